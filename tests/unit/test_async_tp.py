"""`megalm.parallel.tensor.async_tp`'s checks, without processes: where torch's fused collective GEMMs cannot run,
the run says why and compiles its blocks without the pass (tests/dist/test_async_tp.py trains with it)."""

from __future__ import annotations

import logging

import pytest

from megalm.parallel.tensor import async_tp


class Group:
    """What the checks read of a process group: its size (its backend through dist.get_backend, patched)."""

    def __init__(self, size: int) -> None:
        self._size, self.group_name = size, "tp"

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("backend, ranks, local, problem", [
    ("gloo", 2, None, "backend is gloo"),
    ("nccl", 16, "8", "16 ranks span nodes"),
    ("nccl", 8, "8", None),
    ("nccl", 4, "6", "4 ranks span nodes"),  # ranks 4-7 straddle two 6-GPU nodes
    ("nccl", 8, None, None),  # not under torchrun: nothing says where the ranks are
    ("fake", 8, None, None),  # megalm-estimate's ranks, in NCCL's place (it checks the node's width itself)
    ("cuda:nccl,cpu:gloo", 8, "8", None),  # parallel.fsdp_cpu_offload's world: CUDA tensors on NCCL (an audit)
    ("cuda:nccl,cpu:gloo", 16, "8", "16 ranks span nodes"),
    ("cpu:gloo", 2, None, "backend is cpu:gloo"),
])
def test_where_the_fused_ops_cannot_run(monkeypatch, caplog, backend, ranks, local, problem):
    monkeypatch.setattr(async_tp.dist, "get_backend", lambda group: backend)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    enabled = []
    monkeypatch.setattr(async_tp, "enable_symmetric_memory", enabled.append)
    found = async_tp.async_tp_problem(Group(ranks))
    assert (found is None) if problem is None else (problem in found), found
    with caplog.at_level(logging.INFO, logger="megalm"):
        options = async_tp.async_tp_inductor_config(Group(ranks))
    assert options == ({} if problem else {"_micro_pipeline_tp": True})
    assert len(enabled) == (0 if problem else 1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("parallel.async_tp")]
    assert len(lines) == 1 and (problem is None or problem in lines[0]), lines


def test_a_one_rank_mesh_has_nothing_to_fuse():
    assert async_tp.async_tp_inductor_config(None) == {}
