"""Muon for the transformer blocks' matrices, AdamW for the rest: one torch optimizer (`optim.name=muon`).

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; at LLM scale Liu et al. 2025,
"Muon is Scalable for LLM Training"): keep a momentum M of each matrix's gradient G (M ← μM + (1 − μ)G; Nesterov:
step along (1 − μ)G + μM), replace it by its orthogonal factor (U·Vᵀ of its SVD, approximated by a quintic
Newton-Schulz iteration with coefficients (3.4445, −4.7750, 2.0315) on the Frobenius-normalised matrix), scale it per
matrix, and apply it with decoupled weight decay: W ← W(1 − lr·wd) − lr·s·O, s = 0.2·√max(rows, cols) (Moonlight's,
the RMS of an AdamW update, so that one lr and weight decay serve both) or √max(1, rows/cols) (the original). The
embedding, the output layer, the router, norms and biases step with AdamW, as the authors do.

Hand-written beside torch.optim.Muon (torch 2.9+) for two reasons. It orthogonalises the tensors it is given, and a
TP shard, or q, k and v fused in one projection, are not the matrices: megalm/parallel/matrices.py gathers and splits
them (`WholeMatrices`), so that every layout takes one process's step. And its iteration runs in bf16, megalm's in
fp32, so that those layouts match one process to fp32 tolerance (tests/dist/test_muon.py). The AdamW groups step with
torch's functional AdamW (its fused kernel on CPU and CUDA, as `build_optimizer`'s).

The data-parallel ranks share the iterations out, each matrix orthogonalised by one of them and broadcast
(megalm/parallel/matrices.py says why and what it saves). Layouts: whatever keeps whole gradients on every rank: tp
(with sequence parallelism), pp, dp, cp, HDP and ep. On fp32 weights (precision=fp32, bf16_autocast) `Muon` steps
the parameters; on bf16 working weights (precision=bf16, the fp8/mx recipes on bf16 weights) BucketAdamW steps the
fp32 main weights behind them, its matrix groups with `MuonMatrices` on views of its flat buckets
(megalm/parallel/data_parallel/bucket_adamw.py). ZeRO-1's flat shards would cut the matrices: under Muon it shards
the optimizer by whole matrices instead (megalm/parallel/data_parallel/layerwise.py). FSDP's shards cut them too:
refused in one line (megalm/training/validation.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw

from megalm.parallel.matrices import WholeMatrices, share_out

NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)  # Jordan et al.'s quintic: fast to ~[0.7, 1.2] singular values
IN_FLIGHT_BYTES = 256 * 2**20  # the broadcast updates a step holds before applying them (`MuonMatrices`)


def orthogonalise(matrix: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """An approximation of U·Vᵀ, the orthogonal factor of `matrix` (or of each of a stack of them, on the last two
    dims), by `steps` Newton-Schulz iterations in fp32."""
    x = matrix.float()
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the wide orientation: the Gram matrix x·xᵀ is the smaller one
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)  # Frobenius norm >= spectral norm: singular values <= 1
    a, b, c = NEWTON_SCHULZ
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def update_scale(rows: int, cols: int, scale: str) -> float:
    """The factor of a (rows, cols) matrix's orthogonalised update (`optim.muon_scale`)."""
    if scale == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


class MuonMatrices:
    """Muon's step of the matrices (`Muon`'s own, and BucketAdamW's on the fp32 main weights behind bf16 working
    weights, megalm/parallel/data_parallel/bucket_adamw.py): called with a param group's settings and, per parameter,
    the fp32 weight to update in place, its gradient and its momentum. `matrices` holds each parameter's
    `WholeMatrices`; `params` the matrix parameters, in the same order on every rank, which fixes who among the
    data-parallel replicas orthogonalises each (`share_out`)."""

    def __init__(self, matrices: dict[int, WholeMatrices], params: list[torch.Tensor]) -> None:
        if missing := [tuple(p.shape) for p in params if id(p) not in matrices]:
            raise ValueError(f"a Muon parameter of shape {missing[0]} has no WholeMatrices")
        self.matrices = matrices
        self.owners = dict(zip(map(id, params), share_out([matrices[id(p)] for p in params]), strict=True))

    @torch.no_grad()
    def __call__(self, group: dict, params: list[torch.Tensor], weights: list[torch.Tensor],
                 grads: list[torch.Tensor], momenta: list[torch.Tensor], grad_scale: torch.Tensor | None = None,
                 owned_only: bool = False) -> None:
        """Every rank updates its momenta (from the gradients divided by `grad_scale`, a clip's inverse coefficient,
        when given); each matrix's orthogonalised update is computed by its owner among the data-parallel replicas
        (with its TP group, which gathers it whole) and broadcast to the others; then the weights step. `owned_only`:
        `params` are the ones this rank owns, whose momenta it alone keeps, and the caller sends the new weights to
        the other replicas (megalm/parallel/data_parallel/layerwise.py)."""
        lr, momentum = group["lr"], group["momentum"]
        pending: list[tuple[torch.Tensor, torch.Tensor, dist.Work | None]] = []  # (weight, its update, broadcast)

        def apply_pending() -> None:
            for weight, update, work in pending:
                if work is not None:
                    work.wait()
                weight.mul_(1 - lr * group["weight_decay"])
                weight.add_(update.view_as(weight), alpha=-lr)
            pending.clear()

        for p, weight, grad, buf in zip(params, weights, grads, momenta, strict=True):  # the same order on every rank:
            grad = grad.float() if grad_scale is None else grad.float() / grad_scale  # the gathers and broadcasts pair
            buf.lerp_(grad, 1 - momentum)
            layout, owner = self.matrices[id(p)], None if owned_only else self.owners[id(p)]
            if owner is None or owner == dist.get_rank():
                direction = grad.lerp(buf, momentum) if group["nesterov"] else buf
                full = torch.cat([orthogonalise(m, group["ns_steps"]) * update_scale(m.size(-2), m.size(-1),
                                                                                      group["scale"])
                                  for m in layout.split(layout.gather(direction))], dim=-2)
                update = layout.scatter(full).to(buf.dtype).contiguous()
            else:
                update = torch.empty_like(buf)
            pending.append((weight, update, None if owner is None else dist.broadcast(
                update, owner, group=layout.replicas, async_op=True)))
            # the updates in flight are applied once they pass IN_FLIGHT_BYTES: the step holds no fp32 update of
            # every matrix at once (4 bytes a parameter more)
            if sum(u.numel() * u.element_size() for _, u, _ in pending) >= IN_FLIGHT_BYTES:
                apply_pending()
        apply_pending()


class Muon(torch.optim.Optimizer):
    """Muon over the param groups marked `"muon": True` (with their settings `momentum`, `nesterov`, `ns_steps` and
    `scale`; `update` holds each parameter's `WholeMatrices`), AdamW over the others. A torch optimizer: its
    state_dict, hooks and param groups are torch's, so checkpoints save, reshard and resume it as they do AdamW (per
    parameter: `momentum_buffer`, or AdamW's `step`, `exp_avg`, `exp_avg_sq`, laid out like the parameter). The state
    is made at once, so that a checkpoint's loader sees its shape before the first step."""

    def __init__(self, groups: list[dict], update: MuonMatrices, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 fused: bool = False) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "muon": False}
        super().__init__(groups, defaults)
        self.update, self.matrices, self.fused = update, update.matrices, fused
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = ({"momentum_buffer": torch.zeros_like(p)} if group["muon"] else
                                 {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                  "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError("Muon.step takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["muon"]:
                self.update(group, params, params, [p.grad for p in params],
                            [self.state[p]["momentum_buffer"] for p in params])
            else:
                self._adamw(group, params)

    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
              [], [s["step"] for s in states], fused=self.fused, foreach=None if self.fused else True,
              amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
              eps=group["eps"], maximize=False)
