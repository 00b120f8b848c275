"""Structured configs: the schema Hydra validates every run against.

`configs/` holds the values (one group per sub-package); these dataclasses hold the types and the
defaults. Registering `MegalmConfig` as the base of `configs/config.yaml` makes a misspelt key or a
wrong type fail at start. `validate` adds the cross-field rules of the sections this module owns
(model, trainer, optim, data, logging), each as a one-line `ConfigError` that names the fix; the
packages validate their own sections (`megalm.parallel.parallelism.validate_parallel`,
`megalm.precision.validate_precision`), and `megalm.training.validation.validate_run` runs them all.
This module imports no other megalm package: everything imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from megalm.errors import ConfigError


@dataclass
class ModelConfig:
    name: str = "tiny"
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: equal to num_heads (multi-head); fewer: GQA
    ffn_hidden_size: int | None = None  # None: 4h for gelu, 8h/3 rounded up to 64 for swiglu
    vocab_size: int = 320  # the tokenizer's vocabulary; the embedding and head are padded past it (below)
    # Megatron's rule: the embedding and output rows are vocab_size rounded up to a multiple of this x tp;
    # the padded rows start at 0 and their logits are masked (no probability mass in loss or generation)
    make_vocab_size_divisible_by: int = 128
    padded_vocab_size: int | None = None  # derived from the two above and parallel.tp; not set by hand
    init_from: str | None = None  # start from these weights: hf:DIR (a Hugging Face Llama/GPT-2 directory)
    seq_length: int = 256
    max_position_embeddings: int | None = None  # None: seq_length
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = 1e-5
    activation: str = "swiglu"  # swiglu | gelu
    position_embedding: str = "rope"  # rope | learned
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    bias: bool = False  # biases in linear layers (GPT-2 style)
    dropout: float = 0.0  # hidden dropout after attention and MLP
    attention_dropout: float = 0.0
    init_std: float = 0.02
    attention_backend: str = "auto"  # auto | flash_attn | torch_varlen | sdpa | reference


@dataclass
class SyntheticDataConfig:
    num_docs: int = 100_000
    mean_doc_length: int = 2048  # log-normal document lengths with this mean, in tokens
    fixed_doc_length: int | None = None  # all documents this long instead


@dataclass
class DataConfig:
    name: str = "demo"  # demo | indexed | synthetic
    path: str | None = None  # indexed: the prefix of PREFIX.bin / PREFIX.idx
    # indexed, instead of path: a weighted mix of prefixes, Megatron's --data-path: [0.3, PREFIX_A, 0.7, PREFIX_B]
    # (or [{weight: 0.3, path: PREFIX_A}, ...], or the string "0.3 PREFIX_A 0.7 PREFIX_B"); docs/blends.md
    blend: Any = None
    varlen: bool = False  # one document per sample (split at seq_length) instead of fixed-length packing
    tokenizer: str = "byte"  # byte | path to a Hugging Face tokenizer.json (demo / synthetic)
    valid_fraction: float = 0.01  # share of documents held out for validation
    split_seed: int = 0  # fixes the train/valid split independently of `seed`
    cache_dir: str | None = None  # demo corpus cache; default: $XDG_CACHE_HOME/megalm or ~/.cache/megalm
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)


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
    seen = [p for _, p in pairs]
    for path in seen:
        if seen.count(path) > 1:
            raise ConfigError(f"data.blend lists {path} twice; give it one entry with the summed weight")
    return pairs


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    schedule: str = "cosine"  # cosine | wsd | linear | constant
    warmup_steps: int = 20
    decay_steps: int | None = None  # cosine/linear: steps from warmup end to min_lr; None: to max_steps
    wsd_decay_fraction: float = 0.2  # wsd: the last fraction of max_steps decays linearly to min_lr
    implementation: str = "auto"  # auto | fused | foreach


@dataclass
class TrainerConfig:
    max_steps: int = 300
    global_batch_size: int = 12  # samples per optimizer step (unless tokens_per_step is set)
    tokens_per_step: int | None = None  # varlen data: a token budget per step instead (samples while they fit)
    micro_batch_size: int = 6  # samples per forward/backward
    log_interval: int = 10
    eval_interval: int = 100  # 0: never
    eval_iters: int = 4
    save_interval: int = 100  # 0: only at the end
    keep_last: int = 2  # checkpoints kept in the run dir
    resume: str = "auto"  # auto | never | <path of a checkpoint dir>
    stop_at_step: int | None = None  # stop (and save) early, as a preemption would; schedules keep max_steps
    grad_clip: float = 1.0  # 0: no clipping
    device: str = "auto"  # auto | cpu | cuda
    num_threads: int | None = None  # torch CPU threads; None: torch's default
    # On these signals: finish the step, save, exit 75 (requeue me); [] leaves the signals' default actions
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    nonfinite: str = "skip"  # skip | stop: a step whose loss or grad norm is inf/NaN skips its update, or ends the run
    max_consecutive_skips: int = 10  # this many non-finite steps in a row end the run (one line naming the step)
    spike_window: int = 100  # loss spikes: z-score against the last this many losses ...
    spike_zscore: float = 6.0  # ... above this is logged with the step and its sample ids (0: off)
    async_save: bool = False  # checkpoints written by a background thread (DCP async_save) while training goes on
    hang_minutes: float = 30.0  # no step, eval or save for this long: hang report per rank, exit 124 (0: off)
    # joining the job (rendezvous, process groups, the model's build and the config check) longer than this: hang
    # report per rank, exit 124 (0: off)
    init_hang_minutes: float = 10.0


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    dp: int | None = None  # None: world size / (tp * pp * cp)
    sequence_parallel: bool = False
    zero1: bool = False
    hdp: bool = False  # ByteScale hybrid DP: dp x cp ranks form one domain, re-planned every step
    hdp_capacity: int | None = None  # tokens per HDP rank per micro-batch (C); None: ceil(seq_length / cp)
    hdp_cost: str | None = None  # cost model: a preset or configs/hdp_cost YAML; None: from the model's shape
    hdp_offload: bool = False  # ByteScale's selective offload: long documents offload r(s) and need fewer ranks
    cp_comm: str = "ring"  # ring | a2a
    pp_schedule: str = "1f1b"  # 1f1b | interleaved | zb
    layers_per_stage: list[int] | None = None  # one layer count per virtual stage (pp*vpp); None: even split
    recompute: Any = "none"  # none | full | selective, or a list with one mode per pipeline rank
    grad_reduce_dtype: str | None = None  # fp32 | bf16 | None (the gradients' own dtype)
    bucket_size_mb: float = 25.0  # DP gradient bucket size
    timeout_minutes: float | None = None  # collective timeout; None: trainer.hang_minutes + 5 (torch's if that is 0)


@dataclass
class PrecisionConfig:
    # fp32 | bf16 | fp8 | fp8_delayed | fp8_rowwise | mxfp8 | mxfp4 | mxfp4_rtn | mxfp4_sr | mxfp4_rht, or auto
    # (configs/config.yaml's default: bf16 on CUDA sm80+, else fp32; replaced by that recipe's section before
    # validation, megalm/training/device.py). A MegalmConfig built in Python keeps fp32 unless asked.
    name: str = "fp32"
    forward: str | None = None  # mxfp4 family: the forward GEMM in bf16 (None) or fp8
    skip: list[str] = field(default_factory=list)  # fnmatch patterns of linear layers kept in bf16
    backend: str = "native"  # native | te (Transformer Engine's fp8 recipes when it is installed)
    autocast: bool = True  # recipes: bf16 autocast for the rest of the model (false: fp32 around the recipe)
    tf32: bool = True  # on CUDA, fp32 matmuls and convolutions use TF32 tensor cores (false: full fp32)


@dataclass
class OffloadConfig:
    enabled: bool = False  # activation offload to host memory (megalm/offload)
    policy: str = "uniform"  # pipeline (pp>1): uniform | lifespan | auto; pp=1 offloads layer groups
    fraction: float = 0.5  # share of micro-batches (pipeline) or of transformer blocks (pp=1) offloaded
    min_tensor_bytes: int = 65536  # saved tensors smaller than this stay on the device
    recompute_cheap: bool = False  # recompute SiLU/GELU outputs from their inputs instead of storing them


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "megalm"
    name: str | None = None
    entity: str | None = None
    mode: str = "offline"  # offline | online


@dataclass
class LoggingConfig:
    tensorboard: bool | None = None  # None: on when tensorboard is installed
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class MegalmConfig:
    seed: int = 1234
    debug: bool = False  # keep tracebacks on errors
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def register_schema() -> None:
    """Register the schema under the name `configs/config.yaml` lists first in its defaults."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="megalm_schema", node=MegalmConfig)


def _unknown_keys(node: Any, schema: Any, prefix: str = "") -> list[str]:
    """Keys of `node` the schema lacks (Hydra's `+key=value` can append them past the schema)."""
    unknown = []
    for key in node:
        if key not in schema:
            unknown.append(f"{prefix}{key}")
        elif OmegaConf.is_dict(node[key]) and OmegaConf.is_dict(schema[key]):
            unknown += _unknown_keys(node[key], schema[key], f"{prefix}{key}.")
    return unknown


def to_dataclass(cfg: DictConfig | MegalmConfig) -> MegalmConfig:
    """A plain `MegalmConfig` from a Hydra config; keys outside the schema are an error."""
    if isinstance(cfg, MegalmConfig):
        return cfg
    schema = OmegaConf.structured(MegalmConfig)
    unknown = _unknown_keys(cfg, schema)
    if unknown:
        raise ConfigError(f"unknown config key '{unknown[0]}'; check the spelling "
                          "(megalm-train --cfg job lists all keys)")
    merged = OmegaConf.merge(schema, cfg)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def choice(value: str, key: str, options: tuple[str, ...]) -> None:
    """A one-line ConfigError unless `value` is one of `options`."""
    if value not in options:
        raise ConfigError(f"{key}={value} is not one of {'|'.join(options)}; pick one of those")


def positive(value: int | float | None, key: str) -> None:
    """A one-line ConfigError unless `value` is None or > 0."""
    if value is not None and value <= 0:
        raise ConfigError(f"{key}={value} must be > 0")


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
    if model.ffn_hidden_size is None:
        if model.activation == "swiglu":
            model.ffn_hidden_size = 64 * -(-int(8 * model.hidden_size / 3) // 64)
        else:
            model.ffn_hidden_size = 4 * model.hidden_size
    if model.max_position_embeddings is None:
        model.max_position_embeddings = model.seq_length
    return model


def validate_model(model: ModelConfig) -> None:
    for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by"):
        positive(getattr(model, key), f"model.{key}")
    if model.padded_vocab_size is not None and model.padded_vocab_size < model.vocab_size:
        raise ConfigError(f"model.padded_vocab_size={model.padded_vocab_size} is below model.vocab_size="
                          f"{model.vocab_size}; leave it unset (it is derived from make_vocab_size_divisible_by)")
    choice(model.norm, "model.norm", ("rmsnorm", "layernorm"))
    choice(model.activation, "model.activation", ("swiglu", "gelu"))
    choice(model.position_embedding, "model.position_embedding", ("rope", "learned"))
    choice(model.attention_backend, "model.attention_backend",
            ("auto", "flash_attn", "torch_varlen", "sdpa", "reference"))
    if model.hidden_size % model.num_heads:
        raise ConfigError(f"model.hidden_size={model.hidden_size} is not divisible by model.num_heads="
                          f"{model.num_heads}; change one so that hidden_size % num_heads == 0")
    if model.num_heads % model.num_kv_heads:
        raise ConfigError(f"model.num_heads={model.num_heads} is not divisible by model.num_kv_heads="
                          f"{model.num_kv_heads}; choose num_kv_heads among the divisors of num_heads")
    head_dim = model.hidden_size // model.num_heads
    if model.position_embedding == "rope" and head_dim % 2:
        raise ConfigError(f"RoPE needs an even head dim, got hidden_size/num_heads={head_dim}; change num_heads")
    if model.seq_length > model.max_position_embeddings:
        raise ConfigError(f"model.seq_length={model.seq_length} exceeds the model's positions "
                          f"(model.max_position_embeddings={model.max_position_embeddings}); "
                          "lower seq_length or raise max_position_embeddings")
    for key in ("dropout", "attention_dropout"):
        if not 0.0 <= getattr(model, key) < 1.0:
            raise ConfigError(f"model.{key}={getattr(model, key)} must be in [0, 1)")


def validate(cfg: MegalmConfig) -> MegalmConfig:
    """Check the cross-field rules of the model, trainer, optim, data and logging sections; fill derived
    defaults. Returns the same (mutated) config."""
    resolve_model_defaults(cfg.model, tp=cfg.parallel.tp)
    validate_model(cfg.model)

    t = cfg.trainer
    for key in ("max_steps", "global_batch_size", "micro_batch_size", "log_interval", "eval_iters", "keep_last"):
        positive(getattr(t, key), f"trainer.{key}")
    for key in ("eval_interval", "save_interval"):
        if getattr(t, key) < 0:
            raise ConfigError(f"trainer.{key}={getattr(t, key)} must be >= 0 (0 turns it off)")
    if t.stop_at_step is not None and not 0 < t.stop_at_step <= t.max_steps:
        raise ConfigError(f"trainer.stop_at_step={t.stop_at_step} must be in [1, trainer.max_steps={t.max_steps}]")
    choice(t.device, "trainer.device", ("auto", "cpu", "cuda"))
    choice(t.nonfinite, "trainer.nonfinite", ("skip", "stop"))
    positive(t.max_consecutive_skips, "trainer.max_consecutive_skips")
    positive(t.spike_window, "trainer.spike_window")
    positive(cfg.parallel.timeout_minutes, "parallel.timeout_minutes")
    timeout = cfg.parallel.timeout_minutes
    for key in ("hang_minutes", "init_hang_minutes"):  # the two watchdogs: steps, and joining the job
        minutes = getattr(t, key)
        if minutes < 0:
            raise ConfigError(f"trainer.{key}={minutes} must be >= 0 (0 turns the watchdog off)")
        if timeout is not None and 0 < minutes >= timeout:
            raise ConfigError(f"parallel.timeout_minutes={timeout} must exceed trainer.{key}={minutes}, so that the "
                              f"watchdog reports a hang before a collective times out; raise it, or lower "
                              f"trainer.{key} (0 turns the watchdog off)")
    if t.spike_zscore < 0:
        raise ConfigError(f"trainer.spike_zscore={t.spike_zscore} must be >= 0 (0 turns spike reports off)")
    if t.tokens_per_step is not None:
        positive(t.tokens_per_step, "trainer.tokens_per_step")
        if not cfg.data.varlen:
            raise ConfigError("trainer.tokens_per_step is a budget over documents of different lengths; set "
                              "data.varlen=true, or use trainer.global_batch_size for packed samples")

    o = cfg.optim
    choice(o.name, "optim.name", ("adamw",))
    choice(o.schedule, "optim.schedule", ("cosine", "wsd", "linear", "constant"))
    choice(o.implementation, "optim.implementation", ("auto", "fused", "foreach"))
    positive(o.lr, "optim.lr")
    if o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}]")
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    if not 0.0 < o.wsd_decay_fraction <= 1.0:
        raise ConfigError(f"optim.wsd_decay_fraction={o.wsd_decay_fraction} must be in (0, 1]")

    d = cfg.data
    choice(d.name, "data", ("demo", "indexed", "synthetic"))
    if d.blend is not None:
        if d.name != "indexed":
            raise ConfigError(f"data.blend mixes indexed datasets, but data={d.name}; add data=indexed")
        if d.path:
            raise ConfigError(f"data.path={d.path} and data.blend are both set; use one (a single dataset is "
                              f"data.blend=[1,{d.path}])")
        blend_pairs(d.blend)
    elif d.path and d.name != "indexed":  # it would be ignored: the run would train on the wrong data
        raise ConfigError(f"data.path={d.path} is read by data=indexed only, but data={d.name}; add data=indexed")
    elif d.name == "indexed" and not d.path:
        raise ConfigError("data=indexed needs data.path=PREFIX (the prefix of PREFIX.bin/PREFIX.idx "
                          "written by megalm-preprocess), or data.blend=[W1,PREFIX1,W2,PREFIX2,...]")
    if not 0.0 <= d.valid_fraction < 1.0:
        raise ConfigError(f"data.valid_fraction={d.valid_fraction} must be in [0, 1)")
    choice(cfg.logging.wandb.mode, "logging.wandb.mode", ("offline", "online"))
    return cfg


def process_group_minutes(cfg: MegalmConfig) -> float | None:
    """The collective timeout of the process group: `parallel.timeout_minutes`, or, unset with the hang watchdog
    on, `trainer.hang_minutes` + 5 (torch's default, 10 minutes for NCCL, would end the run before the watchdog
    could say where each rank is); None keeps torch's default."""
    if cfg.parallel.timeout_minutes is not None or cfg.trainer.hang_minutes <= 0:
        return cfg.parallel.timeout_minutes
    return cfg.trainer.hang_minutes + 5


def config_to_dict(cfg: MegalmConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
