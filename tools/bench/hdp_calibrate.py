"""HDP cost-model calibration: measure the cost model's coefficients on one device and write a cost YAML.

    python tools/bench/hdp_calibrate.py model=7b --base configs/hdp_cost/h100_7b.yaml --out /tmp/h100_7b.yaml
    python tools/bench/hdp_calibrate.py model=tiny --device cpu --base configs/hdp_cost/h100_7b.yaml \
        --out /tmp/hdp_cost_tiny.yaml --budget-s 30                     # the same code on CPU (CI)

What it measures, on ONE real megalm transformer block of the model config's shape, built and run as the trainer
runs it (meta-device GPT, the precision recipe's `convert`, `parallel.recompute`, `init_weights`, the recipe's
working dtype; forward inside the recipe's forward context; precision=bf16 (bf16 weights) on CUDA unless
`precision=` says otherwise; `model.attention_backend`,
`auto` by default):

- a, b, c: forward + backward of the block on packed micro-batches of documents s_i, chosen so that Σs_i² and
  Σs_i vary independently (one long document vs many short ones of the same total, several totals, and mixed
  lengths); warmup calls, then the median of timed calls (CUDA events; perf_counter on CPU). Fit of
  t = a·Σs_i² + b·Σs_i + c by non-negative least squares on the relative error (`fit_cost`).
- head: embedding + final norm + LM head + loss, forward + backward, at three token counts; the slope per token.
- act_bytes, act_fixed: CUDA allocator (memory_allocated / max_memory_allocated) at two token counts, per block and
  for the head (`memory_line`); on CPU the live storage of the tensors autograd saves (no transient peaks), and
  capacity is not derived (no device memory to fill).
- capacity: (0.9·HBM − 4 GiB − act_fixed) / act_bytes, rounded down to a power of two (as the base file derives it).
- host_bw: pinned host <-> device copies of 256 MiB, the slower direction (CUDA only).

bw_intra, bw_inter, latency, overlap and ranks_per_node need two GPUs or nodes: they are kept from `--base` and
marked "not measured (one GPU)" in the written file. The run stops measuring when `--budget-s` (counted from the
process start) nears and always writes the file with what it has. Exit code 0: written with a fit; 1: written, but
fewer than 3 points fit in the budget (a, b, c kept from the base); 2: bad input (one line on stderr).
Arguments without dashes are Hydra overrides of configs/config.yaml, as in tools/bench/throughput.py.
"""

from __future__ import annotations

import time

_PROCESS_START = time.monotonic()  # the budget counts from here (before the imports), so --budget-s bounds the run

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megalm import compat  # noqa: E402
from megalm.estimate.layout_search import ROOFLINE_EFFICIENCY  # noqa: E402
from megalm.estimate.rank import HBM_BYTES  # noqa: E402
from megalm.measure import storage_identity  # noqa: E402
from megalm.measure.op_cost import GPUS, OpCosts  # noqa: E402
from megalm.model.attention import one_kernel_backend  # noqa: E402
from megalm.parallel.hdp.cost import CostModel, GiB  # noqa: E402
from megalm.precision import compute_dtype  # noqa: E402
from tools.bench.cli import parse_flags_and_overrides  # noqa: E402
from tools.bench.timing import time_calls  # noqa: E402

KEYS = ("a", "b", "c", "layers", "head", "kv_bytes", "qo_bytes", "heads", "comm_passes", "bw_intra", "bw_inter",
        "latency", "overlap", "ranks_per_node", "capacity", "act_bytes", "act_fixed", "host_bw", "source", "name")
TEXT_KEYS = ("source", "name")
TWO_GPU_KEYS = ("bw_intra", "bw_inter", "latency", "overlap", "ranks_per_node")  # need two GPUs or nodes
INT_KEYS = ("layers", "ranks_per_node", "capacity", "kv_bytes", "qo_bytes", "heads")
DEFAULTS = {  # per device: (max tokens per micro-batch, shortest document, warmup calls, timed calls)
    "cuda": (16384, 256, 3, 10),
    "cpu": (1024, 64, 1, 3),
    "roofline": (16384, 256, 0, 1),
}
HOST_COPY_BYTES = 256 * 2**20


class BadInput(Exception):
    """Something the user passed cannot work; the message is the one line printed."""


# ---------------------------------------------------------------------------------------------
# The fit (pure numpy: tested with synthetic timings)


@dataclass
class Fit:
    a: float
    b: float
    c: float
    relative_residuals: list[float]  # (fit − measured) / measured, per point

    @property
    def rms(self) -> float:
        r = self.relative_residuals
        return math.sqrt(sum(x * x for x in r) / len(r)) if r else float("nan")

    def predict(self, sum_sq: float, tokens: float) -> float:
        return self.a * sum_sq + self.b * tokens + self.c


def fit_cost(sum_sq: Sequence[float], tokens: Sequence[float], seconds: Sequence[float]) -> Fit:
    """a, b, c ≥ 0 of t = a·Σs² + b·Σs + c minimising Σ((fit − t)/t)²: relative error, because timing noise grows
    with the time and the small micro-batches are what pin c.

    Exact non-negative least squares for three unknowns: the optimum is the unconstrained least-squares solution on
    some subset of the columns (the KKT conditions), so every subset is solved and the best feasible one kept.
    Columns are scaled to unit norm first (Σs² is ~1e8 times the constant column)."""
    t = np.asarray(seconds, dtype=np.float64)
    if len(t) < 3 or not (len(sum_sq) == len(tokens) == len(t)) or np.any(t <= 0):
        raise ValueError(f"fit_cost needs at least 3 points with positive times, got {len(t)}")
    design = np.stack([np.asarray(sum_sq, np.float64), np.asarray(tokens, np.float64), np.ones_like(t)], axis=1)
    weighted = design / t[:, None]
    target = np.ones_like(t)  # t / t
    norms = np.linalg.norm(weighted, axis=0)
    norms[norms == 0] = 1.0
    scaled = weighted / norms
    best, best_cost = np.zeros(3), float(np.sum(target**2))
    for size in (1, 2, 3):
        for cols in itertools.combinations(range(3), size):
            sol, *_ = np.linalg.lstsq(scaled[:, cols], target, rcond=None)
            if np.any(sol < 0):
                continue
            theta = np.zeros(3)
            theta[list(cols)] = sol
            cost = float(np.sum((scaled @ theta - target) ** 2))
            if cost < best_cost - 1e-15:
                best, best_cost = theta, cost
    a, b, c = (best / norms).tolist()
    residuals = ((design @ np.array([a, b, c]) - t) / t).tolist()
    return Fit(a, b, c, residuals)


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of ordinary least squares y = slope·x + intercept (two points: the line through them)."""
    slope, intercept = np.polyfit(np.asarray(x, np.float64), np.asarray(y, np.float64), 1)
    return float(slope), float(intercept)


def design_points(max_tokens: int, min_doc: int) -> list[tuple[int, ...]]:
    """Micro-batches (document lengths) to time, in the order to time them: first, for each total T (ascending,
    powers of two from 2·min_doc to max_tokens) one document of T and T/min_doc documents of min_doc (the extremes of
    Σs² at that Σs), so a run cut short by its budget still spans both axes; then the lengths in between; then mixed
    lengths (T/2 + T/4 + … + min_doc + min_doc), which check that Σs² describes unequal documents too."""
    totals = [t for t in (max_tokens >> k for k in range(12)) if t >= 2 * min_doc][::-1]
    first = [p for t in totals for p in ((t,), (min_doc,) * (t // min_doc))]
    between = [(s,) * (t // s) for t in totals for s in (t >> k for k in range(1, 12)) if min_doc < s < t]
    mixed = []
    for t in totals[-2:]:
        lengths, s = [], t // 2
        while s >= min_doc:
            lengths.append(s)
            s //= 2
        mixed.append((*lengths, t - sum(lengths)))
    return list(dict.fromkeys(first + between + [m for m in mixed if len(m) > 2]))


# ---------------------------------------------------------------------------------------------
# Measuring


@dataclass
class Point:
    lengths: tuple[int, ...]
    seconds: float  # median of the timed calls
    spread: float  # (max − min) / median of the timed calls

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def sum_sq(self) -> int:
        return sum(s * s for s in self.lengths)

    def label(self) -> str:
        if len(set(self.lengths)) == 1:
            return f"{len(self.lengths)}x{self.lengths[0]}"
        return "+".join(str(s) for s in self.lengths)


@dataclass
class MemoryLine:
    """Bytes per token and at zero tokens, of what a block keeps for its backward (`saved`) and of the peaks above
    the state during the block's and the head's forward + backward."""

    saved: tuple[float, float]
    block_peak: tuple[float, float]
    head_peak: tuple[float, float]
    layer_state: float  # bytes of one block's parameters + gradients
    other_state: float  # embedding, final norm, LM head: parameters + gradients
    how: str
    live_saved: tuple[float, float] | None = None  # cross-check on CUDA: autograd's saved storages


@dataclass
class Clock:
    """The run's budget: deadline = process start + budget − a reserve for fitting and writing."""

    start: float
    budget: float
    reserve: float = field(default=1.0)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget - self.reserve - self.elapsed()


class Bench:
    """One megalm transformer block plus the embedding and head (a one-layer GPT), built and run as the trainer
    builds and runs a model, and the measurements on it."""

    def __init__(self, cfg, device: torch.device, warmup: int, repeats: int, roofline: str | None = None) -> None:
        from megalm.model.gpt import GPT, init_weights
        from megalm.model.loss import TokenLoss
        from megalm.parallel.recompute import apply_recompute, stage_mode
        from megalm.precision import Precision

        self.cfg, self.device, self.warmup, self.repeats = cfg, device, warmup, repeats
        self.roofline = roofline  # a GPU name (megalm.measure.op_cost.GPUS): time = its roofline / efficiency
        self.is_cuda = device.type == "cuda"
        self.forwards = 0  # block forwards run, each a step of its own (`block_forward`)
        model_cfg = copy.deepcopy(cfg.model)
        model_cfg.num_layers = 1
        self.precision = Precision(cfg.precision, cfg.seed, device)
        # The meta skeleton is built outside the FakeTensorMode `--device roofline` runs under (as the trainer does:
        # a parameter made under it could not be swapped for its materialised self); outside one this is a no-op.
        with unset_fake_temporarily():
            model = GPT(model_cfg, device="meta")
            self.precision.convert(model)
            self.recompute = stage_mode(cfg.parallel.recompute, 0, cfg.parallel.pp)
            apply_recompute(model, self.recompute)
        # Materialise the block and the rest separately: the allocator tells each one's parameter bytes.
        working = self.precision.working_dtype  # precision=bf16: bf16 weights, as the trainer's model holds them

        def materialise(module: torch.nn.Module) -> None:
            module.to_empty(device=device)
            for param in module.parameters():  # param.data, not .to(): fake tensors cannot be swapped in
                param.data = param.data.to(working or torch.float32)

        before = self._allocated()
        materialise(model.layers)
        after_block = self._allocated()
        for name, child in model.named_children():
            if name != "layers":
                materialise(child)
        self.param_bytes = (after_block - before, self._allocated() - after_block)
        if any(p.is_meta for p in model.parameters()):
            raise RuntimeError("a parameter of the one-layer GPT stayed on the meta device")
        init_weights(model, cfg.seed)
        self.model, self.block = model, model.layers[0]
        self.loss_fn = TokenLoss(cfg.model.vocab_size)  # the trainer's: the gradient written over the logits
        self.param_ptrs = {storage_identity(p) for p in model.parameters()}
        self.compute_dtype: torch.dtype | None = None  # of q, seen on the first forward
        self.grad_bytes = (0.0, 0.0)

    # -------------------------------------------------------------- helpers

    def _allocated(self) -> int:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        return 0

    def _sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def block_inputs(self, lengths: Sequence[int]) -> dict:
        """A packed micro-batch of documents `lengths` at the block's input: hidden states [T, h] (in the embedding's
        dtype, as it gives them), cu_seqlens, positions restarting per document, RoPE computed as GPT.forward does."""
        total, hidden = sum(lengths), self.cfg.model.hidden_size
        dtype = self.model.embedding.weight.dtype
        gen = torch.Generator(device=self.device).manual_seed(total)  # drawn on the device: no host copy of [T, h]
        x = torch.randn(total, hidden, generator=gen, device=self.device).to(dtype).requires_grad_(True)
        grad = torch.randn(total, hidden, generator=gen, device=self.device).to(dtype)
        with unset_fake_temporarily():  # real offsets under --device roofline: varlen attention reads them on the host
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=self.device)
        positions = torch.cat([torch.arange(s) for s in lengths]).to(self.device)
        with self.precision.forward_context():
            rope = self.model.rotary(positions, dtype)
        return {"x": x, "grad": grad, "cu": cu, "max_seqlen": max(lengths), "rope": rope}

    def block_forward(self, inp: dict) -> torch.Tensor:
        # each call a step of its own: under fp8_delayed the amax history moves (the first step alone casts with the
        # current amax, a pass more than the delayed cast of every later step)
        self.forwards += 1
        self.precision.before_forward(self.model, self.forwards, 0)
        with self.precision.forward_context():
            return self.block(inp["x"], inp["cu"], inp["max_seqlen"], inp["rope"])

    def block_call(self, inp: dict) -> None:
        """Forward + backward of the block; parameter gradients accumulate as over a step's micro-batches."""
        self.block_forward(inp).backward(inp["grad"])
        inp["x"].grad = None

    def head_inputs(self, tokens: int) -> dict:
        gen = torch.Generator(device="cpu").manual_seed(tokens)
        vocab = self.cfg.model.vocab_size
        ids = torch.randint(0, vocab, (tokens + 1,), generator=gen)
        return {"tokens": ids[:-1].to(self.device), "labels": ids[1:].to(self.device),
                "mask": torch.ones(tokens, device=self.device), "positions": torch.arange(tokens).to(self.device)}

    def head_loss(self, inp: dict) -> torch.Tensor:
        """Embedding -> final norm -> LM head under the forward context, the loss outside it (as LocalRunner)."""
        with self.precision.forward_context():
            logits = self.model.head(self.model.embed(inp["tokens"], inp["positions"]))
        return self.loss_fn(logits, inp["labels"], inp["mask"])

    def head_call(self, inp: dict) -> None:
        self.head_loss(inp).backward()

    def time_calls(self, call: Callable[[], None]) -> tuple[float, float]:
        """(median seconds, (max − min) / median) of `repeats` calls after `warmup` calls. CUDA: events around each
        call from an idle device (so host launch gaps count, as they do in training); CPU: perf_counter; roofline:
        one call's ops priced on the GPU (max(FLOPs / peak, bytes / HBM bandwidth) each, megalm/measure/op_cost.py)
        and divided by megalm-estimate's ROOFLINE_EFFICIENCY, the step time the estimator reports."""
        if self.roofline is not None:
            costs = OpCosts(GPUS[self.roofline])
            with costs:
                call()
            return costs.total().ms / 1e3 / ROOFLINE_EFFICIENCY, 0.0
        times = [ms / 1e3 for ms in time_calls(call, self.device, self.warmup, self.repeats)]
        median = statistics.median(times)
        return median, (max(times) - min(times)) / median

    # -------------------------------------------------------------- phases

    def first_calls(self, tokens: int) -> None:
        """The first block and head calls (they resolve the attention backend, compile kernels and create the cuBLAS
        workspaces of the forward and the backward threads), then the gradients' bytes: the gradients are dropped and
        allocated again by one more call of each, measured by the allocator on CUDA, by storage sizes on CPU."""
        inp = self.block_inputs((tokens,))
        head = self.head_inputs(tokens)
        seen: list[torch.dtype] = []
        hook = self.block.attention.qkv_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        self.block_call(inp)
        hook.remove()
        self.compute_dtype = seen[0]
        self.head_call(head)
        self.model.zero_grad(set_to_none=True)
        before = self._allocated()
        self.block_call(inp)
        block_grads = self._allocated() - before
        before = self._allocated()
        self.head_call(head)
        head_grads = self._allocated() - before
        if not self.is_cuda:
            grads = lambda mod: sum(p.grad.untyped_storage().nbytes() for p in mod.parameters() if p.grad is not None)
            params = lambda mod: sum(p.untyped_storage().nbytes() for p in mod.parameters())
            others = [m for n, m in self.model.named_children() if n != "layers"]
            block_grads, head_grads = grads(self.block), sum(grads(m) for m in others)
            self.param_bytes = (params(self.block), sum(params(m) for m in others))
        self.grad_bytes = (float(block_grads), float(head_grads))

    def attention_backend(self) -> str:
        from megalm.model.attention import select_attention_backend

        dropout = self.cfg.model.attention_dropout > 0
        return select_attention_backend(self.cfg.model.attention_backend, self.device, self.compute_dtype,
                                        dropout=dropout)

    def saved_storage(self, run: Callable[[], torch.Tensor], inputs: dict) -> tuple[torch.Tensor, int]:
        """Run a forward; return its output and the bytes of the distinct storages autograd saves for the backward,
        plus the output's. Parameters (state) and the `inputs` (the previous layer's output, counted there) are left
        out, as the allocator's count above a baseline taken after they exist leaves them out."""
        storages: dict[int, int] = {}
        skip = self.param_ptrs | {storage_identity(t) for t in inputs.values() if torch.is_tensor(t)}

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage: not counted
                return t
            if storage_identity(st) not in skip:
                storages[storage_identity(st)] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        storages[storage_identity(out)] = out.untyped_storage().nbytes()
        return out, sum(storages.values())

    def memory_point(self, tokens: int) -> dict[str, float]:
        """Bytes above the state at `tokens` tokens (one document): the block's kept activations after its
        forward, its peak through the backward, the head's peak; CUDA from the allocator, CPU from live storage."""
        inp = self.block_inputs((tokens,))
        head = self.head_inputs(tokens)
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        base = self._allocated()
        out, live = self.saved_storage(lambda: self.block_forward(inp), inp)
        kept = self._allocated() - base
        out.backward(inp["grad"])
        inp["x"].grad = None
        del out
        block_peak = torch.cuda.max_memory_allocated(self.device) - base if self.is_cuda else live
        if self.is_cuda:
            self._sync()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = self._allocated()
            self.head_call(head)
            head_peak = torch.cuda.max_memory_allocated(self.device) - base
        else:
            loss, head_peak = self.saved_storage(lambda: self.head_loss(head), head)
            loss.backward()
            del loss
        return {"saved": kept if self.is_cuda else live, "block_peak": block_peak, "head_peak": head_peak,
                "live": live}

    def memory_line(self, token_counts: Sequence[int]) -> MemoryLine:
        points = [self.memory_point(n) for n in token_counts]
        line = lambda key: fit_line(token_counts, [p[key] for p in points])
        how = ("CUDA allocator: memory_allocated after the block's forward and max_memory_allocated through its "
               "backward and the head's forward + backward, above the state" if self.is_cuda else
               "CPU: live storage of the tensors autograd saves (distinct storages; parameters and the input "
               "excluded) and the output; no transient peaks (torch has no CPU allocator statistics)")
        return MemoryLine(saved=line("saved"), block_peak=line("block_peak"), head_peak=line("head_peak"),
                          layer_state=self.param_bytes[0] + self.grad_bytes[0],
                          other_state=self.param_bytes[1] + self.grad_bytes[1], how=how,
                          live_saved=line("live") if self.is_cuda else None)

    def host_bandwidth(self, nbytes: int = HOST_COPY_BYTES) -> tuple[float, float]:
        """(host->device, device->host) bytes/s of copies between pinned host memory and the device."""
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        h2d, _ = self.time_calls(lambda: dev.copy_(host, non_blocking=True))
        d2h, _ = self.time_calls(lambda: host.copy_(dev, non_blocking=True))
        return nbytes / h2d, nbytes / d2h


# ---------------------------------------------------------------------------------------------
# Config, checks, the YAML


def compose_config(overrides: list[str], device: str):
    """megalm's config as tools/bench/throughput.py composes it; bf16 on CUDA unless `precision=` is given (the
    trainer's choice for a GPU), the config's precision on CPU; errors as one line."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from megalm.config import register_schema, to_dataclass
    from megalm.errors import MegalmError
    from megalm.train import CONFIG_DIR
    from megalm.training.validation import validate_run

    register_schema()
    base = ["data=synthetic", "trainer.eval_interval=0", "trainer.save_interval=0", "logging.tensorboard=false",
            f"trainer.device={device}", *(["precision=bf16"] if device == "cuda" else [])]
    model = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] in ("model", "+model")), None)
    if model is not None and not (Path(CONFIG_DIR) / "model" / f"{model}.yaml").is_file():
        known = sorted(p.stem for p in (Path(CONFIG_DIR) / "model").glob("*.yaml"))
        raise BadInput(f"unknown model {model!r}: pick one of {', '.join(known)} (configs/model)")
    first_line = lambda e: (str(e).strip().splitlines() or [type(e).__name__])[0]
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = to_dataclass(compose(config_name="config", overrides=base + overrides))
    except (HydraException, OmegaConfBaseException, MegalmError, ValueError) as e:
        raise BadInput(f"bad override: {first_line(e)}") from e
    if cfg.parallel.tp != 1:
        raise BadInput(f"parallel.tp={cfg.parallel.tp}: this tool times one block on one GPU; calibrate with "
                       "parallel.tp=1 (a TP group's cost model is not measured here)")
    try:
        return validate_run(cfg, 1)
    except (MegalmError, ValueError) as e:
        raise BadInput(f"config: {first_line(e)}") from e


def check_out(path: Path) -> None:
    """--out must be a file we can write: its folder exists and is writable, and it is not a folder."""
    if path.is_dir():
        raise BadInput(f"--out {path} is a directory; give a file path such as {path / 'hdp_cost.yaml'}")
    parent = path.parent
    if not parent.is_dir():
        raise BadInput(f"--out {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise BadInput(f"--out {path} is not writable")


def load_base(path: Path) -> dict:
    try:
        CostModel.from_yaml(path)
        with open(path) as f:
            return yaml.safe_load(f)
    except (OSError, ValueError, TypeError, yaml.YAMLError) as e:
        raise BadInput(f"--base {path}: not a cost-model YAML ({str(e).splitlines()[0]})") from e


def format_value(key: str, value) -> str:
    if key in TEXT_KEYS:
        return json.dumps(str(value))  # a JSON string is a YAML string
    value = float(value)
    if key in INT_KEYS and value.is_integer():
        return str(int(value))
    if value.is_integer() and abs(value) < 1e6:
        return f"{value:.1f}"
    return f"{value:.4e}"  # always with a dot: PyYAML reads 1e-05 (no dot) as a string


def write_yaml(path: Path, values: dict, notes: dict[str, str], header: list[str]) -> None:
    """The cost-model YAML: header comment lines, then every key of the base in its order with a note on where its
    value comes from. Read back with CostModel.from_yaml before returning (the file must load as numbers)."""
    width = max(len(f"{k}: {format_value(k, values[k])}") for k in KEYS)
    wrap = lambda h: [h] if h.startswith(("Command:", "  ")) else textwrap.wrap(h, 116, subsequent_indent="  ") or [""]
    lines = [f"# {part}".rstrip() for h in header for part in wrap(h)]
    for key in KEYS:
        text = f"{key}: {format_value(key, values[key])}"
        lines.append(f"{text:<{width}}  # {notes[key]}" if notes.get(key) else text)
    path.write_text("\n".join(lines) + "\n")
    loaded = CostModel.from_yaml(path)
    bad = [k for k in KEYS if k not in TEXT_KEYS and not isinstance(getattr(loaded, k), (int, float))]
    if bad:
        raise RuntimeError(f"{path}: keys {bad} did not load as numbers")


# ---------------------------------------------------------------------------------------------
# The run


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def one_line_error(message: str):
        raise BadInput(message)

    parser.error = one_line_error  # type: ignore[method-assign]
    parser.add_argument("--base", required=True, type=Path,
                        help="cost YAML whose unmeasured keys (links, overlap) are kept: configs/hdp_cost/h100_7b.yaml")
    parser.add_argument("--out", required=True, type=Path, help="the cost YAML to write")
    parser.add_argument("--budget-s", type=float, default=180.0,
                        help="seconds for the whole run, from process start (default 180)")
    parser.add_argument("--device", choices=("cuda", "cpu", "roofline"), default="cuda",
                        help="cuda: time on the GPU; cpu: the same code on the CPU (CI); roofline: no device, the "
                        "block's ops traced under fake tensors and priced on --gpu (the estimator's step time; "
                        "FP8 recipes as that GPU runs them)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="--device roofline: the GPU priced")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="largest micro-batch in tokens (default 16384 on CUDA, 1024 on CPU)")
    parser.add_argument("--min-doc", type=int, default=None,
                        help="shortest document in tokens (default 256 on CUDA, 64 on CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per point (default 10 CUDA, 3 CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per point (default 3 CUDA, 1 CPU)")
    args, overrides = parse_flags_and_overrides(parser, argv)
    max_tokens, min_doc, warmup, repeats = DEFAULTS[args.device]
    args.max_tokens = args.max_tokens or max_tokens
    args.min_doc = args.min_doc or min_doc
    args.warmup = warmup if args.warmup is None else args.warmup
    args.repeats = repeats if args.repeats is None else args.repeats
    if args.budget_s <= 0:
        raise BadInput(f"--budget-s {args.budget_s}: must be positive")
    if args.min_doc < 1 or args.max_tokens < 2 * args.min_doc:
        raise BadInput(f"--max-tokens {args.max_tokens} must be at least twice --min-doc {args.min_doc} (>= 1)")
    if args.repeats < 1 or args.warmup < 0:
        raise BadInput("--repeats must be >= 1 and --warmup >= 0")
    return args, overrides


def measure(args: argparse.Namespace, cfg, device: torch.device, clock: Clock) -> dict:
    """All phases, each only if the budget leaves room for it; returns what was measured."""
    bench = Bench(cfg, device, args.warmup, args.repeats, roofline=args.gpu if args.device == "roofline" else None)
    bench.first_calls(args.min_doc)
    found: dict = {"backend": bench.attention_backend(), "dtype": str(bench.compute_dtype).removeprefix("torch."),
                   "recompute": bench.recompute, "precision": cfg.precision.name, "points": [], "skipped": [],
                   "bench": bench}
    calls = args.warmup + args.repeats
    top = args.max_tokens
    # Seconds per token of one warm call at 2·min_doc tokens (launch-bound on a GPU, so an overestimate for large
    # micro-batches); the budget checks below use it until the fit can predict.
    warm = bench.block_inputs((2 * args.min_doc,))
    bench._sync()
    t0 = time.perf_counter()
    bench.block_call(warm)
    bench._sync()
    per_token = max((time.perf_counter() - t0) / (2 * args.min_doc), 1e-9)
    del warm

    def affordable(tokens: float, n_calls: int) -> bool:
        return clock.left() > 2.0 * per_token * tokens * n_calls

    def out_of_memory(what: str) -> None:
        torch.cuda.empty_cache()
        found["skipped"].append(f"{what} (out of memory at {top} tokens: lower --max-tokens)")
        print(f"  {what}: out of memory at {top} tokens; skipped", flush=True)

    if affordable(top * 1.25, 4):  # a block and a head call at top/4 and at top tokens
        try:
            found["memory"] = bench.memory_line([top // 4, top])
        except torch.cuda.OutOfMemoryError:
            out_of_memory("memory")
    else:
        found["skipped"].append("memory (budget)")
    head_tokens = [top // 4, top // 2, top]
    if affordable(sum(head_tokens), calls):
        try:
            head_times = [bench.time_calls(functools.partial(bench.head_call, bench.head_inputs(n)))[0]
                          for n in head_tokens]
            found["head"] = (fit_line(head_tokens, head_times), head_times, head_tokens)
        except torch.cuda.OutOfMemoryError:
            out_of_memory("head")
    else:
        found["skipped"].append("head (budget)")
    if device.type == "cuda":
        if clock.left() > 5.0:
            found["host_bw"] = bench.host_bandwidth()
        else:
            found["skipped"].append("host_bw (budget)")
    design = design_points(args.max_tokens, args.min_doc)
    too_big: int | None = None
    for lengths in design:
        tokens = sum(lengths)
        if too_big is not None and tokens >= too_big:
            found["skipped"].append(f"{len(lengths)} docs, {tokens} tokens (out of memory)")
            continue
        points: list[Point] = found["points"]
        if len(points) >= 3:
            fit = fit_cost([p.sum_sq for p in points], [p.tokens for p in points], [p.seconds for p in points])
            guess = max(fit.predict(sum(s * s for s in lengths), tokens), per_token * tokens)
        else:
            guess = per_token * tokens * 2
        if clock.left() < 1.5 * guess * calls + 0.05:
            found["skipped"].append(f"{len(design) - design.index(lengths)} points (budget)")
            break
        inp = bench.block_inputs(lengths)
        try:
            seconds, spread = bench.time_calls(functools.partial(bench.block_call, inp))
        except torch.cuda.OutOfMemoryError:
            del inp
            torch.cuda.empty_cache()
            too_big = tokens
            print(f"  {tokens} tokens: out of memory; skipping micro-batches this large", flush=True)
            continue
        del inp
        point = Point(tuple(lengths), seconds, spread)
        points.append(point)
        per_token = max(per_token if len(points) > 1 else 0.0, seconds / tokens)
        print(f"  point {len(points):2d}: {point.label():>14} tokens {tokens:>6} sum_sq {point.sum_sq:>12.4g} "
              f"{seconds * 1e3:9.3f} ms (spread {spread:.1%})", flush=True)
    return found


def derive(found: dict, base: dict, cfg, device: torch.device, args: argparse.Namespace, out: Path
           ) -> tuple[dict, dict[str, str], list[str], Fit | None]:
    """The YAML's values, per-key notes and header from the measurements; unmeasured keys from `base`."""
    bench: Bench = found["bench"]
    model = cfg.model
    layers = model.num_layers
    defaults = CostModel(a=0.0, b=0.0, c=0.0)
    values = {k: base.get(k, getattr(defaults, k)) for k in KEYS}
    values["name"] = out.stem
    base_name = str(args.base)
    notes: dict[str, str] = {}
    measured: list[str] = []
    verb = f"{args.gpu} roofline / {ROOFLINE_EFFICIENCY}" if args.device == "roofline" else "measured"
    points: list[Point] = found["points"]
    fit = None
    if len(points) >= 3:
        fit = fit_cost([p.sum_sq for p in points], [p.tokens for p in points], [p.seconds for p in points])
        values.update(a=fit.a, b=fit.b, c=fit.c)
        notes["a"] = f"{verb}: s per token pair per layer (fit of {len(points)} points)"
        notes["b"] = f"{verb}: s per token per layer"
        notes["c"] = f"{verb}: s per micro-batch per layer"
        measured += ["a", "b", "c"]
    else:
        for k in "abc":
            notes[k] = f"not measured (budget: {len(points)} points, 3 needed): kept from {base_name}"
    head_dim = model.hidden_size // model.num_heads
    elem = torch.empty((), dtype=bench.compute_dtype).element_size()
    values["layers"] = layers
    values["kv_bytes"] = 2 * model.num_kv_heads * head_dim * elem
    values["qo_bytes"] = 2 * model.hidden_size * elem
    values["heads"] = model.num_kv_heads
    notes["layers"] = f"from the model config ({model.name})"
    notes["kv_bytes"] = (f"from the model config: 2 * {model.num_kv_heads} kv heads * {head_dim} * {elem} B "
                         f"({found['dtype']})")
    notes["qo_bytes"] = f"from the model config: q and the attention output, 2 * {model.hidden_size} * {elem} B"
    notes["heads"] = "from the model config: kv heads of one rank (tp=1); an all-to-all group must divide them"
    notes["comm_passes"] = f"model constant (KV fwd; KV, dKV bwd): kept from {base_name}"
    for key in TWO_GPU_KEYS:
        notes[key] = f"not measured (one GPU): kept from {base_name}"
    if "head" in found:
        (slope, intercept), _, _ = found["head"]
        values["head"] = max(slope, 0.0)
        notes["head"] = f"{verb}: s per token, embedding + LM head + loss ({intercept * 1e3:+.3f} ms per call)"
        measured.append("head")
    else:
        notes["head"] = f"not measured (budget): kept from {base_name}"
    memory_text: list[str] = []
    if "memory" in found:
        m: MemoryLine = found["memory"]
        # A step's peak: all layers' saved activations, plus the larger of the head's peak (its backward runs first)
        # and the last block's backward transient (its own saved part already counted).
        e_trans, f_trans = m.block_peak[0] - m.saved[0], m.block_peak[1] - m.saved[1]
        e = layers * m.saved[0] + max(m.head_peak[0], e_trans)
        state = layers * m.layer_state + m.other_state
        f = state + max(0.0, layers * m.saved[1] + max(m.head_peak[1], f_trans))
        values["act_bytes"], values["act_fixed"] = e, f
        measured += ["act_bytes", "act_fixed"]
        probe = "memory probe of the traced block" if args.device == "roofline" else "measured"
        notes["act_bytes"] = f"{probe}: activation bytes per token, all layers + head (see header)"
        notes["act_fixed"] = f"{probe}: parameters + gradients of all layers + head, + the line's intercept"
        memory_text = [
            f"Memory ({m.how}), at two token counts, lines bytes = e*T + f:",
            f"  block kept for backward e={m.saved[0]:.1f} B/token (f={m.saved[1]:.4g} B); block backward peak "
            f"e={m.block_peak[0]:.1f}; head peak e={m.head_peak[0]:.1f} (f={m.head_peak[1]:.4g} B)",
            *([f"  cross-check, autograd's saved storages: e={m.live_saved[0]:.1f} B/token (f={m.live_saved[1]:.4g} B)"]
              if m.live_saved else []),
            f"  act_bytes = layers*{m.saved[0]:.1f} + max(head {m.head_peak[0]:.1f}, block transient {e_trans:.1f})"
            f" = {e:.4g} B/token (recompute={found['recompute']})",
            f"  act_fixed = layers*{m.layer_state / GiB:.4f} GiB + {m.other_state / GiB:.4f} GiB (parameters + "
            f"gradients as allocated) + {max(0.0, f - state) / GiB:.4f} GiB",
            "    (the line's intercept: what a forward keeps whatever the sequence's length) = "
            f"{f / GiB:.3f} GiB;",
            "    optimizer state not counted (ZeRO-1 over the HDP domain, as the base file assumes)",
        ]
        if device.type == "cuda" or args.device == "roofline":
            hbm = (HBM_BYTES[args.gpu] if args.device == "roofline"
                   else torch.cuda.get_device_properties(device).total_memory)
            free = 0.9 * hbm - 4 * GiB - f
            if free >= e:
                values["capacity"] = 2 ** int(math.log2(free / e))
                measured.append("capacity")
                notes["capacity"] = "derived: (0.9*HBM - 4 GiB - act_fixed) / act_bytes, power of two below"
                memory_text.append(f"  capacity = (0.9*{hbm / GiB:.1f} GiB - 4 GiB - act_fixed) / act_bytes = "
                                   f"{free / e:,.0f} tokens -> {values['capacity']} (power of two below)")
            else:
                notes["capacity"] = f"not derived (model state leaves no room: {free / GiB:.1f} GiB): kept from base"
                memory_text.append(f"  capacity: 0.9*HBM - 4 GiB - act_fixed = {free / GiB:.1f} GiB, no room: kept")
        else:
            notes["capacity"] = f"not derived (CPU: no device memory to fill): kept from {base_name}"
    else:
        for k in ("act_bytes", "act_fixed", "capacity"):
            notes[k] = f"not measured (budget): kept from {base_name}"
    if "host_bw" in found:
        h2d, d2h = found["host_bw"]
        values["host_bw"] = min(h2d, d2h)
        notes["host_bw"] = f"measured: pinned copies, slower direction (h2d {h2d / 1e9:.1f}, d2h {d2h / 1e9:.1f} GB/s)"
        measured.append("host_bw")
    else:
        why = {"cpu": "CPU: no host-device link", "roofline": "roofline: no device"}.get(args.device, "budget")
        notes["host_bw"] = f"not measured ({why}): kept from {base_name}"
    notes["name"] = "the --out file's name"

    if args.device == "roofline":
        device_name = (f"none: the roofline of {GPUS[args.gpu].name} (megalm/measure/op_cost.py) / "
                       f"{ROOFLINE_EFFICIENCY} (megalm-estimate's efficiency), traced on the CPU under FakeTensorMode")
        versions = f"torch {torch.__version__}"
    elif device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
        versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
        versions = f"torch {torch.__version__}"
    command = "python tools/bench/hdp_calibrate.py " + shlex.join(args.argv)
    kept = [k for k in KEYS if k not in measured and k not in TWO_GPU_KEYS
            and k not in ("layers", "kv_bytes", "qo_bytes", "heads", "source", "name")]
    how = {"roofline": f"DERIVED WITHOUT A GPU from the {args.gpu} roofline and megalm's memory probe",
           "cuda": "MEASURED on one GPU", "cpu": "MEASURED on the CPU"}[args.device]
    values["source"] = f"tools/bench/hdp_calibrate.py --device {args.device}, {datetime.date.today()} (see the header)"
    notes["source"] = "where these numbers come from (gpu_check's calibrate step replaces a roofline file)"
    header = [
        f"HDP cost model: {model.name} shape ({layers} layers, h={model.hidden_size}, {model.num_heads} heads, "
        f"{model.num_kv_heads} kv heads, ffn={model.ffn_hidden_size}, vocab {model.vocab_size}), {how} by "
        "tools/bench/hdp_calibrate.py (read by megalm.parallel.hdp.cost.CostModel.from_yaml).",
        f"Device: {device_name}; {versions}; {datetime.date.today().isoformat()}.",
        f"Command: {command}",
        f"One block run as the trainer runs it: precision={found['precision']} (compute {found['dtype']}), attention "
        f"backend {found['backend']}, recompute={found['recompute']}.",
        f"{'Derived' if args.device == 'roofline' else 'Measured'}: {', '.join(measured) or 'nothing'}. From the model "
        "config: layers, kv_bytes, qo_bytes, heads.",
        f"{', '.join(TWO_GPU_KEYS)}: not measured (one GPU; they need two GPUs or nodes), kept from {base_name}.",
        f"Also kept from {base_name}: {', '.join(kept)} (see each key's note).",
        "",
        "Per layer, a micro-batch of documents s_i on one rank takes  a*sum(s_i^2) + b*sum(s_i) + c  seconds.",
    ]
    if fit is not None:
        header += [f"Fit: {len(points)} points (forward + backward of one block, median of {args.repeats} after "
                   f"{args.warmup} warmup), non-negative least squares on relative error; residuals rms "
                   f"{fit.rms:.1%}, max {max(abs(r) for r in fit.relative_residuals):.1%}:",
                   f"  {'documents':>16} {'tokens':>7} {'sum_sq':>11} "
                   f"{'roofline ms' if args.device == 'roofline' else 'measured ms':>12} {'fit ms':>9} "
                   f"{'residual':>8} {'spread':>7}"]
        for p, r in zip(points, fit.relative_residuals, strict=True):
            header.append(f"  {p.label():>16} {p.tokens:>7} {p.sum_sq:>11.4g} {p.seconds * 1e3:>12.3f} "
                          f"{fit.predict(p.sum_sq, p.tokens) * 1e3:>9.3f} {r:>+8.1%} {p.spread:>7.1%}")
    else:
        header.append(f"Fit: not done, {len(points)} points measured within --budget-s {args.budget_s:g} (3 needed).")
    if "head" in found:
        _, times, toks = found["head"]
        header.append("Head (embedding + final norm + LM head + loss, fwd + bwd): "
                      + ", ".join(f"{n} tokens {t * 1e3:.3f} ms" for n, t in zip(toks, times, strict=True)))
    header += memory_text
    if found["skipped"]:
        header.append(f"Skipped: {'; '.join(found['skipped'])}.")
    header.append("")
    return values, notes, header, fit


def main(argv: list[str] | None = None) -> int:
    """Run the calibration; returns the exit code (0 written with a fit, 1 written without one, 2 bad input).
    The budget counts from the process start when run as a script, from this call otherwise."""
    started = _PROCESS_START if argv is None else time.monotonic()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, overrides = parse_args(argv)
        args.argv = argv
        check_out(args.out)
        base = load_base(args.base)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise BadInput("--device cuda but no CUDA device is visible (torch.cuda.is_available() is False); "
                           "use --device roofline (any model, no GPU) or --device cpu with a small model (model=tiny)")
        if args.device == "roofline":  # priced as the GPU runs it: bf16 unless precision= says otherwise
            precision = [] if any(o.startswith("precision=") for o in overrides) else ["precision=bf16"]
            cfg = compose_config(precision + overrides, "cpu")
        else:
            cfg = compose_config(overrides, args.device)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    device = torch.device("cpu" if args.device == "roofline" else args.device)
    backend = one_kernel_backend(cfg.model.attention_backend, device, compute_dtype(cfg.precision),
                                 dropout=cfg.model.attention_dropout > 0)
    if backend != cfg.model.attention_backend:
        print(f"model.attention_backend={backend}: auto would run cudnn here, whose documents of equal lengths (most "
              "design points) take another kernel than HDP's packed micro-batches and ring blocks", flush=True)
        cfg.model.attention_backend = backend
    clock = Clock(started, args.budget_s, reserve=min(3.0, 0.03 * args.budget_s))
    print(f"calibrating {cfg.model.name} on {args.device}: micro-batches up to {args.max_tokens} tokens, documents "
          f">= {args.min_doc}, budget {args.budget_s:g} s", flush=True)
    # --device roofline: sizes only, and an FP8 recipe's GEMMs and casts traced as the priced GPU runs them
    with contextlib.ExitStack() as stack:
        if args.device == "roofline":
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(compat.fp8_traced_as_gpu(GPUS[args.gpu].capability))
        found = measure(args, cfg, device, clock)
    values, notes, header, fit = derive(found, base, cfg, device, args, args.out)
    write_yaml(args.out, values, notes, header)
    n = len(found["points"])
    summary = ", ".join(f"{k}={values[k]:.4g}" + (f" ({values[k] / base[k]:.2f}x base)" if base.get(k) else "")
                        for k in ("a", "b", "c", "head", "act_bytes", "act_fixed", "host_bw"))
    print(f"attention backend {found['backend']}, precision {found['precision']}; {summary}; "
          f"capacity={values['capacity']}")
    if fit is None:
        print(f"error: only {n} points within --budget-s {args.budget_s:g}: a, b, c kept from {args.base}; "
              f"wrote {args.out} anyway; raise --budget-s", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {n} points fit, residuals rms {fit.rms:.1%}, {clock.elapsed():.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
