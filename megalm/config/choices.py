"""The fixed sets a config value is picked from, as Enums the schema types its fields with.

OmegaConf validates an Enum field by member name when the config is composed, so `optim.schedule=exp` fails
before anything runs, listing the valid names; it rejects `typing.Literal`, hence Enums. Every member's name is
its value, and members are strings: code compares `cfg.model.norm == "rmsnorm"`, uses a member as a dict key,
and an f-string or `json.dumps` writes the bare value. The packages that own a choice (pipeline schedules,
offload policies, precision recipes) take their list of names from here, so the schema and the code cannot
drift apart.
"""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A string picked from a fixed set; `str(member)` and `f"{member}"` are its value (as `enum.StrEnum` from
    Python 3.11, which the 3.10 floor lacks)."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


class Norm(Choice):
    """The normalization of each block and of the final hidden state."""

    rmsnorm = "rmsnorm"
    layernorm = "layernorm"


class Activation(Choice):
    """The MLP's nonlinearity: gated SiLU (Llama) or GELU (GPT-2)."""

    swiglu = "swiglu"
    gelu = "gelu"


class DropPolicy(Choice):
    """Which assignments an MoE expert past its capacity drops: the last in token order (position), or those of the
    lowest routing weight (probs, Megatron's default `--moe-token-drop-policy`)."""

    position = "position"
    probs = "probs"


class RouterScore(Choice):
    """How an MoE router turns logits into expert scores: softmax (Switch, Mixtral, Qwen3) or sigmoid (DeepSeek-V3)."""

    softmax = "softmax"
    sigmoid = "sigmoid"


class PositionEmbedding(Choice):
    """Rotary embeddings (Llama) or a learned absolute table (GPT-2)."""

    rope = "rope"
    learned = "learned"


class RopeScaling(Choice):
    """How RoPE's frequencies are rescaled for a longer context: none, Llama 3.1's (slow frequencies divided by a
    factor, fast ones kept, those between interpolated by wavelength), or YaRN (the same by rotations over the
    original context, and the attention logits scaled: Qwen's long-context configs)."""

    none = "none"
    llama3 = "llama3"
    yarn = "yarn"


class AttentionBackend(Choice):
    """The attention kernel; auto picks the fastest present (megalm/model/attention.py)."""

    auto = "auto"
    flash_attn = "flash_attn"
    torch_varlen = "torch_varlen"
    cudnn = "cudnn"
    sdpa = "sdpa"
    reference = "reference"


class DataSource(Choice):
    """The bundled demo corpus, megalm-preprocess's indexed files, or synthetic documents."""

    demo = "demo"
    indexed = "indexed"
    synthetic = "synthetic"


class OptimizerName(Choice):
    """The optimizer."""

    adamw = "adamw"
    muon = "muon"


class MuonScale(Choice):
    """How Muon scales each orthogonalised matrix update of shape (rows, cols)."""

    match_rms_adamw = "match_rms_adamw"
    original = "original"


class LRSchedule(Choice):
    """The learning-rate schedule after warmup (wsd: warmup-stable-decay)."""

    cosine = "cosine"
    wsd = "wsd"
    linear = "linear"
    constant = "constant"
    inverse_sqrt = "inverse_sqrt"


class WSDDecayStyle(Choice):
    """The shape of the wsd schedule's decay (Megatron-LM's --lr-wsd-decay-style)."""

    linear = "linear"
    cosine = "cosine"
    exponential = "exponential"
    minus_sqrt = "minus_sqrt"


class OptimizerImplementation(Choice):
    """torch's AdamW kernel: fused (one kernel per step), foreach, or auto; or triton: megalm's one-pass kernel over
    fp32 main weights that writes the working copies too (megalm/parallel/data_parallel/adamw_kernel.py)."""

    auto = "auto"
    fused = "fused"
    foreach = "foreach"
    triton = "triton"


class Device(Choice):
    """Where the run computes; auto: CUDA when visible."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class NonFinite(Choice):
    """What a step with an inf/NaN loss or grad norm does."""

    skip = "skip"
    stop = "stop"


# "a2a+p2p" is no identifier, so this one is built by the functional API too.
ContextComm = Choice("ContextComm", [(v, v) for v in ("ring", "a2a", "a2a+p2p")], module=__name__,
                     qualname="ContextComm")
ContextComm.__doc__ = ("Context parallelism's exchange: ring attention, Ulysses all-to-all, or both (all-to-all inside "
                       "a node, ring across nodes).")


# A class body cannot spell a member named "1f1b", so this one is built by the functional API.
PipelineScheduleName = Choice("PipelineScheduleName", [(v, v) for v in ("1f1b", "interleaved", "zb")],
                              module=__name__, qualname="PipelineScheduleName")
PipelineScheduleName.__doc__ = "The pipeline schedule: 1F1B, interleaved 1F1B (vpp > 1), or zero-bubble."


class GradReduceDtype(Choice):
    """The dtype data-parallel gradients are summed in."""

    fp32 = "fp32"
    bf16 = "bf16"


class PrecisionRecipe(Choice):
    """The training precision; auto: bf16 on CUDA sm80+, else fp32 (megalm/training/device.py)."""

    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    bf16_autocast = "bf16_autocast"
    fp8 = "fp8"
    fp8_delayed = "fp8_delayed"
    fp8_rowwise = "fp8_rowwise"
    mxfp8 = "mxfp8"
    mxfp4 = "mxfp4"
    mxfp4_rtn = "mxfp4_rtn"
    mxfp4_sr = "mxfp4_sr"
    mxfp4_rht = "mxfp4_rht"


class ForwardFormat(Choice):
    """The mxfp4 recipes' forward GEMM format."""

    bf16 = "bf16"
    fp8 = "fp8"


class PrecisionBackend(Choice):
    """megalm's own low-precision linears, Transformer Engine's fp8 recipes, or torchao's float8 training."""

    native = "native"
    te = "te"
    torchao = "torchao"


class OffloadPolicy(Choice):
    """Which micro-batches a pipeline offloads (megalm/offload/policy.py)."""

    uniform = "uniform"
    lifespan = "lifespan"
    auto = "auto"


class WandbMode(Choice):
    """Weights & Biases: log to disk only, or upload."""

    offline = "offline"
    online = "online"
