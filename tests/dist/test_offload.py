"""PipeOffload in the pipeline schedule: bit-identical to no offload, and freeing what the schedule says.

Each worker runs the pipelined trainer without and with `offload.enabled` (every policy, and with the cheap
activations recomputed instead of stored), on the same seed and data in one process: losses and parameters after 3
optimizer steps must be identical to the bit (the copies are exact, and offload changes no computation). The store's
own peak of device-resident activation bytes in the last step must equal the theory: `resident_profile` of the
schedule the runtime ran (its OFFLOAD / RELOAD actions), weighted by the bytes each micro-batch-chunk's forward
saved. And the live-storage probe (independent of the store) must see it: the last step's device peak with offload
is below the peak without it by at least the theory's saving, less `PIPELINE_SHORTFALL`. The stage input a rank
received stays resident (the runtime holds it for its gradient; the store does not move it). On pp 2 without virtual
chunks (1F1B, ZB) at most two micro-batches are in flight and the theory's saving at the peak is 0 (the one not
running backward comes back before its B): there the probe checks that offload does not raise the peak; interleaved
pp 2 x vpp 2 saves 0.59 MB of 1.41 MB on rank 0.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from megalm.offload.policy import resident_profile
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.launch import run_distributed
from tests.unit.test_offload import SHORTFALL, device_peak

# Beyond the layer-wise SHORTFALL's reasons: the probe's peak falls inside a B, which has already let go of part of
# its group (autograd frees a saved tensor after its node's backward) while its gradients in flight are live, and with
# offload it can fall in another B than without, one that had freed less of its group by then. Interleaved pp 2 x
# vpp 2, rank 0, uniform 0.5 (2026-11-29): at the offloaded run's peak the store held 766,464 bytes, 49,152 below its
# profile's 815,616, with the same backward-made bytes live as at the peak without offload; the probe measures
# 560,128 of the theory's 592,896 (0.945; 0.957 before SwiGLU kept less per block, so the same gradients in flight
# weigh more). A store that leaks its device buffers measures about none of it (tests/unit/test_offload.py).
PIPELINE_SHORTFALL = SHORTFALL + 0.03

STEPS = 3
COMMON = ["model.num_layers=4", "trainer.micro_batch_size=2", "offload.min_tensor_bytes=0"]
LAYOUTS = {
    "pp2_1f1b": ["parallel.pp=2"],
    "pp2_vpp2_interleaved": ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved"],
    "pp2_zb": ["parallel.pp=2", "parallel.pp_schedule=zb"],
    # checkpointed blocks save only their inputs, through the offload hooks: those are what moves
    "pp2_1f1b_full_recompute": ["parallel.pp=2", "parallel.recompute=full"],
}


def check_offload(rank: int, world_size: int, layout: list[str], tmp: str) -> None:
    plain = Trainer(compose_config(*COMMON, *layout), f"{tmp}/plain")
    losses = [plain.train_step(step).loss for step in range(STEPS - 1)]
    plain_peak, last_loss = device_peak(plain, STEPS - 1)  # the last step measured by the probe
    losses.append(last_loss)
    for policy, fraction, cheap in (("uniform", 0.5, False), ("lifespan", 0.5, False), ("auto", 0.5, False),
                                    ("uniform", 1.0, True)):
        run = Trainer(compose_config(*COMMON, *layout, "offload.enabled=true", f"offload.policy={policy}",
                                     f"offload.fraction={fraction}", f"offload.recompute_cheap={cheap}"),
                      f"{tmp}/{policy}{fraction}{cheap}")
        run_losses = [run.train_step(step).loss for step in range(STEPS - 1)]
        peak, last_loss = device_peak(run, STEPS - 1)
        assert [*run_losses, last_loss] == losses, policy
        for (name, p), (_, q) in zip(plain.model.named_parameters(), run.model.named_parameters(), strict=True):
            assert torch.equal(p, q), (policy, name)
        runtime, store = run.parallel.runner, run.parallel.offload_store
        m = run.cfg.trainer.global_batch_size // run.cfg.trainer.micro_batch_size
        sched = runtime.schedule(m)
        kinds = [a.kind for a in sched.actions[rank]]
        assert kinds.count("OFFLOAD") == kinds.count("RELOAD")
        if rank == 0:  # no policy offloads on the last stage: its F and B touch, a copy there would free nothing
            assert kinds.count("OFFLOAD") > 0, policy
        if policy == "auto":  # the start-up line states auto's own share (it said offload.fraction, unread by auto)
            stated = float(re.search(r"offload\(auto ([0-9.e-]+) of micro-batches\)", run.parallel.describe())[1])
            chunks = sum(a.kind == "F" for a in sched.actions[rank])
            assert kinds.count("OFFLOAD") <= math.ceil(stated * chunks), (stated, kinds.count("OFFLOAD"), chunks)
        weights = {key: store.group_bytes_seen[key] for key in store.group_bytes_seen}
        theory = max(resident_profile(sched, rank, weights))
        assert store.peak_resident_bytes == theory, (policy, store.peak_resident_bytes, theory)
        saving = max(resident_profile(plain.parallel.runner.schedule(m), rank, weights)) - theory
        if "parallel.vpp=2" in layout and rank == 0:  # the layout whose peak offload can lower (docstring)
            assert saving > 0, (policy, saving)
        assert plain_peak - peak >= (1 - PIPELINE_SHORTFALL) * saving, (
            f"{policy} rank {rank}: the probe measured {plain_peak - peak} bytes less at the device peak "
            f"({plain_peak} -> {peak}), the theory says {saving}")
        assert store.offloaded_bytes == store.reloaded_bytes
        assert not store.groups and store.resident_bytes == 0  # every group released after its backward


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_offload_is_exact_and_matches_the_memory_theory(tmp_path, layout):
    run_distributed(check_offload, 2, LAYOUTS[layout], str(tmp_path), timeout=300)


def check_default_threshold(rank: int, world_size: int, tmp: str) -> None:
    """offload.min_tensor_bytes at its default (64 KiB): with one sequence a micro-batch no saved tensor reaches it,
    with eight some do; pp2 1F1B trains exactly as without offload either way."""
    for micro_batch in (1, 8):
        common = ["model.num_layers=4", f"trainer.micro_batch_size={micro_batch}",
                  f"trainer.global_batch_size={4 * micro_batch}", "parallel.pp=2"]
        plain = Trainer(compose_config(*common), f"{tmp}/plain{micro_batch}")
        run = Trainer(compose_config(*common, "offload.enabled=true", "offload.fraction=1.0"),
                      f"{tmp}/offload{micro_batch}")
        assert [plain.train_step(s).loss for s in range(2)] == [run.train_step(s).loss for s in range(2)]
        store = run.parallel.offload_store
        assert store.min_tensor_bytes == 65536 and store.offloaded_bytes == store.reloaded_bytes
        assert not store.groups and store.resident_bytes == 0
        # the first stage moves some at eight sequences, nothing at one (0 == 0 passed with nothing ever moved)
        assert (store.offloaded_bytes > 0) == (micro_batch == 8 and rank == 0), (micro_batch, store.offloaded_bytes)


def test_pipeline_offload_at_the_default_threshold(tmp_path):
    run_distributed(check_default_threshold, 2, str(tmp_path), timeout=300)
