"""Fused projections: one GEMM for q, k and v, one for SwiGLU's gate and up (Megatron's linear_qkv, linear_fc1).

A block's input is read once per fused GEMM instead of once per projection, its gradient comes out of one dgrad
GEMM instead of being summed from three (or two), and the weight-gradient GEMM reads the input once too.

Layout of the full tensors, the parts concatenated along the output rows (dim 0, weights and biases alike):

    attention.qkv_proj   [q (num_heads * head_dim); k (num_kv_heads * head_dim); v (num_kv_heads * head_dim)]
    mlp.gate_up_proj     [gate (ffn_hidden_size); up (ffn_hidden_size)]

Tensor parallelism cuts each part on its own (megalm/model/shard.py, `FusedShardSpec`), so a rank's local weight
is [its q heads; its kv heads; its kv heads] or [its gate units; its up units], split by width in the forward
with no communication, for GQA with kv heads replicated over TP ranks too. Init draws each part as the unfused
model did under its old name (`initial_value`), so a fused model starts from the same function; the parts'
names (`UNFUSED`) are also what Hugging Face files and checkpoints written before the fusion hold:
`fuse_tensors` / `unfuse_tensors` convert between the two namings.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megalm.config import ModelConfig

# fused module (within a layer) -> the modules it replaced, in the order of its rows
UNFUSED = {"attention.qkv_proj": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
           "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def part_rows(module: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The output rows of each part of fused `module` ("attention.qkv_proj" or "mlp.gate_up_proj")."""
    if module == "attention.qkv_proj":
        head_dim = cfg.head_dim
        return cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim, cfg.num_kv_heads * head_dim
    if module == "mlp.gate_up_proj":
        return cfg.ffn_hidden_size, cfg.ffn_hidden_size
    raise ValueError(f"{module} is not a fused projection")


def split_fused_name(name: str) -> tuple[str, str, str] | None:
    """("layers.N.", fused module, leaf) for a parameter of a fused projection, else None."""
    for module in UNFUSED:
        marker = f".{module}."
        if marker in name and name.startswith("layers."):
            prefix, _, leaf = name.partition(marker)
            return prefix + ".", module, leaf
    return None


def unfused_names(name: str) -> list[str] | None:
    """The names of the parts of fused parameter `name`, in row order (None for a parameter that is not fused)."""
    split = split_fused_name(name)
    if split is None:
        return None
    prefix, module, leaf = split
    return [f"{prefix}{part}.{leaf}" for part in UNFUSED[module]]


def fuse_tensors(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The same tensors with every complete set of parts (q/k/v, gate/up, under their unfused names) concatenated
    into its fused parameter; everything else unchanged. `cfg` gives the parts' sizes (checked)."""
    out = dict(tensors)
    for name in list(tensors):
        for module, parts in UNFUSED.items():
            first = f".{parts[0]}."
            if first not in name or not name.startswith("layers."):
                continue
            prefix, _, leaf = name.partition(first)
            names = [f"{prefix}.{part}.{leaf}" for part in parts]
            if not all(n in out for n in names):
                continue
            values = [out.pop(n) for n in names]
            rows = tuple(v.shape[0] for v in values)
            if rows != part_rows(module, cfg):
                raise ValueError(f"{names}: rows {rows}, the model's {module} has parts of {part_rows(module, cfg)}")
            out[f"{prefix}.{module}.{leaf}"] = torch.cat(values, dim=0)
    return out


def unfuse_tensors(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The same tensors with every fused parameter split into its parts, under their unfused names (views)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        split = split_fused_name(name)
        if split is None:
            out[name] = value
            continue
        _, module, _ = split
        for part, piece in zip(unfused_names(name), value.split(part_rows(module, cfg), dim=0), strict=True):
            out[part] = piece
    return out
