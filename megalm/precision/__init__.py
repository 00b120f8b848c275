"""Precision recipes, applied from outside the model (docs/architecture.md, "Precision from outside").

- fp32: nothing.
- bf16 (Megatron's mixed precision): the model's weights are bf16 working copies, so the residual stream and
  every activation are bf16 and no linear casts its weight per micro-batch; norms and softmax compute in fp32
  inside and return bf16; the optimizer keeps fp32 main weights and the gradients accumulate over micro-batches
  in fp32 (the data-parallel buckets: megalm/parallel/data_parallel/bucket_adamw.py). The bf16 weights are
  refreshed from the main ones once per optimizer step.
- bf16_autocast (what `bf16` was before: kept to compare with): fp32 weights under torch.autocast, which casts
  each weight to bf16 in every micro-batch's forward and keeps the fp32 residual stream.
- fp8*, mxfp8, mxfp4*: the recipe's low-precision GEMMs in the linear layers (`precision/linear.py`, set as each
  linear layer's `gemm_recipe` hook, on plain and tensor-parallel layers alike) on bf16 working weights as under
  `bf16` (Transformer Engine's and Megatron's setting; `precision.bf16_weights`, auto: on for the native backend
  unless `precision.autocast=false`): no autocast, the recipe's GEMMs quantize bf16 activations and weights, and
  what they save for the backward is bf16 (or FP8). `precision.bf16_weights=false`: fp32 weights under bf16
  autocast (the recipes' setting before 2026-12-03, whose fp32 residual stream gave the q/k/v and gate/up GEMMs
  fp32 inputs to quantize); with `precision.autocast=false` too, fp32 around the recipe.
- `precision.backend=te` with fp8 / fp8_delayed: Transformer Engine's Linear and fp8 recipes
  (`precision/te.py`) when TE is importable; otherwise the native path, and the log says so.
- `precision.backend=torchao` with fp8: torchao's Float8Linear (TorchTitan's fp8, `precision/torchao_fp8.py`) when
  torchao is importable; otherwise the native path, and the log says so.

`Precision` is the model converter the parallelism applies to every model chunk (after tensor
parallelism, before the pipeline's weight-gradient split and recomputation) and whose forward context
and per-micro-batch seeding it runs around each forward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from megalm import compat
from megalm.config import MegalmConfig, PrecisionConfig, choice, recompute_modes, zero_bubble
from megalm.config.choices import ForwardFormat, PrecisionBackend
from megalm.errors import ConfigError
from megalm.precision import fp8, te, torchao_fp8
from megalm.precision.gemm import mx_gemm_path
from megalm.precision.install import apply_precision, reduce_amax_histories, set_precision_step
from megalm.precision.layer_state import WeightsVersion
from megalm.precision.recipes import RECIPES, get_recipe

log = logging.getLogger("megalm")


@functools.cache
def transformer_engine_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a build that does not match this torch
        return False
    return True


@functools.cache
def transformer_engine_problem(name: str) -> str | None:
    """Why Transformer Engine cannot run recipe `name` here (not importable, or too old), or None. Cached:
    `autocast` asks before every forward."""
    if not transformer_engine_available():
        return "transformer_engine not importable"
    import transformer_engine

    return te.version_problem(name, str(getattr(transformer_engine, "__version__", "")))


def uses_transformer_engine(name: str, backend: str, device: torch.device | None = None) -> bool:
    """Whether recipe `name` under `backend` runs Transformer Engine's layers: te requested, a TE that runs
    the recipe, and (when `device` is given) a CUDA device — TE has no CPU kernels."""
    on_gpu = device is None or torch.device(device).type in te.TE_DEVICES
    return backend == "te" and name in te.TE_RECIPES and on_gpu and transformer_engine_problem(name) is None


# The recipes that change no linear layer: plain fp32, bf16 working weights, bf16 autocast over fp32 weights.
WHOLE_MODEL = ("fp32", "bf16", "bf16_autocast")
PRECISIONS = (*RECIPES, "bf16_autocast")  # every precision.name (RECIPES: the GEMM recipes of the linear layers)


def autocasts(precision: PrecisionConfig | str) -> bool:
    """Whether forward passes run under bf16 autocast: bf16_autocast, and the low-precision recipes unless
    `precision.autocast` is false."""
    name = getattr(precision, "name", precision)
    return name == "bf16_autocast" or (name not in WHOLE_MODEL and getattr(precision, "autocast", True)
                                       and working_dtype(precision) is None)


def compiles_in_sight(precision: PrecisionConfig) -> bool:
    """Whether every op of a compiled block under this precision is in the compiled graph but the GEMMs: no recipe
    (fp32, bf16), megalm's per-tensor FP8 (current or delayed), whose casts are ops of the graph
    (compiled_linear.py), or torchao's Float8Linear (casts and GEMMs alike). Other recipes run each linear, casts
    included, as one opaque op."""
    return precision.name in WHOLE_MODEL or precision.backend == "torchao" or (
        precision.backend == "native" and get_recipe(precision.name, forward=precision.forward).casts_in_graph)


def compiled_recipe_conflict(cfg: MegalmConfig) -> tuple[str, str] | None:
    """Why `cfg`'s recipe cannot run in compiled blocks under its layout, and the layout's fix (None: it can). A
    compiled block runs a native FP8/MX recipe's linears as one opaque op (compiled_linear.py), which has no input
    gather and hands no weight gradient to a zero-bubble W: those layers would break the graph instead."""
    p, parallel = cfg.precision, cfg.parallel
    if p.name in WHOLE_MODEL or p.backend != "native":
        return None
    if parallel.sequence_parallel and parallel.tp > 1:
        return "without sequence parallelism only", "set parallel.sequence_parallel=false"
    if zero_bubble(parallel):
        return ("without the zero-bubble schedule's deferred weight gradients",
                "use another parallel.pp_schedule")
    recompute = [parallel.recompute] if isinstance(parallel.recompute, str) else list(parallel.recompute)
    if "full" in recompute and get_recipe(p.name, forward=p.forward).draws:
        # the op's call seed is an output the backward reads: under full recompute the partitioner re-runs the op in
        # the backward, which draws the next seed, so dgrad and wgrad would round with other numbers than eager's
        return ("without full recomputation (its recomputed forward draws a new seed, which the compiled backward "
                "would round with)", "use parallel.recompute=selective (it keeps the recipe's GEMM outputs)")
    return None


def has_fp8_gemms(precision: PrecisionConfig) -> bool:
    """Whether the recipe's linear layers multiply FP8 operands: the fp8 recipes, and MX ones with `forward=fp8`."""
    return str(precision.name).startswith("fp8") or precision.forward == "fp8"


def recipe_on_bf16_weights(precision: PrecisionConfig | str) -> bool:
    """Whether a low-precision recipe (fp8/mx) trains bf16 working weights behind fp32 main weights:
    `precision.bf16_weights` where it is set, else (None, auto) on the native backend unless `precision.autocast`
    is false (which asks for fp32 around the recipe). Never for fp32, bf16, bf16_autocast and an unresolved auto. A
    bare recipe name stands for its defaults: true for "fp8"."""
    name = getattr(precision, "name", precision)
    if name in WHOLE_MODEL or name == "auto":
        return False
    chosen = getattr(precision, "bf16_weights", None)
    if chosen is not None:
        return bool(chosen)
    return getattr(precision, "backend", "native") == "native" and getattr(precision, "autocast", True)


def working_dtype(precision: PrecisionConfig | str) -> torch.dtype | None:
    """The dtype the model's weights train in behind fp32 main weights (bf16: precision=bf16, and the fp8/mx
    recipes on bf16 weights: `recipe_on_bf16_weights`), or None: the fp32 weights train. A bare recipe name stands
    for its defaults."""
    name = getattr(precision, "name", precision)
    return torch.bfloat16 if name == "bf16" or recipe_on_bf16_weights(precision) else None


def compute_dtype(precision: PrecisionConfig | str) -> torch.dtype:
    """The dtype activations reach attention in: bf16 with bf16 weights or under autocast, else fp32."""
    return torch.bfloat16 if autocasts(precision) or working_dtype(precision) else torch.float32


def grouped_gemm_refusal(cfg: MegalmConfig) -> tuple[str, str] | None:
    """(what, fix) where an MoE model's experts cannot be traced (compiled blocks, megalm-estimate's fake tensors):
    torch._grouped_mm's meta kernel, which CUDA's kernel follows, takes bf16 inputs whose rows are multiples of 16
    bytes (in eager on a CPU it runs fp32 and any width). The experts run in `compute_dtype`: fp32 under precision=
    fp32, and under the fp8/mx recipes without autocast or bf16 working weights. None where they can be traced."""
    m, p = cfg.model, cfg.precision
    if not m.moe.num_experts:
        return None
    if compute_dtype(p) != torch.bfloat16:
        return (f"the MoE experts' torch._grouped_mm, which takes bf16 only, and precision={p.name} runs them in fp32",
                "set precision=bf16" + ("" if p.name in WHOLE_MODEL else " or precision.bf16_weights=true"))
    # the routed experts are whole on every TP rank (megalm/parallel/tensor/apply.py): their full width
    widths = {"model.hidden_size": m.hidden_size, "model.moe.expert_ffn_hidden_size": m.moe.expert_ffn_hidden_size}
    if odd := [f"{name}={width}" for name, width in widths.items() if width % 8]:
        return (f"the MoE experts' torch._grouped_mm, which needs rows of 16 bytes (bf16 widths that are multiples of "
                f"8): {', '.join(odd)}", "round it to a multiple of 8")
    return None


@contextlib.contextmanager
def autocast(precision: PrecisionConfig | str, device: torch.device, amax_group: object = None) -> Iterator[None]:
    """bf16 autocast around forward passes (fp32 weights): for bf16_autocast, and for the low-precision
    recipes unless `precision.autocast` is false (then everything but the recipe's GEMMs runs in fp32);
    plus TE's fp8_autocast when the recipe runs on Transformer Engine. Nothing is entered before the
    `with`. `precision` is a PrecisionConfig or a recipe name; `amax_group` the group TE reduces amaxes over."""
    name = getattr(precision, "name", precision)
    with contextlib.ExitStack() as stack:
        if autocasts(precision):
            stack.enter_context(torch.autocast(device_type=device.type, dtype=torch.bfloat16))
        if uses_transformer_engine(name, getattr(precision, "backend", "native"), device):
            stack.enter_context(te.te_autocast(name, amax_group))
        yield


class Precision:
    """`cfg.precision` as a model converter: what it installs, the context of every forward, the seeding
    of random rounding per micro-batch, and the token multiple its GEMMs need (TE FP8: 16)."""

    def __init__(self, cfg: PrecisionConfig, seed: int, device: torch.device):
        self.cfg, self.seed, self.device = cfg, seed, device
        self.amax_group = None  # the ranks that split the batch (set by the parallelism): TE reduces amaxes over it
        self.noise_rank = 0  # this rank's TP rank (set by the parallelism): stochastic rounding draws apart by it
        self.weights_version = WeightsVersion()  # shared by the layers' states of every chunk it converts
        self.on_te = uses_transformer_engine(cfg.name, cfg.backend, device)
        # FP8 GEMMs on a GPU (TE's, or torch._scaled_mm) need the token count divisible by 16: pad micro-batches
        on_gpu = device.type == "cuda" or compat.fp8_traced_capability() is not None  # or the estimator's trace
        fp8_on_gpu = on_gpu and has_fp8_gemms(cfg)
        self.token_multiple = (te.TE_TOKEN_MULTIPLE if self.on_te else fp8.SCALED_MM_TOKEN_MULTIPLE if fp8_on_gpu
                               else 1)
        self.working_dtype = working_dtype(cfg)
        self.note = {"bf16": "bf16 (bf16 weights, fp32 main weights and gradient sums)",
                     "bf16_autocast": "bf16_autocast (autocast over fp32 weights)"}.get(cfg.name, cfg.name)
        if device.type == "cuda":  # fp32 GEMMs on Ampere/Hopper: TF32 (10-bit mantissa) unless asked not to
            torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
            torch.backends.cudnn.allow_tf32 = cfg.tf32
            log.info("fp32 matmuls on %s: %s (precision.tf32=%s)", device, "TF32" if cfg.tf32 else "full fp32",
                     str(cfg.tf32).lower())
        self.on_torchao = cfg.backend == "torchao" and torchao_fp8.torchao_problem() is None
        # megalm's own delayed scaling, whose amaxes `after_backward` reduces (TE reduces its own, torchao has none)
        self.native_delayed = (cfg.name not in WHOLE_MODEL and not self.on_te and not self.on_torchao
                               and get_recipe(cfg.name, forward=cfg.forward).delayed)
        self.fallback = ""
        if cfg.backend == "te" and not self.on_te:
            why = transformer_engine_problem(cfg.name) or "no CUDA device"
            log.warning("precision.backend=te but %s; running the native %s path", why, cfg.name)
            self.fallback = f", {why}"
        if cfg.backend == "torchao" and not self.on_torchao:
            why = torchao_fp8.torchao_problem()
            gather = " (its weights gathered, then cast: precision.fp8_all_gather needs torchao)" * cfg.fp8_all_gather
            log.warning("precision.backend=torchao but %s; running the native %s path%s", why, cfg.name, gather)
            self.fallback = f", {why}"
        self.fp8_all_gather = cfg.fp8_all_gather and self.on_torchao

    def convert(self, chunk: nn.Module, fsdp_shards: int = 1) -> None:
        """Install the recipe on the linear layers of `chunk` (a GPT or a pipeline chunk). `fsdp_shards`: the ranks
        FSDP will shard each weight's rows over (1: none), where `precision.fp8_all_gather` gathers a weight in FP8
        if its rows divide over them."""
        name, skip = self.cfg.name, skipped_layers(self.cfg)
        skipped = f", skipping {skip}" if skip else ""
        if name in WHOLE_MODEL:
            return
        if self.on_te:
            count = te.apply_te(chunk, name, skip)
            self.note = f"{name} on {count} linear layers (transformer_engine {type(te.te_recipe(name)).__name__})"
        elif self.on_torchao:
            emulate = not fp8.scaled_mm_runs(self.device)
            count, left, uneven = torchao_fp8.apply_torchao(
                chunk, skip, emulate=emulate, fp8_gather_shards=fsdp_shards if self.fp8_all_gather else None)
            how = "FP8 GEMMs emulated: no torch._scaled_mm here" if emulate else "torch._scaled_mm"
            gather = f"; FSDP gathers {count - len(uneven)} of their weights in FP8" if self.fp8_all_gather else ""
            self.note = f"{name} on {count} linear layers (torchao Float8Linear, tensorwise; {how}{gather})"
            if uneven:
                log.warning("precision.fp8_all_gather: %d linear layers (%s, ...) are gathered in their own dtype, "
                            "then cast: their rows do not divide over FSDP's %d shards, which torchao's FP8 gather "
                            "needs", len(uneven), uneven[0], fsdp_shards)
            if left:
                log.warning("precision.backend=torchao: %d linear layers stay in the trainer's precision (a dimension "
                            "is not a multiple of 16, which torch._scaled_mm needs; precision.backend=native "
                            "emulates those GEMMs in FP8)", left)
                self.note += f", {left} layers left unconverted (a dimension not a multiple of 16)"
        else:
            states = apply_precision(chunk, get_recipe(name, forward=self.cfg.forward), skip=skip, seed=self.seed,
                                     weights_version=self.weights_version, noise_rank=self.noise_rank)
            paths = [f"FP8 GEMMs {fp8.gemm_path(self.device)}"] * has_fp8_gemms(self.cfg)
            paths += [f"MX GEMMs {mx_gemm_path(self.device)}"] * name.startswith("mx")
            path = "; ".join(paths)
            weights = "bf16 working weights" if working_dtype(self.cfg) else "fp32 weights"
            self.note = f"{name} on {len(states)} linear layers (native: {path}{self.fallback}), on {weights}"
        self.note += skipped

    def watch_optimizer(self, optimizer: object) -> None:
        """Count `optimizer`'s steps (a hook on it alone), so that each layer quantizes its weight once per step."""
        self.weights_version.watch(optimizer)

    def watch_sharded_optimizer(self, optimizer: object, chunks: list[nn.Module]) -> None:
        """Under FSDP, with torchao's FP8 all-gather: after each of `optimizer`'s steps, the new weights' scales for
        the next gathers, a chunk's in one all-reduce (`torchao_fp8.precompute_weight_scales`). Until the first step
        (a checkpoint may load the weights after this is called) each gather takes its weight's scale with an
        all-reduce of its own, as torchao does without a precomputed one."""
        if self.fp8_all_gather:
            optimizer.register_step_post_hook(  # type: ignore[attr-defined]
                lambda *_: torchao_fp8.precompute_weight_scales(chunks))

    def forward_context(self) -> contextlib.AbstractContextManager:
        return autocast(self.cfg, self.device, self.amax_group)

    @property
    def quantizes_weights(self) -> bool:
        """Whether the recipe makes low-precision copies of the linears' weights (the fp8/mx recipes)."""
        return self.cfg.name not in WHOLE_MODEL

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations reach attention in (`compute_dtype`)."""
        return compute_dtype(self.cfg)

    def after_backward(self, model: nn.Module, step: int) -> None:
        """After training step `step`'s backward on every rank of `amax_group` (the ranks that split its batch): native
        delayed scaling's step amaxes maxed over them, so the next step casts with one process's scales."""
        group = self.amax_group
        if self.native_delayed and group is not None and dist.get_world_size(group) > 1:
            reduce_amax_histories(model, group, self.device, step)

    def before_forward(self, chunk: nn.Module, step: int, micro_batch: int, shard: int = 0) -> None:
        """Seed the random rounding of `chunk`'s layers by (step, micro-batch index in the step, this rank's
        position on the micro-batch's CP ring). Only recipes with layer states have seeds: the others skip the walk
        over the chunk's modules."""
        if self.quantizes_weights:
            set_precision_step(chunk, step, micro_batch, shard)


def skipped_layers(precision: PrecisionConfig) -> list[str]:
    """The layer patterns a recipe keeps in bf16: `precision.skip`, or by default the output head ([output]); none
    without a recipe (fp32, bf16)."""
    if precision.skip is None:
        return [] if str(precision.name) in WHOLE_MODEL else ["output"]
    return list(precision.skip)


def _check_skip_patterns(cfg: MegalmConfig) -> None:
    """Refuse a `precision.skip` pattern that names no linear layer of the model: a typo (or a module that is not a
    linear layer, which no recipe touches) would skip nothing without a word. `output` always names the head (a
    tied one is the embedding, which no recipe touches). Built on the meta device: the names, not the weights."""
    import fnmatch

    from megalm.model import GPT
    from megalm.model.linear import LinearHooks
    from megalm.model.naming import canonical_named_modules
    from megalm.precision.install import expand_layer_patterns

    skip = [str(pattern) for pattern in skipped_layers(cfg.precision)]
    if all(pattern == "output" for pattern in skip):
        return
    names = {name for name, module in canonical_named_modules(GPT(cfg.model, device="meta"))
             if isinstance(module, (nn.Linear, LinearHooks))} | {"output"}  # what apply_precision can skip
    for pattern, expanded in zip(skip, expand_layer_patterns(skip, cfg.model.num_layers - 1), strict=True):
        if not any(fnmatch.fnmatchcase(name, expanded) for name in names):
            raise ConfigError(f"precision.skip pattern {pattern!r} names no linear layer of this model (they are "
                              "named like output, layers.0.attention.qkv_proj, layers.{last}.mlp.*); fix or remove it")


def validate_precision(cfg: MegalmConfig) -> None:
    """The rules of `cfg.precision`, alone and with the parallel layout, as one-line ConfigErrors."""
    p, parallel = cfg.precision, cfg.parallel
    if p.name not in PRECISIONS:
        raise ConfigError(f"precision={p.name} is not one of {'|'.join(PRECISIONS)}; pick one of those")
    if p.forward is not None:
        choice(p.forward, "precision.forward", ForwardFormat)
        if not p.name.startswith("mxfp4"):
            raise ConfigError(f"precision.forward={p.forward} applies to the mxfp4 recipes only; "
                              f"remove it for precision={p.name}")
    choice(p.backend, "precision.backend", PrecisionBackend)
    if p.backend == "torchao":
        _validate_torchao(cfg)
    if p.fp8_all_gather and (p.backend != "torchao" or not parallel.fsdp):
        raise ConfigError("precision.fp8_all_gather=true gathers torchao's FP8 weights under FSDP; set "
                          "precision=fp8 precision.backend=torchao parallel.fsdp=true, or drop it")
    if p.fp8_all_gather and parallel.fsdp_cpu_offload:
        raise ConfigError("precision.fp8_all_gather=true with parallel.fsdp_cpu_offload=true is not supported: the "
                          "weights' FP8 scales would be reduced from host memory over the GPUs' groups; drop one")
    if p.backend == "te" and p.name not in te.TE_RECIPES:
        raise ConfigError(f"precision.backend=te runs Transformer Engine's fp8 recipes (fp8, fp8_delayed); "
                          f"precision={p.name} needs precision.backend=native")
    if p.backend == "te" and any(mode != "none" for mode in recompute_modes(parallel.recompute, parallel.pp)):
        raise ConfigError("precision.backend=te does not combine with parallel.recompute yet (the recomputed "
                          "forward would run outside TE's fp8_autocast); use parallel.recompute=none or "
                          "precision.backend=native")
    if cfg.trainer.compile and (conflict := compiled_recipe_conflict(cfg)):
        raise ConfigError(f"trainer.compile=true runs precision={p.name} {conflict[0]}; {conflict[1]} or "
                          "trainer.compile=false")
    if cfg.trainer.compile and (refusal := grouped_gemm_refusal(cfg)):
        raise ConfigError(f"trainer.compile=true traces {refusal[0]}; {refusal[1]}, or set trainer.compile=false")
    if p.name not in WHOLE_MODEL:
        _check_skip_patterns(cfg)
    if parallel.gradient_accumulation_fusion and working_dtype(p) is None:
        raise ConfigError(f"parallel.gradient_accumulation_fusion adds weight gradients into fp32 main gradients "
                          f"behind bf16 weights, which precision={p.name} does not keep: use precision=bf16 (or "
                          "precision.bf16_weights=true), or drop it")
    if p.bf16_weights and (p.name in WHOLE_MODEL or p.backend == "te"):
        raise ConfigError(f"precision.bf16_weights=true applies to the native fp8/mx recipes; remove it for "
                          f"precision={p.name}" + (" with precision.backend=te" if p.backend == "te" else ""))
    if p.bf16_weights is False and p.name in WHOLE_MODEL:  # (bf16 keeps bf16 weights whatever it says)
        raise ConfigError(f"precision.bf16_weights=false applies to the fp8/mx recipes; remove it for precision="
                          f"{p.name}" + (" (fp32 weights under bf16 autocast: precision=bf16_autocast)"
                                         if p.name == "bf16" else ""))
    if p.autocast is False and p.name == "bf16_autocast":
        raise ConfigError("precision=bf16_autocast is bf16 autocast over fp32 weights, which precision.autocast=false "
                          "turns off: use precision=fp32, or drop precision.autocast")
    if p.autocast is False and p.name in WHOLE_MODEL:
        log.warning(f"precision.autocast=false is not read by precision={p.name} (it keeps fp32 around the fp8/mx "
                    "recipes)")
    if p.bf16_weights and p.autocast is False:
        raise ConfigError("precision.bf16_weights=true keeps bf16 weights, so the model around the recipe runs in "
                          "bf16, and precision.autocast=false asks for fp32 there: drop one of them")
    if p.skip and p.name in WHOLE_MODEL:
        raise ConfigError(f"precision.skip keeps layers out of the fp8/mx recipes; precision={p.name} has no recipe "
                          "to keep them out of: remove it")
    uneven = ("parallel.hdp=true" if parallel.hdp else "trainer.tokens_per_step"
              if cfg.trainer.tokens_per_step is not None and (parallel.dp or 1) * parallel.cp > 1 else None)
    if p.backend == "te" and uneven:
        # native recipes reduce their amaxes once a step, after the backward (Precision.after_backward)
        raise ConfigError(f"precision.backend=te reduces FP8 amaxes over the ranks that split the batch in every "
                          f"micro-batch (TE's fp8_autocast), and under {uneven} those ranks run different numbers "
                          f"of micro-batches: the reduction would hang; use precision.backend=native or drop "
                          f"{uneven}")
    if p.backend == "te" and parallel.tp > 1:
        raise ConfigError(f"precision.backend=te swaps in TE's Linear, which megalm's tensor parallelism does not "
                          f"shard; use parallel.tp=1 or precision.backend=native (tp={parallel.tp})")


def _validate_torchao(cfg: MegalmConfig) -> None:
    p, parallel = cfg.precision, cfg.parallel
    if p.name not in torchao_fp8.TORCHAO_RECIPES:
        raise ConfigError(f"precision.backend=torchao runs precision=fp8 (torchao's tensorwise float8); "
                          f"precision={p.name} needs precision.backend=native")
    if parallel.tp > 1:
        raise ConfigError(f"precision.backend=torchao swaps in torchao's Float8Linear, which megalm's tensor "
                          f"parallelism does not shard; use parallel.tp=1 or precision.backend=native "
                          f"(tp={parallel.tp})")
    if zero_bubble(parallel):
        raise ConfigError("precision.backend=torchao with parallel.pp_schedule=zb: torchao's layers compute their "
                          "weight gradients in B, not in the schedule's W; use another parallel.pp_schedule or "
                          "precision.backend=native")
