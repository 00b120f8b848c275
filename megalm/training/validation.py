"""Every config rule of a run, each package checking its own section.

`megalm.config.validate` owns the model, trainer, optim, data and logging sections; the precision
package checks `precision` (`validate_precision`; `precision=auto` is resolved first, against the run's device:
megalm/training/device.py), the parallel package the layout against the world
size (`validate_parallel`), the offload package `offload` (`validate_offload`). This is the one place
that runs them all, above every package it asks.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator

import torch

from megalm.config import MegalmConfig, validate
from megalm.data.dataset import SampleDataset
from megalm.errors import ConfigError
from megalm.model import select_attention_backend
from megalm.offload import validate_offload
from megalm.parallel.parallelism import triton_adamw_refusal, validate_parallel
from megalm.parallel.recompute import recompute_modes
from megalm.precision import compute_dtype, validate_precision, working_dtype
from megalm.training.compile import resolve_auto_compile, validate_compile
from megalm.training.device import resolve_auto_precision
from megalm.training.metrics import check_logging_backends
from megalm.training.preemption import signal_numbers
from megalm.training.profiling import validate_profiling


def validate_run(cfg: MegalmConfig, world_size: int = 1, device: torch.device | None = None,
                 warn: bool = True) -> MegalmConfig:
    """Check every rule for a run on `world_size` processes. Returns a resolved copy: derived defaults filled
    (model sizes, `parallel.dp`, `parallel.hdp_capacity`) and `precision=auto` resolved against the run's
    `device` (default, for tools that only check a config: the GPU here if `trainer.device` allows one, else the
    CPU; the attention backend is checked against a `device` given only), so no rule sees "auto". The config
    passed in is left as it was (the package validators below fill the copy); `trainer.compile=null` (auto)
    likewise, after the precision (megalm/training/compile.py).
    `warn=False` keeps the rules' warnings and notes unsaid (errors still raise): a run checked twice (megalm-train
    checks before Hydra makes the run dir, the trainer again) says them once, and on rank 0 only."""
    with _said(warn):
        return _validate_run(copy.deepcopy(cfg), world_size, device)


@contextlib.contextmanager
def _said(warn: bool) -> Iterator[None]:
    """megalm's log (its child loggers' too: they inherit its level) above WARNING while the rules run, unless
    `warn`."""
    log = logging.getLogger("megalm")
    level = log.level
    if not warn:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _validate_run(cfg: MegalmConfig, world_size: int, device: torch.device | None) -> MegalmConfig:
    on_its_device = device is not None  # a run's check (a tool's may name a GPU's attention kernel on a laptop)
    if device is None:
        device = torch.device("cuda" if cfg.trainer.device != "cpu" and torch.cuda.is_available() else "cpu")
    resolve_auto_precision(cfg, device)
    resolve_auto_compile(cfg, device)  # after the precision: what compiles depends on the recipe
    validate(cfg)
    validate_parallel(cfg, world_size)
    validate_precision(cfg)
    validate_offload(cfg)
    validate_compile(cfg)
    signal_numbers(cfg.trainer.preempt_signals)  # a bad name is refused before Hydra makes the run dir
    check_logging_backends(cfg.logging)  # so is a logger that is not installed (it was refused after the build)
    validate_profiling(cfg, world_size)
    # the rules the build checks again, said here too so that megalm-train refuses them before Hydra makes a run dir
    if on_its_device:
        select_attention_backend(cfg.model.attention_backend, device, compute_dtype(cfg.precision),
                                 dropout=cfg.model.attention_dropout > 0, window=cfg.model.sliding_window is not None)
    if device.type == "cuda" and cfg.model.attention_dropout > 0 and "selective" in recompute_modes(
            cfg.parallel.recompute, cfg.parallel.pp):
        logging.getLogger("megalm").info(
            "parallel.recompute=selective runs the attention kernels again in backward under model.attention_dropout>0"
            " (each draws its mask from the generator the recompute restores; kept, the dropouts after it would draw "
            "other masks): slower than selective without attention dropout")
    if cfg.optim.implementation == "triton" and not cfg.parallel.zero1 and (
            cfg.parallel.fsdp or working_dtype(cfg.precision) is None):
        raise ConfigError(triton_adamw_refusal(cfg.parallel.fsdp))
    if cfg.optim.name == "muon" and cfg.parallel.fsdp:
        raise ConfigError("optim.name=muon orthogonalises whole matrices, which parallel.fsdp=true cuts across the "
                          "data-parallel ranks; use parallel.zero1=true with it (the optimizer sharded by whole "
                          "parameters: megalm/parallel/data_parallel/layerwise.py)")
    if cfg.optim.name == "muon" and cfg.parallel.zero1 and cfg.optim.implementation == "triton":
        raise ConfigError("optim.implementation=triton steps AdamW's ZeRO-1 shards; under optim.name=muon ZeRO-1 "
                          "shards by whole matrices and steps them with torch's AdamW: use optim.implementation=auto")
    if cfg.parallel.fsdp_cpu_offload and device.type != "cuda":
        raise ConfigError("parallel.fsdp_cpu_offload=true moves FSDP's shards from the GPU to the host; on "
                          f"{device.type} they are there already: drop it")
    return cfg


def note_evaluation_split(cfg: MegalmConfig, valid: SampleDataset | None, samples_read: int) -> None:
    """One warning line when `trainer.eval_interval` evaluates nothing (no validation split), or when each evaluation
    reads `samples_read` samples of a split that holds fewer (the rest come round again: scored more than once)."""
    t, log = cfg.trainer, logging.getLogger("megalm")
    if valid is None:
        log.warning(f"trainer.eval_interval={t.eval_interval}: there is no validation split (data.valid_fraction="
                    f"{cfg.data.valid_fraction}); raise it, or set trainer.eval_interval=0")
    elif samples_read > valid.samples_per_epoch:
        held, per_iteration = valid.samples_per_epoch, -(-samples_read // t.eval_iters)  # (a token budget's vary)
        fits = held // per_iteration  # evaluation iterations the split surely holds: fewer than eval_iters
        lower = f"trainer.eval_iters={fits} (now {t.eval_iters}) or " if fits else ""
        needed = cfg.data.valid_fraction * samples_read / held  # (the split grows about in proportion)
        more = (f"data.valid_fraction to about {needed:.2g} or more (now {cfg.data.valid_fraction})" if needed < 1
                else "more documents (no data.valid_fraction below 1 holds the reads)")
        log.warning(f"each evaluation reads {samples_read} validation samples, and the split holds {held}: "
                    f"{samples_read - held} of them score samples again; set {lower}{more}")
