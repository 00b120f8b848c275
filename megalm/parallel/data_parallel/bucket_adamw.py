"""AdamW over the reducer's flat gradient buckets: ZeRO-1's sharded state, and fp32 main weights for bf16 ones.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC20): with plain DP every rank stores the full AdamW state (2 fp32 moments, 8 bytes/param) and
performs the same update. Stage 1 ("P_os") partitions the optimizer state instead: the flattened
parameters of each bucket are split into `dp` contiguous shards, the gradient is *reduce-scattered*
(each rank receives the summed gradient of its shard only), each rank updates its shard and an
*all-gather* returns the full updated parameters to everyone. A ring reduce-scatter plus a ring
all-gather move exactly as many bytes as one ring all-reduce (2(n-1)/n of the buffer per rank), so
the memory saving is free in communication volume.

The gradients come from `GradReducer(..., zero1=True)` (reducer.py), which reduce-scatters them into
each rank's shard of every bucket.

Mixed precision with main weights (Micikevicius et al. 2018, "Mixed Precision Training"; Megatron's
Float16OptimizerWithFloat16Params and distributed optimizer): with `working_dtype=torch.bfloat16` the model's
parameters become bf16 working copies that forward and backward use directly (no per-micro-batch casts under
autocast), while this optimizer keeps the fp32 main weights, flat like its moments: the owned part of every
bucket (the whole bucket without ZeRO-1, which needs a reducer that accumulates: `GradReducer(accumulate=True)`,
the gradients summed in fp32 across micro-batches in the buckets; this rank's shard with ZeRO-1). AdamW steps
the fp32 main weights from the fp32 gradients, and the bf16 copy is refreshed once per step: cast from the main
weights, or under ZeRO-1 cast from each rank's shard and all-gathered in bf16 (half of the fp32 gather's bytes).
Bytes per parameter: 2 (bf16 weight) + 4 (fp32 gradient bucket) + 12 (main weight and two moments), the last
divided by the DP size under ZeRO-1 — Megatron's 18 and 6 + 12/d. Checkpoints hold the fp32 main weights
(`full_precision_weights()`), so they resume exactly and load into fp32 runs.

Muon (`optim.name=muon`, megalm/training/muon.py) on bf16 working weights: its param group of matrices steps with a
`matrix_update` on each parameter's fp32 main weight, gradient and momentum, views of the whole buckets (without
ZeRO-1), the momentum where AdamW's first moment would be and no second moment: 2 + 4 + 8 bytes a matrix parameter.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.optim.adamw import adamw

from megalm.model import TransformerBlock
from megalm.model.naming import model_chunks
from megalm.parallel.collectives import all_gather_flat
from megalm.parallel.data_parallel import adamw_kernel
from megalm.parallel.data_parallel.optimizer_face import TorchOptimizerFace
from megalm.parallel.data_parallel.reducer import GradBucket, GradReducer
from megalm.parallel.norms import NormShare

log = logging.getLogger("megalm")


class BucketAdamW(TorchOptimizerFace):
    """AdamW over the reducer's buckets: its fp32 state sharded over the DP group (ZeRO stage 1, Rajbhandari
    et al. 2020) when the reducer shards, and fp32 main weights behind `working_dtype` parameters when given.

    torch's AdamW (its fused kernel on CPU and CUDA, foreach elsewhere: decoupled weight decay, then the
    Adam step) applied to this rank's flat segments of every bucket, one call per param group, followed by
    an all-gather of the updated parameters. It looks like a torch optimizer where the trainer and
    checkpoint code need it to:
    `param_groups` (list of dicts with "params", "lr", "betas", "eps", "weight_decay", so
    `optim.set_lr` works and per-group weight decay is respected), `zero_grad`, `register_step_pre_hook` and
    `register_step_post_hook` (precision recipes count steps with it), and a torch-format
    `state_dict()` indexed in param-group order, so `training.checkpoint` saves and loads it by
    parameter name — under any DP size, and interchangeably with a plain torch AdamW.

    Gradients come from the reducer's buckets; norm and clipping act on the part this rank steps:
    `local_grad_sq_norm()` (sum it over `reducer.shard_group` for the global norm²) and
    `scale_grads(coef)`, or `clip_grad_norm_(max_norm)` for a DP-only layout.

    Without `working_dtype` the parameters are fp32 and are themselves the main weights: the shard is read
    from them at every step, which also means a model loaded after this optimizer was built is picked up.
    With it, the parameters are `working_dtype` copies and this optimizer keeps the fp32 main weights, taken
    from `initial_weights` ({id(param): fp32 tensor}, the values the parameters were cast from: the fp32
    initialisation, not its rounding) or else from the parameters; whatever loads or saves weights goes
    through `full_precision_weights()`.

    A param group marked `"muon": True` steps with `matrix_update` (`MuonMatrices`) instead of AdamW, on whole main
    weights (working_dtype parameters, no ZeRO-1); its state is a `momentum_buffer` per parameter, as torch's Muon's.
    """

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict], reducer: GradReducer, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 working_dtype: torch.dtype | None = None,
                 initial_weights: dict[int, torch.Tensor] | None = None, kernel: str = "auto",
                 matrix_update: Callable[..., None] | None = None):
        if not reducer.zero1 and not (working_dtype is not None and reducer.accumulate):
            raise ValueError("BucketAdamW needs a GradReducer built with zero1=True, or, for working_dtype "
                             "parameters, one built with accumulate=True")
        self._set_param_groups(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.reducer = reducer
        self.dp_group = reducer.dp_group
        self.world, self.rank = reducer.world, reducer.rank

        self._group_of: dict[int, dict] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in self._group_of:
                    raise ValueError("a parameter appears in more than one param group")
                if p.dtype != (working_dtype or torch.float32):
                    raise ValueError(f"BucketAdamW steps fp32 parameters, or working_dtype ones behind fp32 main "
                                     f"weights; got {p.dtype} with working_dtype={working_dtype}")
                self._group_of[id(p)] = group
        if set(self._group_of) != {id(p) for p in reducer.params}:
            raise ValueError("BucketAdamW's parameters must be exactly the reducer's trainable parameters")
        # param groups marked "muon": stepped by `matrix_update` (megalm/training/muon.py MuonMatrices) on each
        # parameter's whole fp32 main weight, gradient and momentum (held where AdamW's first moment would be), which
        # only a rank that owns whole buckets has
        self.matrix_groups = [group for group in self.param_groups if group.get("muon")]
        self.matrix_update = matrix_update
        if self.matrix_groups and (matrix_update is None or reducer.zero1 or working_dtype is None):
            raise ValueError("BucketAdamW steps matrix param groups (\"muon\") with a matrix_update, on whole fp32 "
                             "main weights: working_dtype parameters without ZeRO-1")

        self.step_count = 0
        # the clip coefficient's inverse, which the fused kernel divides the gradients by (torch's fused AdamW reads
        # the attribute of this name): set by Parallelism.clip_grad_norm_, cleared by the trainer after the step
        self.grad_scale: torch.Tensor | None = None
        # `kernel` is optim.implementation: megalm's one-pass Triton kernel ("triton"; "auto" on CUDA where triton
        # imports: adamw_kernel.py, which writes the working copies too, 1.37x torch's kernel and cast on an H100,
        # 2026-12-05), torch's fused AdamW kernel ("fused"; "auto" on a CPU, or CUDA without triton), or its foreach
        # kernels ("foreach"; "auto" elsewhere)
        if kernel not in ("auto", "fused", "foreach", "triton"):
            raise ValueError(f"BucketAdamW kernel {kernel!r}: auto, fused, foreach or triton")
        device = reducer.params[0].device if reducer.params else torch.device("cpu")
        # a cost trace (fake tensors: megalm-estimate's, the step-cost tool's, each of a GPU run whatever device it
        # traces on) steps the Triton kernel's op (`traced_adamw_step`, priced by its bytes), as a CUDA run would
        self.traced = bool(reducer.params) and is_fake(reducer.params[0])
        if kernel == "auto" and (self.traced or device.type == "cuda" and adamw_kernel.runnable(device)):
            kernel = "triton"
            log.info("optim.implementation=auto: megalm's one-pass Triton AdamW steps the fp32 main weights "
                     "(optim.implementation=fused for torch's kernel)")
        self.fused = kernel == "fused" or (kernel != "foreach" and device.type in ("cpu", "cuda"))
        self.kernel = "triton" if kernel == "triton" else "torch"
        if kernel == "triton" and not self.traced and not adamw_kernel.runnable(device):
            log.warning("optim.implementation=triton: the Triton AdamW kernel cannot run on %s (it needs CUDA, or "
                        "TRITON_INTERPRET=1 on a CPU); torch's AdamW steps instead", device.type)
            self.kernel = "torch"
        self.exp_avg = [torch.zeros(b.shard_numel, dtype=torch.float32, device=b.buffer.device)
                        for b in reducer.buckets]
        # AdamW's second moments: laid out as the buckets (ZeRO-1 shards them alike), or, beside matrix groups (whole
        # buckets), packed over the AdamW parameters only: a matrix keeps one momentum, not two moments
        self._second_at: dict[int, slice] = {}  # id(AdamW parameter) -> its slice of its bucket's second moments
        sizes = []
        for b in reducer.buckets:
            size = 0
            for seg in b.segments:
                if self.matrix_groups and id(seg.param) not in self.matrix_ids:
                    self._second_at[id(seg.param)] = slice(size, size + seg.param.numel())
                    size += seg.param.numel()
            sizes.append(size if self.matrix_groups else b.shard_numel)
        self.exp_avg_sq = [torch.zeros(n, dtype=torch.float32, device=m.device) for n, m in zip(sizes, self.exp_avg,
                                                                                                 strict=True)]
        self.working_dtype = working_dtype
        # ZeRO-1's parameter all-gathers left in flight after a step (`overlap_param_gather_with`): bucket index ->
        # (the gathered flat tensor, its pending work)
        self._pending: dict[int, tuple[torch.Tensor, dist.Work | None]] = {}
        self.overlaps_param_gather = False
        self.main: list[torch.Tensor] | None = None  # fp32 main weights, flat: the owned part of every bucket
        if working_dtype is not None:
            self.main = [torch.zeros_like(m) for m in self.exp_avg]
            self._take_main_weights(initial_weights or {})

    # ------------------------------------------------------------------ gradients

    def _grad_shards(self) -> list[torch.Tensor]:
        return self.reducer.grad_shards()

    def local_grad_sq_norm(self, weight: Callable[[nn.Parameter], NormShare] | None = None) -> torch.Tensor:
        """Sum of squares of the gradient elements this rank owns (the reducer's shards; fp32 scalar).
        Summed over the DP group it is the full gradient norm squared; `weight(param)` scales each
        parameter's part (see `GradReducer.local_grad_sq_norm`)."""
        return self.reducer.local_grad_sq_norm(weight)

    def scale_grads(self, coef: float | torch.Tensor) -> None:
        """Multiply this rank's gradient shards by `coef` (the clip coefficient)."""
        self.reducer.scale_grads(coef)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global-norm clipping like torch.nn.utils.clip_grad_norm_, for a layout where DP is the only
        parallelism (with TP, combine local_grad_sq_norm over the TP group too). Collective."""
        sq = self.local_grad_sq_norm()
        if self.world > 1 and self.reducer.zero1:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.dp_group)
        norm = sq.sqrt()
        if math.isfinite(max_norm):
            self.scale_grads(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the reducer's buckets and are overwritten each step; this only drops any
        `p.grad` left behind (e.g. by a backward run outside a reducer step), and the fp32 copies of ZeRO-1's bf16
        gradient shards, which `step()` drops too: a step the non-finite guard skips kept them to the next step."""
        self.reducer.release_cast_grad_shards()
        super().zero_grad(set_to_none)

    # ------------------------------------------------------------------ the update

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the part of every bucket this rank owns, then every parameter refreshed from it (ZeRO-1: an
        all-gather, collective). A fixed number of foreach/fused launches per param group (and bucket, where bf16
        gradient buckets are cast for torch's kernels), not one per parameter."""
        self._run_hooks(self._pre_hooks)
        self.finish_param_gather()  # the parameters are read below (fp32: they are the main weights)
        grads = self._grad_shards()
        self.step_count += 1
        shards = self.main or [torch.empty(b.shard_numel, dtype=torch.float32, device=m.device)
                               for b, m in zip(self.reducer.buckets, self.exp_avg, strict=True)]
        # the Triton kernel writes the working copies where this rank owns whole buckets (then there are main weights:
        # the constructor asks for them); under ZeRO-1 the all-gather refreshes the parameters, as after torch's
        writes_copies = self.kernel == "triton" and not self.reducer.zero1
        # Gradients in bf16 (parallel.grad_reduce_dtype=bf16 without ZeRO-1: the whole buckets): the Triton kernel
        # reads them as they are; torch's kernels take fp32, so each bucket is cast and stepped on its own (a launch
        # per param group and bucket), never an fp32 copy of every gradient at once (4 bytes a parameter more than
        # the fp32 buckets the setting halves).
        cast_each = self.kernel != "triton" and any(g.dtype != torch.float32 for g in grads)
        indices = range(len(grads))
        for batch in ([i] for i in indices) if cast_each else [indices]:
            self._step_buckets(batch, grads, shards, writes_copies)
        self._step_matrices(grads, shards, writes_copies)
        if not writes_copies:
            self._refresh_params(shards)
        del grads
        self.reducer.release_cast_grad_shards()
        self._run_hooks(self._post_hooks)

    def _step_buckets(self, indices: Iterable[int], grads: list[torch.Tensor], shards: list[torch.Tensor],
                      writes_copies: bool) -> None:
        """AdamW on buckets `indices`: one launch per param group (torch's kernels) or per segment (Triton)."""
        # id(group) -> (group, [main weights, gradients, moments, second moments, working copies the step writes])
        per_group: dict[int, tuple[dict, list[list]]] = {}
        fresh: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # fp32 parameters -> the shard they step in
        for i in indices:
            bucket, m, v, shard = self.reducer.buckets[i], self.exp_avg[i], self.exp_avg_sq[i], shards[i]
            grad = grads[i] if grads[i].dtype == torch.float32 or self.kernel == "triton" else grads[i].float()
            for seg in bucket.segments:
                if id(seg.param) in self.matrix_ids:  # stepped by `_step_matrices`
                    continue
                group = self._group_of[id(seg.param)]
                s = seg.shard_slice
                if self.main is None:  # the fp32 parameters are the main weights
                    fresh[0].append(shard[s])
                    fresh[1].append(seg.param.detach().reshape(-1)[seg.param_slice])
                work = seg.param.detach().reshape(-1)[seg.param_slice] if writes_copies else None
                lists = per_group.setdefault(id(group), (group, [[], [], [], [], []]))[1]
                for out, tensor in zip(lists, (shard[s], grad[s], m[s], v[self._second_at.get(id(seg.param), s)],
                                               work), strict=True):
                    out.append(tensor)
        if fresh[0]:
            torch._foreach_copy_(*fresh)
        for group, (params, grads_, exp_avgs, exp_avg_sqs, works) in per_group.values():
            beta1, beta2 = group["betas"]
            if self.kernel == "triton":  # optim.implementation=triton: adamw_kernel's one pass per segment
                hyper = {"lr": group["lr"], "beta1": beta1, "beta2": beta2, "eps": group["eps"],
                         "weight_decay": group["weight_decay"], "step": self.step_count}
                for tensors in zip(params, grads_, exp_avgs, exp_avg_sqs, works, strict=True):
                    if self.traced:
                        adamw_kernel.traced_adamw_step(*tensors, self.grad_scale, **hyper)
                    else:
                        adamw_kernel.adamw_step_(*tensors, **hyper, grad_scale=self.grad_scale)
                continue
            # torch's own AdamW kernels (fused, or foreach) on this rank's flat segments, one call per param group;
            # the step counters (one per tensor, as torch's kernels take them) are views of one tensor
            steps = list(torch.full((len(params),), float(self.step_count - 1), device=params[0].device).unbind())
            adamw(params, grads_, exp_avgs, exp_avg_sqs, [], steps, fused=self.fused,
                  foreach=None if self.fused else True, grad_scale=self.grad_scale,  # the foreach path refuses one
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                  eps=group["eps"], maximize=False)

    def _step_matrices(self, grads: list[torch.Tensor], shards: list[torch.Tensor], writes_copies: bool) -> None:
        """The matrix groups' step (`matrix_update`) on each parameter's whole main weight, gradient and momentum
        (views of the buckets), in the groups' order, which is every rank's; and, where the Triton kernel wrote the
        other parameters' working copies, these parameters' cast from their main weights."""
        stepped = []
        for group in self.matrix_groups:
            params = group["params"]
            where = [self.reducer._where[id(p)] for p in params]
            views = [[flats[bucket.index][offset:offset + p.numel()].view(p.shape)
                      for p, (bucket, offset) in zip(params, where, strict=True)]
                     for flats in (shards, grads, self.exp_avg)]
            self.matrix_update(group, params, *views, grad_scale=self.grad_scale)
            stepped += zip(params, views[0], strict=True)
        if writes_copies and stepped:
            torch._foreach_copy_([p.detach() for p, _ in stepped], [main for _, main in stepped])

    def _refresh_params(self, shards: list[torch.Tensor]) -> None:
        """Every parameter from the updated owned parts: all-gathered under ZeRO-1 (in the parameters' dtype:
        bf16 working weights gather half the bytes), copied (cast) from the main weights otherwise."""
        buckets = self.reducer.buckets
        if not self.reducer.zero1:  # this rank owns whole buckets
            torch._foreach_copy_([seg.param.view(-1) for b in buckets for seg in b.segments],
                                 [shard[seg.shard_slice] for b, shard in zip(buckets, shards, strict=True)
                                  for seg in b.segments])
            return
        dtype = self.working_dtype or torch.float32
        for i in reversed(range(len(buckets))):  # in forward order: the backward filled the buckets last layer first
            self._pending[i] = self._gather(shards[i].to(dtype), buckets[i])
        if not self.overlaps_param_gather:
            self.finish_param_gather()

    @torch.no_grad()
    def finish_param_gather(self, buckets: Iterable[int] | None = None) -> None:
        """Wait for the parameter all-gathers still in flight (all, or those of bucket indices `buckets`) and copy
        them into the parameters. A no-op when none is: what anything that reads the parameters outside a forward
        calls first (checkpoints, the trainer at the end of `fit`)."""
        for i in list(self._pending) if buckets is None else buckets:
            if i not in self._pending:
                continue
            full, work = self._pending.pop(i)
            if work is not None:
                work.wait()
            bucket = self.reducer.buckets[i]
            torch._foreach_copy_([p.view(-1) for p in bucket.params],
                                 [full[offset:offset + p.numel()] for p, offset in zip(bucket.params, bucket.offsets,
                                                                                        strict=True)])

    def overlap_param_gather_with(self, owners: Iterable[tuple[nn.Module, list[nn.Parameter]]]) -> int:
        """Leave ZeRO-1's parameter all-gathers in flight when `step()` returns, so that they run while the next
        forward begins (Megatron's `overlap_param_gather`): each bucket is waited for in the forward pre-hook of
        the first module of `owners` ((module, the parameters its forward reads first): `forward_owners`) that
        reads one of its parameters. Every bucket must be some owner's, or it would be read stale. Returns how
        many modules got a hook; 0 without ZeRO-1, where there is no all-gather."""
        if not self.reducer.zero1 or all(b.world == 1 for b in self.reducer.buckets):
            return 0
        bucket_of = {id(p): i for i, b in enumerate(self.reducer.buckets) for p in b.params}
        hooked, covered = 0, set()
        for module, params in owners:
            needs = sorted({bucket_of[id(p)] for p in params if id(p) in bucket_of})
            if needs:
                module.register_forward_pre_hook(lambda _module, _args, needs=needs: self.finish_param_gather(needs))
                hooked += 1
                covered.update(needs)
        if missing := sorted(set(range(len(self.reducer.buckets))) - covered):
            raise ValueError(f"buckets {missing} hold no parameter of the modules given: their gathers would never be "
                             "waited for in a forward")
        self.overlaps_param_gather = True
        return hooked

    # ------------------------------------------------------------------ main weights

    @torch.no_grad()
    def _take_main_weights(self, values: dict[int, torch.Tensor], working: list[torch.Tensor] | None = None) -> None:
        """The main weights from the owned parts of `values[id(param)]`, or of the parameters themselves where it has
        none; then the parameters are (again) working copies: cast into `working` (the reducer's parameters' own
        working tensors, which they hold again) or, without it, into new tensors."""
        for bucket, main in zip(self.reducer.buckets, self.main, strict=True):
            for seg in bucket.segments:
                source = values.get(id(seg.param), seg.param).detach()
                main[seg.shard_slice].copy_(source.reshape(-1)[seg.param_slice])
        if working is None:
            for p in self.reducer.params:
                p.data = p.data.to(self.working_dtype)
            return
        torch._foreach_copy_(working, [p.data for p in self.reducer.params])  # cast: rounded as `.to` rounds
        for p, tensor in zip(self.reducer.params, working, strict=True):
            p.data = tensor

    @contextlib.contextmanager
    def full_precision_weights(self) -> Iterator[None]:
        """Inside, the parameters hold the fp32 main weights (gathered whole under ZeRO-1): what a checkpoint saves,
        and what a load writes; on exit the main weights are taken from them and the working copies cast again.
        Collective under ZeRO-1. Without a working dtype the parameters are the main weights: nothing to do."""
        self.finish_param_gather()
        if self.main is None:
            yield
            return
        # each parameter's working tensor, which it holds again on exit: its storage stays the parameter's, as what
        # keeps storages of parameters knows them (activation offload tells weights from activations by storage)
        working = [p.data for p in self.reducer.params]
        with torch.no_grad():
            for bucket, main in zip(self.reducer.buckets, self.main, strict=True):
                full = self._gathered(main, bucket)
                for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                    p.data = full[offset:offset + p.numel()].view(p.shape).clone()
        try:
            yield
        finally:
            self._take_main_weights({}, working)

    def _gather(self, shard: torch.Tensor, bucket: GradBucket) -> tuple[torch.Tensor, dist.Work | None]:
        """Start an all-gather of every rank's shard of `bucket` into one padded flat tensor, over the bucket's group
        (ZeRO-1; without it this rank's part is the whole bucket already)."""
        if bucket.world == 1 or not self.reducer.zero1:
            return shard, None
        full = torch.empty(bucket.padded_numel, dtype=shard.dtype, device=shard.device)
        self.reducer.stats["all_gather_bytes"] += full.numel() * full.element_size()
        self.reducer.stats["collective_calls"] += 1
        return full, all_gather_flat(full, shard, group=bucket.group, async_op=True)

    def _gathered(self, shard: torch.Tensor, bucket: GradBucket) -> torch.Tensor:
        """Every rank's shard in one padded flat tensor, waited for (the shard itself without ZeRO-1)."""
        full, work = self._gather(shard, bucket)
        if work is not None:
            work.wait()
        return full

    def gather_buffers(self) -> list[torch.Tensor]:
        """The ZeRO-1 all-gather outputs in flight: made by `step`, held until the next forward takes each bucket's
        parameters from its buffer (`finish_param_gather`). Communication buffers, for memory accounting."""
        return [full for full, _ in self._pending.values()]

    # ------------------------------------------------------------------ checkpoints

    @property
    def state(self) -> dict[int, dict[str, torch.Tensor]]:
        """This rank's moment shards by bucket, shaped like torch's per-parameter `optimizer.state` (what the
        trainer's non-finite check reads before a save; `state_dict()` is the full, gathered state)."""
        return {i: {"exp_avg": m, "exp_avg_sq": v} for i, (m, v) in enumerate(zip(self.exp_avg, self.exp_avg_sq,
                                                                                   strict=True))}

    @torch.no_grad()
    def state_dict(self) -> dict:
        """Full AdamW state in torch's format ({"state": {index: {"step", "exp_avg", "exp_avg_sq"}},
        "param_groups": [...]}) with indices in param-group order.

        Collective: every DP rank must call it. Each bucket's moments are all-gathered, so every rank
        briefly holds the full state (memory-heavy, simple): the price of a checkpoint that loads
        under any DP size and into a plain torch AdamW.
        """
        full_m = [self._gathered(m, b) for b, m in zip(self.reducer.buckets, self.exp_avg, strict=True)]
        full_v = [self._gathered(v, b) for b, v in zip(self.reducer.buckets, self.exp_avg_sq, strict=True)]
        state = {}
        if self.step_count > 0:
            for index, p in enumerate(self._ordered_params()):
                bucket, offset = self.reducer._where[id(p)]
                sl = slice(offset, offset + p.numel())
                if id(p) in self.matrix_ids:  # as torch's Muon, and megalm's on fp32 weights, keep it
                    state[index] = {"momentum_buffer": full_m[bucket.index][sl].view_as(p).clone()}
                    continue
                state[index] = {"step": torch.tensor(float(self.step_count), dtype=torch.float32),
                                "exp_avg": full_m[bucket.index][sl].view_as(p).clone(),
                                "exp_avg_sq": full_v[bucket.index][self._second_at.get(id(p), sl)].view_as(p).clone()}
        return {"state": state, "param_groups": self._state_dict_groups()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full (any-DP-size, or torch AdamW) state: each rank keeps the slices it owns.

        torch AdamW keeps one step counter per parameter; this optimizer has one for all (every
        parameter steps every time), so the largest saved counter is used.
        """
        self.finish_param_gather()  # a gather still in flight would overwrite weights loaded beside this state
        params = self._ordered_params()
        self._load_group_settings(state_dict["param_groups"])
        steps = [0]
        for m in self.exp_avg + self.exp_avg_sq:
            m.zero_()
        for index, per_param in state_dict["state"].items():
            p = params[int(index)]
            keys = self._checked_state(int(index), p, per_param)
            matrix = id(p) in self.matrix_ids
            if not matrix:
                steps.append(int(float(per_param["step"])))
            bucket, _ = self.reducer._where[id(p)]
            for seg in bucket.segments:
                if seg.param is p:
                    self.exp_avg[bucket.index][seg.shard_slice] = per_param[keys[0]].reshape(-1)[seg.param_slice]
                    if not matrix:
                        self.exp_avg_sq[bucket.index][self._second_at.get(id(p), seg.shard_slice)] = \
                            per_param["exp_avg_sq"].reshape(-1)[seg.param_slice]
        self.step_count = max(steps)


def forward_owners(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Where a forward first reads each parameter, as (module, parameters) for `overlap_param_gather_with`, in
    forward order: each model chunk's root the embeddings' (a pipeline's last stage holds a tied embedding's weight
    without running the embedding's forward: its root waits for it too), each TransformerBlock its own (its hooks
    stay outside a compiled block's graph), and the final norm the head's (its weight, the output projection's or
    the tied embedding's: `GPT.head` runs the norm first). The head's buckets are the last all-gathers launched:
    waited for by the root, the first wait would hold the whole forward until every gather had landed."""
    owners = []
    for chunk in model_chunks(model):
        blocks = [m for m in chunk.modules() if isinstance(m, TransformerBlock)]
        final_norm, output = getattr(chunk, "final_norm", None), getattr(chunk, "output", None)
        head = [*(final_norm.parameters() if final_norm is not None else ()),
                *(output.parameters() if output is not None else ())]
        later = {id(p) for block in blocks for p in block.parameters()} | {id(p) for p in head}
        owners += [(chunk, [p for p in chunk.parameters() if id(p) not in later])]
        owners += [(block, list(block.parameters())) for block in blocks]
        if final_norm is not None:
            tied = [chunk.embedding.weight] if output is None and getattr(chunk, "embedding", None) is not None else []
            owners += [(final_norm, head + tied)]
    return owners
