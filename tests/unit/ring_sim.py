"""A zigzag ring simulated in one process, for the tests of the ring's block kernels: every rank's forward
steps (merging each block's output by its log-sum-exp) and backward steps, no communication."""

from __future__ import annotations

import torch

from megalm.parallel.context.ring import ring_step_backward, ring_step_forward


def simulated_ring(shards, layout, scale: float, kernel: str):
    """Every rank's ring steps in one process: the outputs, and each rank's (dq, dk, dv)."""
    n = len(shards)
    outs, lses, grads = [], [], [[torch.zeros(t.shape) for t in shard] for shard in shards]
    for r in range(n):
        out, lse = torch.zeros(shards[r][0].shape), torch.full(shards[r][0].shape[:2], float("-inf"))
        for j in range(n):
            s = (r - j) % n
            ring_step_forward(shards[r][0], shards[s][1], shards[s][2], out, lse, layout, r, s, scale, kernel)
        outs.append(out)
        lses.append(lse)
    for r in range(n):
        dout = torch.full_like(outs[r], 0.5) + torch.arange(outs[r].shape[0])[:, None, None] / 7
        for s in range(n):
            ring_step_backward(dout, shards[r][0], shards[s][1], shards[s][2], outs[r], lses[r], grads[r][0],
                               grads[s][1], grads[s][2], layout, r, s, scale, kernel)
    return outs, grads
