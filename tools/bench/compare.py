"""megalm against Megatron-Core and TorchTitan, each run as its own recommended one-GPU setup: the same Llama
shapes, tokens and step, one process, one device.

    python tools/bench/compare.py --json compare.json     # the default grid below: ~9 minutes on one H100
    python tools/bench/compare.py --shapes 125m,1.3b --seqs 2048,4096,8192 --precisions bf16,fp8 \
        --frameworks megalm,megatron,torchtitan --steps 10 --warmup 3 --repeats 2 --json compare.json
    python tools/bench/compare.py --tiny --precisions fp32 --steps 1 --warmup 0 --repeats 1   # CPU, seconds

Why: a throughput number means little without the frameworks people would otherwise use, run the way their
authors would run them on one GPU. Every run trains the same shape (layers, hidden, heads, GQA kv heads, SwiGLU
ffn, RMSNorm, RoPE, untied head, megalm's padded vocab; tests/unit/test_compare_peers.py checks the parameter
counts agree) on the same synthetic tokens (megalm's synthetic documents, each exactly seq + 1 tokens, so every
sample is one full causal sequence), with one step everywhere: forward, backward, grad-norm clip at 1.0, fused
AdamW, no activation recomputation. The peers' versions are pinned in one place, tools/compare_peers.txt.

- megalm: its own `Trainer.train_step` (as tools/bench/throughput.py times it; `data.varlen=true`), eager
  (`trainer.compile=false`, where the default, auto, compiles on CUDA), its
  attention backend `auto` (on Hopper `cudnn`: these equal documents are one batched SDPA call, cuDNN's kernel
  where torch picks it; on other GPUs torch's varlen flash kernel in bf16; SDPA on a CPU).
- megalm_compiled, labelled "megalm (trainer.compile=true)": the same with each transformer block compiled by
  inductor, the setting to set beside TorchTitan's compiled blocks (and megalm's default on CUDA); CUDA only
  (skipped on a CPU, saying so). On one H200 (2026-11-29) 1.16x the eager row in bf16, 1.58x in fp8.
- megalm_torchao, labelled "megalm (precision.backend=torchao)": fp8 cells only, megalm's step with torchao's
  Float8Linear as its FP8 linears (the ones TorchTitan's fp8 runs; megalm/precision/torchao_fp8.py), compiled per
  block on CUDA as TorchTitan's are (eager elsewhere): beside megalm_compiled, the two FP8 backends in one trainer.
- megatron, labelled "megatron (custom spec: SDPA core attention)": Megatron-Core's `GPTModel` on
  `get_gpt_layer_local_spec` with its `core_attention` swapped for `SDPACoreAttention` below (torch SDPA,
  `is_causal=True`, which picks the flash or cuDNN kernel on an H100), since the GPU image has neither
  Transformer Engine nor flash-attn and the local spec's own `DotProductAttention` materialises fp32 s x s
  scores. On CUDA with Megatron's own fusions that need neither (compiled by its `jit_fuser`, torch.compile):
  SwiGLU, bias-dropout-add and the native fused cross entropy. One rank (TP = PP = 1), torch RMSNorm.
- torchtitan: TorchTitan's llama3 `Transformer` (the release in tools/compare_peers.txt: the newest that imports
  on torch 2.11) with its args at the shape: its default `sdpa` attention (cuDNN > flash priority, causal), and
  on CUDA its per-`TransformerBlock` torch.compile plus its compiled loss (`compile.enable`, components model and
  loss); for fp8 its `quantize.linear.float8` converter (torchao Float8Linear, tensorwise scaling), the output
  head kept in bf16 as megalm does. On a CPU it runs eager (inductor would build C++ kernels for minutes).

Each row names the kernels its system used (`kernels`: attention, GEMMs, compile, loss): the SDPA kernel is the
one torch's dispatcher chooses for the run's own shapes and dtype (`torch._fused_sdp_choice`).
`--profile N` then runs N more steps of each row's last repeat under torch.profiler, untimed, and sums their kernels
(on a CPU their aten ops) into the kinds of megalm/measure/kernel_profile.py, the same for every framework: the
row's `profile` (ms per step by kind, GPU busy time against the unprofiled step) says kind by kind where one
system's step spends more than another's.

Precisions: fp32 (one TF32 setting for all: megalm's `precision.tf32`); bf16 = each system's bf16 step on one GPU:
megalm's `precision=bf16` (bf16 weights in the model, fp32 main weights and gradient sums in the optimizer, the
weights cast once per step), bf16 autocast over fp32 weights for TorchTitan (what it does on one GPU) and for
Megatron-Core's model (its own recipe, bf16 parameters with fp32 main copies, lives in its DDP and optimizer
wrappers, which a one-rank loop here does not build); fp8 = megalm's `precision=fp8`, TorchTitan's Float8 converter,
and no Megatron-Core run (its fp8 needs Transformer Engine).

Runs alternate by framework (A B C A B C for `--repeats 2`) inside each (shape, seq, precision) cell, each run
building its model afresh after `torch._dynamo.reset()` (so each compiles as a fresh process would, from the
warm on-disk caches), so clock and thermal drift hit every framework alike; the JSON keeps the order.
Tokens/s is the tokens of a step over the median timed step of all repeats; TFLOP/s and MFU come from one
formula for all three, megalm's `training_flops` (megalm/training/flops.py) over that step time, against
`peak_flops` of the device (or `--peak-tflops`). A framework that cannot run says why, one line each.

The default grid (125m and 1.3b, seq 4096, bf16 and fp8, 16,384 tokens a step, 3 + 10 steps, 2 repeats) is sized
for ten minutes on one H100, estimated (not yet measured) as: 20 runs (megalm 8, TorchTitan 8, Megatron-Core 4:
it has no fp8); steps from megalm's FLOPs at ~400 TFLOP/s effective (15.9 TFLOP a step for 125m, 149 for 1.3b:
0.04 s and 0.37 s) -> 13 steps x (10 x 0.04 + 10 x 0.37 s) = 54 s, doubled for slower peers: ~110 s; model,
optimizer and data builds ~4 s (125m) / 6 s (1.3b) a run: ~100 s; compiles: TorchTitan's blocks and loss ~45 s
cold in each of its 4 cells plus ~10 s warm for the repeat: ~220 s, Megatron's fusions ~40 s, megalm's FP8 cast
~20 s; start-up ~30 s. Total ~520 s (~9 minutes). Each further (shape, seq) adds ~2 to 3 minutes. Measured on one
H200 (2026-11-28): 189 s, before megalm_compiled and megalm_torchao joined the grid (12 more runs, each compiling
its blocks: ~420 s estimated with them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import math
import os
import re
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from throughput import compose_config, synchronize  # noqa: E402

from megalm import compat  # noqa: E402
from megalm.config import MegalmConfig, ModelConfig  # noqa: E402
from megalm.measure.kernel_profile import StepProfile, profile_steps  # noqa: E402
from megalm.training.flops import peak_flops, training_flops  # noqa: E402
from tools.bench.cli import parse_flags_and_overrides  # noqa: E402

FRAMEWORKS = ("megalm", "megalm_compiled", "megalm_torchao", "megatron", "torchtitan")
# What each row is called: Megatron-Core runs a spec of ours, which the label must say.
LABELS = {"megalm": "megalm", "megalm_compiled": "megalm (trainer.compile=true)",
          "megalm_torchao": "megalm (precision.backend=torchao)",
          "megatron": "megatron (custom spec: SDPA core attention)", "torchtitan": "torchtitan (llama3)"}
PEERS_FILE = Path(__file__).resolve().parents[1] / "compare_peers.txt"
# --tiny: a shape every framework builds on a CPU in a second (the model=tiny config, shrunk further).
TINY_SHAPE = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
              "model.ffn_hidden_size=128"]
MODEL_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                "padded_vocab_size", "activation", "norm", "position_embedding", "rope_theta", "norm_eps",
                "tie_embeddings", "seq_length")


class Skip(Exception):
    """A framework cannot run this cell here; the message says exactly why."""


@dataclass
class Cell:
    shape: str
    seq: int
    precision: str


@dataclass
class Run:
    """One build + warm-up + timed steps of one framework in one cell, and the kernels it ran."""

    step_seconds: list[float]
    tokens_per_step: int
    peak_memory_gib: float
    params_m: float
    kernels: dict[str, str] = field(default_factory=dict)
    profile: StepProfile | None = None  # --profile: where the time of a few more steps went


@dataclass
class Row:
    framework: str
    shape: str
    seq: int
    precision: str
    label: str = ""
    status: str = "ok"  # ok | skipped
    reason: str | None = None
    batch: int = 0
    tokens_per_step: int = 0
    step_seconds: float | None = None
    tokens_per_sec: float | None = None
    tokens_per_sec_per_repeat: list[float] = field(default_factory=list)
    tflops_per_sec: float | None = None
    mfu: float | None = None
    peak_memory_gib: float | None = None
    params_m: float | None = None
    kernels: dict[str, str] = field(default_factory=dict)  # attention, gemm, compile, loss
    model: dict = field(default_factory=dict)
    profile: dict | None = None  # --profile: StepProfile.as_dict() of the last repeat (kernel ms per kind)


# ---------------------------------------------------------------------------------------------- pinned peers


def normalise(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def peer_pins(path: Path = PEERS_FILE) -> dict[str, str]:
    """{name: version} of tools/compare_peers.txt, the one place the peers' versions are pinned; any line that
    is not an exact `name==version` is an error, so that the file cannot drift into ranges."""
    pins = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        if not match:
            raise ValueError(f"{path}: {raw.strip()!r} is not an exact name==version pin")
        pins[normalise(match[1])] = match[2]
    return pins


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def pin_problem(package: str) -> str | None:
    """Why `package` is not here at its pinned version (not installed, or another version); None when it is."""
    pinned = peer_pins()[normalise(package)]
    have = version(package)
    if have is None:
        return f"{package} not installed (tools/compare_peers.txt pins {pinned})"
    if have != pinned:
        return f"{package} {have} installed, but tools/compare_peers.txt pins {pinned} (the API this harness drives)"
    return None


# ---------------------------------------------------------------------------------------------- shared set-up


def cell_config(cell: Cell, batch: int, overrides: list[str], tiny: bool) -> MegalmConfig:
    """megalm's config of a cell: the shape every framework builds and the data every framework reads."""
    shape = ["model=tiny", *TINY_SHAPE] if tiny else [f"model={cell.shape}"]
    return compose_config([*shape, f"precision={cell.precision}", "data.varlen=true", *overrides,
                           f"model.seq_length={cell.seq}", f"data.synthetic.fixed_doc_length={cell.seq + 1}",
                           f"trainer.micro_batch_size={batch}", f"trainer.global_batch_size={batch}"])


def synthetic_batches(cfg: MegalmConfig, steps: int, batch: int, device: torch.device) -> list[torch.Tensor]:
    """[batch, seq + 1] token tensors of steps 0..steps-1: the very samples megalm's trainer reads."""
    from megalm.data.build import build_datasets

    train = build_datasets(cfg).train
    out = []
    for step in range(steps):
        rows = [torch.from_numpy(train[k].tokens) for k in range(step * batch, (step + 1) * batch)]
        out.append(torch.stack(rows).to(device))
    return out


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype activations (and so attention) run in: bf16 for every recipe but fp32."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast for every recipe but fp32 (fp8 keeps the non-fp8 parts in bf16, as megalm does)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def adamw(model: torch.nn.Module, cfg: MegalmConfig, device: torch.device) -> torch.optim.Optimizer:
    """megalm's optimizer for the peers: AdamW with its hyper-parameters, the fused kernel (as megalm's auto,
    and TorchTitan's default implementation)."""
    o = cfg.optim
    return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                             fused=device.type in ("cuda", "cpu"))


def time_steps(step: Callable[[int], None], warmup: int, steps: int, device: torch.device) -> list[float]:
    """Seconds of each timed step (after `warmup` untimed ones), each bracketed by a device synchronize."""
    times = []
    for i in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        step(i)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def measure(step: Callable[[int], None], warmup: int, steps: int, device: torch.device,
            profile: int = 0) -> tuple[list[float], StepProfile | None]:
    """`time_steps`, then (`profile` > 0) that many more steps under torch.profiler, untimed: the same kernel
    kinds for every framework (megalm.measure.kernel_profile), so two rows' milliseconds compare kind by kind."""
    times = time_steps(step, warmup, steps, device)
    if not profile:
        return times, None
    result = profile_steps(step, warmup + steps, profile, device)
    result.unprofiled_ms = 1e3 * statistics.median(times)
    return times, result


def params_m(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


def peak_memory(device: torch.device) -> float:
    from megalm.training.metrics import peak_memory_gb

    return peak_memory_gb(device)


def require(module: str, package: str) -> None:
    """Import `module` or skip: "not installed" when the package is absent, "not importable" when it breaks."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        absent = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == module.split(".")[0]
        raise Skip(f"{package} {'not installed' if absent else 'not importable'} ({type(e).__name__}: {e})") from None


def probe_sdpa(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, dtype: torch.dtype,
               device: torch.device) -> str:
    """The kernel torch SDPA runs for causal attention of this shape in training (`compat.sdpa_kernel_choice`), on
    empty [b, h, s, d] tensors that need grad (some kernels take a head size forward only)."""
    q = torch.empty(batch, heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True)
    kv = torch.empty(batch, kv_heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True)
    return compat.sdpa_kernel_choice(q, kv, kv, is_causal=True, enable_gqa=heads != kv_heads)


def gemm_kernels(device: torch.device, precision: str, layers: str, bf16: str = "bf16 under autocast") -> str:
    """Where bf16 and fp32 GEMMs run: cuBLAS in `bf16` (the system's recipe, autocast unless it says otherwise), or
    fp32 with the TF32 setting of this run."""
    where = "cuBLAS" if device.type == "cuda" else "CPU"
    if precision == "fp32":
        tf32 = device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
        return f"{layers}: {where} fp32{' (TF32)' if tf32 else ''}"
    return f"{layers}: {where} {bf16}"


# ---------------------------------------------------------------------------------------------- megalm

MEGALM_ATTENTION = {
    "flash_attn": "flash-attn's varlen kernel (flash_attn_varlen_func)",
    "torch_varlen": "torch.nn.attention.varlen.varlen_attn (flash varlen kernel)",
    "cudnn": "torch SDPA, one batched is_causal call (documents of equal lengths; unequal ones: torch_varlen)",
    "sdpa": "torch SDPA, one batched is_causal call",
    "reference": "explicit fp32 attention with a [T, T] mask",
}


def megalm_kernels(trainer: Any, cfg: MegalmConfig, batch: int, device: torch.device) -> dict[str, str]:
    from megalm.model.attention import select_attention_backend

    m, name = cfg.model, cfg.precision.name
    backend = select_attention_backend(m.attention_backend, device, compute_dtype(name),
                                       dropout=m.attention_dropout > 0)
    attention = f"{backend}: {MEGALM_ATTENTION.get(backend, backend)}"
    if backend in ("sdpa", "cudnn"):
        kv_heads = m.num_kv_heads or m.num_heads
        attention += " (" + probe_sdpa(batch, m.num_heads, kv_heads, m.seq_length, m.hidden_size // m.num_heads,
                                       compute_dtype(name), device) + ")"
    gemm = (gemm_kernels(device, name, "megalm's Linear (F.linear)", bf16=trainer.precision.note)  # no autocast
            if name in ("fp32", "bf16") else f"megalm {trainer.precision.note}")
    fp8_cast = device.type == "cuda" and name.startswith("fp8") and cfg.precision.backend == "native"
    compiled = "torch.compile per transformer block (inductor), the rest eager"
    eager = "eager" + ("; its FP8 casts are one torch.compile'd kernel" if fp8_cast else "")
    return {"attention": attention, "gemm": gemm, "compile": compiled if cfg.trainer.compile else eager,
            "loss": "fp32 F.cross_entropy (token sum / tokens)"}


def run_megalm(cfg: MegalmConfig, batches: list[torch.Tensor], device: torch.device, warmup: int,
               steps: int, profile: int = 0) -> Run:
    from megalm.training.trainer import Trainer

    # the megalm row is eager (trainer.compile's default, null, would compile it on CUDA); megalm_compiled sets true
    max_steps = warmup + steps + (profile + 1 if profile else 0)  # the profiled steps too, as throughput.py
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=max_steps,
                                                               compile=bool(cfg.trainer.compile)))
    tokens = []
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        if trainer.device.type != device.type:
            raise Skip(f"megalm chose {trainer.device}, the others {device}")
        times, profiled = measure(lambda i: tokens.append(trainer.train_step(i).tokens), warmup, steps, device, profile)
        kernels = megalm_kernels(trainer, cfg, batches[0].shape[0], device)
        return Run(times, tokens[-1], peak_memory(device), params_m(trainer.model), kernels, profiled)


def run_megalm_compiled(cfg: MegalmConfig, batches: list[torch.Tensor], device: torch.device, warmup: int,
                        steps: int, profile: int = 0) -> Run:
    """megalm with `trainer.compile=true`, beside TorchTitan's compiled blocks: on CUDA only, where inductor
    generates the Triton kernels a GPU run gets (on a CPU its C++ kernels would time something else)."""
    if device.type != "cuda":
        raise Skip("megalm's compiled blocks are compared on CUDA only")
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, compile=True))
    return run_megalm(cfg, batches, device, warmup, steps, profile)


def run_megalm_torchao(cfg: MegalmConfig, batches: list[torch.Tensor], device: torch.device, warmup: int,
                       steps: int, profile: int = 0) -> Run:
    """megalm with `precision.backend=torchao` in the fp8 cells: torchao's Float8Linear in megalm's step, compiled
    per block on CUDA as TorchTitan compiles it (eager on a CPU, where inductor would build C++ kernels)."""
    from megalm.precision.torchao_fp8 import torchao_problem

    if not cfg.precision.name.startswith("fp8"):
        raise Skip(f"torchao's float8 replaces fp8's linears only: in {cfg.precision.name} this is the megalm row")
    if torchao_problem() is not None:
        raise Skip(torchao_problem())
    cfg = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, backend="torchao"),
                              trainer=dataclasses.replace(cfg.trainer, compile=device.type == "cuda"))
    return run_megalm(cfg, batches, device, warmup, steps, profile)


# ---------------------------------------------------------------------------------------------- Megatron-Core


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
    seq = batches[0].shape[1] - 1
    positions = torch.arange(seq, device=device).expand(batches[0].shape[0], -1)

    def step(i: int) -> None:
        tokens = batches[i % len(batches)]
        with autocast(device, cfg.precision.name):  # no mask: SDPACoreAttention runs is_causal
            loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()  # per-token losses [b, s]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

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
    return Run(times, batches[0][:, :-1].numel(), peak_memory(device), params_m(model), kernels, profiled)


# ---------------------------------------------------------------------------------------------- TorchTitan


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
    multiplier just under ffn / base give exactly ffn; RoPE scaling factor 1 is plain RoPE, as megalm's."""
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
    labels_per_step = batches[0][:, 1:].numel()

    def step(i: int) -> None:
        tokens = batches[i % len(batches)]
        with autocast(device, name):  # TorchTitan's single-device AMP wraps the loss too
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) / labels_per_step  # its sum / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times, profiled = measure(step, warmup, steps, device, profile)
    m = cfg.model
    with sdpa_priority(ScaledDotProductAttentionWrapper().sdpa_backends, set_priority=True):
        chosen = probe_sdpa(batches[0].shape[0], m.num_heads, m.num_kv_heads or m.num_heads, m.seq_length,
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
    return Run(times, batches[0][:, :-1].numel(), peak_memory(device), params_m(model), kernels, profiled)


RUNNERS: dict[str, Callable[..., Run]] = {"megalm": run_megalm, "megalm_compiled": run_megalm_compiled,
                                          "megalm_torchao": run_megalm_torchao,
                                          "megatron": run_megatron, "torchtitan": run_torchtitan}


# ---------------------------------------------------------------------------------------------- the harness


def one_line(error: BaseException) -> str:
    """A skip's own message, or the error's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    return first if isinstance(error, Skip) else f"{type(error).__name__}: {first}"


@contextlib.contextmanager
def fresh_device(device: torch.device, cfg: MegalmConfig) -> Iterator[None]:
    """Each run starts from a clean allocator, a reset peak, no compiled code from earlier runs (dynamo would
    otherwise turn a second sequence length into dynamic shapes, or stop compiling at its recompile limit),
    and megalm's TF32 setting (megalm sets it globally; the peers run under the same one)."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.precision.tf32
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def summarise(row: Row, runs: list[Run], cfg: MegalmConfig, batch: int, seq: int, peak: float | None) -> None:
    """Tokens/s over the median step of all repeats; TFLOP/s and MFU from megalm's formula, the same for all."""
    step_s = statistics.median(t for run in runs for t in run.step_seconds)
    row.tokens_per_step = runs[0].tokens_per_step
    row.step_seconds = step_s
    row.tokens_per_sec = row.tokens_per_step / step_s
    row.tokens_per_sec_per_repeat = [run.tokens_per_step / statistics.median(run.step_seconds) for run in runs]
    flops = training_flops(cfg.model, [seq] * batch)
    row.tflops_per_sec = flops / step_s / 1e12
    row.mfu = flops / step_s / peak if peak else None
    row.peak_memory_gib = max(run.peak_memory_gib for run in runs)
    row.params_m = runs[0].params_m
    row.kernels = runs[-1].kernels
    row.profile = runs[-1].profile.as_dict() if runs[-1].profile is not None else None


def run_cell(cell: Cell, args: argparse.Namespace, overrides: list[str], device: torch.device,
             order: list[dict]) -> list[Row]:
    batch = max(1, args.tokens_per_step // cell.seq)
    cfg = cell_config(cell, batch, overrides, args.tiny)
    model = {k: getattr(cfg.model, k) for k in MODEL_FIELDS}
    rows = {fw: Row(fw, cell.shape, cell.seq, cell.precision, label=LABELS[fw], batch=batch, model=model)
            for fw in args.frameworks}
    runs: dict[str, list[Run]] = {fw: [] for fw in args.frameworks}
    batches = synthetic_batches(cfg, min(args.warmup + args.steps, 4), batch, device)
    for repeat in range(args.repeats):
        for fw in args.frameworks:  # A B C, A B C: drift reaches every framework alike
            row = rows[fw]
            if row.status != "ok":
                continue
            with fresh_device(device, cfg):
                try:
                    profile = args.profile if repeat == args.repeats - 1 else 0  # once per row
                    runs[fw].append(RUNNERS[fw](cfg, batches, device, args.warmup, args.steps, profile))
                except Exception as e:  # noqa: BLE001 - a peer that cannot run is a result, said in one line
                    row.status, row.reason = "skipped", one_line(e)
                    if args.verbose and not isinstance(e, Skip):
                        traceback.print_exc()
            order.append({"framework": fw, "shape": cell.shape, "seq": cell.seq, "precision": cell.precision,
                          "repeat": repeat, "status": row.status})
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device, cell.precision)
    for fw, row in rows.items():
        if row.status == "ok":
            summarise(row, runs[fw], cfg, batch, cell.seq, peak)
    return list(rows.values())


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def table_width(frameworks: list[str]) -> int:
    return max([len(LABELS[fw]) for fw in frameworks] + [9])


def print_header(width: int) -> None:
    print(f"{'framework':<{width}} {'shape':<6} {'seq':>6} {'prec':<5} {'tokens/s':>12} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'peak GiB':>8}  status", flush=True)


def print_rows(rows: list[Row], width: int) -> None:
    """One line a row (a skip's reason on it), and under each row that ran, the kernels it used."""
    for r in rows:
        mfu = fmt(None if r.mfu is None else 100 * r.mfu, ".1f") + ("%" if r.mfu is not None else "")
        status = "ok" if r.status == "ok" else f"skipped: {r.reason}"
        print(f"{r.label:<{width}} {r.shape:<6} {r.seq:>6} {r.precision:<5} {fmt(r.tokens_per_sec, ',.0f'):>12} "
              f"{fmt(r.tflops_per_sec, '.2f'):>8} {mfu:>6} {fmt(r.peak_memory_gib, '.2f'):>8}  {status}")
        for key, what in r.kernels.items():
            print(f"    {key}: {what}")
        if r.profile is not None:
            print(f"    profile ({'kernel' if r.profile['device'] == 'cuda' else 'aten op'} ms per step, "
                  f"{r.profile['kernels']:.0f} calls): " + ", ".join(f"{kind} {ms:.1f}" for kind, ms in
                                                                r.profile["by_kind"].items())
                  + (f"; busy {r.profile['busy_ms']:.1f} of {r.profile['unprofiled_ms']:.1f} ms unprofiled"
                     if r.profile["device"] == "cuda" else ""))
    sys.stdout.flush()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    csv = lambda kind: lambda s: [kind(x) for x in s.split(",") if x]  # noqa: E731
    # The defaults are the grid sized for ten minutes on one H100 (the estimate is in the module docstring).
    parser.add_argument("--shapes", type=csv(str), default=["125m", "1.3b"], help="configs/model names")
    parser.add_argument("--seqs", type=csv(int), default=[4096], help="sequence lengths")
    parser.add_argument("--precisions", type=csv(str), default=["bf16", "fp8"], help="fp32, bf16, fp8")
    parser.add_argument("--frameworks", type=csv(str), default=list(FRAMEWORKS), help=",".join(FRAMEWORKS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per framework, alternated A B C A B C")
    parser.add_argument("--tokens-per-step", type=int, default=None,
                        help="tokens per step: batch = this // seq (default 16384; 256 with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide shape for CPU checks")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: from flops.py)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--verbose", action="store_true", help="print the traceback of a run that fails")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after each row's last repeat, N more steps under torch.profiler: kernel ms per kind")
    args, overrides = parse_flags_and_overrides(parser, argv)
    if args.profile < 0:
        parser.error("--profile takes a number of steps >= 0")
    unknown = set(args.frameworks) - set(FRAMEWORKS)
    if unknown:
        parser.error(f"unknown frameworks {sorted(unknown)}: pick from {','.join(FRAMEWORKS)}")
    if args.tiny:
        args.shapes = ["tiny"]
    if args.tokens_per_step is None:
        args.tokens_per_step = 256 if args.tiny else 16384
    return args, overrides


def main(argv: list[str] | None = None) -> dict:
    """Runs the grid cell by cell, printing each cell's rows and rewriting the JSON (`complete` false until the
    last cell) as it finishes, so that a run stopped by a time limit keeps every cell it measured."""
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "compare_inductor"))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cells = [Cell(shape, seq, precision) for shape in args.shapes for seq in args.seqs
             for precision in args.precisions]
    order: list[dict] = []
    rows: list[Row] = []
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, **{name: version(name) for name in peer_pins()}},
        "pins": peer_pins(),
        "settings": {"shapes": args.shapes, "seqs": args.seqs, "precisions": args.precisions,
                     "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                     "tokens_per_step": args.tokens_per_step, "overrides": overrides,
                     "peak_tflops": args.peak_tflops, "profile": args.profile},
        "complete": False,
        "run_order": order,
        "rows": [],
    }
    print(f"device: {report['device']}, torch {torch.__version__}")
    width = table_width(args.frameworks)
    print_header(width)
    for k, cell in enumerate(cells):
        cell_rows = run_cell(cell, args, overrides, device, order)
        rows += cell_rows
        print_rows(cell_rows, width)
        report["rows"] = [dataclasses.asdict(r) for r in rows]
        report["complete"] = k == len(cells) - 1
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    if args.json:
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    result = main()
    megalm_rows = [r for r in result["rows"] if r["framework"] == "megalm"]  # the compiled row may skip (CPU)
    sys.exit(1 if any(r["status"] != "ok" for r in megalm_rows) else 0)
