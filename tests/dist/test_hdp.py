"""HDP equals one process: the same global batch of documents, planned over the HDP domain every step.

Each worker runs the HDP trainer, compared with the single-process run of the same model and data (recorded once per
file by rank 0: single_process_reference in tests/dist/equivalence.py). The batch mixes documents packed onto single
ranks with documents on rings of 2 and 3 ranks (asserted from the plans), ranks run different numbers of micro-batches,
and the losses of 5 steps must agree within 1e-5 relative; the first step's gradients, the grad norm, the parameters
after 5 steps and the validation loss are compared too.
"""

from __future__ import annotations

import pytest

from megalm.parallel.hdp import plan_hdp, simulate
from megalm.parallel.hdp.split import HdpSplit
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.equivalence import (
    assert_layout_matches,
    assert_resume_is_bit_exact,
    single_process_reference,
)
from tests.dist.launch import run_distributed

STEPS = 5
# Documents as samples of up to 48 tokens, C = 16 tokens per rank: rings of 2 and 3 ranks, and
# short documents packed; log-normal lengths with mean 30 give both in step 0 (asserted).
HDP = ["parallel.hdp=true", "parallel.hdp_capacity=16", "data.varlen=true", "model.seq_length=48",
       "data.synthetic.mean_doc_length=30", "trainer.global_batch_size=12"]
# Ring merges reorder fp32 sums, and documents as samples make many tokens rare (see
# tests/dist/test_context_parallel.py): parameters after 5 steps within one lr-sized Adam step.
PARAM_ATOL = 3e-3


def plan_shapes(trainer: Trainer) -> tuple[set[int], list[int]]:
    """Ring sizes in the last plan, and the number of micro-batches each HDP rank runs."""
    plan = trainer.parallel.split.last_plan
    return {len(mb.ranks) for mb in plan.micro_batches if mb.seqs}, [len(todo) for todo in plan.per_rank]


def check_hdp(rank: int, world_size: int, overrides: list[str], tmp: str, expect: tuple[str, ...]) -> None:
    """`expect` names what step 0's plan must show: "mixed" (packed documents and rings of 2 and 3
    ranks, different micro-batch counts per rank), "fillers" (pipelines needed aligned rings and a
    filler), "idle" (some rank has no micro-batch at all)."""
    same_model_and_data = [o for o in overrides if not o.startswith("parallel.")]
    reference = single_process_reference(rank, same_model_and_data, tmp, STEPS)
    par = Trainer(compose_config(*overrides), f"{tmp}/par")
    assert par.parallel.reducer.world == par.mesh.dims.dp * par.mesh.dims.cp
    assert_layout_matches(reference, par, rank, STEPS, PARAM_ATOL, lambda: check_first_plan(par, expect))
    if par.cfg.parallel.hdp:
        check_rank_loads(par, STEPS)


def check_first_plan(par: Trainer, expect: tuple[str, ...]) -> None:
    """Step 0's plan shows what `expect` names (see `check_hdp`)."""
    if par.cfg.parallel.hdp:
        sizes, counts = plan_shapes(par)
        if "mixed" in expect:
            assert {1, 2, 3} <= sizes, f"step 0 should mix packed documents and rings of 2 and 3 ranks, got {sizes}"
            assert len(set(counts)) > 1, f"ranks should run different numbers of micro-batches, got {counts}"
        if "fillers" in expect:
            assert par.parallel.split.last_plan.stats["fillers"] > 0, \
                "this pipelined layout should need a filler micro-batch"
        if "lockstep" in expect:  # expert parallelism: as many micro-batches on every rank, rings among them
            assert len(set(counts)) == 1 and par.parallel.split.last_plan.stats["fillers"] > 0, counts
            assert {2, 3} <= sizes, f"step 0 should hold rings of 2 and 3 ranks, got {sizes}"
        if "interleaved" in expect:  # every pipeline runs one interleaved schedule: as many, a multiple of pp
            pp = par.cfg.parallel.pp
            assert len(set(counts)) == 1 and counts[0] % pp == 0, counts
            assert par.parallel.split.last_plan.stats["fillers"] > 0, "this plan should need fillers"
            assert {2, 3} <= sizes, f"step 0 should hold rings of 2 and 3 ranks, got {sizes}"
        if "idle" in expect:
            assert min(counts) == 0, f"some rank should have nothing to do in step 0, got {counts}"
        if "hierarchical" in expect:
            rings = {(len(mb.ranks), mb.inner) for mb in par.parallel.split.last_plan.micro_batches
                     if len(mb.ranks) > 1}
            assert (4, 2) in rings, f"step 0 should hold a ring of 2 groups of 2 (sizes, groups): {rings}"


def check_rank_loads(trainer: Trainer, step: int) -> None:
    """The tokens each HDP rank ran in a step (counted from its batches, summed over the domain: what
    metrics.jsonl logs) are the simulator's for the same step: tools/hdp_sim.py's planner and simulate, on the
    step's lengths, with the run's own cost model."""
    result = trainer.train_step(step)
    ids = trainer.step_sample_ids(step)
    lengths = [trainer.data.train.sample_length(k) - 1 for k in ids]
    split = HdpSplit.for_config(trainer.cfg, trainer.mesh)
    sim = simulate(plan_hdp(lengths, split.num_ranks, split.capacity, split.cost, pp=split.pp,
                            offload=split.offload, hierarchical=split.hierarchical), split.cost, pp=split.pp)
    assert result.rank_tokens == sim.tokens, (result.rank_tokens, sim.tokens)
    assert sum(sim.tokens) == sum(lengths)


MIXED = ("mixed",)
MOE = ["model=moe_tiny", "model.num_layers=2", "model.hidden_size=64", "model.moe.expert_ffn_hidden_size=32",
       "model.moe.aux_loss_coeff=0", "model.moe.seq_aux_loss_coeff=0.01", "model.moe.bias_update_rate=0.01"]
LAYOUTS = {
    "dp4": (4, ["parallel.dp=4"], MIXED),
    "dp2_cp2": (4, ["parallel.dp=2", "parallel.cp=2"], MIXED),
    # selective recompute keeps each ring's attention output and runs its elementwise ops again
    "dp4_selective": (4, ["parallel.dp=4", "parallel.recompute=selective"], MIXED),
    # a dropless MoE model without the switch loss (a micro-batch's, refused): the sequence and z losses and the
    # selection bias are per document, token and step, whatever packs them; the routers gather a ring's choices p2p
    # and count no zigzag padding
    "dp4_moe": (4, ["parallel.dp=4", *MOE], MIXED),
    "dp2_cp2_zero1": (4, ["parallel.dp=2", "parallel.cp=2", "parallel.zero1=true"], MIXED),
    # a token budget per step instead of a sample count: steps hold different numbers of documents
    "dp4_token_budget": (4, ["parallel.dp=4", "trainer.tokens_per_step=400"], MIXED),
    # a budget of one document per step: most ranks have no micro-batch, and still join the reduction
    "dp4_idle_ranks": (4, ["parallel.dp=4", "trainer.tokens_per_step=20"], ("idle",)),
    # the same budget without HDP: DP ranks take slices that differ by a sample, micro-batches a partial last one
    "dp2_token_budget_without_hdp": (2, ["parallel.dp=2", "trainer.tokens_per_step=400", "parallel.hdp=false",
                                         "parallel.hdp_capacity=null"], ()),
    "tp2_dp4_sp": (8, ["parallel.tp=2", "parallel.dp=4", "parallel.sequence_parallel=true"], MIXED),
    # Longer documents: step 0's plan would deadlock as four 1F1B pipelines unless its rings are aligned,
    # which takes a filler micro-batch.
    "pp2_dp4": (8, ["parallel.pp=2", "parallel.dp=4", "model.num_layers=4", "data.synthetic.mean_doc_length=40",
                    "trainer.global_batch_size=8"], ("mixed", "fillers")),
    "pp2_dp4_zb_full_recompute": (8, ["parallel.pp=2", "parallel.dp=4", "model.num_layers=4",
                                      "parallel.pp_schedule=zb", "parallel.recompute=full"], MIXED),
    # interleaved pipelines (2 chunks of a layer each per rank) in lockstep: one schedule, rings at one index
    "pp2_dp4_interleaved": (8, ["parallel.pp=2", "parallel.dp=4", "model.num_layers=4", "parallel.vpp=2",
                                "parallel.pp_schedule=interleaved", "data.synthetic.mean_doc_length=40",
                                "trainer.global_batch_size=8"], ("interleaved",)),
    # ... under a token budget, which without HDP gives interleaved pipelines counts they cannot take (refused there)
    "pp2_dp4_interleaved_token_budget": (8, ["parallel.pp=2", "parallel.dp=4", "model.num_layers=4", "parallel.vpp=2",
                                             "parallel.pp_schedule=interleaved", "data.synthetic.mean_doc_length=40",
                                             "trainer.tokens_per_step=300"], ("interleaved",)),
    # ... and no pipeline filler's token
    "pp2_dp4_moe": (8, ["parallel.pp=2", "parallel.dp=4", *MOE, "model.num_layers=4",
                        "data.synthetic.mean_doc_length=40", "trainer.global_batch_size=8"], ("mixed", "fillers")),
    # expert parallelism: every micro-batch's all-to-alls need each EP group's ranks at it, so every rank runs as many
    # micro-batches (fillers where it has fewer), rings at one position on all their members
    "dp4_moe_ep2": (4, ["parallel.dp=4", *MOE, "parallel.ep=2"], ("lockstep",)),
    # ... under a token budget too, which without HDP gives data-parallel ranks different counts (refused there)
    "dp4_moe_ep2_token_budget": (4, ["parallel.dp=4", *MOE, "parallel.ep=2", "trainer.tokens_per_step=400"],
                                 ("lockstep",)),
    "pp2_dp4_moe_ep4": (8, ["parallel.pp=2", "parallel.dp=4", *MOE, "parallel.ep=4", "model.num_layers=4",
                            "data.synthetic.mean_doc_length=40", "trainer.global_batch_size=8"], ("lockstep",)),
    # a2a+p2p: "nodes" of 2 HDP ranks; a document that needs 3 ranks gets 4 as a hierarchical ring of 2 x 2
    "dp4_hierarchical": (4, ["parallel.dp=4", "parallel.cp_comm=a2a+p2p", "parallel.cp_a2a_size=2"],
                         ("hierarchical",)),
    # ... with an MoE model, whose routers gather a hierarchical ring's choices, and selective recompute
    "dp4_hierarchical_moe_selective": (4, ["parallel.dp=4", "parallel.cp_comm=a2a+p2p", "parallel.cp_a2a_size=2",
                                           "parallel.recompute=selective", *MOE], ("hierarchical",)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hdp_matches_single_process(tmp_path, name):
    world, parallel, expect = LAYOUTS[name]
    run_distributed(check_hdp, world, HDP + parallel, str(tmp_path), expect, timeout=300)


@pytest.mark.slow  # 12 s; the default suite keeps the ramp under dp2 and pp2 (tests/dist/test_trainer_parallel.py)
def test_a_batch_ramp_up_under_hdp_matches_single_process(tmp_path):
    """trainer.rampup_batch_size: steps of 4, 4, 8, 12 and 12 documents, each planned over the HDP domain."""
    run_distributed(check_hdp, 4, [*HDP, "parallel.dp=4", "trainer.rampup_batch_size=[4,4,16]"], str(tmp_path), (),
                    timeout=300)


@pytest.mark.slow  # about 30 s: the default suite keeps test_resume_under_tp_dp_zero1_is_bit_exact
def test_hdp_resume_is_bit_exact(tmp_path):
    """Stopped at step 3 and resumed (token budget: the checkpoint carries the sample cursor)."""
    layout = [*HDP, "parallel.dp=4", "trainer.tokens_per_step=400", "trainer.max_steps=5"]
    assert_resume_is_bit_exact(tmp_path, 4, layout, stop_at=3)


def record_communicator_order(rank: int, world_size: int, overrides: list[str], out: str) -> None:
    """Each rank's ring sends (batched p2p) and gradient-bucket reductions of 3 HDP steps, in the order it issues
    them, each with its group's name (a communicator on NCCL) and, for a send, the peers: written to out/rank.json."""
    import json
    from unittest import mock

    import torch.distributed as dist

    from megalm.parallel.data_parallel.reducer import GradReducer

    trainer = Trainer(compose_config(*overrides), f"{out}/run{rank}")
    default = dist.distributed_c10d._get_default_group()
    events: list[list] = []
    launch, send = GradReducer._launch, dist.batch_isend_irecv

    def launched(self: GradReducer, bucket) -> object:  # noqa: ANN001 - the reducer's bucket
        if bucket.world > 1:
            events.append(["reduce", (bucket.group or default).group_name, bucket.index])
        return launch(self, bucket)

    def sent(ops: list) -> object:
        events.append(["p2p", (ops[0].group or default).group_name, sorted({op.peer for op in ops})])
        return send(ops)

    with mock.patch.object(GradReducer, "_launch", launched), mock.patch.object(dist, "batch_isend_irecv", sent):
        for step in range(3):
            trainer.train_step(step)
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(events, f)


def test_hdp_ranks_issue_each_communicator_s_work_in_one_order(tmp_path):
    """NCCL's rule, checked on gloo: one communicator runs its work in the order each rank issues it, so two ranks
    must issue what they share on it (the reductions of its group, their sends to each other) in the same order.
    Under HDP ranks run different numbers of micro-batches, and a rank's last one launches its gradient buckets'
    reductions during its backward, while ring members with micro-batches to come still send. With dp over every
    rank, torch's mesh handed back the default group for the gradients, the group the rings send on: the orders
    differed (a hang on GPUs, where gloo goes on), until the gradients got a communicator of their own (2026-12-04,
    found by an audit). Small buckets (8 for the tiny model) launch reductions between the ring's sends."""
    import json

    run_distributed(record_communicator_order, 4, [*HDP, "parallel.dp=4", "parallel.bucket_size_mb=0.02"],
                    str(tmp_path), timeout=300)
    events = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(4)]
    assert any(e[0] == "p2p" for e in events[0]) and any(e[0] == "reduce" for e in events[0])

    def shared(rank: int, other: int, group: str) -> list:
        return [e[0] if e[0] == "p2p" else (e[0], e[2]) for e in events[rank]
                if e[1] == group and (e[0] == "reduce" or other in e[2])]

    groups = {e[1] for rank_events in events for e in rank_events}
    for group in groups:
        for a in range(4):
            for b in range(a + 1, 4):
                assert shared(a, b, group) == shared(b, a, group), (
                    f"ranks {a} and {b} issue their work on group {group} in different orders")
