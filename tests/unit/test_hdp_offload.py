"""ByteScale's selective offload in the HDP cost model and planner: r(s), d(s), and plans that use them."""

from __future__ import annotations

import math
import random

import pytest

from megalm.parallel.hdp import check_plan, plan_hdp, ring_size
from megalm.parallel.hdp.cost import fits, load_cost, offload_ratio, offload_ring_size

COST = load_cost("configs/hdp_cost/h100_7b.yaml")


def test_ratio_is_the_largest_whose_copy_hides_under_the_forward():
    e = COST.act_bytes / COST.layers
    r_max = 1 - 2 / COST.layers
    for s in (1024, 4096, 16384, 65536, 262144, 2 * 1024 * 1024):
        r = offload_ratio(s, COST)
        forward = (COST.a * s * s + COST.b * s + COST.c) / 3
        copy = r * e * s / COST.host_bw
        assert 0 < r <= r_max
        assert copy <= forward * (1 + 1e-9)  # hidden
        if r < r_max:  # and the largest: any more would not hide
            assert math.isclose(copy, forward, rel_tol=1e-9)


def test_ratio_grows_with_length_and_rings_shrink():
    rng = random.Random(0)
    lengths = sorted(rng.randrange(1, 4 * 1024 * 1024) for _ in range(300))
    ratios = [offload_ratio(s, COST) for s in lengths]
    assert all(a <= b + 1e-12 for a, b in zip(ratios, ratios[1:], strict=False))  # compute ~s², activations ~s
    C = COST.capacity
    for s, r in zip(lengths, ratios, strict=True):
        d = offload_ring_size(s, C, COST)
        assert d == max(1, math.ceil((1 - r) * s / C - 1e-9)) and d <= ring_size(s, C)
        assert fits(s, d, C, r) and (d == 1 or not fits(s, d - 1, C, r))  # the fewest ranks that hold it
    # 7B on H100s: a 2M-token document keeps 2 of its 32 layers' activations: 16x fewer ranks
    assert offload_ring_size(2 * 1024 * 1024, C, COST) == ring_size(2 * 1024 * 1024, C) // 16


def test_no_host_link_no_offload():
    assert offload_ratio(1 << 20, COST.replace(host_bw=0.0)) == 0.0
    assert offload_ring_size(100_000, 8192, COST.replace(host_bw=0.0)) == ring_size(100_000, 8192)


@pytest.mark.parametrize("seed", range(3))
def test_plans_with_offload_use_the_smaller_rings_and_pass_the_offload_aware_check(seed):
    rng = random.Random(seed)
    C, ranks = 8192, 64
    lengths = [int(rng.lognormvariate(8, 1.6)) + 1 for _ in range(400)]
    lengths = [min(s, C * ranks // 2) for s in lengths]
    plain = plan_hdp(lengths, ranks, C, COST, balance=False)
    offload = plan_hdp(lengths, ranks, C, COST, offload=True, balance=False, compete=False)
    check_plan(plain, lengths, ranks, C)
    check_plan(offload, lengths, ranks, C, offload=COST)
    assert offload.stats["offloading_rings"] > 0
    with pytest.raises(ValueError, match="exceed capacity"):  # without offload those rings would not fit
        check_plan(offload, lengths, ranks, C)
    ring_bytes = lambda plan: sum(COST.ring_bytes(mb.tokens, len(mb.ranks)) for mb in plan.micro_batches)
    assert ring_bytes(offload) < ring_bytes(plain)
    for mb in offload.micro_batches:  # no ring wider than without offload, some narrower
        if len(mb.seqs) == 1 and mb.tokens > C:
            assert offload_ring_size(mb.tokens, C, COST) <= len(mb.ranks) <= ring_size(mb.tokens, C)


@pytest.mark.parametrize("seed", range(3))
def test_offload_never_plans_a_slower_step_than_without_offload(seed):
    """What the trainer plans under parallel.hdp_offload: narrower offload rings where they estimate faster, the
    plain plan where they would lengthen the step (a long-tail batch on 7B)."""
    rng = random.Random(seed)
    C, ranks = 8192, 64
    lengths = [min(int(rng.lognormvariate(8, 1.8)) + 1, C * ranks // 2) for _ in range(400)]
    plain = plan_hdp(lengths, ranks, C, COST)
    chosen = plan_hdp(lengths, ranks, C, COST, offload=True)
    forced = plan_hdp(lengths, ranks, C, COST, offload=True, compete=False)
    assert chosen.stats["estimated_step"] <= plain.stats["estimated_step"]
    assert chosen.stats["estimated_step"] <= forced.stats["estimated_step"]
    check_plan(chosen, lengths, ranks, C, offload=COST)


def test_a_selective_offload_that_cannot_act_is_said(caplog):
    """parallel.hdp_offload=true on 2 layers (r_max = 1 - 2/2 = 0), or with a cost model without a host link, was
    accepted and offloaded nothing, while the run described itself as offloading (an audit, 2026-12-04)."""
    import logging

    from megalm.training.validation import validate_run
    from tests.conftest import compose_config

    hdp = ["parallel.hdp=true", "parallel.hdp_offload=true", "offload.enabled=true", "data.varlen=true",
           "parallel.hdp_capacity=16"]
    with caplog.at_level(logging.WARNING, logger="megalm"):
        validate_run(compose_config(*hdp, "model.num_layers=2"), world_size=4)
    assert any("parallel.hdp_offload=true offloads nothing here" in r.message and "2 layers keep 2 resident"
               in r.message for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megalm"):
        validate_run(compose_config(*hdp, "model.num_layers=4"), world_size=4)
    assert not any("offloads nothing" in r.message for r in caplog.records), caplog.text
    with caplog.at_level(logging.WARNING, logger="megalm"):  # 4 layers in two chunks of 2: each keeps both
        validate_run(compose_config(*hdp, "model.num_layers=4", "parallel.pp=2"), world_size=8)
    assert any("2 blocks of a pipeline chunk keep 2 resident (r_max = 1 - 2/2)" in r.message
               for r in caplog.records), caplog.text


@pytest.mark.parametrize("pp, vpp, layers_per_stage, chunk", [
    (1, 1, None, 32), (2, 1, None, 16), (8, 1, None, 4), (4, 1, [6, 10, 10, 6], 6), (4, 2, None, 4)])
def test_each_pipeline_chunk_keeps_two_of_its_blocks_resident(pp, vpp, layers_per_stage, chunk):
    """With a pipeline each chunk offloads the first ceil(r·L) of its own L blocks (megalm/offload/hooks.py), so r's
    cap is the smallest chunk's 1 − 2/L: the whole model's (1 − 2/32 at 7B) offloaded every block of a 4-block chunk
    at pp 8, and the last one's reload, which its backward needs first, was waited for where the planner priced the
    offload as hidden."""
    from megalm.offload.policy import layer_groups
    from megalm.parallel.hdp.split import hdp_cost_model
    from tests.conftest import compose_config

    overrides = ["model.num_layers=32", "parallel.hdp_cost=configs/hdp_cost/h100_7b.yaml", f"parallel.pp={pp}",
                 f"parallel.vpp={vpp}"]
    if layers_per_stage:
        overrides.append(f"parallel.layers_per_stage=[{','.join(map(str, layers_per_stage))}]")
    cost = hdp_cost_model(compose_config(*overrides))
    assert (cost.chunk_layers or cost.layers) == chunk
    counts = layers_per_stage or [32 // (pp * vpp)] * (pp * vpp)
    longest = 4 * 1024 * 1024
    assert offload_ratio(longest, cost) == pytest.approx(1 - 2 / chunk)  # capped: the long tail reaches the cap
    for s in (65536, 262144, 1024 * 1024, longest):
        r = offload_ratio(s, cost)
        assert r == min(offload_ratio(s, COST), 1 - 2 / chunk)  # the cost model's r(s), capped for the chunk
        assert all(blocks - len(layer_groups(blocks, r, round_up=True)) >= 2 for blocks in counts), (s, r)
