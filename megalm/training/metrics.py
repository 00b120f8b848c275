"""Where training metrics go: the console, `metrics.jsonl`, TensorBoard and Weights & Biases.

`metrics.jsonl` is the contract: one JSON object per logged step, appended and flushed as it is
written, so tests, scripts and plots read runs without TensorBoard. TensorBoard is used when
installed (or forced on); W&B only when `logging.wandb.enabled=true`, offline by default, so no
network call happens unless asked.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from megalm.config import LoggingConfig
from megalm.errors import ConfigError

log = logging.getLogger("megalm")
T = TypeVar("T")


def clock(seconds: float) -> str:
    """H:MM:SS."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


BATCH_SHARE_SHOWN = 0.05  # the console line names the batches' share of the time from this share up


def format_line(record: dict[str, Any], max_steps: int) -> str:
    """A concise console line: step and progress, loss (and its mean over the steps since the last line), lr,
    grad norm, throughput (and MFU, eval when known), elapsed time and the estimate of what is left."""
    parts = [f"step {record['step']:>{len(str(max_steps))}}/{max_steps} ({100 * record['step'] / max_steps:.0f}%)",
             f"loss {record['loss']:.4f}" + (f" (avg {record['loss_avg']:.4f})" if record.get("loss_avg") is not None
                                             and record["loss_avg"] != record["loss"] else "")]
    if "val_loss" in record:
        parts.append(f"val {record['val_loss']:.4f}")
    parts += [f"lr {record['lr']:.2e}", f"grad {record['grad_norm']:.3f}",
              f"{record['tokens_per_sec']:,.0f} tok/s"]
    if "params_norm" in record:  # logging.params_norm
        parts.append(f"params {record['params_norm']:.3f}")
    if "global_batch_size" in record:  # a batch ramp-up's (trainer.rampup_batch_size)
        parts.append(f"batch {record['global_batch_size']}")
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    if record.get("batch_share", 0) >= BATCH_SHARE_SHOWN:  # a run that waits on its input says so
        parts.append(f"batches {100 * record['batch_share']:.0f}% of the time")
    if "elapsed_sec" in record:
        eta = record.get("eta_sec")
        parts.append(f"{clock(record['elapsed_sec'])} elapsed" + (f", eta {clock(eta)}" if eta is not None else ""))
    return " | ".join(parts)


def check_logging_backends(cfg: LoggingConfig) -> None:
    """The logging backends asked for are installed: one-line ConfigErrors, checked with the config's other rules
    (`validate_run`), before a run dir is made and the model built."""
    if cfg.tensorboard is True and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard=true but tensorboard is not installed; "
                          "pip install tensorboard or set logging.tensorboard=false")
    if cfg.wandb.enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb.enabled=true but wandb is not installed; pip install wandb "
                          "or set logging.wandb.enabled=false")


class MetricsLogger:
    """Fan-out of metric records; only the process that owns it (rank 0) should create one."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, max_steps: int, config_dict: dict | None = None,
                 start_step: int = 0):
        """`start_step`: the step the run (re)starts from. A resumed run appends: the records of steps after it,
        which an earlier attempt logged before it stopped, stay in metrics.jsonl (megalm-plot draws the last
        attempt's), while TensorBoard drops them (its `purge_step`)."""
        check_logging_backends(cfg)  # (validate_run has: a logger built on its own checks again)
        self.max_steps = max_steps
        self.started = time.perf_counter()
        self._first: tuple[int, float] | None = None  # (step, time) of the first record: the rate's origin
        self._last_step = start_step  # the last record's step: `loss_avg` averages the steps after it
        self._alloc_retries = 0  # the CUDA allocator's retries last said (memory_metrics)
        self._bar = _terminal_bar(max_steps)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")  # noqa: SIM115 - open for the logger's lifetime, closed in close()
        if self._file.tell() and not _ends_with_newline(self.path):
            self._file.write("\n")  # a line torn by a crash stays a line of its own, not the start of the next record
        self._tb = self._open_tensorboard(run_dir, cfg.tensorboard, start_step)
        self._wandb = self._open_wandb(run_dir, cfg, config_dict) if cfg.wandb.enabled else None

    @staticmethod
    def _open_tensorboard(run_dir: Path, wanted: bool | None, start_step: int):
        if wanted is False or (wanted is None and importlib.util.find_spec("tensorboard") is None):
            return None
        from torch.utils.tensorboard import SummaryWriter

        purge = start_step + 1 if start_step else None  # the first step this attempt logs: later events are stale
        return SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=purge)

    @staticmethod
    def _open_wandb(run_dir: Path, cfg: LoggingConfig, config_dict: dict | None):
        import wandb

        os.environ.setdefault("WANDB_MODE", cfg.wandb.mode)
        return wandb.init(project=cfg.wandb.project, name=cfg.wandb.name, entity=cfg.wandb.entity,
                          dir=str(run_dir), mode=cfg.wandb.mode, config=config_dict)

    def log(self, record: dict[str, Any], step_losses: list[tuple[int, float]] | None = None) -> None:
        """Add progress (`progress`, `elapsed_sec`, `eta_sec`: from the rate since the first record, which a resumed
        run makes after its first step) and, given the run's (step, loss) pairs, `loss_avg`: the mean of the losses
        of the steps since the previous record (Megatron's lm loss, averaged over the log interval; a step skipped
        for a non-finite loss left out), and send the record everywhere."""
        now, step = time.perf_counter(), record["step"]
        if step_losses is not None:
            recent = [loss for s, loss in itertools.takewhile(lambda pair: pair[0] > self._last_step,
                                                              reversed(step_losses)) if math.isfinite(loss)]
            record = {**record, "loss_avg": math.fsum(recent) / len(recent) if recent else None}
        self._last_step = step
        if self._first is None:
            self._first = (step, now)
        first_step, first_time = self._first
        rate = (now - first_time) / (step - first_step) if step > first_step else None
        record = {**record, "progress": step / self.max_steps, "elapsed_sec": now - self.started,
                  "eta_sec": None if rate is None else rate * (self.max_steps - step)}
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
        log.info(format_line(record, self.max_steps))
        if record.get("alloc_retries", 0) > self._alloc_retries:  # said as the count grows, one line a record at most
            self._alloc_retries = record["alloc_retries"]
            log.warning(f"step {step}: the CUDA caching allocator has retried {self._alloc_retries} allocation(s) "
                        "since the start (it freed its cache to find the memory, a device-wide sync each: memory is "
                        "near full or fragmented); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, a smaller "
                        "trainer.micro_batch_size or more parallel.recompute avoids it")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = record["step"]
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(f"train/{key}", value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _terminal_bar(total: int):
    """A tqdm progress bar of the steps when stdout is a terminal (never in a log file or under a scheduler)."""
    if not sys.stdout.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="step", dynamic_ncols=True, leave=False)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def read_metrics(run_dir: Path | str) -> list[dict[str, Any]]:
    """All records of a run's metrics.jsonl, in order (a resumed run's earlier attempts included: megalm-plot draws
    the last one's, `megalm.plot.curves.last_attempt`)."""
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


class ThroughputWindow:
    """Tokens and model FLOPs since the last logged step: tokens/s, per GPU, and MFU over that window's training time
    (evaluation and checkpoint saves run `aside`, off its clock); and the host's time making the steps' batches, per
    step and as a share of that time (TorchTitan's data-loading time: a run that waits on its input shows it)."""

    def __init__(self, world_size: int, peak_flops: float | None):
        self.world_size, self.peak = world_size, peak_flops
        self.start, self.tokens, self.flops = time.perf_counter(), 0, 0.0
        self.steps, self.batch_seconds = 0, 0.0

    def aside(self, work: Callable[[], T]) -> T:
        """`work()`, its time left out of the window (the window's start moves later by it)."""
        began = time.perf_counter()
        try:
            return work()
        finally:
            self.start += time.perf_counter() - began

    def add(self, tokens: int, flops: float, batch_seconds: float = 0.0) -> None:
        """One step's tokens, model FLOPs and host time making its batches."""
        self.tokens += tokens
        self.flops += flops
        self.steps += 1
        self.batch_seconds += batch_seconds

    def close(self) -> dict[str, float]:
        """The window's rates (a metrics record's throughput fields); starts the next window."""
        now = time.perf_counter()
        elapsed = max(now - self.start, 1e-9)
        rates = {"tokens_per_sec": self.tokens / elapsed,
                 "tokens_per_sec_per_gpu": self.tokens / elapsed / self.world_size}
        if self.peak is not None:  # per GPU: global model FLOPs over all ranks' peak
            rates["mfu"] = self.flops / elapsed / (self.peak * self.world_size)
        if self.steps:  # this rank's (the logging rank's) batches
            rates |= {"batch_ms": 1e3 * self.batch_seconds / self.steps, "batch_share": self.batch_seconds / elapsed}
        self.start, self.tokens, self.flops = now, 0, 0.0
        self.steps, self.batch_seconds = 0, 0.0
        return rates


def memory_metrics(device: torch.device) -> dict[str, float]:
    """A metrics record's memory fields: `peak_memory_gib` (`peak_memory_gb`); on CUDA also the caching allocator's
    peak reserved memory (`peak_reserved_gib`: what the process holds from the GPU, fragmentation included) and its
    counts since the start of `alloc_retries` (allocations that succeeded only after the allocator freed its cache and
    retried: memory near full or fragmented, each retry a device-wide sync) and `ooms` (TorchTitan logs both)."""
    record = {"peak_memory_gib": peak_memory_gb(device)}
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        record |= {"peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30,
                   "alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0)}
    return record


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated device memory (GPU) or peak resident set size of the process (CPU), in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def run_lines(trainer: Any) -> list[str]:
    """What a run says when it starts (its logging rank): the model, precision, layout, data and run dir, and a batch
    ramp-up's sizes (`megalm/data/steps.py`)."""
    from megalm.model import GPT, num_parameters

    cfg = trainer.cfg
    n_params = num_parameters(GPT(cfg.model, device="meta"))
    lines = [f"model {cfg.model.name}: {n_params / 1e6:.2f}M parameters, {cfg.model.num_layers} layers | "
             f"{trainer.precision.note} on {trainer.device} | {trainer.parallel.describe()} | data {cfg.data.name} "
             f"({'varlen' if cfg.data.varlen else 'packed'}) | run dir {trainer.run_dir}"]
    if cfg.trainer.rampup_batch_size:  # (refused beside trainer.tokens_per_step)
        lines.append(trainer.train_steps.describe())
    if cfg.trainer.train_samples:
        lines.append(f"trainer.train_samples={cfg.trainer.train_samples}: {cfg.trainer.max_steps} steps, "
                     f"{trainer.train_steps.start(cfg.trainer.max_steps)} samples")
    return lines
