"""The GPT decoder: Llama style by default, GPT-2 style by config, over packed documents.

Pre-norm residual blocks (GPT-2, Radford et al. 2019; Xiong et al. 2020):
    x = x + dropout(attention(attention_norm(x)))
    x = x + dropout(mlp(mlp_norm(x)))
then a final norm and the output head. Llama (Touvron et al. 2023) = RMSNorm, SwiGLU, RoPE, GQA,
untied head, no biases; GPT-2 = LayerNorm, GELU, learned positions, tied head, biases.

There is no batch dimension: hidden states are [T, hidden] for T packed tokens, documents are
delimited by `cu_seqlens` and positions restart per document (see megalm/data/batch.py).
The model holds `Linear` layers (nn.Linear with hooks, megalm/model/linear.py) and no collectives;
parallelism and precision recipes are applied from outside.

`init_weights` makes the initial weights a function of the seed only: every parameter is drawn on
CPU in fp32 from its own generator seeded by (seed, crc32(name)), so the result does not depend on
construction order, device, dtype, or which layers a pipeline stage holds. Every parallel layout
therefore starts from the same model.
"""

from __future__ import annotations

import copy
import hashlib
import math
import zlib
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from megalm.config import ModelConfig, is_moe_layer, model_config, resolve_model_defaults, validate_model
from megalm.data.batch import PackedBatch
from megalm.model.attention import Attention, AttentionContext
from megalm.model.fused import part_rows, split_fused_name, unfused_names
from megalm.model.linear import Linear
from megalm.model.mlp import build_mlp
from megalm.model.moe import MoE
from megalm.model.naming import canonical_named_parameters, model_chunks
from megalm.model.norm import build_norm
from megalm.model.rope import rope_cos_sin
from megalm.model.shard import copy_full_value, shard_specs

# Parameters that are embedding tables (excluded by num_parameters(exclude_embeddings=True)).
EMBEDDING_PARAMS = ("embedding.weight", "position_embedding.weight")
# Parameters with one row per token id: `padded_vocab_size` rows, of which the first `vocab_size` are real.
VOCAB_PARAMS = ("embedding.weight", "output.weight")
# Projections that write into the residual stream: init std scaled by 1/sqrt(2 * num_layers) (GPT-2).
RESIDUAL_PROJECTIONS = ("o_proj.weight", "down_proj.weight")


class TransformerBlock(nn.Module):
    """One pre-norm decoder layer. `layer_id` is its global index, kept when a pipeline stage
    holds only some layers (it names the parameters for `init_weights`)."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = build_norm(cfg)
        self.attention = Attention(cfg)
        self.mlp_norm = build_norm(cfg)
        self.mlp = MoE(cfg) if is_moe_layer(cfg, layer_id) else build_mlp(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        context: AttentionContext | None = None,
    ) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), cu_seqlens, max_seqlen, rope, context))
        h = self.mlp_norm(x)
        if isinstance(self.mlp, MoE):  # a context may say how the routers see the tokens (`moe_tokens`: CP, padding)
            return x + self.dropout(self.mlp(h, cu_seqlens, getattr(context, "moe_tokens", None)))
        return x + self.dropout(self.mlp(h))


class GPT(nn.Module):
    """Decoder-only transformer: tokens [T] -> logits [T, padded_vocab_size] over packed documents; the
    columns from `vocab_size` on are padding (`real_logits` drops them; the losses mask them).

    `device` chooses where the parameters are created ("meta" for no memory: then
    `model.to_empty(device=...)` and `init_weights(model, seed)`). Always call `init_weights`:
    construction leaves torch's default (seed-dependent, order-dependent) initialization.
    """

    def __init__(self, cfg: ModelConfig | DictConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        cfg = resolve_model_defaults(copy.deepcopy(model_config(cfg)))
        validate_model(cfg)
        self.cfg = cfg
        self.head_dim = cfg.head_dim
        with torch.device(device) if device is not None else nullcontext():
            # Padded past the tokenizer's vocab (Megatron's make_vocab_size_divisible_by x tp): the loss and
            # generation mask the logits of ids >= vocab_size, so the padding rows never matter.
            self.embedding = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
            self.position_embedding = (
                nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
                if cfg.position_embedding == "learned" else None
            )
            self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.num_layers))
            self.final_norm = build_norm(cfg)
            # Tied: logits use embedding.weight and there is no output module (nor output.weight).
            self.output = (
                None if cfg.tie_embeddings else Linear(cfg.hidden_size, cfg.padded_vocab_size, bias=False)
            )
        # A pipeline stage (megalm/parallel/pipeline/stages.py) keeps a slice of `layers` and clears these:
        # a stage that is not first takes hidden states as input, one that is not last returns them.
        self.is_first_stage = True
        self.is_last_stage = True

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> hidden [T, hidden] (token embedding, plus learned positions for GPT-2)."""
        hidden = self.embedding(tokens)
        if self.position_embedding is not None:
            hidden = hidden + self.position_embedding(position_ids)
        return hidden

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE (cos, sin) [T, head_dim] shared by all layers, computed in fp32 and cast to `dtype` once (the
        residual stream's: bf16 with bf16 weights, as Megatron and HF cast them to q's dtype; fp32 under autocast
        and in fp32); None without rotary embeddings."""
        if self.cfg.position_embedding != "rope":
            return None
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
        return cos.to(dtype), sin.to(dtype)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> logits [T, padded_vocab_size] (final norm, then the output projection)."""
        hidden = self.final_norm(hidden)
        if self.output is None:
            return F.linear(hidden, self.embedding.weight)
        return self.output(hidden)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        context: AttentionContext | None = None,
    ) -> torch.Tensor:
        """tokens, position_ids int64 [T]; cu_seqlens int32 [N + 1]; max_seqlen: longest document (int);
        `context`: how attention runs when the micro-batch's documents span several ranks (None: locally).

        Returns logits [T, padded_vocab_size] in the compute dtype (bf16 under autocast): take the loss in fp32.
        A pipeline stage that is not the first takes the previous stage's hidden states [T, hidden] in
        place of `tokens`; one that is not the last returns its hidden states instead of logits.
        """
        hidden = self.embed(tokens, position_ids) if self.is_first_stage else tokens
        rope = self.rotary(position_ids, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cu_seqlens, max_seqlen, rope, context)
        return self.head(hidden) if self.is_last_stage else hidden

    def forward_batch(self, batch: PackedBatch) -> torch.Tensor:
        """`forward` on a PackedBatch (already on the model's device)."""
        return self(batch.tokens, batch.position_ids, batch.cu_seqlens, batch.max_seqlen)


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name`: a hash of (seed, crc32(name)).

    32 bits, because torch's CPU generator (mt19937) keeps only the low 32 bits of a seed:
    `seed * 2**32 + crc` would give every seed the same weights.
    """
    key = f"{seed}:{zlib.crc32(name.encode())}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")


def initial_value(
    name: str, shape: tuple[int, ...] | torch.Size, cfg: ModelConfig, seed: int
) -> torch.Tensor:
    """The full fp32 CPU initial value of parameter `name` (its full-model name and shape).

    Biases 0, norm weights 1, residual output projections (o_proj, down_proj) N(0, std/sqrt(2L)),
    every other weight (linear, embedding) N(0, std), with std = cfg.init_std and L = cfg.num_layers.
    The rows of the vocab padding are 0 and the real rows are drawn as if there were none, so the
    padding (which depends on tp) changes nothing in the model.
    A fused projection (qkv_proj, gate_up_proj) is its parts drawn under their unfused names and
    concatenated: the fused model starts from the unfused model's weights.
    """
    module_name, _, leaf = name.rpartition(".")
    if (parts := unfused_names(name)) is not None:  # q/k/v, gate/up: each part as the unfused model drew it
        _, module, _ = split_fused_name(name)
        rows = part_rows(module, cfg)
        return torch.cat([initial_value(part, (n, *shape[1:]), cfg, seed) for part, n in zip(parts, rows,
                                                                                            strict=True)])
    if leaf == "bias":
        return torch.zeros(shape)
    if module_name.endswith("norm"):
        return torch.ones(shape)
    if name in VOCAB_PARAMS and shape[0] > cfg.vocab_size:
        real = initial_value(name, (cfg.vocab_size, *shape[1:]), cfg, seed)
        return resize_vocab_rows(real, shape[0])
    std = cfg.init_std
    if name.endswith(RESIDUAL_PROJECTIONS):
        std = std / math.sqrt(2 * cfg.num_layers)
    generator = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)


def resize_vocab_rows(value: torch.Tensor, rows: int) -> torch.Tensor:
    """A vocab parameter (or its optimizer moment) with `rows` rows: padding rows cut or added as zeros.

    Layouts pad the vocab differently (tp enters the rule), so a checkpoint's tables are resized on load;
    every row past the real vocab is zero in every layout, so nothing real is lost.
    """
    if rows <= value.shape[0]:
        return value[:rows]
    padding = value.new_zeros((rows - value.shape[0], *value.shape[1:]))
    return torch.cat([value, padding])


def real_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The logits of the real vocab: [..., padded] -> [..., vocab_size] (a view)."""
    return logits[..., :vocab_size]


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, progress: Callable[[], None] | None = None) -> None:
    """Set every parameter to `initial_value(name, ...)`: deterministic in `seed` only.

    A sharded parameter (tensor parallelism) has a `ShardSpec` (megalm/model/shard.py): the full value
    is drawn, then sliced, so every layout starts from the same model. `model` may be a ModuleList of
    pipeline chunks. `progress()` after each parameter: drawing a large stage's full tensors takes minutes on a
    CPU thread, which a start-up hang watchdog must see as progress, not as a hang.
    """
    cfg = model_chunks(model)[0].cfg
    specs = shard_specs(model)
    for name, param in canonical_named_parameters(model):
        if param.is_meta:
            raise RuntimeError(f"init_weights: {name} is on the meta device; "
                               "call model.to_empty(device=...) first")
        spec = specs.get(name)
        full = initial_value(name, spec.full_shape if spec else tuple(param.shape), cfg, seed)
        copy_full_value(param, spec.shard(full) if spec else full)
        if progress is not None:
            progress()
    reset_buffers(model)


def reset_buffers(model: nn.Module) -> None:
    """Zero the model's state that is not a parameter (MoE routers' balancing bias, load counts): `to_empty` leaves
    buffers uninitialized, and neither `init_weights`' draws nor a checkpoint's parameters cover the counts."""
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()


def num_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Number of (unique) parameters; `exclude_embeddings` drops the token and position tables
    (with tied embeddings this also drops the output head, which is the same tensor)."""
    return sum(
        p.numel() for name, p in model.named_parameters()
        if not (exclude_embeddings and name in EMBEDDING_PARAMS)
    )
