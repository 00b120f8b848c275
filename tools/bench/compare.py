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
  `get_gpt_layer_local_spec` with its `core_attention` swapped for `SDPACoreAttention` (in
  tools/bench/compare_megatron.py: torch SDPA, `is_causal=True`, which picks the flash or cuDNN kernel on an
  H100), since the GPU image has neither Transformer Engine nor flash-attn and the local spec's own
  `DotProductAttention` materialises fp32 s x s scores. On CUDA with Megatron's own fusions that need neither
  (compiled by its `jit_fuser`, torch.compile): SwiGLU, bias-dropout-add and the native fused cross entropy. One
  rank (TP = PP = 1), torch RMSNorm.
- torchtitan: TorchTitan's llama3 `Transformer` (the release in tools/compare_peers.txt: the newest that imports
  on torch 2.11) with its args at the shape: its default `sdpa` attention (cuDNN > flash priority, causal), and
  on CUDA its per-`TransformerBlock` torch.compile plus its compiled loss (`compile.enable`, components model and
  loss); for fp8 its `quantize.linear.float8` converter (torchao Float8Linear, tensorwise scaling), the output
  head kept in bf16 as megalm does. On a CPU it runs eager (inductor would build C++ kernels for minutes).

The megalm rows are run here; each peer's build and run is a module of its own beside this file
(tools/bench/compare_megatron.py, tools/bench/compare_torchtitan.py), and what every runner shares (`Run`, `Skip`,
the pins, the timing) is tools/bench/compare_run.py.

Each row names the kernels its system used (`kernels`: attention, GEMMs, compile, loss): the SDPA kernel is the
one torch's dispatcher chooses for the run's own shapes and dtype (`torch._fused_sdp_choice`).
`--profile N` then runs N more steps of each row's last repeat under torch.profiler, untimed, and sums their kernels
(on a CPU their aten ops) into the kinds of megalm/measure/kernel_profile.py, the same for every framework: the
row's `profile` (ms per step by kind, GPU busy time against the unprofiled step) says kind by kind where one
system's step spends more than another's.

`--micro-batches N` splits each step's `--tokens-per-step` into N micro-batches in every framework (gradient
accumulation: N forwards and backwards, one clip and optimizer step), so that the optimizer step is shared as
pretraining shares it; each row keeps its step's losses (`losses`), which equal one micro-batch's run in fp32.

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
import json
import math
import os
import statistics
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from throughput import compose_config  # noqa: E402

from megalm.config import MegalmConfig  # noqa: E402
from megalm.errors import ConfigError  # noqa: E402
from megalm.training.flops import peak_flops, training_flops  # noqa: E402
from tools.bench.cli import parse_flags_and_overrides, run_main  # noqa: E402

# The peers' runners and what every runner shares live beside this file (module docstring).
from tools.bench.compare_megatron import run_megatron  # noqa: E402
from tools.bench.compare_run import (  # noqa: E402
    Run,
    Skip,
    compute_dtype,
    gemm_kernels,
    measure,
    params_m,
    peak_memory,
    peer_pins,
    probe_sdpa,
    version,
)
from tools.bench.compare_torchtitan import run_torchtitan  # noqa: E402

FRAMEWORKS = ("megalm", "megalm_compiled", "megalm_torchao", "megatron", "torchtitan")
# What each row is called: Megatron-Core runs a spec of ours, which the label must say.
LABELS = {"megalm": "megalm", "megalm_compiled": "megalm (trainer.compile=true)",
          "megalm_torchao": "megalm (precision.backend=torchao)",
          "megatron": "megatron (custom spec: SDPA core attention)", "torchtitan": "torchtitan (llama3)"}
# --tiny: a shape every framework builds on a CPU in a second (the model=tiny config, shrunk further).
TINY_SHAPE = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
              "model.ffn_hidden_size=128"]
MODEL_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                "padded_vocab_size", "activation", "norm", "position_embedding", "rope_theta", "norm_eps",
                "tie_embeddings", "seq_length")


@dataclass
class Cell:
    shape: str
    seq: int
    precision: str


@dataclass
class Row:
    framework: str
    shape: str
    seq: int
    precision: str
    label: str = ""
    status: str = "ok"  # ok | skipped (cannot run here: why) | failed (a megalm row that raised)
    reason: str | None = None
    batch: int = 0  # sequences a micro-batch
    micro_batches: int = 1  # a step's (gradient accumulation)
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
    losses: list[float] = field(default_factory=list)  # the first repeat's, step by step (warm-up included)
    grad_norms: list[float] = field(default_factory=list)  # the same steps' gradient norms, before the clip


# ---------------------------------------------------------------------------------------------- shared set-up


def cell_config(cell: Cell, batch: int, overrides: list[str], tiny: bool, micro_batches: int = 1) -> MegalmConfig:
    """megalm's config of a cell: the shape every framework builds and the data every framework reads; a step is
    `micro_batches` micro-batches of `batch` sequences (gradient accumulation)."""
    shape = ["model=tiny", *TINY_SHAPE] if tiny else [f"model={cell.shape}"]
    cfg = compose_config([*shape, f"precision={cell.precision}", "data.varlen=true", *overrides,
                          f"model.seq_length={cell.seq}", f"data.synthetic.fixed_doc_length={cell.seq + 1}",
                          f"trainer.micro_batch_size={batch}", f"trainer.global_batch_size={batch * micro_batches}"])
    if cfg.model.rope_scaling.type != "none":  # the peers' rows would compute another model than megalm's
        raise ConfigError(f"model.rope_scaling.type={cfg.model.rope_scaling.type}: compare builds Megatron-Core and "
                          "TorchTitan with plain RoPE; drop model.rope_scaling")
    if cfg.model.qkv_bias:
        raise ConfigError("model.qkv_bias=true: compare builds Megatron-Core and TorchTitan without biases; drop it")
    return cfg


def synthetic_batches(cfg: MegalmConfig, steps: int, batch: int, device: torch.device,
                      micro_batches: int = 1) -> list[torch.Tensor]:
    """[micro_batches, batch, seq + 1] token tensors of steps 0..steps-1: the very samples megalm's trainer reads,
    split into micro-batches in its order."""
    from megalm.data.build import build_datasets

    train = build_datasets(cfg).train
    out = []
    per_step = batch * micro_batches
    for step in range(steps):
        rows = [torch.from_numpy(train[k].tokens) for k in range(step * per_step, (step + 1) * per_step)]
        out.append(torch.stack(rows).reshape(micro_batches, batch, -1).to(device))
    return out


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
    results = []
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        if trainer.device.type != device.type:
            raise Skip(f"megalm chose {trainer.device}, the others {device}")
        times, profiled = measure(lambda i: results.append(trainer.train_step(i)), warmup, steps, device, profile)
        kernels = megalm_kernels(trainer, cfg, batches[0].shape[1], device)
        return Run(times, results[-1].tokens, peak_memory(device), params_m(trainer.model), kernels, profiled,
                   [r.loss for r in results], [r.grad_norm for r in results])


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


def summarise(row: Row, runs: list[Run], flops: float, peak: float | None) -> None:
    """Tokens/s over the median step of all repeats; TFLOP/s and MFU from a step's `flops` by megalm's formula, the
    same for all."""
    step_s = statistics.median(t for run in runs for t in run.step_seconds)
    row.tokens_per_step = runs[0].tokens_per_step
    row.step_seconds = step_s
    row.tokens_per_sec = row.tokens_per_step / step_s
    row.tokens_per_sec_per_repeat = [run.tokens_per_step / statistics.median(run.step_seconds) for run in runs]
    row.tflops_per_sec = flops / step_s / 1e12
    row.mfu = flops / step_s / peak if peak else None
    row.peak_memory_gib = max(run.peak_memory_gib for run in runs)
    row.params_m = runs[0].params_m
    row.kernels = runs[-1].kernels
    row.profile = runs[-1].profile.as_dict() if runs[-1].profile is not None else None
    row.losses, row.grad_norms = runs[0].losses, runs[0].grad_norms


def run_cell(cell: Cell, args: argparse.Namespace, overrides: list[str], device: torch.device,
             order: list[dict]) -> list[Row]:
    n = args.micro_batches
    batch = max(1, args.tokens_per_step // cell.seq // n)
    cfg = cell_config(cell, batch, overrides, args.tiny, n)
    model = {k: getattr(cfg.model, k) for k in MODEL_FIELDS}
    rows = {fw: Row(fw, cell.shape, cell.seq, cell.precision, label=LABELS[fw], batch=batch, micro_batches=n,
                    model=model) for fw in args.frameworks}
    runs: dict[str, list[Run]] = {fw: [] for fw in args.frameworks}
    batches = synthetic_batches(cfg, min(args.warmup + args.steps, 4), batch, device, n)
    flops = training_flops(cfg.model, [cell.seq] * (batch * n))  # a step's sequences
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device, cell.precision)
    for repeat in range(args.repeats):
        for fw in args.frameworks:  # A B C, A B C: drift reaches every framework alike
            row = rows[fw]
            if row.status != "ok":
                continue
            with fresh_device(device, cfg):
                try:
                    profile = args.profile if repeat == args.repeats - 1 else 0  # once per row
                    runs[fw].append(RUNNERS[fw](cfg, batches, device, args.warmup, args.steps, profile))
                    print(run_line(fw, cell, repeat, args.repeats, runs[fw][-1], flops, peak), flush=True)
                except Exception as e:  # noqa: BLE001 - a peer that cannot run is a result, said in one line
                    # megalm's own rows raising is megalm's failure (the exit status says so), not a skip
                    failed = fw.startswith("megalm") and not isinstance(e, Skip)
                    row.status, row.reason = "failed" if failed else "skipped", one_line(e)
                    if args.verbose and not isinstance(e, Skip):
                        traceback.print_exc()
            order.append({"framework": fw, "shape": cell.shape, "seq": cell.seq, "precision": cell.precision,
                          "repeat": repeat, "status": row.status})
    for fw, row in rows.items():
        if row.status == "ok":
            summarise(row, runs[fw], flops, peak)
    return list(rows.values())


def run_line(fw: str, cell: Cell, repeat: int, repeats: int, run: Run, flops: float, peak: float | None) -> str:
    """One run's figures as soon as it ends, before its cell's rows (which wait for every framework's runs): a call
    cut by its time limit inside a cell (gpu_check's) still shows the runs it finished."""
    step_s = statistics.median(run.step_seconds)
    mfu = f", MFU {flops / step_s / peak:.1%}" if peak else ""
    return (f"  {fw} {cell.shape}/{cell.seq} {cell.precision}, run {repeat + 1} of {repeats}: {step_s * 1e3:.1f} ms "
            f"a step (median of {len(run.step_seconds)}), {run.tokens_per_step / step_s:,.0f} tokens/s{mfu}, "
            f"{run.peak_memory_gib:.2f} GiB")


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
        status = "ok" if r.status == "ok" else f"{r.status}: {r.reason}"
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
                        help="tokens per step: batch = this // seq // micro-batches (default 16384; 256 with --tiny)")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="micro-batches a step (gradient accumulation in every framework): the optimizer "
                             "step shared by them, as in pretraining")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide shape for CPU checks")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: from flops.py)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--verbose", action="store_true", help="print the traceback of a run that fails")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after each row's last repeat, N more steps under torch.profiler: kernel ms per kind")
    args, overrides = parse_flags_and_overrides(parser, argv)
    if args.profile < 0:
        parser.error("--profile takes a number of steps >= 0")
    if args.micro_batches < 1:
        parser.error("--micro-batches takes a number >= 1")
    unknown = set(args.frameworks) - set(FRAMEWORKS)
    if unknown:
        parser.error(f"unknown frameworks {sorted(unknown)}: pick from {','.join(FRAMEWORKS)}")
    if args.tiny:
        args.shapes = ["tiny"]
    if args.tokens_per_step is None:
        args.tokens_per_step = 256 if args.tiny else 16384
    for seq in args.seqs if args.micro_batches > 1 else []:
        if args.tokens_per_step % (seq * args.micro_batches):
            parser.error(f"--tokens-per-step {args.tokens_per_step} is not {args.micro_batches} micro-batches of "
                         f"whole sequences of {seq}: pass a multiple of {seq * args.micro_batches}")
    return args, overrides


def main(argv: list[str] | None = None) -> dict:
    """Runs the grid cell by cell, printing each run's line as it ends (`run_line`) and each cell's rows, and
    rewriting the JSON (`complete` false until the last cell) as a cell finishes, so that a run stopped by a time
    limit keeps every cell it measured and shows every run it finished."""
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
                     "tokens_per_step": args.tokens_per_step, "micro_batches": args.micro_batches,
                     "overrides": overrides,
                     "peak_tflops": args.peak_tflops, "profile": args.profile},
        "complete": False,
        "run_order": order,
        "rows": [],
    }
    if cells:  # the overrides' config, checked before any run (model.rope_scaling, a bad key)
        cell_config(cells[0], 1, overrides, args.tiny)
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


def exit_status(report: dict) -> int:
    """1 when a megalm row raised (status "failed") or the eager megalm row did not run, else 0: a peer that cannot
    run, and megalm's compiled rows on a CPU, are results."""
    rows = report["rows"]
    return int(any(r["status"] == "failed" or (r["framework"] == "megalm" and r["status"] != "ok") for r in rows))


if __name__ == "__main__":
    run_main(lambda: exit_status(main()))  # a bad override is one error line (exit 2), not a traceback
