"""Data parallelism: bucketed, overlapped gradient reduction (the optimizer over its buckets is bucket_adamw.py).

Every DP rank holds the whole model, runs its own slice of the global batch and ends the backward
with a *partial* gradient. Because megalm's loss is `sum(token losses) / tokens in the global
batch` (docs/architecture.md, "Loss is per token over the global batch"), the gradient of the step
is the **sum** of the ranks' partial gradients, never their mean: a rank that saw more tokens simply
contributes more.

GradReducer (the "DDP" half)
----------------------------
Reducing one parameter at a time wastes latency (thousands of tiny collectives); reducing all of
them after backward wastes the backward (the network idles while we compute, then we idle while it
sends). Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"
(VLDB), show the fix: group parameters into ~25 MB *buckets* in roughly the order backward produces
their gradients (reverse registration order: the last layer's gradients come first) and launch a
bucket's collective asynchronously the moment its last gradient is final, so communication of the
late layers overlaps the backward of the early ones.

A gradient is final once its parameter's post-accumulate-grad hook has fired once per micro-batch
(`start_step(num_micro_batches)` tells the reducer how many to expect). Parameters that get no
gradient in a step (an unused branch, a rank whose data skipped a layer) never reach that count;
`finish()` reduces whatever is left, so they cannot hang the step. Buckets are always launched in
bucket order, on every rank, which is what keeps the collectives of different ranks paired even
when ranks disagree about which parameters were used.

fp32 gradient accumulation ("main_grad", Megatron's accumulate_allreduce_grads_in_fp32)
-------------------------------------------------------------------------------------
With bf16 working weights (`precision=bf16`), accumulating micro-batch gradients in bf16 `p.grad` would round
every partial sum. `accumulate=True` makes the bucket the accumulator: the hook adds each micro-batch's
gradient into the parameter's view of its bucket and frees `p.grad`, every micro-batch, so the step's sum is
formed in the bucket's dtype (fp32 unless `reduce_dtype` says otherwise, as Megatron accumulates and reduces in
one buffer) and the summed gradients stay in the buckets (`grad_shards()`) for an optimizer that steps fp32
main weights from them (bucket_adamw.py). A step's first gradient of a parameter is copied in (as AccumulateGrad
takes the first one), so the buckets need no zeroing pass; one that gets none is zeroed in `finish()`.

Single process
--------------
`dp_group=None` (what `ParallelMesh` holds in a single process) or a group of size 1 means *no
communication* — None here is not torch's "default group". The same classes then run unchanged:
the all-reduce reducer leaves gradients untouched (or, accumulating, holds them in its buckets), and
ZeRO-1 degenerates to one shard holding everything, i.e. plain AdamW.

Deliberately left out (each is a contained change if profiling asks for it)
--------------------------------------------------------------------------
- The final local gradient is *copied* into its bucket (and `p.grad` freed). Making `p.grad` a view
  of the bucket from the start ("gradient as bucket view") would save that copy, at the price of
  grads that must never be re-allocated by anyone else.
- ZeRO-1 keeps full-size gradient buckets; freeing all but the own shard after the reduce-scatter
  is ZeRO-2.
- One bucket size for all buckets; DDP makes the first bucket small so communication starts sooner.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megalm.parallel.collectives import group_rank, group_size, reduce_scatter_flat
from megalm.parallel.norms import NormShare, share_pairs, weighted_sq_norm
from megalm.parallel.progress import Progress, note_collective

# ---------------------------------------------------------------------------- layout


@dataclass
class ShardSegment:
    """The part of one parameter that falls inside this rank's shard of a bucket.

    Elements [param_start, param_end) of the flattened parameter sit at
    [shard_start, shard_start + param_end - param_start) of the rank's shard.
    """

    param: nn.Parameter
    param_start: int
    param_end: int
    shard_start: int

    @property
    def shard_slice(self) -> slice:
        return slice(self.shard_start, self.shard_start + self.param_end - self.param_start)

    @property
    def param_slice(self) -> slice:
        return slice(self.param_start, self.param_end)


@dataclass
class GradBucket:
    """Parameters whose gradients travel in one collective, laid out back to back in `buffer`.

    `buffer` has `padded_numel` elements in the reduce dtype; with ZeRO-1 the padding makes it
    split into `world` equal shards, and `shard` receives this rank's summed slice. `segments` are the
    pieces of parameters in the part of the bucket this rank's optimizer steps: its shard under ZeRO-1,
    the whole bucket when gradients accumulate in it without ZeRO-1, none otherwise.
    """

    index: int
    params: list[nn.Parameter]
    offsets: list[int]  # where each parameter starts in the flat buffer
    numel: int  # sum of the parameters' sizes
    padded_numel: int  # numel rounded up to a multiple of the DP size (ZeRO-1), else numel
    grad_dtype: torch.dtype
    buffer: torch.Tensor
    shard: torch.Tensor | None = None  # ZeRO-1: reduce-scatter output, reduce dtype
    grad_shard: torch.Tensor | None = None  # ZeRO-1: this rank's summed gradient, grad dtype (after finish)
    segments: list[ShardSegment] = field(default_factory=list)  # the pieces of params this rank owns
    group: dist.ProcessGroup | None = None  # the ranks it is summed over (and sharded over, ZeRO-1)
    world: int = 1  # their number
    rank: int = 0  # this rank's place among them (its ZeRO-1 shard)
    pending: int = 0  # parameters whose gradient is not final yet in this step
    launched: bool = False
    work: dist.Work | None = None

    @property
    def shard_numel(self) -> int:
        return self.shard.numel() if self.shard is not None else self.padded_numel


def _build_buckets(params: list[nn.Parameter], bucket_bytes: float, reduce_dtype: torch.dtype | None,
                   zero1: bool, group_of: Callable[[nn.Parameter], dist.ProcessGroup | None],
                   accumulate: bool = False) -> list[GradBucket]:
    """Split `params` (already in reverse registration order) into buckets of about `bucket_bytes`.

    A bucket is closed once it holds at least `bucket_bytes` (so a large parameter gets a bucket of
    its own) or when the dtype/device or the group it is summed over (`group_of(param)`) changes (one flat
    buffer has one dtype and one device, one collective one group).
    Accumulating buckets are fp32 (or `reduce_dtype`) whatever the parameters' dtype.
    """
    groups: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    current_bytes = 0
    for p in params:
        if current and (p.dtype != current[0].dtype or p.device != current[0].device
                        or group_of(p) is not group_of(current[0])):
            groups.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += p.numel() * (reduce_dtype or (torch.float32 if accumulate else p.dtype)).itemsize
        if current_bytes >= bucket_bytes:
            groups.append(current)
            current, current_bytes = [], 0
    if current:
        groups.append(current)

    buckets = []
    for index, group in enumerate(groups):
        pg = group_of(group[0])
        world, rank = group_size(pg), group_rank(pg)
        offsets, numel = [], 0
        for p in group:
            offsets.append(numel)
            numel += p.numel()
        padded = math.ceil(numel / world) * world if zero1 else numel
        grad_dtype = torch.float32 if accumulate else group[0].dtype
        dtype = reduce_dtype or grad_dtype
        # zeros: the padding is never written again, so it stays zero and adds nothing.
        buffer = torch.zeros(padded, dtype=dtype, device=group[0].device)
        bucket = GradBucket(index, group, offsets, numel, padded, grad_dtype, buffer, group=pg, world=world, rank=rank)
        if zero1 or accumulate:  # the range this rank's optimizer steps: its shard, or the whole bucket
            size = padded // world if zero1 else padded
            if zero1:
                bucket.shard = torch.zeros(size, dtype=dtype, device=buffer.device)
            lo, hi = (rank * size, (rank + 1) * size) if zero1 else (0, padded)
            for p, start in zip(group, offsets, strict=True):
                a, b = max(start, lo), min(start + p.numel(), hi)
                if a < b:
                    bucket.segments.append(ShardSegment(p, a - start, b - start, a - lo))
        buckets.append(bucket)
    return buckets


# ---------------------------------------------------------------------------- the reducer


def _weak_hook(reducer_ref: weakref.ref) -> Callable[[nn.Parameter], None]:
    def hook(param: nn.Parameter) -> None:
        reducer = reducer_ref()
        if reducer is not None:
            reducer._on_grad_ready(param)

    return hook


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class GradReducer:
    """Sums gradients over the DP group in buckets, overlapped with backward.

    Per step: `start_step(n)`, then n micro-batches of forward+backward, then `finish()`.
    - zero1=False: after `finish()` every rank's `p.grad` is the DP-summed gradient.
    - zero1=True: after `finish()` `p.grad` is None and each bucket's `grad_shard` holds the
      summed gradient of this rank's shard; `BucketAdamW` consumes it.
    - accumulate=True: each micro-batch's gradient is added into the bucket (fp32) as it arrives; after
      `finish()` `p.grad` is None and `grad_shards()` holds the summed gradients (the whole buckets, or
      this rank's shards under ZeRO-1), for `BucketAdamW` with fp32 main weights.

    reduce_dtype (e.g. torch.bfloat16) is the dtype the buffers are communicated and summed in —
    half the traffic of fp32 at the cost of bf16 rounding of the sum; the result is cast back to
    the gradient's dtype. Default: the gradient's own dtype.

    `stats` counts what went over the wire: "<collective>_bytes" is the size of the full buffer
    each collective worked on (all-reduce: the buffer; reduce-scatter: its input; all-gather: its
    output — the gather is counted here by BucketAdamW), "collective_calls" the number of calls,
    "buckets_in_backward" / "buckets_in_finish" where buckets were launched (the first is the
    overlapped ones). `bytes_sent_per_rank()` turns the sizes into ring-algorithm traffic.

    The hooks live as long as the reducer: keep a reference to it (the trainer does, to call
    start_step/finish); `remove()` detaches them earlier.
    """

    def __init__(self, params: Iterable[nn.Parameter], dp_group: dist.ProcessGroup | None,
                 bucket_size_mb: float = 25.0, reduce_dtype: torch.dtype | None = None, zero1: bool = False,
                 presum: dict[nn.Parameter, dist.ProcessGroup] | None = None, progress: Progress | None = None,
                 accumulate: bool = False, own_groups: dict[nn.Parameter, dist.ProcessGroup] | None = None):
        self.progress = progress  # the mesh's record of the collective entered (hang reports)
        unique: dict[int, nn.Parameter] = {}
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)  # tied weights appear once
        self.params: list[nn.Parameter] = list(unique.values())
        self.dp_group = dp_group
        self.world, self.rank = group_size(dp_group), group_rank(dp_group)
        self.zero1 = zero1
        self.accumulate = accumulate
        self.flat_grads = zero1 or accumulate  # the summed gradients stay in the buckets, not in p.grad
        self.reduce_dtype = reduce_dtype
        # Parameters whose local gradient is first summed over another group (a pipeline's tied embedding: its
        # first- and last-stage copies), in finish(), before the DP reduction: under ZeRO-1 the DP reduction
        # shards the gradient, and the two stages' shards of the weight do not line up.
        self.presum = [(p, g) for p, g in (presum or {}).items() if p.requires_grad]
        presummed = {id(p) for p, _ in self.presum}
        # Reverse registration order approximates the order in which backward finalises gradients; the
        # pre-summed parameters go last, so that waiting for finish() holds back no other bucket.
        order = [p for p in self.params[::-1] if id(p) not in presummed] + [p for p, _ in self.presum]
        # Parameters summed over a group of their own (expert-parallel slices: over the ranks holding the same
        # experts) get buckets of their own; every other over `dp_group`
        own = {id(p): g for p, g in (own_groups or {}).items()}
        self.buckets = _build_buckets(order, bucket_size_mb * 2**20, reduce_dtype, zero1,
                                      lambda p: own.get(id(p), dp_group), accumulate)
        self._where: dict[int, tuple[GradBucket, int]] = {}  # id(param) -> (bucket, offset)
        for bucket in self.buckets:
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                self._where[id(p)] = (bucket, offset)
        self.stats: dict[str, int] = {}
        self.reset_stats()
        self._fires: dict[int, int] = {}
        self._num_micro_batches = 0
        self._next_launch = 0  # buckets are launched strictly in index order
        self._active = False
        self.step_finished = False  # True between finish() and the next start_step()
        # Plain DP in one process has nothing to do; ZeRO-1 still needs its flat grad shard, accumulation its buckets.
        self.enabled = any(b.world > 1 for b in self.buckets) or self.flat_grads or bool(self.presum)
        self._handles = []
        if self.enabled:
            # The hooks hold the reducer weakly and are removed when it is collected. A strong
            # reference would form a parameter -> hook -> reducer -> parameter cycle that only the
            # cyclic GC frees, keeping the process group alive past destroy_process_group(); at
            # interpreter exit gloo's worker threads can then release tensors without Python (SIGABRT).
            hook = _weak_hook(weakref.ref(self))
            self._handles = [p.register_post_accumulate_grad_hook(hook) for p in self.params]
            weakref.finalize(self, _remove_handles, self._handles)

    # ------------------------------------------------------------------ public API

    def start_step(self, num_micro_batches: int) -> None:
        """Arm the hooks: a gradient is final after `num_micro_batches` backward passes (may be 0)."""
        if self._active:
            raise RuntimeError("GradReducer.start_step() called twice without finish()")
        if num_micro_batches < 0:
            raise ValueError(f"num_micro_batches={num_micro_batches} must be >= 0")
        self._num_micro_batches = num_micro_batches
        self._fires = {id(p): 0 for p in self.params}
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.launched = False
            bucket.work = None
        self._next_launch = 0
        self._active = True
        self.step_finished = False

    def before_backward(self, chunk: nn.Module, last: bool) -> None:
        """Nothing to tell: a bucket is reduced once its gradients are final, counted by the hooks."""

    def finish(self) -> None:
        """Launch the buckets still waiting (unused parameters count as zero), wait for all of them,
        and leave the summed gradients in place (`p.grad`, or the buckets' `grad_shard` for ZeRO-1)."""
        if not self._active:
            raise RuntimeError("GradReducer.finish() without start_step()")
        if self.enabled:
            for p, group in self.presum:  # their local gradients, summed over their group first
                if self.accumulate:  # already summed over the micro-batches in the bucket (zero if none came)
                    local = self._view(p)
                    if self._fires[id(p)] == 0:
                        local.zero_()
                else:
                    local = p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                if group_size(group) > 1:
                    dist.all_reduce(local, group=group)
                if not self.accumulate:
                    self._copy_in(p)
                self._where[id(p)][0].pending -= 1
            presummed = {id(p) for p, _ in self.presum}
            for bucket in self.buckets:
                if not bucket.launched:
                    for p in bucket.params:
                        # not final yet (unused in some micro-batch), or a rank with no micro-batch at all
                        # (HDP): its bucket still holds the last step's gradient, so zeros go in
                        stale = self._fires[id(p)] < self._num_micro_batches or self._num_micro_batches == 0
                        if id(p) in presummed or not stale:
                            continue
                        if not self.accumulate:
                            self._copy_in(p)
                        elif self._fires[id(p)] == 0:  # accumulating: the sum so far is in place, or none came
                            self._view(p).zero_()
                    bucket.pending = 0
            self._launch_ready(in_backward=False)
            for bucket in self.buckets:
                if bucket.work is not None:
                    bucket.work.wait()
                    bucket.work = None
                self._copy_out(bucket)
        self._active = False
        self.step_finished = True

    def bytes_sent_per_rank(self) -> dict[str, float]:
        """Bytes each rank sends under ring algorithms: all-reduce 2(n-1)/n of the buffer,
        reduce-scatter and all-gather (n-1)/n each (Rajbhandari et al. 2020, sec. 7)."""
        n = self.world
        return {"all_reduce": 2 * (n - 1) / n * self.stats["all_reduce_bytes"],
                "reduce_scatter": (n - 1) / n * self.stats["reduce_scatter_bytes"],
                "all_gather": (n - 1) / n * self.stats["all_gather_bytes"]}

    def reset_stats(self) -> None:
        self.stats.update({"all_reduce_bytes": 0, "reduce_scatter_bytes": 0, "all_gather_bytes": 0,
                           "collective_calls": 0, "buckets_in_backward": 0, "buckets_in_finish": 0})

    def release_cast_grad_shards(self) -> None:
        """Drop the ZeRO-1 gradient shards cast out of the reduce dtype (`parallel.grad_reduce_dtype=bf16`: an fp32
        copy of each shard), once the optimizer has stepped them: kept until the next step's `finish()`, they held
        4 bytes a parameter / dp between steps for nothing."""
        for bucket in self.buckets:
            if bucket.grad_shard is not None and bucket.grad_shard is not bucket.shard:
                bucket.grad_shard = None

    def grad_shards(self) -> list[torch.Tensor]:
        """The summed gradients this rank's optimizer steps, one flat tensor per bucket (valid after finish()):
        its shard of every bucket under ZeRO-1, else (accumulating) the whole buckets."""
        if not self.flat_grads:
            raise RuntimeError("grad_shards() needs GradReducer(zero1=True) or GradReducer(accumulate=True)")
        if not self.step_finished:
            raise RuntimeError("the reducer has no finished step: call reducer.finish() before using grads")
        return [b.grad_shard if self.zero1 else b.buffer for b in self.buckets]

    def summed_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """`param`'s summed gradient, shaped like it (valid after finish()): its `.grad`, or its slice of the
        buckets when they accumulate; None under ZeRO-1, where this rank holds a shard of the buckets only."""
        if self.zero1:
            return None
        return self._view(param).view(param.shape) if self.accumulate else param.grad

    def summed_over(self, param: nn.Parameter) -> dist.ProcessGroup | None:
        """The ranks `param`'s gradient is summed over (its bucket's group: dp x cp, or an expert slice's own), whose
        reduced gradients of it are therefore the same."""
        return self._where[id(param)][0].group

    @property
    def shard_group(self) -> dist.ProcessGroup | None:
        """The group whose ranks each hold one shard of the summed gradients (ZeRO-1's DP group); None
        when every rank holds all of them."""
        return self.dp_group if self.zero1 else None

    @torch.no_grad()
    def local_grad_sq_norm(self, weight: Callable[[nn.Parameter], NormShare] | None = None) -> torch.Tensor:
        """Sum of squares of the summed gradient elements this rank holds (fp32 scalar): its shard of every
        bucket under ZeRO-1 (shards partition the parameters: sum this over `shard_group` for the full
        norm²), every parameter's whole gradient otherwise (in the buckets when they accumulate). `weight(param)`
        scales each parameter's part (tensor parallelism passes each parameter's share, so TP-replicated parameters
        count once; a share may differ between ranges of a parameter: megalm.parallel.norms.NormShare)."""
        device = self.params[0].device if self.params else None
        if self.flat_grads:
            pairs = [(g, 1.0) for g in self.grad_shards()] if weight is None else [
                pair for bucket, g in zip(self.buckets, self.grad_shards(), strict=True) for seg in bucket.segments
                for pair in share_pairs(g[seg.shard_slice], seg.param_start, weight(seg.param))]
        else:
            pairs = [pair for p in self.params if p.grad is not None
                     for pair in share_pairs(p.grad.reshape(-1), 0, 1.0 if weight is None else weight(p))]
        return weighted_sq_norm(pairs, device)

    @torch.no_grad()
    def scale_grads(self, coef: float | torch.Tensor) -> None:
        """Multiply the summed gradients this rank holds by `coef` (the clip coefficient)."""
        if self.flat_grads:
            for g in self.grad_shards():
                g.mul_(coef)
        else:
            torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], coef)

    def remove(self) -> None:
        """Detach the hooks (the model can then run backward without a reducer)."""
        _remove_handles(self._handles)

    def main_grad(self, param: nn.Parameter) -> tuple[torch.Tensor, bool]:
        """`param`'s sum of this step's gradients so far (fp32, or `reduce_dtype`), shaped like it (its slice of the
        bucket), and whether it is still empty (the slice then holds the last step's sum: overwrite it, do not add).
        For a GEMM that adds its weight gradient in place (gradient accumulation fusion, fused_wgrad.py), which then
        calls `added_to_main_grad`. Needs `accumulate=True`."""
        if not self.accumulate:
            raise RuntimeError("main_grad() needs GradReducer(accumulate=True): the buckets hold no sum otherwise")
        self._require_step()
        return self._view(param).view(param.shape), self._fires[id(param)] == 0

    def added_to_main_grad(self, param: nn.Parameter) -> None:
        """This micro-batch's gradient of `param` was added into `main_grad(param)` in place (no `p.grad`): counted
        as the post-accumulate-grad hook counts one, launching the bucket's reduction once it is final."""
        self._arrived(param)

    # ------------------------------------------------------------------ internals

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: runs after each backward adds into `param.grad`."""
        self._require_step()
        if self.accumulate:  # this micro-batch's gradient joins the bucket's sum (fp32) and leaves p.grad
            view, grad = self._view(param), param.grad.reshape(-1)
            if self._fires[id(param)] == 0:  # the step's first one starts the sum: no zeroing pass over the buckets
                view.copy_(grad)
            else:
                view.add_(grad)
            param.grad = None
        self._arrived(param)

    def _arrived(self, param: nn.Parameter) -> None:
        """One more micro-batch's gradient of `param` is in (in `p.grad`, or already in its bucket when accumulating);
        the last one makes it final, and its bucket's collective starts once the bucket is complete."""
        key = id(param)
        self._fires[key] += 1
        if self._fires[key] > self._num_micro_batches:
            raise RuntimeError(f"a parameter received {self._fires[key]} gradients in a step declared with "
                               f"start_step({self._num_micro_batches}); its bucket was already reduced")
        if self._fires[key] < self._num_micro_batches:
            return
        if any(p is param for p, _ in self.presum):
            return  # summed over its group in finish(), then copied in
        bucket, _ = self._where[key]
        if not self.accumulate:
            self._copy_in(param)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready(in_backward=True)

    def _require_step(self) -> None:
        if not self._active:
            raise RuntimeError("a gradient arrived outside a GradReducer step: call reducer.start_step("
                               "num_micro_batches) before the first backward and finish() after the last")

    def _view(self, param: nn.Parameter) -> torch.Tensor:
        """`param`'s flat slice of its bucket."""
        bucket, offset = self._where[id(param)]
        return bucket.buffer[offset:offset + param.numel()]

    def _copy_in(self, param: nn.Parameter) -> None:
        """Move the final local gradient into the bucket (casting to the reduce dtype) and free it."""
        view = self._view(param)
        if param.grad is None:
            view.zero_()
        else:
            view.copy_(param.grad.reshape(-1))
        param.grad = None  # the bucket holds it now; also keeps stale local grads from being used

    def _launch_ready(self, in_backward: bool) -> None:
        """Launch every complete bucket that is next in line. Strict index order on every rank keeps
        the collectives of all ranks paired, whatever order their gradients became ready in."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            bucket = self.buckets[self._next_launch]
            self._launch(bucket)
            self.stats["buckets_in_backward" if in_backward else "buckets_in_finish"] += 1
            self._next_launch += 1

    def _launch(self, bucket: GradBucket) -> None:
        bucket.launched = True
        nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
        if bucket.world == 1:  # ZeRO-1 in one process: the "shard" is the whole buffer
            if self.zero1:
                bucket.shard.copy_(bucket.buffer)
            return
        self.stats["collective_calls"] += 1
        note_collective(self.progress, "DP reduce_scatter" if self.zero1 else "DP all_reduce", bucket.world)
        if self.zero1:
            self.stats["reduce_scatter_bytes"] += nbytes
            bucket.work = reduce_scatter_flat(bucket.shard, bucket.buffer, op=dist.ReduceOp.SUM,
                                              group=bucket.group, async_op=True)
        else:
            self.stats["all_reduce_bytes"] += nbytes
            bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=bucket.group,
                                          async_op=True)

    def _copy_out(self, bucket: GradBucket) -> None:
        """Hand the summed result back in the gradient dtype."""
        if self.zero1:
            shard = bucket.shard
            bucket.grad_shard = shard if shard.dtype == bucket.grad_dtype else shard.to(bucket.grad_dtype)
            return
        if self.accumulate:  # the summed gradients stay in the bucket (grad_shards())
            return
        for p, offset in zip(bucket.params, bucket.offsets, strict=True):
            flat = bucket.buffer[offset:offset + p.numel()]
            # Same dtype: the grad is a view of the bucket (no copy); it stays valid until the next
            # step's first final gradient overwrites the bucket.
            p.grad = flat.view_as(p) if flat.dtype == p.dtype else flat.view_as(p).to(p.dtype)
