"""Megatron-Core as tools/bench/compare.py runs it: `GPTModel` on its local (non-TE) layer spec with torch SDPA as
the core attention (`SDPACoreAttention`), one rank (TP = PP = 1), its own CUDA fusions, and the step every
framework takes (forward, backward, grad-norm clip, fused AdamW).

Why a module of its own: everything here drives Megatron-Core's API at the release tools/compare_peers.txt pins
(and why the spec is ours: `SDPACoreAttention`'s docstring)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

from megalm import compat
from megalm.config import MegalmConfig, ModelConfig
from tools.bench.compare_run import (
    PeerStep,
    Run,
    Skip,
    adamw,
    autocast,
    gemm_kernels,
    measure,
    params_m,
    peak_memory,
    require,
)


class SDPACoreAttention(torch.nn.Module):
    """Megatron-Core's `core_attention` slot filled by torch SDPA (`F.scaled_dot_product_attention`).

    Why: without Transformer Engine or flash-attn, the local spec's `DotProductAttention` computes fp32 s x s
    scores with baddbmm and an unfused softmax: a strawman at 4K+ tokens. SDPA runs the flash or cuDNN kernel
    on an H100. The constructor and `forward` take exactly what Megatron-Core 0.16's SelfAttention passes its
    core attention (the arguments of DotProductAttention): query [sq, b, np, hn], key and value
    [sk, b, ng, hn] (ng query groups: GQA via SDPA's `enable_gqa`, query head i reading group i // (np / ng),
    Megatron's repeat_interleave convention), a boolean `attention_mask` that is True where attention is
    masked out (or None), and returns [sq, b, np * hn]. With no mask, a causal mask type runs `is_causal=True`
    (no s x s mask is built at all). What DotProductAttention also refuses here (packed sequences,
    attention bias, context parallelism) or what SDPA has no form for (windows, softmax offsets) raises.
    `kernel` records the SDPA kernel the dispatcher chose on the first call.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__()
        if config.context_parallel_size != 1:
            raise NotImplementedError("SDPACoreAttention: context parallelism needs TEDotProductAttention")
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise NotImplementedError("SDPACoreAttention: no sliding windows or softmax offsets in torch SDPA")
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # None: 1 / sqrt(hn), SDPA's default and DotProductAttention's. apply_query_key_layer_scaling divides the
        # scale by the layer number and multiplies the scores back before an fp32 softmax: the same function.
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.kernel: str | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention: packed sequences (THD) need TEDotProductAttention")
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: no attention bias")
        mask_type = getattr(attn_mask_type if attn_mask_type is not None else self.attn_mask_type, "name", None)
        sq, b, heads, head_dim = query.shape
        if attention_mask is not None:  # Megatron's mask is True where hidden; SDPA's boolean mask, where attended
            mask, causal = ~attention_mask, False
        elif mask_type == "causal":
            if key.shape[0] != sq:
                raise NotImplementedError("SDPACoreAttention: causal attention needs as many keys as queries")
            mask, causal = None, True
        elif mask_type == "no_mask":
            mask, causal = None, False
        else:
            raise ValueError(f"SDPACoreAttention: mask type {mask_type} needs an attention_mask")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        gqa = k.shape[1] != heads
        if self.kernel is None:
            self.kernel = compat.sdpa_kernel_choice(q, k, v, mask, is_causal=causal, enable_gqa=gqa)
        dropout = self.dropout_p if self.training else 0.0
        fork = contextlib.nullcontext()
        if dropout > 0.0 and not self.config.sequence_parallel:  # as DotProductAttention: per-TP-rank dropout
            from megatron.core import tensor_parallel

            fork = tensor_parallel.get_cuda_rng_tracker().fork()
        with fork:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)  # [b, h, s, d] -> [s, b, h * d]


def megatron_sdpa_spec(normalization: str) -> Any:
    """Megatron-Core's local (non-TE) GPT layer spec with `SDPACoreAttention` as its core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization=normalization)  # a fresh spec each call: ours to change
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def megatron_process_group(device: torch.device) -> None:
    """A one-rank process group and Megatron's model-parallel state (TP = PP = 1), made once per process."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        with socket.socket() as s:  # a free port for the one-rank rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def build_megatron(model: ModelConfig, device: torch.device, seed: int, fused: bool | None = None) -> torch.nn.Module:
    """Megatron-Core's GPTModel on the SDPA spec, in the shape of `model`; on the meta device, uninitialised.

    `fused` (default: on CUDA) turns on the fusions Megatron-LM trains with that need neither Transformer
    Engine nor Apex, each a function compiled by Megatron's `jit_fuser` (torch.compile): SwiGLU,
    bias-dropout-add, and the native fused vocab-parallel cross entropy. RoPE fusion needs TE: off."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    megatron_process_group(device)
    on_cuda, on_meta = device.type == "cuda", device.type == "meta"
    fused = on_cuda if fused is None else fused
    torch.manual_seed(seed)
    if on_cuda:
        torch.cuda.set_device(device)
        model_parallel_cuda_manual_seed(seed)  # Megatron's RNG tracker: GPU init and its dropout forks use it
    swiglu = model.activation == "swiglu"
    config = TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_heads,
        num_query_groups=model.num_kv_heads, ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm" if model.norm == "rmsnorm" else "LayerNorm", layernorm_epsilon=model.norm_eps,
        gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=fused and swiglu, bias_dropout_fusion=fused, cross_entropy_loss_fusion=fused,
        cross_entropy_fusion_impl="native",
        # Transformer Engine's or Apex's kernels, which this image lacks (the softmax one is unused under SDPA).
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=torch.float32, use_cpu_initialization=not on_cuda, perform_initialization=not on_meta)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        gpt = GPTModel(config=config, transformer_layer_spec=megatron_sdpa_spec(config.normalization),
                       vocab_size=model.padded_vocab_size or model.vocab_size,
                       max_sequence_length=model.seq_length, position_embedding_type=model.position_embedding,
                       rotary_base=int(model.rope_theta), share_embeddings_and_output_weights=model.tie_embeddings)
    return gpt if on_meta else gpt.to(device)


@contextlib.contextmanager
def megatron_on_cpu(device: torch.device) -> Iterator[None]:
    """CPU (and meta) only: Megatron-Core puts RoPE's frequencies on `torch.cuda.current_device()`; answering
    "cpu" lets the same model code run without a GPU. On CUDA nothing is changed."""
    if device.type == "cuda":
        yield
        return
    with mock.patch("torch.cuda.current_device", lambda: "cpu"):
        yield


def run_megatron(cfg: MegalmConfig, batches: list[torch.Tensor], device: torch.device, warmup: int,
                 steps: int, profile: int = 0) -> Run:
    if cfg.precision.name != "fp32" and cfg.precision.name != "bf16":
        raise Skip(f"{cfg.precision.name} needs Transformer Engine in Megatron-Core (the local spec has none)")
    require("megatron.core", "megatron-core")
    if cfg.precision.name == "bf16" and device.type != "cuda":
        raise Skip("bf16 on CPU: Megatron-Core's linear autograd functions carry CUDA autocast only "
                   "(custom_fwd/custom_bwd with device_type='cuda')")
    with megatron_on_cpu(device):
        return megatron_steps(cfg, batches, device, warmup, steps, profile)


def megatron_steps(cfg: MegalmConfig, batches: list[torch.Tensor], device: torch.device, warmup: int,
                   steps: int, profile: int = 0) -> Run:
    model = build_megatron(cfg.model, device, cfg.seed)
    optimizer = adamw(model, cfg, device)
    _, batch, seq = batches[0].shape  # [micro-batches, batch, seq + 1]
    positions = torch.arange(seq - 1, device=device).expand(batch, -1)

    def micro_batch_loss(tokens: torch.Tensor) -> torch.Tensor:
        with autocast(device, cfg.precision.name):  # no mask: SDPACoreAttention runs is_causal
            return model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()  # per-token losses [b, s]

    step = PeerStep(model, optimizer, cfg.trainer.grad_clip, batches, micro_batch_loss)
    times, profiled = measure(step, warmup, steps, device, profile)
    chosen = next((m.kernel for m in model.modules() if isinstance(m, SDPACoreAttention)), None)
    fused = model.config.cross_entropy_loss_fusion
    kernels = {
        "attention": f"torch SDPA is_causal ({chosen or 'not run'}) as core_attention in the local spec",
        "gemm": gemm_kernels(device, cfg.precision.name, "Megatron's Column/RowParallelLinear (TP=1)"),
        "compile": ("eager; Megatron's jit_fuser (torch.compile) fusions: SwiGLU, bias-dropout-add, cross entropy"
                    if fused else "eager (Megatron's jit fusions off: on CUDA only)"),
        "loss": f"Megatron's {'fused ' if fused else ''}vocab-parallel cross entropy (fp32), mean",
    }
    return Run(times, batches[0][..., :-1].numel(), peak_memory(device), params_m(model), kernels, profiled,
               step.losses(), step.norms())
