"""The training loop: one optimizer step = one global batch, accumulated over micro-batches.

A step, end to end (`Trainer.train_step`):
1. the global batch of `step` is a list of sample ids, a function of (seed, step) only;
2. `Parallelism.share_of_step` gives this rank its micro-batches of it (ready for the model) and the
   step's loss normaliser: the number of loss tokens in the whole global batch;
3. `Parallelism.forward_backward` runs them (each micro-batch's backward on loss_sum / n_tokens, so
   gradients accumulate to exactly the gradient of the global-batch mean) and reduces the gradients;
4. gradients are clipped by global norm, the schedule's lr is set, and AdamW steps.
The trainer does not know which layout runs: megalm/parallel/parallelism.py decides that, once.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megalm.config import MegalmConfig, config_to_dict
from megalm.data.build import build_datasets
from megalm.data.dataset import SampleDataset, TokenBudgetSteps
from megalm.errors import CheckpointError, ConfigError, MegalmError
from megalm.model import GPT, num_parameters
from megalm.parallel.dims import ParallelMesh, init_distributed
from megalm.parallel.microbatch import StepShare
from megalm.parallel.parallelism import Parallelism
from megalm.precision import Precision
from megalm.training import checkpoint as ckpt
from megalm.training.flops import peak_flops, training_flops
from megalm.training.metrics import MetricsLogger, ThroughputWindow
from megalm.training.optim import build_optimizer, lr_at, set_lr
from megalm.training.validation import validate_run

log = logging.getLogger("megalm")


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    tokens: int  # input tokens processed in the step
    flops: float  # model training FLOPs of the step


@dataclass
class TrainSummary:
    steps: int
    first_loss: float | None
    last_loss: float | None
    val_loss: float | None
    tokens: int
    seconds: float
    checkpoint: Path | None
    run_dir: Path
    losses: list[tuple[int, float]] = field(default_factory=list)


def select_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated device memory (GPU) or peak resident set size of the process (CPU), in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class Trainer:
    """Builds data, the parallel model and the optimizer from a config; `fit()` trains and checkpoints
    in `run_dir`. Under torchrun the layout comes from `cfg.parallel` (megalm/parallel/parallelism.py);
    `mesh` forces one (tests pass a one-rank mesh for the single-process reference in a distributed job).
    """

    def __init__(self, cfg: MegalmConfig, run_dir: Path | str, mesh: ParallelMesh | None = None):
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        self.device = select_device(cfg.trainer.device)
        world_size = mesh.dims.world_size if mesh is not None else init_distributed(self.device)[1]
        self.cfg = validate_run(cfg, world_size)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)  # the same on every rank: TP ranks must draw the same dropout masks

        self.data = build_datasets(cfg)  # before the model: a bad path or vocab fails before any weight is made
        self.precision = Precision(cfg.precision, cfg.seed, self.device)
        self.parallel = Parallelism(cfg, self.device, [self.precision], mesh)
        self.mesh, self.model = self.parallel.mesh, self.parallel.model
        self.optimizer = build_optimizer(self.model, cfg.optim, self.parallel.optimizer_factory)
        self.config_dict = config_to_dict(cfg)
        budget = cfg.trainer.tokens_per_step
        self.train_steps = TokenBudgetSteps(self.data.train, budget) if budget else None
        self.valid_steps = TokenBudgetSteps(self.data.valid, budget) if budget and self.data.valid else None
        self.step = 0
        self.consumed_tokens = 0
        self.resumed_from: Path | None = None
        self._maybe_resume()
        self.peak = peak_flops(self.device, cfg.precision.name)

    # ------------------------------------------------------------------ resume

    def _data_order(self) -> dict:
        """What fixes the samples of every step: a resumed run must have the same."""
        t = self.cfg.trainer
        return {"seed": self.cfg.seed, "global_batch_size": t.global_batch_size, "varlen": self.cfg.data.varlen,
                "tokens_per_step": t.tokens_per_step, "blend": self.data.blend}  # blend: [[weight, prefix], ...]

    def _maybe_resume(self) -> None:
        resume = self.cfg.trainer.resume
        own_latest = ckpt.latest_checkpoint(self.run_dir)
        if resume == "never":
            if own_latest is not None:
                raise CheckpointError(f"run dir {self.run_dir} already has checkpoints ({own_latest.name}); "
                                      "use trainer.resume=auto to continue it or choose a new hydra.run.dir")
            self._maybe_init_from()
            return
        path = own_latest if resume == "auto" else ckpt.resolve_checkpoint_path(resume)
        if path is None:
            self._maybe_init_from()
            return
        meta = ckpt.read_checkpoint_meta(path)
        if meta.state.get("weights_only"):
            raise CheckpointError(f"checkpoint {path} holds weights only (megalm-import); start from it with "
                                  f"model.init_from={path} instead of trainer.resume")
        if self.cfg.model.init_from:
            log.info(f"model.init_from={self.cfg.model.init_from} not used: resuming from {path}")
        ckpt.check_model_config(meta.config.get("model", {}), self.config_dict["model"], path)
        ckpt.check_same_data_order(meta.state, self._data_order(), path)
        ckpt.load_checkpoint(path, self.model, self.optimizer, self.mesh)
        self.step = meta.state["step"]
        self.consumed_tokens = meta.state["consumed_tokens"]
        if self.train_steps is not None:  # continue the step boundaries from the checkpoint's cursor
            self.train_steps = TokenBudgetSteps(self.data.train, self.cfg.trainer.tokens_per_step, self.step,
                                                meta.state["next_sample"])
        self.resumed_from = path
        log.info(f"resumed from {path} at step {self.step}")

    def _maybe_init_from(self) -> None:
        """A fresh run with `model.init_from`: replace the seed's initial weights by those weights (any layout)."""
        if not self.cfg.model.init_from:
            return
        from megalm.training.init_from import load_init_weights

        source = load_init_weights(self.cfg.model.init_from, self.model, self.config_dict["model"])
        log.info(f"model.init_from: weights from {source}")

    def save(self) -> Path:
        state = {"consumed_tokens": self.consumed_tokens, "tokenizer": getattr(self.data.tokenizer, "spec", None),
                 **self._data_order()}
        if self.train_steps is not None:
            state["next_sample"] = self.train_steps.start(self.step)
        return ckpt.save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, state,
                                    self.config_dict, self.cfg.trainer.keep_last, self.mesh)

    # ------------------------------------------------------------------ one step

    def step_sample_ids(self, step: int, dataset: SampleDataset | None = None) -> range:
        """The sample indices of global batch `step`: `global_batch_size` of them, or as many as fit
        `trainer.tokens_per_step` (a function of (seed, step) only, whatever the layout)."""
        t = self.cfg.trainer
        if t.tokens_per_step is None:
            return range(step * t.global_batch_size, (step + 1) * t.global_batch_size)
        is_valid = dataset is not None and dataset is self.data.valid
        return (self.valid_steps if is_valid else self.train_steps).ids(step)

    def forward_backward(self, step: int) -> tuple[torch.Tensor, StepShare]:
        """This rank's share of global batch `step`, its gradients accumulated and reduced; returns this
        rank's summed (unnormalised) loss and the share."""
        share = self.parallel.share_of_step(self.data.train, self.step_sample_ids(step), step)
        return self.parallel.forward_backward(share), share

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the full model's gradient (whatever the layout)."""
        return self.parallel.grad_norm()

    def train_step(self, step: int) -> StepResult:
        """One optimizer step on global batch `step` (0-based). Loss, tokens and FLOPs are global."""
        loss, share = self.forward_backward(step)
        grad_norm = self.parallel.clip_grad_norm_(self.cfg.trainer.grad_clip)
        lr = lr_at(step, self.cfg.optim, self.cfg.trainer.max_steps)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        counted = share.counted_doc_lengths
        fill = lambda value: torch.full((), value, dtype=torch.float64, device=self.device)  # a kernel, no copy
        local = torch.stack([loss.double(), fill(sum(counted)), fill(training_flops(self.cfg.model, counted))])
        totals = self.parallel.sum_over_batch(local)
        normaliser = torch.as_tensor(share.normaliser, dtype=torch.float64, device=self.device)
        # the step's one device-to-host sync: everything the log needs, read together
        loss_sum, tokens, flops, norm, n = torch.cat([totals, grad_norm.double().reshape(1), normaliser.reshape(1)]
                                                     ).tolist()
        return StepResult(loss=loss_sum / n, grad_norm=norm, lr=lr, tokens=int(tokens), flops=flops)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean per-token loss over the first `eval_iters` global batches of the validation split."""
        valid = self.data.valid
        if valid is None:
            return None
        loss, tokens = torch.zeros((), dtype=torch.float64, device=self.device), 0
        for i in range(self.cfg.trainer.eval_iters):
            share = self.parallel.share_of_step(valid, self.step_sample_ids(i, valid), i)
            loss += self.parallel.forward_loss(share).double()
            tokens += share.loss_tokens
        return (self.parallel.sum_over_batch(loss) / max(int(tokens), 1)).item()

    # ------------------------------------------------------------------ the loop

    def fit(self) -> TrainSummary:
        t = self.cfg.trainer
        stop_at = t.stop_at_step or t.max_steps
        main = self.mesh.is_logging_rank
        logger = MetricsLogger(self.run_dir, self.cfg.logging, t.max_steps, self.config_dict) if main else None
        if main:
            n_params = num_parameters(GPT(self.cfg.model, device="meta"))
            log.info(f"model {self.cfg.model.name}: {n_params / 1e6:.2f}M parameters, {self.cfg.model.num_layers} "
                     f"layers | {self.precision.note} on {self.device} | {self.parallel.describe()} | data "
                     f"{self.cfg.data.name} ({'varlen' if self.cfg.data.varlen else 'packed'}) | run dir "
                     f"{self.run_dir}")
        first_loss = last_loss = val_loss = None
        losses: list[tuple[int, float]] = []
        last_saved: Path | None = None
        start = time.perf_counter()
        window = ThroughputWindow(self.mesh.dims.world_size, self.peak)
        try:
            while self.step < stop_at:
                result = self.train_step(self.step)
                self.step += 1
                self.consumed_tokens += result.tokens
                window.add(result.tokens, result.flops)
                losses.append((self.step, result.loss))
                if not math.isfinite(result.loss):
                    raise MegalmError(f"loss became {result.loss} at step {self.step}; lower optim.lr or "
                                      "set trainer.grad_clip=1.0")
                evaluate = t.eval_interval > 0 and self.step % t.eval_interval == 0
                if evaluate:
                    val_loss = self.evaluate()
                if self.step == 1 or self.step % t.log_interval == 0 or evaluate or self.step == stop_at:
                    record = {"step": self.step, "loss": result.loss, "grad_norm": result.grad_norm,
                              "lr": result.lr, "tokens": self.consumed_tokens, **window.close(),
                              "peak_memory_gib": peak_memory_gb(self.device)}
                    if evaluate and val_loss is not None:
                        record["val_loss"] = val_loss
                    if logger is not None:
                        logger.log(record)
                    first_loss = result.loss if first_loss is None else first_loss
                    last_loss = result.loss
                if (t.save_interval and self.step % t.save_interval == 0) or self.step == stop_at:
                    last_saved = self.save()
        finally:
            if logger is not None:
                logger.close()
        summary = TrainSummary(steps=self.step, first_loss=first_loss, last_loss=last_loss, val_loss=val_loss,
                               tokens=self.consumed_tokens, seconds=time.perf_counter() - start,
                               checkpoint=last_saved, run_dir=self.run_dir, losses=losses)
        if main:
            self._log_summary(summary)
        return summary

    def _log_summary(self, s: TrainSummary) -> None:
        done = "finished" if s.steps >= self.cfg.trainer.max_steps else "stopped early"
        parts = [f"{done} at step {s.steps}/{self.cfg.trainer.max_steps} in {s.seconds:.1f}s"]
        if s.first_loss is not None:
            parts.append(f"loss {s.first_loss:.3f} -> {s.last_loss:.3f}")
        if s.val_loss is not None:
            parts.append(f"val loss {s.val_loss:.3f}")
        parts.append(f"peak memory {peak_memory_gb(self.device):.2f} GiB")
        log.info(" | ".join(parts))
        if s.checkpoint is not None:
            log.info(f"checkpoint: {s.checkpoint}")
            log.info(f"sample from it: megalm-generate {s.checkpoint} --prompt 'def '")
        log.info(f"metrics: {self.run_dir / 'metrics.jsonl'}")
