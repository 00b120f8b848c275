"""megalm against Megatron-Core and TorchTitan: the same Llama shapes, tokens and step, one process, one device.

    python tools/bench/compare.py --shapes 125m,1.3b --seqs 2048,4096,8192 --precisions bf16,fp8 \
        --frameworks megalm,megatron,torchtitan --steps 10 --warmup 3 --repeats 2 --json compare.json
    python tools/bench/compare.py --tiny --precisions fp32 --steps 1 --warmup 0 --repeats 1   # CPU, seconds

Why: a throughput number means little without the frameworks people would otherwise use, measured the same
way. Every run here trains the same shape (layers, hidden, heads, GQA kv heads, SwiGLU ffn, RMSNorm, RoPE,
untied head, megalm's padded vocab) on the same synthetic tokens (megalm's own synthetic documents, each
exactly seq + 1 tokens, so every sample is one full causal sequence), with one step everywhere: forward,
backward, grad-norm clip at 1.0, fused AdamW. Only the model code differs:

- megalm: its own `Trainer.train_step` (as tools/bench/throughput.py times it; `data.varlen=true`).
- megatron: Megatron-Core's `GPTModel` with `get_gpt_layer_local_spec` (no Transformer Engine: its unfused
  `DotProductAttention`, recomputed in backward on CUDA as Megatron's selective recompute does, since its s x s
  scores would not fit; torch RMSNorm), one rank (TP = PP = 1), its own vocab-parallel cross entropy.
- torchtitan: TorchTitan's llama3 `Llama3Model` with its config resized to the shape, its default `flex`
  attention (compiled flex_attention with the causal + document mask), its cross entropy in fp32.

Precisions: fp32; bf16 = bf16 autocast with fp32 weights and optimizer state for all three (megalm's bf16
recipe, and what TorchTitan does on one GPU); fp8 = megalm's `precision=fp8`, TorchTitan's torchao float8
linears (output head kept in bf16, as megalm does), and no Megatron-Core run (its fp8 needs Transformer Engine).

Runs alternate by framework (A B C A B C for `--repeats 2`) inside each (shape, seq, precision) cell, each run
building its model afresh, so clock and thermal drift hit every framework alike; the JSON keeps the order.
Tokens/s is the tokens of a step over the median timed step of all repeats; TFLOP/s and MFU come from one
formula for all three, megalm's `training_flops` (megalm/training/flops.py) over that step time, against
`peak_flops` of the device (or `--peak-tflops`). A framework that cannot run says why, one line each.
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
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from throughput import compose_config, synchronize  # noqa: E402

from megalm.config import MegalmConfig, ModelConfig  # noqa: E402
from megalm.training.flops import peak_flops, training_flops  # noqa: E402

FRAMEWORKS = ("megalm", "megatron", "torchtitan")
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
    """One build + warm-up + timed steps of one framework in one cell."""

    step_seconds: list[float]
    tokens_per_step: int
    peak_memory_gib: float
    params_m: float


@dataclass
class Row:
    framework: str
    shape: str
    seq: int
    precision: str
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
    model: dict = field(default_factory=dict)


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


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast for every recipe but fp32 (fp8 keeps the non-fp8 parts in bf16, as megalm does)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def adamw(model: torch.nn.Module, cfg: MegalmConfig, device: torch.device) -> torch.optim.Optimizer:
    """megalm's optimizer for the peers: AdamW with its hyper-parameters, the fused kernel (as megalm's auto)."""
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


# ---------------------------------------------------------------------------------------------- megalm


def run_megalm(cfg: MegalmConfig, batches: list[torch.Tensor], device: torch.device, warmup: int,
               steps: int) -> Run:
    from megalm.training.trainer import Trainer

    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=warmup + steps))
    tokens = []
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        if trainer.device.type != device.type:
            raise Skip(f"megalm chose {trainer.device}, the others {device}")
        times = time_steps(lambda i: tokens.append(trainer.train_step(i).tokens), warmup, steps, device)
        return Run(times, tokens[-1], peak_memory(device), params_m(trainer.model))


# ---------------------------------------------------------------------------------------------- Megatron-Core


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


def build_megatron(model: ModelConfig, device: torch.device, seed: int) -> torch.nn.Module:
    """Megatron-Core's GPTModel, local (non-TE) layer spec, in the shape of `model`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    megatron_process_group(device)
    on_cuda = device.type == "cuda"
    torch.manual_seed(seed)
    if on_cuda:
        torch.cuda.set_device(device)
        model_parallel_cuda_manual_seed(seed)  # Megatron's RNG tracker: GPU init and its dropout forks use it
    config = TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_heads,
        num_query_groups=model.num_kv_heads, ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm" if model.norm == "rmsnorm" else "LayerNorm", layernorm_epsilon=model.norm_eps,
        gated_linear_unit=model.activation == "swiglu", activation_func=F.silu if model.activation == "swiglu"
        else F.gelu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        # The fused kernels below come from Transformer Engine or Apex, which the local spec goes without.
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        params_dtype=torch.float32, use_cpu_initialization=not on_cuda,
        # Local attention keeps the s x s scores of every layer for backward (~150 GB for 125m at 8K on one GPU);
        # Megatron's own remedy is to recompute core attention in backward. Its checkpoint saves the CUDA RNG state,
        # so CPU checks run without (their sequences are short).
        recompute_granularity="selective" if on_cuda else None)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
                   vocab_size=model.padded_vocab_size or model.vocab_size,
                   max_sequence_length=model.seq_length, position_embedding_type=model.position_embedding,
                   rotary_base=int(model.rope_theta), share_embeddings_and_output_weights=model.tie_embeddings)
    return gpt.to(device)


@contextlib.contextmanager
def megatron_on_cpu(device: torch.device) -> Iterator[None]:
    """CPU checks only: Megatron-Core puts RoPE's frequencies and DotProductAttention's QK^T buffer on
    `torch.cuda.current_device()`, forks the CUDA RNG around attention dropout (0 here) and makes its default
    causal mask on "cuda" (see megatron_steps). Answering "cpu", forking nothing and passing the mask in lets
    the same model code run on a CPU. On CUDA nothing is changed."""
    if device.type == "cuda":
        yield
        return
    no_fork = mock.Mock(fork=contextlib.nullcontext)
    with mock.patch("torch.cuda.current_device", lambda: "cpu"), \
            mock.patch("megatron.core.tensor_parallel.get_cuda_rng_tracker", lambda *a, **k: no_fork):
        yield


def run_megatron(cfg: MegalmConfig, batches: list[torch.Tensor], device: torch.device, warmup: int,
                 steps: int) -> Run:
    if cfg.precision.name != "fp32" and cfg.precision.name != "bf16":
        raise Skip(f"{cfg.precision.name} needs Transformer Engine in Megatron-Core (the local spec has none)")
    require("megatron.core", "megatron-core")
    if cfg.precision.name == "bf16" and device.type != "cuda":
        raise Skip("bf16 on CPU: Megatron-Core's linear autograd functions carry CUDA autocast only "
                   "(custom_fwd/custom_bwd with device_type='cuda')")
    with megatron_on_cpu(device):
        return megatron_steps(cfg, batches, device, warmup, steps)


def megatron_steps(cfg: MegalmConfig, batches: list[torch.Tensor], device: torch.device, warmup: int,
                   steps: int) -> Run:
    model = build_megatron(cfg.model, device, cfg.seed)
    optimizer = adamw(model, cfg, device)
    seq = batches[0].shape[1] - 1
    positions = torch.arange(seq, device=device).expand(batches[0].shape[0], -1)
    # Megatron's default causal mask is made with device="cuda"; on the CPU the same mask is passed in (True = hidden).
    mask = None if device.type == "cuda" else torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]

    def step(i: int) -> None:
        tokens = batches[i % len(batches)]
        with autocast(device, cfg.precision.name):
            loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).mean()  # per-token losses [b, s]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = time_steps(step, warmup, steps, device)
    return Run(times, batches[0][:, :-1].numel(), peak_memory(device), params_m(model))


# ---------------------------------------------------------------------------------------------- TorchTitan


def build_torchtitan(model: ModelConfig, device: torch.device, seed: int) -> torch.nn.Module:
    """TorchTitan's llama3 model, its config built with llama3's own layer builder at the shape of `model`."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    if model.activation != "swiglu" or model.norm != "rmsnorm" or model.position_embedding != "rope":
        raise Skip("TorchTitan's llama3 is SwiGLU + RMSNorm + RoPE only")
    dim, vocab = model.hidden_size, model.padded_vocab_size or model.vocab_size
    config = llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=model.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=model.norm_eps, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            n_layers=model.num_layers, dim=dim, n_heads=model.num_heads, n_kv_heads=model.num_kv_heads,
            hidden_dim=model.ffn_hidden_size, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=dim // model.num_heads, max_seq_len=model.seq_length, theta=model.rope_theta)))
    torch.manual_seed(seed)
    with device:
        titan = config.build()
    titan.init_states(buffer_device=device)
    return titan


def float8_linears(model: torch.nn.Module) -> None:
    """TorchTitan's fp8: torchao's float8 training linears (tensorwise scaling), the output head left in bf16."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:
        raise Skip(f"fp8 needs torchao's float8 ({e})") from None
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn != "lm_head")


def run_torchtitan(cfg: MegalmConfig, batches: list[torch.Tensor], device: torch.device, warmup: int,
                   steps: int) -> Run:
    if cfg.precision.name not in ("fp32", "bf16", "fp8"):
        raise Skip(f"no {cfg.precision.name} recipe wired for TorchTitan here (fp32, bf16, fp8)")
    require("torchtitan.models.llama3", "torchtitan")
    model = build_torchtitan(cfg.model, device, cfg.seed)
    if cfg.precision.name == "fp8":
        float8_linears(model)
    optimizer = adamw(model, cfg, device)
    seq = batches[0].shape[1] - 1
    positions = torch.arange(seq, device=device).expand(batches[0].shape[0], -1)

    def step(i: int) -> None:
        tokens = batches[i % len(batches)]
        masks = model.get_attention_masks(positions)  # one document per row: the causal mask
        with autocast(device, cfg.precision.name):
            logits = model(tokens[:, :-1], positions, masks)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())  # TorchTitan's: fp32 logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = time_steps(step, warmup, steps, device)
    return Run(times, batches[0][:, :-1].numel(), peak_memory(device), params_m(model))


RUNNERS: dict[str, Callable[..., Run]] = {"megalm": run_megalm, "megatron": run_megatron, "torchtitan": run_torchtitan}


# ---------------------------------------------------------------------------------------------- the harness


def one_line(error: BaseException) -> str:
    """A skip's own message, or the error's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    return first if isinstance(error, Skip) else f"{type(error).__name__}: {first}"


@contextlib.contextmanager
def fresh_device(device: torch.device) -> Iterator[None]:
    """Each run starts from a clean allocator and a reset peak, and gives its memory back afterwards."""
    gc.collect()
    if device.type == "cuda":
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


def run_cell(cell: Cell, args: argparse.Namespace, overrides: list[str], device: torch.device,
             order: list[dict]) -> list[Row]:
    batch = max(1, args.tokens_per_step // cell.seq)
    cfg = cell_config(cell, batch, overrides, args.tiny)
    model = {k: getattr(cfg.model, k) for k in MODEL_FIELDS}
    rows = {fw: Row(fw, cell.shape, cell.seq, cell.precision, batch=batch, model=model) for fw in args.frameworks}
    runs: dict[str, list[Run]] = {fw: [] for fw in args.frameworks}
    batches = synthetic_batches(cfg, min(args.warmup + args.steps, 4), batch, device)
    for repeat in range(args.repeats):
        for fw in args.frameworks:  # A B C, A B C: drift reaches every framework alike
            row = rows[fw]
            if row.status != "ok":
                continue
            with fresh_device(device):
                try:
                    runs[fw].append(RUNNERS[fw](cfg, batches, device, args.warmup, args.steps))
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


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def print_table(rows: list[Row]) -> None:
    print(f"{'framework':<11} {'shape':<6} {'seq':>6} {'prec':<5} {'tokens/s':>12} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'peak GiB':>8}  status")
    for r in rows:
        mfu = fmt(None if r.mfu is None else 100 * r.mfu, ".1f") + ("%" if r.mfu is not None else "")
        status = "ok" if r.status == "ok" else f"skipped: {r.reason}"
        print(f"{r.framework:<11} {r.shape:<6} {r.seq:>6} {r.precision:<5} {fmt(r.tokens_per_sec, ',.0f'):>12} "
              f"{fmt(r.tflops_per_sec, '.2f'):>8} {mfu:>6} {fmt(r.peak_memory_gib, '.2f'):>8}  {status}")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    csv = lambda kind: lambda s: [kind(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--shapes", type=csv(str), default=["125m", "1.3b"], help="configs/model names")
    parser.add_argument("--seqs", type=csv(int), default=[2048, 4096, 8192], help="sequence lengths")
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
    # Hydra overrides (key=value, for megalm and the shape) may follow any flag: set them aside first.
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = parser.parse_args([a for a in argv if a not in overrides])
    unknown = set(args.frameworks) - set(FRAMEWORKS)
    if unknown:
        parser.error(f"unknown frameworks {sorted(unknown)}: pick from {','.join(FRAMEWORKS)}")
    if args.tiny:
        args.shapes = ["tiny"]
    if args.tokens_per_step is None:
        args.tokens_per_step = 256 if args.tiny else 16384
    return args, overrides


def main(argv: list[str] | None = None) -> dict:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "compare_inductor"))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    order: list[dict] = []
    rows = [row for shape in args.shapes for seq in args.seqs for precision in args.precisions
            for row in run_cell(Cell(shape, seq, precision), args, overrides, device, order)]
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "megatron-core": version("megatron-core"),
                     "torchtitan": version("torchtitan"), "torchao": version("torchao")},
        "settings": {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                     "tokens_per_step": args.tokens_per_step, "overrides": overrides,
                     "peak_tflops": args.peak_tflops},
        "run_order": order,
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    print(f"device: {report['device']}, torch {torch.__version__}")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    result = main()
    megalm_rows = [r for r in result["rows"] if r["framework"] == "megalm"]
    sys.exit(1 if any(r["status"] != "ok" for r in megalm_rows) else 0)
