"""Low-precision linear layers: a recipe's three GEMMs for one layer (`RecipeGemms`, the layer's `gemm_recipe`
hook) and `low_precision_linear`, F.linear under a recipe. What each recipe computes, and its measured error:
megalm/precision/recipes.py; the per-layer seed stream, amax histories and weight cache: layer_state.py.

Where the GEMMs run (the log says which; Precision.note):
    CPU          the reference: round operands to the format, dequantize, fp32 matmul
    CUDA, bf16   a bf16 GEMM with fp32 accumulation, writing the dtype the layer needs (`mm_bf16`)
    CUDA, FP8    operands cast to FP8 straight from bf16 by compiled kernels that fold in the amax (current
                 scaling: amax, scale and cast in one function; delayed: the cast returns the amax for the
                 history), then torch._scaled_mm on compute capability 8.9+ writing the output dtype the
                 layer asks for: bf16 activations and input gradients, the weight's dtype for wgrad (see
                 megalm.precision.fp8)
    CUDA, MX     the Triton quantizer (RHT, E8M0 scales, rounding in one pass; megalm.precision.kernels)
                 writes the dequantized operands in bf16, where MX values are exact (the 3/4 prescale of
                 stochastic rounding stays in them and is divided out of the output), and a bf16 GEMM
                 with fp32 output; the same values as the reference for round-to-nearest, stochastic
                 rounding with Philox draws instead of torch's generator (tests/unit/test_mx_gemm_fused.py)
A weight's FP8 copy is made once per optimizer step and reused by every micro-batch (and by fprop and
dgrad under per-tensor scales): `LinearState.quantized_weight`, once the trainer's optimizer is watched
(`WeightsVersion.watch`, a hook on that optimizer alone). Where torch._scaled_mm runs, dgrad's copy is also
cached column-major, the layout the GEMM takes, so no micro-batch transposes a weight. An activation is cast to
FP8 once per call under per-tensor scales, which do not depend on the GEMM's K: dgrad's FP8 dy is wgrad's, and
fprop's FP8 x is kept for wgrad in place of x (1 byte per element, through autograd's saved tensors:
`RecipeGemms.pack_input`; Transformer Engine keeps its FP8 input likewise). Under per-row scales and MX blocks
each GEMM casts its own operands along its K, and the layer keeps its input in its own dtype (bf16 under
`precision.bf16_weights`; fp32 under autocast over fp32 weights, whose norms return the fp32 stream's dtype, where
F.linear would keep a bf16 copy), as a sequence-parallel layer keeps its shard (smaller than a whole FP8
copy from tp = 2 on; wgrad casts it again, gathered, with fprop's scale). Bias and its gradient stay
fp32 (a layer with a bias gets an fp32 GEMM output, adds the bias, then casts). Under torch.autocast the output
has the autocast dtype, as F.linear's.

Why megalm's own FP8 path beside torchao's float8 training (TorchTitan's converter: `Float8Linear`, tensorwise
or rowwise, compile-friendly, float8 all-gather under FSDP2), which runs as `precision.backend=torchao`
(precision/torchao_fp8.py). megalm's recipes need what a module swap does not give: one GemmSpec per GEMM (E5M2
gradients, rowwise, MX with RHT and stochastic rounding), a seed stream per layer call that pipeline schedules and
recomputation do not change, the delayed-scaling history, a weight copy reused by every micro-batch of a step
(Float8Linear casts the weight in every forward unless FSDP2 precomputes it), and the zero-bubble schedule's
deferred wgrad, all on the same linear layers TP and SP use. For plain fp8 the two compute the same thing (tests
hold them to 1e-6 in fp32); which is faster decides which is the default there. The step-cost trace does not
decide it: in megalm's own step the two compiled backends are within 2.4% of each other (47.79 and 48.95 ms at 1.3B,
megalm's ahead), and what puts megalm's fp8 at 1.12x its bf16 where TorchTitan's is at 0.99x is mostly the step
around the linears (tools/bench/step_cost.py; docs/benchmarks.md). tools/bench/compare.py runs both backends in
megalm's own step (`megalm_compiled` and `megalm_torchao`) beside TorchTitan in the same GPU run
(tools/gpu_check.sh compare).

Tensor parallelism. A TP shard quantizes its own K-slice. TP ranks of one layer share its name, so
they draw the same seeds; RHT signs are drawn first (block_size of them, the same for every block),
so they do not depend on the shard's shape either. A tp>1 run equals the tp=1 run, up to fp32
summation order, for the GEMMs whose K is not sharded, with round-to-nearest and block-local scales
(MX or rowwise):
    column-parallel (W split by output rows): fprop (K = in) and wgrad (K = T) are exact; dgrad's
        K = out is sharded: each shard's partial dx comes from its own blocks, which are tp=1's blocks
        only when out/tp is a multiple of the block size (and of the RHT size).
    row-parallel (W split by input columns): dgrad (K = out) and wgrad (K = T) are exact; fprop's
        K = in is sharded (the same alignment condition).
Per-tensor FP8 scales are a shard's own amax, not the full tensor's, and SR noise is drawn for the
shard's shape, and apart on each TP rank (`LinearState.noise_rank`: shared noise would round the partial products a
collective sums alike), so those are reproducible but not equal to tp=1.

Compiled blocks (`trainer.compile`): dynamo cannot trace a layer's per-call Python state (seed hashing, weight
caches, amax histories: layer_state.py), so inside a compiled block a layer runs as one opaque op pair that runs
this same code each call (compiled_linear.py); the numbers are those of the eager path. Under per-tensor FP8
scaling, current or delayed (`Recipe.casts_in_graph`), only the GEMMs are in the ops: the casts of x and dy are ops
of the compiled graph, which inductor fuses with their producers, and wgrad's operands are written column-major
there; where torch._scaled_mm runs the GEMMs are graph ops too, on the weight's cached FP8 copies
(`prepare_graph_weights`). Delayed scaling's scales come into the graph as tensors made from the histories before
the block runs, and its amaxes leave it as a gradient (compiled_linear.prepare_graph_scales): the graph casts in one
pass, fused into the producer, where current scaling's cast waits for a whole-tensor amax.

`apply_precision(model, recipe, skip=...)` (megalm/precision/install.py) installs a recipe on the model's linear
layers from outside: it sets each layer's `gemm_recipe` hook (megalm/model/linear.py) to a `RecipeGemms`, which the
layer's GEMM function reads; tensor-parallel layers have the same hook, and a zero-bubble pipeline's
weight-gradient sink composes with it.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from megalm.measure import storage_identity
from megalm.model.linear import linear
from megalm.precision import compiled_linear, fp8
from megalm.precision.compiled_linear import Call
from megalm.precision.gemm import Fp8Operand, GemmSpec, fp8_operand, gemm, hash_seed
from megalm.precision.layer_state import LinearState, gemm_generator
from megalm.precision.recipes import Recipe, get_recipe


class RecipeGemms:
    """A recipe's three GEMMs for one layer: the `gemm_recipe` hook of megalm.model.linear.

    `start` fixes the call seed (from the layer's `LinearState`, or `seed`, or torch's generator) when
    any GEMM draws random numbers; fprop/dgrad/wgrad quantize their operands along K as the recipe's
    GemmSpecs say and return `out_dtype` (fp32 unless asked: the layer asks for the dtype it needs). The
    backward GEMMs run with the call's seed whenever they run (in B, or later in a zero-bubble W), so deferring
    them changes no draw.
    """

    def __init__(self, recipe: Recipe, state: LinearState | None = None, seed: int | None = None,
                 weight: torch.Tensor | None = None, module: nn.Module | None = None):
        self.recipe, self.state, self.seed = recipe, state, seed
        self._weight, self.module = weight, module  # the layer's weight parameter, or the layer that holds it
        self.random = any(spec.random for spec in recipe.specs)
        self.handle = compiled_linear.layer_handle(self)  # names this layer to the compiled path's ops
        self.graph_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # prepare_graph_weights
        self._graph_copies: tuple | None = None  # what graph_weights is set to while `_graph_token` holds
        self._graph_token: tuple | None = None  # what _graph_copies are valid for (`_weight_token`)
        self._graph_eligible: tuple | None = None  # (the weight, whether the graph can read its copies)
        self.graph_scales: compiled_linear.GraphScales | None = None  # compiled_linear.prepare_graph_scales
        self._graph_sink: torch.Tensor | None = None  # GraphScales.sink

    @property
    def weight(self) -> torch.Tensor | None:
        """The layer's weight parameter, what its cached FP8 copy is keyed on: read from the layer when one was given,
        since materialising a model built on the meta device (`to_empty`) replaces its parameters."""
        return self.module.weight if self.module is not None else self._weight

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items()
                if k not in ("handle", "graph_weights", "_graph_copies", "_graph_token", "_graph_eligible",
                             "graph_scales", "_graph_sink")}

    def __setstate__(self, state: dict) -> None:  # a copy (deepcopy, pickle) is a layer of its own: its own handle
        self.__dict__.update(state)
        self.handle, self.graph_weights, self._graph_copies = compiled_linear.layer_handle(self), None, None
        self._graph_token = self._graph_eligible = None
        self.graph_scales = self._graph_sink = None

    def compiled_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        out_dtype: torch.dtype) -> torch.Tensor:
        """The layer as one opaque op pair, what `linear` runs inside a compiled block (compiled_linear.py); under
        per-tensor FP8 scaling its casts stay outside the ops, in the compiled graph (delayed scaling's where the
        block's caller took its scales: compiled_linear.prepare_graph_scales), and where the block's caller made the
        weight's FP8 copies (`prepare_graph_weights`) and the tokens are a multiple of 16, so do the GEMMs."""
        scales = self.graph_scales
        if self.recipe.casts_in_graph and (scales is not None or not self.recipe.delayed):
            formats = fp8.fp8_dtype(self.recipe.fprop.a_format), fp8.fp8_dtype(self.recipe.dgrad.a_format)
            copies, tokens = self.graph_weights, x.numel() // x.shape[-1]
            if copies is not None and copies[0].shape == weight.shape and tokens % fp8.SCALED_MM_TOKEN_MULTIPLE == 0:
                return compiled_linear.fp8_graph_linear(x, weight, bias, out_dtype, copies, *formats, scales,
                                                        fast_accum=self.recipe.fprop.fast_accum)
            return compiled_linear.fp8_linear(self.handle, x, weight, bias, out_dtype, *formats, scales)
        return compiled_linear.recipe_linear(self.handle, x, weight, bias, out_dtype)

    def graph_weights_wanted(self) -> bool | None:
        """Whether a compiled block's graph reads this layer's FP8 weight copies (`prepare_graph_weights`) and they are
        yet to be made this optimizer step (True), are made already (False), or are not read at all (None): only under
        per-tensor scaling (current or delayed) where torch._scaled_mm takes the weight, and while the copies are
        cached for the optimizer step (not under FSDP, whose recipes cast after every gather: a graph would hold each
        copy from forward to backward). Asked before every block call: what does not change while the weight is the same
        tensor (the recipe, its device and shape) is decided once per weight."""
        w, token = self.weight, self._graph_token
        if token is not None and w is not None and token[0]() is w and token[1:] == self.state.weight_token(w):
            return False  # the weight by identity, then the rest (weak references to live tensors compare them)
        if w is None or self.state is None or not self.state.weights_version.watched:
            return None
        if self._graph_eligible is None or self._graph_eligible[0]() is not w:
            self._graph_eligible = weakref.ref(w), self._takes_graph_weights(w)
        return True if self._graph_eligible[1] else None

    def drop_weight_copies(self) -> None:
        """Let go of the weight's FP8 copies of an earlier optimizer step, the graph's and the layer cache's
        (per-tensor keys), before new ones are made: a block's new copies then never sit beside its old ones."""
        self._graph_copies = self._graph_token = None
        if self.state is not None:
            for key in self._tensor_scale_keys():
                self.state.weights.pop(key, None)

    def _tensor_scale_keys(self) -> tuple[tuple, tuple]:
        """The layer cache's keys of the weight's per-tensor-scaled copies: row-major and column-major
        (`_fp8_weight`'s)."""
        key = (self.recipe.fprop.b_format, None)
        return key, (*key, "column-major")

    def _takes_graph_weights(self, w: torch.Tensor) -> bool:
        fprop, dgrad = self.recipe.fprop, self.recipe.dgrad
        if not self.recipe.casts_in_graph or fprop.b_format != dgrad.b_format or not fp8.scaled_mm_runs(w.device):
            return False
        # a dimension not a multiple of 16: the eager path emulates these GEMMs, and so does the op pair
        return fp8.scaled_mm_takes(w, w.t(), fp8.fp8_dtype(fprop.a_format), fp8.fp8_dtype(fprop.b_format), False)

    def prepare_graph_weights(self, made: fp8.WeightCopies | None = None) -> None:
        """Make (or find in the layer's cache) the weight's FP8 copies that a compiled block's graph reads, before the
        block runs: `graph_weights` = (row-major for fprop, column-major for dgrad, the inverse of their per-tensor
        scale), the copies `_fp8_weight` serves the eager path, as parameters that do not require grad: weights to
        dynamo (static shapes) and to activation offload (left in place), not activations. `made`: the copies as
        `fp8.quantize_weights` made them with the block's other weights (row-major, column-major, scale, inverse)
        for a layer whose `graph_weights_wanted` was True, which the layer's cache then holds. None where the graph
        reads no copies (`graph_weights_wanted`): the compiled layer's GEMMs then run in the op pair. A second call in
        the same optimizer step finds the copies of the first."""
        wanted = True if made is not None else self.graph_weights_wanted()
        if wanted is None:
            self.graph_weights = None
            return
        if wanted:
            w, fprop, dgrad = self.weight, self.recipe.fprop, self.recipe.dgrad
            if made is None:
                with torch.no_grad():
                    (rows, scale), (columns, _) = self._fp8_weight(fprop, w, 1), self._fp8_weight(dgrad, w, 0)
                    inverse = fp8.inverse_scale(scale)
            else:  # through the layer's cache: the eager path (the op pair) reads the same copies this step, and
                # copies it made already this step (an eager pass, the estimator's `make_weight_copies`) are kept
                owner, (key, column_key) = self._owner(w), self._tensor_scale_keys()
                rows, scale = self.state.quantized_weight(key, owner, lambda: (made[0], made[2]))
                columns, _ = self.state.quantized_weight(column_key, owner, lambda: (made[1], made[2]))
                inverse = made[3] if rows is made[0] else fp8.inverse_scale(scale)
            as_weight = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731 - a fresh object: no marks
            self._graph_copies = as_weight(rows), as_weight(columns), inverse
            self._graph_token = self._weight_token(w)
        self.graph_weights = self._graph_copies

    def _weight_token(self, w: torch.Tensor | None) -> tuple | None:
        """What the layer's cached weight copies are valid for (`LinearState.quantized_weight`'s token), after the
        weight (a weak reference: `graph_weights_wanted` compares its referent by identity, the rest by value)."""
        if w is None or self.state is None:
            return None
        return weakref.ref(w), *self.state.weight_token(w)

    def start(self, x: torch.Tensor) -> Call:
        seed = self.seed
        if seed is None and self.random:
            seed = self.state.next_seed() if self.state is not None else int(torch.randint(2**62, ()).item())
        return Call(seed, {})

    def _run(self, spec: GemmSpec, gemm_name: str, call: Call, a: torch.Tensor, a_name: str, a_dim: int,
             b: torch.Tensor, b_name: str, b_dim: int, out_dtype: torch.dtype) -> torch.Tensor:
        a_fp8 = b_fp8 = None
        if spec.kind == "fp8":
            a_fp8 = self._fp8(spec, call, a, a_name, a_dim, spec.a_format)
            if b_name == "w" and self.state is not None:
                b_fp8 = self._fp8_weight(spec, b, b_dim)
            else:
                b_fp8 = self._fp8(spec, call, b, b_name, b_dim, spec.b_format)
        generator = noise = seed = None
        if spec.random:  # RHT signs from (call seed, GEMM); stochastic rounding's noise apart per TP rank
            generator = gemm_generator(call.seed, gemm_name, a.device)
            rank = self.state.noise_rank if self.state is not None else 0
            noised = gemm_name if rank == 0 else f"{gemm_name}/noise{rank}"  # rank 0: one process's draws
            noise = gemm_generator(call.seed, noised, a.device) if rank else None
            seed = hash_seed(call.seed, noised)
        return gemm(spec, a, a_dim, b, b_dim, generator, seed=seed, noise=noise, a_fp8=a_fp8, b_fp8=b_fp8,
                    out_dtype=out_dtype)

    def _fp8(self, spec: GemmSpec, call: Call, t: torch.Tensor, name: str, k_dim: int, fmt: str) -> Fp8Operand:
        """Tensor `name` (x, w or dy) in FP8 for one GEMM of `call`: per-row scales along K; or the call's per-tensor
        scale, which the first GEMM to quantize the tensor computes (current: amax, scale and cast in one compiled
        function; delayed: the history's scale, and the cast's own amax pushed to it), and whose FP8 copy of an
        activation the other GEMM reads as it is: per-tensor scales do not depend on the K dim, so the same cast
        serves both (dy: dgrad and wgrad; x: fprop and wgrad, through `pack_input`)."""
        key = (name, fmt)
        if spec.scaling == "row":
            return fp8_operand(spec, t, k_dim, fmt)
        if key in call.operands:  # the same tensor under the same scale: the FP8 copy this call cast already
            return call.operands[key]
        if key in call.scales:
            return self._keep(call, key, fp8_operand(spec, t, k_dim, fmt, call.scales[key]))
        if spec.scaling == "tensor":
            q, call.scales[key] = fp8_operand(spec, t, k_dim, fmt)
        elif spec.scaling == "delayed":
            dtype = fp8.fp8_dtype(fmt)
            if self.state is None:
                raise ValueError("delayed FP8 scaling needs a LinearState (the amax history lives there)")
            history = self.state.amax[name]
            first = fp8.amax(t) if history.history is None else None  # an empty history scales by the current amax
            call.scales[key] = history.scale(first, dtype)
            q, amax = fp8.quantize_delayed(t, dtype, call.scales[key])
            if self.training:  # the step's max, pushed when the next step starts (`LinearState.set_step`)
                history.update(amax)
        else:
            raise ValueError(f"unknown FP8 scaling {spec.scaling!r}; expected tensor, delayed or row")
        return self._keep(call, key, (q, call.scales[key]))

    @staticmethod
    def _keep(call: Call, key: tuple[str, str], operand: Fp8Operand) -> Fp8Operand:
        """Keep an activation's FP8 copy (x, dy) for the call's other GEMM that reads it; a weight's copy lives in the
        layer's cache (or, uncached, is cast again: a call must not hold a weight's copy until its backward)."""
        if key[0] != "w":
            call.operands[key] = operand
        return operand

    def _fp8_weight(self, spec: GemmSpec, w: torch.Tensor, k_dim: int) -> Fp8Operand:
        """The weight's FP8 copy for a GEMM whose K is its dim `k_dim`, from the layer's cache (once per optimizer
        step: `LinearState.quantized_weight`). Where torch._scaled_mm runs, dgrad's copy (K = out, dim 0) is kept
        column-major as the GEMM takes it, so no micro-batch transposes the weight (Transformer Engine caches the
        transpose likewise)."""
        fmt, owner = spec.b_format, self._owner(w)
        key = (fmt, k_dim if spec.scaling == "row" else None)
        operand = self.state.quantized_weight(key, owner, lambda: self._fp8(spec, Call(None, {}), w, "w", k_dim, fmt))
        if k_dim == 0 and fp8.scaled_mm_runs(w.device):
            operand = self.state.quantized_weight((*key, "column-major"), owner,
                                                  lambda: (fp8.column_major(operand[0]), operand[1]))
        return operand

    def make_weight_copies(self) -> None:
        """Make the FP8 copies of the layer's weight that fprop and dgrad read (its cache: `_fp8_weight`) now. For a
        trace whose GEMM ops do not run: megalm-estimate's compiled `fp8` blocks, whose ops' fake kernels compute
        nothing, so the copies they hold on a GPU are made here, where the trace's storage probe counts them."""
        with torch.no_grad():  # as inside the layer's autograd function: no graph holds the cast's temporaries
            for spec, k_dim in ((self.recipe.fprop, 1), (self.recipe.dgrad, 0)):
                if spec.kind == "fp8" and self.state is not None and self.weight is not None:
                    self._fp8_weight(spec, self.weight, k_dim)

    def _owner(self, w: torch.Tensor) -> torch.Tensor:
        """The layer's parameter when `w` is it or an alias of it (the zero-bubble path passes weight.detach(),
        a new object per call sharing storage and version counter), so that the cache hits; else `w` itself
        (a weight computed per call, e.g. kv rows gathered over TP ranks). Storages are told apart by identity, not
        data pointer: under the estimator's fake tensors every data pointer is 0."""
        p = self.weight
        if p is not None and w.shape == p.shape and storage_identity(w) == storage_identity(p):
            return p
        return w

    @property
    def training(self) -> bool:
        """Whether the layer trains (nn.Module.train()): an evaluation forward (the module in eval mode) leaves the
        delayed-scaling histories as they are, so that evaluating does not change what training computes."""
        return self.module is None or self.module.training

    @property
    def packs_input(self) -> bool:
        """Whether wgrad reads the FP8 copy of x that fprop casts (both FP8 of one format under per-tensor scales,
        current or delayed): then the layer keeps that copy for the backward instead of x (`pack_input`). A
        recomputed forward (activation checkpointing) casts the same x with the same scale (delayed scaling's is
        fixed for the step: `amax_history.AmaxHistory`), so what it keeps is the FP8 x the call's backward expects."""
        fprop, wgrad = self.recipe.fprop, self.recipe.wgrad
        return (fprop.kind == wgrad.kind == "fp8" and fprop.scaling == wgrad.scaling
                and fprop.scaling in ("tensor", "delayed") and fprop.a_format == wgrad.b_format)

    def pack_input(self, call: Call) -> torch.Tensor | None:
        """What the layer's backward keeps of its input in place of x: fprop's FP8 copy where `packs_input`, 1 byte
        per element and no cast of x in the backward (Transformer Engine keeps its FP8 input likewise); None: the
        layer keeps x. The call lets go of its FP8 x either way, so that nothing but the saved tensors (which
        offload and recomputation see) lives until the backward."""
        kept = {key: call.operands.pop(key) for key in [key for key in call.operands if key[0] == "x"]}
        return kept[("x", self.recipe.wgrad.b_format)][0] if self.packs_input else None

    def unpack_input(self, call: Call, kept: torch.Tensor) -> None:
        """Hand `pack_input`'s FP8 x back to the call, for wgrad."""
        key = ("x", self.recipe.wgrad.b_format)
        call.operands[key] = kept, call.scales[key]

    def finish(self, call: Call) -> None:
        """The call's backward is over (wgrad ran, or will not): let go of the FP8 activations its GEMMs shared, which
        the autograd graph would otherwise keep alive for as long as it lives (into the next micro-batch's forward,
        outside the saved tensors that offload sees)."""
        call.operands.clear()

    def fprop(self, call: Call, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32
              ) -> torch.Tensor:
        return self._run(self.recipe.fprop, "fprop", call, x, "x", 1, weight, "w", 1, out_dtype)

    def dgrad(self, call: Call, dy: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32
              ) -> torch.Tensor:
        return self._run(self.recipe.dgrad, "dgrad", call, dy, "dy", 1, weight, "w", 0, out_dtype)

    def wgrad(self, call: Call, dy: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype = torch.float32
              ) -> torch.Tensor:
        return self._run(self.recipe.wgrad, "wgrad", call, dy, "dy", 0, x, "x", 0, out_dtype)


def low_precision_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    recipe: str | Recipe = "fp32",
    state: LinearState | None = None,
    *,
    seed: int | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) with its three GEMMs in the precision of `recipe`.

    x [..., in], weight [out, in], bias [out] or None -> [..., out]. `state` carries the layer's seed
    stream and FP8 amax histories (needed by fp8_delayed); `seed` overrides the call seed. The fp32
    recipe is plain F.linear.
    """
    recipe = get_recipe(recipe)
    if recipe.is_fp32:
        return F.linear(x, weight, bias)
    return linear(x, weight, bias, RecipeGemms(recipe, state, seed))
