"""Every torch API megalm calls that is newer than its floor or changed inside the supported range, probed once.

megalm supports torch >= 2.11 (pyproject.toml states it; `.ci/run` tests the floor, which is the GPU image's torch,
and the newest release). What differs across that range goes through this module, so the version-dependent surface is in
one place: each probe is a signature or capability check computed once (functools.cache), never a version number
compared, and a probe that picks a fallback says so in one log line naming it.

It is also the one place that answers "is this a CUDA device, and of which compute capability" for the code that
selects kernels (attention backends, FP8 GEMMs, the MX Triton quantizer, the ring's block kernels). `simulated_cuda`
makes it answer for a device this process does not have: the fake-CUDA test tier runs megalm's CUDA paths on a CPU
machine under FakeTensorMode (tests/unit/test_fake_cuda.py), where `torch.cuda.is_available()` must stay False
(fake tensors reach for the driver when it says True).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("megalm")

# The GPU image's torch, the oldest megalm runs its tests and GPU runs on (2.9 had HuggingFaceStorageWriter's
# save_distributed, which checkpoints need, and CI tested it until 2026-12-01).
TORCH_FLOOR = (2, 11)


def major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as torch's "2.11.0+cu130" or torchao's "0.17.0"."""
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    return major, minor


def check_torch_version(version: str) -> None:
    """Refuse a torch older than the floor pyproject.toml states, with the fix."""
    if major_minor(version) < TORCH_FLOOR:
        raise ImportError(f"megalm needs torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]} (the oldest it is tested on), "
                          f"found {version}; pip install 'torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}'")


check_torch_version(torch.__version__)


@functools.cache
def _log_fallback(message: str) -> None:
    log.info(message)


# ------------------------------------------------------------------------------------------------ devices

# simulated_cuda's answer, in the caller's context (a ContextVar: set and reset by the context manager only)
_simulated_capability: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "megalm_simulated_cuda_capability", default=None)


def triton_interpreted() -> bool:
    """Whether Triton kernels run under its interpreter (TRITON_INTERPRET=1: CPU tensors, Python speed)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def triton_importable() -> bool:
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:  # ImportError, or a triton build that does not load on this machine
        return False
    return True


def triton_runs_on(device: torch.device | str | None = None) -> bool:
    """Whether megalm's Triton kernels (the MX quantizer, the AdamW step) can run on `device`: a CUDA device with
    triton importable, or CPU tensors under the Triton interpreter. None means the current CUDA device."""
    device = torch.device("cuda" if device is None else device)
    if device.type == "cuda":  # sm70+, as inductor's Triton backend asks
        capability = cuda_capability(device)
        return capability is not None and capability >= (7, 0) and triton_importable()
    if device.type == "cpu":
        return triton_interpreted() and triton_importable()
    return False


def cuda_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """The compute capability of CUDA `device` (None: the current one), or None where it is not a usable CUDA
    device (another device type, or no CUDA in this process). Under `simulated_cuda` the simulated one."""
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    if (simulated := _simulated_capability.get()) is not None:
        return simulated
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


@contextlib.contextmanager
def simulated_cuda(capability: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """Inside, `cuda_capability` answers `capability` for every CUDA device: kernel selection takes its CUDA paths
    on a machine without one (for FakeTensorMode with fake CUDA tensors; real CUDA tensors still need a GPU)."""
    token = _simulated_capability.set(capability)
    try:
        yield
    finally:
        _simulated_capability.reset(token)


# fp8_traced_as_gpu's capability, in the caller's context (None: off)
_fp8_traced_capability: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "megalm_fp8_traced_capability", default=None)


@contextlib.contextmanager
def fp8_traced_as_gpu(capability: tuple[int, int]) -> Iterator[None]:
    """Inside, FP8 recipes on fake CPU tensors are traced as a CUDA GPU of `capability` runs them: each cast to FP8
    pads, and counts, as the GPU's one compiled kernel (megalm.measure.op_cost.one_kernel), and from 8.9 on the
    GEMMs take torch._scaled_mm (its fake kernel: shapes and dtypes) instead of the CPU's fp32 emulation.
    megalm-estimate steps a GPU's rank on fake CPU tensors (autograd's engine asks a CUDA device for its
    context) and must trace, hence price and hold, what the GPU runs. Real tensors never take it
    (megalm/precision/fp8.py checks). Gradient accumulation fusion's GEMM follows it too
    (megalm/parallel/data_parallel/fused_wgrad.py): CUDA's fp32-accumulating bf16 GEMM, not the CPU's emulation."""
    token = _fp8_traced_capability.set(capability)
    try:
        yield
    finally:
        _fp8_traced_capability.reset(token)


def fp8_traced_capability() -> tuple[int, int] | None:
    """The GPU's capability while `fp8_traced_as_gpu` is on, else None."""
    return _fp8_traced_capability.get()


def custom_op_body(qualname: str) -> Callable[..., Any] | None:
    """The Python function the `torch.library.custom_op` named `qualname` ("namespace::name") runs, or None (torch
    keeps it in a private table, `torch._library.custom_ops.OPDEFS`, torch 2.4 on). For torch's fused collective
    GEMMs of symmetric memory (`symm_mem::fused_all_gather_matmul`, `fused_matmul_reduce_scatter`: async TP's), the
    unfused fallback torch runs them as on meta tensors: the collective, then the GEMM."""
    namespace, _, name = qualname.partition("::")
    if namespace == "symm_mem":
        from torch.distributed import _symmetric_memory

        return getattr(_symmetric_memory, f"_{name}_fallback", None)
    from torch._library import custom_ops

    opdef = getattr(custom_ops, "OPDEFS", {}).get(qualname)
    return getattr(opdef, "_init_fn", None)


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a FakeTensor (shapes and dtypes, no data): code that compiles or launches kernels
    runs its eager twin on it instead (inductor and Triton need a real device)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def host_values(tensor: torch.Tensor) -> list:
    """`tensor.tolist()` of a real tensor, read even where a FakeTensorMode is on (a cost trace's FLOP formula reads a
    host tensor an op was given, where the mode would take the read for one of its own tensors'). None for a fake
    tensor, which has no values."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if is_fake(tensor):
        return None
    with unset_fake_temporarily():
        return tensor.tolist()


def host_tensor(values: list[int]) -> torch.Tensor:
    """An int64 CPU tensor of `values` that stays real where a FakeTensorMode is on, for an op to read on the host
    (`host_values`). FSDP's root pre-forward rebuilds the dataclasses among a forward's arguments (the CP attention
    context: torch.distributed.utils._recursive_to, dataclasses.replace), inside megalm-estimate's fake trace, and
    their host tensors made there were fake: the estimate raised on ring CP with FSDP."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # on the host by name: a default-device context (fake CUDA) would put it there
        return torch.tensor(values, dtype=torch.int64, device="cpu")


def fake_mode_active() -> bool:
    """Whether a FakeTensorMode is on the dispatch stack: new tensors made now are fake, so a cache of constant
    tensors must neither keep nor serve them (a fake constant fails every real call after; a real one fails under a
    mode that does not take real inputs)."""
    from torch._guards import active_fake_mode

    return active_fake_mode() is not None


def dynamo_frames_compiled() -> int:
    """How many frames dynamo has compiled in this process (its own counter, which torch's tests read too); 0 where
    torch._dynamo was never imported, without importing it (then nothing was compiled)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["frames"]["total"])


def constant_to_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compiler.assume_constant_result` without importing torch._dynamo (and Triton) when megalm is imported:
    the same mark dynamo reads (tests/unit/test_compat.py checks it against torch's own decorator). Dynamo then calls
    `fn` at trace time and keeps its result as a constant instead of tracing into it."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


# ---------------------------------------------------------------------------------------------- attention


# (varlen_attn, causal by window_size, takes scale, takes enable_gqa), read from this torch's signature once, in eager
# code (attention backend selection calls varlen_attn_available() before any block is compiled); () where there is
# no usable varlen_attn; None until read. A compiled block's call reaches only `_resolve_varlen`'s first return,
# never the log calls below, which would break its graph (the first GPU run found that, 2026-11-28).
_varlen_form: tuple[Callable[..., torch.Tensor], bool, bool, bool] | tuple[()] | None = None


def _resolve_varlen() -> tuple[Callable[..., torch.Tensor], bool, bool, bool] | tuple[()]:
    """torch.nn.attention.varlen.varlen_attn and the keywords this torch's form takes, or () (logged once).

    torch 2.10's varlen_attn is (..., is_causal, return_aux): no scale, no window, GQA shapes as they are; 2.11's
    takes scale and window_size=(-1, 0) for causal and no enable_gqa (its kernel reads kv head h // (Hq / Hkv)
    itself); 2.12+ wants enable_gqa=True for GQA."""
    global _varlen_form
    if _varlen_form is not None:
        return _varlen_form
    _varlen_form = ()
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        _log_fallback("this torch has no torch.nn.attention.varlen: attention_backend=auto runs sdpa (one call per "
                      "document when their lengths differ); torch >= 2.10 has the varlen flash kernel")
        return _varlen_form
    params = inspect.signature(varlen_attn).parameters
    window, scale, gqa = "window_size" in params, "scale" in params, "enable_gqa" in params
    if not window and "is_causal" not in params:
        _log_fallback("this torch's varlen_attn takes neither window_size nor is_causal: attention_backend=auto "
                      "runs sdpa")
        return _varlen_form
    if not window:
        _log_fallback("this torch's varlen_attn is causal by is_causal=True and takes no softmax scale (its "
                      "default, 1/sqrt(head_dim), is the only one it runs)")
    if not gqa:
        _log_fallback("this torch's varlen_attn has no enable_gqa keyword: grouped-query shapes are passed as they "
                      "are (its flash kernel reads kv head h // (Hq / Hkv) itself)")
    _varlen_form = (varlen_attn, window, scale, gqa)
    return _varlen_form


def reset_varlen_resolution() -> None:
    """Forget the resolved varlen_attn form (tests that stand in another torch's signature)."""
    global _varlen_form
    _varlen_form = None


def varlen_attn_available() -> bool:
    """Whether torch.nn.attention.varlen.varlen_attn exists (torch >= 2.10) in a form megalm can call."""
    return bool(_resolve_varlen())


def varlen_window_available() -> bool:
    """Whether this torch's varlen_attn takes a window (window_size: torch >= 2.11), which a sliding window needs."""
    form = _resolve_varlen()
    return bool(form) and form[1]


def varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Causal varlen flash attention (torch.nn.attention.varlen) of q [T, Hq, D] onto k/v [T, Hkv, D], with the
    keywords this torch's signature takes; `window`: each query sees its last `window` keys, itself included."""
    form = _resolve_varlen()
    if not form:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn is missing from this torch or has an unknown form "
                           "(it needs >= 2.10); use model.attention_backend=auto")
    fn, takes_window, takes_scale, takes_gqa = form
    if window is not None and not takes_window:
        raise ValueError("this torch's varlen_attn takes no window (torch >= 2.11 does); use "
                         "model.attention_backend=sdpa for model.sliding_window")
    kwargs: dict[str, Any] = ({"window_size": (-1 if window is None else window - 1, 0)} if takes_window
                              else {"is_causal": True})
    if takes_scale:
        kwargs["scale"] = scale
    elif scale is not None and not math.isclose(scale, q.shape[-1] ** -0.5):
        raise ValueError(f"this torch's varlen_attn runs softmax scale 1/sqrt(head_dim) only, not {scale}; use "
                         "model.attention_backend=sdpa")
    if takes_gqa and q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


# The kernels behind torch SDPA, by the number `torch._fused_sdp_choice` answers (torch.nn.attention.SDPBackend).
SDPA_KERNELS = {-1: "no kernel", 0: "math", 1: "flash", 2: "memory-efficient", 3: "cuDNN", 4: "overrideable"}


def sdpa_kernel_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None, *,
                       is_causal: bool = True, enable_gqa: bool = False) -> str:
    """Which kernel torch SDPA runs for [b, h, s, d] inputs like these: the dispatcher's own choice (it depends on the
    device, dtype, head size, mask, GQA and grad, on torch's priority order and any `sdpa_kernel` in force), so a log
    line or a benchmark row can say what ran rather than what was hoped for."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, is_causal, enable_gqa=enable_gqa)
    except (RuntimeError, TypeError) as e:  # an older torch, or inputs no kernel takes
        return f"unknown ({type(e).__name__})"
    name = SDPA_KERNELS.get(int(choice), str(choice))
    return f"{name} on CPU" if q.device.type == "cpu" else name


def present_aten_ops(names: tuple[str, ...]) -> list[torch._ops.OpOverload]:
    """The `.default` overloads of those aten ops this torch has (attention kernels come and go by version)."""
    return [getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)]


def kernel_parameter_names(fn: Callable[..., Any]) -> set[str]:
    """The keyword names a flash-attn internal takes. flash-attn >= 2.7 wraps them in torch.library.custom_op,
    whose own signature is (*args, **kwargs): read the wrapped function's, or else the op schema's."""
    for target in (getattr(fn, "_init_fn", None), inspect.unwrap(fn)):
        if target is None:
            continue
        params = inspect.signature(target).parameters
        if not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
            return set(params)
    schema = getattr(getattr(fn, "_opoverload", None), "_schema", None)
    if schema is None:
        raise RuntimeError(f"cannot read the parameters of flash-attn's {getattr(fn, '__name__', fn)}; this "
                           "flash-attn version is not supported: use model.attention_backend=torch_varlen")
    return {argument.name for argument in schema.arguments}


def call_with_known_keywords(fn: Callable[..., Any], defaults: dict[str, Any], **kwargs: Any) -> Any:
    """Call `fn` (a flash-attn internal) with the keywords its version knows, `defaults` added where it takes them."""
    names = kernel_parameter_names(fn)
    kwargs |= {key: value for key, value in defaults.items() if key in names}
    return fn(**{key: value for key, value in kwargs.items() if key in names})


# ------------------------------------------------------------------------------------------------- GEMMs


@functools.cache
def mm_out_dtype_available() -> bool:
    """torch.mm(..., out_dtype=) (bf16 operands, fp32 output); logged once when missing."""
    if hasattr(torch.ops.aten.mm, "dtype"):
        return True
    log.warning("this torch has no torch.mm(out_dtype=): bf16 GEMMs with fp32 output run as fp32 matmuls of the "
                "bf16 values (same values, slower); upgrade torch for the bf16 GEMM")
    return False


@functools.cache
def compiles_over_fake_tensors() -> bool:
    """Whether torch.compile (dynamo and AOT autograd) compiles a function, forward and backward, over the caller's
    FakeTensorMode: megalm-estimate's trace of compiled blocks needs it. Before torch 2.11 AOT autograd asserts that
    the fake tensors are its own. Probed once on a function of its own (no other code's compile cache is touched);
    logged once when missing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def probe(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, w)

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            x, w = torch.empty(2, 4, requires_grad=True), torch.empty(4, 4, requires_grad=True)
            torch.compile(probe, backend="aot_eager")(x, w).sum().backward()
        return True
    except Exception as error:  # noqa: BLE001 - torch's assertion, or any failure of the probe, means no
        log.warning("this torch cannot compile over fake tensors (%s): megalm-estimate prices trainer.compile=true "
                    "eager; torch 2.11 and later can", str(error).splitlines()[0][:120])
        return False


def scaled_mm_available() -> bool:
    """torch._scaled_mm (FP8 GEMMs) exists in this torch."""
    return hasattr(torch, "_scaled_mm")


# ---------------------------------------------------------------------------------------------- collectives

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older releases have only the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Make this process rank `rank` of a fake process group of `world_size` (torch's FakeStore: collectives return at
    once, nothing is sent), which megalm-estimate and the activation-memory tool run on fake tensors. Its collectives
    need fake kernels: torch registers them itself from 2.11 (torch.distributed._meta_registrations); before, its own
    memory tracker's module torch.distributed._tools.fake_collectives registers the same kernels when imported
    (without it torch 2.9 failed on FSDP's all-gather: "UnsupportedOperatorException: c10d._allgather_base_")."""
    import importlib.util

    from torch.testing._internal.distributed.fake_pg import FakeStore

    if importlib.util.find_spec("torch.distributed._meta_registrations") is None:
        import torch.distributed._tools.fake_collectives  # noqa: F401 - registers the kernels
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())

# ----------------------------------------------------------------------------------------------- checkpoints


def hf_storage_writer(path: str) -> Any:
    """torch.distributed.checkpoint's HuggingFaceStorageWriter writing one file per rank (save_distributed)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    return HuggingFaceStorageWriter(path, save_distributed=True)


# ------------------------------------------------------------------------------------------------ autograd


def as_function_output(out: torch.Tensor) -> torch.Tensor:
    """What an autograd.Function's forward returns when it could be an alias of a tensor its traced forward made or
    mutated: a view of it (free), never that tensor itself.

    torch 2.11's dynamo traces some forwards (those that run a collective, whose `wait_tensor` and `copy_` write in
    place; those that build their result in place, or return a `.to()` or `.contiguous()` that changed nothing) with
    intermediate tensors as extra outputs of the traced function. Where the result is one of them, autograd hands
    its gradient to that alias and the result's own is zero: compiled TP, SP, Ulysses and EP blocks trained wrongly
    on 2.11 (tests/dist/test_compile_layouts.py and test_moe_layouts.py compare them with eager), and the chunked
    loss, compiled, would have. A view is a tensor of its own, so the gradient reaches it; torch 2.9 and 2.13 train
    the same either way."""
    return out.view_as(out)


# ------------------------------------------------------------------------------------------------ inductor

# inductor's `inductor_force_stride_order` prim, or None: resolved by `load_inductor_layout_prim` when blocks are
# compiled (megalm/training/compile.py), in eager code, so that a traced block only reads this name.
inductor_force_strides: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None


def load_inductor_layout_prim() -> None:
    """Register and keep inductor's `prims.inductor_force_stride_order` (a private op of torch._inductor, present
    since torch 2.1; its eager form copies only where the strides differ). Without it a graph's FP8 column-major
    copies are made as before, by a transposed loop inductor's C++ scheduler does not fuse with the cast (logged).
    Where inductor's lowering of the prim cannot order symbolic strides (torch 2.11's: it sorts them with no shape
    env, and a token count that changes from step to step failed to compile, "cannot determine truth value of
    Relational"), the prim is kept for static shapes only (logged)."""
    global inductor_force_strides
    if inductor_force_strides is not None:  # loaded (and its fallback logged) once a process
        return
    try:
        importlib.import_module("torch._inductor.inductor_prims")
        prim = torch.ops.prims.inductor_force_stride_order
    except (ImportError, AttributeError) as error:
        _log_fallback(f"no inductor_force_stride_order in torch {torch.__version__} ({error}): compiled FP8 "
                      "graphs write column-major copies in a pass of their own")
        return
    if _lowering_orders_symbolic_strides():
        inductor_force_strides = prim
    else:
        _log_fallback(f"torch {torch.__version__}'s inductor cannot order symbolic strides in "
                      "inductor_force_stride_order: compiled FP8 graphs over a changing token count write "
                      "column-major copies in a pass of their own")
        inductor_force_strides = functools.partial(_force_static_strides, prim)


def _lowering_orders_symbolic_strides() -> bool:
    """Whether inductor's lowering of `inductor_force_stride_order` hands the graph's shape env to the sort of the
    strides (which the fix of the bug above added; there is no public switch or version to ask): read from the names
    its code uses."""
    lowering = importlib.import_module("torch._inductor.lowering")
    function = getattr(lowering, "inductor_force_stride_order", None)  # as register_lowering wrapped it
    code = getattr(inspect.unwrap(function), "__code__", None) if function is not None else None
    return code is not None and "shape_env" in code.co_names


def _force_static_strides(prim: Callable[[torch.Tensor, list[int]], torch.Tensor], tensor: torch.Tensor,
                          stride: list[int]) -> torch.Tensor:
    """`prim(tensor, stride)` where every stride is a number; `tensor` as it is (already in that layout, the
    caller's copy) where one is symbolic (`load_inductor_layout_prim`). Dynamo shows a symbolic size to `isinstance`
    as an int; a symbol is told from a number by its range, which has no upper bound. Not where the traced code
    bounds the symbol (`if tokens < n`, a guard): no compiled block compares its token count with a number."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if all(statically_known_true(s < sys.maxsize) for s in stride):
        return prim(tensor, stride)
    return tensor
