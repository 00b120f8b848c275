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
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megalm.config import MegalmConfig, config_to_dict, validate
from megalm.data.batch import PackedBatch, Sample
from megalm.data.dataset import SampleDataset, TokenBudgetSteps, build_datasets, loss_token_count, micro_batches
from megalm.errors import CheckpointError, ConfigError, MegalmError
from megalm.model import GPT, init_weights, num_parameters
from megalm.parallel.context import shard_batch, zigzag_plan
from megalm.parallel.data import GradReducer, build_zero1_optimizer
from megalm.parallel.dims import ParallelDims, ParallelMesh, build_mesh, init_distributed
from megalm.parallel.hdp_cost import CostModel, ModelShape, load_cost, preset
from megalm.parallel.hdp_runtime import HdpRuntime, Ring, apply_hdp_attention, bind_ring
from megalm.parallel.parallelize import (
    apply_context_parallel,
    apply_tensor_parallel,
    loss_fn_for,
    pad_for_sequence_parallel,
)
from megalm.parallel.pipeline import PipelineRuntime, build_stage_chunks
from megalm.parallel.recompute import apply_recompute, stage_mode
from megalm.parallel.tensor import tp_grad_norm_squared, tp_norm_share
from megalm.precision import apply_recipe, autocast, uses_transformer_engine
from megalm.precision.linear import set_precision_step
from megalm.precision.te import TE_TOKEN_MULTIPLE
from megalm.training import checkpoint as ckpt
from megalm.training.flops import peak_flops, training_flops
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
    """Builds data, model and optimizer from a config; `fit()` trains and checkpoints in `run_dir`.

    Under torchrun (or inside an initialised process group) the model is split over the mesh:
    pipeline parallelism gives each pipeline rank its chunks of layers and runs the schedule
    (`parallel/pipeline.py`), tensor parallelism swaps the layers for sharded ones
    (`parallel/parallelize.py`), each DP rank takes its slice of the global batch, context
    parallelism gives each CP rank a zigzag shard of every micro-batch (`parallel/context.py`), and
    `parallel/data.py` sums gradients over DP x CP (all-reduce, or reduce-scatter into ZeRO-1).
    With `parallel.hdp=true` the DP x CP ranks form one HDP domain instead: each step is planned
    (`parallel/hdp_runtime.py`), and every rank runs its own list of packed or ring micro-batches.
    `mesh` forces a layout (tests pass a one-rank mesh to get the single-process reference inside a distributed job).
    """

    def __init__(self, cfg: MegalmConfig, run_dir: Path | str, mesh: ParallelMesh | None = None):
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        self.device = select_device(cfg.trainer.device)
        world_size = mesh.dims.world_size if mesh is not None else init_distributed(self.device)[1]
        self.cfg = validate(cfg, world_size=world_size)
        p = cfg.parallel
        self.mesh = mesh or build_mesh(ParallelDims(tp=p.tp, pp=p.pp, cp=p.cp, dp=p.dp), self.device)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)  # the same on every rank: TP ranks must draw the same dropout masks

        check_same_config_on_all_ranks(cfg, self.mesh)
        self.data = build_datasets(cfg)
        self.model = self._build_model()
        self.loss_fn = loss_fn_for(self.mesh)
        self.pipeline = None
        if p.pp > 1:
            self.pipeline = PipelineRuntime(self.model, self.mesh, p.pp_schedule, self.loss_fn,
                                            lambda: autocast(cfg.precision, self.device), self.device)
        self.hdp = None
        if p.hdp:
            self.hdp = HdpRuntime(self.mesh, p.hdp_capacity, hdp_cost_model(cfg), p.pp, p.pp_schedule)
        reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(p.grad_reduce_dtype or "")
        # Each CP (or HDP) rank holds the gradient of its tokens only: sum over DP and CP (ZeRO-1 shards
        # over both). `batch_group` holds the ranks that split one global batch (losses, token counts).
        grad_group = self.mesh.dp_cp_group if p.cp > 1 or p.hdp else self.mesh.dp_group
        self.batch_group = grad_group if p.hdp else self.mesh.dp_group
        self.reducer = GradReducer(list(self.model.parameters()), grad_group, p.bucket_size_mb,
                                   reduce_dtype=reduce_dtype, zero1=p.zero1)
        self.optimizer = (build_zero1_optimizer(self.model, cfg.optim, self.reducer) if p.zero1
                          else build_optimizer(self.model, cfg.optim))
        self.config_dict = config_to_dict(cfg)
        budget = cfg.trainer.tokens_per_step
        self.train_steps = TokenBudgetSteps(self.data.train, budget) if budget else None
        self.valid_steps = TokenBudgetSteps(self.data.valid, budget) if budget and self.data.valid else None
        self.step = 0
        self.consumed_tokens = 0
        self.resumed_from: Path | None = None
        self._maybe_resume()
        self.peak = peak_flops(self.device, cfg.precision.name)

    def _build_model(self) -> GPT | torch.nn.ModuleList:
        """Build on the meta device (only this pipeline rank's chunks), shard for TP, wrap for
        recomputation, then materialise and initialise: every rank draws its shards of the
        single-process initial weights (`init_weights` + `shard_full`)."""
        p = self.cfg.parallel
        if p.pp > 1:
            model = build_stage_chunks(self.cfg.model, self.mesh.pp_rank, p.pp, p.vpp,
                                       list(p.layers_per_stage) if p.layers_per_stage else None)
        else:
            model = GPT(self.cfg.model, device="meta")
        chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
        prec = self.cfg.precision
        for chunk in chunks:
            apply_tensor_parallel(chunk, self.mesh, p.sequence_parallel)
            if p.hdp:
                apply_hdp_attention(chunk)
            else:
                apply_context_parallel(chunk, self.mesh, p.cp_comm)
            self.precision_note = apply_recipe(chunk, prec.name, prec.forward, prec.skip, prec.backend, self.cfg.seed,
                                               self.device)
            apply_recompute(chunk, stage_mode(p.recompute, self.mesh.pp_rank, p.pp))
        model.to_empty(device=self.device)
        init_weights(model, self.cfg.seed)
        return model

    def _all_reduce(self, value: torch.Tensor, group) -> torch.Tensor:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(value, group=group)
        return value

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
        t = self.cfg.trainer
        for key, current in (("seed", self.cfg.seed), ("global_batch_size", t.global_batch_size),
                             ("varlen", self.cfg.data.varlen), ("tokens_per_step", t.tokens_per_step)):
            if meta.state.get(key) != current:
                raise CheckpointError(f"checkpoint {path} was trained with {key}={meta.state.get(key)}, this run "
                                      f"has {current}; resuming would change the data order — set it back or "
                                      "start a new hydra.run.dir")
        ckpt.load_checkpoint(path, self.model, self.optimizer, self.mesh)
        self.step = meta.state["step"]
        self.consumed_tokens = meta.state["consumed_tokens"]
        if t.tokens_per_step:  # continue the step boundaries from the checkpoint's cursor
            cursor = meta.state["next_sample"]
            self.train_steps = TokenBudgetSteps(self.data.train, t.tokens_per_step, self.step, cursor)
        self.resumed_from = path
        log.info(f"resumed from {path} at step {self.step}")

    def save(self) -> Path:
        state = {"consumed_tokens": self.consumed_tokens, "seed": self.cfg.seed,
                 "global_batch_size": self.cfg.trainer.global_batch_size, "varlen": self.cfg.data.varlen,
                 "tokenizer": getattr(self.data.tokenizer, "spec", None),
                 "tokens_per_step": self.cfg.trainer.tokens_per_step}
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

    def local_sample_ids(self, step: int, dataset: SampleDataset | None = None) -> range:
        """This DP rank's contiguous slice of global batch `step` (TP ranks of a DP rank share it).
        Under a token budget the slices differ by at most one sample (a rank may get none)."""
        ids, dp, rank = self.step_sample_ids(step, dataset), self.mesh.dims.dp, self.mesh.dp_rank
        return ids[rank * len(ids) // dp:(rank + 1) * len(ids) // dp]

    def local_samples(self, step: int, dataset: SampleDataset | None = None) -> list[Sample]:
        """The samples of `local_sample_ids`: only these are read, so no rank reads another's data."""
        dataset = self.data.train if dataset is None else dataset
        return [dataset[k] for k in self.local_sample_ids(step, dataset)]

    def _prepare(self, mb: PackedBatch, ring: Ring | None = None) -> PackedBatch:
        """A micro-batch as the model takes it: this CP rank's zigzag shard, padded for SP, on the device.

        CP first, then SP: the SP padding of the local shard is one more (even) zigzag segment, the
        same on every CP rank. Zigzag padding continues each document's positions, so for learned
        position tables they are clamped to the table (padding is masked out of the loss and never
        attended to by real tokens, so what it reads does not matter). Under HDP `mb` is already this
        rank's part (a ring's shard, `HdpRuntime.micro_batches`), and `ring` is bound to it last.
        """
        p = self.cfg.parallel
        sharded = ring is not None if p.hdp else p.cp > 1
        if p.cp > 1 and not p.hdp:
            mb = shard_batch(mb, zigzag_plan(mb.cu_seqlens, p.cp), self.mesh.cp_rank)
        if sharded and self.cfg.model.position_embedding == "learned":
            mb.position_ids = mb.position_ids.clamp(max=self.cfg.model.max_position_embeddings - 1)
        if p.sequence_parallel:
            mb = pad_for_sequence_parallel(mb, self.mesh.dims.tp, even=sharded)
        elif uses_transformer_engine(self.cfg.precision.name, self.cfg.precision.backend, self.device):
            mb = pad_for_sequence_parallel(mb, TE_TOKEN_MULTIPLE, even=sharded)  # TE's FP8 GEMMs want T % 16 == 0
        mb = mb.to(self.device)
        if p.hdp:
            bind_ring(mb.cu_seqlens, ring)
        return mb

    def _micro_batch_loss(self, mb: PackedBatch) -> torch.Tensor:
        """Summed token loss of one prepared micro-batch under the precision recipe (no pipeline).
        Training and evaluation share it."""
        with autocast(self.cfg.precision, self.device):
            logits = self.model(mb.tokens, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
        return self.loss_fn(logits, mb.labels, mb.loss_mask)

    def forward_backward(self, samples: list[Sample], n_loss_tokens: int, step: int = 0
                         ) -> tuple[torch.Tensor, int, float]:
        """Accumulate gradients of sum(token losses) / n_loss_tokens over the samples' micro-batches,
        then finish the DP gradient reduction (overlapped with the backward by the reducer's hooks).
        `step` seeds the random rounding of low-precision recipes, with the global micro-batch index.

        Returns this DP rank's summed (unnormalised) loss, its input tokens and their model FLOPs
        (CP ranks share the samples: the loss is summed over their shards, tokens are counted once).
        """
        batches = micro_batches(samples, self.cfg.trainer.micro_batch_size,
                                partial_last=self.train_steps is not None)
        tokens = sum(mb.num_tokens for mb in batches)
        flops = sum(training_flops(self.cfg.model, mb.doc_lengths) for mb in batches)
        # Each micro-batch's random rounding is seeded by the index of its first sample in the step, so DP
        # replicas draw apart (their slices may differ in length under a token budget).
        first = self.local_sample_ids(step).start - self.step_sample_ids(step).start
        ids = [first + i * self.cfg.trainer.micro_batch_size for i in range(len(batches))]
        loss_total = self._accumulate([self._prepare(mb) for mb in batches], ids, n_loss_tokens, step)
        self._all_reduce(loss_total, self.mesh.cp_group)  # each CP rank has the loss of its tokens
        return loss_total, tokens, flops

    def _accumulate(self, batches: list[PackedBatch], ids: list[int], n_loss_tokens: int, step: int) -> torch.Tensor:
        """Forward and backward of prepared micro-batches (`ids`: their global indices, which seed random
        rounding), gradients accumulated and reduced; returns this rank's summed loss."""
        self.model.train()
        self.reducer.start_step(len(batches))
        if self.pipeline is not None:  # the schedule runs forward and backward of all micro-batches
            self.pipeline.before_forward = lambda chunk, i: set_precision_step(chunk, step, ids[i])
            loss_total = self.pipeline.step(batches, n_loss_tokens)
        else:
            loss_total = torch.zeros((), device=self.device)
            for mb, mb_id in zip(batches, ids, strict=True):
                set_precision_step(self.model, step, mb_id)
                loss_sum = self._micro_batch_loss(mb)
                (loss_sum / n_loss_tokens).backward()
                loss_total += loss_sum.detach()
        self.reducer.finish()
        if self.pipeline is not None:
            self.pipeline.sync_tied_embedding_grads()
            self._all_reduce(loss_total, self.mesh.pp_group)  # only the last stage computed it
        return loss_total

    def forward_backward_step(self, step: int) -> tuple[torch.Tensor, int, int, float]:
        """forward_backward on this rank's share of global batch `step`; also returns the step's
        global loss-token count (the normaliser, summed over DP)."""
        if self.hdp is not None:  # every rank plans the step and reads only its own micro-batches
            local, n_loss_tokens = self.hdp.micro_batches(self.data.train, self.step_sample_ids(step))
            batches = [self._prepare(m.batch, m.ring) for m in local]
            loss_total = self._accumulate(batches, [m.plan_index for m in local], max(n_loss_tokens, 1), step)
            tokens = sum(map(sum, (m.counted_doc_lengths for m in local)))
            flops = sum(training_flops(self.cfg.model, m.counted_doc_lengths) for m in local)
            return loss_total, max(n_loss_tokens, 1), tokens, flops
        samples = self.local_samples(step)
        n_loss_tokens = int(self._all_reduce(torch.tensor(loss_token_count(samples)), self.mesh.dp_group))
        loss_total, tokens, flops = self.forward_backward(samples, max(n_loss_tokens, 1), step)
        return loss_total, max(n_loss_tokens, 1), tokens, flops

    def _norm_share(self, param: torch.nn.Parameter) -> float:
        share = tp_norm_share(param, self.mesh.tp_group)
        return share * self.pipeline.norm_share(param) if self.pipeline is not None else share

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the full model's gradient: squares summed over TP shards and pipeline stages,
        replicated parameters counted once (`tp_norm_share`, the tied embedding's last-stage copy);
        under ZeRO-1 each DP (x CP) rank holds a shard of the gradient, so the squares are summed over
        the reducer's group too."""
        if self.cfg.parallel.zero1:
            sq = self.optimizer.local_grad_sq_norm(weight=self._norm_share)
            self._all_reduce(sq, self.reducer.dp_group)
            self._all_reduce(sq, self.mesh.tp_group)
        else:
            sq = tp_grad_norm_squared(self.model.parameters(), self.mesh.tp_group, weight=self._norm_share)
        return self._all_reduce(sq, self.mesh.pp_group).sqrt()

    def optimizer_step(self, step: int) -> tuple[float, float]:
        """Clip by global grad norm, set the schedule's lr, step AdamW. Returns (grad_norm, lr)."""
        t = self.cfg.trainer
        norm = self.grad_norm()
        if t.grad_clip > 0:
            coef = torch.clamp(t.grad_clip / (norm + 1e-6), max=1.0)
            if self.cfg.parallel.zero1:
                self.optimizer.scale_grads(coef)
            else:
                torch._foreach_mul_([p.grad for p in self.model.parameters() if p.grad is not None], coef)
        lr = lr_at(step, self.cfg.optim, t.max_steps)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.item(), lr

    def train_step(self, step: int) -> StepResult:
        """One optimizer step on global batch `step` (0-based). Loss, tokens and FLOPs are global."""
        loss_total, n_loss_tokens, tokens, flops = self.forward_backward_step(step)
        grad_norm, lr = self.optimizer_step(step)
        totals = self._all_reduce(torch.tensor([loss_total.item(), tokens, flops], dtype=torch.float64),
                                  self.batch_group)
        return StepResult(loss=totals[0].item() / n_loss_tokens, grad_norm=grad_norm, lr=lr,
                          tokens=int(totals[1]), flops=float(totals[2]))

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean per-token loss over the first `eval_iters` global batches of the validation split."""
        if self.data.valid is None:
            return None
        t = self.cfg.trainer
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64)
        if self.pipeline is not None:
            self.pipeline.before_forward = None  # a forward has no random rounding to seed
        for i in range(t.eval_iters):
            if self.hdp is not None:
                local, n_loss_tokens = self.hdp.micro_batches(self.data.valid, self.step_sample_ids(i, self.data.valid))
                batches = [self._prepare(m.batch, m.ring) for m in local]
                totals[1] += n_loss_tokens if self.hdp.index == 0 else 0  # the global count, once per domain
            else:
                samples = self.local_samples(i, self.data.valid)
                packed = micro_batches(samples, t.micro_batch_size, partial_last=self.valid_steps is not None)
                batches = [self._prepare(mb) for mb in packed]
                totals[1] += loss_token_count(samples)
            if self.pipeline is not None:
                totals[0] += self.pipeline.forward_only(batches).item()
            else:
                for mb in batches:
                    totals[0] += self._micro_batch_loss(mb).item()
        self.model.train()
        self._all_reduce(totals[:1], self.mesh.pp_group)  # the loss lives on the last stage
        if self.hdp is None:
            self._all_reduce(totals[:1], self.mesh.cp_group)  # CP ranks hold the losses of their shards
        self._all_reduce(totals, self.batch_group)
        return (totals[0] / max(totals[1], 1)).item()

    # ------------------------------------------------------------------ the loop

    def fit(self) -> TrainSummary:
        t = self.cfg.trainer
        stop_at = t.stop_at_step or t.max_steps
        main = self.mesh.is_logging_rank
        logger = MetricsLogger(self.run_dir, self.cfg.logging, t.max_steps, self.config_dict) if main else None
        dims = self.mesh.dims
        if main:
            n_params = num_parameters(GPT(self.cfg.model, device="meta"))
            log.info(f"model {self.cfg.model.name}: {n_params / 1e6:.2f}M parameters, {self.cfg.model.num_layers} "
                     f"layers | {self.precision_note} on {self.device} | {dims.world_size} rank(s): tp={dims.tp} "
                     f"pp={dims.pp}{self._pipeline_note()}{self._context_note()} dp={dims.dp}"
                     f"{' sp' if self.cfg.parallel.sequence_parallel else ''}"
                     f"{' zero1' if self.cfg.parallel.zero1 else ''} | data {self.cfg.data.name} "
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
                              "tokens_per_sec_per_gpu": window_tokens / elapsed / dims.world_size,
                              "peak_memory_gib": peak_memory_gb(self.device)}
                    if self.peak is not None:  # per GPU: global model FLOPs over all ranks' peak
                        record["mfu"] = window_flops / elapsed / (self.peak * dims.world_size)
                    if evaluate and val_loss is not None:
                        record["val_loss"] = val_loss
                    if logger is not None:
                        logger.log(record)
                    first_loss = result.loss if first_loss is None else first_loss
                    last_loss = result.loss
                    window_start, window_tokens, window_flops = now, 0, 0.0
                if (t.save_interval and self.step % t.save_interval == 0) or self.step == stop_at:
                    last_saved = self.save()
        finally:
            if logger is not None:
                logger.close()
        seconds = time.perf_counter() - start
        summary = TrainSummary(steps=self.step, first_loss=first_loss, last_loss=last_loss, val_loss=val_loss,
                               tokens=self.consumed_tokens, seconds=seconds, checkpoint=last_saved,
                               run_dir=self.run_dir, losses=losses)
        if main:
            self._log_summary(summary)
        return summary

    def _pipeline_note(self) -> str:
        p = self.cfg.parallel
        if p.pp == 1:
            return ""
        vpp = f" vpp={p.vpp}" if p.vpp > 1 else ""
        return f" ({p.pp_schedule}{vpp})"

    def _context_note(self) -> str:
        p = self.cfg.parallel
        if p.hdp:
            return f" cp={p.cp} hdp (C={p.hdp_capacity} tokens, {self.hdp.cost.name} cost)"
        return f" cp={p.cp} ({p.cp_comm})" if p.cp > 1 else ""

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


def hdp_cost_model(cfg: MegalmConfig) -> CostModel:
    """`parallel.hdp_cost`: a preset or YAML (megalm.parallel.hdp_cost.load_cost); unset, the first-principles
    model of this model's shape on H100s, one HDP rank = one TP group (only the balance depends on it)."""
    if cfg.parallel.hdp_cost:
        return load_cost(cfg.parallel.hdp_cost)
    m = cfg.model
    shape = ModelShape(layers=m.num_layers, hidden=m.hidden_size, heads=m.num_heads, kv_heads=m.num_kv_heads,
                       ffn=m.ffn_hidden_size, vocab=m.vocab_size)
    return preset(shape, tp=cfg.parallel.tp)


def check_same_config_on_all_ranks(cfg: MegalmConfig, mesh: ParallelMesh) -> None:
    """Fail fast, on every rank, when ranks were launched with different configs (different overrides
    per rank would otherwise pair mismatched collectives and hang, or silently train garbage)."""
    if not mesh.is_distributed:
        return
    import hashlib
    import json

    text = json.dumps(config_to_dict(cfg), sort_keys=True, default=str)
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")
    mine = torch.tensor([digest], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    differ = [r for r, d in enumerate(everyone) if int(d) != digest]
    if differ:
        raise ConfigError(f"rank {mesh.rank}'s config differs from rank(s) {differ[:8]}'s; launch every rank with "
                          "the same config and overrides")
