"""tools/bench/comm_volume.py counts the collectives of whatever torch runs it: a collective an older torch lacks
(`all_gather_single` and `reduce_scatter_single` came after 2.11, the floor) is left out, not an AttributeError
in every rank (README's command failed so on torch 2.11)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from tools.bench import comm_volume


def test_counters_wrap_the_collectives_this_torch_has_and_count_them(monkeypatch):
    for module in (dist, distributed_c10d):  # restored after the test: install_counters replaces them
        for name in comm_volume.COUNTED:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.delattr(dist, "all_gather_single", raising=False)  # as on torch 2.11
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *args, **kwargs: calls.append(tensor))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    counters = comm_volume.Counters()
    comm_volume.install_counters(counters)
    assert not hasattr(dist, "all_gather_single") and not hasattr(dist, "reduce_scatter_single")
    counters.on = True
    dist.all_reduce(torch.zeros(10))
    assert len(calls) == 1
    assert counters.stats["all_reduce[world]"] == [1, 40, 40 * 2 * 3 / 4]
