"""An MoE router's view of a zigzag-sharded micro-batch: which of this rank's tokens are real, where each sits in
the whole micro-batch, and the whole's rows gathered over the CP ring.

The router's capacity queues (first come in the micro-batch's token order) and its switch and sequence losses
(routed counts per expert, per document) are functions of the whole micro-batch, not of a shard
(megalm/model/moe.py, `TokenShard`). Under context parallelism each rank holds a zigzag shard; one all-gather of
the chosen experts (small ints) over the ring gives every rank the whole's choices in the padded stream's order
(zigzag.py: documents in order, each padded at its end), where padding is masked out, so each rank routes its shard
exactly as one process routes the whole micro-batch. HDP's rings are rank lists with no group of their own: there
the gather is the p2p all-to-all of hierarchical CP (every slot the same rows), on the default group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalm import compat
from megalm.parallel.collectives import all_gather_flat
from megalm.parallel.context.hierarchical import p2p_all_to_all
from megalm.parallel.context.zigzag import ZigzagLayout
from megalm.parallel.progress import Progress, note_collective


class RingTokens:
    """`TokenShard` of this rank's zigzag shard (`layout`, position `index` of its ring, `real` its tokens that are
    not padding) over the ring's `group`, or with no group (HDP) p2p over the ring's global `ranks`."""

    def __init__(self, layout: ZigzagLayout, index: int, real: torch.Tensor, group: dist.ProcessGroup | None,
                 progress: Progress | None = None, ranks: tuple[int, ...] = ()) -> None:
        self.layout, self.real, self.group, self.progress = layout, real, group, progress
        self.meta = compat.host_tensor([index, *ranks]) if group is None else None  # p2p_all_to_all's
        self.local_index = layout.indices[index]
        self.whole_tokens = layout.padded_tokens
        self.num_docs = layout.chunk_sizes.numel()

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of `t` [T_local, ...] placed in the padded stream's order [T_whole, ...] (detached)."""
        n, local = self.layout.n, t.shape[0]
        flat = t.detach().reshape(-1)
        note_collective(self.progress, "all_gather (MoE routing over the CP ring)", n)
        if self.group is None:
            out = p2p_all_to_all(flat.expand(n, -1), self.meta).reshape(-1)
        else:
            out = flat.new_empty(n * flat.numel())
            all_gather_flat(out, flat.contiguous(), group=self.group)
        whole = out.new_empty(self.whole_tokens, *t.shape[1:])
        whole[self.layout.indices.reshape(-1)] = out.view(n * local, *t.shape[1:])
        return whole

    @property  # computed where read, each time (megalm/model/moe.py, WholeTokens)
    def local_docs(self) -> torch.Tensor:
        return self._docs(2 * self.layout.chunk_sizes, self.layout.local_tokens)

    @property
    def whole_docs(self) -> torch.Tensor:
        return self._docs(2 * self.layout.n * self.layout.chunk_sizes, self.whole_tokens)

    def _docs(self, lengths: torch.Tensor, total: int) -> torch.Tensor:
        """Each token's document, for documents of `lengths` tokens (`total` of them: no host read)."""
        docs = torch.arange(self.num_docs, device=lengths.device)
        return docs.repeat_interleave(lengths, output_size=total)
