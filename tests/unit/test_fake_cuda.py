"""The fake-CUDA tier: megalm's CUDA forward paths, run on a machine without a GPU.

Under torch's FakeTensorMode a tensor has a shape, a dtype and a device but no data; with a torch built with
CUDA (the PyPI wheels) fake tensors can claim to live on `cuda:0`, and every op checks what it would check on a
GPU (its fake or meta kernel): signatures and keywords, shapes, dtypes, devices, the layout and alignment rules of
torch._scaled_mm. `megalm.compat.simulated_cuda` makes megalm's kernel selection see a GPU (sm89 or sm90), while
`torch.cuda.is_available()` stays False (fake tensors reach for the driver when it says True). So an API that
differs on the GPU image's torch, or a CUDA-only call with a wrong signature, fails here, on CPU CI, instead of in
the first minute of a GPU session. `pytest -k fake_cuda` selects this tier; `.ci/run` runs it on every torch leg.

What it cannot reach, and where that is tested instead:
- values: nothing is computed. The GPU tier (tests/gpu, tools/gpu_check.sh) compares results.
- backward through autograd: the engine asks the fake device for a CUDA context. Backward kernels that megalm
  calls directly are called directly here (the ring's block backward, the dgrad/wgrad GEMMs of the recipes).
- Triton launches and inductor (both need a driver): the MX quantizer is a custom op with a fake implementation
  (megalm::mx_quantize), and fp8.quantize runs its eager twin on fake tensors. Dynamo's tracing needs none: compiled
  blocks are traced here (graph breaks, recompiles, torch's varlen kernel in the graph) with a recording backend.
- CUDA streams, events and pinned host memory (activation offload's copies), and NCCL: tests/gpu; the offload
  logic itself runs on CPU in tests/unit/test_offload.py.
- sdpa over documents of unequal lengths reads cu_seqlens on the host (one call per document): it needs values.
- rings of more than one rank need a process group: tests/dist runs them on gloo; here a one-rank ring runs the
  micro-batch path that HDP and context parallelism attach (RingContext, the zigzag layout on the device).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator

import pytest
import torch

from megalm import compat
from megalm.config import ModelConfig, MoEConfig, PrecisionConfig
from megalm.model import attention
from megalm.model.gpt import GPT
from megalm.parallel.context import ring_kernels as ring
from megalm.parallel.context.attention import RingContext
from megalm.parallel.context.zigzag import layout_from_local_cu_seqlens
from megalm.precision import Precision, fp8, linear
from megalm.precision.kernels import mx_triton
from megalm.precision.linear import RecipeGemms
from megalm.precision.mx import mx_quantize
from megalm.precision.recipes import get_recipe
from tests.conftest import packed_layouts

needs_cuda_build = pytest.mark.skipif(
    torch.version.cuda is None,
    reason=f"fake CUDA tensors need a torch built with CUDA (the PyPI wheels); torch {torch.__version__} is CPU-only")
CUDA = torch.device("cuda", 0)
SM90 = (9, 0)
# The tier's default device: an sm89 GPU (L40S) has FP8 GEMMs and flash kernels, and attention `auto` runs
# torch_varlen on it; sm90 (auto: cudnn) where a test asks for it.
SM89 = (8, 9)


def _clear_selection_caches() -> None:
    attention._resolve_backend.cache_clear()


@contextlib.contextmanager
def fake_cuda(capability: tuple[int, int] = SM89, host_tensors: bool = False) -> Iterator[None]:
    """Fake tensors on cuda:0 by default, kernel selection seeing `capability`, and autocast allowed on cuda (it
    asks the driver whether CUDA and bf16 are there: the simulated device has both). `host_tensors`: real CPU
    tensors may enter (a batch prepared on the host and moved to the device)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _clear_selection_caches()
    with contextlib.ExitStack() as stack:
        stack.enter_context(pytest.MonkeyPatch.context()).setattr(
            torch.cuda.amp.common, "amp_definitely_not_available", lambda: False)
        stack.enter_context(pytest.MonkeyPatch.context()).setattr(
            torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
        stack.enter_context(compat.simulated_cuda(capability))
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=host_tensors))
        stack.enter_context(torch.device(CUDA))
        yield
    _clear_selection_caches()


@functools.cache
def fake_mode_misses(op: str) -> str | None:
    """Why this torch's fake mode cannot run `op` on fake CUDA tensors, or None when it can. Probed with torch's own
    calls (no megalm code), so a test that needs the op skips with the reason instead of blaming megalm: torch 2.9's
    SDPA asks the driver for device properties, its meta kernel of mm(out_dtype=) takes no out_dtype, and so on."""
    bf16 = torch.bfloat16

    def varlen_operands():
        q = torch.empty(16, 2, 32, dtype=bf16)
        return q, torch.empty_like(q), torch.empty_like(q), torch.tensor([0, 16], dtype=torch.int32)

    def flash():
        q, k, v, cu = varlen_operands()
        torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 16, 16, 0.0, True, False, scale=0.1)

    def efficient():
        q, k, v, cu = (t.unsqueeze(0) if t.dim() == 3 else t for t in varlen_operands())
        torch.ops.aten._efficient_attention_forward(query=q, key=k, value=v, bias=None, cu_seqlens_q=cu,
                                                    cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=16, dropout_p=0.0,
                                                    custom_mask_type=2, compute_log_sumexp=True, scale=0.1)

    def varlen():  # torch's function, positional arguments only: megalm's own call is what the tests check
        from torch.nn.attention.varlen import varlen_attn

        q, k, v, cu = varlen_operands()
        varlen_attn(q, k, v, cu, cu, 16, 16)

    def scaled_mm():
        one = torch.ones((), dtype=torch.float32)
        a, b = torch.empty(32, 64, dtype=fp8.E4M3), torch.empty(48, 64, dtype=fp8.E4M3).t()
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)

    def views():  # ordinary ops: torch 2.9 asks the driver for a device guard in some of them
        x = torch.empty(8, 4)
        x[:4].t().contiguous().t()
        torch.repeat_interleave(torch.arange(2), torch.tensor([1, 3]), output_size=4)

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(*[torch.empty(1, 2, 16, 32, dtype=bf16)] * 3, is_causal=True)

    probes = {
        "views": views, "sdpa": sdpa,
        "varlen_attn": varlen,
        "mm_out_dtype": lambda: torch.mm(torch.empty(16, 32, dtype=bf16), torch.empty(32, 16, dtype=bf16),
                                         out_dtype=torch.float32),
        "addmm_fp32_accumulator": lambda: torch.addmm(c := torch.empty(16, 16), torch.empty(16, 32, dtype=bf16),
                                                      torch.empty(32, 16, dtype=bf16), out_dtype=torch.float32, out=c),
        "flash_varlen": flash, "efficient_varlen": efficient, "scaled_mm": scaled_mm,
    }
    try:
        with fake_cuda(SM90):
            probes[op]()
    except Exception as error:
        return f"torch {torch.__version__}'s fake mode cannot run {op}: {type(error).__name__}: {str(error)[:120]}"
    return None


def needs_fake(*ops: str) -> None:
    """Skip unless this torch's fake mode runs every op in `ops` (`fake_mode_misses`)."""
    for op in ops:
        if (why := fake_mode_misses(op)) is not None:
            pytest.skip(why)


def auto_attention_op() -> str:
    """The torch op the attention backend `auto` picks on a GPU in bf16 (flash-attn's is not probed)."""
    return "varlen_attn" if compat.varlen_attn_available() else "sdpa"


def _qkv(tokens: int, heads: int = 8, kv_heads: int = 2, head_dim: int = 32, dtype=torch.bfloat16):
    return (torch.empty(tokens, heads, head_dim, dtype=dtype), torch.empty(tokens, kv_heads, head_dim, dtype=dtype),
            torch.empty(tokens, kv_heads, head_dim, dtype=dtype))


def _model_config(**overrides) -> ModelConfig:
    cfg = ModelConfig(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, vocab_size=256, seq_length=64)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


# ------------------------------------------------------------------------------------------------- selection


def test_fake_cuda_auto_picks_the_fastest_backend_the_device_has():
    """What `auto` picks on a simulated GPU: no torch.cuda.is_available() needed, none touched."""
    _clear_selection_caches()
    varlen = compat.varlen_attn_available()
    flash = attention._flash_attn_importable()
    fallback = "flash_attn" if flash else "sdpa"
    hopper_pick, other_pick = ("cudnn", "flash_attn" if flash else "torch_varlen") if varlen else (fallback, fallback)
    for capability, fast in ((SM90, hopper_pick), (SM89, other_pick)):  # auto picks cuDNN's attention on Hopper only
        with compat.simulated_cuda(capability):
            assert attention.select_attention_backend("auto", CUDA, torch.bfloat16) == fast
            assert attention.select_attention_backend("auto", CUDA, torch.bfloat16, dropout=True) == (
                "flash_attn" if flash else "sdpa")
            assert attention.select_attention_backend("auto", CUDA, torch.float32) == "sdpa"
            assert ring.block_kernel("auto", CUDA, torch.float32) == "torch_efficient"
            ring_kernel = {"cudnn": "torch_varlen", "sdpa": "torch_efficient"}.get(fast, fast)  # cudnn's blocks: flash
            assert ring.block_kernel("auto", CUDA, torch.bfloat16) == ring_kernel
            assert fp8.gemm_path(CUDA).startswith("torch._scaled_mm")
            assert mx_triton.triton_available(CUDA) == compat.triton_importable()
    with compat.simulated_cuda((7, 5)):  # Turing: no flash kernels, no FP8 GEMMs
        assert attention.select_attention_backend("auto", CUDA, torch.bfloat16) == "sdpa"
        assert fp8.gemm_path(CUDA).startswith("emulated")
    if not torch.cuda.is_available():  # no simulation, no GPU: the CPU path (on a GPU machine, its real answer)
        assert attention.select_attention_backend("auto", CUDA, torch.bfloat16) == "sdpa"


# ------------------------------------------------------------------------------------------------- attention


@needs_cuda_build
@pytest.mark.parametrize("window", [None, 16], ids=["causal", "window16"])
@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn", "sdpa"])
def test_fake_cuda_varlen_attention_backend(backend, window):
    """Each backend `auto` can choose on a GPU accepts megalm's call: GQA, packed documents, bf16, with and without
    a sliding window shorter than the documents (model.sliding_window: the kernels' window_size, SDPA's band)."""
    if backend == "flash_attn" and not attention._flash_attn_importable():
        pytest.skip("flash-attn is not installed")
    if backend == "torch_varlen" and not compat.varlen_attn_available():
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen (>= 2.10): auto runs sdpa")
    if backend == "torch_varlen" and window and not compat.varlen_window_available():
        pytest.skip(f"torch {torch.__version__}'s varlen_attn takes no window (>= 2.11): auto runs sdpa")
    needs_fake({"sdpa": "sdpa", "torch_varlen": "varlen_attn"}.get(backend, "sdpa"))
    with fake_cuda():
        q, k, v = _qkv(96)
        cu = torch.tensor([0, 32, 64, 96], dtype=torch.int32)  # equal documents: sdpa's batched call
        out = attention.varlen_attention(q, k, v, cu, 32, backend, window=window)
        assert out.shape == q.shape and out.dtype == q.dtype and out.device == CUDA
        if backend != "sdpa":  # unequal documents: sdpa would read cu_seqlens on the host (module docstring)
            cu = torch.tensor([0, 10, 64, 96], dtype=torch.int32)
            out = attention.varlen_attention(q, k, v, cu, 54, backend, window=window)
            assert out.shape == q.shape and out.device == CUDA


@needs_cuda_build
@pytest.mark.parametrize("kernel", ["torch_varlen", "torch_efficient", "flash_attn"])
@pytest.mark.parametrize("causal", [True, False])
def test_fake_cuda_ring_block_kernels_forward_and_backward(kernel, causal):
    """The ring's CUDA block kernels (aten ops, called directly: their backward too) accept its varlen blocks."""
    if kernel == "flash_attn" and not attention._flash_attn_importable():
        pytest.skip("flash-attn is not installed")
    needs_fake("views", {"torch_varlen": "flash_varlen", "torch_efficient": "efficient_varlen"}.get(kernel, "sdpa"))
    with fake_cuda():
        q, k, v = _qkv(48)
        cu_q = torch.tensor([0, 16, 48], dtype=torch.int32)
        cu_k = cu_q if causal else torch.tensor([0, 8, 24], dtype=torch.int32)
        k, v = (k, v) if causal else (k[:24], v[:24])
        max_k = 32 if causal else 16
        out, lse = ring.block_forward(q, k, v, cu_q, cu_k, 32, max_k, causal, 32**-0.5, kernel)
        assert out.shape == q.shape and out.dtype == torch.float32 and lse.shape == (48, 8)
        if kernel == "torch_efficient" and not _efficient_backward_meta_matches_schema():
            pytest.skip(f"torch {torch.__version__}'s meta kernel of _efficient_attention_backward lacks the schema's "
                        "`out` argument: fake mode cannot call it (a real GPU can)")
        dq, dk, dv = ring.block_backward(torch.empty_like(out), q, k, v, out, lse, cu_q, cu_k, 32, max_k, causal,
                                         32**-0.5, kernel)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dq.device == CUDA


def _efficient_backward_meta_matches_schema() -> bool:
    """Whether torch's meta (fake) kernel of _efficient_attention_backward takes the op's arguments (2.11's lacks
    `out`, so every keyword after it lands one place off)."""
    import inspect

    from torch._meta_registrations import meta__efficient_attention_backward

    return "out" in inspect.signature(meta__efficient_attention_backward).parameters


# ------------------------------------------------------------------------------------------------- the model


def _forward(model: GPT, tokens: int = 64, docs: tuple[int, ...] = (32, 32), context=None) -> torch.Tensor:
    ids = torch.zeros(tokens, dtype=torch.long)
    pos = torch.cat([torch.arange(n) for n in docs])
    cu = torch.tensor([0, *itertools.accumulate(docs)], dtype=torch.int32)
    return model(ids, pos, cu, max(docs), context)


@contextlib.contextmanager
def counting(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> Iterator[list[int]]:
    """Counts calls of `owner.name` (e.g. torch._scaled_mm) while inside."""
    calls, original = [0], getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    yield calls
    monkeypatch.setattr(owner, name, original)


def _to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The parameters' data cast in place, as Parallelism casts them (`Module.to` would swap fake tensors)."""
    for param in model.parameters():
        param.data = param.data.to(dtype)


@needs_cuda_build
@pytest.mark.parametrize("recipe", ["bf16", "bf16_autocast", "fp8", "fp8_delayed", "fp8_rowwise", "mxfp8", "mxfp4"])
def test_fake_cuda_model_forward_under_each_recipe(recipe, monkeypatch):
    """The trainer's forward on a GPU: bf16 weights (bf16), or fp32 weights under the recipe's autocast; GQA, the
    backend auto picks, FP8 GEMMs on torch._scaled_mm (its fake kernel checks the operands' dtypes, layouts and
    16-alignment)."""
    gemm_ops = ["scaled_mm"] if recipe.startswith("fp8") else ["mm_out_dtype"] if recipe == "mxfp8" else []
    needs_fake("views", auto_attention_op(), *gemm_ops)
    with fake_cuda():
        model = GPT(_model_config())
        precision = Precision(PrecisionConfig(name=recipe), seed=0, device=CUDA)
        precision.convert(model)
        if precision.working_dtype is not None:  # as Parallelism casts the trainer's model
            _to_dtype(model, precision.working_dtype)
        with counting(monkeypatch, torch, "_scaled_mm") as scaled_mm, precision.forward_context():
            precision.before_forward(model, step=0, micro_batch=0)
            logits = _forward(model)
        assert logits.shape == (64, model.cfg.padded_vocab_size) and logits.device == CUDA
        assert logits.dtype == torch.bfloat16  # bf16 weights or autocast: the attention was bf16 (flash backend)
        uses_scaled_mm = recipe.startswith("fp8")
        assert (scaled_mm[0] > 0) == uses_scaled_mm, (recipe, scaled_mm[0])


@needs_cuda_build
@pytest.mark.parametrize("recipe", ["fp8", "fp8_rowwise", "mxfp4", "mxfp4_rht"])
def test_fake_cuda_recipe_gemms_of_backward(recipe, monkeypatch):
    """dgrad and wgrad (the backward GEMMs, in E5M2 for FP8 and MX with stochastic rounding / RHT for MXFP4),
    called as the layer's backward calls them: FP8 through torch._scaled_mm, MX through the Triton quantizer op."""
    if recipe.startswith("mx") and not compat.triton_importable():
        pytest.skip("triton is not installed: MX GEMMs run the PyTorch reference")
    needs_fake("views", "scaled_mm" if recipe.startswith("fp8") else "mm_out_dtype")
    # A CUDA torch.Generator (RHT signs, the reference's SR draws) needs a driver: draw them on the CPU here.
    on_device = linear.gemm_generator
    cpu_generator = lambda seed, gemm, device: on_device(seed, gemm, "cpu")
    monkeypatch.setattr(linear, "gemm_generator", cpu_generator)
    with fake_cuda():
        gemms = RecipeGemms(get_recipe(recipe), seed=0)
        x, weight, dy = torch.empty(64, 128), torch.empty(96, 128), torch.empty(64, 96)
        # megalm::mx_quantize's outputs are allocated by _mx_outputs, in its kernel and in its fake implementation
        with counting(monkeypatch, torch, "_scaled_mm") as scaled_mm, \
                counting(monkeypatch, mx_triton, "_mx_outputs") as quantized:
            call = gemms.start(x)
            y = gemms.fprop(call, x, weight)
            dx = gemms.dgrad(call, dy, weight)
            dw = gemms.wgrad(call, dy, x)
        assert (y.shape, dx.shape, dw.shape) == ((64, 96), (64, 128), (96, 128))
        assert dx.device == dw.device == CUDA
        # FP8: fprop, dgrad and wgrad on the kernel, but row-wise scaling keeps E5M2 (dgrad, wgrad) emulated.
        # MX (MXFP4): fprop in bf16; dgrad and wgrad quantize both operands.
        want = {"fp8": (3, 0), "fp8_rowwise": (1, 0), "mxfp4": (0, 4), "mxfp4_rht": (0, 4)}[recipe]
        assert (scaled_mm[0], quantized[0]) == want, recipe


@needs_cuda_build
@pytest.mark.parametrize("recipe", ["fp8", "fp8_delayed"])
def test_fake_cuda_fp8_writes_bf16_and_transposes_no_weight_per_micro_batch(recipe, monkeypatch):
    """FP8 without waste, as the GPU would run it: torch._scaled_mm writes the bf16 the layer asks for (no fp32
    output and cast), and dgrad's weight comes from the cache already column-major, so after the first micro-batch
    of a step no FP8 copy of the weight is made (no quantize, no transpose: a clone of its size would be one); fprop
    with fast accumulation, dgrad without."""
    needs_fake("views", "scaled_mm")
    from torch.utils._python_dispatch import TorchDispatchMode

    class WeightSizedCopies(TorchDispatchMode):
        def __init__(self, numel: int):
            super().__init__()
            self.numel, self.copies = numel, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            fp8_dtype = isinstance(out, torch.Tensor) and out.dtype in (fp8.E4M3, fp8.E5M2)
            fp8_sized = fp8_dtype and out.numel() == self.numel
            aliases = func._schema.returns[0].alias_info is not None  # a view (t, transpose) costs nothing
            if fp8_sized and not aliases:  # a new FP8 tensor of the weight's size
                self.copies += 1
            return out

    out_dtypes, fast_accum = [], []
    original = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: out_dtypes.append(k["out_dtype"])
                        or fast_accum.append(k.get("use_fast_accum", False)) or original(*a, **k))
    with fake_cuda():
        state = linear.LinearState("layer")
        state.weights_version.watch(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
        weight = torch.nn.Parameter(torch.empty(96, 128, dtype=torch.bfloat16))
        gemms = RecipeGemms(get_recipe(recipe), state, weight=weight)
        copies = []
        for _ in range(3):  # micro-batches of one step
            x, dy = torch.empty(64, 128, dtype=torch.bfloat16), torch.empty(64, 96, dtype=torch.bfloat16)
            with WeightSizedCopies(weight.numel()) as mode:
                call = gemms.start(x)
                y = gemms.fprop(call, x, weight, torch.bfloat16)
                dx = gemms.dgrad(call, dy, weight, torch.bfloat16)
            copies.append(mode.copies)
            assert y.dtype == dx.dtype == torch.bfloat16
    assert copies[0] > 0 and copies[1:] == [0, 0], copies
    assert out_dtypes == [torch.bfloat16] * 6, out_dtypes
    assert fast_accum == [True, False] * 3, "fprop accumulates fast, dgrad promotes (fp8.py)"


@needs_cuda_build
def test_fake_cuda_scaled_mm_rules_are_checked():
    """The tier can fail: torch._scaled_mm's fake kernel refuses what the GPU refuses (here a row-major second
    operand), and megalm's dispatch never sends it one (a 30-token GEMM is emulated, not sent)."""
    needs_fake("views", "scaled_mm")
    with fake_cuda():
        a = torch.empty(32, 64, dtype=fp8.E4M3)
        b = torch.empty(64, 48, dtype=fp8.E4M3)  # row-major: cuBLASLt wants it column-major
        one = torch.ones((), dtype=torch.float32)
        with pytest.raises(RuntimeError):
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
        assert fp8.scaled_mm(a, b, one, one).shape == (32, 48)
        assert fp8.scaled_mm(torch.empty(30, 64, dtype=fp8.E4M3), b, one, one).shape == (30, 48)


@needs_cuda_build
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rht", [False, True])
def test_fake_cuda_mx_quantizer_op_shapes_match_the_reference(packed, rht):
    """megalm::mx_quantize's fake implementation returns what the kernel writes: the reference's shapes."""
    if not compat.triton_importable():
        pytest.skip("triton is not installed")
    x_cpu = torch.randn(40, 100)
    want = mx_quantize(x_cpu if not rht else torch.nn.functional.pad(x_cpu, (0, 28)), "e2m1", dim=-1)
    with fake_cuda():
        signs = torch.ones(64) if rht else None
        got = mx_triton.mx_quantize_triton(torch.empty(40, 100, dtype=torch.bfloat16), "e2m1", "stochastic",
                                           rht_signs=signs, packed=packed)
        if packed:
            assert got.codes.shape == want.codes.shape and got.scales.shape == want.scales.shape
            assert got.codes.device == CUDA
        else:
            assert got.shape == (40, 128 if rht else 100) and got.device == CUDA


@needs_cuda_build
def test_fake_cuda_one_rank_ring_micro_batch():
    """An HDP / context-parallel micro-batch: its RingContext (zigzag layout moved to the device) in every
    attention layer, on the backend auto picks."""
    needs_fake("views", auto_attention_op())
    layout = layout_from_local_cu_seqlens(torch.tensor([0, 20, 64], dtype=torch.int32), 1)  # on the host, as prepared
    with fake_cuda(host_tensors=True):
        model = GPT(_model_config())
        context = RingContext((0,), 0, layout.to(CUDA))
        assert context.layout.local_cu_seqlens.device == CUDA
        _to_dtype(model, torch.bfloat16)  # precision=bf16's weights
        logits = _forward(model, docs=(20, 44), context=context)
        assert logits.shape == (64, model.cfg.padded_vocab_size) and logits.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------ compiled blocks


@needs_cuda_build
@pytest.mark.parametrize(("recipe", "capability", "experts"), [
    *((recipe, SM89, 0) for recipe in ["bf16", "bf16_autocast", "fp8", "fp8_delayed", "fp8_rowwise", "mxfp8",
                                       "mxfp4"]),
    ("bf16", SM90, 0), ("fp8", SM90, 0), ("bf16", SM90, 8)],
    ids=lambda value: f"moe{value}" if isinstance(value, int) else str(value))
def test_fake_cuda_compiled_blocks_take_the_varlen_kernel_in_whole_graphs_compiled_at_most_three_times(recipe,
                                                                                                      capability,
                                                                                                      experts):
    """trainer.compile=true on a GPU, as far as a machine without one reaches: dynamo traces each block's forward on
    fake CUDA tensors, with torch's varlen flash kernel (cu_seqlens a tensor, never read on the host) in the graph.
    Over 20 micro-batches of equal and unequal documents and varying token counts: no graph break, and the blocks'
    one code object compiles at most three times (the first graph, then the document count and the token count
    made dynamic). On sm90 (auto: cudnn) the graph also holds the batched SDPA call of equal documents. The recipes'
    GEMMs are megalm's ops in the graph (fake tensors make no FP8 weight copies for the graph's own torch._scaled_mm:
    tests/unit/test_compile_blocks.py runs that path). Inductor's Triton kernels need a
    driver: the GPU tier compiles them (tests/gpu). An MoE model (8 experts, top 2, a capacity, the switch,
    sequence and z losses) likewise: its router, grouped GEMMs and per-document counts in the same graph."""
    from torch._dynamo.utils import counters

    from megalm.model.attention import choose_attention_backends
    from megalm.training.compile import compile_blocks

    needs_fake("views", "varlen_attn")
    if not compat.varlen_attn_available():
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen: the CUDA path runs SDPA per document")
    targets: set[str] = set()

    def recording(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        for graph in (module.graph for module in gm.modules() if isinstance(module, torch.fx.GraphModule)):
            targets.update(str(node.target) for node in graph.nodes if node.op == "call_function")
        return gm.forward

    hopper = capability == SM90
    if hopper:
        needs_fake("sdpa")
    with fake_cuda(capability):
        cfg = _model_config(seq_length=128)
        if experts:
            cfg.moe = MoEConfig(num_experts=experts, top_k=2, expert_ffn_hidden_size=64, capacity_factor=1.25,
                                aux_loss_coeff=0.01, seq_aux_loss_coeff=0.01, z_loss_coeff=0.001)
        model = GPT(cfg)
        precision = Precision(PrecisionConfig(name=recipe), seed=0, device=CUDA)
        precision.convert(model)
        if precision.working_dtype is not None:
            _to_dtype(model, precision.working_dtype)
        want = "cudnn" if hopper else "torch_varlen"
        assert choose_attention_backends(model, CUDA, torch.bfloat16) == {want}  # as the trainer does
        compile_blocks(model, backend=recording)
        torch._dynamo.reset()
        counters.clear()
        with precision.forward_context():
            for step, docs in enumerate(packed_layouts(20)):
                precision.before_forward(model, step=step, micro_batch=0)
                assert _forward(model, sum(docs), docs).shape[0] == sum(docs)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["frames"]["total"] <= 3, dict(counters["frames"])
    assert any("varlen" in target for target in targets), sorted(targets)
    assert any("scaled_dot_product" in target for target in targets) == hopper, sorted(targets)
    ops = torch.ops.megalm
    recipe_ops = targets & {str(op) for op in (ops.recipe_linear.default, ops.fp8_linear.default)}
    assert bool(recipe_ops) == (recipe not in ("bf16", "bf16_autocast")), sorted(targets)  # the GEMMs in the graph
    assert any("_grouped_mm" in target for target in targets) == bool(experts), sorted(targets)


@contextlib.contextmanager
def recording_ops(calls: list[str]) -> Iterator[None]:
    """Appends to `calls` each op that is not a view (`aten.addmm.dtype_out`) dispatched inside."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if not func.is_view:
                calls.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recording():
        yield


@needs_cuda_build
def test_fake_cuda_fused_weight_gradient_is_one_gemm_into_the_fp32_sum():
    """Gradient accumulation fusion on a GPU (megalm/parallel/data_parallel/fused_wgrad.py): bf16 dy and x, the fp32
    main gradient both accumulator and output of one addmm, whatever the first micro-batch's beta; no upcast copy."""
    from megalm.parallel.data_parallel.fused_wgrad import wgrad_into

    needs_fake("addmm_fp32_accumulator")
    calls: list[str] = []
    with fake_cuda(SM90), recording_ops(calls):
        dy, x = torch.empty(64, 48, dtype=torch.bfloat16), torch.empty(64, 32, dtype=torch.bfloat16)
        main_grad = torch.empty(48, 32)
        for first in (True, False):
            wgrad_into(main_grad, dy, x, first)
    assert calls == ["aten.addmm.dtype_out"] * 2, calls
