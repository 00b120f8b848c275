"""Precision recipes for linear layers (megalm.precision.recipes, run by megalm.precision.linear).

Three kinds of checks: (1) each GEMM quantizes the right operands along the right (K) dimension,
compared with a reference assembled from the separately tested quantizers; (2) the error of each
recipe against an fp64 reference stays inside the documented band (the table in recipes.py's
docstring), with a lower bound too, so a recipe that silently did not quantize fails; (3) the
statistics that make the MXFP4 recipe work: stochastic rounding makes dW unbiased (averaging draws
helps, unlike round-to-nearest), and the RHT reduces SR's error on heavy-tailed operands.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megalm.config import ModelConfig
from megalm.model import GPT, init_weights
from megalm.precision import fp8
from megalm.precision.amax_history import AmaxHistory
from megalm.precision.hadamard import random_signs, rht
from megalm.precision.install import apply_precision, remove_precision, set_precision_step
from megalm.precision.layer_state import LinearState, gemm_generator
from megalm.precision.linear import low_precision_linear
from megalm.precision.mx import mx_quantize_dequantize
from megalm.precision.recipes import RECIPES, get_recipe

T, IN, OUT = 512, 256, 256


def operands(dist: str = "gauss", seed: int = 0, t: int = T, n_in: int = IN, n_out: int = OUT):
    """x [t, in], W [out, in], dy [t, out]: N(0, 1), or Student-t with 3 degrees of freedom (heavy tails)."""
    gen = torch.Generator().manual_seed(seed)

    def sample(*shape):
        z = torch.randn(*shape, generator=gen)
        if dist == "gauss":
            return z
        chi2 = torch.randn(3, *shape, generator=gen).pow(2).sum(0)
        return z / (chi2 / 3).sqrt()

    return sample(t, n_in), sample(n_out, n_in), sample(t, n_out)


def run(recipe, x, w, dy, bias=None, seed=0, state=None):
    """(y, dx, dW[, db]) of one forward + backward."""
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    y = low_precision_linear(x, w, b, recipe, state, seed=seed)
    y.backward(dy)
    out = (y.detach(), x.grad, w.grad)
    return out if b is None else (*out, b.grad)


def reference(x, w, dy):
    x, w, dy = x.double(), w.double(), dy.double()
    return x @ w.T, dy @ w, dy.T @ x


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bf16(t):
    return t.bfloat16().float()


def mx(t, fmt, dim, mode="floor"):
    return mx_quantize_dequantize(t, fmt, 32, dim, scale_mode=mode)


def fp8_qdq(t, dtype, amax):
    """Independent FP8 emulation: scale to the format's max, saturate, cast, scale back."""
    scale = torch.finfo(dtype).max / amax
    return (t * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float() / scale


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# ---------------------------------------------------------------------------------------------------
# (1) the right operands, the right K
# ---------------------------------------------------------------------------------------------------


def close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_fp32_recipe_is_f_linear():
    x, w, dy = operands()
    bias = torch.randn(OUT)
    got = run("fp32", x, w, dy, bias)
    xr, wr, br = x.clone().requires_grad_(), w.clone().requires_grad_(), bias.clone().requires_grad_()
    F.linear(xr, wr, br).backward(dy)
    assert torch.equal(got[0], F.linear(x, w, bias))
    assert torch.equal(got[1], xr.grad) and torch.equal(got[2], wr.grad) and torch.equal(got[3], br.grad)


def test_bf16_gemms():
    x, w, dy = operands()
    y, dx, dw = run("bf16", x, w, dy)
    assert close(y, bf16(x) @ bf16(w).T)
    assert close(dx, bf16(dy) @ bf16(w))
    assert close(dw, bf16(dy).T @ bf16(x))


def test_mxfp4_rtn_blocks_run_along_each_gemms_k():
    x, w, dy = operands()
    y, dx, dw = run("mxfp4_rtn", x, w, dy)
    assert close(y, bf16(x) @ bf16(w).T)  # forward in bf16
    assert close(dx, mx(dy, "e2m1", 1) @ mx(w, "e2m1", 0))  # K = out
    assert close(dw, mx(dy, "e2m1", 0).T @ mx(x, "e2m1", 0))  # K = tokens
    # quantizing W along `in` (the forward's K) instead would be a different GEMM
    assert not close(dx, mx(dy, "e2m1", 1) @ mx(w, "e2m1", 1))


def test_mxfp8_all_three_gemms_with_ceil_scales():
    x, w, dy = operands()
    y, dx, dw = run("mxfp8", x, w, dy)
    assert close(y, mx(x, "e4m3", 1, "ceil") @ mx(w, "e4m3", 1, "ceil").T)
    assert close(dx, mx(dy, "e4m3", 1, "ceil") @ mx(w, "e4m3", 0, "ceil"))
    assert close(dw, mx(dy, "e4m3", 0, "ceil").T @ mx(x, "e4m3", 0, "ceil"))


def test_mxfp4_rht_and_sr_draws_come_from_the_per_gemm_generator():
    x, w, dy = operands()
    for name in ("mxfp4_rht", "mxfp4"):
        rounding = "stochastic" if name == "mxfp4" else "nearest"
        _, dx, dw = run(name, x, w, dy, seed=123)
        for gemm, got, (a, a_dim), (b, b_dim) in (("dgrad", dx, (dy, 1), (w, 0)), ("wgrad", dw, (dy, 0), (x, 0))):
            gen = gemm_generator(123, gemm, "cpu")
            signs = random_signs(64, gen)
            qa = mx_quantize_dequantize(rht(a, signs, a_dim), "e2m1", dim=a_dim, rounding=rounding, generator=gen)
            qb = mx_quantize_dequantize(rht(b, signs, b_dim), "e2m1", dim=b_dim, rounding=rounding, generator=gen)
            expected = qa @ qb if gemm == "dgrad" else qa.T @ qb
            assert close(got, expected), (name, gemm)


def test_fp8_current_scaling_per_tensor():
    x, w, dy = operands()
    y, dx, dw = run("fp8", x, w, dy)
    ax, aw, ady = x.abs().max(), w.abs().max(), dy.abs().max()
    assert close(y, fp8_qdq(x, E4M3, ax) @ fp8_qdq(w, E4M3, aw).T)
    assert close(dx, fp8_qdq(dy, E5M2, ady) @ fp8_qdq(w, E4M3, aw))
    assert close(dw, fp8_qdq(dy, E5M2, ady).T @ fp8_qdq(x, E4M3, ax))


def test_fp8_rowwise_scales_run_along_k():
    x, w, dy = operands()
    y, dx, dw = run("fp8_rowwise", x, w, dy)

    def rows(t, dtype, dim):  # one scale per vector along `dim` (the GEMM's K)
        return fp8_qdq(t, dtype, t.abs().amax(dim=dim, keepdim=True))

    assert close(y, rows(x, E4M3, 1) @ rows(w, E4M3, 1).T)
    assert close(dx, rows(dy, E5M2, 1) @ rows(w, E4M3, 0))
    assert close(dw, rows(dy, E5M2, 0).T @ rows(x, E4M3, 0))


def test_fp8_delayed_scaling_uses_the_history_then_updates_it():
    x, w, dy = operands()
    state = LinearState("layer", amax_history_len=4)
    y1, _, _ = run("fp8_delayed", x, w, dy, state=state)
    assert torch.equal(y1, run("fp8", x, w, dy)[0])  # empty history (the first step): the current amax
    assert state.amax["x"].history is None, "a step's amaxes join the history when the next step starts"
    y1_again, _, _ = run("fp8_delayed", 2 * x, w, dy, state=state)  # the same step: still the current amax
    assert torch.equal(y1_again, run("fp8", 2 * x, w, dy)[0])
    state.set_step(1)
    assert state.amax["x"].history[0] == 2 * x.abs().max() and state.amax["dy"].history[0] == dy.abs().max()
    # a 4x larger input is scaled with the old amax, so it saturates at 448 where current scaling would not
    y2, dx2, _ = run("fp8_delayed", 4 * x, w, 2 * dy, state=state)
    assert close(y2, fp8_qdq(4 * x, E4M3, 2 * x.abs().max()) @ fp8_qdq(w, E4M3, w.abs().max()).T)
    assert close(dx2, fp8_qdq(2 * dy, E5M2, dy.abs().max()) @ fp8_qdq(w, E4M3, w.abs().max()))
    assert not close(y2, run("fp8", 4 * x, w, dy)[0])
    state.set_step(2)
    assert state.amax["x"].count == 2 and state.amax["x"].history.amax() == 4 * x.abs().max()


def test_fp8_helpers():
    assert fp8.fp8_max(E4M3) == 448.0 and fp8.fp8_max(E5M2) == 57344.0
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan"), 1e-37])
    torch.testing.assert_close(fp8.scale_from_amax(amax, E4M3), torch.tensor(
        [224.0, 1.0, float("nan"), float("nan"), torch.finfo(torch.float32).max]), rtol=0, atol=0, equal_nan=True)
    # saturating cast: beyond 448 after scaling stays 448
    assert fp8.quantize_dequantize(torch.tensor([1.0, 3.0]), E4M3, torch.tensor(224.0)).tolist() == [1.0, 2.0]
    history = AmaxHistory(length=2)
    assert history.scale(torch.tensor(4.0), E4M3) == 112.0  # empty: the current amax
    for value in (8.0, 1.0, 2.0):  # a ring of two steps: 8 drops out
        history.update(torch.tensor(value))
        history.update(torch.tensor(value / 2))  # a smaller amax in the same step leaves the step's max
        history.roll()
    assert history.scale(torch.tensor(100.0), E4M3) == 224.0
    for value in (1.0, 5.0, 3.0):  # between micro-batches the step's amaxes are kept as their max
        history.update(torch.tensor(value))
    history.compact()
    assert [t.item() for t in history.pending] == [5.0]
    a, b = torch.randn(32, 48), torch.randn(48, 16)
    sa, sb = fp8.tensor_scale(a, E4M3), fp8.rowwise_scale(b, E4M3, dim=0)
    assert sb.shape == (1, 16)
    qa, qb = fp8.quantize(a, E4M3, sa), fp8.quantize(b, E4M3, sb)
    assert qa.dtype == qb.dtype == E4M3
    assert close(fp8.scaled_mm(qa, qb, sa, sb), fp8_qdq(a, E4M3, a.abs().max()) @ fp8_qdq(b, E4M3, b.abs().amax(0)))


def test_fp8_delayed_needs_a_state():
    x, w, dy = operands(t=32, n_in=32, n_out=32)
    with pytest.raises(ValueError, match="LinearState"):
        run("fp8_delayed", x, w, dy)


# ---------------------------------------------------------------------------------------------------
# (2) error bands: relative Frobenius error per GEMM vs fp64 (the table in recipes.py)
# ---------------------------------------------------------------------------------------------------

# recipe: ((lo, hi) for y, dx, dW) on Gaussian operands; measured values sit inside with a margin.
GAUSS_BANDS = {
    "bf16": ((1e-3, 5e-3),) * 3,
    "fp8": ((0.03, 0.05), (0.045, 0.075), (0.045, 0.075)),
    "fp8_delayed": ((0.03, 0.05), (0.045, 0.075), (0.045, 0.075)),
    "fp8_rowwise": ((0.03, 0.05), (0.045, 0.075), (0.045, 0.075)),
    "mxfp8": ((0.03, 0.045),) * 3,
    "mxfp4_rtn": ((1e-3, 5e-3), (0.14, 0.19), (0.14, 0.19)),
    "mxfp4_rht": ((1e-3, 5e-3), (0.14, 0.19), (0.14, 0.19)),
    "mxfp4_sr": ((1e-3, 5e-3), (0.21, 0.27), (0.21, 0.27)),
    "mxfp4": ((1e-3, 5e-3), (0.21, 0.27), (0.21, 0.27)),
}


def test_every_recipe_has_a_band():
    assert set(GAUSS_BANDS) | {"fp32"} == set(RECIPES)


@pytest.mark.parametrize("name", sorted(GAUSS_BANDS))
def test_error_bands_on_gaussian_operands(name):
    x, w, dy = operands()
    ref = reference(x, w, dy)
    got = run(name, x, w, dy, state=LinearState("l"))
    for value, exact, (lo, hi), what in zip(got, ref, GAUSS_BANDS[name], ("y", "dx", "dW"), strict=True):
        err = rel_err(value, exact)
        assert lo <= err <= hi, f"{name} {what}: relative error {err:.4f} outside [{lo}, {hi}]"


def test_rht_reduces_stochastic_rounding_error_on_heavy_tails():
    x, w, dy = operands("heavy")
    ref = reference(x, w, dy)
    errs = {name: torch.zeros(2) for name in ("mxfp4_sr", "mxfp4")}
    for name in errs:
        for seed in range(3):
            _, dx, dw = run(name, x, w, dy, seed=seed)
            errs[name] += torch.tensor([rel_err(dx, ref[1]), rel_err(dw, ref[2])]) / 3
    assert (errs["mxfp4"] < 0.85 * errs["mxfp4_sr"]).all(), errs
    assert (errs["mxfp4_sr"] > 0.25).all(), errs  # heavy tails do hurt SR without the RHT


# ---------------------------------------------------------------------------------------------------
# (3) unbiased gradients
# ---------------------------------------------------------------------------------------------------


def test_mxfp4_backward_is_unbiased():
    """Averaging dW (and dx) over seeds converges to the exact gradient for SR (error ~ 1/sqrt(n)),
    but not for round-to-nearest, whose error is the same in every draw."""
    x, w, dy = operands(t=128, n_in=64, n_out=96, seed=5)
    _, dx_ref, dw_ref = reference(x, w, dy)
    n = 48
    # 1/sqrt(48) = 0.144 for an unbiased estimate; a biased one keeps its error
    for name, max_ratio, min_ratio in (("mxfp4", 0.2, 0.0), ("mxfp4_sr", 0.2, 0.0), ("mxfp4_rtn", 1.01, 0.99)):
        draws = [run(name, x, w, dy, seed=s)[1:] for s in range(n)]
        for i, exact in ((0, dx_ref), (1, dw_ref)):
            single = sum(rel_err(d[i], exact) for d in draws) / n
            mean = rel_err(torch.stack([d[i] for d in draws]).double().mean(0), exact)
            assert min_ratio * single <= mean <= max_ratio * single, (name, i, single, mean)


# ---------------------------------------------------------------------------------------------------
# Seeds, shapes, dtypes
# ---------------------------------------------------------------------------------------------------


def test_seeds_make_runs_reproducible():
    x, w, dy = operands(t=64, n_in=64, n_out=64)
    a, b, c = (run("mxfp4", x, w, dy, seed=s) for s in (1, 1, 2))
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not torch.equal(a[2], c[2])
    # a LinearState's stream: the same (name, seed, step, micro-batch) gives the same draws
    s1, s2 = LinearState("layers.0.mlp.up_proj", seed=3), LinearState("layers.0.mlp.up_proj", seed=3)
    seeds1 = [s1.next_seed() for _ in range(3)]
    assert [s2.next_seed() for _ in range(3)] == seeds1 and len(set(seeds1)) == 3
    s1.set_step(0, 0)
    assert s1.next_seed() == seeds1[0]
    s1.set_step(1, 0)
    assert s1.next_seed() not in seeds1
    assert LinearState("layers.0.mlp.gate_proj", seed=3).next_seed() != seeds1[0]
    # each GEMM of a call draws from its own stream
    first = [torch.rand(4, generator=gemm_generator(1, g, "cpu")) for g in ("fprop", "dgrad", "wgrad")]
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    # without a state or a seed, torch's default generator decides
    torch.manual_seed(0)
    d = run("mxfp4", x, w, dy, seed=None)
    torch.manual_seed(0)
    e = run("mxfp4", x, w, dy, seed=None)
    assert torch.equal(d[2], e[2])


def test_batched_input_bias_and_autocast():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 48, 64, generator=gen, requires_grad=True)
    w = torch.randn(32, 64, generator=gen, requires_grad=True)
    b = torch.randn(32, generator=gen, requires_grad=True)
    dy = torch.randn(2, 48, 32, generator=gen)
    y = low_precision_linear(x, w, b, "mxfp4", seed=0)
    assert y.shape == (2, 48, 32) and y.dtype == torch.float32
    y.backward(dy)
    assert x.grad.shape == x.shape and torch.equal(b.grad, dy.sum(dim=(0, 1)))
    assert rel_err(y, x.detach() @ w.detach().T + b.detach()) < 0.01
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = low_precision_linear(x, w, b, "mxfp8", seed=0)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


@pytest.mark.parametrize("name", ["mxfp4", "mxfp8", "fp8_rowwise"])
def test_shapes_that_are_not_multiples_of_the_blocks(name):
    """K = 40 features, 24 outputs, 100 tokens: MX blocks and the RHT pad with zeros, which is exact."""
    x, w, dy = operands(t=100, n_in=40, n_out=24, seed=9)
    got = run(name, x, w, dy)
    for value, exact in zip(got, reference(x, w, dy), strict=True):
        assert value.shape == exact.shape and rel_err(value, exact) < 0.35


def test_get_recipe():
    assert get_recipe("mxfp4").forward == "bf16"
    fwd8 = get_recipe("mxfp4", forward="fp8")
    assert fwd8.forward == "fp8" and fwd8.dgrad == RECIPES["mxfp4"].dgrad
    x, w, dy = operands(t=64, n_in=64, n_out=64)
    y = run(fwd8, x, w, dy)[0]
    assert close(y, fp8_qdq(x, E4M3, x.abs().max()) @ fp8_qdq(w, E4M3, w.abs().max()).T)
    with pytest.raises(ValueError, match="unknown precision recipe"):
        get_recipe("fp3")


# ---------------------------------------------------------------------------------------------------
# apply_precision on a model
# ---------------------------------------------------------------------------------------------------


def tiny_gpt(seed: int = 0) -> GPT:
    cfg = ModelConfig(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                      vocab_size=64, seq_length=32, attention_backend="sdpa")
    model = GPT(cfg)
    init_weights(model, seed)
    return model


def forward_backward(model: GPT, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (64,), generator=gen)
    positions = torch.arange(64) % 32
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    logits = model(tokens, positions, cu, 32)
    loss = F.cross_entropy(logits.float(), torch.roll(tokens, -1))
    model.zero_grad()
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_apply_precision_skip_and_overrides():
    model = tiny_gpt()
    ref_logits, ref_grads = forward_backward(model)
    states = apply_precision(model, "mxfp4", skip=("output", "layers.0.*", "layers.{last}.*"),
                             overrides={"layers.1.mlp.*": "mxfp8"})
    assert sorted(states) == sorted(f"layers.1.{m}" for m in (
        "attention.qkv_proj", "attention.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
    assert model.layers[1].mlp.gate_up_proj.gemm_recipe.recipe.name == "mxfp8"
    assert model.layers[1].attention.qkv_proj.gemm_recipe.recipe.name == "mxfp4"
    assert model.output.gemm_recipe is None and model.layers[0].mlp.gate_up_proj.gemm_recipe is None
    set_precision_step(model, step=0)
    logits, grads = forward_backward(model)
    assert 0 < rel_err(logits, ref_logits) < 0.05
    for name, g in grads.items():
        assert torch.isfinite(g).all()
        if name.startswith("layers.1.") and name.endswith("proj.weight"):
            assert 0 < rel_err(g, ref_grads[name]) < 0.5, name
    twin = copy.deepcopy(model)  # the installed recipes follow the copy
    with torch.no_grad():
        twin.layers[1].mlp.gate_up_proj.weight.zero_()
    assert not torch.equal(forward_backward(twin)[0], forward_backward(model)[0])
    remove_precision(model)
    assert torch.equal(forward_backward(model)[0], ref_logits)
    # installing again replaces the previous recipe everywhere
    apply_precision(model, "bf16", skip=("output",))
    assert model.layers[1].mlp.gate_up_proj.gemm_recipe.recipe.name == "bf16"
    assert model.layers[0].mlp.gate_up_proj.gemm_recipe.recipe.name == "bf16"


def test_apply_precision_is_reproducible_across_models():
    grads = []
    for _ in range(2):
        model = tiny_gpt()
        apply_precision(model, "mxfp4", seed=7)
        set_precision_step(model, step=3, micro_batch=1)
        grads.append(forward_backward(model)[1])
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_apply_precision_fp32_changes_nothing():
    model = tiny_gpt()
    ref = forward_backward(model)
    apply_precision(model, "fp32")
    got = forward_backward(model)
    assert torch.equal(got[0], ref[0]) and all(torch.equal(got[1][n], ref[1][n]) for n in ref[1])


def test_apply_precision_on_tensor_parallel_layers():
    from megalm.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    gen = torch.Generator().manual_seed(8)
    col = ColumnParallelLinear.from_linear(nn.Linear(64, 96), group=None)
    row = RowParallelLinear.from_linear(nn.Linear(96, 64), group=None)
    with torch.no_grad():
        for p in (*col.parameters(), *row.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen))
    model = nn.Sequential(col, row)
    x = torch.randn(64, 64, generator=gen)
    apply_precision(model, "mxfp4_rtn")
    y = model(x)
    h = low_precision_linear(x, col.weight, col.bias, "mxfp4_rtn")
    assert torch.equal(y, low_precision_linear(h, row.weight, None, "mxfp4_rtn") + row.bias)


def test_apply_precision_refuses_a_plain_torch_linear():
    """Only layers with the precision hook can run a recipe; a plain torch layer is named, not skipped."""
    with pytest.raises(TypeError, match="0 is a plain torch nn.Linear"):
        apply_precision(nn.Sequential(nn.Linear(4, 4)), "mxfp8")


def test_recomputation_changes_no_draw():
    """A recomputed forward advances the layer's seed stream, but the backward GEMMs keep the seed of
    their original forward: mxfp4 gradients are bit-identical with and without full recomputation."""
    from megalm.parallel.recompute import apply_recompute

    grads = []
    for mode in ("none", "full"):
        model = tiny_gpt()
        apply_precision(model, "mxfp4", seed=3)
        apply_recompute(model, mode)
        set_precision_step(model, step=1, micro_batch=2)
        grads.append(forward_backward(model)[1])
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@pytest.mark.parametrize("tf32", [True, False])
def test_tf32_follows_the_config_on_cuda(tf32):
    """fp32 on a GPU runs its matmuls in TF32 unless precision.tf32=false (a CPU run leaves the flags alone)."""
    from megalm.config import PrecisionConfig
    from megalm.precision import Precision

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
        Precision(PrecisionConfig(name="fp32", tf32=tf32), seed=0, device=torch.device("cpu"))
        assert torch.backends.cuda.matmul.allow_tf32 is (not tf32)
        Precision(PrecisionConfig(name="fp32", tf32=tf32), seed=0, device=torch.device("cuda"))
        assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_fp8_pads_micro_batches_on_a_gpu_and_says_where_its_gemms_run():
    """torch._scaled_mm needs T % 16 == 0: on a GPU the fp8 recipes pad micro-batches to 16 tokens (they
    emulated silently before); the log names the GEMM path (emulation on CPU)."""
    from megalm.config import PrecisionConfig
    from megalm.precision import Precision

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for name, forward, multiple in (("fp8", None, 16), ("fp8_rowwise", None, 16), ("mxfp4", "fp8", 16),
                                        ("mxfp4", None, 1), ("bf16", None, 1)):
            gpu = Precision(PrecisionConfig(name=name, forward=forward), seed=0, device=torch.device("cuda"))
            assert gpu.token_multiple == multiple, name
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    cpu = Precision(PrecisionConfig(name="fp8"), seed=0, device=torch.device("cpu"))
    assert cpu.token_multiple == 1
    cpu.convert(tiny_gpt())
    assert "FP8 GEMMs emulated in fp32 (no FP8 GEMMs on cpu)" in cpu.note


@pytest.mark.parametrize("a_dtype, b_dtype, rowwise, shape, on_hardware", [
    (fp8.E4M3, fp8.E4M3, False, (32, 64, 48), True),
    (fp8.E5M2, fp8.E4M3, False, (32, 64, 48), True),  # per-tensor dgrad: E5M2 x E4M3 has a kernel
    (fp8.E5M2, fp8.E5M2, False, (32, 64, 48), False),  # no E5M2 x E5M2 kernel
    (fp8.E4M3, fp8.E4M3, True, (32, 64, 48), True),
    (fp8.E5M2, fp8.E4M3, True, (32, 64, 48), False),  # fp8_rowwise never runs E5M2 on _scaled_mm
    (fp8.E4M3, fp8.E5M2, True, (32, 64, 48), False),
    (fp8.E4M3, fp8.E4M3, False, (30, 64, 48), False),  # tokens not a multiple of 16
])
def test_which_fp8_gemms_run_on_scaled_mm(a_dtype, b_dtype, rowwise, shape, on_hardware):
    """The dispatch rule on a (simulated) Hopper GPU: every other case is emulated, never sent to a kernel
    that would refuse it or lose precision."""
    from types import SimpleNamespace

    from megalm import compat

    m, k, n = shape
    a = SimpleNamespace(device=torch.device("cuda"), shape=(m, k))
    b = SimpleNamespace(device=torch.device("cuda"), shape=(k, n))
    with compat.simulated_cuda((9, 0)):
        assert fp8._scaled_mm_available(a, b, a_dtype, b_dtype, rowwise) == on_hardware
    with compat.simulated_cuda((8, 0)):  # A100: no FP8 GEMMs
        assert not fp8._scaled_mm_available(a, b, a_dtype, b_dtype, rowwise)


@pytest.mark.parametrize("recipe", ["fp8", "fp8_delayed", "fp8_rowwise"])
def test_an_inf_in_an_fp8_layer_s_input_is_not_saturated_into_a_finite_output(recipe):
    """An overflow upstream (an inf in x) reaches the output as NaN, as it does under bf16, torchao's float8 and the
    MX recipes, so that the loss is not finite and the trainer's non-finite guard sees the step. Until 2026-12-04 an
    inf amax gave scale 1 and the cast saturated the inf to 448: a finite loss of 1e7 trained on (an audit found
    it). The other rows of the output stay finite where the scale is per row."""
    torch.manual_seed(0)
    x, w = torch.randn(32, 64), torch.randn(48, 64)
    x[3, 5] = float("inf")
    y = low_precision_linear(x, w, None, recipe, LinearState("l"))
    assert not torch.isfinite(y).all()
    if recipe == "fp8_rowwise":
        assert torch.isfinite(y[torch.arange(32) != 3]).all()


@pytest.mark.parametrize("recipe", ["fp8", "fp8_rowwise"])
def test_a_tiny_amax_scales_to_fp32_s_largest_and_keeps_zeros_zero(recipe):
    """An amax below ~1e-36 made the scale inf, and each exact zero 0 * inf = NaN (an audit found it): the scale is
    now fp32's largest, as Transformer Engine clamps it, and the product is the fp32 one's (about 1e-37 here)."""
    torch.manual_seed(0)
    w = torch.randn(32, 32)
    x = torch.zeros(16, 32)
    x[0, 0] = 1e-37
    y = low_precision_linear(x, w, None, recipe, LinearState("l"))
    assert torch.isfinite(y).all()
    assert (y[1:] == 0).all() and y[0].abs().max() <= 4e-37


def test_a_step_that_overflowed_leaves_delayed_scaling_s_history_scaling_the_next_steps():
    """A step whose dy held a NaN (one the trainer's non-finite guard skips) pushes a NaN amax into dy's history;
    the next steps' scale comes from the history's finite entries, so dy (1e-6 here: a loss over many tokens) is
    cast as before. Until 2026-12-04 the NaN made the scale 1 for the history's 16 steps, which flushed every dy
    below E5M2's 2^-16 to zero: dx was 0, without a word (an audit found it)."""
    torch.manual_seed(0)
    state = LinearState("l")
    w = torch.randn(64, 64)
    for index in range(1, 8):
        state.set_step(index)
        x = torch.randn(32, 64, requires_grad=True)
        y = low_precision_linear(x, w, None, "fp8_delayed", state)
        dy = 1e-6 * torch.randn_like(y)
        if index == 4:
            dy[0, 0] = float("nan")
        (dx,) = torch.autograd.grad(y, x, dy)
        if index != 4:
            exact = dy @ w
            assert (dx - exact).norm() / exact.norm() < 0.2, index
    state.set_step(8)
    assert state.amax["dy"].history.isnan().any()  # the step's amax is kept: the scale leaves it out


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_linear_of_no_tokens(name):
    """A layer given no tokens returns no rows and a zero weight gradient under every recipe (the inf-norm of the FP8
    amax and the RHT's reshape along T refused an empty tensor)."""
    x = torch.randn(0, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    out = low_precision_linear(x, w, None, name, LinearState("layer"))
    assert out.shape == (0, 32)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and x.grad.shape == x.shape


def test_tensor_parallel_ranks_share_rht_signs_and_draw_their_own_rounding_noise():
    """A layer's TP ranks share its call seeds, so its RHT signs match (a GEMM whose K is not sharded then equals
    tp = 1's), but each rank's stochastic rounding draws apart by its TP rank (`LinearState.noise_rank`): a
    column-parallel dgrad (K = out, sharded) sums the ranks' partial products, whose rounding errors, drawn alike,
    had added up instead of averaging out. Rank 0 keeps one process's draws."""
    from megalm.precision.linear import RecipeGemms

    def partials(recipe: str, ranks: list[int], dy: torch.Tensor, w: torch.Tensor, seed: int = 99
                 ) -> list[torch.Tensor]:
        """Each TP rank's dgrad of its out-slice, with the same call seed (a layer's, shared over TP)."""
        out = []
        for shard, rank in enumerate(ranks):
            gemms = RecipeGemms(get_recipe(recipe), LinearState("layer", seed=5, noise_rank=rank), seed=seed)
            rows = slice(shard * w.shape[0] // len(ranks), (shard + 1) * w.shape[0] // len(ranks))
            out.append(gemms.dgrad(gemms.start(dy), dy[:, rows], w[rows]).double())
        return out

    gen = torch.Generator().manual_seed(0)
    dy, w = torch.randn(128, 256, generator=gen), torch.randn(256, 128, generator=gen)
    alike = torch.cat([w[:64]] * 4)  # shards holding alike values: alike draws give alike rounding errors
    # round to nearest after the RHT: the signs alone decide, the same on every rank
    nearest = partials("mxfp4_rht", [0, 1], dy, alike), partials("mxfp4_rht", [0, 0], dy, alike)
    assert all(torch.equal(a, b) for a, b in zip(*nearest, strict=True))
    # stochastic rounding: rank 0 draws as one process does, rank 1 apart
    own, shared = partials("mxfp4", [0, 1], dy, alike), partials("mxfp4", [0, 0], dy, alike)
    assert torch.equal(own[0], shared[0]) and not torch.equal(own[1], shared[1])
    # the summed dgrad's error over many calls' draws: apart, the four ranks' errors average out
    dy, w = dy + 1.0, alike + 0.5  # non-zero means: the errors share a sign
    exact = dy.double() @ w.double()

    def error(ranks: list[int]) -> float:
        return sum((sum(partials("mxfp4", ranks, dy, w, seed)) - exact).norm().item() for seed in range(8))

    assert error([0, 1, 2, 3]) < 0.9 * error([0, 0, 0, 0])
