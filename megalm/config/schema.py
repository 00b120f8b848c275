"""The schema Hydra validates every run against: one dataclass per config section, a docstring per field.

`configs/` holds the values (one group per sub-package); these dataclasses hold the types, the defaults and
what each field means (`megalm-train --cfg job` prints the composed values). Registering `MegalmConfig` as the
base of `configs/config.yaml` makes a misspelt key, a wrong type or a value outside a choice's Enum
(`megalm.config.choices`) fail at start, before anything runs.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from megalm.config.choices import (
    Activation,
    AttentionBackend,
    ContextComm,
    DataSource,
    Device,
    DropPolicy,
    ForwardFormat,
    GradReduceDtype,
    LRSchedule,
    MuonScale,
    NonFinite,
    Norm,
    OffloadPolicy,
    OptimizerImplementation,
    OptimizerName,
    PipelineScheduleName,
    PositionEmbedding,
    PrecisionBackend,
    PrecisionRecipe,
    RopeScaling,
    RouterScore,
    WandbMode,
    WSDDecayStyle,
)
from megalm.errors import ConfigError


@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling (megalm/model/rope.py): Llama 3.1's (`llama3_inv_freq`; Llama 3.1 and 3.3: factor 8,
    Llama 3.2: 32) or YaRN (`yarn_inv_freq`; Qwen3's 128K configs: factor 4 over 32,768), as a config.json's
    rope_scaling holds it; type none leaves RoPE as rope_theta makes it. factor and original_max_position_embeddings
    are both types'; the others are one type's each."""

    type: RopeScaling = RopeScaling.none
    """none | llama3 | yarn."""
    factor: float = 8.0
    """What the slowest frequencies are divided by: the context grows by it."""
    low_freq_factor: float = 1.0
    """Wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """Wavelengths shorter than original_max_position_embeddings / high_freq_factor are kept; those between are
    interpolated."""
    original_max_position_embeddings: int = 8192
    """The context the model was first trained at (Llama 3's 8,192)."""
    beta_fast: float = 32.0
    """YaRN: frequencies turning more than beta_fast times over the original context are kept."""
    beta_slow: float = 1.0
    """YaRN: those turning fewer than beta_slow times are divided by factor; a linear ramp over the pairs between."""
    attention_factor: float | None = None
    """YaRN: what cos and sin are multiplied by (the attention logits by its square); None: 0.1·ln(factor) + 1."""
    truncate: bool = True
    """YaRN: the ramp's ends rounded out to whole dimensions (transformers' default)."""


@dataclass
class MoEConfig:
    """Mixture-of-experts feed-forward layers (megalm/model/moe.py); num_experts 0 is a dense model."""

    num_experts: int = 0
    """Routed experts per MoE layer; 0: no MoE layers."""
    top_k: int = 2
    """Experts each token is routed to."""
    expert_ffn_hidden_size: int | None = None
    """Each expert's SwiGLU inner size; None: model.ffn_hidden_size."""
    num_shared_experts: int = 0
    """Experts every token goes through besides its routed ones (DeepSeek), run as one dense SwiGLU MLP."""
    shared_ffn_hidden_size: int | None = None
    """The shared MLP's inner size; None: num_shared_experts x expert_ffn_hidden_size."""
    first_k_dense: int = 0
    """The first k blocks keep a dense MLP (DeepSeek's first_k_dense_replace)."""
    every_n_layers: int = 1
    """Block i (past first_k_dense) has experts when (i + 1) % n == 0 (Qwen's decoder_sparse_step); 1: all."""
    router_score: RouterScore = RouterScore.softmax
    """softmax (Switch, Mixtral, Qwen3) | sigmoid (DeepSeek-V3) over the router's logits, in fp32."""
    norm_topk_prob: bool = True
    """Renormalise the k chosen scores to sum to 1 (Qwen3's norm_topk_prob; DeepSeek-V3 does for sigmoid)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' combine weights (DeepSeek-V3: 2.5)."""
    capacity_factor: float | None = None
    """None: dropless. Else an expert takes at most ceil(cf x T x top_k / num_experts) of a micro-batch's T tokens
    (the whole micro-batch's, whatever the layout); the rest of its assignments are dropped and counted."""
    drop_policy: DropPolicy = DropPolicy.position
    """Which assignments an expert past its capacity drops: position (the last in token order) | probs (those of
    the lowest routing weight, ties in token order: Megatron's default)."""
    aux_loss_coeff: float = 0.0
    """The switch-style load-balancing loss's coefficient (Fedus et al.; Qwen3's router_aux_loss_coef 0.001)."""
    seq_aux_loss_coeff: float = 0.0
    """The sequence-level balancing loss's coefficient (per document; DeepSeek-V3's alpha, 1e-4)."""
    z_loss_coeff: float = 0.0
    """The router z-loss's coefficient (ST-MoE: 1e-3)."""
    bias_update_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3's gamma, 1e-3): after each step every expert's selection bias moves by
    this toward uniform load; 0: off."""


@dataclass
class ModelConfig:
    """The transformer's shape and kind (Llama-style or GPT-2-style); presets in configs/model/."""

    name: str = "tiny"
    """The preset's name, for logs and run dirs."""
    num_layers: int = 4
    """Transformer blocks."""
    hidden_size: int = 256
    """The residual stream's width (h)."""
    num_heads: int = 4
    """Query heads."""
    head_dim: int | None = None
    """Each head's width; None: hidden_size / num_heads. Qwen3 sets it apart (128 whatever hidden_size / heads)."""
    qk_norm: bool = False
    """An RMSNorm over each head of q and of k before RoPE (Qwen3; weights [head_dim] shared by the heads)."""
    num_kv_heads: int | None = None
    """Key/value heads: None equals num_heads (multi-head attention); fewer is grouped-query attention."""
    ffn_hidden_size: int | None = None
    """The MLP's inner size; None: 4h for gelu, 8h/3 rounded up to a multiple of 64 for swiglu."""
    vocab_size: int = 320
    """The tokenizer's vocabulary; the embedding and head are padded past it (make_vocab_size_divisible_by)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron's rule: the embedding and output rows are vocab_size rounded up to a multiple of this x tp; the
    padded rows start at 0 and their logits are masked (no probability mass in loss or generation)."""
    padded_vocab_size: int | None = None
    """Derived from vocab_size, make_vocab_size_divisible_by and parallel.tp; not set by hand."""
    init_from: str | None = None
    """Start from these weights: hf:DIR (a Hugging Face model directory megalm-import reads), or a megalm checkpoint
    or run dir (any layout; docs/interop.md)."""
    seq_length: int = 256
    """Tokens per sample (packed), or the longest document piece (data.varlen)."""
    max_position_embeddings: int | None = None
    """Positions the model has; None: seq_length."""
    norm: Norm = Norm.rmsnorm
    """rmsnorm (Llama) | layernorm (GPT-2), before each sublayer and at the end."""
    norm_eps: float = 1e-5
    """The epsilon inside the norm's square root."""
    activation: Activation = Activation.swiglu
    """swiglu (Llama's gated MLP) | gelu (GPT-2)."""
    position_embedding: PositionEmbedding = PositionEmbedding.rope
    """rope (rotary, Llama) | learned (an absolute table, GPT-2)."""
    rope_theta: float = 10000.0
    """RoPE's base: the longest wavelength grows with it."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """RoPE's frequency scaling (Llama 3.1's: model.rope_scaling.type=llama3); none by default."""
    tie_embeddings: bool = False
    """The output head shares the input embedding's weight."""
    bias: bool = False
    """Biases in the linear layers (GPT-2 style)."""
    qkv_bias: bool = False
    """Biases in the q, k and v projections only (Qwen2, Qwen2.5); model.bias puts them in every linear layer."""
    dropout: float = 0.0
    """Hidden dropout after attention and MLP."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    sliding_window: int | None = None
    """None: each token attends to every earlier token of its document. Else to the last `sliding_window` tokens,
    itself included (Mistral 7B v0.1's 4096; Megatron's --window-size (sliding_window - 1, 0))."""
    init_std: float = 0.02
    """The standard deviation of the normal init of the weights."""
    attention_backend: AttentionBackend = AttentionBackend.auto
    """auto | flash_attn | torch_varlen | cudnn | sdpa | reference; auto picks the fastest one present
    (megalm/model/attention.py: cudnn on Hopper) and a slower pick than asked for is logged."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts layers (configs/model/moe_tiny.yaml); off by default."""


@dataclass
class SyntheticDataConfig:
    """Documents of random tokens, for throughput runs without a corpus."""

    num_docs: int = 100_000
    """Documents in the synthetic corpus."""
    mean_doc_length: int = 2048
    """Log-normal document lengths with this mean, in tokens."""
    fixed_doc_length: int | None = None
    """All documents this long instead."""


@dataclass
class DataConfig:
    """Where training tokens come from (configs/data/)."""

    name: DataSource = DataSource.demo
    """demo (the bundled corpus) | indexed (megalm-preprocess's files) | synthetic; chosen by data=NAME."""
    path: str | None = None
    """data=indexed: the prefix of PREFIX.bin / PREFIX.idx (megalm-preprocess writes them)."""
    blend: Any = None
    """data=indexed, instead of path: a weighted mix of prefixes, Megatron's --data-path: [0.3, PREFIX_A, 0.7,
    PREFIX_B] (or [{weight: 0.3, path: PREFIX_A}, ...], or the string "0.3 PREFIX_A 0.7 PREFIX_B"); docs/blends.md."""
    varlen: bool = False
    """One document per sample (split at seq_length) instead of fixed-length packing."""
    tokenizer: str = "byte"
    """data=indexed: the tokenizer of a Megatron-format dataset without megalm's sidecar, or one that stands for the
    dataset's own (the same vocab and eod; a blend's components alike). byte, or the path of a Hugging Face
    tokenizer.json. data=demo is byte-tokenized; data=synthetic has no text, and refuses another."""
    valid_fraction: float = 0.01
    """The share of documents held out for validation."""
    split_seed: int = 0
    """Fixes the train/valid split independently of `seed`."""
    cache_dir: str | None = None
    """The demo corpus cache, and the samplers' index arrays of 16 MB and more (index/: built once by the machine's
    first process, memory-mapped by all; megalm/data/index_cache.py); None: $XDG_CACHE_HOME/megalm or
    ~/.cache/megalm. A local disk: the files are locked with flock while built."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    """data=synthetic: the documents' count and lengths."""


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    name: OptimizerName = OptimizerName.adamw
    """adamw (decoupled weight decay, Loshchilov & Hutter) | muon (the transformer blocks' matrices orthogonalised,
    AdamW for the rest: megalm/training/muon.py)."""
    lr: float = 1e-3
    """The peak learning rate, reached at the end of warmup."""
    min_lr: float = 1e-4
    """The learning rate the schedule decays to."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the matrices; norms and biases get none."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    schedule: LRSchedule = LRSchedule.cosine
    """cosine | wsd (warmup-stable-decay) | linear | constant | inverse_sqrt (lr·√(warmup/step), down to min_lr),
    after warmup."""
    warmup_steps: int = 20
    """Linear warmup from 0 to lr over this many steps (global batches of samples under trainer.rampup_batch_size)."""
    decay_steps: int | None = None
    """cosine/linear: steps from the end of warmup to min_lr; None: to trainer.max_steps."""
    wsd_decay_fraction: float = 0.2
    """wsd: the last fraction of trainer.max_steps decays to min_lr."""
    wsd_decay_style: WSDDecayStyle = WSDDecayStyle.linear
    """wsd: the decay's shape, as Megatron-LM's --lr-wsd-decay-style: linear | cosine | exponential | minus_sqrt
    (1 - √progress, the cooldown Hägele et al. 2024 found best)."""
    muon_momentum: float = 0.95
    """muon: the momentum of the gradients it orthogonalises."""
    muon_nesterov: bool = True
    """muon: Nesterov momentum."""
    muon_ns_steps: int = 5
    """muon: Newton-Schulz iterations of the orthogonalisation."""
    muon_scale: MuonScale = MuonScale.match_rms_adamw
    """muon: match_rms_adamw scales a (rows, cols) update by 0.2·√max(rows, cols), to an AdamW update's RMS, so that
    optim.lr and weight_decay serve both optimizers (Liu et al. 2025, Moonlight) | original: √max(1, rows/cols)
    (Jordan et al. 2024)."""
    implementation: OptimizerImplementation = OptimizerImplementation.auto
    """auto | fused (one kernel per step) | foreach: torch's AdamW kernel; triton: megalm's one pass over the fp32
    main weights that also writes the bf16 working copies (bf16 working weights or ZeRO-1; CUDA, or a CPU under
    TRITON_INTERPRET=1, else torch's with a warning). auto: triton where fp32 main weights or ZeRO-1 shards are
    stepped on CUDA with triton installed (1.37x torch's kernel and cast at 1.3B on an H100, 2026-12-05:
    tools/bench/adamw_kernels.py), torch's fused kernel otherwise."""


@dataclass
class TrainerConfig:
    """The training loop: batch, steps, checkpoints, and what a bad step or a hang does."""

    max_steps: int = 300
    """Optimizer steps of the run; the learning-rate schedule spans them."""
    train_samples: int | None = None
    """Train on this many samples instead (Megatron-LM's --train-samples): max_steps becomes the steps that consume
    them, a batch ramp-up's smaller steps counted (the last step may take more); leave max_steps unset beside it."""
    global_batch_size: int = 12
    """Samples per optimizer step (unless tokens_per_step is set)."""
    rampup_batch_size: list[int] | None = None
    """[start, increment, samples]: ramp the global batch up from `start` samples a step by `increment` to
    global_batch_size over the run's first `samples` samples (Megatron-LM's --rampup-batch-size; each size a multiple
    of micro_batch_size x dp). The learning-rate schedule then counts samples, in global batches (as Megatron's
    --lr-warmup-samples; megalm/training/optim.py). Validation batches are whole. null: every step takes
    global_batch_size (megalm/data/steps.py)."""
    tokens_per_step: int | None = None
    """data.varlen: a token budget per step instead (samples are taken while they fit)."""
    micro_batch_size: int = 6
    """Samples per forward/backward."""
    log_interval: int = 10
    """Steps between log lines (and metrics.jsonl records)."""
    eval_interval: int = 100
    """Steps between validations; 0: never."""
    eval_iters: int = 2
    """Batches per validation."""
    save_interval: int = 100
    """Steps between checkpoints; 0: only at the end."""
    keep_last: int = 2
    """Checkpoints kept in the run dir."""
    resume: str = "auto"
    """auto (the run dir's latest checkpoint, if any), never, or the path of a checkpoint dir."""
    stop_at_step: int | None = None
    """Stop (and save) early, as a preemption would; the schedules keep max_steps."""
    grad_clip: float = 1.0
    """The global grad-norm clip; 0: no clipping. With fused AdamW (the default on CPU and CUDA, FSDP aside) the
    clip's scale is applied inside the AdamW kernel (its `grad_scale`) instead of by a pass over the gradients."""
    device: Device = Device.auto
    """auto (CUDA when visible, else CPU) | cpu | cuda."""
    num_threads: int | None = None
    """torch's CPU threads; None: torch's default."""
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """On these signals: finish the step, save, exit 75 (requeue me); [] leaves the signals' default actions."""
    exit_duration_minutes: float | None = None
    """Stop as on a preemption signal (save, exit 75) after the first step that ends this many minutes after the
    trainer started, on any rank's clock (Megatron-LM's --exit-duration-in-mins); null: no time limit."""
    nonfinite: NonFinite = NonFinite.skip
    """A step whose loss or grad norm is inf/NaN skips its update, or ends the run."""
    max_consecutive_skips: int = 10
    """This many non-finite steps in a row end the run (one line naming the step)."""
    spike_window: int = 100
    """Loss spikes: the z-score is taken against the last this many losses ..."""
    spike_zscore: float = 6.0
    """... and a loss above it is logged with the step and its sample ids; 0: off."""
    async_save: bool = False
    """Checkpoints are written by a background thread (DCP async_save) while training goes on."""
    hang_minutes: float = 30.0
    """No step, eval or save for this long: a hang report per rank, exit 124; 0: off."""
    compile: bool | None = None
    """torch.compile each transformer block (as TorchTitan does), after the attention backends are chosen; the
    block's forward and backward are one graph each (tests/unit/test_compile_blocks.py counts the breaks). The
    loss's chunk kernels are compiled too (with parallel.tp=1: megalm/model/loss.py), as TorchTitan's loss is. The CP
    ring and the FP8/MX recipes' linears run inside the graph as opaque ops (fp8's casts as graph ops, and its
    GEMMs too where torch._scaled_mm runs); those recipes refuse SP and ZB. None (auto, the default): compiled on
    CUDA, where a GPU row measured it faster (1.16x bf16, 1.58x fp8 at 1.3B on an H200: docs/benchmarks.md), eager
    on a CPU, where inductor cannot, with TE, and where no GPU row has measured them yet (MoE, whose blocks compile
    whole too, except at expert parallelism's all-to-all; ZB, whose deferred linears run as opaque ops in a whole
    graph: megalm/training/compile.py `auto_compile`); one log line says which and why. true / false: always /
    never."""
    compile_backend: str = "inductor"
    """The torch.compile backend of trainer.compile: inductor (fused kernels), or aot_eager / eager to debug. megalm's
    aot_eager runs the joint-graph passes inductor runs (SP's re-gathers, full recompute on torch 2.11), so it saves
    what inductor's blocks save; eager cannot recompute an MoE model's blocks (refused in one line)."""
    gc_interval: int = 1
    """Python's garbage collector runs between steps only while training: its young generations every this many
    steps, a full collection after each evaluation or checkpoint and after a compile (TorchTitan's training.gc_freq,
    50 there; Megatron's --manual-gc: a full collection inside a step pauses that rank 0.1-0.2 s, and the others
    wait for it at the next collective). 1 frees at each step's end the cycles torch 2.11's compiled blocks leave
    every step, as Python's own collector would; 0: Python's automatic collection (megalm/training/python_gc.py)."""
    init_hang_minutes: float = 10.0
    """Joining the job (rendezvous, process groups, the model's build, the config check) longer than this: a hang
    report per rank, exit 124; 0: off."""


@dataclass
class ParallelConfig:
    """How the ranks split the work; dp x tp x pp x cp = world size (docs/guide.md lists the layouts)."""

    tp: int = 1
    """Tensor-parallel ranks (Megatron's column/row-parallel linears)."""
    pp: int = 1
    """Pipeline stages."""
    vpp: int = 1
    """Virtual stages per pipeline rank (interleaved schedule)."""
    cp: int = 1
    """Context-parallel ranks: each sequence is split over them."""
    dp: int | None = None
    """Data-parallel replicas; None: world size / (tp * pp * cp)."""
    ep: int = 1
    """Expert-parallel ranks (MoE models): each holds num_experts / ep of every MoE layer's experts, and tokens travel
    to their experts by all-to-all. Carved from the dp x cp ranks (consecutive ones); it must divide both."""
    sequence_parallel: bool = False
    """Shard the norm/dropout activations over the tp ranks (Korthikanti et al.)."""
    async_tp: bool = False
    """Under sequence parallelism, in compiled blocks: each TP all-gather and reduce-scatter runs micro-pipelined
    with the GEMM it feeds or drains (TorchTitan's async TP: inductor's _micro_pipeline_tp pass over CUDA symmetric
    memory; megalm/parallel/tensor/async_tp.py). Needs trainer.compile with the inductor backend; NCCL only (on
    another backend one log line says it is off)."""
    zero1: bool = False
    """Shard the optimizer states over the data-parallel ranks (ZeRO stage 1): AdamW's flat buckets cut evenly; under
    optim.name=muon by whole matrices (megalm/parallel/data_parallel/layerwise.py)."""
    fsdp: bool = False
    """Shard weights, gradients and optimizer states over the data-parallel (x cp) ranks: ZeRO-3 through torch's
    FSDP2 `fully_shard`, one unit per transformer block plus the root (megalm/parallel/fsdp)."""
    fsdp_reshard_after_forward: bool = True
    """FSDP: free each block's gathered parameters after its forward and gather them again for its backward; false
    keeps them from forward to backward (one all-gather less per block, the gathered model held in between)."""
    fsdp_shard_size: int | None = None
    """FSDP: None shards over all dp x cp ranks; a divisor of dp x cp is HSDP: shard within groups of that many
    consecutive ranks (a node's), replicate across the groups (gradients all-reduced between replicas)."""
    fsdp_cpu_offload: bool = False
    """FSDP: keep the sharded parameters, gradients and optimizer step on the host (FSDP2's CPUOffloadPolicy;
    CUDA only)."""
    fsdp_reduce_each_micro_batch: bool = True
    """FSDP: reduce-scatter each unit's gradients after every micro-batch's backward, accumulating them sharded (as
    TorchTitan does); false keeps each rank's unsharded gradients (in grad_reduce_dtype: fp32 by default) across the
    step's micro-batches and reduce-scatters once, in the last: 1/micro-batches of the gradient traffic for 4 bytes
    a (TP-local) parameter more on every rank (FSDP2's set_requires_gradient_sync). HSDP's all-reduce across
    replicas runs once a step either way (with fp32 sums)."""
    overlap_param_gather: bool = True
    """ZeRO-1: the all-gather of the updated parameters (under optim.name=muon, each parameter's broadcast from its
    owner) runs on while the next forward begins, each waited for before the first block that reads it (Megatron's
    overlap_param_gather); false: waited for in the step."""
    hdp: bool = False
    """ByteScale's hybrid data parallelism: the dp x cp ranks form one domain, re-planned every step."""
    hdp_capacity: int | None = None
    """Tokens per HDP rank per micro-batch (C); None: ceil(seq_length / cp)."""
    hdp_cost: str | None = None
    """The HDP cost model: a preset or a configs/hdp_cost YAML; None: derived from the model's shape."""
    hdp_offload: bool = False
    """ByteScale's selective offload: long documents offload a ratio r(s) and need fewer ranks."""
    cp_comm: ContextComm = ContextComm.ring
    """ring (ring attention, K/V passed round the CP ranks) | a2a (Ulysses all-to-all over heads) | a2a+p2p
    (hierarchical: all-to-all within groups of cp_a2a_size ranks, a ring across the groups)."""
    cp_a2a_size: int | None = None
    """a2a+p2p: ranks per all-to-all group, those of one node (under HDP: the HDP ranks a node holds); it must divide
    each TP rank's query and kv heads. None: static CP the largest divisor of cp up to 8 // tp; HDP 8 // tp."""
    pp_schedule: PipelineScheduleName = PipelineScheduleName["1f1b"]
    """1f1b | interleaved (needs vpp > 1) | zb (zero-bubble, split weight gradients)."""
    layers_per_stage: list[int] | None = None
    """One layer count per virtual stage (pp * vpp); None: an even split."""
    recompute: Any = "none"
    """none | full | selective, or a list with one mode per pipeline rank."""
    grad_reduce_dtype: GradReduceDtype | None = None
    """The dtype gradients are summed in; None: the gradients' own dtype. Under precision=bf16 the micro-batches'
    gradients accumulate in the buckets too (Megatron's main_grad), in this dtype; None: fp32."""
    bucket_size_mb: float = 25.0
    """The data-parallel gradient bucket size."""
    gradient_accumulation_fusion: bool = False
    """Under precision=bf16: each linear layer's weight-gradient GEMM adds into its fp32 main gradient in the buckets
    itself (Megatron's gradient_accumulation_fusion; on CUDA torch's bf16 GEMM with an fp32 accumulator, no apex), so
    no bf16 weight gradient is written and copied in (megalm/parallel/data_parallel/fused_wgrad.py)."""
    timeout_minutes: float | None = None
    """The collective timeout; None: 5 minutes past the later of trainer.hang_minutes and trainer.init_hang_minutes
    (torch's default if both are 0)."""
    flight_recorder_entries: int = 20000
    """torch's flight recorder: each process keeps its last this many collectives, which the hang watchdog dumps to
    RUN_DIR/hang-rankR.flight.json (`python -m megalm.parallel.flight_recorder RUN_DIR` compares the ranks'); 0 off.
    A TORCH_FR_BUFFER_SIZE in the environment wins."""


@dataclass
class PrecisionConfig:
    """The number formats of the linears and of the rest of the model (configs/precision/)."""

    name: PrecisionRecipe = PrecisionRecipe.fp32
    """The recipe: fp32; bf16 (bf16 weights, fp32 main weights and gradient sums); bf16_autocast; the fp8/mx
    recipes of the linear layers (megalm/precision). configs/config.yaml's default is auto (bf16 on CUDA sm80+,
    else fp32), replaced by that recipe's section before validation (megalm/training/device.py); a MegalmConfig
    built in Python keeps fp32."""
    forward: ForwardFormat | None = None
    """mxfp4 recipes: the forward GEMM in bf16 (None) or fp8."""
    skip: list[str] | None = None
    """fnmatch patterns of linear layers the fp8/mx recipes keep in bf16; None: [output] (the head), under
    `precision=fp8` and `precision.name=fp8` alike. Not read by fp32, bf16 or bf16_autocast (refused there)."""
    backend: PrecisionBackend = PrecisionBackend.native
    """native (megalm's linears) | te (Transformer Engine's fp8 recipes, when it is installed) | torchao (torchao's
    Float8Linear, TorchTitan's fp8, for precision=fp8, when it is installed)."""
    fp8_all_gather: bool = False
    """precision.backend=torchao under FSDP (parallel.fsdp=true): FSDP gathers each converted linear's weight in FP8
    (1 byte an element, where bf16 gathers 2), cast from its fp32 shard with the whole weight's scale, which each
    optimizer step precomputes for all of a model chunk's weights in one all-reduce (TorchTitan's
    enable_fsdp_float8_all_gather and precompute_float8_dynamic_scale_for_fsdp; Megatron's --fp8-param-gather). A
    weight whose rows do not divide over FSDP's shards is gathered, then cast (one log line). False: all are."""
    autocast: bool = True
    """fp8/mx recipes on fp32 weights (`bf16_weights` false): bf16 autocast for the rest of the model (false: fp32
    around the recipe, and fp32 weights where `bf16_weights` is auto; refused beside `bf16_weights` true). Not read
    by fp32 or bf16 (bf16 weights, no autocast; false is said to be unread); refused false under bf16_autocast
    (autocast over fp32 weights: what bf16 was before)."""
    bf16_weights: bool | None = None
    """fp8/mx recipes: bf16 working weights behind fp32 main weights, as precision=bf16 keeps them, so the
    recipe's GEMMs quantize bf16 activations and weights (Transformer Engine's and Megatron's setting) and no
    autocast runs; false: fp32 weights, under autocast unless `autocast` is false (the recipes' default before
    2026-12-03); None (auto, the default): true on the native backend unless `autocast` is false."""
    tf32: bool = True
    """On CUDA, fp32 matmuls and convolutions use TF32 tensor cores (false: full fp32)."""


@dataclass
class OffloadConfig:
    """Activation offload to host memory (megalm/offload, docs/offload.md)."""

    enabled: bool = False
    """Offload saved activations to host memory between forward and backward."""
    policy: OffloadPolicy = OffloadPolicy.uniform
    """pp > 1: which micro-batches offload; pp = 1 offloads groups of blocks."""
    fraction: float = 0.5
    """The share of micro-batches (pipeline) or of transformer blocks (pp = 1) offloaded."""
    min_tensor_bytes: int = 65536
    """Saved tensors smaller than this stay on the device."""
    recompute_cheap: bool = False
    """Recompute GELU outputs from their inputs instead of storing them (SwiGLU's SiLU output is never stored)."""


@dataclass
class WandbConfig:
    """Weights & Biases logging (pip install -e ".[wandb]")."""

    enabled: bool = False
    """Log the metrics to Weights & Biases too."""
    project: str = "megalm"
    """The W&B project."""
    name: str | None = None
    """The run's name; None: W&B's."""
    entity: str | None = None
    """The W&B team or user; None: the default of the logged-in account."""
    mode: WandbMode = WandbMode.offline
    """offline (written to the run dir; wandb sync uploads it) | online."""


@dataclass
class LoggingConfig:
    """Where metrics go besides the console and the run dir's metrics.jsonl."""

    tensorboard: bool | None = None
    """None: on when tensorboard is installed."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases."""
    params_norm: bool = False
    """Log the L2 norm of the model's weights at each logged step (`params_norm`: Megatron's --log-params-norm), a
    reduction over the layout's shards and one host sync a logged step."""


@dataclass
class ProfilingConfig:
    """A profile of a few steps of the run (megalm/training/profiling.py): Megatron's --profile and
    --record-memory-history, TorchTitan's [profiling] section."""

    trace: bool = False
    """Record torch.profiler's trace of the steps below (CPU ops, and CUDA kernels on a GPU): a Chrome trace per rank
    in the run dir's profile/, and where the steps' time went (kernels by kind) in the log and a JSON beside it."""
    memory_snapshot: bool = False
    """CUDA: record the caching allocator's history from the start of training, and write its snapshot (open it at
    pytorch.org/memory_viz) after the steps below, and on an out-of-memory error; a CPU run has none (said once)."""
    start_step: int = 10
    """The steps this process runs before the profiled ones (a resumed run counts from its resume); the last of them
    warms the profiler up. 10 leaves compiling and the allocator's first steps out."""
    steps: int = 2
    """How many steps are profiled."""
    ranks: list[int] | None = field(default_factory=lambda: [0])
    """The global ranks that profile; null: every rank."""


@dataclass
class MegalmConfig:
    """A whole run."""

    seed: int = 1234
    """Seeds the init and the data order; any layout of the same seed trains the same model."""
    debug: bool = False
    """Keep tracebacks on errors."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The transformer (configs/model/)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The tokens (configs/data/)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer and its schedule (configs/optim/)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop (configs/trainer/)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The layout over the ranks (configs/parallel/)."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """The number formats (configs/precision/)."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Activation offload (configs/offload/)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metric sinks (configs/logging/)."""
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    """Profiler traces and memory snapshots of a few steps (configs/profiling/)."""


def register_schema() -> None:
    """Register the schema under the name `configs/config.yaml` lists first in its defaults; once a process (a
    registration builds the schema's OmegaConf node, 43 ms of CPU, and every composition asks)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    if "megalm_schema.yaml" not in store.repo:
        store.store(name="megalm_schema", node=MegalmConfig)


@functools.cache
def _schema_node() -> DictConfig:
    """The schema as an OmegaConf node, built once a process (43 ms of CPU a build) and only read: `OmegaConf.merge`
    copies its first argument before merging into it."""
    node = OmegaConf.structured(MegalmConfig)
    OmegaConf.set_readonly(node, True)
    return node


def _unknown_keys(node: Any, schema: Any, prefix: str = "") -> list[str]:
    """Keys of `node` the schema lacks (Hydra's `+key=value` can append them past the schema)."""
    unknown = []
    for key in node:
        if key not in schema:
            unknown.append(f"{prefix}{key}")
        elif OmegaConf.is_dict(node[key]) and OmegaConf.is_dict(schema[key]):
            unknown += _unknown_keys(node[key], schema[key], f"{prefix}{key}.")
    return unknown


def unknown_key_line(key: str) -> str:
    """The one line for a key the schema lacks."""
    return f"unknown config key '{key}'; check the spelling (megalm-train --cfg job lists all keys)"


def model_config(values: dict[str, Any] | DictConfig | ModelConfig) -> ModelConfig:
    """A `ModelConfig` from a saved run's `model` section (nested sections, such as `moe`, made dataclasses too; a
    key the schema lacks, or a value outside a choice, is a one-line ConfigError)."""
    if isinstance(values, ModelConfig):
        return values
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), values))  # type: ignore
    except (OmegaConfBaseException, KeyError) as e:  # a ConfigKeyError (a key the schema lacks) is no ValidationError
        line = schema_error_line(e) if isinstance(e, OmegaConfBaseException) else str(e)
        raise ConfigError(f"model config: {line}") from None


def to_dataclass(cfg: DictConfig | MegalmConfig) -> MegalmConfig:
    """A plain `MegalmConfig` from a Hydra config; keys outside the schema are an error."""
    if isinstance(cfg, MegalmConfig):
        return cfg
    schema = _schema_node()
    unknown = _unknown_keys(cfg, schema)
    if unknown:
        raise ConfigError(unknown_key_line(unknown[0]))
    try:
        merged = OmegaConf.merge(schema, cfg)
    except ValidationError as e:
        raise ConfigError(schema_error_line(e)) from None
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


_NOT_A_CHOICE = re.compile(r"Invalid value '(?P<value>.*)', expected one of \[(?P<options>.*)\]")


def schema_error_line(exc: BaseException) -> str:
    """One line for OmegaConf's multi-line schema error: the key, the value and the fix. A key the schema lacks
    names itself; a value outside a choice's Enum reads as the packages' own checks do: `key=value is not one of
    a|b|c; pick one of those`."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    head = lines[0] if lines else type(exc).__name__
    full_key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    if ("not in struct" in head or "not in '" in head) and full_key:
        return unknown_key_line(full_key)
    not_a_choice = _NOT_A_CHOICE.match(head)
    if not_a_choice and full_key:
        options = "|".join(o.strip() for o in not_a_choice["options"].split(","))
        key = "precision" if full_key == "precision.name" else "data" if full_key == "data.name" else full_key
        return f"{key}={not_a_choice['value']} is not one of {options}; pick one of those"
    return f"{full_key}: {head}" if full_key else head


def config_to_dict(cfg: MegalmConfig) -> dict[str, Any]:
    """The config as plain values: choices as their names, ready for JSON and YAML."""
    plain = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    return plain  # type: ignore[return-value]
