"""The training loop: one optimizer step = one global batch, accumulated over micro-batches.

A step, end to end (`Trainer.train_step`):
1. the global batch for `step` is drawn from (seed, step) only (`data.dataset.global_batch`);
2. it is split into packed micro-batches, and the loss normaliser is the number of loss tokens
   in the whole global batch (`training.loss`);
3. each micro-batch runs forward under the precision recipe and backward on loss_sum / n_tokens,
   so gradients accumulate to exactly the gradient of the global-batch mean;
4. gradients are clipped by global norm, the schedule's lr is set, and AdamW steps.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megalm.config import MegalmConfig, config_to_dict, validate
from megalm.data.batch import Sample
from megalm.data.dataset import build_datasets, global_batch, loss_token_count, micro_batches
from megalm.errors import CheckpointError, ConfigError, MegalmError
from megalm.model import GPT, init_weights
from megalm.precision import autocast
from megalm.training import checkpoint as ckpt
from megalm.training.flops import peak_flops, training_flops
from megalm.training.loss import token_loss_sum
from megalm.training.metrics import MetricsLogger
from megalm.training.optim import build_optimizer, lr_at, set_lr

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
    """Builds data, model and optimizer from a config; `fit()` trains and checkpoints in `run_dir`."""

    def __init__(self, cfg: MegalmConfig, run_dir: Path | str):
        # torchrun sets WORLD_SIZE; until the parallel layers land, several processes are refused
        # instead of silently training independent copies into one run dir.
        self.cfg = validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        self.device = select_device(cfg.trainer.device)
        torch.manual_seed(cfg.seed)

        self.data = build_datasets(cfg)
        self.model = GPT(cfg.model, device=self.device)
        init_weights(self.model, cfg.seed)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.config_dict = config_to_dict(cfg)
        self.step = 0
        self.consumed_tokens = 0
        self.resumed_from: Path | None = None
        self._maybe_resume()
        self.peak = peak_flops(self.device, cfg.precision.name)

    # ------------------------------------------------------------------ resume

    def _maybe_resume(self) -> None:
        resume = self.cfg.trainer.resume
        own_latest = ckpt.latest_checkpoint(self.run_dir)
        if resume == "never":
            if own_latest is not None:
                raise CheckpointError(f"run dir {self.run_dir} already has checkpoints ({own_latest.name}); "
                                      "use trainer.resume=auto to continue it or choose a new hydra.run.dir")
            return
        path = own_latest if resume == "auto" else ckpt.resolve_checkpoint_path(resume)
        if path is None:
            return
        meta = ckpt.read_checkpoint_meta(path)
        ckpt.check_model_config(meta.config.get("model", {}), self.config_dict["model"], path)
        for key, current in (("seed", self.cfg.seed), ("global_batch_size", self.cfg.trainer.global_batch_size),
                             ("varlen", self.cfg.data.varlen)):
            if meta.state.get(key) != current:
                raise CheckpointError(f"checkpoint {path} was trained with {key}={meta.state.get(key)}, this run "
                                      f"has {current}; resuming would change the data order — set it back or "
                                      "start a new hydra.run.dir")
        ckpt.load_checkpoint(path, self.model, self.optimizer)
        self.step = meta.state["step"]
        self.consumed_tokens = meta.state["consumed_tokens"]
        self.resumed_from = path
        log.info(f"resumed from {path} at step {self.step}")

    def save(self) -> Path:
        state = {"consumed_tokens": self.consumed_tokens, "seed": self.cfg.seed,
                 "global_batch_size": self.cfg.trainer.global_batch_size, "varlen": self.cfg.data.varlen,
                 "tokenizer": getattr(self.data.tokenizer, "spec", None)}
        return ckpt.save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, state,
                                    self.config_dict, self.cfg.trainer.keep_last)

    # ------------------------------------------------------------------ one step

    def forward_backward(self, samples: list[Sample], n_loss_tokens: int) -> tuple[torch.Tensor, int, float]:
        """Accumulate gradients of sum(token losses) / n_loss_tokens over the samples' micro-batches.

        Returns the summed (unnormalised) loss, the input tokens processed and their model FLOPs.
        """
        t = self.cfg.trainer
        loss_total = torch.zeros((), device=self.device)
        tokens, flops = 0, 0.0
        self.model.train()
        for mb in micro_batches(samples, t.micro_batch_size):
            mb = mb.to(self.device)
            with autocast(self.cfg.precision.name, self.device):
                logits = self.model(mb.tokens, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
            loss_sum = token_loss_sum(logits, mb.labels, mb.loss_mask)
            (loss_sum / n_loss_tokens).backward()
            loss_total += loss_sum.detach()
            tokens += mb.num_tokens
            flops += training_flops(self.cfg.model, mb.doc_lengths)
        return loss_total, tokens, flops

    def optimizer_step(self, step: int) -> tuple[float, float]:
        """Clip by global grad norm, set the schedule's lr, step AdamW. Returns (grad_norm, lr)."""
        t = self.cfg.trainer
        max_norm = t.grad_clip if t.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        lr = lr_at(step, self.cfg.optim, t.max_steps)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.item(), lr

    def train_step(self, step: int) -> StepResult:
        """One optimizer step on global batch `step` (0-based)."""
        samples = global_batch(self.data.train, step, self.cfg.trainer.global_batch_size)
        n_loss_tokens = max(loss_token_count(samples), 1)
        loss_total, tokens, flops = self.forward_backward(samples, n_loss_tokens)
        grad_norm, lr = self.optimizer_step(step)
        return StepResult(loss=(loss_total / n_loss_tokens).item(), grad_norm=grad_norm, lr=lr,
                          tokens=tokens, flops=flops)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean per-token loss over the first `eval_iters` global batches of the validation split."""
        if self.data.valid is None:
            return None
        t = self.cfg.trainer
        self.model.eval()
        loss_total, n_tokens = 0.0, 0
        for i in range(t.eval_iters):
            samples = global_batch(self.data.valid, i, t.global_batch_size)
            for mb in micro_batches(samples, t.micro_batch_size):
                mb = mb.to(self.device)
                with autocast(self.cfg.precision.name, self.device):
                    logits = self.model(mb.tokens, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
                loss_total += token_loss_sum(logits, mb.labels, mb.loss_mask).item()
            n_tokens += loss_token_count(samples)
        self.model.train()
        return loss_total / max(n_tokens, 1)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> TrainSummary:
        t = self.cfg.trainer
        stop_at = t.stop_at_step or t.max_steps
        logger = MetricsLogger(self.run_dir, self.cfg.logging, t.max_steps, self.config_dict)
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info(f"model {self.cfg.model.name}: {n_params / 1e6:.2f}M parameters, {self.cfg.model.num_layers} "
                 f"layers | {self.cfg.precision.name} on {self.device} | data {self.cfg.data.name} "
                 f"({'varlen' if self.cfg.data.varlen else 'packed'}) | run dir {self.run_dir}")
        first_loss = last_loss = val_loss = None
        losses: list[tuple[int, float]] = []
        last_saved: Path | None = None
        start = time.perf_counter()
        window_start, window_tokens, window_flops = start, 0, 0.0
        try:
            while self.step < stop_at:
                result = self.train_step(self.step)
                self.step += 1
                self.consumed_tokens += result.tokens
                window_tokens += result.tokens
                window_flops += result.flops
                losses.append((self.step, result.loss))
                if not math.isfinite(result.loss):
                    raise MegalmError(f"loss became {result.loss} at step {self.step}; lower optim.lr or "
                                      "set trainer.grad_clip=1.0")
                evaluate = t.eval_interval > 0 and self.step % t.eval_interval == 0
                if evaluate:
                    val_loss = self.evaluate()
                if self.step == 1 or self.step % t.log_interval == 0 or evaluate or self.step == stop_at:
                    now = time.perf_counter()
                    elapsed = max(now - window_start, 1e-9)
                    record = {"step": self.step, "loss": result.loss, "grad_norm": result.grad_norm,
                              "lr": result.lr, "tokens": self.consumed_tokens,
                              "tokens_per_sec": window_tokens / elapsed,
                              "peak_memory_gib": peak_memory_gb(self.device)}
                    if self.peak is not None:
                        record["mfu"] = window_flops / elapsed / self.peak
                    if evaluate and val_loss is not None:
                        record["val_loss"] = val_loss
                    logger.log(record)
                    first_loss = result.loss if first_loss is None else first_loss
                    last_loss = result.loss
                    window_start, window_tokens, window_flops = now, 0, 0.0
                if (t.save_interval and self.step % t.save_interval == 0) or self.step == stop_at:
                    last_saved = self.save()
        finally:
            logger.close()
        seconds = time.perf_counter() - start
        summary = TrainSummary(steps=self.step, first_loss=first_loss, last_loss=last_loss, val_loss=val_loss,
                               tokens=self.consumed_tokens, seconds=seconds, checkpoint=last_saved,
                               run_dir=self.run_dir, losses=losses)
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
