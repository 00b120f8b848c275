"""What a compiled block costs, read from inductor itself: a `torch.compile` backend for cost traces.

An eager trace (op_cost.py) cannot see what `torch.compile` fuses. `InductorCosts` is a backend that runs
inductor's real lowering, fusion and code generation on each graph (forward and backward, as AOT autograd splits
them) and keeps the kernels of inductor's scheduler: each generated kernel (a fused group of pointwise and
reduction ops: one launch) with the bytes inductor counts for it (`get_read_write_buffers_sizes`, what its own
`inductor_metrics` log reports), and the extern kernels it calls. The generated code is never run: under
`FakeTensorMode` there is no data to run it on. Instead the graph's aten ops run eagerly over the fake tensors,
inside the caller's `OpCosts`, which records from them only the GEMMs, attention and collectives inductor calls
as extern kernels (their FLOPs from torch's formulas); every other kernel, generated or a fallback to an aten op,
is counted with the bytes inductor's scheduler gives it.

On a CPU inductor generates C++ kernels where a GPU gets Triton ones; the fusion decisions are made by the same
scheduler, so kernel counts and bytes stand in for the GPU's (the caller says which device it traced).

Memory (under megalm.measure.LiveStorages): the replay makes every value of the graph, where the generated kernels
write only their buffers. So the replay is uncounted; the graph's outputs count from its end (the activations a
forward saves, the gradients a backward returns), and while it runs the peak of the buffers inductor allocates
(the generated kernels' and the extern ones': neither fused away nor written over an input), each live from the
kernel that writes it to the last that reads it, in inductor's order, on top of what was live before. The inputs
stay live throughout, as the replay holds them: inductor's code frees a backward's saved activations as it goes,
so a compiled backward's peak is an upper bound.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten

from megalm.measure.op_cost import OpCosts, category, is_traced_through, launches_no_kernel
from megalm.measure.storage import LiveStorages

REPLAYED = ("gemm", "attention", "communication")  # extern kernels whose FLOPs and bytes the eager replay traces


def _extern_name(node: Any) -> str:
    """The aten name of an extern kernel: `extern_kernels.mm` -> mm, `torch.ops.aten._foo.default` -> _foo."""
    kernel = getattr(node.node, "python_kernel_name", None) or type(node.node).__name__
    parts = str(kernel).split(".")
    return parts[-2] if parts[-1] in ("default", "Tensor", "out") and len(parts) > 1 else parts[-1]


def _extern_category(node: Any, name: str) -> str:
    """op_cost's category of an extern kernel named `name` (a collective by its op's namespace)."""
    op = getattr(node.node, "op_overload", None)
    return category(name, op.namespace if isinstance(op, torch._ops.OpOverload) else "aten")


def traced_through(node: Any) -> bool:
    """Whether an extern kernel is a custom op whose Python body the replay prices op by op (op_cost.TRACED_THROUGH)."""
    op = getattr(node.node, "op_overload", None)
    return op is not None and is_traced_through(op)


@contextlib.contextmanager
def _inductor_metrics_logged() -> Iterator[None]:
    """Turn on inductor's `inductor_metrics` artifact log (it makes inductor count each scheduler node's bytes into
    `torch._inductor.metrics.nodes_num_elem`) without printing it."""
    from torch._inductor import compile_fx

    logger = compile_fx.inductor_metrics_log
    level, propagate, handler = logger.level, logger.propagate, logging.NullHandler()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.setLevel(level)
        logger.propagate = propagate
        logger.removeHandler(handler)


@contextlib.contextmanager
def _buffer_peaks_recorded(record: list[int]) -> Iterator[None]:
    """While inside, each graph inductor schedules appends to `record` the peak bytes of the buffers its kernels
    allocate, live from the kernel that writes one to the last that reads it (inductor's own `last_usage`, where its
    generated code frees them); the graph's outputs stay live to its end, its inputs are the caller's. A value fused
    into a kernel is no buffer (`removed_buffers`), and a result written over an input has a mutation layout, which
    allocates nothing. Read where inductor counts its kernels' bytes (`GraphLowering.count_bytes`, under the
    inductor_metrics log), while the graph's sizes are known."""
    from torch._inductor import ir
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.count_bytes

    def count_bytes(graph: Any) -> Any:
        removed = set(graph.removed_buffers)
        # a size's value where it is symbolic: `optimization_hint` from torch 2.11 (2.13 has no `size_hint`)
        hint = getattr(graph.sizevars, "optimization_hint", None) or graph.sizevars.size_hint
        sizes: dict[str, int] = {}
        live = peak = 0
        for node in graph.scheduler.nodes:  # in execution order
            for buf in node.get_outputs():
                layout = getattr(buf.node, "layout", None)
                if buf.get_name() not in removed and isinstance(layout, ir.FixedLayout):
                    sizes[buf.get_name()] = hint(layout.storage_size(), fallback=0) * layout.dtype.itemsize
                    live += sizes[buf.get_name()]
            peak = max(peak, live)
            for name in node.last_usage:
                live -= sizes.pop(name, 0)
        record.append(peak)
        return original(graph)

    GraphLowering.count_bytes = count_bytes
    try:
        yield
    finally:
        GraphLowering.count_bytes = original


class InductorCosts:
    """A `torch.compile` backend: inductor's kernels per graph, counted into the `OpCosts` active when it runs.

    `graphs` lists, per compiled graph, its generated kernel count and their bytes, its fallback kernels and its
    GEMM/attention/collective extern kernels by name, and how many ops its last eager replay recorded
    (`extern_replayed`: the extern kernels' sum, unless one is an op the replay does not dispatch by that name).
    `options`: inductor config to compile with, as `torch.compile(options=...)` gives it (megalm's blocks:
    megalm.training.compile.inductor_options).
    """

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.graphs: list[dict[str, Any]] = []
        self.options = options

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, inner_compile=self._inner, config_patches=self.options)

    def _inner(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        from torch._inductor import metrics
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

        first, peaks = len(metrics.nodes_num_elem), []
        with _inductor_metrics_logged(), torch._inductor.config.patch(fx_graph_cache=False), \
                _buffer_peaks_recorded(peaks):  # a cache hit would skip the scheduler, and with it the kernels
            # counted here
            compile_fx_inner(gm, example_inputs, **kwargs)  # lowering, fusion, code generation; never run
        generated: list[float] = []  # bytes of each kernel inductor generates
        fallbacks: list[tuple[str, str, float]] = []  # (aten op, category, bytes) of the other kernels it calls
        extern = Counter()  # the GEMM/attention/collective kernels it calls, which the replay traces
        bodies = Counter()  # the custom ops whose Python bodies the replay runs op by op
        for node, _ in metrics.nodes_num_elem[first:]:
            if isinstance(node, NopKernelSchedulerNode) or type(getattr(node, "node", None)).__name__ == "MultiOutput":
                continue
            nbytes = float(node.get_read_write_buffers_sizes())
            if not isinstance(node, ExternKernelSchedulerNode):
                generated.append(nbytes)
            elif traced_through(node):  # its own ops are replayed and priced (op_cost.TRACED_THROUGH)
                bodies[_extern_name(node)] += 1
            elif _extern_category(node, name := _extern_name(node)) in REPLAYED:
                extern[name] += 1
            elif not (getattr(getattr(node.node, "op_overload", None), "is_view", False)  # a view launches nothing,
                      or launches_no_kernel(name)):  # nor an allocation, a host read or a collective's wait
                fallbacks.append((name, _extern_category(node, name), nbytes))
        graph = {"generated_kernels": len(generated), "generated_bytes": sum(generated),
                 "fallback_kernels": dict(Counter(name for name, _, _ in fallbacks)), "extern": dict(extern),
                 "traced_through": dict(bodies),
                 "peak_buffer_bytes": sum(peaks)}
        self.graphs.append(graph)
        kernels = [("inductor_generated", "elementwise/other", nbytes) for nbytes in generated] + fallbacks

        def run(args: list) -> Any:
            modes = _get_current_dispatch_mode_stack()
            costs = next((m for m in reversed(modes) if isinstance(m, OpCosts)), None)
            probe = next((m for m in reversed(modes) if isinstance(m, LiveStorages)), None)
            if probe is not None:  # inductor's buffers, not the replay's values (the module docstring)
                with probe.uncounted():
                    out = _counted_run(costs, args)
                outputs, inputs = ([t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)] for x in (out, args))
                if outputs or inputs:
                    probe.note_transient(graph["peak_buffer_bytes"], (outputs or inputs)[0].device.type)
                probe.track(outputs)
                return out
            return _counted_run(costs, args)

        def _counted_run(costs: OpCosts | None, args: list) -> Any:
            if costs is None:
                return gm(*args)
            for name, cat, nbytes in kernels:
                costs.add_kernel(name, nbytes, cat)
            def replayed() -> int:  # by name: the FP8 weight copies an `fp8_linear` adds count apart
                return sum(costs.by_op[name].kernels for name in extern if name in costs.by_op)

            before = replayed()
            with costs.recording_only(set(extern)):
                out = gm(*args)
            # the replay dispatches the extern kernels inductor calls; a count that differs is reported
            graph["extern_replayed"] = replayed() - before
            return out

        run._boxed_call = True  # type: ignore[attr-defined]  # inductor's calling convention: one list of args
        return run


def _buffer_shape(graph: Any, name: str) -> str:
    """`dtype[sizes]` of a buffer or graph input of the graph being lowered ("?" where this torch hides it)."""
    buf = graph.name_to_buffer.get(name) or graph.graph_inputs.get(name)
    try:
        hint = getattr(graph.sizevars, "optimization_hint", None) or graph.sizevars.size_hint
        return f"{str(buf.get_dtype()).removeprefix('torch.')}{[int(hint(s, fallback=0)) for s in buf.get_size()]}"
    except (AttributeError, TypeError, ValueError, NotImplementedError):  # a multi-output op's result, a symbol
        return "?"


def _kernel_of(graph: Any, node: Any) -> dict[str, Any] | None:
    """One scheduler node as `inductor_kernels_recorded` lists it; None for one that launches nothing."""
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    if isinstance(node, NopKernelSchedulerNode) or type(getattr(node, "node", None)).__name__ == "MultiOutput":
        return None
    ops = sorted({str(origin.target).removeprefix("aten.").removesuffix(".default")
                  for part in node.get_nodes() for origin in (getattr(part.node, "origins", None) or ())
                  if origin.op == "call_function"})
    return {"kernel": f"extern {_extern_name(node)}" if isinstance(node, ExternKernelSchedulerNode) else "generated",
            "bytes": int(node.get_read_write_buffers_sizes()),
            "reads": sorted({f"{dep.name}: {_buffer_shape(graph, dep.name)}" for dep in node.read_writes.reads}),
            "writes": sorted({f"{dep.name}: {_buffer_shape(graph, dep.name)}" for dep in node.read_writes.writes}),
            "ops": ops}


@contextlib.contextmanager
def inductor_kernels_recorded(graphs: list[dict[str, Any]]) -> Iterator[None]:
    """While inside, each graph inductor compiles, on any device, appends to `graphs` {"backward": bool, "kernels":
    [...]}: its kernels in inductor's order, each with `kernel` ("generated", or "extern <aten op>"), `bytes` (what
    inductor's scheduler counts it to read and write: `get_read_write_buffers_sizes`, the count step_cost.py sums),
    the buffers it `reads` and `writes` ("name: dtype[sizes]") and the aten `ops` fused into it. On a GPU these are
    Triton's kernels, the fusion decisions this CPU's trace can only stand in for (tools/bench/inductor_kernels.py).
    Inductor's caches are off inside (a hit skips the scheduler); its compiled code runs as usual."""
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.count_bytes

    def count_bytes(graph: Any) -> Any:
        kernels = [kernel for node in graph.scheduler.nodes if (kernel := _kernel_of(graph, node)) is not None]
        graphs.append({"backward": bool(getattr(graph, "is_backward", False)), "kernels": kernels})
        return original(graph)

    caches = {"fx_graph_cache": False}
    autograd_cache = hasattr(torch._functorch.config, "enable_autograd_cache")
    GraphLowering.count_bytes = count_bytes
    try:
        with _inductor_metrics_logged(), torch._inductor.config.patch(caches), \
                (torch._functorch.config.patch(enable_autograd_cache=False) if autograd_cache
                 else contextlib.nullcontext()):
            yield
    finally:
        GraphLowering.count_bytes = original
