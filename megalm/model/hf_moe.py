"""The Hugging Face architectures of megalm's Llama-style models beyond Llama: Qwen3 (QK-norm, its own head_dim),
Qwen3-MoE (Qwen3 with MoE blocks) and Mixtral (Llama with MoE blocks), after transformers' modeling files
(models/qwen3, models/qwen3_moe, models/mixtral), which define what a key means:

    megalm                                    Qwen3 / Qwen3-MoE                         Mixtral
    layers.N.attention.{q,k}_norm.weight      model.layers.N.self_attn.{q,k}_norm.weight -
    layers.N.mlp.router.weight [E, h]         model.layers.N.mlp.gate.weight            ...block_sparse_moe.gate.weight
    layers.N.mlp.experts.gate_up_proj.weight  ...mlp.experts.{e}.gate_proj.weight       ...experts.{e}.w1.weight
      [E, 2f, h], rows [gate; up]             ...mlp.experts.{e}.up_proj.weight         ...experts.{e}.w3.weight
    layers.N.mlp.experts.down_proj.weight     ...mlp.experts.{e}.down_proj.weight       ...experts.{e}.w2.weight
      [E, h, f]

The experts are stored per expert on disk (what `save_pretrained` writes; transformers 5 fuses them in memory
and splits them again on save), so the mapping stacks them on import and slices them on export. Both routers are
megalm's softmax top-k: Qwen3-MoE renormalises the k weights when `norm_topk_prob`, Mixtral always. Qwen3-MoE's
dense blocks are those in `mlp_only_layers` or off its `decoder_sparse_step`: megalm's `first_k_dense` and
`every_n_layers`. Neither has megalm's aux-loss-free selection bias or shared experts: a model with them does
not export. Both HF models are dropless, as megalm is without `capacity_factor`; with one, megalm drops in evaluation
and generation too, so the export warns that transformers' logits differ wherever an expert's queue was full.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from megalm.config import ModelConfig, MoEConfig

QWEN3, QWEN3_MOE, MIXTRAL = "qwen3", "qwen3_moe", "mixtral"
MOE_SUFFIXES = ("mlp.router.weight", "mlp.experts.gate_up_proj.weight", "mlp.experts.down_proj.weight")
_ROUTER = {QWEN3_MOE: "mlp.gate.weight", MIXTRAL: "block_sparse_moe.gate.weight"}
_EXPERT = {QWEN3_MOE: ("mlp.experts.{e}.", "gate_proj", "up_proj", "down_proj"),
           MIXTRAL: ("block_sparse_moe.experts.{e}.", "w1", "w3", "w2")}


# transformers' defaults (their XConfig.__init__ signatures) for the MoE keys a config.json may omit
MOE_DEFAULTS = {
    QWEN3_MOE: {"num_experts_per_tok": 8, "router_aux_loss_coef": 0.001, "norm_topk_prob": False,
                "decoder_sparse_step": 1, "num_experts": 128, "moe_intermediate_size": 768, "mlp_only_layers": None},
    MIXTRAL: {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "num_local_experts": 8},
}


class MoEMappingError(ValueError):
    """Why a megalm MoE model or an HF config cannot be mapped (hf.py turns it into an InteropError)."""


def moe_architecture(cfg: ModelConfig) -> str:
    """qwen3_moe (with QK-norm) or mixtral: the HF architecture of a Llama-style MoE model, or MoEMappingError."""
    moe, problems = cfg.moe, []
    if moe.router_score != "softmax":
        problems.append(f"router_score={moe.router_score} (softmax only)")
    if moe.routed_scaling_factor != 1.0:
        problems.append(f"routed_scaling_factor={moe.routed_scaling_factor} (1 only)")
    if moe.num_shared_experts:
        problems.append(f"num_shared_experts={moe.num_shared_experts} (no shared experts)")
    if moe.bias_update_rate:
        problems.append(f"bias_update_rate={moe.bias_update_rate} (no aux-loss-free selection bias)")
    arch = QWEN3_MOE if cfg.qk_norm else MIXTRAL
    if arch == MIXTRAL:
        if moe.first_k_dense or moe.every_n_layers != 1:
            problems.append("dense blocks (Mixtral's blocks all have experts; add model.qk_norm for Qwen3-MoE)")
        if not moe.norm_topk_prob:
            problems.append("norm_topk_prob=false (Mixtral renormalises)")
    if problems:
        raise MoEMappingError(f"the MoE model cannot be exported as {arch}: model.moe {'; '.join(problems)}")
    return arch


def moe_hf_config(cfg: ModelConfig, arch: str) -> dict[str, Any]:
    """config.json's MoE keys (and Qwen3's attention keys) for `arch`."""
    moe = cfg.moe
    if arch == QWEN3:
        return _qwen3_attention(cfg)
    router = {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coeff,
              "output_router_logits": False}
    if arch == QWEN3_MOE:
        return {**_qwen3_attention(cfg), **router, "num_experts": moe.num_experts,
                "moe_intermediate_size": moe.expert_ffn_hidden_size, "decoder_sparse_step": moe.every_n_layers,
                "mlp_only_layers": list(range(moe.first_k_dense)), "norm_topk_prob": moe.norm_topk_prob}
    return {**router, "num_local_experts": moe.num_experts, "intermediate_size": moe.expert_ffn_hidden_size,
            "router_jitter_noise": 0.0, "sliding_window": None}


def _qwen3_attention(cfg: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.num_layers}


def moe_config_from_hf(hf: Mapping[str, Any], arch: str) -> tuple[dict[str, Any], MoEConfig | None]:
    """(ModelConfig keyword arguments, the MoE section) that `arch`'s config.json adds to Llama's; `hf` holds
    transformers' defaults for the keys the file omits (MOE_DEFAULTS)."""
    if arch == QWEN3:
        return {"qk_norm": True}, None
    top_k = int(hf["num_experts_per_tok"])
    aux = float(hf["router_aux_loss_coef"])
    if top_k == 1 and (arch != QWEN3_MOE or hf["norm_topk_prob"]):  # (the training config's fix would change it)
        raise MoEMappingError("num_experts_per_tok=1 renormalised over its one expert weighs every expert's output "
                              "1, so its router gets no gradient: megalm does not import top-1 routing with "
                              "norm_topk_prob (Mixtral always renormalises)")
    if arch == QWEN3_MOE:
        step = int(hf["decoder_sparse_step"])
        dense = sorted(int(i) for i in hf["mlp_only_layers"] or [])
        if dense != list(range(len(dense))):
            raise MoEMappingError(f"mlp_only_layers={dense} are not the first blocks; megalm's dense blocks are the "
                                  "first model.moe.first_k_dense ones")
        experts = int(hf.get("num_local_experts") or hf["num_experts"])  # transformers 5 writes num_local_experts
        return {"qk_norm": True}, MoEConfig(
            num_experts=experts, top_k=top_k, expert_ffn_hidden_size=int(hf["moe_intermediate_size"]),
            first_k_dense=len(dense), every_n_layers=step, norm_topk_prob=bool(hf["norm_topk_prob"]),
            aux_loss_coeff=aux)
    ffn = int(hf["intermediate_size"])
    return {"ffn_hidden_size": ffn}, MoEConfig(num_experts=int(hf["num_local_experts"]), top_k=top_k,
                                               expert_ffn_hidden_size=ffn, norm_topk_prob=True, aux_loss_coeff=aux)


def moe_tensors_to_hf(arch: str, layer: int, suffix: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """The HF tensors of one MoE parameter of block `layer` (`suffix` one of MOE_SUFFIXES)."""
    prefix = f"model.layers.{layer}."
    if suffix == "mlp.router.weight":
        return {prefix + _ROUTER[arch]: value}
    expert, gate, up, down = _EXPERT[arch]
    out = {}
    for e, w in enumerate(value):
        keys = f"{prefix}{expert.format(e=e)}"
        if suffix == "mlp.experts.down_proj.weight":
            out[f"{keys}{down}.weight"] = w
        else:
            g, u = w.chunk(2, dim=0)
            out[f"{keys}{gate}.weight"], out[f"{keys}{up}.weight"] = g, u
    return out


def moe_tensor_from_hf(arch: str, layer: int, suffix: str, num_experts: int,
                       get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """One MoE parameter of block `layer` from the HF tensors `get(key)` returns (experts stacked)."""
    prefix = f"model.layers.{layer}."
    if suffix == "mlp.router.weight":
        return get(prefix + _ROUTER[arch])
    expert, gate, up, down = _EXPERT[arch]
    keys = [f"{prefix}{expert.format(e=e)}" for e in range(num_experts)]
    if suffix == "mlp.experts.down_proj.weight":
        return torch.stack([get(f"{k}{down}.weight") for k in keys])
    return torch.stack([torch.cat([get(f"{k}{gate}.weight"), get(f"{k}{up}.weight")]) for k in keys])
