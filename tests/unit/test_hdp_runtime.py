"""HDP trainer pieces that need no process group: pipelined plans, ring shards read from the dataset,
the ring context a micro-batch carries, fillers, and the config rules."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch

from megalm.data.batch import Sample, pack_samples
from megalm.data.dataset import VarlenDataset
from megalm.data.steps import TokenBudgetSteps
from megalm.data.synthetic import SyntheticDocuments
from megalm.errors import ConfigError
from megalm.model import GPT, init_weights
from megalm.model.loss import token_loss_sum
from megalm.parallel.context.zigzag import shard_batch, zigzag_plan
from megalm.parallel.hdp import pipelined, plan_hdp
from megalm.parallel.hdp.cost import load_cost
from megalm.parallel.hdp.pipelined import align_rings, check_pipelined, in_lockstep, in_one_schedule, run_pipelines
from megalm.parallel.hdp.plan import MicroBatch, Plan
from megalm.parallel.hdp.split import filler_batch, read_ring_shard
from megalm.training.validation import validate_run

COST = load_cost("h100_7b")


def random_plans(trials: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(trials):
        ranks, pp = rng.choice([2, 3, 4, 6, 8]), rng.choice([2, 3, 4])
        lengths = [rng.choice([rng.randint(1, 100), rng.randint(1, 100 * ranks)]) for _ in range(rng.randint(1, 16))]
        yield plan_hdp(lengths, ranks, 100, COST, pp=pp), pp, lengths


def test_unaligned_pipelined_plans_can_deadlock_and_the_check_finds_it():
    found = 0
    for plan, pp, _ in random_plans(300):
        try:
            check_pipelined(plan, pp)
        except ValueError as e:
            assert "deadlocks" in str(e)
            found += 1
    assert found > 0, "expected some plans whose rings sit at different pipeline positions to deadlock"


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_aligned_plans_run_as_pipelines(schedule):
    for plan, pp, lengths in random_plans(300, seed=1):
        aligned = align_rings(plan)
        check_pipelined(aligned, pp, schedule)  # raises on deadlock
        # same work: every document once, locals stay on their rank, fillers carry no documents
        assert sorted(i for mb in aligned.micro_batches for i in mb.seqs) == list(range(len(lengths)))
        for r, todo in enumerate(aligned.per_rank):
            assert sorted(k for k in todo if k < len(plan.micro_batches)) == sorted(plan.per_rank[r])
            for k in todo:
                assert r in aligned.micro_batches[k].ranks
        for k, mb in enumerate(aligned.micro_batches):
            if len(mb.ranks) > 1:
                assert len({aligned.per_rank[r].index(k) for r in mb.ranks}) == 1, "ring at different positions"
        assert aligned.stats["fillers"] == len(aligned.micro_batches) - len(plan.micro_batches)


def test_plans_in_lockstep_give_every_rank_as_many_micro_batches_rings_aligned():
    """Expert parallelism's all-to-alls need every rank of an EP group at every micro-batch: `in_lockstep` pads each
    rank to the longest list with fillers, rings at one position on all their members, the same work, and the plan
    still runs as pipelines (each pipeline then runs the same schedule, so the all-to-alls of a stage line up)."""
    padded = 0
    for plan, pp, lengths in random_plans(300, seed=2):
        lockstep = in_lockstep(plan)
        assert len({len(todo) for todo in lockstep.per_rank}) == 1
        assert len(lockstep.per_rank[0]) == max(len(todo) for todo in align_rings(plan).per_rank)
        assert sorted(i for mb in lockstep.micro_batches for i in mb.seqs) == list(range(len(lengths)))
        for r, todo in enumerate(lockstep.per_rank):
            assert sorted(k for k in todo if k < len(plan.micro_batches)) == sorted(plan.per_rank[r])
        for k, mb in enumerate(lockstep.micro_batches):
            if len(mb.ranks) > 1:
                assert len({lockstep.per_rank[r].index(k) for r in mb.ranks}) == 1, "ring at different positions"
        assert lockstep.stats["fillers"] == len(lockstep.micro_batches) - len(plan.micro_batches)
        padded += lockstep.stats["fillers"] > align_rings(plan).stats["fillers"]
        run_pipelines(lockstep, pp)  # whole, not as the one pipeline check_pipelined runs for it
    assert padded > 0, "some plan should need fillers beyond its rings' alignment"


def test_only_plans_whose_rings_sit_at_one_index_are_checked_as_one_pipeline(monkeypatch):
    """Two rings in opposite orders on two pipelines of one count deadlock; the check runs them whole (they are not in
    one schedule), and checks a plan in one schedule as one pipeline of its count."""
    rings = [MicroBatch((0, 1), (0,), 10, 100), MicroBatch((0, 1), (1,), 10, 100)]
    crossed = Plan("hand", rings, [[0, 1], [1, 0]])
    assert not in_one_schedule(crossed)
    with pytest.raises(ValueError, match="deadlocks"):
        check_pipelined(crossed, 2)
    run_pipelines(Plan("hand", rings, [[0, 1], [0, 1]]), 2)
    aligned = Plan("hand", rings, [[0, 1], [0, 1]])
    assert in_one_schedule(aligned) and not in_one_schedule(Plan("hand", [*rings, rings[0]], [[0, 1, 2], [0, 1]]))
    # a ring its members do not all list is not in one schedule, wherever it sits
    assert not in_one_schedule(Plan("hand", [*rings, MicroBatch((1,), (), 0, 0)], [[0, 1], [0, 2]]))
    checked = []
    monkeypatch.setattr(pipelined, "run_pipelines", lambda plan, *args: checked.append(plan))
    check_pipelined(aligned, 2)
    check_pipelined(crossed, 2)
    assert checked[0].per_rank == [[0, 1]] and checked[1] is crossed  # one pipeline of its count, or the whole plan


def padded_to_a_multiple(plan: Plan, multiple: int) -> Plan:
    """`plan` with each rank's list padded with fillers to a multiple of `multiple`, each rank on its own."""
    mbs, per_rank = list(plan.micro_batches), []
    for r, todo in enumerate(plan.per_rank):
        pad = -len(todo) % multiple
        per_rank.append([*todo, *range(len(mbs), len(mbs) + pad)])
        mbs += [MicroBatch((r,), (), 0, 0)] * pad
    return Plan(plan.policy, mbs, per_rank, dict(plan.stats))


def test_interleaved_pipelines_run_in_lockstep_and_aligned_rings_alone_can_deadlock_them():
    """An interleaved schedule's order depends on its micro-batch count, so pipelines of different counts can meet a
    ring from different places even with the ring at one index in all: `check_pipelined`, which models the chunks,
    finds such plans. In lockstep (one count, a multiple of pp) every pipeline runs one schedule, and none does: run
    whole (`run_pipelines`), which is why `check_pipelined` checks such a plan as one pipeline of its count."""
    deadlocks = 0
    for plan, pp, _ in random_plans(200, seed=3):
        for vpp in (2, 3):
            lockstep = in_lockstep(plan, pp)
            counts = {len(todo) for todo in lockstep.per_rank}
            assert len(counts) == 1 and counts.pop() % pp == 0 and in_one_schedule(lockstep)
            run_pipelines(lockstep, pp, "interleaved", vpp)
            try:
                check_pipelined(padded_to_a_multiple(align_rings(plan), pp), pp, "interleaved", vpp)
            except ValueError as e:
                assert "deadlocks" in str(e) and f"vpp={vpp}" in str(e) and "in_lockstep(plan" in str(e)
                deadlocks += 1
    assert deadlocks > 0, "some aligned plan of unequal counts should deadlock interleaved pipelines"


def varlen_dataset(seq_length: int = 40) -> VarlenDataset:
    source = SyntheticDocuments(60, 97, mean_doc_length=30, seed=3)
    return VarlenDataset(source, np.arange(60), seq_length, seed=5)


def test_sample_length_and_read_agree_with_the_sample():
    data = varlen_dataset()
    for k in range(0, 200, 7):
        sample = data[k]
        assert data.sample_length(k) == len(sample.tokens)
        np.testing.assert_array_equal(data.read(k, 1, len(sample.tokens) - 2), sample.tokens[1:-1])
    with pytest.raises(IndexError):
        data.read(0, 0, data.sample_length(0) + 1)


def test_ring_shard_reads_only_its_chunks_and_equals_the_full_shard():
    data = varlen_dataset()
    reads: list[tuple[int, int]] = []
    real_read = data.read
    data.read = lambda k, offset, length: reads.append((offset, length)) or real_read(k, offset, length)
    k = next(k for k in range(100) if data.sample_length(k) > 30)
    full = pack_samples([data[k]])
    for n in (2, 3):
        for index in range(n):
            reads.clear()
            shard, real = read_ring_shard(data, k, n, index)
            expect = shard_batch(full, zigzag_plan(full.cu_seqlens, n), index)
            for name in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens"):
                torch.testing.assert_close(getattr(shard, name), getattr(expect, name), rtol=0, atol=0)
            assert real.shape == shard.tokens.shape and int(real.sum()) == int(shard.loss_mask.sum())  # one doc
            read_tokens = sum(length for _, length in reads)
            assert read_tokens <= shard.loss_mask.sum().item() + 2, "a ring member read more than its chunks"


def test_filler_adds_zero_loss_and_zero_gradient():
    model = GPT(_tiny_model_cfg())
    init_weights(model, 0)
    mb = filler_batch()
    loss = token_loss_sum(model(mb.tokens, mb.position_ids, mb.cu_seqlens, mb.max_seqlen), mb.labels, mb.loss_mask)
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def _tiny_model_cfg():
    from tests.conftest import compose_config

    return validate_run(compose_config()).model


def test_micro_batches_carry_their_ring_context_and_attention_runs_it(make_config, tmp_path):
    """Which ring a micro-batch runs on is data: a prepared ring micro-batch carries its RingContext (ranks,
    position, the shard's zigzag layout); a local one carries none; the model's attention runs the context
    it is given."""
    from megalm.parallel.context.attention import RingContext
    from megalm.parallel.dims import ParallelDims, ParallelMesh
    from megalm.parallel.microbatch import LocalMicroBatch, Ring
    from megalm.training.trainer import Trainer

    data = varlen_dataset()
    k = next(k for k in range(100) if data.sample_length(k) > 30)
    trainer = Trainer(make_config(*HDP), tmp_path, mesh=ParallelMesh(ParallelDims()))
    prepared = trainer.parallel._prepare(LocalMicroBatch(read_ring_shard(data, k, 3, 1)[0], 5, ring=Ring((4, 0, 2), 1)))
    context = prepared.attention
    assert isinstance(context, RingContext) and (context.ranks, context.index, context.comm) == ((4, 0, 2), 1, "ring")
    expected = zigzag_plan(pack_samples([data[k]]).cu_seqlens, 3).layout
    assert torch.equal(context.layout.chunk_sizes, expected.chunk_sizes) and prepared.index == 5
    assert trainer.parallel._prepare(LocalMicroBatch(filler_batch(), 0)).attention is None

    calls = []

    class Recording:
        def attend(self, q, k, v, backend, dropout_p=0.0, scale=None):
            calls.append(tuple(q.shape))
            return torch.zeros_like(q)

    model = GPT(_tiny_model_cfg())
    init_weights(model, 0)
    mb = pack_samples([Sample(np.arange(9) % 50, (9,))])
    model(mb.tokens, mb.position_ids, mb.cu_seqlens, mb.max_seqlen, Recording())
    assert len(calls) == model.cfg.num_layers and calls[0][0] == 8


HDP = ["parallel.hdp=true", "data.varlen=true"]


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.hdp=true"], 4, "data.varlen=true"),
    (HDP + ["parallel.hdp_capacity=4"], 4, "needs 8 ranks"),
    (HDP + ["parallel.cp=2", "parallel.cp_comm=a2a"], 4, "cp_comm=ring"),
    (HDP + ["parallel.hdp_capacity=16", "model.attention_dropout=0.1"], 4, "attention_dropout=0"),
    # a capacity of seq_length (dp only: the default) had passed, and the planner's rings of short documents failed
    (HDP + ["model.attention_dropout=0.1"], 4, "a short one that outlasts the step's mean load"),
    (HDP + ["parallel.hdp_cost=nope"], 4, "parallel.hdp_cost=nope"),
    (["parallel.hdp_capacity=16"], 1, "parallel.hdp=false"),
])
def test_hdp_config_rules(make_config, overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate_run(make_config(*overrides), world_size=world)


def test_one_device_connection_under_hdp_is_said(make_config, monkeypatch, caplog):
    """At CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's TP overlap setting) the GPU runs two communicators' kernels in
    issue order, which HDP's own communicator for the gradient reductions relies on not happening (docs/hdp.md):
    said in one line; nothing without it, or on one rank."""
    for value, world, said in (("1", 4, True), (None, 4, False), ("8", 4, False), ("1", 1, False)):
        if value is None:
            monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        else:
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megalm"):
            validate_run(make_config(*HDP), world_size=world)
        assert ("CUDA_DEVICE_MAX_CONNECTIONS=1 under parallel.hdp=true" in caplog.text) == said, (value, world)


def test_a_token_budget_takes_interleaved_pipelines_under_hdp_only(make_config):
    """Without HDP a token budget gives steps micro-batch counts that an interleaved schedule cannot take; HDP pads
    every pipeline to a multiple of pp (`in_lockstep`)."""
    interleaved = ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved", "model.num_layers=4",
                   "trainer.tokens_per_step=300", "data.varlen=true"]
    with pytest.raises(ConfigError, match="or parallel.hdp=true"):
        validate_run(make_config(*interleaved), world_size=4)
    assert validate_run(make_config(*interleaved, "parallel.hdp=true"), world_size=4).parallel.hdp


def test_hdp_capacity_defaults_to_the_static_cp_share(make_config):
    cfg = validate_run(make_config(*HDP, "parallel.cp=2", "model.seq_length=33"), world_size=4)
    assert cfg.parallel.hdp_capacity == 17


def test_sample_is_one_document():
    assert Sample(np.arange(5), (5,)).num_loss_tokens() == 4  # what HdpRuntime's loss-token count assumes


def test_token_budget_steps_fill_the_budget_and_resume_from_a_cursor():
    data = varlen_dataset()
    steps = TokenBudgetSteps(data, 100)
    inputs = lambda ids: sum(data.sample_length(k) - 1 for k in ids)
    for step in range(20):
        ids = steps.ids(step)
        assert len(ids) >= 1 and ids.start == (steps.ids(step - 1).stop if step else 0)
        assert len(ids) == 1 or inputs(ids) <= 100, "over the budget with more than one sample"
        assert inputs(range(ids.start, ids.stop + 1)) > 100, "the next sample would have fitted"
    resumed = TokenBudgetSteps(data, 100, first_step=7, first_sample=steps.start(7))
    assert [resumed.ids(s) for s in range(7, 20)] == [steps.ids(s) for s in range(7, 20)]
    with pytest.raises(IndexError):
        resumed.ids(3)
    assert TokenBudgetSteps(data, 1).ids(0) == range(0, 1)  # a sample longer than the budget still runs


def test_token_budget_needs_varlen_data(make_config):
    with pytest.raises(ConfigError, match="data.varlen=true"):
        validate_run(make_config("trainer.tokens_per_step=100"))


def test_one_process_hdp_with_a_token_budget_and_no_validation_split(make_config, tmp_path):
    """The trainer's HDP path in one process (a domain of one rank): plans, packs and trains."""
    from megalm.parallel.dims import ParallelDims, ParallelMesh
    from megalm.training.trainer import Trainer

    cfg = make_config(*HDP, "trainer.tokens_per_step=100", "data.valid_fraction=0")
    trainer = Trainer(cfg, tmp_path, mesh=ParallelMesh(ParallelDims()))
    assert trainer.data.valid is None
    result = trainer.train_step(0)
    ids = trainer.step_sample_ids(0)
    assert result.tokens == sum(trainer.data.train.sample_length(k) - 1 for k in ids)
    assert trainer.parallel.split.last_plan.num_ranks == 1 and trainer.evaluate() is None
    assert result.rank_tokens == [result.tokens]  # the one rank of the domain ran every token
    trainer.cfg.trainer.max_steps = 2
    trainer.fit()  # metrics.jsonl carries the per-rank loads (tests/dist/test_hdp.py: equal to the simulator's)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    loads = [r["hdp_rank_tokens"] for r in records if "step" in r]
    assert loads and all(len(x) == 1 and x[0] > 0 for x in loads)


def test_the_trainers_cost_model_holds_the_runs_capacity_whatever_the_presets_memory_says():
    """Unset `parallel.hdp_cost`, the trainer balances with the first-principles preset of its model's shape. That
    preset's H100 memory model finds no room for 70B's state at tp = 1 (110 GiB a GPU), which once raised a
    ValueError from any such run, and from a pipeline with offload, whose copy-to-compute ratio reads the same model
    (it crashed `megalm-estimate --search` on such candidates); the capacity the run holds is
    `parallel.hdp_capacity` (without HDP, a micro-batch's tokens), and the model takes it."""
    from megalm.parallel.hdp.split import hdp_cost_model
    from tests.conftest import compose_config

    cfg = validate_run(compose_config("model=70b", "parallel.hdp=true", "parallel.hdp_capacity=2048", "data=synthetic",
                                      "data.varlen=true", "model.seq_length=4096", "trainer.global_batch_size=8",
                                      "trainer.micro_batch_size=1", tiny=False), world_size=8)
    assert cfg.model.num_layers == 80 and cfg.parallel.tp == 1
    assert hdp_cost_model(cfg).capacity == 2048
    # without HDP (PipeOffload's copy-to-compute ratio reads the model's times): what a micro-batch holds
    cfg = validate_run(compose_config("model=70b", "parallel.pp=2", "offload.enabled=true", "model.seq_length=4096",
                                      "trainer.global_batch_size=8", "trainer.micro_batch_size=2", tiny=False),
                       world_size=2)
    assert hdp_cost_model(cfg).capacity == 8192


def test_the_trainers_cost_model_prices_an_moe_model_at_the_mlp_width_its_tokens_run():
    """An MoE block's token runs k routed experts and the shared ones, not the dense FFN: the default cost model takes
    the blocks' mean width (one dense block of 704 units, three of 2 x 128 routed + 128 shared: 464), where it had
    taken the dense width in every block."""
    from megalm.parallel.hdp.cost import ModelShape, preset
    from megalm.parallel.hdp.split import hdp_cost_model
    from tests.conftest import compose_config

    cfg = validate_run(compose_config("model=moe_tiny", "model.moe.first_k_dense=1", "model.moe.num_shared_experts=1",
                                      "model.moe.aux_loss_coeff=0",
                                      "parallel.hdp=true", "parallel.dp=2", "data=synthetic", "data.varlen=true",
                                      tiny=False), world_size=2)
    m = cfg.model
    assert (m.ffn_hidden_size, m.moe.expert_ffn_hidden_size, m.moe.shared_ffn_hidden_size) == (704, 128, 128)

    def priced(ffn: int):
        shape = ModelShape(layers=4, hidden=256, heads=4, kv_heads=2, ffn=ffn, vocab=m.padded_vocab_size)
        return preset(shape, tp=1, capacity=cfg.parallel.hdp_capacity).replace(chunk_layers=4)  # offload's blocks

    assert hdp_cost_model(cfg) == priced((704 + 3 * (2 * 128 + 128)) // 4) != priced(704)


def test_a_named_cost_model_is_rescaled_to_the_runs_tp():
    """`parallel.hdp_cost` names a model of one-GPU HDP ranks (the YAML's and the 7b preset's tp 1): at tp 2 a node
    holds 4 HDP ranks, each with twice the links and 1.8x the FLOPs, as the preset built at tp 2 has them. It kept
    ranks_per_node 8, so the planner took rings of 5 to 8 ranks that cross nodes for NVLink rings."""
    from megalm.parallel.hdp.cost import load_cost, preset
    from megalm.parallel.hdp.split import hdp_cost_model
    from tests.conftest import compose_config

    def cost(name: str, tp: int):
        cfg = validate_run(compose_config("model=7b", "parallel.hdp=true", f"parallel.tp={tp}", "parallel.dp=2",
                                          f"parallel.hdp_cost={name}", "data=synthetic", "data.varlen=true",
                                          "model.seq_length=4096", "trainer.global_batch_size=8",
                                          "trainer.micro_batch_size=1", tiny=False), world_size=2 * tp)
        return hdp_cost_model(cfg)

    yaml1, yaml2 = cost("h100_7b", 1), cost("h100_7b", 2)
    assert yaml1.replace(chunk_layers=0) == load_cost("h100_7b") and yaml1.tp == 1
    assert (yaml2.tp, yaml2.ranks_per_node, yaml2.heads, yaml2.name) == (2, 4, 16, "h100_7b@tp2")
    assert yaml2.capacity == yaml1.capacity  # the run plans with parallel.hdp_capacity
    back = yaml2.at_tp(1)
    assert (back.ranks_per_node, back.heads, back.bw_inter, back.a) == (8, 32, yaml1.bw_inter, pytest.approx(yaml1.a))
    assert yaml2.bw_inter == 2 * yaml1.bw_inter and yaml2.c == yaml1.c
    assert yaml2.b == pytest.approx(yaml1.b / 1.8) and yaml2.act_bytes == yaml1.act_bytes / 2
    built = preset("7b", tp=2)
    scaled = cost("7b", 2)
    for key in ("a", "b", "head", "bw_intra", "bw_inter", "ranks_per_node", "heads", "act_bytes", "act_fixed", "tp"):
        assert getattr(scaled, key) == pytest.approx(getattr(built, key)), key
    thirteen = preset("13b")  # built at its default tp 2
    assert thirteen.tp == 2 and thirteen.at_tp(2) is thirteen
