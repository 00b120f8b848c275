"""Pipeline parallelism: the stage model of one pipeline rank and the runtime that executes a schedule.

Hand-written rather than torch.distributed.pipelining (docs/architecture.md says why: its stages fix
activation shapes once, its action set is closed, and its split backward bypasses the hooks our DP
reducer relies on). The pieces, each in its own file:

- `stages.py`      which layers each (rank, chunk) holds, and the chunks themselves;
- `actions.py`     a schedule's data: `Action`, and `Schedule`'s per-rank action lists;
- `schedules.py`   the generators (1F1B, interleaved 1F1B, ZB-H1), validated as data;
- `p2p.py`         batched point-to-point sends sized from the micro-batch (`exchange_known`), so micro-batches
                   may differ in token count;
- `rendezvous.py`  NCCL's rule that a send may wait for its receive: batches of sends and receives;
- `weight_grad.py` the B/W split of zero-bubble schedules;
- this file        runs one rank's action list.

Data: every pipeline rank reads the same micro-batches itself (the global batch is a function of
(seed, step) only), so only hidden states and their gradients travel between stages; token ids,
positions, document boundaries and labels are local. The first stage embeds, the last stage computes
`loss_sum / n_loss_tokens` (the global-batch normaliser, docs/architecture.md) and starts each
micro-batch's backward from it. Gradients accumulate over micro-batches as in one process.

Tied embeddings (GPT-2): the first stage holds the embedding and the last stage a copy for the output
head, initialised identically (weights are drawn by name). After the backward the DP reducer sums their
gradients over `mesh.embedding_group` (the two ranks) before its own reduction (`tied_embedding`), so
both copies take the same update, sharded by ZeRO-1 or not; the gradient norm counts the weight once
(`tied_embedding_copy` names the copy, whose share is 0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from megalm.parallel.dims import ParallelMesh
from megalm.parallel.microbatch import LocalMicroBatch
from megalm.parallel.pipeline.actions import Action, Schedule
from megalm.parallel.pipeline.p2p import exchange_known, pipeline_peer
from megalm.parallel.pipeline.rendezvous import steps, with_comm
from megalm.parallel.pipeline.schedules import build_schedule, forward_only, validate
from megalm.parallel.pipeline.weight_grad import WeightGradStore, defer_weight_grads

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Key = tuple[int, int]  # (micro_batch, chunk)


class MemoryHooks(Protocol):
    """What activation offload plugs into the runtime (the offload feature implements it).

    `select(schedule)` names the (pp_rank, micro_batch, chunk) whose activations to offload; the runtime
    inserts OFFLOAD/RELOAD actions for them (`Schedule.with_offload`), calls `start_step()` before a
    training step, runs each F inside `forward_context(key, micro_batch)` (saved-tensor hooks that can take
    over the activations), calls `offload(key)` / `reload(key)` where the schedule says, and `release(key)` after
    the micro-batch's B.
    """

    def select(self, schedule: Schedule) -> set[tuple[int, int, int]]: ...

    def start_step(self) -> None: ...

    def release(self, key: Key) -> None: ...

    def forward_context(self, key: Key, micro_batch: LocalMicroBatch) -> contextlib.AbstractContextManager: ...

    def offload(self, key: Key) -> None: ...

    def reload(self, key: Key) -> None: ...


def tied_embedding_copy(chunks: nn.ModuleList) -> nn.Parameter | None:
    """The last stage's copy of a tied embedding (None when this rank has none or holds the original)."""
    holds_first = any(chunk.is_first_stage for chunk in chunks)
    for chunk in chunks:
        if chunk.is_last_stage and chunk.cfg.tie_embeddings and not holds_first:
            return chunk.embedding.weight
    return None


def executed_schedule(name: str, pp: int, num_micro_batches: int, vpp: int = 1,
                      memory_hooks: MemoryHooks | None = None) -> Schedule:
    """The validated action lists a training step runs: schedule `name` with its SEND/RECV actions, and the
    OFFLOAD/RELOAD actions of what `memory_hooks` selects on that list (megalm-plot schedule draws this one)."""
    sched = with_comm(build_schedule(name, pp, num_micro_batches, vpp))
    if memory_hooks is not None:
        sched = sched.with_offload(memory_hooks.select(sched))
    validate(sched)
    return sched


class PipelineRuntime:
    """Runs one pipeline rank's action list per step: forward, backward (and W) of its chunks.

    `run_micro_batches(micro_batches, n_loss_tokens, step)` trains on this rank's micro-batches (gradients
    accumulate into the chunks' parameters, through the DP reducer's hooks as usual) and returns the
    summed token loss (non-zero on the last stage only). `forward_only(micro_batches)` is the
    evaluation pass. The schedule is rebuilt for every new micro-batch count, so steps may differ in
    their number of micro-batches (and micro-batches in their number of tokens).

    `forward_context()` is entered around every F (autocast, precision); `before_forward(chunk, step,
    index)` runs before each training F (seeds random rounding by the micro-batch's index in the step);
    `before_backward(chunk, last)` before each B, `last` on the chunk's last B of the step (FSDP defers its
    reductions to it).
    With `schedule="zb"` the chunks' linear layers defer their weight gradients to W (weight_grad.py).
    """

    def __init__(self, chunks: nn.ModuleList, mesh: ParallelMesh, schedule: str, loss_fn: LossFn,
                 forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 before_forward: Callable[[nn.Module, int, int, int], None] | None = None,
                 device: torch.device | str = "cpu", memory_hooks: MemoryHooks | None = None,
                 activation_shape: Callable[[LocalMicroBatch], tuple[int, ...]] | None = None,
                 activation_dtype: torch.dtype = torch.float32,
                 before_backward: Callable[[nn.Module, bool], None] | None = None) -> None:
        self.chunks, self.mesh, self.schedule_name = chunks, mesh, schedule
        self.vpp = len(chunks)
        self.loss_fn, self.forward_context, self.device = loss_fn, forward_context, torch.device(device)
        self.before_forward, self.before_backward = before_forward, before_backward
        # What one stage hands the next: [tokens of the micro-batch on this rank, hidden] (the residual stream
        # keeps the parameters' dtype under autocast); its gradient has the same shape and dtype.
        hidden = chunks[0].cfg.hidden_size
        self.activation_shape = activation_shape or (lambda mb: (mb.batch.num_tokens, hidden))
        self.activation_dtype = activation_dtype
        self.store: WeightGradStore | None = None
        if schedule == "zb":
            self.store = WeightGradStore()
            defer_weight_grads(chunks, self.store)
        self._schedules: dict[int, Schedule] = {}
        self._eval_schedules: dict[int, Schedule] = {}  # forward_only's, per micro-batch count: built once as well
        self.tied_copy = tied_embedding_copy(chunks)
        self.memory_hooks = memory_hooks
        self.peak_in_flight = 0  # most micro-batch activations held at once in the last step

    def schedule(self, num_micro_batches: int) -> Schedule:
        """The validated schedule (with communication actions) for `num_micro_batches`."""
        if num_micro_batches not in self._schedules:
            self._schedules[num_micro_batches] = executed_schedule(
                self.schedule_name, self.mesh.dims.pp, num_micro_batches, self.vpp, self.memory_hooks)
        return self._schedules[num_micro_batches]

    # ------------------------------------------------------------------ execution

    def run_micro_batches(self, micro_batches: list[LocalMicroBatch], n_loss_tokens: int | torch.Tensor,
                          step: int = 0) -> torch.Tensor:
        """Forward and backward of every micro-batch by the schedule."""
        if not micro_batches:
            return torch.zeros((), device=self.device)
        sched = self.schedule(len(micro_batches))
        return self._execute(sched, sched.actions[self.mesh.pp_rank], micro_batches, n_loss_tokens, step)

    @torch.no_grad()
    def forward_only(self, micro_batches: list[LocalMicroBatch]) -> torch.Tensor:
        """Summed token loss of the micro-batches (last stage; 0 elsewhere): forwards in `forward_only`'s order."""
        if not micro_batches:
            return torch.zeros((), device=self.device)
        n = len(micro_batches)
        if n not in self._eval_schedules:  # each evaluation has the same counts: its early-receive search runs once
            self._eval_schedules[n] = with_comm(forward_only(self.mesh.dims.pp, n, self.vpp))
        sched = self._eval_schedules[n]
        return self._execute(sched, sched.actions[self.mesh.pp_rank], micro_batches, 1, None)

    def _execute(self, sched: Schedule, actions: list[Action], micro_batches: list[LocalMicroBatch],
                 n_loss_tokens: int | torch.Tensor, step: int | None) -> torch.Tensor:
        """Run `actions`; `step` is None for a forward-only pass. Compute actions run one by one; each run of
        communication between two of them is one batch of sends and receives, posted together and waited
        for (NCCL may hold a send until its receive is posted: rendezvous.py), then its memory actions."""
        train = step is not None
        rank, last = self.mesh.pp_rank, sched.num_virtual_stages - 1
        inputs: dict[tuple[int, int], torch.Tensor] = {}  # received activations (leaves)
        outputs: dict[tuple[int, int], torch.Tensor] = {}  # chunk outputs (the last stage: scaled loss)
        output_grads: dict[tuple[int, int], torch.Tensor] = {}
        input_grads: dict[tuple[int, int], torch.Tensor] = {}
        loss = torch.zeros((), device=self.device)
        hooks = self.memory_hooks if train else None
        if hooks:
            hooks.start_step()
        last_backward = {a.chunk: a for a in actions if a.kind == "B"}  # each chunk's last B (later ones overwrite)
        self.peak_in_flight = 0
        for item in steps(actions):
            action = " + ".join(map(str, item)) if isinstance(item, tuple) else str(item)
            self.mesh.progress.note(pipeline_action=action)
            if isinstance(item, tuple):
                self._communicate(item, micro_batches, outputs, input_grads, inputs, output_grads, train)
                for a in item:
                    if a.kind == "OFFLOAD" and hooks:
                        hooks.offload((a.micro_batch, a.chunk))
                    elif a.kind == "RELOAD" and hooks:
                        hooks.reload((a.micro_batch, a.chunk))
                continue
            a, key = item, (item.micro_batch, item.chunk)
            stage = sched.stage_of(rank, a.chunk)
            if a.kind == "F":
                mb = micro_batches[a.micro_batch]
                x = None if stage == 0 else inputs[key] if train else inputs.pop(key)
                chunk = self.chunks[a.chunk]
                if train and self.before_forward is not None:
                    self.before_forward(chunk, step, mb.index, mb.ring_position)
                with self.forward_context(), hooks.forward_context(key, mb) if hooks else contextlib.nullcontext():
                    out = mb.run(chunk, x)
                if stage == last:
                    loss_sum = self.loss_fn(out, mb.batch.labels, mb.batch.loss_mask)
                    loss += loss_sum.detach()
                    out = loss_sum / n_loss_tokens
                if train or stage != last:
                    outputs[key] = out
                    self.peak_in_flight = max(self.peak_in_flight, len(outputs))
            elif a.kind == "B":
                out, grad = outputs.pop(key), output_grads.pop(key, None)
                if self.before_backward is not None:
                    self.before_backward(self.chunks[a.chunk], a is last_backward[a.chunk])
                with self.store.collect(key) if self.store is not None else contextlib.nullcontext():
                    torch.autograd.backward(out, grad)
                if hooks:
                    hooks.release(key)
                x = inputs.pop(key, None)
                if stage > 0:
                    input_grads[key] = x.grad
            elif a.kind == "W":
                self.store.apply(key)
            else:
                raise RuntimeError(f"the pipeline runtime cannot execute {a}")
        if outputs or output_grads or input_grads or (self.store is not None and self.store.pending):
            raise RuntimeError(f"{sched.name}: step ended with work left on pipeline rank {rank}")
        return loss

    def _communicate(self, batch: tuple[Action, ...], micro_batches: list[LocalMicroBatch], outputs: dict,
                     input_grads: dict, inputs: dict, output_grads: dict, train: bool) -> None:
        """One batch of the schedule's SEND/RECV actions, posted together (`p2p.exchange_known`) and
        completed. Activations and their gradients between stages are [tokens, hidden] in
        `activation_dtype`; both sides know the micro-batch, so no shape header is needed."""
        sends, receives = [], []
        for a in batch:
            key, peer = (a.micro_batch, a.chunk), None if a.peer is None else pipeline_peer(self.mesh, a.peer)
            if a.kind == "SEND_F":
                sends.append((outputs[key] if train else outputs.pop(key), peer))
            elif a.kind == "SEND_B":
                sends.append((input_grads.pop(key), peer))
            elif a.kind in ("RECV_F", "RECV_B"):
                receives.append((a, peer))
        if not sends and not receives:
            return
        shapes = [self.activation_shape(micro_batches[a.micro_batch]) for a, _ in receives]
        for tensor, _ in sends:  # both sides must agree without a header: a mismatch is a megalm bug
            if tensor.dtype != self.activation_dtype:
                raise RuntimeError(f"pipeline stage output is {tensor.dtype}, the receiver expects "
                                   f"{self.activation_dtype}")
        received = exchange_known(sends, [(peer, shape, self.activation_dtype)
                                          for (_, peer), shape in zip(receives, shapes, strict=True)],
                                  device=self.device, progress=self.mesh.progress)
        for (a, _), tensor in zip(receives, received, strict=True):
            key = (a.micro_batch, a.chunk)
            if a.kind == "RECV_F":
                inputs[key] = tensor.requires_grad_(train)
            else:
                output_grads[key] = tensor

    # ------------------------------------------------------------------ after the backward

    def tied_embedding(self) -> tuple[nn.Parameter, dist.ProcessGroup] | None:
        """This rank's copy of a tied embedding and the group of its two copies (first and last stage), whose
        gradients the DP reducer sums before its own reduction (`GradReducer(presum=...)`); None elsewhere."""
        group = self.mesh.embedding_group
        if group is None or not any(c.cfg.tie_embeddings for c in self.chunks):
            return None
        return next(c.embedding.weight for c in self.chunks if c.embedding is not None), group
