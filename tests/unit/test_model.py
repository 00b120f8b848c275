"""Unit tests of megalm.model: attention backends against an fp32 oracle, packing, causality, init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megalm import compat
from megalm.config import ModelConfig
from megalm.data.batch import packed_from_documents
from megalm.errors import ConfigError
from megalm.model import GPT, init_weights, num_parameters, select_attention_backend, varlen_attention
from megalm.model.fused import part_rows
from megalm.model.norm import LayerNorm, RMSNorm
from megalm.model.rope import apply_rope, rope_cos_sin
from megalm.model.shard import ShardSpec

GPT2_STYLE = dict(norm="layernorm", activation="gelu", position_embedding="learned", tie_embeddings=True,
                  bias=True)


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                  vocab_size=64, seq_length=32, attention_backend="sdpa")
    fields.update(overrides)
    return ModelConfig(**fields)


def build(cfg: ModelConfig, seed: int = 0, perturb: bool = True) -> GPT:
    """An initialized model in eval mode; `perturb` makes norm weights and biases non-trivial too."""
    model = GPT(cfg)
    init_weights(model, seed)
    if perturb:
        gen = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def pack(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    lengths = [len(d) for d in docs]
    cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return torch.cat(docs), positions, cu, max(lengths)


def random_docs(lengths: list[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def random_qkv(total: int, hq: int, hkv: int, dim: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(total, h, dim, generator=gen, dtype=dtype).requires_grad_() for h in (hq, hkv, hkv)]


def cu_from(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu


# ---------------------------------------------------------------- attention


def test_reference_matches_naive_loop():
    lengths, hq, hkv, dim = [3, 1, 4], 4, 2, 8
    q, k, v = random_qkv(sum(lengths), hq, hkv, dim, dtype=torch.float64)
    out = varlen_attention(q, k, v, cu_from(lengths), max(lengths), "reference").double()
    expected = torch.zeros_like(out)
    start = 0
    for n in lengths:
        for t in range(start, start + n):
            for h in range(hq):
                kv = h // (hq // hkv)
                keys, values = k[start:t + 1, kv], v[start:t + 1, kv]
                weights = torch.softmax(keys @ q[t, h] / math.sqrt(dim), dim=0)
                expected[t, h] = weights @ values
        start += n
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("lengths", [[6, 6, 6], [5, 1, 9, 3]], ids=["equal", "ragged"])
def test_sdpa_matches_reference(lengths, heads, monkeypatch):
    hq, hkv = heads
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    cu, total = cu_from(lengths), sum(lengths)
    grad_out = torch.randn(total, hq, 8, generator=torch.Generator().manual_seed(5))
    results = {}
    for backend in ("sdpa", "reference"):
        q, k, v = random_qkv(total, hq, hkv, 8)
        out = varlen_attention(q, k, v, cu, max(lengths), backend)
        results[backend] = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    # equal lengths: one batched SDPA call; ragged: one call per document
    assert len(calls) == (1 if len(set(lengths)) == 1 else len(lengths))
    for got, want, name in zip(results["sdpa"], results["reference"], ("out", "dq", "dk", "dv"), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)


def test_select_backend_on_cpu():
    cpu = torch.device("cpu")
    assert select_attention_backend("auto", cpu, torch.float32) == "sdpa"
    assert select_attention_backend("auto", cpu, torch.bfloat16) == "sdpa"
    assert select_attention_backend("sdpa", cpu, torch.float32) == "sdpa"
    assert select_attention_backend("reference", cpu, torch.float32) == "reference"
    if not torch.cuda.is_available():
        assert select_attention_backend("auto", torch.device("cuda"), torch.bfloat16) == "sdpa"
    for backend in ("flash_attn", "torch_varlen", "cudnn"):
        with pytest.raises(ConfigError, match=f"attention_backend={backend}.*attention_backend=auto"):
            select_attention_backend(backend, cpu, torch.bfloat16)
    with pytest.raises(ConfigError):
        select_attention_backend("bogus", cpu, torch.float32)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_cudnn_backend_runs_equal_documents_in_one_sdpa_call(heads, monkeypatch):
    """Backend cudnn: documents of one length are one batched SDPA call (where torch picks cuDNN's kernel on a GPU; on
    a CPU its own: the values are the reference's); documents of unequal lengths go to torch's varlen kernel, never
    SDPA; dropout is refused on both routes (the varlen kernel has none)."""
    hq, hkv = heads
    sdpa_calls, varlen_calls = [], []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: sdpa_calls.append(a[0].shape) or
                        sdpa(*a, **kw))
    monkeypatch.setattr(compat, "varlen_attn", lambda q, k, v, cu, max_len, scale=None, window=None:
                        varlen_calls.append((cu.dtype, max_len)) or q.clone())
    cu = cu_from([6, 6, 6])
    q, k, v = random_qkv(18, hq, hkv, 8)
    out = varlen_attention(q, k, v, cu, 6, "cudnn")
    assert sdpa_calls == [(3, hq, 6, 8)] and not varlen_calls
    torch.testing.assert_close(out, varlen_attention(q, k, v, cu, 6, "reference"), atol=1e-5, rtol=1e-5)

    sdpa_calls.clear()
    varlen_attention(q, k, v, cu_from([5, 1, 12]), 12, "cudnn")
    assert varlen_calls == [(torch.int32, 12)] and not sdpa_calls
    for lengths in ([6, 6, 6], [5, 1, 12]):
        with pytest.raises(ValueError, match="cudnn attention backend has no dropout"):
            varlen_attention(q, k, v, cu_from(lengths), max(lengths), "cudnn", dropout_p=0.1)


def test_cudnn_backend_compiles_without_a_graph_break():
    """A compiled block's equal documents keep one graph through the cudnn backend's batched call."""
    from torch._dynamo.utils import counters

    cu = cu_from([8, 8])
    q, k, v = random_qkv(16, 4, 2, 8)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda q, k, v: varlen_attention(q, k, v, cu, 8, "cudnn"), backend="eager")
    torch.testing.assert_close(compiled(q, k, v), varlen_attention(q, k, v, cu, 8, "reference"), atol=1e-5,
                               rtol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


def test_auto_runs_cudnn_on_hopper_only_and_says_which_kernel(monkeypatch, caplog):
    """auto picks cudnn on sm90 (where cuDNN's attention is reported faster than flash), and flash-attn or
    torch_varlen on other sm80+ GPUs, and on Hopper without cuDNN's SDPA (switched off by the user), where an
    explicit cudnn is refused.
    The kernel equal documents run is logged once per shape, as a warning when it is not cuDNN's."""
    import logging

    from megalm.model import attention

    if not compat.varlen_attn_available():
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen: auto runs sdpa on a GPU")
    cuda = torch.device("cuda")
    flash = attention._flash_attn_importable()  # the package, where installed: auto's pick off Hopper
    with compat.simulated_cuda((9, 0)):
        assert select_attention_backend("auto", cuda, torch.bfloat16) == "cudnn"
        # the benchmarks that time one kernel for every document (HDP calibration, context parallelism)
        assert attention.one_kernel_backend("auto", cuda, torch.bfloat16) == "torch_varlen"
        assert attention.one_kernel_backend("cudnn", cuda, torch.bfloat16) == "cudnn"  # asked for: kept
        # where auto would not run cudnn (fp32, attention dropout) it stays auto, free to pick what runs there
        assert attention.one_kernel_backend("auto", cuda, torch.float32) == "auto"
        assert attention.one_kernel_backend("auto", cuda, torch.bfloat16, dropout=True) == "auto"
        with_dropout = select_attention_backend("auto", cuda, torch.bfloat16, dropout=True)
        assert with_dropout == ("flash_attn" if flash else "sdpa")
        monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
        assert select_attention_backend("auto", cuda, torch.bfloat16) == ("flash_attn" if flash else "torch_varlen")
        with pytest.raises(ConfigError, match="enable_cudnn_sdp.*attention_backend=auto"):
            select_attention_backend("cudnn", cuda, torch.bfloat16)
    with compat.simulated_cuda((8, 0)):
        assert attention.one_kernel_backend("auto", cuda, torch.bfloat16) == "auto"
        assert select_attention_backend("auto", cuda, torch.bfloat16) == ("flash_attn" if flash else "torch_varlen")

    attention._log_equal_documents_kernel.cache_clear()
    with caplog.at_level(logging.INFO, logger="megalm"):
        assert attention._log_equal_documents_kernel(cuda, torch.bfloat16, 16, 4, 128).startswith("not probed")
        monkeypatch.setattr(attention, "_equal_documents_kernel", lambda *shape: "flash")
        attention._log_equal_documents_kernel(cuda, torch.bfloat16, 16, 4, 256)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["attention backend cudnn: documents of equal lengths run torch SDPA's flash kernel (16 query "
                        "heads, 4 kv heads, head_dim 256, bfloat16: not cuDNN's, torch did not choose it here); "
                        "unequal ones torch_varlen"]
    attention._log_equal_documents_kernel.cache_clear()


def test_model_with_unrunnable_backend_raises():
    model = GPT(tiny_config(attention_backend="flash_attn"))
    tokens, positions, cu, max_len = pack(random_docs([5], 64))
    with pytest.raises(ConfigError, match="flash_attn"):
        model(tokens, positions, cu, max_len)


# ---------------------------------------------------------------- rope and norms


def bytes_kept_for_backward(fn, x: torch.Tensor) -> int:  # noqa: ANN001 - any callable
    """The bytes of the distinct storages autograd saves for the backward of fn(x), caught by saved-tensor hooks."""
    from megalm.measure.storage import storage_bytes

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(x)
    return storage_bytes(saved)


def test_rope_matches_complex_rotation():
    dim, theta = 8, 10000.0
    x = torch.randn(5, 3, dim, dtype=torch.float64)
    positions = torch.tensor([0, 1, 2, 0, 7])
    cos, sin = rope_cos_sin(positions, dim, theta)
    got = apply_rope(x, cos, sin)
    # Rotate-half pairs (x[i], x[i + D/2]) as one complex number, rotated by exp(i * p * theta^(-2i/D)).
    z = torch.complex(x[..., : dim // 2], x[..., dim // 2:])
    freqs = torch.tensor([theta ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)
    z = z * torch.polar(torch.ones_like(freqs), positions[:, None, None].double() * freqs)
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], dim=-1), atol=1e-6, rtol=1e-6)
    # positions restart per document: identical rows for identical positions
    torch.testing.assert_close(cos[0], cos[3])


def test_rope_gradient_is_autograds_in_three_passes_each_way_keeping_only_the_tables():
    """apply_rope's written-out backward against autograd through the composed rotation (fp64: to rounding; bf16:
    one rounding, since addcmul rounds once where the composition rounded twice), eager and compiled (torch 2.11's
    AOT autograd once mis-traced its backward: megalm.model.rope._as); each direction runs three
    kernels over [T, H, D] (roll, multiply, addcmul: the composition ran four), counted by a dispatch mode; and it
    keeps for the backward nothing but the two tables (saved-tensor hooks)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    def composed(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, s = cos[:, None, :], sin[:, None, :]
        return (x * c + x.roll(x.shape[-1] // 2, dims=-1) * s).to(x.dtype)

    class WholeSizedOps(TorchDispatchMode):
        def __init__(self, numel: int) -> None:
            super().__init__()
            self.numel, self.ops = numel, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
            out = func(*args, **(kwargs or {}))
            if not func.is_view and isinstance(out, torch.Tensor) and out.numel() == self.numel:
                self.ops.append(func._overloadpacket.__name__)
            return out

    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 9])
    for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 2.0**-7)):
        cos, sin = (t.to(dtype) for t in rope_cos_sin(positions, 16, 10000.0))
        x = torch.randn(7, 3, 16, dtype=dtype, requires_grad=True)
        dy = torch.randn(7, 3, 16, dtype=dtype)
        compiled = torch.compile(lambda t, c=cos, s=sin: apply_rope(t * 1.0, c, s), backend="aot_eager", fullgraph=True)
        got, want, traced = apply_rope(x, cos, sin), composed(x, cos, sin), compiled(x)
        (got_grad,), (want_grad,) = torch.autograd.grad(got, x, dy), torch.autograd.grad(want, x, dy)
        (traced_grad,) = torch.autograd.grad(traced, x, dy)
        for g, w in ((got, want), (got_grad, want_grad), (traced, want), (traced_grad, want_grad)):
            torch.testing.assert_close(g, w, atol=tol, rtol=tol)
    counts = {}
    for name, fn in (("apply_rope", apply_rope), ("composed", composed)):
        forward, backward = WholeSizedOps(x.numel()), WholeSizedOps(x.numel())
        with forward:
            y = fn(x, cos, sin)
        with backward:
            torch.autograd.grad(y, x, dy)
        counts[name] = (len(forward.ops), len(backward.ops))
    assert counts == {"apply_rope": (3, 3), "composed": (4, 4)}, counts
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        apply_rope(x * 1.0, cos, sin)
    assert saved == [cos.numel(), sin.numel()], saved


def test_norms_match_formulas():
    x = torch.randn(6, 16)
    rms = RMSNorm(16, eps=1e-5)
    ln = LayerNorm(16, eps=1e-5, bias=True)
    with torch.no_grad():
        for p in (rms.weight, ln.weight, ln.bias):
            p.copy_(torch.randn(16))
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * rms.weight
    torch.testing.assert_close(rms(x), expected)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(ln(x), (x - mean) / torch.sqrt(var + 1e-5) * ln.weight + ln.bias)
    assert rms(x.bfloat16()).dtype == torch.bfloat16


def test_rms_norm_gradients_are_autograds_and_it_saves_what_cuda_saves():
    """The hand-written backward against autograd through F.rms_norm (fp64: to rounding; bf16: within one rounding,
    2^-7 relative: the two round in different orders, and about one draw in 60 differs in one element by one ulp),
    and what the norm keeps for backward, counted by saved-tensor hooks: the bf16 input, the weight and a per-token
    fp32 rstd, not F.rms_norm's two fp32 [T, h] copies on CPU."""
    import torch.nn.functional as F

    torch.manual_seed(5)  # reproducible draws
    for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 2.0**-7)):
        norm = RMSNorm(32).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(32) + 0.5)
        x = torch.randn(2, 7, 32, dtype=dtype, requires_grad=True)
        dy = torch.randn(2, 7, 32, dtype=dtype)
        got = torch.autograd.grad(norm(x), (x, norm.weight), dy)
        want = torch.autograd.grad(F.rms_norm(x, (32,), norm.weight, norm.eps), (x, norm.weight), dy)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=0.0 if dtype == torch.bfloat16 else tol, rtol=tol)
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    assert bytes_kept_for_backward(RMSNorm(128).to(torch.bfloat16), x) == 64 * 128 * 2 + 128 * 2 + 64 * 4


def test_swiglu_is_autograds_bit_for_bit_and_keeps_its_input_alone():
    """megalm.model.mlp.swiglu against silu(gate) * up through autograd: the same values and gradients bit for bit
    in eager (fp32 and bf16), and compiled, where its backward takes the cat route, within one rounding (torch 2.9's
    AOT autograd decomposes silu's backward: one ulp off in fp32); and what it keeps for backward, counted by
    saved-tensor hooks by storage: [gate, up] alone, where autograd's composition also keeps silu(gate)."""
    from megalm.model.mlp import swiglu

    def reference(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    torch.manual_seed(0)
    compiled = torch.compile(lambda t: swiglu(t * 1.0), backend="aot_eager", fullgraph=True)
    for dtype, rounding in ((torch.float32, 2.0**-23), (torch.bfloat16, 2.0**-7)):
        x = torch.randn(2, 9, 2 * 24, dtype=dtype, requires_grad=True)
        dy = torch.randn(2, 9, 24, dtype=dtype)
        want = reference(x)
        (want_grad,) = torch.autograd.grad(want, x, dy)
        for fn, tol in ((swiglu, 0.0), (compiled, rounding)):
            got = fn(x)
            (got_grad,) = torch.autograd.grad(got, x, dy)
            torch.testing.assert_close(got, want, atol=0.0, rtol=0.0)
            torch.testing.assert_close(got_grad, want_grad, atol=tol * want_grad.abs().max().item(), rtol=tol)

    x = torch.randn(64, 2 * 48, dtype=torch.bfloat16, requires_grad=True)
    # a non-leaf input, as a GEMM's output is
    assert bytes_kept_for_backward(lambda t: swiglu(t * 1.0), x) == 64 * 2 * 48 * 2
    assert bytes_kept_for_backward(lambda t: reference(t * 1.0), x) == 64 * 2 * 48 * 2 + 64 * 48 * 2


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_attention_keeps_one_copy_of_v_for_its_backward(positions):
    """Attention saves v for its backward: with RoPE (q and k rotated into new tensors) a copy of v, so that no view
    keeps the [T, q + 2 kv] projection alive; with learned positions q and k are saved as views of that output, which
    lives on anyway, and a copy of v was T·kv·head_dim more in every layer (an audit, GPT-2-style runs)."""
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=100, seq_length=32,
                      attention_backend="sdpa", position_embedding=positions)
    model = GPT(cfg)
    init_weights(model, 0)
    T = 32
    attention = model.layers[0].attention
    x = torch.randn(T, cfg.hidden_size, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    rope = model.rotary(torch.arange(T), torch.float32) if positions == "rope" else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(x, torch.tensor([0, T], dtype=torch.int32), T, rope)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    sizes = sorted(n for ptr, n in saved.items() if ptr not in weights)
    head_dim = cfg.hidden_size // cfg.num_heads
    qkv, v = T * (4 + 2 * 2) * head_dim * 4, T * 2 * head_dim * 4
    assert (qkv in sizes) == (positions == "learned")  # the projection's output, kept by views of q and k
    assert (v in sizes) == (positions == "rope")  # v's own copy


def test_causal():
    model = build(tiny_config())
    tokens, positions, cu, max_len = pack(random_docs([12], 64))
    changed = tokens.clone()
    changed[7] = (changed[7] + 1) % 64
    with torch.no_grad():
        a, b = model(tokens, positions, cu, max_len), model(changed, positions, cu, max_len)
    torch.testing.assert_close(a[:7], b[:7], atol=0, rtol=0)
    assert not torch.allclose(a[7:], b[7:])


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_packed_equals_separate(style, backend):
    cfg = tiny_config(attention_backend=backend, **(GPT2_STYLE if style == "gpt2" else {}))
    model = build(cfg)
    docs = random_docs([7, 3, 11, 1], cfg.vocab_size)
    with torch.no_grad():
        packed = model(*pack(docs))
        separate = torch.cat([model(*pack([doc])) for doc in docs])
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-5)
    # The model does read positions (so the equality above checks that they restart per document).
    tokens, positions, cu, max_len = pack(docs)
    with torch.no_grad():
        unpositioned = model(tokens, torch.zeros_like(positions), cu, max_len)
    assert not torch.allclose(unpositioned[7:], packed[7:], atol=1e-4)


@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_model_sdpa_matches_reference(num_kv_heads):
    docs = random_docs([5, 9, 2], 64)
    results = []
    for backend in ("sdpa", "reference"):
        model = build(tiny_config(num_kv_heads=num_kv_heads, attention_backend=backend))
        logits = model(*pack(docs))
        logits.pow(2).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((logits.detach(), grads))
    assert model.layers[0].attention.qkv_proj.weight.shape == (32 + 2 * num_kv_heads * 8, 32)
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_forward_batch():
    model = build(tiny_config())
    docs = random_docs([6, 4], 64)
    batch = packed_from_documents(docs)  # inputs are each document but its last token
    with torch.no_grad():
        expected = torch.cat([model(*pack([d[:-1]])) for d in docs])
        torch.testing.assert_close(model.forward_batch(batch), expected, atol=1e-5, rtol=1e-5)


def test_parameter_names_llama():
    cfg = tiny_config()
    model = GPT(cfg)
    per_layer = ["attention_norm.weight", "attention.qkv_proj.weight", "attention.o_proj.weight",
                 "mlp_norm.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight"]
    expected = {"embedding.weight", "final_norm.weight", "output.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in per_layer}
    assert set(model.state_dict()) == expected
    # vocab 64 is padded to a multiple of make_vocab_size_divisible_by (128 by default): 128 rows
    h, hq, hkv, f, V, L = 32, 32, 16, 48, 128, 2
    assert model.cfg.padded_vocab_size == V and cfg.vocab_size == 64
    per_block = 2 * h + h * hq + 2 * h * hkv + hq * h + 3 * h * f
    assert num_parameters(model) == V * h + L * per_block + h + h * V
    assert num_parameters(model, exclude_embeddings=True) == L * per_block + h + h * V


def test_gpt2_variant_and_tied_embeddings():
    cfg = tiny_config(num_kv_heads=None, **GPT2_STYLE)
    model = build(cfg)
    names = set(model.state_dict())
    assert "output.weight" not in names and model.output is None
    assert model.position_embedding.weight.shape == (cfg.seq_length, cfg.hidden_size)
    for i in range(cfg.num_layers):
        for proj in ("qkv_proj", "o_proj"):
            assert f"layers.{i}.attention.{proj}.bias" in names
        for proj in ("up_proj", "down_proj"):
            assert f"layers.{i}.mlp.{proj}.bias" in names
        assert f"layers.{i}.attention_norm.bias" in names
        assert f"layers.{i}.mlp.gate_up_proj.weight" not in names
    # The head reads the embedding table: zeroing a row zeroes that token's logit, and the
    # table gets gradient from the head even for tokens absent from the input.
    tokens, positions, cu, max_len = pack([torch.tensor([1, 2, 3, 4])])
    with torch.no_grad():
        model.embedding.weight[9].zero_()
    logits = model(tokens, positions, cu, max_len)
    assert torch.all(logits[:, 9] == 0) and torch.all(logits[:, 10] != 0)
    logits.sum().backward()
    assert model.embedding.weight.grad[10].abs().sum() > 0


def test_init_is_deterministic_and_seed_dependent():
    cfg = tiny_config(**GPT2_STYLE)
    torch.manual_seed(1)
    a = GPT(cfg)
    init_weights(a, seed=7)
    torch.manual_seed(2)  # a different global RNG state while building must not matter
    b = GPT(cfg)
    init_weights(b, seed=7)
    c = GPT(cfg)
    init_weights(c, seed=8)
    for name, value in a.state_dict().items():
        torch.testing.assert_close(value, b.state_dict()[name], atol=0, rtol=0, msg=name)
        if name.endswith("weight") and "norm" not in name:
            assert not torch.equal(value, c.state_dict()[name]), name
    # parameters of the same shape get different values (each has its own generator)
    q0, q1 = a.layers[0].attention.qkv_proj.weight, a.layers[1].attention.qkv_proj.weight
    assert not torch.equal(q0, q1)
    q, k, v = q0.split(part_rows("attention.qkv_proj", a.cfg))  # and the parts of a fused projection
    assert not torch.equal(q, k) and not torch.equal(k, v)


def test_init_on_meta_equals_init_on_cpu():
    cfg = tiny_config()
    cpu = GPT(cfg, device="cpu")
    init_weights(cpu, seed=3)
    meta = GPT(cfg, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    with pytest.raises(RuntimeError, match="to_empty"):
        init_weights(meta, seed=3)
    meta.to_empty(device="cpu")
    init_weights(meta, seed=3)
    for name, value in cpu.state_dict().items():
        torch.testing.assert_close(meta.state_dict()[name], value, atol=0, rtol=0, msg=name)


def test_init_independent_of_which_layers_exist():
    cfg = tiny_config(num_layers=3)
    full = GPT(cfg)
    init_weights(full, seed=5)
    stage = GPT(cfg)
    stage.layers = nn.ModuleList(list(stage.layers)[1:])  # a pipeline stage holding layers 1 and 2
    init_weights(stage, seed=5)
    for local, global_ in ((0, 1), (1, 2)):
        for name, value in stage.layers[local].state_dict().items():
            torch.testing.assert_close(value, full.layers[global_].state_dict()[name], atol=0, rtol=0)
    # a sharded parameter (first half of o_proj's rows) gets the matching slice of the full init
    shard = nn.Linear(32, 16, bias=False)
    shard.shard_specs = {"weight": ShardSpec(full_shape=(32, 32), dim=0, num_slices=2, index=0)}
    stage.layers[0].attention.o_proj = shard
    init_weights(stage, seed=5)
    torch.testing.assert_close(shard.weight, full.layers[1].attention.o_proj.weight[:16], atol=0, rtol=0)


def test_init_distribution():
    cfg = tiny_config(hidden_size=64, ffn_hidden_size=256, num_layers=2, vocab_size=256, init_std=0.02,
                      **GPT2_STYLE)
    model = GPT(cfg)
    init_weights(model, seed=0)
    residual_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
        elif "norm" in name:
            assert torch.all(p == 1), name
        else:
            want = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            assert abs(p.std().item() / want - 1) < 0.1, (name, p.std().item(), want)
            assert abs(p.mean().item()) < 0.1 * want, name
