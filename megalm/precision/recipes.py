"""Precision recipes: how each of a linear layer's three GEMMs rounds its operands (`RecipeGemms` in
megalm/precision/linear.py runs them; megalm/precision/gemm.py is one GEMM).

A linear layer y = x W^T + b (x [T, in], W [out, in]) runs three GEMMs, each with its own
reduction dimension K:

    fprop  y  = x W^T     K = in    x along its dim 1, W along its dim 1
    dgrad  dx = dy W      K = out   dy along its dim 1, W along its dim 0
    wgrad  dW = dy^T x    K = T     dy along its dim 0, x along its dim 0

Block scales (MX: one per 32 elements) and per-row FP8 scales must run along K, or the GEMM could not
factor them out of its sums. So every GEMM quantizes its two operands itself, from the
high-precision tensors it was given: W is quantized along `in` for fprop and along `out` for dgrad,
dy along `out` for dgrad and along the tokens for wgrad (per-tensor scales, which do not depend on K, let the
GEMMs that read one tensor share its cast: linear.py). The backward saves x (or, under per-tensor FP8 scaling,
current or delayed, fprop's FP8 copy of it; not under sequence parallelism, where the layer keeps its input's shard)
and W.

Recipes (`get_recipe(name)`; fprop / dgrad / wgrad):

    fp32         F.linear, untouched (also what a layer gets when it is skipped)
    bf16         operands rounded to bf16, fp32 accumulation, in all three
    fp8          FP8 with per-tensor current scaling: E4M3 for x and W, E5M2 for dy; on torch._scaled_mm the
                 forward GEMM accumulates fast (no fp32 promotion: fp8.py), as TE's and torchao's do, the
                 gradients' GEMMs promoting
    fp8_delayed  the same with delayed scaling (amax history of 16 steps, per layer and tensor; the scale
                 fixed within a step, so recomputation and the schedule change nothing: amax_history.AmaxHistory)
    fp8_rowwise  the same with one scale per row along K (per token / feature / output channel)
    mxfp8        MXFP8 (E4M3 elements, block 32 along K, "ceil" scales: no clipping) in all three
    mxfp4        Tseng et al. 2025 ("Training LLMs with MXFP4", arXiv 2502.20586): fprop in bf16
                 (or FP8: `get_recipe("mxfp4", forward="fp8")`), dgrad and wgrad in MXFP4 (E2M1,
                 block 32 along K, spec "floor" scales) after a random Hadamard transform of size 64
                 along K, with stochastic rounding (x3/4 so it never clips; see megalm.precision.mx).
                 Unbiased gradient estimates: E[dx] = dy W and E[dW] = dy^T x.
    mxfp4_rtn    ablation: MXFP4 backward, round to nearest, no RHT (biased)
    mxfp4_sr     ablation: stochastic rounding only
    mxfp4_rht    ablation: RHT only, round to nearest

Measured error (tests/unit/test_precision_linear.py; CPU, torch 2.13): relative Frobenius error
||C - C_exact|| / ||C_exact|| of each GEMM against fp64, x [512, 256], W [256, 256], dy [512, 256];
Gaussian: N(0, 1) entries; heavy: Student-t with 3 degrees of freedom; random recipes: mean of 8 seeds
(the spread between seeds is < 0.01). The tests assert bands around these values.

    recipe        Gaussian: y    dx      dW     | heavy: dx    dW
    bf16                0.0024  0.0023  0.0023  |      0.0023  0.0023
    fp8                 0.038   0.059   0.059   |      0.058   0.058
    fp8_delayed         0.038   0.059   0.059   |      0.058   0.058   (one call: = current scaling)
    fp8_rowwise         0.037   0.058   0.059   |      0.052   0.054
    mxfp8               0.038   0.038   0.038   |      0.038   0.037
    mxfp4_rtn           0.0024  0.161   0.161   |      0.202   0.202
    mxfp4_rht           0.0024  0.162   0.162   |      0.161   0.161
    mxfp4_sr            0.0024  0.240   0.238   |      0.309   0.309
    mxfp4               0.0024  0.239   0.239   |      0.231   0.232

(y of the mxfp4 family is the bf16 forward.) Round-to-nearest has the smallest error per draw, but
the same error in every draw: it is a bias. Stochastic rounding has ~1.5x the error per draw with zero
mean, so it averages out over steps and micro-batches: the mean of 48 draws of dW (x [128, 64],
W [96, 64]) has relative error 0.035 against 0.240 for one draw, i.e. 1/sqrt(48) of it, while
mxfp4_rtn stays at 0.164. Heavy tails put outliers in blocks, which inflates their scale and SR's
variance (0.24 -> 0.31); the RHT spreads them over 64 elements and brings it back to 0.23.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megalm.precision.gemm import GemmSpec


@dataclass(frozen=True)
class Recipe:
    """A precision recipe: one GemmSpec per GEMM of a linear layer."""

    name: str
    fprop: GemmSpec
    dgrad: GemmSpec
    wgrad: GemmSpec

    @property
    def forward(self) -> str:
        """The forward GEMM's kind (fp32 | bf16 | fp8 | mx)."""
        return self.fprop.kind

    @property
    def is_fp32(self) -> bool:
        return all(spec.kind == "fp32" for spec in self.specs)

    @property
    def specs(self) -> tuple[GemmSpec, GemmSpec, GemmSpec]:
        return self.fprop, self.dgrad, self.wgrad

    @property
    def casts_in_graph(self) -> bool:
        """Whether a compiled block casts a layer's activations in its graph (compiled_linear.fp8_linear): every
        GEMM FP8 under per-tensor scaling, current or delayed, x and dy each in one format (the amax, the scale and the
        cast are then plain torch ops, delayed scaling's scales graph inputs; per-row scales stay in the recipe's
        op)."""
        return (self.fprop.scaling in ("tensor", "delayed")
                and all(spec.kind == "fp8" and spec.scaling == self.fprop.scaling for spec in self.specs)
                and self.fprop.a_format == self.wgrad.b_format and self.dgrad.a_format == self.wgrad.a_format)

    @property
    def draws(self) -> bool:
        """Whether a GEMM draws random numbers (stochastic rounding, the RHT's signs) from its call's seed."""
        return any(spec.rounding == "stochastic" or spec.rht for spec in self.specs)

    @property
    def delayed(self) -> bool:
        """Whether the recipe's forward scales FP8 by an amax history (amax_history.AmaxHistory)."""
        return self.fprop.kind == "fp8" and self.fprop.scaling == "delayed"


_FP32 = GemmSpec("fp32")
_BF16 = GemmSpec("bf16")
_FP8_FWD = GemmSpec("fp8", "e4m3", "e4m3", fast_accum=True)  # x, W; fast accumulation as TE's and torchao's fprop
_FP8_BWD = GemmSpec("fp8", "e5m2", "e4m3")  # dgrad: dy, W; wgrad: dy, x
_MXFP8 = GemmSpec("mx", "e4m3", "e4m3", "ceil")


def _fp8(name: str, scaling: str) -> Recipe:
    fwd, bwd = (dataclasses.replace(s, scaling=scaling) for s in (_FP8_FWD, _FP8_BWD))
    return Recipe(name, fwd, bwd, bwd)


def _mxfp4(name: str, stochastic: bool, hadamard: bool) -> Recipe:
    bwd = GemmSpec("mx", "e2m1", "e2m1", "floor", "stochastic" if stochastic else "nearest", hadamard)
    return Recipe(name, _BF16, bwd, bwd)


RECIPES: dict[str, Recipe] = {
    "fp32": Recipe("fp32", _FP32, _FP32, _FP32),
    "bf16": Recipe("bf16", _BF16, _BF16, _BF16),
    "fp8": _fp8("fp8", "tensor"),
    "fp8_delayed": _fp8("fp8_delayed", "delayed"),
    "fp8_rowwise": _fp8("fp8_rowwise", "row"),
    "mxfp8": Recipe("mxfp8", _MXFP8, _MXFP8, _MXFP8),
    "mxfp4": _mxfp4("mxfp4", stochastic=True, hadamard=True),
    "mxfp4_rtn": _mxfp4("mxfp4_rtn", stochastic=False, hadamard=False),
    "mxfp4_sr": _mxfp4("mxfp4_sr", stochastic=True, hadamard=False),
    "mxfp4_rht": _mxfp4("mxfp4_rht", stochastic=False, hadamard=True),
}
FORWARD_SPECS = {"fp32": _FP32, "bf16": _BF16, "fp8": _FP8_FWD, "mxfp8": _MXFP8}


def get_recipe(recipe: str | Recipe, forward: str | None = None) -> Recipe:
    """The recipe named `recipe` (see RECIPES); `forward` (fp32 | bf16 | fp8 | mxfp8) replaces its fprop."""
    if isinstance(recipe, str):
        if recipe not in RECIPES:
            raise ValueError(f"unknown precision recipe {recipe!r}; expected one of {sorted(RECIPES)}")
        recipe = RECIPES[recipe]
    if forward is not None:
        if forward not in FORWARD_SPECS:
            raise ValueError(f"unknown forward precision {forward!r}; expected one of {sorted(FORWARD_SPECS)}")
        recipe = dataclasses.replace(recipe, name=f"{recipe.name}+{forward}_fwd", fprop=FORWARD_SPECS[forward])
    return recipe
