"""The ring's `torch_efficient` block kernel (torch's memory-efficient attention ops): which kernel the ring
picks on a GPU, and the adapter's arguments and layouts.

On CPU the aten ops do not run, so a stand-in takes their place: it binds its arguments by the op's real
schema, checks them against what the CUDA kernels require (and the forward's outputs against torch's meta
kernel), computes the result with explicit math, and answers in the op's layout, per-document padded
log-sum-exp included. The ring's blocks must then equal the `reference` kernel's. The `gpu` test runs the
real ops.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from megalm import compat
from megalm.parallel.context import ring_kernels as ring
from megalm.parallel.context.ring_kernels import block_backward, block_forward, block_kernel
from megalm.parallel.context.zigzag import shard_tensor, zigzag_plan
from tests.unit.ring_sim import simulated_ring

REAL_FORWARD = torch.ops.aten._efficient_attention_forward.default
REAL_BACKWARD = torch.ops.aten._efficient_attention_backward.default
NO_MASK, TOP_LEFT, BOTTOM_RIGHT = 0, 1, 2  # custom_mask_type (torch.nn.attention.bias.CausalVariant: 1, 2)


def _cu(lengths: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _qkv(tq: int, tk: int, hq: int, hkv: int, dim: int = 8, seed: int = 0, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((tq, hq), (tk, hkv), (tk, hkv))
    return [torch.randn(*shape, dim, generator=gen).to(device, dtype) for shape in shapes]


# ------------------------------------------------------------------------------------- kernel selection


@pytest.fixture
def fresh_kernel_log():
    ring._log_kernel.cache_clear()  # logged once per (device, dtype): forget what other tests logged
    yield
    ring._log_kernel.cache_clear()


def _fake_gpu(monkeypatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", None)


def test_block_kernel_runs_memory_efficient_kernels_where_flash_cannot(monkeypatch, caplog, fresh_kernel_log):
    """On CUDA the O(T^2) reference runs only where no kernel returning the log-sum-exp does: fp32 (and fp16
    on a GPU without flash) runs torch's memory-efficient kernels, half precision on sm80+ keeps flash."""
    cuda = torch.device("cuda")
    _fake_gpu(monkeypatch, (9, 0))
    with caplog.at_level(logging.INFO, logger="megalm"):
        assert block_kernel("auto", cuda, torch.float32) == "torch_efficient"
        assert block_kernel("sdpa", cuda, torch.float32) == "torch_efficient"
        # half precision on sm80+: flash (torch < 2.10 has no varlen flash backend: auto is sdpa, the ring efficient)
        flash = ("torch_varlen", "flash_attn") if compat.varlen_attn_available() else ("torch_efficient",)
        assert block_kernel("auto", cuda, torch.bfloat16) in flash
        assert block_kernel("reference", cuda, torch.float16) == "reference"  # asked for: the oracle
    assert ("ring attention block kernel: torch_efficient on cuda float32 (sdpa returns no log-sum-exp; flash "
            "kernels need fp16/bf16 on sm80+)") in caplog.text
    assert caplog.text.count("torch_efficient on cuda float32") == 1  # once per (device, dtype)

    ring._log_kernel.cache_clear()
    caplog.clear()
    _fake_gpu(monkeypatch, (7, 5))  # T4: no flash kernels; memory-efficient ones, but bf16 only from sm80
    with caplog.at_level(logging.INFO, logger="megalm"):
        assert block_kernel("auto", cuda, torch.float16) == "torch_efficient"
        assert block_kernel("auto", cuda, torch.bfloat16) == "reference"
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "reference on cuda bfloat16" in warned[0].getMessage()
    assert "no flash or memory-efficient kernel for bfloat16: O(T^2) memory" in warned[0].getMessage()

    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm: its varlen LSE layout is not the one read here
    assert block_kernel("auto", cuda, torch.float32) == "reference"
    monkeypatch.undo()
    assert block_kernel("auto", torch.device("cpu"), torch.float32) == "reference"


# ------------------------------------------------------------------------ the stand-in for the aten ops


def _bind(op, args: tuple, kwargs: dict) -> dict:
    """The arguments by name, as the dispatcher binds them to `op`'s schema: fails on an unknown or repeated
    name, a missing argument, or a value of the wrong kind."""
    schema = op._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    assert len(args) <= len(positional), f"{len(args)} positional arguments for {schema.name}"
    bound = {a.name: value for a, value in zip(positional, args, strict=False)}
    for name, value in kwargs.items():
        assert name in {a.name for a in schema.arguments}, f"{schema.name} has no argument {name!r}"
        assert name not in bound, f"{name!r} given twice"
        bound[name] = value
    kinds = {"Tensor": torch.Tensor, "int": int, "float": (float, int), "bool": bool}
    for a in schema.arguments:
        if a.name not in bound:
            assert a.has_default_value(), f"{schema.name}: missing {a.name!r}"
            bound[a.name] = a.default_value
        kind, value = str(a.type), bound[a.name]
        if kind.startswith("Optional[") and value is None:
            continue
        kind = kind.removeprefix("Optional[").removesuffix("]")
        assert isinstance(value, kinds[kind]) and (kind == "bool") == isinstance(value, bool), \
            f"{a.name}={value!r} is not a {a.type}"
    return bound


def _check_varlen(b: dict, heads: int) -> list[tuple[int, int, int, int]]:
    """The varlen inputs the CUDA kernels accept; returns each document's (q start, q length, k start, k length)."""
    q, k, v = b["query"], b["key"], b["value"]
    assert q.dim() == k.dim() == v.dim() == 4 and q.shape[0] == k.shape[0] == v.shape[0] == 1, \
        "cu_seqlens only supports batch size 1: [1, T, H, D]"
    assert q.shape[2] == k.shape[2] == v.shape[2] == heads, "the kernels need as many kv heads as query heads"
    assert q.shape[3] == k.shape[3] and k.shape[1] == v.shape[1]
    assert q.dtype == k.dtype == v.dtype and all(t.stride(-1) == 1 for t in (q, k, v)), "last dim contiguous"
    cu_q, cu_k = b["cu_seqlens_q"], b["cu_seqlens_k"]
    for cu, total in ((cu_q, q.shape[1]), (cu_k, k.shape[1])):
        assert cu is not None and cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous()
        assert int(cu[0]) == 0 and int(cu[-1]) == total and bool((cu[1:] >= cu[:-1]).all())
    assert cu_q.shape == cu_k.shape
    assert b["bias"] is None and b["dropout_p"] == 0.0 and b["custom_mask_type"] in (NO_MASK, TOP_LEFT, BOTTOM_RIGHT)
    assert b["window_size"] is None and isinstance(b["scale"], float)
    docs = [(int(cu_q[d]), int(cu_q[d + 1] - cu_q[d]), int(cu_k[d]), int(cu_k[d + 1] - cu_k[d]))
            for d in range(len(cu_q) - 1)]
    assert b["max_seqlen_q"] is not None and max(n for _, n, _, _ in docs) <= b["max_seqlen_q"] <= q.shape[1]
    assert b["max_seqlen_k"] is not None and max(n for _, _, _, n in docs) <= b["max_seqlen_k"] <= k.shape[1]
    return docs


def _doc_probs(b: dict, qs: int, nq: int, ks: int, nk: int, lse: torch.Tensor | None = None):
    """(scores [H, nq, nk] fp64, masked to -inf, per the custom_mask_type; probabilities, normalised by `lse`
    [H, nq] as given (the backward kernel: an lse of -inf on a masked score gives nan), else by their own
    log-sum-exp)."""
    q, k = (b[name][0].double() for name in ("query", "key"))
    scores = torch.einsum("qhd,khd->hqk", q[qs:qs + nq], k[ks:ks + nk]) * b["scale"]
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    allowed = {NO_MASK: j >= 0, TOP_LEFT: j <= i, BOTTOM_RIGHT: j <= i + nk - nq}[b["custom_mask_type"]]
    scores = scores.masked_fill(~allowed, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, -1)
        lse = lse.masked_fill(torch.isneginf(lse), 0)
    return scores, torch.exp(scores - lse.double()[..., None])


class StandIn:
    """torch.ops.aten._efficient_attention_forward / _backward on CPU, in the real ops' layouts."""

    def __init__(self) -> None:
        self.calls = {"forward": 0, "backward": 0}

    def forward(self, *args, **kwargs):
        b = _bind(REAL_FORWARD, args, kwargs)
        self.calls["forward"] += 1
        q, v = b["query"], b["value"]
        heads = q.shape[2]
        docs = _check_varlen(b, heads)
        assert b["compute_log_sumexp"] and b["seqlen_k"] is None
        # output [1, Tq, H, Dv] in q's dtype; lse [documents, H, max_seqlen_q rounded up to 32] fp32, each
        # document's rows from 0, the padding +inf; a row with no key gets lse 0 (torch's kernels write
        # log(1) there) and an output the caller must not read (nan here).
        out = torch.full(q.shape[:3] + v.shape[3:], float("nan"), dtype=torch.float64)
        width = math.ceil(b["max_seqlen_q"] / 32) * 32
        lse = torch.full((len(docs), heads, width), float("inf"), dtype=torch.float64)
        for d, (qs, nq, ks, nk) in enumerate(docs):
            # the real kernel's causal mask fails there (tests/unit/test_ring_kernels.py, GPU tier, 2026-11-28)
            assert b["custom_mask_type"] != BOTTOM_RIGHT or nk >= nq, \
                "bottom-right causal on a document with fewer keys than queries: the kernel does not mask it"
            scores, probs = _doc_probs(b, qs, nq, ks, nk)
            doc_lse = torch.logsumexp(scores, -1)
            has_key = ~torch.isneginf(doc_lse)  # [H, nq]
            doc_out = torch.einsum("hqk,khd->qhd", probs, v[0, ks:ks + nk].double())
            out[0, qs:qs + nq] = torch.where(has_key.T[..., None], doc_out, float("nan"))
            lse[d, :, :nq] = doc_lse.masked_fill(~has_key, 0.0)
        results = (out.to(q.dtype), lse.float(), torch.empty((), dtype=torch.long),
                   torch.empty((), dtype=torch.long), b["max_seqlen_q"], b["max_seqlen_k"])
        meta = REAL_FORWARD(**{name: value.to("meta") if isinstance(value, torch.Tensor) else value
                               for name, value in b.items()})  # torch's own shapes for these arguments
        for got, want in zip(results[:2], meta[:2], strict=True):
            assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
        return results

    def backward(self, *args, **kwargs):
        b = _bind(REAL_BACKWARD, args, kwargs)
        self.calls["backward"] += 1
        q, k, v, out, dout, lse = (b[name] for name in ("query", "key", "value", "out", "grad_out_", "logsumexp"))
        heads = q.shape[2]
        docs = _check_varlen(b, heads)
        assert b["window_size"] is None and b["num_splits_key"] is None and not b["shared_storage_dqdkdv"]
        assert not b["bias_requires_grad"] and b["philox_seed"].dtype == b["philox_offset"].dtype == torch.long
        # the kernel reads out and grad_out as q's dtype, [1, Tq, H, Dv], and lse [documents, H, >= max_seqlen_q]
        # fp32 with rows aligned to 8 floats (the forward's layout)
        assert out.dtype == dout.dtype == q.dtype and out.shape == dout.shape == q.shape[:3] + v.shape[3:]
        assert lse.dtype == torch.float32 and lse.shape[:2] == (len(docs), heads)
        assert lse.shape[2] >= b["max_seqlen_q"] and lse.stride(2) == 1
        assert lse.stride(1) % 8 == 0 and lse.stride(0) % 8 == 0, "LSE is not correctly aligned"
        # what the kernel never writes (dq of a document without keys, dk/dv of one without queries) stays as
        # allocated: garbage on the GPU, nan here
        dq, dk, dv = (torch.full(t.shape, float("nan"), dtype=torch.float64) for t in (q, k, v))
        for d, (qs, nq, ks, nk) in enumerate(docs):
            _, probs = _doc_probs(b, qs, nq, ks, nk, lse[d, :, :nq])
            do, o = dout[0, qs:qs + nq].double(), out[0, qs:qs + nq].double()
            delta = (do * o).sum(-1).T  # [H, nq]
            dp = torch.einsum("qhd,khd->hqk", do, v[0, ks:ks + nk].double())
            ds = probs * (dp - delta[..., None])
            if nk:
                dq[0, qs:qs + nq] = torch.einsum("hqk,khd->qhd", ds, k[0, ks:ks + nk].double()) * b["scale"]
            if nq:
                dk[0, ks:ks + nk] = torch.einsum("hqk,qhd->khd", ds, q[0, qs:qs + nq].double()) * b["scale"]
                dv[0, ks:ks + nk] = torch.einsum("hqk,qhd->khd", probs, do)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), torch.empty(())


@pytest.fixture
def stand_in(monkeypatch) -> StandIn:
    fake = StandIn()
    monkeypatch.setattr(ring, "EFFICIENT_FORWARD", fake.forward)
    monkeypatch.setattr(ring, "EFFICIENT_BACKWARD", fake.backward)
    return fake


def test_the_stand_in_refuses_what_the_kernels_refuse(stand_in) -> None:
    """The stand-in is strict where the real ops are: equal heads, names and kinds from the schema."""
    q, k, v = (t.unsqueeze(0) for t in _qkv(6, 6, 4, 2))
    cu = _cu([6])
    args = {"bias": None, "cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 6, "max_seqlen_k": 6,
            "dropout_p": 0.0, "custom_mask_type": 2, "compute_log_sumexp": True, "scale": 0.5}
    with pytest.raises(AssertionError, match="as many kv heads"):
        stand_in.forward(query=q, key=k, value=v, **args)
    with pytest.raises(AssertionError, match="no argument 'is_causal'"):
        stand_in.forward(query=q, key=q, value=q, is_causal=True, **args)
    with pytest.raises(AssertionError, match="custom_mask_type=True is not a int"):
        stand_in.forward(query=q, key=q, value=q, **(args | {"custom_mask_type": True}))
    out, lse, *_ = stand_in.forward(query=q, key=q, value=q, **args)
    assert out.shape == q.shape and lse.shape == (1, 4, 32)


# ---------------------------------------------------------------------- the adapter against the reference


BLOCKS = {  # (query lengths, key lengths, causal) per document, as the zigzag steps produce them
    "causal, several documents": ([5, 1, 9, 3], [5, 1, 9, 3], True),
    "causal, a document past 32 rows": ([40, 7], [40, 7], True),
    "full, Tq > Tk (front chunks)": ([8, 2, 6], [4, 1, 3], False),
    "full, Tq < Tk (back queries)": ([4, 1, 3], [8, 2, 6], False),
    "full, a document without keys": ([3, 4, 2], [0, 5, 2], False),
    "full, a document without queries": ([0, 5, 2], [3, 4, 2], False),
}


def _block(name: str, hq: int, hkv: int, device="cpu", dtype=torch.float32, seed: int = 0):
    lengths_q, lengths_k, causal = BLOCKS[name]
    q, k, v = _qkv(sum(lengths_q), sum(lengths_k), hq, hkv, seed=seed, device=device, dtype=dtype)
    cu_q, cu_k = _cu(lengths_q, device), _cu(lengths_k, device)
    return q, k, v, (cu_q, cu_k, max(lengths_q), max(lengths_k), causal, q.shape[-1] ** -0.5)


def _forward_backward(q, k, v, block, kernel: str, seed: int = 1):
    out, lse = block_forward(q, k, v, *block, kernel=kernel)
    gen = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=gen).to(q.device, q.dtype)
    grads = block_backward(dout, q, k, v, out, lse, *block, kernel=kernel)
    return out, lse, grads


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_torch_efficient_block_equals_reference(stand_in, name: str, hq: int, hkv: int) -> None:
    """Forward (out, lse [Tq, H] fp32) and backward through the adapter = the reference kernel, GQA included."""
    q, k, v, block = _block(name, hq, hkv)
    got = _forward_backward(q, k, v, block, "torch_efficient")
    want = _forward_backward(q, k, v, block, "reference")
    assert stand_in.calls == {"forward": 1, "backward": 1}
    assert got[0].dtype == got[1].dtype == torch.float32 and got[1].shape == (q.shape[0], hq)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)  # -inf where a row has no key
    for g, w in zip(got[2], want[2], strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g.float(), w, atol=1e-5, rtol=1e-5)


def _check_bottom_right(device="cpu", dtype=torch.float32, tol: float = 1e-5) -> None:
    """torch_efficient causal on documents with more keys than queries: the queries are the last n_q rows of a
    square document (row i sees keys j <= i + n_k - n_q, bottom-right as in the flash kernels), checked against the
    reference on the square documents at those rows. Fewer keys than queries is not asked of the kernel: its mask
    fails there (`_efficient_rows`)."""
    lengths_q, lengths_k, hq, hkv = [3, 4, 1], [5, 4, 2], 4, 2
    square_q, k, v = _qkv(sum(lengths_k), sum(lengths_k), hq, hkv, device=device, dtype=dtype)
    rows = torch.cat([torch.arange(start + nk - nq, start + nk) for start, nq, nk in
                      zip(_cu(lengths_k)[:-1].tolist(), lengths_q, lengths_k, strict=True)]).to(device)
    q = square_q[rows]
    block = (_cu(lengths_q, device), _cu(lengths_k, device), max(lengths_q), max(lengths_k), True, 0.5)
    out, lse, (dq, dk, dv) = _forward_backward(q, k, v, block, "torch_efficient")
    square = (_cu(lengths_k, device), _cu(lengths_k, device), max(lengths_k), max(lengths_k), True, 0.5)
    q32, k32, v32 = square_q.float(), k.float(), v.float()
    want_out, want_lse = block_forward(q32, k32, v32, *square)
    torch.testing.assert_close(out, want_out[rows], atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse[rows], atol=tol, rtol=tol)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)  # as drawn there
    square_dout = torch.zeros_like(want_out).index_copy_(0, rows, dout.float())  # the other rows: no gradient
    want = block_backward(square_dout, q32, k32, v32, want_out, want_lse, *square)
    torch.testing.assert_close(dq.float(), want[0][rows], atol=2 * tol, rtol=2 * tol)
    torch.testing.assert_close(dk.float(), want[1], atol=2 * tol, rtol=2 * tol)
    torch.testing.assert_close(dv.float(), want[2], atol=2 * tol, rtol=2 * tol)


def test_torch_efficient_causal_is_bottom_right_aligned_like_flash(stand_in) -> None:
    """Causal on a document with more keys than queries reads as in the flash kernels (torch_varlen): the last
    query sees every key. The ring asks causal only of square documents, where this is the reference's top-left
    mask."""
    _check_bottom_right()


def test_the_stand_in_refuses_fewer_keys_than_queries_under_a_causal_mask(stand_in) -> None:
    """What the first GPU run found: torch's kernel lets such rows see keys past the diagonal. The stand-in
    refuses the case instead of computing what the kernel does not."""
    lengths_q, lengths_k = [5, 4], [3, 4]
    q, k, v = _qkv(sum(lengths_q), sum(lengths_k), 4, 2)
    with pytest.raises(AssertionError, match="fewer keys than queries"):
        block_forward(q, k, v, _cu(lengths_q), _cu(lengths_k), 5, 4, True, 0.5, kernel="torch_efficient")


def test_simulated_ring_with_torch_efficient_equals_reference(stand_in) -> None:
    """The zigzag ring's blocks (causal s == r, front chunks s < r, back queries s > r) and their merge."""
    cu, n = _cu([13, 3, 20, 1]), 3
    plan = zigzag_plan(cu, n)
    q, k, v = _qkv(int(cu[-1]), int(cu[-1]), 4, 2)
    shards = [[shard_tensor(t, plan, i) for t in (q, k, v)] for i in range(n)]
    scale = q.shape[-1] ** -0.5
    got = simulated_ring(shards, plan.layout, scale, "torch_efficient")
    want = simulated_ring(shards, plan.layout, scale, "reference")
    assert stand_in.calls == {"forward": n * n, "backward": n * n}
    for g, w in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    for rank_got, rank_want in zip(got[1], want[1], strict=True):
        for g, w in zip(rank_got, rank_want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------- real GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2)])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_torch_efficient_on_gpu_equals_reference(name: str, hq: int, hkv: int, dtype: torch.dtype,
                                                 tol: float) -> None:
    """The real aten ops through the adapter against the fp32 reference on the same (rounded) inputs."""
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 memory-efficient kernels need sm80+")
    assert block_kernel("auto", torch.device("cuda"), torch.float32) == "torch_efficient"
    q, k, v, block = _block(name, hq, hkv, device="cuda", dtype=dtype)
    got = _forward_backward(q, k, v, block, "torch_efficient")
    want = _forward_backward(q.float(), k.float(), v.float(), block, "reference")
    assert got[0].dtype == got[1].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], atol=tol, rtol=tol)
    torch.testing.assert_close(got[1], want[1], atol=tol, rtol=tol)
    for g, w in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(g.float(), w, atol=2 * tol, rtol=2 * tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_efficient_on_gpu_is_bottom_right_aligned() -> None:
    """The real kernels with custom_mask_type 2 on documents with more keys than queries."""
    _check_bottom_right("cuda", torch.float32, 2e-4)
