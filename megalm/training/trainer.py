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
import time
from pathlib import Path

import torch

from megalm.config import MegalmConfig, config_to_dict, process_group_minutes
from megalm.data.build import build_datasets
from megalm.data.dataset import SampleDataset
from megalm.data.steps import step_samples
from megalm.model import choose_attention_backends
from megalm.parallel.dims import ParallelMesh, init_distributed
from megalm.parallel.microbatch import StepShare
from megalm.parallel.parallelism import Parallelism
from megalm.precision import Precision
from megalm.training import checkpoint as ckpt
from megalm.training.compile import compile_blocks, compile_loss
from megalm.training.device import select_device
from megalm.training.expert_load import ExpertLoad
from megalm.training.flops import peak_flops, training_flops
from megalm.training.guards import NonFiniteError, NonFiniteGuard, SpikeDetector, check_finite_state
from megalm.training.init_from import load_init_weights
from megalm.training.metrics import MetricsLogger, ThroughputWindow, memory_metrics, peak_memory_gb, run_lines
from megalm.training.optim import build_optimizer, current_weights, lr_at, set_lr
from megalm.training.preemption import Preemption
from megalm.training.profiling import StepProfiler
from megalm.training.python_gc import StepBoundaryGC
from megalm.training.results import StepResult, TrainSummary
from megalm.training.validation import note_evaluation_split, validate_run
from megalm.training.watchdog import Watchdog, joining_watchdog

log = logging.getLogger("megalm")


class Trainer:
    """Builds data, the parallel model and the optimizer from a config; `fit()` trains and checkpoints
    in `run_dir`. Under torchrun the layout comes from `cfg.parallel` (megalm/parallel/parallelism.py);
    `mesh` forces one (tests pass a one-rank mesh for the single-process reference in a distributed job).
    """

    def __init__(self, cfg: MegalmConfig, run_dir: Path | str, mesh: ParallelMesh | None = None):
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        self.device = select_device(cfg.trainer.device)
        self.preemption = Preemption(cfg.trainer.preempt_signals, self.device, distributed=False,
                                     exit_minutes=cfg.trainer.exit_duration_minutes)
        self.run_dir = Path(run_dir)
        # Joining the job is watched too: a rank stuck in the rendezvous or in building the groups is reported
        # (and exits 124 for the launcher to restart) within trainer.init_hang_minutes, not at the group timeout.
        with joining_watchdog(cfg.trainer.init_hang_minutes, self.run_dir) as joining:
            rank, world_size = (mesh.rank, mesh.dims.world_size) if mesh is not None else init_distributed(
                self.device, process_group_minutes(cfg), cfg.parallel.fsdp_cpu_offload,
                cfg.parallel.flight_recorder_entries)
            # a resolved copy (precision=auto: this device); its warnings said by rank 0 alone, as every rank has them
            self.cfg = cfg = validate_run(cfg, world_size, self.device, warn=rank == 0)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            torch.manual_seed(cfg.seed)  # reseeded per pipeline stage once the mesh is known (random_seed)

            self.data = build_datasets(cfg)  # before the model: a bad path or vocab fails before any weight is made
            self.precision = Precision(cfg.precision, cfg.seed, self.device)
            joining.progress.note(collective="building the mesh's process groups and the model, checking the "
                                             "config on every rank")
            # drawing the weights is progress: a large stage's full tensors take minutes on one CPU thread
            self.parallel = Parallelism(cfg, self.device, [self.precision], mesh, progress=joining.beat)
        self.mesh, self.model = self.parallel.mesh, self.parallel.model
        torch.manual_seed(self.parallel.random_seed(cfg.seed))  # this rank's dropout stream
        # chosen (and logged) once, before any forward: a compiled block's trace holds no selection
        choose_attention_backends(self.model, self.device, self.precision.compute_dtype)
        if cfg.trainer.compile:
            compile_blocks(self.model, cfg.trainer.compile_backend, self.parallel.inductor_config)
            compile_loss(self.parallel.loss_fn, cfg.trainer.compile_backend)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.parallel)
        self.parallel.watch_optimizer(self.optimizer)  # quantized weights: made once per optimizer step
        self.expert_load = ExpertLoad(self.model, cfg.model)  # MoE: load, drops, balancing losses, bias updates
        self.config_dict = config_to_dict(cfg)
        # which samples each step takes (megalm/data/steps.py); validation batches are whole, never ramped
        self.train_steps = step_samples(cfg.trainer, self.data.train)
        self.valid_steps = step_samples(cfg.trainer, self.data.valid, rampup=False) if self.data.valid else None
        self.step, self.consumed_tokens, self.resumed_from = 0, 0, None  # resumed_from: the checkpoint's path
        self.checkpointer = ckpt.Checkpointer(self.run_dir, cfg.trainer.keep_last, self.mesh, cfg.trainer.async_save)
        self.preemption.distributed = self.mesh.is_distributed
        self.nonfinite = NonFiniteGuard(cfg.trainer.nonfinite, cfg.trainer.max_consecutive_skips)
        self.spikes = SpikeDetector(cfg.trainer.spike_window, cfg.trainer.spike_zscore)
        self.watchdog = Watchdog(cfg.trainer.hang_minutes * 60, self.mesh.rank, self.run_dir,
                                 progress=self.mesh.progress, groups=self.mesh.groups())
        self._maybe_resume()
        self.peak = peak_flops(self.device, cfg.precision.name)

    # ------------------------------------------------------------------ resume

    def _maybe_resume(self) -> None:
        """Continue from a checkpoint (`trainer.resume`); a fresh run starts from `model.init_from` when set."""
        resume = self.cfg.trainer.resume
        ckpt.latest_unless_never(self.run_dir, resume)
        if resume == "never" or (path := ckpt.resumable_checkpoint(self.run_dir, resume)) is None:
            if self.cfg.model.init_from:  # weights from elsewhere, any layout (megalm/training/init_from.py)
                where = load_init_weights(self.cfg.model.init_from, self.model, self.config_dict["model"],
                                          self.optimizer, getattr(self.data.tokenizer, "spec", None), self.mesh)
                log.info(f"model.init_from: weights from {where}")
            return
        meta = ckpt.read_checkpoint_meta(path)
        step = meta.state["step"]
        explicit = ckpt.resumes_as_named(resume, path)
        ckpt.check_resume_target(path, step, self.cfg.trainer, self.run_dir, explicit=explicit)
        if self.cfg.model.init_from:
            log.info(f"model.init_from={self.cfg.model.init_from} not used: resuming from {path}")
        ckpt.check_model_config(meta.config.get("model", {}), self.config_dict["model"], path)
        data = {**ckpt.data_order(self.cfg, self.data.blend), **ckpt.data_size(self.data.train, self.data.valid)}
        ckpt.check_same_data_order(meta.state, data, path)
        if self.mesh.is_logging_rank:  # what a resume only notes: once, not once per rank
            ckpt.note_function_change(meta.config.get("model", {}), self.config_dict["model"], path)
            ckpt.note_precision_change(meta.config.get("precision", {}), self.config_dict["precision"], path)
            ckpt.note_schedule_change(meta.config, self.cfg, step, path, self.train_steps)
            ckpt.note_data_change(meta.state, data, path)
        ckpt.load_checkpoint(path, self.model, self.optimizer, self.mesh, self.device)
        self.step, self.consumed_tokens = step, meta.state["consumed_tokens"]
        self.nonfinite.load_state_dict(meta.state)
        if self.cfg.trainer.tokens_per_step:  # continue the budget's step boundaries from the checkpoint's cursor
            self.train_steps = step_samples(self.cfg.trainer, self.data.train, self.step, meta.state["next_sample"])
        self.resumed_from = path
        log.info(f"resumed from {path} at step {self.step}")

    def save(self) -> Path:
        """A checkpoint of this step; refused (one line) when any weight or optimizer state is not finite."""
        self.finish_save()  # published before anything can fail
        check_finite_state(self.model, self.optimizer, self.step, self.device, self.mesh.is_distributed)
        tokenizer = self.data.tokenizer
        state = {"consumed_tokens": self.consumed_tokens, "tokenizer": getattr(tokenizer, "spec", None),
                 "tokenizer_vocab_size": getattr(tokenizer, "vocab_size", None), **self.nonfinite.state_dict(),
                 **ckpt.data_order(self.cfg, self.data.blend), **ckpt.data_size(self.data.train, self.data.valid)}
        state["next_sample"] = self.train_steps.start(self.step)  # a token budget's resume reads it
        return self.checkpointer.save(self.step, self.model, self.optimizer, state, self.config_dict)

    def finish_save(self) -> None:
        """Publish the save in flight, finish ZeRO-1's overlapped gather: every rank, before a save and at the end."""
        current_weights(self.optimizer)
        self.checkpointer.finish()

    # ------------------------------------------------------------------ one step

    def step_sample_ids(self, step: int, dataset: SampleDataset | None = None) -> range:
        """The sample indices of global batch `step`: `global_batch_size` of them (or its ramp-up's), or as many as
        fit `trainer.tokens_per_step` (a function of (seed, step) only, whatever the layout)."""
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
        """One optimizer step on global batch `step` (0-based). Loss, tokens and FLOPs are global. A step whose loss
        or grad norm is not finite skips its update (`trainer.nonfinite`, megalm/training/guards.py)."""
        loss, share = self.forward_backward(step)
        # the clip's scale goes into a fused AdamW's step (`optimizer.grad_scale`), or onto the gradients
        grad_norm = self.parallel.clip_grad_norm_(self.cfg.trainer.grad_clip, self.optimizer)
        try:
            counted = share.counted_doc_lengths
            fill = lambda value: torch.full((), value, dtype=torch.float64, device=self.device)  # a kernel, no copy
            local = torch.cat([torch.stack([loss.double(), fill(sum(counted)),
                                            fill(training_flops(self.cfg.model, counted))]),
                               self.parallel.sum_over_sequence_shards(self.expert_load.take(self.device))])
            totals = self.parallel.sum_over_batch(local)
            normaliser = torch.as_tensor(share.normaliser, dtype=torch.float64, device=self.device)
            loads = self.parallel.rank_loads(share)  # HDP: the tokens each rank of the domain ran; else empty
            stop = self.preemption.reduced_flag()  # any rank's signal, agreed on the device (empty: none to agree on)
            # the step's one device-to-host sync: all the log, the guard and the preemption check need, read together
            values = torch.cat([totals, grad_norm.double().reshape(1), normaliser.reshape(1), loads, stop]).tolist()
            (loss_sum, tokens, flops), moe = values[:3], values[3:len(totals)]
            norm, n, *rank_tokens = values[len(totals):len(values) - len(stop)]
            preempt = values[-1] if len(stop) else None
            lr = lr_at(step, self.cfg.optim, self.cfg.trainer.max_steps, self.train_steps)
            skipped = self.nonfinite.should_skip(step + 1, loss_sum / n, norm)
            if not skipped:
                set_lr(self.optimizer, lr)
                self.optimizer.step()
                self.expert_load.update_bias(totals[3:])
            self.optimizer.zero_grad(set_to_none=True)
        finally:  # spent by the step, or dropped with it (also when the guard raises)
            self.optimizer.grad_scale = None
        return StepResult(loss=loss_sum / n, grad_norm=norm, lr=lr, tokens=int(tokens), flops=flops, skipped=skipped,
                          rank_tokens=[int(x) for x in rank_tokens], moe=self.expert_load.record(moe, n),
                          preempt=preempt, batch_seconds=share.host_seconds)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean per-token loss over the first `eval_iters` global batches of the validation split."""
        valid = self.data.valid
        if valid is None:
            return None
        loss, tokens = torch.zeros((), dtype=torch.float64, device=self.device), 0
        for i in range(self.cfg.trainer.eval_iters):
            self.watchdog.beat()  # batch by batch: trainer.hang_minutes bounds one batch, not the whole evaluation
            share = self.parallel.share_of_step(valid, self.step_sample_ids(i, valid), i)
            loss += self.parallel.forward_loss(share).double()
            tokens += share.loss_tokens
        return (self.parallel.sum_over_batch(loss) / max(int(tokens), 1)).item()

    # ------------------------------------------------------------------ the loop

    def fit(self) -> TrainSummary:
        t = self.cfg.trainer
        stop_at = t.stop_at_step or t.max_steps
        main = self.mesh.is_logging_rank
        logger = MetricsLogger(self.run_dir, self.cfg.logging, t.max_steps, self.config_dict,
                               self.step) if main else None
        if main:
            for line in run_lines(self):
                log.info(line)
            if t.eval_interval > 0:
                valid = self.data.valid
                note_evaluation_split(self.cfg, valid, self.step_sample_ids(t.eval_iters - 1, valid).stop if valid
                                      else 0)
        val_loss = last_saved = None
        losses: list[tuple[int, float]] = []
        start, preempted = time.perf_counter(), False
        collector = StepBoundaryGC(t.gc_interval)  # Python's GC between steps only, while training
        profiler = StepProfiler(self.cfg, self.run_dir, self.mesh.rank, self.device, self.step)
        with self.preemption, self.watchdog, collector, profiler:  # signals, hangs and profiles: while training only
            window = ThroughputWindow(self.mesh.dims.world_size, self.peak)  # after the collector's first collection
            try:
                while self.step < stop_at:
                    self.watchdog.beat(self.step + 1)
                    profiler.before_step(self.step)
                    result = self.train_step(self.step)
                    window.aside(lambda: profiler.after_step(self.step))  # a profile's files: written off the clock
                    self.step += 1
                    collector.after_step(self.step)
                    window.aside(self.checkpointer.publish_if_written)  # an async save written: `latest` names it
                    self.consumed_tokens += result.tokens
                    window.add(result.tokens, result.flops, result.batch_seconds)
                    losses.append((self.step, result.loss))
                    self.spikes.check(result.loss, self.step, self.step_sample_ids(self.step - 1))
                    evaluate = t.eval_interval > 0 and (self.step % t.eval_interval == 0 or self.step == stop_at)
                    if evaluate:  # eval and save off the throughput window's clock (Megatron stops its timer too)
                        val_loss = window.aside(self.evaluate)
                        self.watchdog.beat(self.step + 1)
                    if self.step == 1 or self.step % t.log_interval == 0 or evaluate or self.step == stop_at:
                        record = {"step": self.step, "loss": result.loss, "grad_norm": result.grad_norm,
                                  "lr": result.lr, "tokens": self.consumed_tokens, **window.close(),
                                  **memory_metrics(self.device),
                                  **({"hdp_rank_tokens": result.rank_tokens} if result.rank_tokens else {}),
                                  **({"global_batch_size": len(self.step_sample_ids(self.step - 1))}
                                     if t.rampup_batch_size else {}),
                                  **({"params_norm": window.aside(lambda: self.parallel.weight_norm(
                                      self.optimizer).item())} if self.cfg.logging.params_norm else {}),
                                  **result.moe}
                        if self.nonfinite.skipped_steps:
                            record["skipped_steps"] = len(self.nonfinite.skipped_steps)
                        if evaluate and val_loss is not None:
                            record["val_loss"] = val_loss
                        if logger is not None:
                            logger.log(record, losses)  # (and the mean of the step losses since the last record)
                    saved = (t.save_interval and self.step % t.save_interval == 0) or self.step == stop_at
                    if saved:
                        last_saved = window.aside(self.save)
                        self.watchdog.beat(self.step + 1)
                    if evaluate or saved:  # one full collection at this boundary, where every rank waited anyway
                        window.aside(collector.full)  # off the clock with them: 0.24 s dipped tokens/s tenfold
                    # the step's read, and again where it evaluated or saved (a signal during either stops now)
                    if self.step < stop_at and (self.preemption.requested(result.preempt) or (
                            (evaluate or saved) and self.preemption.agreed_now())):
                        last_saved, preempted = last_saved if saved else self.save(), True
                        self.preemption.log_stop(self.step, last_saved)
                        break
                self.finish_save()
            except NonFiniteError:  # decided on all-reduced values: every rank is here, the publish is safe
                self.finish_save()
                raise
            finally:
                if logger is not None:
                    logger.close()
        summary = TrainSummary(steps=self.step, val_loss=val_loss, tokens=self.consumed_tokens,
                               seconds=time.perf_counter() - start, checkpoint=last_saved, run_dir=self.run_dir,
                               losses=losses, preempted=preempted, has_tokenizer=self.data.tokenizer is not None)
        if main:
            for line in summary.lines(t.max_steps, peak_memory_gb(self.device)):
                log.info(line)
        return summary
