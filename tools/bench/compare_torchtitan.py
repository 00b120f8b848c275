"""TorchTitan as tools/bench/compare.py runs it: its llama3 `Transformer` at megalm's shape, its JobConfig for one
GPU (per-block compile and compiled loss on CUDA, bf16 AMP, its Float8 converter for fp8), and the step every
framework takes. tools/bench/step_cost.py traces the same model (`torchtitan_job`, `torchtitan_args`,
`convert_torchtitan`).

Why a module of its own: everything here drives TorchTitan's API at the release tools/compare_peers.txt pins."""

from __future__ import annotations

from typing import Any

import torch

from megalm.config import MegalmConfig, ModelConfig
from tools.bench.compare_run import (
    PeerStep,
    Run,
    Skip,
    adamw,
    autocast,
    compute_dtype,
    gemm_kernels,
    measure,
    params_m,
    peak_memory,
    pin_problem,
    probe_sdpa,
    require,
)


def torchtitan_job(precision: str, compile_model: bool, emulate_fp8: bool = False) -> Any:
    """TorchTitan's JobConfig for one GPU, as its llama3 recipe sets it where it matters for a step: per-block
    compile of the model and the loss (`compile.enable`), bf16 AMP (its single-device mixed precision), for
    fp8 its Float8 linear converter with the output head left out. No activation checkpointing: megalm and
    Megatron-Core recompute nothing either, and every default shape fits without."""
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.compile.enable = compile_model
    job.compile.components = ["model", "loss"]
    job.activation_checkpoint.mode = "none"
    job.training.mixed_precision_param = "bfloat16"
    if precision == "fp8":
        job.model.converters = ["quantize.linear.float8"]
        job.quantize.linear.float8.filter_fqns = ["output"]
        job.quantize.linear.float8.emulate = emulate_fp8  # CPU checks only: TorchTitan's emulation is eager-only
    return job


def torchtitan_args(model: ModelConfig) -> Any:
    """llama3's TransformerModelArgs at the shape of `model`. Its FeedForward sizes the hidden layer from
    4 * dim (2/3 of it, times ffn_dim_multiplier, rounded up to multiple_of), so multiple_of = ffn and a
    multiplier just under ffn / base give exactly ffn; RoPE scaling factor 1 is plain RoPE, as megalm's
    (compare.py refuses model.rope_scaling)."""
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    if model.activation != "swiglu" or model.norm != "rmsnorm" or model.position_embedding != "rope":
        raise Skip("TorchTitan's llama3 is SwiGLU + RMSNorm + RoPE only")
    if model.tie_embeddings or model.bias:
        raise Skip("TorchTitan's llama3 has an untied output head and no biases")
    ffn = model.ffn_hidden_size
    base = int(2 * 4 * model.hidden_size / 3)
    return TransformerModelArgs(
        dim=model.hidden_size, n_layers=model.num_layers, n_heads=model.num_heads, n_kv_heads=model.num_kv_heads,
        vocab_size=model.padded_vocab_size or model.vocab_size, multiple_of=ffn, ffn_dim_multiplier=ffn / base,
        norm_eps=model.norm_eps, rope_theta=model.rope_theta, rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0),
        max_seq_len=model.seq_length, attn_type="sdpa", attn_mask_type="causal")


def convert_torchtitan(titan: torch.nn.Module, job: Any) -> None:
    """Apply `job`'s model converters (fp8: its Float8 linear converter; none in bf16) as TorchTitan's trainer does on
    one GPU."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters

    one_gpu = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    build_model_converters(job, one_gpu).convert(titan)


def build_torchtitan(model: ModelConfig, device: torch.device, seed: int, job: Any) -> torch.nn.Module:
    """TorchTitan's llama3 Transformer as its trainer makes it on one GPU: built on meta, converted (fp8),
    materialised and initialised on `device`, then each TransformerBlock compiled; on meta, only built."""
    from torchtitan.models.llama3 import Transformer
    from torchtitan.models.llama3.infra.parallelize import apply_compile

    args = torchtitan_args(model)
    torch.manual_seed(seed)
    with torch.device("meta"):
        titan = Transformer(args)
    convert_torchtitan(titan, job)
    if device.type == "meta":
        return titan
    titan.to_empty(device=device)
    with torch.no_grad():
        titan.init_weights(buffer_device=device)
    if job.compile.enable and "model" in job.compile.components:
        apply_compile(titan, job.compile)
    return titan


def run_torchtitan(cfg: MegalmConfig, batches: list[torch.Tensor], device: torch.device, warmup: int,
                   steps: int, profile: int = 0) -> Run:
    name = cfg.precision.name
    if name not in ("fp32", "bf16", "fp8"):
        raise Skip(f"no {name} recipe wired for TorchTitan here (fp32, bf16, fp8)")
    problem = pin_problem("torchtitan")
    if problem:
        raise Skip(problem)
    require("torchtitan.models.llama3", "torchtitan")
    if name == "fp8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            raise Skip("fp8: TorchTitan's Float8 converter needs a CUDA device of compute capability 8.9+")
        require("torchao.float8", "torchao")
    from torch.nn.attention import sdpa_kernel as sdpa_priority
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper

    job = torchtitan_job(name, compile_model=device.type == "cuda")
    model = build_torchtitan(cfg.model, device, cfg.seed, job)
    loss_fn = build_cross_entropy_loss(job)  # fp32 cross entropy, summed; compiled with the model
    optimizer = adamw(model, cfg, device)
    labels_per_micro_batch = batches[0][0, :, 1:].numel()  # batches: [micro-batches, batch, seq + 1] a step

    def micro_batch_loss(tokens: torch.Tensor) -> torch.Tensor:
        with autocast(device, name):  # TorchTitan's single-device AMP wraps the loss too
            return loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) / labels_per_micro_batch  # its sum / tokens

    step = PeerStep(model, optimizer, cfg.trainer.grad_clip, batches, micro_batch_loss)
    times, profiled = measure(step, warmup, steps, device, profile)
    m = cfg.model
    with sdpa_priority(ScaledDotProductAttentionWrapper().sdpa_backends, set_priority=True):
        chosen = probe_sdpa(batches[0].shape[1], m.num_heads, m.num_kv_heads or m.num_heads, m.seq_length,
                            m.hidden_size // m.num_heads, compute_dtype(name), device)
    compiled = job.compile.enable
    kernels = {
        "attention": f"torch SDPA is_causal ({chosen}): llama3's default sdpa, priority cuDNN > flash > math",
        "gemm": ("torchao Float8Linear (tensorwise scaling): torch._scaled_mm; output head bf16" if name == "fp8"
                 else gemm_kernels(device, name, "nn.Linear")),
        "compile": ("torch.compile per TransformerBlock (fullgraph, inductor) and of the loss" if compiled
                    else "eager (per-block compile on CUDA only: inductor would build C++ kernels here)"),
        "loss": "TorchTitan's fp32 cross entropy (sum / tokens)" + (", compiled" if compiled else ""),
    }
    return Run(times, batches[0][..., :-1].numel(), peak_memory(device), params_m(model), kernels, profiled,
               step.losses(), step.norms())
