"""What a step costs on a GPU, read from the aten ops it dispatches: kernels, FLOPs, bytes and a roofline time.

`OpCosts` is a `TorchDispatchMode`: every op that is not a view (a view launches no kernel) nor a rerun of DTensor's
sharding propagation (`megalm.measure.storage.in_sharding_propagation`) is one kernel (or part
of one: `one_kernel` counts a region's ops as the single fused kernel the GPU runs for them), its
FLOPs come from torch's own formulas (`torch.utils.flop_counter`), its bytes are those of its tensor inputs read
(not a destination it overwrites, nor anything a fill is given; an allocation is no kernel) and its outputs
written, and its roofline time on a named GPU is max(FLOPs / peak, bytes / HBM bandwidth). Under
`FakeTensorMode` this runs a step of any size on a CPU in seconds (no data is computed). Which kernels run is the
dispatcher's choice on the device traced: a CPU trace decomposes some ops that CUDA runs fused (the caller says
which device it traced), and an eager trace cannot see what `torch.compile` would fuse.

Hand-written because torch's `runtime_estimator` reads the live GPU, and its `FlopCounterMode` counts FLOPs only. On a
GPU the two rooflines are compared op by op (measure/torch_roofline.py, run by the GPU tier).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from megalm import compat
from megalm.measure.storage import in_sharding_propagation, is_higher_order, storage_identity


@dataclass(frozen=True)
class Gpu:
    """Dense peak throughput and memory bandwidth of one GPU (vendor datasheets; SXM parts)."""

    name: str
    bf16_tflops: float  # dense bf16/fp16 tensor cores
    fp8_tflops: float  # dense fp8 tensor cores
    tf32_tflops: float  # dense tf32 tensor cores (fp32 GEMMs with precision.tf32)
    hbm_tbytes_per_s: float
    capability: tuple[int, int]  # CUDA compute capability: which kernels megalm picks on it (FP8 GEMMs from 8.9)


GPUS = {  # NVIDIA datasheets: H100 SXM5, H200 SXM, A100 SXM4 80GB, B200 (HGX B200, per GPU)
    "h100": Gpu("H100 SXM5", 989.4, 1978.9, 494.7, 3.35, (9, 0)),
    "h200": Gpu("H200 SXM", 989.4, 1978.9, 494.7, 4.8, (9, 0)),
    "a100": Gpu("A100 SXM4 80GB", 312.0, 0.0, 156.0, 2.039, (8, 0)),
    "b200": Gpu("B200", 2250.0, 4500.0, 1100.0, 8.0, (10, 0)),
}

CATEGORIES = ("gemm", "attention", "cast/copy", "elementwise/other", "loss", "optimizer", "communication")
REPORTED = CATEGORIES[:5]  # in every summary, zero or not (a compiled loss is inductor's generated kernels)
# megalm's FP8/MX linears in compiled blocks are opaque ops (megalm/precision/compiled_linear.py), priced as GEMMs
_RECIPE_GEMMS = {"recipe_linear": 2, "recipe_linear_backward": 4, "fp8_linear": 2, "fp8_linear_backward": 4}
_GEMM = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm", "matmul", "linear",
         *_RECIPE_GEMMS}
_CAST_COPY = {"_to_copy", "copy_", "copy", "clone", "_copy_from", "_copy_from_and_resize", "contiguous", "cat",
              "stack", "index_select", "gather", "scatter", "scatter_add_", "embedding", "embedding_dense_backward",
              "fill_", "zero_", "zeros", "zeros_like", "new_zeros", "full", "ones_like", "index_put_", "masked_fill_"}
_ACCUMULATING_GEMMS = {"addmm", "addmm_", "baddbmm", "baddbmm_"}  # C + A B: the peak is A's and B's (an fp32 C)
_NO_KERNEL_NAMESPACES = {"prim", "profiler"}  # tensor metadata queries (prim::device), profiler markers
_NO_KERNEL = {"detach", "lift_fresh", "_local_scalar_dense", "item",  # a host read (of a CPU handle: no sync)
              "wait_tensor",  # a functional collective's wait: the stream waits on the collective, no kernel runs
              "_record_function_enter_new", "_record_function_exit",
              "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",  # allocations: no kernel runs
              # a view whose schema says it is not one (F.linear on a 3-D input: mm, then this), and in-place
              # changes of a tensor's shape or strides: metadata only (priced as a read and write of the tensor, they
              # were 37 of the HF row's kernels and 4% of its bytes at the tiny model)
              "_unsafe_view", "t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "set_", "detach_"}
# Ops that write their output without reading any tensor argument (a fill); and in-place ops whose destination (the
# first argument) is overwritten, not read. Without these a copy into an fp32 gradient bucket was priced as reading
# the bucket too, 4 of its 10 bytes per element.
_WRITE_ONLY = {"zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "new_zeros", "new_ones", "new_full",
               "fill_", "zero_"}
_OVERWRITES_DESTINATION = {"copy_", "_foreach_copy_"}
# Arguments an op writes without reading them: megalm's Triton AdamW (megalm::adamw_step) writes the bf16 working
# copy from the updated weight in registers
_WRITE_ONLY_ARGUMENTS = {"adamw_step": {"work"}}
# In-place ops that return nothing write what their schema marks as written, except where it marks more than the
# kernel writes: the fused optimizers' schemas mark the gradients too (unscaled in place only with a `grad_scale`:
# a grad scaler's, or megalm's clip coefficient, megalm/parallel/parallelism.py).
_WRITES = {"_fused_adamw_": ("self", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"),
           "_fused_adam_": ("self", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"),
           "_fused_sgd_": ("self", "momentum_buffer_list")}
_LOSS = ("nll_loss", "log_softmax", "_log_softmax", "cross_entropy", "logsumexp")
# torch.distributed's ops: eager code's (`c10d`, the group boxed) and the functional ones compiled graphs and DTensor
# call. Their time is their link's, which the caller prices from the bytes they move (megalm/estimate/collectives.py),
# so here they count as kernels of 0 ms: priced as a read and a write of their buffers at HBM bandwidth too, every
# collective had been counted twice (a tp8 SP 1.3B step's compute 20% too long, found 2026-12-05)
COMMUNICATION_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})


def category(op: str, namespace: str = "aten") -> str:
    """The cost category of an op name (without overload) of `namespace`: gemm, attention, cast/copy, loss,
    optimizer, communication, or elementwise/other."""
    if namespace in COMMUNICATION_NAMESPACES:
        return "communication"
    if op in _GEMM or op.endswith("_") and op[:-1] in _GEMM:  # in place too (addmm_)
        return "gemm"
    if "attention" in op or "flash" in op or "_efficient_attention" in op or "cudnn_attention" in op:
        return "attention"
    if op.startswith(_LOSS):
        return "loss"
    if op.startswith(("_fused_adam", "_fused_sgd", "adamw_step")) or op.startswith("_foreach_") and "norm" not in op:
        return "optimizer"
    if op in _CAST_COPY:
        return "cast/copy"
    return "elementwise/other"


def _attention_flops(name: str, args: tuple, kwargs: dict) -> float | None:
    """FLOPs of the SDPA kernels torch's flop counter has no formula for (the CPU flash kernel and its backward):
    QK^T and PV, 2 * b * h * s_q * s_k * d each, forward; the backward's four GEMMs are twice that. A causal call
    computes half the square (flash kernels skip the masked blocks), so its FLOPs are halved; torch's own SDPA
    formulas count the whole square, causal or not."""
    if name == "_scaled_dot_product_flash_attention_for_cpu":
        q, k, causal = args[0], args[1], _arg(args, kwargs, 4, "is_causal")
    elif name == "_scaled_dot_product_flash_attention_for_cpu_backward":
        q, k, causal = args[1], args[2], _arg(args, kwargs, 7, "is_causal")
    else:
        return None
    b, h, s_q, d = q.shape
    forward = 4.0 * b * h * s_q * k.shape[-2] * d * (0.5 if causal else 1.0)
    return forward if name.endswith("_cpu") else 2 * forward


# torch's attention kernels whose FLOP formulas (torch.utils.flop_counter) count the whole square, causal or not
CAUSAL_HALVED = frozenset({
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward"})


def causal_attention(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call of one of torch's attention kernels (`CAUSAL_HALVED`) is causal: its `is_causal` argument, or
    a `custom_mask_type` other than 0 (none) for the efficient kernels; read by name from the op's schema."""
    if func._overloadpacket.__name__ not in CAUSAL_HALVED:
        return False
    for argument, value in _arguments(func, args, kwargs):
        if argument.name == "is_causal" or argument.name == "custom_mask_type":
            return bool(value)
    return False


def _recipe_gemm_operands(name: str, args: tuple) -> list[torch.Tensor] | None:
    """The matrices of one of megalm's compiled FP8/MX linear ops (megalm/precision/compiled_linear.py): [x, weight]
    for a forward (x [T, in], FP8 under `fp8_linear`), [dy, x, weight] for a backward; None for any other op."""
    if name not in _RECIPE_GEMMS:
        return None
    return [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2]


def _grouped_gemm_flops(name: str, args: tuple, out: torch.Tensor) -> float | None:
    """FLOPs of a grouped GEMM (MoE experts; torch's flop counter has no formula): 2 · Σ_g m_g · k_g · n_g. With a
    3-d operand the groups stack along the output's rows or columns, or along a batch dim, and k is the first
    operand's last dim: 2 · out.numel() · k. Two 2-d operands are grouped along k (the weight gradient, one [m, n]
    output per group): 2 · m · K · n."""
    if name not in ("_grouped_mm", "_scaled_grouped_mm"):
        return None
    a, b = args[0], args[1]
    if a.dim() == 2 and b.dim() == 2:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2.0 * out.numel() * a.shape[-1]


def _arg(args: tuple, kwargs: dict, position: int, name: str):  # noqa: ANN202 - any argument
    return args[position] if len(args) > position else kwargs.get(name, False)


def _arguments(func: Any, args: tuple, kwargs: dict) -> Iterator[tuple[Any, Any]]:
    """(schema argument, value) of each argument the op was given."""
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args):
            yield argument, args[i]
        elif argument.name in kwargs:
            yield argument, kwargs[argument.name]


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _read_operands(func: Any, name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op reads: its tensor arguments, less its `out=` tensors, the destination an op overwrites
    (`copy_`), and everything for a fill or an `x.new_*` (which takes x's dtype and device only)."""
    if name in _WRITE_ONLY or name.startswith("new_"):
        return []
    skipped = {"self"} if name in _OVERWRITES_DESTINATION else set(_WRITE_ONLY_ARGUMENTS.get(name, ()))
    if name in _ACCUMULATING_GEMMS and kwargs.get("beta", 1) == 0:  # beta = 0: C is not read
        skipped.add("self")
    return [t for argument, value in _arguments(func, args, kwargs)
            if not argument.is_out and argument.name not in skipped for t in _tensors(value)]


# Ops that read or write only the elements their indices name, not the whole tensor they index
_GATHERS = {"gather": "self", "index_select": "self", "embedding": "weight"}  # read out.numel() elements of it
_SCATTERS_IN_PLACE = {"scatter_": "src", "scatter_add_": "src", "index_add_": "source", "index_put_": "values",
                      "index_copy_": "source"}  # write (and, adding, read) as many elements of self as they are given
_ADDING = {"scatter_add_", "index_add_"}
_NLL_LOSS = ("nll_loss_forward", "nll_loss_backward")  # (nll_loss2d's are priced whole)


def indexed_bytes(func: Any, args: tuple, kwargs: dict, out: object) -> tuple[int, int] | None:
    """(bytes read, bytes written) of an op that touches only the elements its indices name (`_GATHERS`,
    `_SCATTERS_IN_PLACE`, the loss's `nll_loss_forward`, which reads one logit a row, and `nll_loss_backward`, which
    reads no logit), or None for any other op: priced as reading and writing whole tensors, the loss's gathers and
    scatters had cost a full pass over the [T, V] logits each. Every other tensor argument (the indices, ...) is read
    whole."""
    name = func._overloadpacket.__name__
    indexed = _GATHERS.get(name) or ("self" if name in _SCATTERS_IN_PLACE or name in _NLL_LOSS else None)
    if indexed is None:
        return None
    arguments = {argument.name: value for argument, value in _arguments(func, args, kwargs)}
    target = arguments.get(indexed)
    if not isinstance(target, torch.Tensor):
        return None
    others = sum(_nbytes(t) for key, value in arguments.items() if key != indexed for t in _tensors(value))
    outputs = _tensors(out)
    if name in _GATHERS:
        return others + outputs[0].numel() * target.element_size(), sum(_nbytes(t) for t in outputs)
    if name == "nll_loss_forward":  # one logit a target
        return others + arguments["target"].numel() * target.element_size(), sum(_nbytes(t) for t in outputs)
    if name == "nll_loss_backward":  # the gradient's [T, V] written whole (zeros, then the targets' column)
        return others, sum(_nbytes(t) for t in outputs)
    elements = _indexed_elements(name, target, arguments)
    if elements is None:
        return None
    nbytes = elements * target.element_size()
    adding = name in _ADDING or name == "index_put_" and bool(arguments.get("accumulate"))
    return others + (nbytes if adding else 0), nbytes


def _indexed_elements(name: str, target: torch.Tensor, arguments: dict[str, Any]) -> int | None:
    """How many elements of `target` an in-place scatter writes: those it is given, or, for index_put_ (whose
    values broadcast), those its indices name; None where that depends on the data (a boolean mask)."""
    if name == "index_put_":
        indices = list(arguments.get("indices") or [])
        if any(i is not None and i.dtype == torch.bool for i in indices):
            return None
        named = [i for i in indices if i is not None]
        rows = math.prod(torch.broadcast_shapes(*[i.shape for i in named])) if named else 1
        whole = [size for i, size in zip(indices, target.shape, strict=False) if i is None]  # x[:, idx]: all of dim 0
        return rows * math.prod(whole) * math.prod(target.shape[len(indices):])
    given = arguments.get(_SCATTERS_IN_PLACE[name])
    if not isinstance(given, torch.Tensor):  # a scalar value (scatter_.value): one element an index
        given = arguments.get("index")
    return given.numel() if isinstance(given, torch.Tensor) else None


def reads_every_argument(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether OpCosts prices op `func` as reading every tensor it is given (not: a fill, a destination it
    overwrites, an `out=` tensor, the accumulator of a GEMM with beta = 0)."""
    return len(_read_operands(func, func._overloadpacket.__name__, args, kwargs)) == len(_tensors((args, kwargs)))


def _written_in_place(func: Any, name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """What an in-place op that returns nothing (`_foreach_*_`, the fused optimizers) writes."""
    written = _WRITES.get(name)
    arguments = list(_arguments(func, args, kwargs))
    if written is not None and any(a.name == "grad_scale" and v is not None for a, v in arguments):
        written = (*written, "grads")  # divided by the scale and stored back
    return [t for argument, value in arguments
            if (argument.name in written if written is not None
                else argument.alias_info is not None and argument.alias_info.is_write) for t in _tensors(value)]


# megalm's opaque ops inside compiled blocks (megalm/model/deferred_wgrad.py) whose Python bodies cost traces run op
# by op: on fake tensors the op would run its fake kernel, which makes its output's shape only: no GEMM to price, and no
# side effect (a weight gradient handed to a zero-bubble W action, or added into its main gradient)
# torch's fused collective GEMMs of symmetric memory, which async TP's pass puts in compiled blocks
# (megalm/parallel/tensor/async_tp.py): the collective and the GEMM inside
FUSED_COLLECTIVE_GEMMS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")
TRACED_THROUGH = frozenset({"megalm::deferred_fprop", "megalm::deferred_dgrad",
                            *(f"symm_mem::{name}" for name in FUSED_COLLECTIVE_GEMMS)})


def launches_no_kernel(op: str) -> bool:
    """Whether the op named `op` (its packet's name, no namespace or overload) runs no kernel: an allocation, a host
    read, a functional collective's wait."""
    return op in _NO_KERNEL


def dispatches_no_kernel(func: Any) -> bool:
    """Whether op overload `func` runs no kernel: a view, a metadata query, a profiler marker, `launches_no_kernel`."""
    return func.is_view or func.namespace in _NO_KERNEL_NAMESPACES or launches_no_kernel(func._overloadpacket.__name__)


def is_traced_through(func: Any) -> bool:
    """Whether the op overload `func` is one of TRACED_THROUGH (a higher-order op, say an rng wrapper, is none)."""
    return isinstance(func, torch._ops.OpOverload) and _op_key(func) in TRACED_THROUGH


def _op_key(func: Any) -> str:
    return f"{func.namespace}::{func._overloadpacket.__name__}"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def one_kernel(name: str, category: str = "cast/copy") -> Iterator[Callable[[float], None]]:
    """The ops inside count as one memory-bound kernel `name` of the bytes handed to the yielded `moved(nbytes)`:
    a kernel the GPU runs fused (a compiled FP8 cast) traced here as its eager twin, whose intermediate copies the
    GPU never writes. Nothing changes where no OpCosts trace is on (the traces are the dispatch modes in force)."""
    traces = [mode for mode in _get_current_dispatch_mode_stack() if isinstance(mode, OpCosts)]
    moved: list[float] = []
    with contextlib.ExitStack() as stack:
        for trace in traces:
            stack.enter_context(trace.recording_only(set()))
        yield moved.append
    for trace in traces:
        trace.add_kernel(name, sum(moved), category)


def _next_sequence_nr() -> int:
    """The sequence number autograd gives the next node it makes on this thread (nodes are numbered in the order they
    are made): that of a view made now, which no trace counts as a kernel."""
    with torch.enable_grad():
        return torch.empty(0, requires_grad=True).view(-1).grad_fn._sequence_nr() + 1


@dataclass
class CategoryCost:
    kernels: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    ms: float = 0.0


class OpCosts(TorchDispatchMode):
    """Kernels, FLOPs, bytes and roofline milliseconds on `gpu` of every op dispatched under it, per category
    and per op. `tf32`: fp32 GEMMs run on TF32 tensor cores (megalm's `precision.tf32`), else at 1/8 of that."""

    def __init__(self, gpu: Gpu = GPUS["h100"], tf32: bool = True) -> None:
        super().__init__()
        self.gpu, self.tf32 = gpu, tf32
        self.by_category: dict[str, CategoryCost] = defaultdict(CategoryCost)
        self.by_op: dict[str, CategoryCost] = defaultdict(CategoryCost)
        self._only: set[str] | None = None  # while set, only these ops are recorded (`recording_only`)
        self._counted_as: str | None = None  # while set, memory-bound ops count under it (`call_counted_as`)
        self._backward_as: dict[Any, str] = {}  # autograd node -> the category of the ops its backward runs
        self._fp8_weights: set[int] = set()  # the weights whose FP8 copies compiled FP8 linears made in this trace
        self._depth = 0  # how many `_reentered` blocks are open

    def __exit__(self, *exc: object) -> None:
        if not self._depth:  # the outermost exit, not `_reentered`'s
            self._backward_as.clear()  # the nodes `call_counted_as` named, and through their edges the step's graph
        super().__exit__(*exc)

    @contextlib.contextmanager
    def _reentered(self) -> Iterator[None]:
        """This mode active again inside its own `__torch_dispatch__` (where torch pops it), to price the ops a
        traced-through op's body runs; leaving it keeps the trace's state."""
        self._depth += 1
        try:
            with self:
                yield
        finally:
            self._depth -= 1

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let a compiled function run under this mode instead of falling back to eager (dynamo skips frames under
        any other dispatch mode): its graphs count themselves in (megalm/measure/compiled_cost.py)."""
        return True

    supports_higher_order_operators = True  # run through uncounted (measure.storage.is_higher_order)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if is_higher_order(func):
            return func(*args, **kwargs)
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            # a tensor subclass wrapping others (torchao's FP8 training tensor, FSDP's DTensor parameters) is priced by
            # the ops its own dispatch runs on them, which come back here (a cast, `torch._scaled_mm`, a local shard's
            # update), not as one op at the wrapper's dtype and global size
            return NotImplemented
        body = compat.custom_op_body(_op_key(func)) if is_traced_through(func) else None
        if body is not None:  # its own ops are priced, all of them (a compiled graph's replay too)
            previous, self._only = self._only, None
            try:
                with self._reentered():
                    return body(*args, **kwargs)
            finally:
                self._only = previous
        if func._overloadpacket.__name__ in ("linear", "matmul"):  # composite ops a traced body calls: their GEMMs
            with self._reentered():
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if dispatches_no_kernel(func) or in_sharding_propagation():
            return out
        name = func._overloadpacket.__name__
        if self._only is not None and name not in self._only:
            return out
        inputs = _read_operands(func, name, args, kwargs)
        outputs = _tensors(out) or _written_in_place(func, name, args, kwargs)
        read = sum(_nbytes(t) for t in inputs)
        written = sum(_nbytes(t) for t in outputs)
        if (indexed := indexed_bytes(func, args, kwargs, out)) is not None:
            read, written = indexed
        # an in-place GEMM (addmm_, a fused weight gradient's CPU form) has its out-of-place twin's formula
        formula = flop_registry.get(func._overloadpacket) or flop_registry.get(
            getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") and name[:-1] in _GEMM else None)
        flops = _attention_flops(name, args, kwargs)
        if flops is None:
            flops = _grouped_gemm_flops(name, args, outputs[0]) if outputs else None
        if flops is None:
            # (the `out_dtype` overloads of mm/addmm pass a dtype where torch's formula takes its output shape)
            shapes = [a for a in args if not isinstance(a, torch.dtype)]
            flops = float(formula(*shapes, **kwargs, out_val=out)) if formula is not None else 0.0
            if causal_attention(func, args, kwargs):  # flash kernels skip the masked blocks: half the square
                flops /= 2
        matrices = _recipe_gemm_operands(name, args)
        if matrices is not None:  # GEMMs out of sight of torch's flop counter (their fake kernels compute nothing):
            # 2·T·in·out forward, twice that backward, at the peak of their operands (FP8 where `fp8_linear` takes
            # FP8 x and dy; `recipe_linear` casts inside, at its activations' dtype)
            x, weight = matrices[-2:]
            flops = float(_RECIPE_GEMMS[name] * x.shape[0] * x.shape[1] * weight.shape[0])
            inputs = matrices
            if name.startswith("fp8_linear"):  # its GEMMs read the layer's FP8 copy of the weight, 1 byte each
                read -= _nbytes(weight) - weight.numel()
                self._fp8_weight_copies(weight)
        gemm_operands = [a for a in args[1:3] if isinstance(a, torch.Tensor)] if name in _ACCUMULATING_GEMMS else inputs
        # the multiplied operands' peak
        self._add(name, flops, read + written, self._peak_flops(gemm_operands), category(name, func.namespace))
        return out

    def _fp8_weight_copies(self, weight: torch.Tensor) -> None:
        """The FP8 copies `megalm::fp8_linear` makes of a weight inside, once per optimizer step (the layer's cache,
        megalm/precision/layer_state.py), counted at the first use of the weight in this trace (one step): current
        scaling's amax and cast (the weight read twice, 1 byte written), and where FP8 GEMMs run, dgrad's
        column-major copy."""
        if storage_identity(weight) in self._fp8_weights:
            return
        self._fp8_weights.add(storage_identity(weight))
        self.add_kernel("fp8_weight_cast", 2 * _nbytes(weight) + weight.numel(), "cast/copy")
        if self.gpu.fp8_tflops:
            self.add_kernel("fp8_weight_column_major", 2 * weight.numel(), "cast/copy")

    def _peak_flops(self, inputs: list[torch.Tensor]) -> float:
        """The tensor-core peak of a GEMM's input dtype (FLOP/s): its narrowest floating dtype, as an aten GEMM's
        operands share theirs and a wider input beside them is an auxiliary one (an attention backward's fp32
        logsumexp, a scale), whose dtype had priced the attention backward at TF32's half rate."""
        dtypes = {t.dtype for t in inputs if t.is_floating_point()}
        if dtypes & {torch.float8_e4m3fn, torch.float8_e5m2} and self.gpu.fp8_tflops:
            return self.gpu.fp8_tflops * 1e12
        if dtypes & {torch.bfloat16, torch.float16}:
            return self.gpu.bf16_tflops * 1e12
        return (self.gpu.tf32_tflops if self.tf32 else self.gpu.tf32_tflops / 8) * 1e12

    @property
    def recording_every_op(self) -> bool:
        """False inside `recording_only` (a compiled graph's replay, `one_kernel`'s fused region)."""
        return self._only is None

    @contextlib.contextmanager
    def recording_only(self, names: set[str]) -> Iterator[None]:
        """Record only the ops named in `names` in this block (a compiled graph replayed eagerly: its other ops ran
        as the generated kernels `add_kernel` counted, megalm/measure/compiled_cost.py)."""
        previous, self._only = self._only, names
        try:
            yield
        finally:
            self._only = previous

    def call_counted_as(self, category: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` with its memory-bound kernels (elementwise, casts, a compiled graph's generated
        ones) counted under `category`, and so are those of the backward of every autograd node it made (from its
        output's back to its tensor arguments'): the loss, from the logits to the scalar, whichever ops compute it
        (torch's `nll_loss` in one system, chunks of `exp` and `sum` in another). GEMMs and collectives keep their
        own categories."""
        first = _next_sequence_nr()
        previous, self._counted_as = self._counted_as, category
        try:
            out = fn(*args, **kwargs)
        finally:
            self._counted_as = previous
        stack = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        while stack:
            node = stack.pop()
            if node is None or node in self._backward_as or not node.next_functions or node._sequence_nr() < first:
                continue  # made before the call (its inputs' history), or a leaf's AccumulateGrad (no next functions)
            self._backward_as[node] = category
            stack.extend(next_node for next_node, _ in node.next_functions)
        return out

    def _counted_category(self, cat: str) -> str:
        """`cat`, or the category a `call_counted_as` region gives a memory-bound kernel: while `fn` runs, or while
        the backward of a node it made runs."""
        if cat not in ("elementwise/other", "cast/copy", "loss"):
            return cat
        if self._counted_as is not None:
            return self._counted_as
        if self._backward_as:
            return self._backward_as.get(torch._C._current_autograd_node(), cat)
        return cat

    def add_kernel(self, name: str, nbytes: float, category: str) -> None:
        """One memory-bound kernel that was not dispatched here (a compiler's generated one, or its fallback)."""
        self._add(name, 0.0, nbytes, self.gpu.bf16_tflops * 1e12, category)

    def _add(self, name: str, flops: float, nbytes: float, peak: float, cat: str | None = None) -> float:
        """Count one kernel; returns its roofline milliseconds (0 for a collective: COMMUNICATION_NAMESPACES)."""
        cat = cat or category(name)
        ms = 0.0 if cat == "communication" else max(flops / peak, nbytes / (self.gpu.hbm_tbytes_per_s * 1e12)) * 1e3
        for bucket in (self.by_category[self._counted_category(cat)], self.by_op[name]):
            bucket.kernels += 1
            bucket.flops += flops
            bucket.bytes += nbytes
            bucket.ms += ms
        return ms

    def total(self) -> CategoryCost:
        out = CategoryCost()
        for c in self.by_category.values():
            out.kernels += c.kernels
            out.flops += c.flops
            out.bytes += c.bytes
            out.ms += c.ms
        return out

    def summary(self) -> dict:
        """{kernels, gbytes, tflop, roofline_ms, by_category: {name: {kernels, gbytes, tflop, ms}}}."""
        total = self.total()
        return {"kernels": total.kernels, "gbytes": total.bytes / 1e9, "tflop": total.flops / 1e12,
                "roofline_ms": total.ms,
                "by_category": {name: {"kernels": c.kernels, "gbytes": c.bytes / 1e9, "tflop": c.flops / 1e12,
                                       "ms": c.ms}
                                for name in CATEGORIES if name in REPORTED or name in self.by_category
                                for c in [self.by_category.get(name, CategoryCost())]}}
