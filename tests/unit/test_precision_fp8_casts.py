"""Under per-tensor FP8 scales each activation of a linear layer is cast to FP8 once per call, and the backward keeps
that FP8 x instead of x.

A per-tensor scale does not depend on the GEMM's K dim, so dgrad's FP8 dy is wgrad's too, and fprop's FP8 x is
wgrad's: casting them again reads 2 bytes and writes 1 per element for values already in memory. The layer's
backward keeps the FP8 x (1 byte per element, through autograd's saved tensors, which offload and recomputation
see) in place of x. Per-row scales run along K and differ per GEMM: there every GEMM casts its own operands, and
x is kept. The casts are counted at `fp8._run` (every FP8 cast passes it) and what the backward keeps by autograd's
saved-tensor hooks, on the eager path and on the compiled one (the recipe's op pair, compiled_linear.py).
"""

from __future__ import annotations

import re

import pytest
import torch

from megalm import compat
from megalm.model.linear import Linear, linear
from megalm.parallel.tensor.comm import Pending, SequenceGather
from megalm.precision import fp8
from megalm.precision.amax_history import AmaxHistory
from megalm.precision.layer_state import LinearState, set_steps
from megalm.precision.linear import RecipeGemms
from megalm.precision.recipes import get_recipe
from tests.conftest import LaunchedOps

E4M3 = torch.float8_e4m3fn
FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}


def _layer(recipe: str) -> Linear:
    torch.manual_seed(0)
    layer = Linear(64, 32, bias=False)
    state = LinearState("layer")
    layer.gemm_recipe = RecipeGemms(get_recipe(recipe), state, weight=layer.weight)
    state.weights_version.watch(torch.optim.SGD(layer.parameters(), lr=0.1))  # the weight's copy is cached
    return layer


def _activation_casts(monkeypatch, layer: Linear) -> list[tuple[str, tuple]]:
    """(phase, shape) of every FP8 cast of an activation (the weight's cached copy left out)."""
    casts: list[tuple[str, tuple]] = []
    real = fp8._run

    def counting(kind, x, dtype, scale):
        if x.data_ptr() != layer.weight.data_ptr():
            casts.append(("backward" if torch._C._current_autograd_node() is not None else "forward",
                          tuple(x.shape)))
        return real(kind, x, dtype, scale)

    monkeypatch.setattr(fp8, "_run", counting)
    return casts


def _step(layer: Linear, forward=None, tokens: int = 16) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """One forward and backward of [tokens, 64] -> [tokens, 32]: (the tensors the backward kept, (y, dx, dW))."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 64, generator=gen).bfloat16().requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = (forward or layer)(x)
    y.backward(torch.randn(y.shape, generator=gen).bfloat16())
    return saved, (y.detach(), x.grad, layer.weight.grad)


def test_each_activation_is_cast_once_and_the_backward_keeps_fp8_x(monkeypatch):
    layer = _layer("fp8")
    _step(layer)  # the weight's copies are made in this first step
    casts = _activation_casts(monkeypatch, layer)
    layer.weight.grad = None
    saved, (y, dx, dw) = _step(layer)
    assert casts == [("forward", (16, 64)), ("backward", (16, 32))], "x once (fprop), dy once (dgrad)"
    inputs = [t for t in saved if t.shape == (16, 64)]
    assert [t.dtype for t in inputs] == [E4M3], "the backward keeps fprop's FP8 x, not the bf16 x"

    # the values are those of casting again: the same tensors under the same scales
    monkeypatch.setattr(RecipeGemms, "pack_input", lambda self, call: call.operands.clear())
    monkeypatch.setattr(RecipeGemms, "_keep", staticmethod(lambda call, key, operand: operand))
    layer.weight.grad = None
    saved_again, again = _step(layer)
    assert [t.dtype for t in saved_again if t.shape == (16, 64)] == [torch.bfloat16]
    for got, want in zip((y, dx, dw), again, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("recipe", "on_scaled_mm"), [
    ("fp8", ["fprop", "dgrad", "wgrad"]), ("fp8_delayed", ["fprop", "dgrad", "wgrad"]),
    ("fp8_rowwise", ["fprop"]),  # per-row E5M2 dy has no torch._scaled_mm kernel: dgrad and wgrad are emulated
])
def test_on_scaled_mm_the_forward_gemm_accumulates_fast_and_the_gradients_promote(recipe, on_scaled_mm,
                                                                                 scaled_mm_on_cpu, monkeypatch):
    """As Transformer Engine's fp8 recipes and torchao's float8 (TorchTitan's) run them: fprop with the tensor cores'
    fast accumulation, dgrad and wgrad promoting their partial sums to fp32 (fp8.py), in eager."""
    if recipe == "fp8_rowwise":
        q = torch.zeros(16, 16, dtype=E4M3)
        try:
            torch._scaled_mm(q, q.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
        except RuntimeError as error:
            pytest.skip(f"torch {torch.__version__}'s CPU torch._scaled_mm has no per-row scales: {error}"[:200])
    calls: list[tuple[str, bool]] = []
    real = torch._scaled_mm

    def recording(*args, **kwargs):
        phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
        calls.append((phase, kwargs.get("use_fast_accum", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    _step(_layer(recipe))
    phases = {"fprop": ("forward", True), "dgrad": ("backward", False), "wgrad": ("backward", False)}
    assert sorted(calls) == sorted(phases[gemm] for gemm in on_scaled_mm), calls


def test_delayed_scaling_casts_each_activation_once_too(monkeypatch):
    """Delayed scaling's scale is fixed within a step (`AmaxHistory`), so it keeps fprop's FP8 x as current scaling
    does: a recomputed forward would cast x with the same scale again (test_recomputation_changes_no_gradient)."""
    layer = _layer("fp8_delayed")
    _step(layer)
    layer.gemm_recipe.state.set_step(1)  # the history holds step 0's amaxes from here on
    casts = _activation_casts(monkeypatch, layer)
    saved, _ = _step(layer)
    assert casts == [("forward", (16, 64)), ("backward", (16, 32))]
    assert [t.dtype for t in saved if t.shape == (16, 64)] == [E4M3]


@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize("recipe", ["fp8", "fp8_delayed"])
def test_recomputation_changes_no_gradient(recipe, recompute):
    """Under activation checkpointing (megalm's full and selective modes) the backward's saved tensors come from a
    recomputed forward; the gradients equal those without it, step after step, also on a step whose input grew
    (delayed scaling's history has moved by then)."""
    from torch.utils.checkpoint import checkpoint

    from megalm.parallel.recompute import _selective_context

    context = {"context_fn": _selective_context} if recompute == "selective" else {}
    plain, recomputed = _layer(recipe), _layer(recipe)
    run = {id(plain): plain, id(recomputed): lambda x: checkpoint(recomputed, x, use_reentrant=False, **context)}
    for step, scale in enumerate((1.0, 8.0, 8.0)):
        grads = []
        for layer in (plain, recomputed):
            layer.gemm_recipe.state.set_step(step)
            layer.weight.grad = None
            x = (scale * torch.randn(16, 64, generator=torch.Generator().manual_seed(2))).bfloat16().requires_grad_()
            y = run[id(layer)](x)
            y.backward(torch.ones_like(y))
            grads.append((x.grad, layer.weight.grad))
        for a, b in zip(*grads, strict=True):
            assert torch.equal(a, b), (recipe, step)
    if recipe == "fp8_delayed":  # steps 0 and 1 in the history, each once (a recompute's amax changed nothing)
        histories = [layer.gemm_recipe.state.amax["x"] for layer in (plain, recomputed)]
        assert [h.count for h in histories] == [2, 2]
        assert torch.equal(histories[0].history, histories[1].history)


def test_the_call_lets_go_of_its_fp8_activations_after_the_backward():
    """The FP8 x and dy the GEMMs shared are held by the layer's autograd node (its call) for as long as the graph
    lives (the trainer keeps the last micro-batch's loss into the next forward): the backward lets go of them, with
    wgrad run now or deferred (zero-bubble's W). Counted by live storages (megalm.measure.LiveStorages)."""
    from megalm.measure import LiveStorages

    class Sink:
        def stash(self, param, compute):
            self.compute = compute

    for sink in (None, Sink()):
        layer = _layer("fp8")
        layer.weight_grad_sink = sink
        _step(layer)
        with LiveStorages() as live:
            x = torch.randn(16, 64).bfloat16().requires_grad_()
            y = layer(x)
            y.backward(torch.ones_like(y))
            kept = sum(t.numel() * t.element_size() for t in (y, x, x.grad)) + 2 * 4  # and the call's 2 scales
            if sink is not None:  # the deferred wgrad holds dy (bf16), the FP8 x and the FP8 dy until it runs
                assert live.bytes() == kept + 16 * 32 * 2 + 16 * 64 + 16 * 32
                compute, sink.compute = sink.compute, None  # as the pipeline's W action takes it
                compute()
                del compute
            assert live.bytes() == kept, "y, x, its gradient and the scales alone are left with the graph"


def test_per_row_scales_cast_per_gemm_and_keep_x(monkeypatch):
    layer = _layer("fp8_rowwise")
    _step(layer)
    casts = _activation_casts(monkeypatch, layer)
    saved, _ = _step(layer)
    assert sorted(casts) == sorted([("forward", (16, 64)), ("backward", (16, 32)), ("backward", (16, 32)),
                                    ("backward", (16, 64))]), "K differs per GEMM: each casts its own operands"
    assert [t.dtype for t in saved if t.shape == (16, 64)] == [torch.bfloat16]


class _IdentityGather(SequenceGather):
    """A sequence-parallel input gather over one rank (what the layer keeps is the shard)."""

    def __init__(self) -> None:
        super().__init__(None)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def start_gather(self, x: torch.Tensor) -> Pending:
        return Pending(x.clone())

    def start_scatter(self, dx: torch.Tensor) -> Pending:
        return Pending(dx)


def test_under_sequence_parallelism_the_shard_is_kept(monkeypatch):
    """The bf16 shard (2/tp bytes per element of the whole input) is smaller than a whole FP8 copy from tp = 2 on:
    the layer keeps it and gathers it again, and wgrad casts it with fprop's scale."""
    layer = _layer("fp8")
    gathered = lambda x: linear(x, layer.weight, None, layer.gemm_recipe, input_comm=_IdentityGather())
    _step(layer, gathered)
    casts = _activation_casts(monkeypatch, layer)
    saved, _ = _step(layer, gathered)
    assert casts == [("forward", (16, 64)), ("backward", (16, 32)), ("backward", (16, 64))]
    assert [t.dtype for t in saved if t.shape == (16, 64)] == [torch.bfloat16]


def _recording_backend(graphs: list[str]):
    """aot_eager that keeps each compiled graph's text (forward, then backward)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, _inputs):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def test_compiled_delayed_scaling_casts_in_the_graph_as_eager(monkeypatch):
    """`precision=fp8_delayed` in a compiled block (the trainer's: `prepared_weights` around it): x and dy are cast in
    the graphs with the scales the block's caller took from the histories (graph inputs: the cast is one pass, fused
    into its producer by inductor), and their amaxes come back to the histories as the gradient of the layer's sink.
    Step after step (the first scaled by the current amax, the next ones by the history, the input growing 8x) the
    outputs, gradients and histories are the eager layer's bit for bit, no cast runs outside the graphs, and the
    graph compiled for the first step is compiled once more, for the history's scales, and never again."""
    from megalm.precision.compiled_linear import prepared_weights

    eager_layer, layer = _layer("fp8_delayed"), _layer("fp8_delayed")
    graphs: list[str] = []
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=_recording_backend(graphs), fullgraph=True)
    casts = _activation_casts(monkeypatch, layer)
    by_layer: dict[int, list] = {id(eager_layer): [], id(layer): []}

    def run_compiled(x):
        with prepared_weights([layer]):
            return compiled(x)

    for step, scale in enumerate((1.0, 1.0, 8.0, 8.0)):
        outputs = []
        for one, forward in ((eager_layer, eager_layer), (layer, run_compiled)):
            one.gemm_recipe.state.set_step(step)
            one.weight.grad = None
            outputs.append(_step(one, lambda x, f=forward, s=scale: f(x * s))[1])
            by_layer[id(one)].extend(casts), casts.clear()
        want, got = outputs
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), step
        for name in ("x", "dy", "w"):
            ours, theirs = layer.gemm_recipe.state.amax[name], eager_layer.gemm_recipe.state.amax[name]
            ours.compact(), theirs.compact()
            assert ours.count == theirs.count == step, name
            assert len(ours.pending) == len(theirs.pending) == 1 and torch.equal(ours.pending[0], theirs.pending[0])
            assert step == 0 or torch.equal(ours.history, theirs.history), name
    activations = [shape for _, shape in by_layer[id(eager_layer)] if shape != tuple(layer.weight.shape)]
    assert activations == [(16, 64), (16, 32)] * 4, "the eager layer's casts of x and dy, counted"
    assert by_layer[id(layer)] == [], "the activations' casts run in the graphs, not as eager calls"
    assert len(graphs) == 4, "a forward and a backward graph for the first step's current amax, one pair after"
    forward, backward = graphs[2:]
    assert "torch.float8_e4m3fn" in forward and "torch.float8_e5m2" in backward
    for graph in (forward, backward):  # the cast scales by a graph input: no scale computed from the amax
        assert "aten.reciprocal" not in graph and "aten.div" not in graph, graph
    # the amaxes the histories take, beside the casts: x's in the forward (its amax saved, not bf16 x), dy's in the
    # backward
    assert "aten.amax.default" in backward
    assert "aten.amax.default" in forward, forward
    assert "aten.stack" in backward, "the call's amaxes, the sink's gradient"
    assert layer.gemm_recipe.graph_scales is None, "let go of after the block"


def test_compiled_per_tensor_fp8_casts_in_the_graph(monkeypatch):
    """`precision=fp8` (per-tensor current scaling) in a compiled block: the amax, scale and cast of x (forward) and
    of dy (backward) are ops of the compiled graphs, where inductor fuses them with their producers, and only the
    GEMMs are opaque ops; no cast runs outside the graphs, the backward keeps the FP8 x, and the numbers are the eager
    path's bit for bit."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    layer = _layer("fp8")
    _, eager = _step(layer)
    graphs: list[str] = []

    def record(gm, _inputs):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    casts = _activation_casts(monkeypatch, layer)
    layer.weight.grad = None
    saved, got = _step(compiled)
    assert casts == [], "the activations' casts run in the graphs, not as eager calls"
    forward, backward = graphs
    ops = torch.ops.megalm
    assert str(ops.fp8_linear.default) in forward and str(ops.fp8_linear_backward.default) in backward
    assert "torch.float8_e4m3fn" in forward and "torch.float8_e5m2" in backward
    for graph in (forward, backward):  # each cast's amax, in its graph: per row (which inductor fuses into the
        # producer's kernel, a norm or SwiGLU), then over the rows
        assert re.search(r"linalg_vector_norm\.default\]\(args = \(%\w+, inf, \[-1\], True\)", graph), graph
        assert "aten.amax.default" in graph
    assert any(t.dtype == E4M3 and t.shape == (16, 64) for t in saved)
    assert not any(t.dtype == torch.bfloat16 and t.shape == (16, 64) for t in saved)
    for a, b in zip(got, eager, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scaled", [False, True], ids=["current", "delayed"])
def test_the_graphs_cast_of_no_tokens_is_the_eager_ones(scaled):
    """A rank's micro-batch of no tokens ([0, h]): the compiled layers' cast takes an amax of 0 and a scale of 1, as
    the eager cast does; it raised (a max over no rows) where the eager path ran."""
    x = torch.randn(0, 64)
    scale = torch.tensor(4.0) if scaled else None
    q, got_scale, got_amax = fp8.quantize_in_graph(x, E4M3, scale)
    if scaled:  # (FP8 x, amax) with the history's scale
        (want_q, want_amax), want_scale = fp8.quantize_delayed(x, E4M3, scale), scale
    else:  # (FP8 x, the scale of its amax)
        (want_q, want_scale), want_amax = fp8.quantize_current(x, E4M3), torch.tensor(0.0)
    assert q.shape == want_q.shape == (0, 64) and q.dtype == want_q.dtype
    assert torch.equal(got_scale, want_scale) and torch.equal(got_amax, want_amax)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic_tokens"])
def test_inductor_hands_wgrad_its_operands_column_major(monkeypatch, dynamic):
    """torch._scaled_mm takes wgrad's operands (dy and x, contracted over the tokens) column-major: the compiled
    graph writes them so beside their casts (inductor's layout prim, as compiled blocks load it), and inductor keeps
    those layouts into the op (no transposing copy in it); the numbers are the eager path's bit for bit (inductor's
    cast is the eager math). dynamic_tokens: a token count that changes from call to call (unequal documents on
    CUDA), whose symbolic strides torch 2.11's lowering of the prim could not order (an InductorError on the GPU,
    2026-12-05): `compat.load_inductor_layout_prim` leaves those copies to a loop of their own there."""
    compat.load_inductor_layout_prim()
    layer = _layer("fp8")
    layouts = []
    real_wgrad = RecipeGemms.wgrad

    def wgrad(self, call, dy, x, out_dtype):
        layouts.append((dy.t().is_contiguous(), x.t().is_contiguous()))
        return real_wgrad(self, call, dy, x, out_dtype)

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="inductor", fullgraph=True, dynamic=dynamic)
    for tokens in (16, 24) if dynamic else (16,):
        layer.weight.grad = None
        _, eager = _step(layer, tokens=tokens)
        layer.weight.grad = None
        with monkeypatch.context() as patch:
            patch.setattr(RecipeGemms, "wgrad", wgrad)
            _, got = _step(compiled, tokens=tokens)
        for a, b in zip(got, eager, strict=True):
            assert torch.equal(a, b)
    assert layouts == [(True, True)] * (2 if dynamic else 1)


@pytest.mark.parametrize("apart", [False, True], ids=["in_the_cast", "apart"])
def test_the_throughput_tool_can_leave_the_column_major_copies_to_kernels_of_their_own(apart):
    """tools/bench/throughput.py --fp8-columns-apart, the GPU's A/B of inductor's layout prim: blocks compiled inside
    trace the column-major FP8 copies without the prim (a loop over the transposed shape), and the prim is back
    after it."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from tools.bench.throughput import columns_apart

    layer = _layer("fp8")
    graphs: list[str] = []

    def record(gm, _inputs):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compat.load_inductor_layout_prim()
    before = compat.inductor_force_strides
    with columns_apart(apart):
        compat.load_inductor_layout_prim()  # as compiling blocks does
        _step(torch.compile(layer, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True))
    assert before is not None and compat.inductor_force_strides is before
    assert ["inductor_force_stride_order" in graph for graph in graphs] == [not apart, not apart]


def test_the_layout_prim_is_kept_for_symbolic_strides_where_inductor_can_order_them():
    """compat's reading of inductor's lowering of the prim (whether it sorts the strides with the graph's shape env)
    against what compiling the prim over a changing token count does on the installed torch: read wrong, compiled FP8
    fails on unequal documents (torch 2.11) or gives up the fused copy where the prim works (torch 2.13)."""
    import torch._inductor.inductor_prims  # noqa: F401 - registers the prim

    prim = torch.ops.prims.inductor_force_stride_order

    def columns(x: torch.Tensor) -> torch.Tensor:
        q = (x * 2).to(E4M3)
        return prim(fp8.column_major(q), [1, q.shape[0]])

    torch._dynamo.reset()
    try:
        torch.compile(columns, dynamic=True, fullgraph=True)(torch.randn(48, 64))
        orders = True
    except Exception as error:  # inductor's error, wrapped by dynamo's backend
        if "cannot determine truth value of Relational" not in str(error):
            raise
        orders = False
    assert compat._lowering_orders_symbolic_strides() is orders


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_delayed_scaling_trains_as_without_recomputation(tmp_path, recompute):
    """A training run under fp8_delayed with activation recomputation gives the losses and weights of the run
    without, step for step (3 steps of 2 micro-batches: the amax history moves between steps, not within one)."""
    from megalm.training.trainer import Trainer
    from tests.conftest import compose_config

    runs = {}
    for mode in ("none", recompute):
        trainer = Trainer(compose_config("precision=fp8_delayed", f"parallel.recompute={mode}", "trainer.max_steps=3"),
                          tmp_path / mode)
        runs[mode] = (trainer.fit().losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        states = [m.gemm_recipe.state for m in trainer.model.modules() if isinstance(m.__dict__.get("gemm_recipe"),
                                                                                      RecipeGemms)]
        assert states and all(s.amax["x"].count == 2 for s in states), "steps 0 and 1 are in the histories"
    assert runs[recompute][0] == runs["none"][0]
    for name, weight in runs["none"][1].items():
        assert torch.equal(runs[recompute][1][name], weight), name


@pytest.mark.parametrize("stop", [1, 2])
def test_delayed_scaling_resumes_bit_exactly(tmp_path, stop):
    """The amax histories are state a checkpoint keeps (this rank's, beside its RNG state): a run stopped after step
    `stop` (1: the first step's amaxes still pending; 2: in the history) and resumed gives the uninterrupted losses.
    Evaluating (every 2 steps here) changes nothing: an eval-mode forward records no amax, and a weight copy made
    before the step's history moved is not served after it."""
    from megalm.training.trainer import Trainer
    from tests.conftest import compose_config

    common = ["precision=fp8_delayed", "trainer.max_steps=4", "trainer.save_interval=1"]
    evaluating = ["trainer.eval_interval=2", "trainer.eval_iters=1"]
    unevaluated = Trainer(compose_config(*common), tmp_path / "unevaluated").fit()
    straight = Trainer(compose_config(*common, *evaluating), tmp_path / "straight").fit()
    assert straight.losses == unevaluated.losses
    Trainer(compose_config(*common, *evaluating, f"trainer.stop_at_step={stop}"), tmp_path / "run").fit()
    rest = Trainer(compose_config(*common, *evaluating, "trainer.resume=auto"), tmp_path / "run").fit()
    assert rest.losses == straight.losses[stop:]


def test_delayed_scaling_histories_restart_on_another_layout_with_a_log_line(tmp_path, caplog):
    """A history holds a shard's amaxes: a checkpoint of another parallel layout restores none, and says so."""
    import logging

    from safetensors.torch import load_file, save_file

    from megalm.training.trainer import Trainer
    from tests.conftest import compose_config

    common = ["precision=fp8_delayed", "trainer.max_steps=3", "trainer.save_interval=2"]
    Trainer(compose_config(*common, "trainer.stop_at_step=2"), tmp_path).fit()
    rng_file = tmp_path / "checkpoints" / "step_00000002" / "rng-rank00000.safetensors"
    tensors = load_file(str(rng_file))
    assert any(k.startswith("amax/tp1-pp1-cp1-dp1-ep1/") for k in tensors)
    save_file({k.replace("/tp1-pp1-", "/tp2-pp1-"): v for k, v in tensors.items()}, str(rng_file))  # as if tp2
    with caplog.at_level(logging.INFO, logger="megalm"):
        resumed = Trainer(compose_config(*common, "trainer.resume=auto"), tmp_path)
    assert "start afresh (the checkpoint holds them per shard of layout tp2-pp1-cp1-dp1-ep1" in caplog.text
    histories = [m.gemm_recipe.state.amax["x"] for m in resumed.model.modules()
                 if isinstance(m.__dict__.get("gemm_recipe"), RecipeGemms)]
    assert histories and all(h.history is None and h.count == 0 for h in histories)


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_delayed_histories_end_a_micro_batch_and_a_step_in_kernels_that_do_not_grow_with_the_layers(micro_batches):
    """Between micro-batches every layer's x, w and dy histories are compacted, and at a new step rolled, together:
    the same few ops for 4 layers as for 40 (each history took two of its own), with the values the one-history
    `AmaxHistory.compact` and `roll` give. A recompute's second amax (three for x) is a group of its own."""
    def states(layers: int, seed: int) -> list[LinearState]:
        g = torch.Generator().manual_seed(seed)
        made = [LinearState(f"layer{i}", amax_history_len=4) for i in range(layers)]
        for state in made:
            for name, history in state.amax.items():
                uses = micro_batches + (name == "x")  # x: a recomputed forward's cast too
                history.history = torch.zeros(4)  # after the first step (which allocates each ring once)
                history.pending = [torch.rand((), generator=g) * 10 for _ in range(uses)]
        return made

    counted = {}
    for layers in (4, 40):
        batched, one_by_one = states(layers, seed=layers), states(layers, seed=layers)
        with LaunchedOps() as compact:
            set_steps(batched, 0, micro_batch=1)
        with LaunchedOps() as roll:
            set_steps(batched, 1)
        for state in one_by_one:
            for history in state.amax.values():  # the reference: one history at a time
                history.pending = [torch.stack(history.pending).amax()]
                history.history[0] = history.pending.pop()
                history.count = 1
        for mine, reference in zip(batched, one_by_one, strict=True):
            assert (mine.step, mine.micro_batch, mine.calls) == (1, 0, 0)
            for name in ("x", "w", "dy"):
                assert torch.equal(mine.amax[name].history, reference.amax[name].history), (layers, name)
                assert mine.amax[name].count == 1 and mine.amax[name].pending == []
        counted[layers] = (sorted(compact.ops), sorted(roll.ops))
    assert counted[4] == counted[40], counted
    compact_ops, roll_ops = counted[4]
    assert len(compact_ops) <= 4 and len(roll_ops) <= 2, counted[4]


def test_batched_histories_end_steps_as_one_history_at_a_time_does():
    """`set_steps` against the per-history code it replaced (written out here): a ring not allocated yet, one that
    wraps past its length, one whose counts differ from the others' (as a checkpoint restores them), an unused
    tensor (no amax: its count stays), one amax or three (a recompute), on a step's start and between micro-batches."""
    def old_compact(h: AmaxHistory) -> None:
        if len(h.pending) > 1:
            h.pending = [torch.stack(h.pending).amax()]

    def old_roll(h: AmaxHistory) -> None:
        old_compact(h)
        if not h.pending:
            return
        if h.history is None:
            h.history = torch.zeros(h.length)
        h.history[h.count % h.length] = h.pending[0].float()
        h.count, h.pending = h.count + 1, []

    def layers(seed: int) -> list[LinearState]:
        g = torch.Generator().manual_seed(seed)
        made = []
        for i, (count, uses) in enumerate([(0, 1), (3, 3), (5, 2), (7, 0), (2, 1), (0, 3)]):
            state = LinearState(f"layer{i}", amax_history_len=3)
            for name, history in state.amax.items():
                if count:  # restored: a ring of its own count (7 wraps twice past its length of 3)
                    history.history, history.count = torch.rand(3, generator=g), count + len(name)
                history.pending = [torch.rand((), generator=g) for _ in range(uses)]
            made.append(state)
        return made

    batched, reference = layers(0), layers(0)
    for step, micro_batch in [(0, 1), (1, 0), (1, 1), (2, 0)]:
        set_steps(batched, step, micro_batch)
        for state in reference:
            for history in state.amax.values():
                (old_roll if step != state.step else old_compact)(history)
            state.step = step
        for mine, old in zip(batched, reference, strict=True):
            for name in ("x", "w", "dy"):
                a, b = mine.amax[name], old.amax[name]
                assert a.count == b.count and len(a.pending) == len(b.pending), (step, mine.name, name)
                assert (a.history is None) == (b.history is None), (step, mine.name, name)
                assert a.history is None or torch.equal(a.history, b.history), (step, mine.name, name)
                assert all(torch.equal(p, q) for p, q in zip(a.pending, b.pending, strict=True))
        for states in (batched, reference):  # the next micro-batch's amaxes, the same in both
            g = torch.Generator().manual_seed(step)
            for state in states:
                for history in state.amax.values():
                    history.pending += [torch.rand((), generator=g) for _ in range(2)]
