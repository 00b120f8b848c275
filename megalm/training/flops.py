"""Model FLOPs per step and MFU (model FLOPs utilisation, PaLM appendix B).

Training FLOPs = 3 × forward FLOPs (backward is two GEMMs per forward GEMM). Recomputation is not
counted: MFU measures useful model work, not what the hardware re-executes.

Forward FLOPs of one micro-batch of T tokens in documents of lengths s_1..s_N:

    dense   = 2 · T · P_matmul
    P_matmul = L · (h·h_q + 2·h·h_kv + h_q·h + m·h·f) + h·V          (m = 3 for SwiGLU, 2 for GELU)
               (an MoE layer's m·h·f is E·h + 3·h·(k·f_expert + f_shared): router, active and shared experts)
    attn    = L · 2 · 2 · h_q · Σ_i s_i (s_i + 1) / 2
            = L · 2 · h_q · Σ_i s_i (s_i + 1)
              (within a sliding window w: s_i (s_i + 1) / 2 pairs become w (w + 1) / 2 + (s_i - w) · w where s_i > w)

with h_q = heads · head_dim, h_kv = kv_heads · head_dim. The attention term counts the causal
(query, key) pairs of each document — the work a causal varlen kernel does — for the two GEMMs
QKᵀ and PV at 2 FLOPs per multiply-add. Embedding lookups, norms and softmax are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megalm.config import ModelConfig, is_moe_layer

# Dense peak FLOP/s by (device-name fragment, precision). bf16 = tensor-core bf16 with fp32 accumulate;
# tf32 = tensor-core tf32; fp32 = plain fp32 FMA. Vendor datasheet numbers without sparsity.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 SXM": {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 NVL": {"bf16": 835.0e12, "tf32": 417.5e12, "fp32": 60.0e12},
    "H100 PCIe": {"bf16": 756.5e12, "tf32": 378.0e12, "fp32": 51.2e12},
    "H100": {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "GH200": {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "B200": {"bf16": 2250e12, "tf32": 1100e12, "fp32": 80e12},
    "A100": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12},
    "A10G": {"bf16": 70e12, "tf32": 35e12, "fp32": 31.2e12},
    "RTX 4090": {"bf16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
}


def matmul_params(model: ModelConfig) -> int:
    """Parameters that take part in a GEMM per token (all linear layers and the output head). An MoE layer counts
    its active ones: the router, top_k routed experts and the shared experts (the others see no token of it)."""
    head_dim = model.head_dim or model.hidden_size // model.num_heads
    h, hq, hkv = model.hidden_size, model.num_heads * head_dim, model.num_kv_heads * head_dim
    mlp_mats = 3 if model.activation == "swiglu" else 2
    attention = h * hq + 2 * h * hkv + hq * h
    moe, total = model.moe, 0
    for layer in range(model.num_layers):
        if is_moe_layer(model, layer):
            shared = moe.shared_ffn_hidden_size if moe.num_shared_experts else 0
            mlp = moe.num_experts * h + 3 * h * (moe.top_k * moe.expert_ffn_hidden_size + shared)
        else:
            mlp = mlp_mats * h * model.ffn_hidden_size
        total += attention + mlp
    head_rows = model.padded_vocab_size or model.vocab_size  # the head multiplies its padding rows too
    return total + h * head_rows


def forward_flops(model: ModelConfig, doc_lengths: Iterable[int]) -> float:
    lengths = list(doc_lengths)
    tokens = sum(lengths)
    hq = model.num_heads * (model.head_dim or model.hidden_size // model.num_heads)
    dense = 2.0 * tokens * matmul_params(model)
    attention = model.num_layers * 4.0 * hq * sum(attended_pairs(s, model.sliding_window) for s in lengths)
    return dense + attention


def attended_pairs(length: int, window: int | None = None) -> int:
    """The (query, key) pairs causal attention computes over a document of `length` tokens: each query's earlier
    keys and itself, or its last `window` of them."""
    if window is None or length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def training_flops(model: ModelConfig, doc_lengths: Iterable[int]) -> float:
    return 3.0 * forward_flops(model, doc_lengths)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak dense FLOP/s of one accelerator for the precision; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    # Low-precision recipes (fp8, mx*) are quoted against the bf16 peak, as Megatron and TorchTitan do.
    kind = "bf16" if precision != "fp32" else ("tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32")
    for fragment, table in PEAK_FLOPS.items():
        if fragment in name:
            return table[kind]
    return None
