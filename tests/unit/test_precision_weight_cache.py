"""FP8 weights are quantized once per optimizer step, and on CUDA straight from bf16.

A layer runs fprop (W along `in`) and dgrad (W along `out`) for every micro-batch of a step; W changes only
at the optimizer step, so its FP8 copy is made once and reused (per-tensor scales: one copy for both GEMMs;
per-row scales: one per K dim). These tests count the quantizations of the weight and check that every
way a weight changes (the watched optimizer, fused AdamW included, which bumps no version counter; an
in-place write) makes a new copy, so the cache never serves a stale weight; and that nothing is cached before an
optimizer is watched (a hook on that optimizer alone: another optimizer's steps are not seen).
"""

from __future__ import annotations

import pytest
import torch

from megalm.model.linear import Linear, linear
from megalm.precision import fp8
from megalm.precision.layer_state import LinearState
from megalm.precision.linear import RecipeGemms, low_precision_linear
from megalm.precision.recipes import get_recipe


def _layer(recipe: str) -> tuple[Linear, LinearState]:
    torch.manual_seed(0)
    layer = Linear(64, 32, bias=False)
    state = LinearState("layer")
    layer.gemm_recipe = RecipeGemms(get_recipe(recipe), state)
    return layer, state


def _count_weight_quantizations(monkeypatch, weight: torch.Tensor) -> list[int]:
    calls = []
    real = fp8._run  # every FP8 cast (quantize, quantize_current, quantize_delayed) goes through it

    def counting(kind, x, dtype, scale):
        calls.extend([1] if x.data_ptr() == weight.data_ptr() else [])
        return real(kind, x, dtype, scale)

    monkeypatch.setattr(fp8, "_run", counting)
    return calls


def _micro_batches(layer: Linear, n: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(n):
        x = torch.randn(16, 64, generator=gen, requires_grad=True)
        y = layer(x)
        y.backward(torch.randn(y.shape, generator=gen))
        outs.append(y.detach())
    return outs


@pytest.mark.parametrize("recipe, per_step", [("fp8", 1), ("fp8_delayed", 1), ("fp8_rowwise", 2)])
def test_weight_is_quantized_once_per_optimizer_step(monkeypatch, recipe, per_step):
    layer, state = _layer(recipe)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=True)  # updates in place, version unchanged
    state.weights_version.watch(optimizer)
    calls = _count_weight_quantizations(monkeypatch, layer.weight)
    _micro_batches(layer, 3)  # 3 fprops + 3 dgrads
    assert len(calls) == per_step, "per-tensor scales: one copy for fprop and dgrad; rows: one per K dim"
    if recipe == "fp8_delayed":  # a step's amaxes join the history as one entry when the next step starts
        assert state.amax["w"].count == state.amax["x"].count == 0
        state.set_step(1)
        assert state.amax["w"].count == state.amax["x"].count == 1
        _micro_batches(layer, 2)  # W's scale moved with its history: the copy of the old scale is not served
        assert len(calls) == 2 * per_step

    before = len(calls)
    torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1).step()  # another optimizer: not seen
    _micro_batches(layer, 1)
    assert len(calls) == before
    optimizer.step()
    before = len(calls)
    ys = _micro_batches(layer, 2, seed=2)
    assert len(calls) == before + per_step
    # the step's copy is the updated weight's: the same outputs as a layer with no cache
    if recipe != "fp8_delayed":  # (delayed scaling depends on the history, which a fresh call lacks)
        fresh = [low_precision_linear(x, layer.weight.detach(), None, recipe) for x in _inputs(2, seed=2)]
        assert all(torch.equal(a, b) for a, b in zip(ys, fresh, strict=True))

    before = len(calls)  # (the fresh calls quantized the weight too)
    with torch.no_grad():
        layer.weight.mul_(2)  # any in-place write bumps the version counter
    _micro_batches(layer, 1)
    assert len(calls) == before + per_step


def _inputs(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(16, 64, generator=gen)
        torch.randn(16, 32, generator=gen)  # the dy drawn between inputs by _micro_batches
        out.append(x)
    return out


def test_nothing_is_cached_before_an_optimizer_is_watched(monkeypatch):
    """Unwatched, fused AdamW's in-place update would go unseen: every call quantizes the weight afresh."""
    layer, _ = _layer("fp8")
    calls = _count_weight_quantizations(monkeypatch, layer.weight)
    _micro_batches(layer, 2)
    assert len(calls) == 4  # fprop and dgrad of each micro-batch
    torch.optim.AdamW(layer.parameters(), lr=0.1, fused=True).step()
    x = _inputs(1, seed=3)[0]
    assert torch.equal(layer(x), low_precision_linear(x, layer.weight.detach(), None, "fp8"))


def test_weight_cache_never_serves_another_tensor():
    """Two weights (a model and its copy, or a weight replaced by load_state_dict) never share an entry."""
    layer, state = _layer("fp8")
    state.weights_version.watch(torch.optim.SGD(layer.parameters(), lr=0.1))
    x = torch.randn(16, 64)
    y1 = layer(x)
    layer.weight = torch.nn.Parameter(layer.weight.detach() * 3)  # new storage
    y2 = layer(x)
    assert torch.equal(y2, low_precision_linear(x, layer.weight, None, "fp8"))
    assert not torch.equal(y1, y2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
def test_fused_fp8_quantize_equals_the_eager_cast(dtype, fmt):
    """The kernel CUDA runs (torch.compile of the same math, reading x in its own dtype) gives the eager
    reference's FP8 bits: per-tensor and per-row scales (as `quantize` passes them: as many dims as x),
    saturation, odd shapes, a transposed operand (quantized contiguous, as `quantize` does)."""
    torch.manual_seed(0)
    x = (torch.randn(37, 96) * 30).to(dtype)
    x[0, 0] = 1e6  # saturates
    limit = fp8.fp8_max(fmt)
    for t in (x, x.t().contiguous()):
        for scale in ((fp8.tensor_scale(t, fmt) / 4).reshape(1, 1), fp8.rowwise_scale(t, fmt, dim=1),
                      fp8.rowwise_scale(t, fmt, dim=0)):
            want = fp8._quantize_math(t, scale, limit, fmt)
            got = fp8.quantize_compiled(t, fmt, scale)
            assert got.dtype == fmt and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_amax_and_cast_equal_the_eager_reference(monkeypatch, dtype):
    """The compiled functions that fold the amax into the cast (current scaling: amax, scale and cast; delayed:
    the cast returning x's amax) give the eager reference's FP8 bits, scales and amaxes; an x with a NaN keeps
    propagating it to the amax (so a diverged run shows up in the history, as with `amax`)."""
    torch.manual_seed(0)
    x = (torch.randn(48, 80) * 30).to(dtype)
    x[1, 2] = -1e6  # saturates under the delayed scale below
    bits = lambda q: q.view(torch.uint8)
    for fmt in (fp8.E4M3, fp8.E5M2):
        eager = {"current": [fp8.quantize_current(x, fmt, dim) for dim in (None, 0, 1)],
                 "delayed": fp8.quantize_delayed(x, fmt, torch.tensor(3.0))}
        for dim, (q, scale) in zip((None, 0, 1), eager["current"], strict=True):
            want = fp8.tensor_scale(x, fmt) if dim is None else fp8.rowwise_scale(x, fmt, dim)
            assert torch.equal(scale, want) and torch.equal(bits(q), bits(fp8.quantize(x, fmt, want)))
        monkeypatch.setattr(fp8, "runs_fused", lambda t: True)  # the CUDA path, on CPU tensors
        for dim, (q, scale) in zip((None, 0, 1), eager["current"], strict=True):
            got_q, got_scale = fp8.quantize_current(x, fmt, dim)
            assert torch.equal(got_scale, scale) and torch.equal(bits(got_q), bits(q)), dim
        got_q, got_amax = fp8.quantize_delayed(x, fmt, torch.tensor(3.0))
        assert torch.equal(bits(got_q), bits(eager["delayed"][0]))
        assert got_amax == eager["delayed"][1] == x.float().abs().max()
        monkeypatch.undo()
    nan = x.clone()
    nan[5, 5] = float("nan")
    assert fp8.amax(nan).isnan() and fp8.quantize_delayed(nan, fp8.E4M3, torch.tensor(1.0))[1].isnan()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_blocks_weights_cast_in_one_call_equal_the_per_weight_casts(monkeypatch, dtype):
    """`fp8.quantize_weights` (current scaling) and `fp8.quantize_weights_delayed` (each weight with its history's
    scale, and its amax for the history): one compiled call for a block's weights on the CUDA path gives the
    per-weight eager casts' FP8 bits in both layouts, scales, inverses and amaxes."""
    torch.manual_seed(0)
    weights = [(torch.randn(shape) * 3).to(dtype) for shape in ((96, 64), (64, 32), (96, 64))]
    weights[1][0, 0] = 1e4  # saturates under its delayed scale
    scales = [torch.tensor(s) for s in (20.0, 11.0, 0.5)]
    bits = lambda q: q.view(torch.uint8)  # noqa: E731
    for fmt in (fp8.E4M3, fp8.E5M2):
        made = {"eager": (fp8.quantize_weights(weights, fmt), fp8.quantize_weights_delayed(weights, fmt, scales))}
        monkeypatch.setattr(fp8, "runs_fused", lambda t: True)  # the CUDA path, on CPU tensors
        made["fused"] = fp8.quantize_weights(weights, fmt), fp8.quantize_weights_delayed(weights, fmt, scales)
        monkeypatch.undo()
        (current, (delayed, amaxes)), (got_current, (got_delayed, got_amaxes)) = made["eager"], made["fused"]
        for ours, theirs in zip(got_delayed + got_current, delayed + current, strict=True):
            assert torch.equal(bits(ours[0]), bits(theirs[0])) and torch.equal(bits(ours[1]), bits(theirs[1]))
            assert ours[1].t().is_contiguous() and all(torch.equal(a, b)
                                                       for a, b in zip(ours[2:], theirs[2:], strict=True))
        for w, scale, (q, _, got_scale, inverse), w_amax in zip(weights, scales, got_delayed, got_amaxes, strict=True):
            want_q, want_amax = fp8.quantize_delayed(w, fmt, scale)
            assert torch.equal(bits(q), bits(want_q)) and torch.equal(w_amax, want_amax) and got_scale is scale
            assert torch.equal(inverse, fp8.inverse_scale(scale))
        assert all(torch.equal(a, b) for a, b in zip(amaxes, got_amaxes, strict=True))
        for w, (q, _, scale, _) in zip(weights, got_current, strict=True):
            want_q, want_scale = fp8.quantize_current(w, fmt)
            assert torch.equal(bits(q), bits(want_q)) and torch.equal(scale, want_scale)


def test_a_weight_computed_per_call_is_never_served_a_stale_copy():
    """A weight tensor made afresh for each call (kv rows gathered over TP ranks, a detached alias) may land
    at a freed weight's address with the same version (0): the cache must not take it for that weight."""
    state = LinearState("layer")
    state.weights_version.watch(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    gemms = RecipeGemms(get_recipe("fp8"), state)
    torch.manual_seed(0)
    x, base = torch.randn(16, 64), torch.randn(32, 64)
    for factor in (1.0, 2.0, 3.0, 5.0):
        w = base * factor
        y = linear(x, w, None, gemms)
        assert torch.equal(y, low_precision_linear(x, w, None, "fp8")), factor
        del w, y


def test_a_detached_alias_of_the_weight_hits_its_cache(monkeypatch):
    """The zero-bubble path hands the GEMMs weight.detach(), a new object per call on the parameter's storage
    and version counter: it must reuse the parameter's copy (cast once, with one amax for W's history under
    delayed scaling), so that the schedule does not change what FP8 computes."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(32, 64))
    state = LinearState("layer")
    state.weights_version.watch(torch.optim.SGD([weight], lr=0.1))
    gemms = RecipeGemms(get_recipe("fp8_delayed"), state, weight=weight)
    calls = _count_weight_quantizations(monkeypatch, weight)
    for _ in range(3):
        x = torch.randn(16, 64, requires_grad=True)
        linear(x, weight.detach(), None, gemms).sum().backward()
    state.set_step(1)
    assert len(calls) == 1 and state.amax["w"].count == 1 and len(state.amax["x"].pending) == 0


def test_the_owner_of_a_weight_is_told_by_storage_under_fake_tensors():
    """megalm-estimate runs the GEMMs on fake tensors, whose data pointers all read 0: a weight of the parameter's
    shape on another storage must still not be taken for the parameter (and served its FP8 copy), while a detached
    alias is; and nothing reads a fake data pointer (torch warns that doing so is a bug)."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("error")
        weight = torch.nn.Parameter(torch.empty(32, 64))
        gemms = RecipeGemms(get_recipe("fp8"), LinearState("layer"), weight=weight)
        assert gemms._owner(weight.detach()) is weight
        other = torch.empty(32, 64)
        assert gemms._owner(other) is other


@pytest.mark.parametrize("zero1", [False, True])
def test_the_trainer_quantizes_each_weight_once_per_step(tmp_path, monkeypatch, zero1):
    """The trainer watches its own optimizer (torch's AdamW, or ZeRO-1's): over two steps of two micro-batches
    each, a layer's weight is quantized once per step (not once per micro-batch, and not once in all: the
    second step's copy is new)."""
    from megalm.training.trainer import Trainer
    from tests.conftest import compose_config

    trainer = Trainer(compose_config("precision=fp8", "trainer.micro_batch_size=4", "trainer.global_batch_size=8",
                                     f"parallel.zero1={str(zero1).lower()}"), tmp_path)
    weight = trainer.model.layers[0].mlp.gate_up_proj.weight
    calls = _count_weight_quantizations(monkeypatch, weight)
    for step in range(2):
        trainer.train_step(step)
        assert len(calls) == step + 1, calls
    assert trainer.precision.weights_version.steps == 2  # (ZeRO-1 writes weights in place: versions bump anyway)


def test_a_layer_built_on_the_meta_device_keeps_its_cache_owner(monkeypatch):
    """The trainer builds the model on the meta device, installs the recipe, then materialises it (`to_empty`, which
    replaces every parameter): the recipe must key its cache on the parameter the layer holds now, so that the
    zero-bubble path's detached alias still hits it (before, it held the meta parameter: one cast per call)."""
    from megalm.precision.install import apply_precision

    layer = Linear(64, 32, bias=False, device="meta")
    state = apply_precision(layer, "fp8")[""]
    layer.to_empty(device="cpu")
    torch.nn.init.normal_(layer.weight)
    state.weights_version.watch(torch.optim.SGD(layer.parameters(), lr=0.1))
    calls = _count_weight_quantizations(monkeypatch, layer.weight)
    for _ in range(3):
        x = torch.randn(16, 64, requires_grad=True)
        linear(x, layer.weight.detach(), None, layer.gemm_recipe).sum().backward()
    assert len(calls) == 1
