"""The cross-field rules of the sections megalm.config owns (model, trainer, optim, data, logging).

Each rule is a one-line `ConfigError` that names the fix. The packages check their own sections
(`megalm.parallel.parallelism.validate_parallel`, `megalm.precision.validate_precision`), and
`megalm.training.validation.validate_run` runs them all on a copy of the config.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Any

from omegaconf import OmegaConf

from megalm.config.choices import (
    Activation,
    AttentionBackend,
    DataSource,
    Device,
    DropPolicy,
    LRSchedule,
    MuonScale,
    NonFinite,
    Norm,
    OptimizerImplementation,
    OptimizerName,
    PositionEmbedding,
    RouterScore,
    WandbMode,
    WSDDecayStyle,
)
from megalm.config.schema import (
    MegalmConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    RopeScalingConfig,
    SyntheticDataConfig,
    TrainerConfig,
    WandbConfig,
)
from megalm.errors import ConfigError

log = logging.getLogger("megalm")

SPIKE_MIN_HISTORY = 10  # losses the spike detector (megalm/training/guards.py) needs before it judges one


def blend_pairs(blend: Any) -> list[tuple[float, str]]:
    """`data.blend` as (weight, prefix) pairs, weights as written (not normalized); a one-line ConfigError for a
    malformed blend. Accepts a flat [w, prefix, ...] list, a list of {weight, path} mappings, or a string."""
    if isinstance(blend, str):
        blend = blend.replace(",", " ").split()
    if OmegaConf.is_config(blend):
        blend = OmegaConf.to_container(blend, resolve=True)
    if not isinstance(blend, (list, tuple)) or not blend:
        raise ConfigError(f"data.blend={blend!r} is not a weighted list; write data.blend=[0.3,PREFIX_A,0.7,PREFIX_B]")
    if all(isinstance(x, dict) for x in blend):
        for i, x in enumerate(blend):
            if set(x) != {"weight", "path"}:
                raise ConfigError(f"data.blend[{i}] has keys {sorted(x)}; each mapping needs exactly weight and path")
        flat = [v for x in blend for v in (x["weight"], x["path"])]
    else:
        flat = list(blend)
    if len(flat) % 2:
        raise ConfigError(f"data.blend has {len(flat)} entries, an odd number; it pairs each weight with a prefix: "
                          "[W1,PREFIX1,W2,PREFIX2,...]")
    pairs = []
    for i in range(0, len(flat), 2):
        weight, path = flat[i], flat[i + 1]
        bad = ConfigError(f"data.blend weight {weight!r} (entry {i}) is not a number; write weight, prefix pairs: "
                          "[0.3,PREFIX_A,0.7,PREFIX_B]")
        if isinstance(weight, str):
            try:
                weight = float(weight)
            except ValueError:
                raise bad from None
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise bad
        if not 0 < weight < float("inf"):
            raise ConfigError(f"data.blend weight {weight} of {path} must be > 0 (and finite); drop the prefix "
                              "instead of giving it weight 0")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"data.blend entry {i + 1} ({path!r}) is not a dataset prefix; write weight, prefix "
                              "pairs: [0.3,PREFIX_A,0.7,PREFIX_B]")
        pairs.append((float(weight), path))
    first: dict[str, str] = {}  # each dataset, its path resolved (./, ~, links): the entry that named it first
    for _, path in pairs:
        key = os.path.realpath(os.path.expanduser(path))
        if key in first:
            twice = f"{path} twice" if first[key] == path else f"one dataset twice, as {first[key]} and {path}"
            raise ConfigError(f"data.blend lists {twice}; give it one entry with the summed weight")
        first[key] = path
    return pairs



def choice(value: str, key: str, options: tuple[str, ...] | type[Enum]) -> None:
    """A one-line ConfigError unless `value` is one of `options` (names, or a choice's Enum). The schema checks
    composed configs; this catches a value set in Python or after composition."""
    if isinstance(options, type):
        options = tuple(member.value for member in options)
    if value not in options:
        raise ConfigError(f"{key}={value} is not one of {'|'.join(options)}; pick one of those")


def positive(value: int | float | None, key: str) -> None:
    """A one-line ConfigError unless `value` is None or a finite number > 0 (NaN compares false with everything:
    `value <= 0` let `optim.lr=nan` through, to fail inside torch)."""
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{key}={value} must be a finite number > 0")


def non_negative(value: int | float, key: str, zero_means: str = "") -> None:
    """A one-line ConfigError unless `value` is a finite number >= 0 (`trainer.grad_clip=nan` passed `value < 0`
    and turned clipping off); `zero_means` says what 0 does ("turns it off")."""
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigError(f"{key}={value} must be a finite number >= 0" + (f" (0 {zero_means})" if zero_means else ""))


def schema_default(schema: type, key: str) -> Any:
    """The default of field `key` of the dataclass `schema` (a list field's: its factory's value)."""
    field = next(f for f in dataclasses.fields(schema) if f.name == key)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default  # type: ignore[misc]


def set_away_from_default(section: Any, schema: type, keys: Iterable[str] | None = None) -> list[str]:
    """`key=value` for each of `keys` (default: every field) whose value in `section`, a config section of the
    dataclass `schema`, is not the schema's default: settings a layout will not read, for a warning or an error."""
    keys = [f.name for f in dataclasses.fields(schema)] if keys is None else keys
    return [f"{key}={override_value(getattr(section, key))}" for key in keys
            if getattr(section, key) != schema_default(schema, key)]


def override_value(value: Any) -> str:
    """`value` as a command-line override spells it (true, false, null), so a message's key=value can be pasted."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


DEMO_DATA_WARNING = "data=demo is the Python standard library as bytes (257 ids)"


def demo_tokenizer_refusal(tokenizer: str) -> str | None:
    """Why data=demo cannot take `data.tokenizer` (None: it can): its corpus is byte-tokenized when built."""
    if tokenizer == "byte":
        return None
    return (f"data=demo is byte-tokenized, got data.tokenizer={tokenizer}; drop it, or tokenize your own text with "
            "megalm-preprocess and use data=indexed")


def fraction(value: float, key: str) -> None:
    """A one-line ConfigError unless `value` is in [0, 1)."""
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{key}={value} must be in [0, 1)")


def pad_vocab(vocab_size: int, multiple: int) -> int:
    """`vocab_size` rounded up to a multiple of `multiple` (Megatron-LM's padded vocab)."""
    return -(-vocab_size // multiple) * multiple


def resolve_model_defaults(model: ModelConfig, tp: int | None = None) -> ModelConfig:
    """Fill the `None` fields that derive from others (kv heads, ffn size, max positions, padded vocab).

    With `tp` (a run's validation), the padded vocab is (re)derived for that many tensor-parallel ranks:
    `vocab_size` up to a multiple of `make_vocab_size_divisible_by * tp`. Without it a missing value is
    derived for one rank and a present one (a saved run's) is kept.
    """
    if tp is not None or model.padded_vocab_size is None:
        multiple = max(1, model.make_vocab_size_divisible_by) * max(1, tp or 1)
        model.padded_vocab_size = pad_vocab(model.vocab_size, multiple)
    if model.num_kv_heads is None:
        model.num_kv_heads = model.num_heads
    if model.head_dim is None and model.num_heads > 0 and model.hidden_size % model.num_heads == 0:
        model.head_dim = model.hidden_size // model.num_heads
    if model.ffn_hidden_size is None:
        if model.activation == "swiglu":
            model.ffn_hidden_size = 64 * -(-int(8 * model.hidden_size / 3) // 64)
        else:
            model.ffn_hidden_size = 4 * model.hidden_size
    if model.max_position_embeddings is None:
        model.max_position_embeddings = model.seq_length
    moe = model.moe
    if moe.num_experts:
        if moe.expert_ffn_hidden_size is None:
            moe.expert_ffn_hidden_size = model.ffn_hidden_size
        if moe.shared_ffn_hidden_size is None and moe.num_shared_experts:
            moe.shared_ffn_hidden_size = moe.num_shared_experts * moe.expert_ffn_hidden_size
    return model


def is_moe_layer(model: ModelConfig, layer_id: int) -> bool:
    """Whether block `layer_id` has experts: past the first `moe.first_k_dense` (DeepSeek), every
    `moe.every_n_layers`-th ((layer_id + 1) % n == 0, Qwen's decoder_sparse_step)."""
    moe = model.moe
    return moe.num_experts > 0 and layer_id >= moe.first_k_dense and (layer_id + 1) % moe.every_n_layers == 0


def moe_layer_ids(model: ModelConfig) -> list[int]:
    """The global ids of the blocks with experts, in order (the model builds them; the step logs a row each)."""
    return [i for i in range(model.num_layers) if is_moe_layer(model, i)]


def validate_moe(model: ModelConfig) -> None:
    """The rules of `model.moe` (after `resolve_model_defaults`)."""
    moe = model.moe
    if moe.num_experts < 0:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} must be >= 0 (0: a dense model)")
    if not moe.num_experts:
        # a preset's experts turned off, or a typo'd model: said, not refused
        if unread := set_away_from_default(moe, MoEConfig):
            log.warning(f"model.moe: {', '.join(unread)} set on a dense model (model.moe.num_experts=0): not used")
        return
    choice(moe.router_score, "model.moe.router_score", RouterScore)
    if not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} must be in [1, model.moe.num_experts={moe.num_experts}]")
    if moe.top_k == 1 and moe.norm_topk_prob:  # Megatron refuses it too (--moe-router-pre-softmax for top-1)
        raise ConfigError("model.moe.top_k=1 with model.moe.norm_topk_prob=true divides the one chosen score by "
                          "itself: every combine weight is 1 and the router learns nothing from the loss; set "
                          "model.moe.norm_topk_prob=false")
    for key in ("expert_ffn_hidden_size", "every_n_layers"):
        positive(getattr(moe, key), f"model.moe.{key}")
    if moe.num_shared_experts < 0 or moe.first_k_dense < 0:
        raise ConfigError("model.moe.num_shared_experts and model.moe.first_k_dense must be >= 0")
    if moe.num_shared_experts:
        positive(moe.shared_ffn_hidden_size, "model.moe.shared_ffn_hidden_size")
    elif moe.shared_ffn_hidden_size is not None:
        raise ConfigError(f"model.moe.shared_ffn_hidden_size={moe.shared_ffn_hidden_size} sizes the shared experts, "
                          "and model.moe.num_shared_experts=0; set it > 0 or drop shared_ffn_hidden_size")
    if model.activation != "swiglu":
        raise ConfigError(f"model.moe: experts are SwiGLU MLPs, model.activation={model.activation}; "
                          "set model.activation=swiglu or model.moe.num_experts=0")
    positive(moe.capacity_factor, "model.moe.capacity_factor")  # null: dropless
    choice(moe.drop_policy, "model.moe.drop_policy", DropPolicy)
    if moe.capacity_factor is None and (unread := set_away_from_default(moe, MoEConfig, ["drop_policy"])):
        log.warning(f"model.moe.{unread[0]} set with model.moe.capacity_factor=null (dropless): "
                    "not used")
    positive(moe.routed_scaling_factor, "model.moe.routed_scaling_factor")
    for key in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
        non_negative(getattr(moe, key), f"model.moe.{key}", "turns it off")
    if not moe_layer_ids(model):
        raise ConfigError(f"model.moe: no block has experts with first_k_dense={moe.first_k_dense} and "
                          f"every_n_layers={moe.every_n_layers} over {model.num_layers} layers; lower them")


def validate_model(model: ModelConfig) -> None:
    for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by"):
        positive(getattr(model, key), f"model.{key}")
    if model.padded_vocab_size is not None and model.padded_vocab_size < model.vocab_size:
        raise ConfigError(f"model.padded_vocab_size={model.padded_vocab_size} is below model.vocab_size="
                          f"{model.vocab_size}; leave it unset (it is derived from make_vocab_size_divisible_by)")
    choice(model.norm, "model.norm", Norm)
    choice(model.activation, "model.activation", Activation)
    choice(model.position_embedding, "model.position_embedding", PositionEmbedding)
    choice(model.attention_backend, "model.attention_backend", AttentionBackend)
    if model.head_dim is None and model.hidden_size % model.num_heads:
        raise ConfigError(f"model.hidden_size={model.hidden_size} is not divisible by model.num_heads="
                          f"{model.num_heads}; change one so that hidden_size % num_heads == 0")
    if model.num_heads % model.num_kv_heads:
        raise ConfigError(f"model.num_heads={model.num_heads} is not divisible by model.num_kv_heads="
                          f"{model.num_kv_heads}; choose num_kv_heads among the divisors of num_heads")
    head_dim = model.head_dim if model.head_dim is not None else model.hidden_size // model.num_heads
    if head_dim < 1:
        raise ConfigError(f"model.head_dim={model.head_dim} must be >= 1, or null for hidden_size / num_heads")
    if model.position_embedding == "rope" and head_dim % 2:
        raise ConfigError(f"RoPE needs an even head dim, got {head_dim}; change model.head_dim or num_heads")
    if model.seq_length > model.max_position_embeddings:
        raise ConfigError(f"model.seq_length={model.seq_length} exceeds the model's positions "
                          f"(model.max_position_embeddings={model.max_position_embeddings}); "
                          "lower seq_length or raise max_position_embeddings")
    for key in ("dropout", "attention_dropout"):
        fraction(getattr(model, key), f"model.{key}")
    positive(model.sliding_window, "model.sliding_window")  # null: the whole document
    for key in ("norm_eps", "rope_theta", "init_std"):  # a zero or negative one trains NaNs, or fails inside torch
        positive(getattr(model, key), f"model.{key}")
    validate_rope_scaling(model)
    validate_moe(model)


# the model.rope_scaling fields each scaling reads
ROPE_SCALING_FIELDS = {"none": (), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings"),
                       "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                "attention_factor", "truncate")}


def validate_rope_scaling(model: ModelConfig) -> None:
    """The rules of `model.rope_scaling`: a scaling needs rotary positions and a factor of 1 or more (it divides the
    slow frequencies); Llama 3.1's a band low_freq_factor < high_freq_factor (its interpolation divides by their
    difference), YaRN's beta_slow < beta_fast (rotations: the ramp runs from the one to the other). Fields the type
    does not read are said unread in one warning."""
    scaling = model.rope_scaling
    others = [f.name for f in dataclasses.fields(RopeScalingConfig)
              if f.name != "type" and f.name not in ROPE_SCALING_FIELDS[str(scaling.type)]]
    if unread := set_away_from_default(scaling, RopeScalingConfig, others):
        hint = (" (model.rope_scaling.type=llama3 or yarn uses them)" if scaling.type == "none" and
                model.position_embedding == "rope" else "")
        log.warning(f"model.rope_scaling: {', '.join(unread)} set with model.rope_scaling.type={scaling.type}: not "
                    f"used{hint}")
    if scaling.type == "none":
        return
    if model.position_embedding != "rope":
        raise ConfigError(f"model.rope_scaling.type={scaling.type} scales rotary embeddings, and "
                          f"model.position_embedding={model.position_embedding} has none; set "
                          "model.rope_scaling.type=none")
    for key in ROPE_SCALING_FIELDS[str(scaling.type)]:
        if key != "truncate":
            positive(getattr(scaling, key), f"model.rope_scaling.{key}")
    if scaling.factor < 1:
        raise ConfigError(f"model.rope_scaling.factor={scaling.factor} must be >= 1 (it divides the slowest "
                          "frequencies: the context grows by it)")
    if scaling.type == "yarn":
        if not scaling.beta_slow < scaling.beta_fast:
            raise ConfigError(f"model.rope_scaling.beta_slow={scaling.beta_slow} must be below beta_fast="
                              f"{scaling.beta_fast} (YaRN's: 1 and 32)")
    elif not scaling.low_freq_factor < scaling.high_freq_factor:
        raise ConfigError(f"model.rope_scaling.low_freq_factor={scaling.low_freq_factor} must be below "
                          f"high_freq_factor={scaling.high_freq_factor} (Llama 3.1's: 1 and 4)")


def ramp_values(rampup: Sequence[int], global_batch_size: int) -> tuple[int, int, int]:
    """(start, increment, samples) of `trainer.rampup_batch_size`, checked against the global batch size: ConfigError
    naming what to change."""
    if len(rampup) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in rampup):
        raise ConfigError(f"trainer.rampup_batch_size={list(rampup)} must be three integers: [start batch size, "
                          "batch size increment, ramp-up samples]")
    first, increment, samples = rampup
    if not 1 <= first <= global_batch_size:
        raise ConfigError(f"trainer.rampup_batch_size starts at {first}, which must be in [1, "
                          f"trainer.global_batch_size={global_batch_size}]")
    if increment < 1 or samples < 1:
        raise ConfigError(f"trainer.rampup_batch_size={list(rampup)}: the increment and the ramp-up samples must be "
                          ">= 1")
    if (global_batch_size - first) % increment:
        raise ConfigError(f"trainer.rampup_batch_size={list(rampup)} does not reach trainer.global_batch_size="
                          f"{global_batch_size} from {first} in steps of {increment}; change the start or the "
                          "increment")
    return first, increment, samples


def ramp_phases(global_batch_size: int, rampup: Sequence[int] | None) -> list[tuple[int, int, int]]:
    """A run's steps as phases of one batch size each, (first step, first sample, batch size), the last one the whole
    global batch from its first step on: Megatron-LM's ramp-up rule in integers (megalm/data/steps.py says it).
    At most n + 1 phases, n = (global - start) / increment: a step that overshoots a boundary skips a size."""
    phases: list[tuple[int, int, int]] = []
    step = consumed = 0
    if rampup:
        first, increment, samples = ramp_values(rampup, global_batch_size)
        n = (global_batch_size - first) // increment
        while (level := min(consumed * n // samples, n)) < n:
            size = first + level * increment
            boundary = -(-(level + 1) * samples // n)  # the first sample count of the next level
            steps = -(-(boundary - consumed) // size)  # >= 1: consumed < boundary
            phases.append((step, consumed, size))
            step, consumed = step + steps, consumed + steps * size
    return [*phases, (step, consumed, global_batch_size)]


def ramp_batch_sizes(global_batch_size: int, rampup: Sequence[int] | None) -> list[int]:
    """The global batch sizes a run takes: [global_batch_size], or each its ramp-up reaches (for the checks that each
    splits over data-parallel ranks and micro-batches; a size the ramp skips need not)."""
    return [size for _, _, size in ramp_phases(global_batch_size, rampup)]


def steps_for_samples(global_batch_size: int, rampup: Sequence[int] | None, samples: int) -> int:
    """The steps that consume `samples` samples at this global batch size and ramp-up (the last step may take more)."""
    phases = ramp_phases(global_batch_size, rampup)
    for (first_step, first_sample, size), (_, ends, _) in zip(phases, [*phases[1:], (0, math.inf, 0)], strict=True):
        if samples <= ends:
            return first_step + -(-(samples - first_sample) // size)
    raise AssertionError("the last phase never ends")


def resolve_train_samples(t: TrainerConfig) -> None:
    """`trainer.train_samples` (Megatron-LM's --train-samples) as `trainer.max_steps`: the steps that consume them,
    the ramp-up's smaller batches counted. Idempotent: a resolved config (its max_steps derived) passes again."""
    if t.train_samples is None:
        return
    positive(t.train_samples, "trainer.train_samples")
    positive(t.global_batch_size, "trainer.global_batch_size")  # (it divides below)
    if t.tokens_per_step is not None:
        raise ConfigError("trainer.train_samples counts steps of trainer.global_batch_size, which "
                          "trainer.tokens_per_step replaces; set trainer.max_steps instead")
    steps = steps_for_samples(t.global_batch_size, t.rampup_batch_size, t.train_samples)
    if t.max_steps not in (steps, schema_default(TrainerConfig, "max_steps")):
        raise ConfigError(f"trainer.train_samples={t.train_samples} sets the run's length ({steps} steps), and "
                          f"trainer.max_steps={t.max_steps} sets it too; drop one of the two")
    t.max_steps = steps


def validate(cfg: MegalmConfig) -> MegalmConfig:
    """Check the cross-field rules of the model, trainer, optim, data and logging sections; fill derived
    defaults. Returns the same (mutated) config."""
    given = cfg.model.padded_vocab_size
    resolve_model_defaults(cfg.model, tp=cfg.parallel.tp)
    if given is not None and given != cfg.model.padded_vocab_size:
        log.warning(f"model.padded_vocab_size={given} is derived, not read: the run pads model.vocab_size="
                    f"{cfg.model.vocab_size} to {cfg.model.padded_vocab_size} (a multiple of "
                    "model.make_vocab_size_divisible_by x parallel.tp); set make_vocab_size_divisible_by instead")
    validate_model(cfg.model)
    if cfg.model.position_embedding == "learned" and (unread := set_away_from_default(cfg.model, ModelConfig,
                                                                                        ["rope_theta"])):
        log.warning(f"model.{unread[0]} set with model.position_embedding=learned, which has no rotary embedding: "
                    "not used")

    t = cfg.trainer
    resolve_train_samples(t)
    for key in ("max_steps", "global_batch_size", "micro_batch_size", "log_interval", "eval_iters", "keep_last"):
        positive(getattr(t, key), f"trainer.{key}")
    for key in ("eval_interval", "save_interval", "gc_interval"):
        non_negative(getattr(t, key), f"trainer.{key}", "turns it off")
    if t.stop_at_step is not None and not 0 < t.stop_at_step <= t.max_steps:
        raise ConfigError(f"trainer.stop_at_step={t.stop_at_step} must be in [1, trainer.max_steps={t.max_steps}]")
    if not str(t.resume or "").strip():
        raise ConfigError("trainer.resume is empty; set it to auto (the default), never, or the path of a checkpoint "
                          "or run dir")
    choice(t.device, "trainer.device", Device)
    choice(t.nonfinite, "trainer.nonfinite", NonFinite)
    positive(t.max_consecutive_skips, "trainer.max_consecutive_skips")
    positive(t.spike_window, "trainer.spike_window")
    if t.spike_zscore > 0 and t.spike_window < SPIKE_MIN_HISTORY:  # a window shorter would never report one
        raise ConfigError(f"trainer.spike_window={t.spike_window} must be >= {SPIKE_MIN_HISTORY}: a loss is judged "
                          f"against at least {SPIKE_MIN_HISTORY} steps' losses (trainer.spike_zscore=0 turns spike "
                          "reports off)")
    positive(cfg.parallel.timeout_minutes, "parallel.timeout_minutes")
    positive(t.exit_duration_minutes, "trainer.exit_duration_minutes")
    non_negative(cfg.parallel.flight_recorder_entries, "parallel.flight_recorder_entries", "turns the recorder off")
    timeout = cfg.parallel.timeout_minutes
    for key in ("hang_minutes", "init_hang_minutes"):  # the two watchdogs: steps, and joining the job
        minutes = getattr(t, key)
        non_negative(minutes, f"trainer.{key}", "turns the watchdog off")
        if timeout is not None and 0 < minutes >= timeout:
            raise ConfigError(f"parallel.timeout_minutes={timeout} must exceed trainer.{key}={minutes}, so that the "
                              f"watchdog reports a hang before a collective times out; raise it, or lower "
                              f"trainer.{key} (0 turns the watchdog off)")
    non_negative(t.grad_clip, "trainer.grad_clip", "turns clipping off")
    if t.num_threads is not None and t.num_threads < 1:
        raise ConfigError(f"trainer.num_threads={t.num_threads} must be >= 1, or null for torch's default")
    if isinstance(t.compile_backend, str):  # (the estimator puts a backend object here)
        choice(t.compile_backend, "trainer.compile_backend", ("inductor", "aot_eager", "eager"))
    non_negative(t.spike_zscore, "trainer.spike_zscore", "turns spike reports off")
    if t.tokens_per_step is not None:
        positive(t.tokens_per_step, "trainer.tokens_per_step")
        if not cfg.data.varlen:
            raise ConfigError("trainer.tokens_per_step is a budget over documents of different lengths; set "
                              "data.varlen=true, or use trainer.global_batch_size for packed samples")
        if unread := set_away_from_default(t, TrainerConfig, ["global_batch_size"]):
            log.warning(f"trainer.{unread[0]} set with trainer.tokens_per_step={t.tokens_per_step}: not used (a step "
                        "takes the samples that fit the token budget)")
    if t.rampup_batch_size is not None:
        if t.tokens_per_step is not None:
            raise ConfigError("trainer.rampup_batch_size ramps trainer.global_batch_size, which "
                              "trainer.tokens_per_step replaces; drop one of the two")
        ramp_values(t.rampup_batch_size, t.global_batch_size)
    if t.eval_interval == 0 and (unread := set_away_from_default(t, TrainerConfig, ["eval_iters"])):
        log.warning(f"trainer.{unread[0]} set with trainer.eval_interval=0, which never evaluates: not used")
    if str(t.nonfinite) == "stop" and (unread := set_away_from_default(t, TrainerConfig, ["max_consecutive_skips"])):
        log.warning(f"trainer.{unread[0]} set with trainer.nonfinite=stop, which skips no step: not used")

    o = cfg.optim
    choice(o.name, "optim.name", OptimizerName)
    choice(o.schedule, "optim.schedule", LRSchedule)
    choice(o.wsd_decay_style, "optim.wsd_decay_style", WSDDecayStyle)
    choice(o.muon_scale, "optim.muon_scale", MuonScale)
    fraction(o.muon_momentum, "optim.muon_momentum")
    positive(o.muon_ns_steps, "optim.muon_ns_steps")
    if o.name != "muon" and (unread := set_away_from_default(o, OptimConfig, [
            "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_scale"])):
        log.warning(f"optim.{unread[0]} is read by optim.name=muon only: not used")
    choice(o.implementation, "optim.implementation", OptimizerImplementation)
    positive(o.lr, "optim.lr")
    if not 0 <= o.min_lr <= o.lr:  # NaN fails it too
        raise ConfigError(f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}]")
    non_negative(o.warmup_steps, "optim.warmup_steps")
    if not 0.0 < o.wsd_decay_fraction <= 1.0:
        raise ConfigError(f"optim.wsd_decay_fraction={o.wsd_decay_fraction} must be in (0, 1]")
    if o.decay_steps is not None:
        positive(o.decay_steps, "optim.decay_steps")  # (null: to trainer.max_steps)
    if o.warmup_steps >= t.max_steps:  # Megatron refuses warmup >= decay
        log.warning(f"optim.warmup_steps={o.warmup_steps} >= trainer.max_steps={t.max_steps}: the learning rate "
                    f"warms up for the whole run (it ends at {t.max_steps / o.warmup_steps:.0%} of "
                    f"optim.lr={o.lr}) and never decays")
    decays = {"constant": "does not decay", "inverse_sqrt": "decays as the inverse square root of the step",
              "wsd": "decays over optim.wsd_decay_fraction of the run"}.get(
        str(o.schedule), "decays over optim.decay_steps (null: to trainer.max_steps)")
    if o.schedule != "wsd" and (unread := set_away_from_default(o, OptimConfig, ["wsd_decay_fraction",
                                                                                "wsd_decay_style"])):
        log.warning(f"optim.{unread[0]} is read by the wsd schedule only: optim.schedule={o.schedule} {decays}")
    if o.decay_steps is not None and o.schedule not in ("cosine", "linear"):
        log.warning(f"optim.decay_steps={o.decay_steps} is read by the cosine and linear schedules only: "
                    f"optim.schedule={o.schedule} {decays}")
    for key in ("beta1", "beta2"):
        fraction(getattr(o, key), f"optim.{key}")
    positive(o.eps, "optim.eps")
    non_negative(o.weight_decay, "optim.weight_decay")

    d = cfg.data
    choice(d.name, "data", DataSource)
    if d.blend is not None:
        if d.name != "indexed":
            raise ConfigError(f"data.blend mixes indexed datasets, but data={d.name}; add data=indexed")
        if d.path:
            raise ConfigError(f"data.path={d.path} and data.blend are both set; use one (a single dataset is "
                              f"data.blend=[1,{d.path}])")
        blend_pairs(d.blend)
    elif d.path and d.name != "indexed":  # it would be ignored: the run would train on the wrong data
        raise ConfigError(f"data.path={d.path} is read by data=indexed only, but data={d.name}; add data=indexed")
    elif d.name == "demo" and (refusal := demo_tokenizer_refusal(d.tokenizer)):
        raise ConfigError(refusal)
    elif d.name == "indexed" and not d.path:
        raise ConfigError("data=indexed needs data.path=PREFIX (the prefix of PREFIX.bin/PREFIX.idx "
                          "written by megalm-preprocess), or data.blend=[W1,PREFIX1,W2,PREFIX2,...]")
    if d.name == "demo" and cfg.model.vocab_size > 1024:  # data= is the config's default: a cluster example ran on it
        log.warning(f"{DEMO_DATA_WARNING}, for a model of "
                    f"{cfg.model.vocab_size:,} tokens ({cfg.model.name}): a smoke run, not a language model; "
                    "tokenize your corpus with megalm-preprocess and set data=indexed data.path=PREFIX")
    positive(d.synthetic.num_docs, "data.synthetic.num_docs")
    for key in ("mean_doc_length", "fixed_doc_length"):  # (fixed null: log-normal lengths)
        length = getattr(d.synthetic, key)
        positive(length, f"data.synthetic.{key}")
        if length is not None and length < 2:  # one token and the eod: it failed inside the data builder
            raise ConfigError(f"data.synthetic.{key}={length} must be >= 2 (a token and the end-of-document)")
    if d.name != "synthetic" and (unread := set_away_from_default(d.synthetic, SyntheticDataConfig)):
        log.warning(f"data.synthetic: {', '.join(unread)} set with data={d.name}: not used (data=synthetic reads it)")
    if d.name == "synthetic" and cfg.model.vocab_size < 2:
        raise ConfigError(f"data=synthetic draws tokens besides the end-of-document: model.vocab_size="
                          f"{cfg.model.vocab_size} must be >= 2")
    for key, value in (("seed", cfg.seed), ("data.split_seed", d.split_seed)):  # numpy's and torch's seed range
        if not 0 <= value < 2**63:
            raise ConfigError(f"{key}={value} must be in [0, 2**63)")
    fraction(d.valid_fraction, "data.valid_fraction")
    w = cfg.logging.wandb
    choice(w.mode, "logging.wandb.mode", WandbMode)
    if not w.enabled and (unread := set_away_from_default(w, WandbConfig)):  # (enabled=false is the default)
        log.warning(f"logging.wandb: {', '.join(unread)} set with logging.wandb.enabled=false: not used "
                    "(logging.wandb.enabled=true logs to W&B)")
    return cfg


RECOMPUTE_MODES = ("none", "full", "selective")  # parallel.recompute (megalm/parallel/recompute.py)


def recompute_modes(recompute: str | list[str], pp: int) -> list[str]:
    """`parallel.recompute` as one validated mode per pipeline rank (one mode for all, or a list of pp)."""
    if isinstance(recompute, str):
        modes = [recompute] * pp
    elif isinstance(recompute, Sequence):  # a list (Hydra's ListConfig is one)
        modes = list(recompute)
    else:  # true, null, 5, {a: 1}: a traceback, or a mapping read as its keys
        raise ConfigError(f"parallel.recompute={recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}, nor a list "
                          "of one mode per pipeline rank")
    if len(modes) != pp:
        raise ConfigError(f"parallel.recompute={modes} has {len(modes)} entries for parallel.pp={pp}; give one "
                          "mode, or one mode per pipeline rank")
    for mode in modes:
        if mode not in RECOMPUTE_MODES:
            raise ConfigError(f"parallel.recompute={mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    return modes


def window_within_samples(model: ModelConfig) -> int | None:
    """`model.sliding_window` where it is shorter than the sequence; None where there is none or it holds every
    document whole (a sample has at most seq_length inputs): what rings and HDP refuse, and what attention with it
    computes differently from without it."""
    window = model.sliding_window
    return window if window is not None and window < model.seq_length else None


def is_hsdp(parallel: ParallelConfig) -> bool:
    """Whether FSDP shards over groups smaller than dp*cp and replicates across them (HSDP); `fsdp_shard_size`
    equal to dp*cp is plain FSDP."""
    return (parallel.fsdp and parallel.fsdp_shard_size is not None
            and parallel.fsdp_shard_size < (parallel.dp or 1) * parallel.cp)


def zero_bubble(parallel: ParallelConfig) -> bool:
    """Whether `parallel` runs the zero-bubble schedule, whose weight gradients wait for its W actions
    (megalm/parallel/pipeline/weight_grad.py): what FSDP, torchao's layers and compiled FP8/MX linears refuse, and what
    compiled blocks run through ops of their own. One stage has no pipeline to schedule."""
    return parallel.pp > 1 and parallel.pp_schedule == "zb"


def process_group_minutes(cfg: MegalmConfig) -> float | None:
    """The collective timeout of the process group: `parallel.timeout_minutes`, or, unset with a hang watchdog on,
    5 minutes past the later of `trainer.hang_minutes` and `trainer.init_hang_minutes` (torch's default, 10 minutes
    for NCCL, would end the run before the watchdog could say where each rank is; so would a timeout under the
    joining watchdog's, with a rendezvous traceback instead of the report and exit 124); None keeps torch's
    default."""
    t = cfg.trainer
    watched = max(t.hang_minutes, t.init_hang_minutes)
    if cfg.parallel.timeout_minutes is not None or watched <= 0:
        return cfg.parallel.timeout_minutes
    return watched + 5
