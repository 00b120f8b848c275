"""An async save is published at a step boundary only once every rank's background write has ended: a rank whose
thread is still writing holds every rank back (the publish renames the directory the slow rank writes into)."""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist

from megalm.training.checkpoint.save import Checkpointer, PendingCheckpoint
from tests.dist.launch import run_distributed


def _poll(rank: int, world_size: int, out: str) -> None:
    checkpointer = Checkpointer(Path(out), keep_last=1)
    checkpointer._poll_group = dist.new_group(backend="gloo")  # as its first distributed async save makes it
    future: Future = Future()
    if rank == 0:
        future.set_result(None)  # rank 0 has written its files; rank 1 is still writing
    published: list[int] = []
    checkpointer.pending = PendingCheckpoint(Path(out) / "step_00000002", future, lambda: published.append(rank))
    seen = [checkpointer.publish_if_written()]
    if rank == 1:
        future.set_result(None)
    dist.barrier()
    seen.append(checkpointer.publish_if_written())
    Path(f"{out}.rank{rank}").write_text(json.dumps({"seen": [str(s) if s else None for s in seen],
                                                     "published": published}))


def test_a_rank_still_writing_holds_every_rank_back(tmp_path):
    run_distributed(_poll, 2, str(tmp_path), timeout=120)
    for rank in range(2):
        result = json.loads(Path(f"{tmp_path}.rank{rank}").read_text())
        assert result == {"seen": [None, str(tmp_path / "step_00000002")], "published": [rank]}, (rank, result)
