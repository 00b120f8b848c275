"""ZeRO-1 for Muon: the optimizer sharded by whole matrices over the data-parallel replicas.

ZeRO-1 (bucket_adamw.py) cuts each flat gradient bucket into equal contiguous shards, one per replica: AdamW is
elementwise and steps any cut, but Muon orthogonalises whole matrices, which those cuts split. Megatron-Core's
LayerWiseDistributedOptimizer shards by parameter instead, and so does this one under `optim.name=muon
parallel.zero1=true`: the reducer all-reduces the gradients (every replica holds them whole, as under plain data
parallelism), each parameter is owned by one replica, which alone keeps its optimizer state (and its fp32 main weight
behind bf16 working weights) and steps it: Muon for the transformer blocks' matrices (`MuonMatrices`), AdamW for the
rest. AdamW's parameters of two or more dimensions are cut into a block of rows a replica instead (AdamW is
elementwise): whole, the embedding's and the output layer's states, the largest of a model, landed on one replica
each, which then orthogonalised fewer matrices, and every replica's step waited for the others' (1.3B at dp 8: two
replicas did 1.9 TFLOP of Newton-Schulz iterations a step, the six others 9.9-10.2, against an even 8.0). The
pieces are shared out by state bytes, the largest first to the least loaded replica (a replica's share is within one
piece's of the mean; with no lump left its share of the iterations is about as even where the matrices are of
similar shapes, as in a dense model's blocks: 8.0 TFLOP each at 1.3B, dp 8).
Then each owner broadcasts the piece's new working weight to the other replicas, one broadcast a piece (not
coalesced into buckets, as Megatron's all-gather is), in the order the next forward reads them, and each is waited
for before the first module that reads it (`overlap_param_gather_with`, `parallel.overlap_param_gather`, as
ZeRO-1's all-gather is), or in the step.

Bytes a parameter, d replicas, bf16 working weights: 2 (weight) + 4 (fp32 gradient bucket) + (4 main + 4 momentum)/d
for a matrix, + (4 + 8)/d for an AdamW one: against 14 and 18 unsharded. Communication: the gradients' all-reduce
(a reduce-scatter and an all-gather) and one broadcast of each weight (an all-gather's bytes): ZeRO-1's, plus one
all-gather of the gradients. The broadcasts write into the working weights (no buffer), so a weight is stale, not
merely late, until its wait: whatever reads the parameters outside a forward calls `finish_param_gather` first.

Hand-written: torch's ZeroRedundancyOptimizer also shards by parameter, but steps one torch optimizer class over
fp32 parameters, not Muon on whole TP-gathered matrices beside AdamW, nor fp32 main weights behind bf16 ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.adamw import adamw

from megalm.parallel.data_parallel.optimizer_face import TorchOptimizerFace
from megalm.parallel.data_parallel.reducer import GradReducer
from megalm.parallel.matrices import share_out


@dataclass(frozen=True, eq=False)
class _Piece:
    """What one replica steps and broadcasts: a parameter whole, or a block of an AdamW parameter's rows (`rows`).
    `cost` (its state's bytes) and `replicas` are what `share_out` balances it by."""

    param: nn.Parameter
    rows: slice | None
    cost: int
    replicas: dist.ProcessGroup | None

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The piece's part of `tensor` (shaped like the parameter): a view."""
        return tensor if self.rows is None else tensor[self.rows]


def row_blocks(rows: int, blocks: int) -> list[slice]:
    """`rows` cut into `blocks` contiguous blocks as even as can be (the first rows % blocks one row longer)."""
    size, extra = divmod(rows, blocks)
    bounds = [0]
    for i in range(blocks):
        bounds.append(bounds[-1] + size + (i < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


class LayerwiseOptimizer(TorchOptimizerFace):
    """Muon (param groups marked `"muon": True`, stepped by `matrix_update`) and AdamW (the others) over the pieces
    this rank owns among its replicas (`replicas`: {id(parameter): the data-parallel group whose reduced gradients of
    it are the same}): the matrices whole, an AdamW parameter of 2 or more dimensions cut into a block of rows a
    replica (AdamW is elementwise: the embedding and the output layer, the largest parameters of a model, would
    otherwise land whole on one replica each, which then holds their states and orthogonalises fewer matrices);
    every piece's new weight is then broadcast from its owner. Gradients come from `reducer` (not ZeRO-1's: whole
    on every rank). Looks like a torch optimizer where the trainer and the checkpoints need it (`param_groups`,
    `zero_grad`, step hooks, a torch-format `state_dict` of the full state, collective) and like BucketAdamW where
    the bf16 recipe does (`full_precision_weights`, `finish_param_gather`)."""

    def __init__(self, groups: list[dict], reducer: GradReducer, replicas: dict[int, dist.ProcessGroup | None],
                 matrix_update: Callable[..., None], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, working_dtype: torch.dtype | None = None,
                 initial_weights: dict[int, torch.Tensor] | None = None, fused: bool = True) -> None:
        if reducer.zero1:
            raise ValueError("LayerwiseOptimizer reads whole gradients: a GradReducer built with zero1=False")
        self._set_param_groups(groups, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        params = self._ordered_params()
        if {id(p) for p in params} != {id(p) for p in reducer.params} or len(params) != len(reducer.params):
            raise ValueError("LayerwiseOptimizer's parameters must be exactly the reducer's trainable parameters")
        self.reducer, self.matrix_update, self.working_dtype, self.fused = reducer, matrix_update, working_dtype, fused
        # a clip's inverse coefficient, which the step divides the gradients by as it reads them (torch's fused AdamW
        # reads the attribute of this name; set by Parallelism.clip_grad_norm_ when `fused`, cleared after the step)
        self.grad_scale: torch.Tensor | None = None
        self.step_count = 0
        self.replicas = replicas
        # who steps each piece: all of them shared out at once by their state's bytes (the memory ZeRO-1 is for; a
        # matrix's Newton-Schulz work follows its size), the largest first to the least loaded replica. The TP peers
        # of a replica must find the same owners of the matrices they gather together: their shards' sizes are equal
        main = 4 if working_dtype is not None else 0
        self.pieces: dict[int, list[_Piece]] = {}  # id(parameter) -> its pieces, in row order
        for p in params:
            group, per_element = replicas.get(id(p)), main + 4 * len(self._state_keys(p))
            size = dist.get_world_size(group) if group is not None else 1
            cut = id(p) not in self.matrix_ids and p.ndim >= 2 and size > 1 and p.shape[0] >= size
            self.pieces[id(p)] = [_Piece(p, rows, per_element * (p if rows is None else p[rows]).numel(), group)
                                  for rows in (row_blocks(p.shape[0], size) if cut else [None])]
        every = [piece for p in params for piece in self.pieces[id(p)]]
        self.owners: dict[_Piece, int | None] = dict(zip(every, share_out(every), strict=True))
        # the owner of each parameter kept whole (a matrix's: megalm/estimate/muon_form.py reads them)
        self.owner = {id(pieces[0].param): self.owners[pieces[0]] for pieces in self.pieces.values()
                      if pieces[0].rows is None}
        # the weights' broadcasts left in flight after a step (`overlap_param_gather_with`): piece -> work, and the
        # order the next forward reads the pieces in, which the broadcasts are issued in
        self._pending: dict[_Piece, dist.Work] = {}
        self._forward_order: list[_Piece] | None = None
        self.overlaps_param_gather = False
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.owned = [piece for piece in every if self.owners[piece] in (None, rank)]
        # the fp32 main weights of the owned pieces (bf16 working weights), from the values they were cast from
        initial = initial_weights or {}
        self.main: dict[_Piece, torch.Tensor] = {} if working_dtype is None else {
            piece: piece.of(initial.get(id(piece.param), piece.param.detach())).to(torch.float32, copy=True)
            for piece in self.owned}
        if working_dtype is not None:
            for p in params:
                p.data = p.data.to(working_dtype)
        self.state: dict[_Piece, dict[str, torch.Tensor]] = {
            piece: {key: torch.zeros(piece.of(piece.param).shape, dtype=torch.float32, device=piece.param.device)
                    for key in self._state_keys(piece.param)} for piece in self.owned}

    # ------------------------------------------------------------------ the torch optimizer's face

    def finish_param_gather(self, pieces: Iterable[_Piece] | None = None) -> None:
        """Wait for the weights' broadcasts still in flight (all, or those of `pieces`): what a forward pre-hook
        calls for its module's, and anything that reads the parameters outside a forward first (a no-op when none
        is in flight)."""
        for piece in list(self._pending) if pieces is None else pieces:
            work = self._pending.pop(piece, None)
            if work is not None:
                work.wait()

    def _sent(self, params: Iterable[nn.Parameter]) -> list[_Piece]:
        """The pieces of `params` that are broadcast (those with replicas; a parameter the optimizer does not step,
        frozen, has none)."""
        return [piece for p in params for piece in self.pieces.get(id(p), ()) if self.owners[piece] is not None]

    def overlap_param_gather_with(self, owners: Iterable[tuple[nn.Module, list[nn.Parameter]]]) -> int:
        """Leave the weights' broadcasts in flight when `step()` returns, issued in the order of `owners` ((module,
        the parameters its forward reads first): `forward_owners`), each waited for in the forward pre-hook of the
        first module that reads it (Megatron's `overlap_param_gather`). Every broadcast parameter must be some
        owner's, or it would be read stale. Returns how many modules got a hook; 0 where no parameter has
        replicas."""
        sent = set(self._sent(self._ordered_params()))
        if not sent:
            return 0
        hooked, order = 0, {}  # (a dict: the pieces in order, each once)
        for module, params in owners:
            needs = list(dict.fromkeys(piece for piece in self._sent(params) if piece not in order))
            if needs:
                order.update(dict.fromkeys(needs))
                module.register_forward_pre_hook(lambda _module, _args, needs=needs: self.finish_param_gather(needs))
                hooked += 1
        unwaited = sent - order.keys()
        if missing := sorted({i for i, p in enumerate(self._ordered_params()) for piece in self.pieces[id(p)]
                              if piece in unwaited}):
            raise ValueError(f"parameters {missing[:8]} belong to none of the modules given: their broadcasts would "
                             "never be waited for in a forward")
        self._forward_order, self.overlaps_param_gather = list(order), True
        return hooked

    def _weight(self, piece: _Piece) -> torch.Tensor:
        """The fp32 weight this rank steps for owned `piece`: its main weight, or the parameter's own rows."""
        return self.main[piece] if self.working_dtype is not None else piece.of(piece.param.detach())

    # ------------------------------------------------------------------ the update

    @torch.no_grad()
    def step(self) -> None:
        """Each owned piece's step (Muon's or AdamW's), its working copy cast, then every piece's weight broadcast
        from its owner (collective over each parameter's replicas, in the same order on every rank), left in flight
        for the next forward to wait for where `overlap_param_gather_with` set that up."""
        self.finish_param_gather()  # (a forward waited for them all, unless none ran since the last step)
        self._run_hooks(self._pre_hooks)
        self.step_count += 1
        owned = set(self.owned)
        for group in self.param_groups:
            pieces = [piece for p in group["params"] for piece in self.pieces[id(p)] if piece in owned]
            if not pieces:
                continue
            weights = [self._weight(piece) for piece in pieces]
            grads = [piece.of(self.reducer.summed_grad(piece.param)) for piece in pieces]
            if group.get("muon"):  # whole matrices (it reads each gradient in fp32 as it goes)
                self.matrix_update(group, [piece.param for piece in pieces], weights, grads,
                                   [self.state[piece]["momentum_buffer"] for piece in pieces], self.grad_scale,
                                   owned_only=True)
                continue
            # torch's AdamW kernels take fp32 gradients: bf16 ones (parallel.grad_reduce_dtype=bf16) are cast and
            # stepped one piece at a time, never an fp32 copy of every gradient at once
            batches = [range(len(pieces))] if all(g.dtype == torch.float32 for g in grads) else [
                [i] for i in range(len(pieces))]
            for batch in batches:
                self._adamw(group, [weights[i] for i in batch], [grads[i].float() for i in batch],
                            [self.state[pieces[i]] for i in batch])
        if self.working_dtype is not None and self.owned:
            torch._foreach_copy_([piece.of(piece.param.detach()) for piece in self.owned],
                                 [self.main[piece] for piece in self.owned])
        self._pending.update(self._broadcast(lambda p: p.detach(), self._forward_order))
        if not self.overlaps_param_gather:
            self.finish_param_gather()
        self._run_hooks(self._post_hooks)

    def _adamw(self, group: dict, weights: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict]) -> None:
        beta1, beta2 = group["betas"]
        steps = list(torch.full((len(weights),), float(self.step_count - 1), device=weights[0].device).unbind())
        adamw(weights, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [], steps,
              fused=self.fused, foreach=None if self.fused else True, grad_scale=self.grad_scale, amsgrad=False,
              beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
              maximize=False)

    def _broadcast(self, tensor_of: Callable[[nn.Parameter], torch.Tensor],
                   pieces: list[_Piece] | None = None) -> dict[_Piece, dist.Work]:
        """Start broadcasting each of `pieces` (all of them by default) of `tensor_of(its parameter)` (written in
        place on the other replicas) from its owner, in the same order on every rank: {piece: its work}."""
        return {piece: dist.broadcast(piece.of(tensor_of(piece.param)), self.owners[piece], group=piece.replicas,
                                      async_op=True)
                for piece in (self._sent(self._ordered_params()) if pieces is None else pieces)}

    def _from_owners(self, tensor_of: Callable[[nn.Parameter], torch.Tensor],
                     params: list[nn.Parameter] | None = None) -> None:
        """`_broadcast` of the pieces of `params` (all the parameters by default), waited for."""
        self.finish_param_gather()  # a weight's broadcast still in flight would land on what this one writes
        for work in self._broadcast(tensor_of, None if params is None else self._sent(params)).values():
            work.wait()

    # ------------------------------------------------------------------ main weights and checkpoints

    @contextlib.contextmanager
    def full_precision_weights(self) -> Iterator[None]:
        """Inside, every parameter holds its fp32 weight (the owner's main weight, broadcast: collective); on exit the
        owners take their main weights from them (a load writes them) and the working copies are cast again."""
        self.finish_param_gather()
        if self.working_dtype is None:
            yield
            return
        params = self._ordered_params()
        working = [p.data for p in params]  # each parameter's own storage, which it holds again on exit
        with torch.no_grad():
            for p in params:
                p.data = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            for piece in self.owned:
                piece.of(piece.param.data).copy_(self.main[piece])
            self._from_owners(lambda p: p.data)
        try:
            yield
        finally:
            with torch.no_grad():
                for piece in self.owned:
                    self.main[piece].copy_(piece.of(piece.param.data))
                torch._foreach_copy_(working, [p.data for p in params])
                for p, tensor in zip(params, working, strict=True):
                    p.data = tensor

    @torch.no_grad()
    def state_dict(self) -> dict:
        """The full state in torch's format, indices in param-group order (Muon's `momentum_buffer` for a matrix,
        AdamW's `step`, `exp_avg`, `exp_avg_sq` for the others): each owner's broadcast to its replicas (collective),
        so that it loads under any layout, and into `Muon` (megalm/training/muon.py)."""
        params = self._ordered_params()
        full: dict[int, dict[str, torch.Tensor]] = {}
        if self.step_count > 0:
            for p in params:
                full[id(p)] = {k: torch.empty(p.shape, dtype=torch.float32, device=p.device)
                               for k in self._state_keys(p)}
            for piece in self.owned:
                for key, tensor in self.state[piece].items():
                    piece.of(full[id(piece.param)][key]).copy_(tensor)
            for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
                self._from_owners(lambda p, key=key: full[id(p)][key], [p for p in params if key in full[id(p)]])
        state = {}
        for index, p in enumerate(params):
            if id(p) in full:
                state[index] = full[id(p)]
                if "exp_avg" in full[id(p)]:
                    state[index]["step"] = torch.tensor(float(self.step_count), dtype=torch.float32)
        return {"state": state, "param_groups": self._state_dict_groups()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state (any layout's, or `Muon`'s): each rank keeps the pieces it owns."""
        self.finish_param_gather()
        params = self._ordered_params()
        self._load_group_settings(state_dict["param_groups"])
        steps = [0]
        for state in self.state.values():
            for tensor in state.values():
                tensor.zero_()
        for index, per_param in state_dict["state"].items():
            p = params[int(index)]
            for key in self._checked_state(int(index), p, per_param):
                for piece in self.pieces[id(p)]:
                    if piece in self.state:
                        self.state[piece][key].copy_(piece.of(per_param[key]))
            if "step" in per_param:
                steps.append(int(float(per_param["step"])))
        self.step_count = max(steps)

