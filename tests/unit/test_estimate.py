"""megalm-estimate: one rank of a layout, built and stepped under fake tensors, measured by the live-storage probe.

The static bytes per parameter must be the closed forms of the mixed-precision recipes (Megatron's accounting, as in
Korthikanti et al. and Megatron-LM's theoretical_memory_usage.py), N parameters on the rank, dp data-parallel ranks:

    precision    parallel   params   grads            optimizer                  ZeRO-1 gather buffers
    bf16         plain DP   2N       4N (fp32 sums)   12N (fp32 main, m, v)              -
    bf16         ZeRO-1     2N       4N + 4N/dp       12N/dp                           2N (bf16)
    fp32         plain DP   4N       4N               8N (m, v)                          -
    fp32         ZeRO-1     4N       4N + 4N/dp       8N/dp                            4N (fp32)

plus AdamW's step counters and scalars in the optimizer's bytes (under 128 bytes).

(ZeRO-1's shard of the summed gradients is a buffer of its own, 4N/dp, and its all-gather lands in a buffer the
next forward takes the parameters from: what megalm holds beyond Megatron's distributed optimizer, which reduces
and gathers in place.) N is counted here from a model built from the same config, not read from the estimator.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from megalm import compat, estimate
from megalm.config.checks import resolve_model_defaults
from megalm.estimate.collectives import LINKS
from megalm.model.gpt import GPT
from megalm.parallel.hdp import plan_hdp, simulate
from megalm.parallel.hdp.split import hdp_cost_model
from tests.conftest import TINY, compose_config

SMALL = [o for o in TINY if not o.startswith("trainer.") or "batch_size" not in o]  # the estimator's batch


def parameters(overrides: list[str]) -> int:
    """Elements of the model the overrides build, on one rank (tp = pp = 1)."""
    cfg = compose_config(*overrides)
    with torch.device("meta"):
        model = GPT(resolve_model_defaults(cfg.model))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("precision, zero1, world, reduce", [
    ("bf16", False, 2, "fp32"), ("bf16", True, 4, "fp32"), ("fp32", False, 2, "fp32"), ("fp32", True, 4, "fp32"),
    # bf16 buckets and shards: the fp32 copy of each shard the optimizer steps was kept between steps (4n/dp)
    ("bf16", True, 4, "bf16")])
def test_static_bytes_are_the_closed_form(precision, zero1, world, reduce):
    overrides = [*SMALL, f"precision={precision}", f"parallel.zero1={str(zero1).lower()}", "trainer.device=cpu",
                 f"parallel.grad_reduce_dtype={reduce}"]
    n = parameters(overrides)
    dp = world
    assert n % dp == 0  # no ZeRO-1 padding at this shape: the closed forms are exact
    result = estimate.estimate(estimate.batch_overrides(overrides, world), world, "h100")
    (rank,) = result["ranks"]
    weight = 2 if precision == "bf16" else 4
    assert rank["param_bytes"] == weight * n
    grad = 2 if reduce == "bf16" else 4
    assert rank["grad_bytes"] == grad * n + (grad * n // dp if zero1 else 0)
    moments_and_main = (12 if precision == "bf16" else 8) * n // (dp if zero1 else 1)
    scalars = rank["optimizer_bytes"] - moments_and_main  # AdamW's step counters and scalars
    assert 0 < scalars < 128, (rank["optimizer_bytes"], moments_and_main)
    assert rank["comm_bytes"] == (weight * n if zero1 else 0)
    assert rank["activation_bytes"] > 0 and rank["flops"] > 0
    assert result["layout"]["dp"] == dp


def test_every_pipeline_role_and_the_step_time():
    """pp4: the first, a middle and the last stage, at their global ranks; the first keeps the most activations
    (1F1B: pp micro-batches in flight), the last has the output head's FLOPs; MFU and tokens/s from the step time."""
    overrides = [*SMALL, "model.num_layers=4", "parallel.pp=4", "precision=bf16", "trainer.device=cpu"]
    result = estimate.estimate(estimate.batch_overrides(overrides, 8), 8, "h100")
    ranks = result["ranks"]
    assert [(r["role"], r["rank"]) for r in ranks] == [("first stage", 0), ("middle stage", 4), ("last stage", 6)]
    assert ranks[0]["activation_bytes"] > ranks[1]["activation_bytes"]
    assert ranks[2]["flops"] > ranks[1]["flops"]
    assert result["layout"]["micro_batches"] == 16 and result["bubble_factor"] == pytest.approx(19 / 16)
    assert result["mfu"] == pytest.approx(result["global_flops"] / (8 * 989.4e12 * result["step_time_s"]))
    assert all(r["peak_bytes"] > r["param_bytes"] + r["activation_bytes"] for r in ranks)


def test_a_token_budget_s_step_is_priced_with_its_own_tokens_and_micro_batches(tmp_path):
    """Under trainer.tokens_per_step the estimator counted global_batch_size x seq_length tokens and micro-batches
    (a default it injected besides the budget, 'batch not given'): tokens/s was 4x too low for the tiny model. Now the
    step's tokens are those a real trainer's step trains on, and its micro-batches those it cuts."""
    from megalm.training.trainer import Trainer

    budget = [*SMALL, "data.varlen=true", "trainer.tokens_per_step=512", "trainer.micro_batch_size=2"]
    assert estimate.batch_overrides(budget, 2) is budget
    result = estimate.estimate([*budget, "trainer.device=cpu"], 2, "h100")
    trainer = Trainer(compose_config(*budget, "trainer.device=cpu", "parallel.dp=1"), tmp_path)
    ids = trainer.step_sample_ids(1)
    tokens = sum(trainer.data.train.sample_length(k) - 1 for k in ids)  # inputs: a sample's tokens less one
    assert result["tokens_per_s"] * result["step_time_s"] == pytest.approx(tokens)
    assert result["layout"]["micro_batches"] == math.ceil(len(ids) / (2 * 2))


def test_the_bubble_is_the_simulated_schedule_s():
    """1F1B and interleaved as Narayanan et al. count them; zero-bubble schedules fill part of the bubble."""
    assert estimate.bubble_factor(4, 16, "1f1b", 1) == pytest.approx((16 + 3) / 16)
    assert estimate.bubble_factor(4, 16, "interleaved", 2) == pytest.approx((16 + 3 / 2) / 16)
    assert 1 < estimate.bubble_factor(4, 16, "zb", 1) < estimate.bubble_factor(4, 16, "1f1b", 1)
    assert estimate.bubble_factor(1, 16, "1f1b", 1) == 1


def test_the_command_line(capsys):
    assert estimate.main([*SMALL, "parallel.tp=2", "precision=bf16", "--world", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"ranks", "step_time_s", "mfu", "tokens_per_s"} <= result.keys()
    assert set(result["ranks"][0]) >= {"role", "peak_bytes", "param_bytes", "grad_bytes", "optimizer_bytes",
                                       "activation_bytes", "comm_bytes", "host_bytes", "reserve_bytes", "flops"}
    auto, batch = result["notes"]  # trainer.compile left at auto: priced eager, where CUDA would compile (tp2)
    assert auto.startswith("trainer.compile left at null (auto): blocks priced eager") and "\n" not in auto
    assert batch == f"batch not given: {estimate.BATCH_DEFAULTS}"
    assert "tp" in result["ranks"][0]["collective_bytes"]
    zb = [*SMALL, "parallel.pp=2", "parallel.pp_schedule=zb", "precision=bf16", "--world", "2", "--json"]
    assert estimate.main(zb) == 0  # under the ZB schedule auto stays eager on CUDA too: nothing to say
    assert not any(n.startswith("trainer.compile") for n in json.loads(capsys.readouterr().out)["notes"])
    # a sliding window: the CPU trace's SDPA band mask is priced whole (an upper bound), said in one note
    assert estimate.main([*SMALL, "model.sliding_window=4", "--world", "1", "--json"]) == 0
    assert estimate.WINDOW_PRICED_WHOLE in json.loads(capsys.readouterr().out)["notes"]
    # one of at least the sequence holds every document whole: priced as full attention, which needs no note
    assert estimate.main([*SMALL, "model.sliding_window=32", "model.seq_length=32", "--world", "1", "--json"]) == 0
    assert estimate.WINDOW_PRICED_WHOLE not in json.loads(capsys.readouterr().out)["notes"]


def test_the_table_prints_a_tiny_model_s_seconds_and_tflop_as_figures(capsys):
    """The table's seconds have 3 decimals and its TFLOP 1, as at 1.3B; a tiny model's step (a fraction of a
    millisecond) printed `step 0.000 s` and `0.0` TFLOP, so it gets 3 significant digits of the JSON's figures."""
    assert estimate.main([*SMALL, "precision=bf16", "--world", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0 < result["step_time_s"] < 1e-3 and result["ranks"][0]["flops"] < 1e11  # tiny: the case this is about
    assert estimate.main([*SMALL, "precision=bf16", "--world", "1"]) == 0
    table = capsys.readouterr().out
    assert f"step {result['step_time_s']:.3g} s (bubble" in table
    row = next(line for line in table.splitlines() if line.startswith("| only stage"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[9:11] == [f"{result['ranks'][0]['flops'] / 1e12:.3g}", f"{result['ranks'][0]['compute_s']:.3g}"]
    assert estimate._figure(0.364, 3) == "0.364" and estimate._figure(69.74, 1) == "69.7"  # larger ones as before


def test_hdp_measures_the_largest_ring_and_its_loads_are_the_simulators():
    """32-token documents on 4 ranks of 11 tokens: rings of 3. The estimator reads every domain rank's share of the
    step from the trainer's own split (the batches it would run); tools/hdp_sim.py's planner and simulator, given
    the same document lengths, must charge each rank the same tokens (a ring member its zigzag share)."""
    overrides = [*SMALL, "parallel.hdp=true", "data.varlen=true", "parallel.hdp_capacity=11", "precision=bf16",
                 "trainer.device=cpu", "trainer.micro_batch_size=1", "trainer.global_batch_size=8"]
    result = estimate.estimate(overrides, 4, "h100")
    hdp = result["hdp"]
    cfg = compose_config(*overrides)
    cfg.model = resolve_model_defaults(cfg.model)
    plan = plan_hdp(hdp["lengths"], 4, 11, hdp_cost_model(cfg))
    assert simulate(plan, hdp_cost_model(cfg)).tokens == hdp["tokens_per_rank"]
    assert sum(hdp["tokens_per_rank"]) == sum(hdp["lengths"])
    busiest = max(range(4), key=lambda h: (hdp["largest_ring"][h], hdp["tokens_per_rank"][h]))
    assert busiest != 0 and max(hdp["largest_ring"]) == 3
    assert [(r["rank"], r["tokens"]) for r in result["ranks"]] == [(0, hdp["tokens_per_rank"][0]),
                                                                    (busiest, hdp["tokens_per_rank"][busiest])]
    assert result["ranks"][1]["role"].startswith("largest ring (3 ranks)")


@pytest.mark.parametrize("argv, message", [
    (["parallel.tp=2", "--world", "3"], "--world 3 is not a multiple of tp x pp x cp = 2"),
    (["parallel.dp=4", "--world", "2"], "parallel.dp=4 with tp x pp x cp = 1 makes 4 GPUs, not --world 2; set "
                                        "--world 4"),  # had named torchrun's --nproc-per-node
    (["--world", "2", "--gpu", "v100"], "--gpu v100: unknown GPU"),
    (["--world", "2", "--gpu", "V100"], "--gpu v100: unknown GPU"),  # read in lower case (H100 is h100)
    (["model=moe_tiny", "model.moe.every_n_layers=2", "--world", "2", "--search"], "model.moe.every_n_layers=2"),
    (["--world", "0"], "--world 0 must be >= 1"),
    (["--world", "2", "--search", "--top", "0"], "--top 0 must be >= 1"),
    (["--world", "2", "--search", "--gpu-memory", "-5"], "--gpu-memory -5.0 must be a finite number > 0 GiB"),
    (["--world", "2", "--search", "--gpu-memory", "nan"], "--gpu-memory nan must be a finite number > 0 GiB"),
    (["--world", "2", "--search", "--gpu-memory", "inf"], "--gpu-memory inf must be a finite number > 0 GiB"),
    (["--world", "2", "--gpu-memory", "80"], "--gpu-memory applies to --search; add --search, or drop it"),
    (["--world", "2", "--top", "3", "--gpu-memory", "80"], "--top and --gpu-memory apply to --search"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    assert estimate.main([*SMALL, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


def test_a_dataset_that_is_not_there_is_one_line(tmp_path, capsys):
    """The estimated step builds the run's data as the trainer does: a missing dataset was a DataError's traceback
    (exit 1), where a config error is one line."""
    small = [o for o in SMALL if not o.startswith("data")]
    assert estimate.main([*small, "data=indexed", f"data.path={tmp_path / 'missing'}", "--world", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: data.path=") and "not found; build it with megalm-preprocess" in err, err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_static_bytes_under_fsdp_are_the_closed_form(precision):
    """FSDP keeps only fp32 shards (the main weights) and their two moments between steps: 12 bytes per element of
    this rank's chunk of every parameter (ceil(rows / dp) rows: FSDP pads the chunks), whatever the recipe (a bf16
    copy exists only while a unit computes); its gradient shards are freed by zero_grad."""
    world = 4
    overrides = [*SMALL, f"precision={precision}", "parallel.fsdp=true", "trainer.device=cpu"]
    cfg = compose_config(*overrides)
    with torch.device("meta"):
        shapes = [p.shape for p in GPT(resolve_model_defaults(cfg.model)).parameters()]
    chunk = sum(math.ceil(s[0] / world) * math.prod(s[1:]) for s in shapes)
    (rank,) = estimate.estimate(estimate.batch_overrides(overrides, world), world, "h100")["ranks"]
    assert rank["param_bytes"] == 4 * chunk
    assert rank["grad_bytes"] == rank["comm_bytes"] == 0
    scalars = rank["optimizer_bytes"] - 8 * chunk  # AdamW's step counters
    assert 0 < scalars <= 8 * len(shapes), (rank["optimizer_bytes"], 8 * chunk)



def test_the_optimizer_under_fsdp_updates_this_rank_s_shard_only():
    """FSDP's parameters are DTensors: the trace prices fused AdamW by the local shard its dispatch updates, not the
    global size the wrapper reports. In fp32 (no bf16 copy to refresh) the optimizer step of a dp-4 FSDP rank costs
    1/4 of a plain data-parallel rank's, which updates every parameter (it had cost as much, before the trace let the
    DTensor dispatch to its shard). Without the clip, whose scale plain DP folds into the fused step and FSDP
    applies to its shards by a pass of their own (megalm/parallel/parallelism.py): the step alone is compared."""
    world, steps = 4, {}
    for name, extra in (("fsdp", ["parallel.fsdp=true"]), ("ddp", [])):
        overrides = [*SMALL, "precision=fp32", "trainer.device=cpu", "trainer.grad_clip=0", *extra]
        (rank,) = estimate.estimate(estimate.batch_overrides(overrides, world), world, "h100")["ranks"]
        steps[name] = rank["optimizer_s"]
    assert abs(steps["fsdp"] * world - steps["ddp"]) < 0.05 * steps["ddp"], steps


def test_fsdp_with_a_pipeline_prices_every_stage():
    """megalm-estimate prices each pipeline stage's rank in a fresh fake world of the same process; FSDP's shard
    offsets asked the mesh for its local rank, which looked its group up by name and did not find the second stage's
    (a traceback, an audit): both stages are priced, each holding half the blocks' shards."""
    overrides = [*SMALL, "precision=fp32", "trainer.device=cpu", "parallel.fsdp=true", "parallel.pp=2"]
    report = estimate.estimate(estimate.batch_overrides(overrides, 8), 8, "h100")
    roles = [rank["role"] for rank in report["ranks"]]
    assert roles == ["first stage", "last stage"] and all(rank["param_bytes"] > 0 for rank in report["ranks"]), roles


def test_fsdp_gathering_torchao_s_fp8_weights_holds_the_same_shards_and_moves_fewer_bytes():
    """precision.fp8_all_gather: a rank holds the same fp32 shards, counted through torchao's wrapper by the tensor it
    wraps (the wrappers each `to_local()` makes afresh had reused storage addresses: 8 weights counted as one), and
    its gathers take less time."""
    from megalm.precision.torchao_fp8 import torchao_problem

    if torchao_problem() is not None:
        pytest.skip(torchao_problem())
    ranks = {}
    for name, extra in (("plain", []), ("fp8", ["precision.fp8_all_gather=true"])):
        overrides = [*SMALL, "precision=fp8", "precision.backend=torchao", "parallel.fsdp=true", "trainer.device=cpu",
                     "trainer.compile=false", *extra]
        (ranks[name],) = estimate.estimate(estimate.batch_overrides(overrides, 2), 2, "h100")["ranks"]
    assert ranks["fp8"]["param_bytes"] == ranks["plain"]["param_bytes"], ranks
    assert ranks["fp8"]["comm_s"] < ranks["plain"]["comm_s"], ranks


def test_moe_ranks_hold_their_expert_slice_and_count_k_experts_per_token():
    """An MoE model's rank under expert parallelism holds 1/ep of the experts (bf16 recipe: 2 bytes of weights per
    element); its FLOPs count each token's k experts, forward and backward: going from top-1 to top-2 adds
    6 · tokens · (3 · h · f) per MoE layer, what the per-expert loop would cost."""
    moe = [*SMALL, "model=moe_tiny", "model.num_layers=2", "model.hidden_size=64",
           "model.moe.expert_ffn_hidden_size=32", "precision=bf16", "trainer.device=cpu"]
    n = parameters(moe)
    cfg = compose_config(*moe)
    experts = cfg.model.num_layers * 3 * cfg.model.hidden_size * 32 * cfg.model.moe.num_experts
    runs = {}
    for top_k in (2, 1):
        overrides = [*moe, "parallel.ep=2", f"model.moe.top_k={top_k}", "model.moe.norm_topk_prob=false"]
        runs[top_k] = estimate.estimate(estimate.batch_overrides(overrides, 2), 2, "h100")
    (two,), (top1,) = (runs[k]["ranks"] for k in (2, 1))
    assert two["param_bytes"] == 2 * (n - experts // 2) and runs[2]["layout"]["ep"] == 2
    batch = compose_config(*estimate.batch_overrides(moe, 2)).trainer.global_batch_size
    per_rank_tokens = batch // 2 * cfg.model.seq_length
    expert_gemm = 6 * per_rank_tokens * 3 * cfg.model.hidden_size * 32 * cfg.model.num_layers
    assert two["flops"] - top1["flops"] == pytest.approx(expert_gemm, rel=1e-9)


def test_a_groups_collectives_run_over_nvlink_where_its_ranks_share_a_node():
    """Data-parallel, FSDP and pipeline groups inside one node of 8 GPUs go over NVLink: they were always priced at
    the NIC's bandwidth, 9x slower, so a one-node dp 8 step spent 0.057 s on communication where NVLink takes 0.006,
    and the layout search favoured tp and pp over dp there (an audit)."""
    from megalm.estimate.collectives import LINKS, comm_seconds, inside_node

    one_node = inside_node(tp=1, cp=1, dp=8, pp=1)
    assert {"dp", "dp_cp", "expert_dp", "pp", "embedding"} <= one_node
    assert not {"dp", "pp"} & inside_node(tp=1, cp=1, dp=16, pp=1)  # two nodes
    assert "dp" in inside_node(tp=2, cp=1, dp=4, pp=2) and "pp" not in inside_node(tp=2, cp=1, dp=4, pp=2)
    assert "dp" not in inside_node(tp=1, cp=1, dp=6, pp=1)  # 6 consecutive ranks straddle a node's boundary
    assert "dp" not in inside_node(tp=8, cp=1)  # the data-parallel size not given: across nodes, as before
    nvlink, nic = (comm_seconds({"dp": 10**9}, LINKS["h100"], inside) for inside in (one_node, set()))
    assert nic == pytest.approx(9 * nvlink)


def test_hsdp_prices_its_shard_group_inside_the_node_and_its_replicas_once_a_step():
    """HSDP's two groups are FSDP's own, which no mesh dimension had named: every collective of theirs was priced as
    `other`, across nodes, the shard group's all-gathers and reduce-scatters inside a node included. Now the shard
    group of 2 consecutive ranks is inside the node, the replicate group across the domain; and with two
    micro-batches a rank its all-reduce of the gradient shards runs once a step (FsdpGrads.before_backward): its
    bytes are those of one all-reduce over 2 replicas of this rank's fp32 gradient shard, the size of its fp32
    weights (`param_bytes`)."""
    from megalm.estimate.collectives import inside_node

    assert "fsdp_shard" in inside_node(tp=1, cp=1, dp=16, fsdp_shard=8)
    assert not {"fsdp_shard", "fsdp_replicate"} & inside_node(tp=2, cp=1, dp=16, fsdp_shard=8)  # 16 ranks a group
    assert "fsdp_replicate" in inside_node(tp=1, cp=1, dp=4, fsdp_shard=2)
    overrides = ["model=tiny", "trainer.device=cpu", "parallel.fsdp=true", "parallel.fsdp_shard_size=2",
                 "trainer.micro_batch_size=1", "trainer.global_batch_size=8"]
    (rank,) = estimate.estimate(overrides, 4, "h100")["ranks"]
    assert set(rank["collective_bytes"]) == {"fsdp_shard", "fsdp_replicate"}, rank["collective_bytes"]
    assert rank["collective_bytes"]["fsdp_replicate"] == rank["param_bytes"]  # 2 (n - 1) / n of it, n = 2


def test_fp8_gemms_are_traced_as_the_gpu_runs_them(monkeypatch):
    """On a GPU with FP8 tensor cores the estimator's step takes torch._scaled_mm (its fake kernel), priced at the FP8
    peak, instead of the CPU's fp32 emulation, with micro-batches padded to 16 tokens as on the GPU (36-token
    sequences here); on an A100, which has none, the emulated GEMMs megalm runs there. On both each cast to FP8
    counts as the GPU's one compiled kernel, not its eager twin's ops (the two made an H100's fp8 step of 1.3B look
    2.5x slower than bf16). The note says which."""
    from megalm.estimate import rank as estimate_rank

    traces: dict[str, estimate_rank.OpCosts] = {}

    class Recorded(estimate_rank.OpCosts):
        def __init__(self, gpu, tf32):
            super().__init__(gpu, tf32)
            traces[gpu.name] = self

    monkeypatch.setattr(estimate_rank, "OpCosts", Recorded)
    overrides = [*SMALL, "precision=fp8", "trainer.device=cpu", "trainer.micro_batch_size=2",
                 "trainer.global_batch_size=2", "model.seq_length=36"]
    notes = {gpu: estimate.estimate(overrides, 1, gpu)["notes"] for gpu in ("h100", "a100")}
    h100, a100 = traces["H100 SXM5"].by_op, traces["A100 SXM4 80GB"].by_op
    # the same GEMM work (the output head stays bf16 in both), the linear layers' part on the FP8 kernel
    assert h100["_scaled_mm"].kernels > 0 and "_scaled_mm" not in a100
    assert h100["_scaled_mm"].flops + h100["mm"].flops == a100["mm"].flops
    # a cast reads x (twice under current scaling, amax first) and writes FP8: one kernel, on either GPU
    for by_op in (h100, a100):
        assert any(op.startswith("fp8_cast_") for op in by_op), sorted(by_op)
        assert by_op["linalg_vector_norm"].kernels == 0, "a cast's amax was priced as an op of its own"
    assert any("torch._scaled_mm" in n for n in notes["h100"]), notes
    assert any("no FP8 tensor cores" in n for n in notes["a100"]), notes


def test_the_collectives_of_compiled_blocks_are_counted_and_sp_regathers_in_the_backward():
    """Compiled blocks dispatch the functional collectives dynamo turns torch.distributed's calls into
    (`_c10d_functional`), which the estimate's `Collectives` counts as it counts eager's `c10d` ops: before, a
    compiled tp2+SP step moved no byte over TP. And the compiled block re-gathers the column-parallel inputs
    (q/k/v's and gate/up's) in its backward as eager SP does, keeping the [T/tp, h] shard, not the gathered [T, h]
    (megalm.training.compile.regather_in_backward): the same TP bytes as eager, and no more activation memory.
    Without that pass the partitioner keeps the gathered input (it recomputes no collective unmarked, and the
    joint graph merges the backward's re-gather with the forward's gather): one all-gather fewer per GEMM group,
    and 2 x [T, h] x (1 - 1/tp) more bytes per layer."""
    if not compat.compiles_over_fake_tensors():
        pytest.skip(f"torch {torch.__version__} cannot compile over the trace's fake tensors (2.11 and later can)")
    base = [*SMALL, "trainer.device=cpu", "trainer.micro_batch_size=2", "trainer.global_batch_size=2",
            "data.synthetic.fixed_doc_length=32", "precision=bf16", "parallel.tp=2", "parallel.sequence_parallel=true"]
    eager, compiled = (estimate.estimate([*base, f"trainer.compile={c}"], 2, "h100")["ranks"][0]
                       for c in ("false", "true"))
    assert compiled["collective_bytes"]["tp"] == eager["collective_bytes"]["tp"]
    assert compiled["activation_bytes"] <= eager["activation_bytes"]


def test_a_compiled_loss_is_priced_by_the_buffers_inductor_writes(monkeypatch):
    """The loss's chunk kernels compiled, the blocks eager: the estimate counts the buffers inductor's kernels write
    (the gradient over the logits, per-token statistics), not the values an op-by-op replay of their fused
    expressions makes (megalm.measure.compiled_cost), so the step holds less than with the eager loss, whose chunk
    holds an fp32 copy of its logits at a time (here the whole [T, V]; without it the compiled step's peak is
    elsewhere in the step, 9% lower). Replayed op by op, it held 21% more than eager."""
    import megalm.training.trainer as trainer_module

    if not compat.compiles_over_fake_tensors():
        pytest.skip(f"torch {torch.__version__} cannot compile over the trace's fake tensors (2.11 and later can)")
    monkeypatch.setattr(trainer_module, "compile_blocks", lambda *args, **kwargs: 0)
    base = [*SMALL, "trainer.device=cpu", "trainer.micro_batch_size=2", "trainer.global_batch_size=2",
            "data.synthetic.fixed_doc_length=32", "precision=bf16"]
    eager, compiled = (estimate.estimate([*base, f"trainer.compile={c}"], 1, "h100")["ranks"][0]
                       for c in ("false", "true"))
    assert compiled["activation_bytes"] < 0.95 * eager["activation_bytes"], (compiled, eager)


def test_compiled_blocks_hold_no_more_than_eager_ones():
    """Blocks and loss compiled: the estimate counts the buffers inductor allocates, each live from the kernel that
    writes it to the last that reads it, not the values an op-by-op replay of the fused expressions makes
    (megalm.measure.compiled_cost). Fused kernels and AOT's partitioner (which recomputes cheap ops in the backward)
    keep no value eager does not, so the compiled step holds no more (here 408,864 bytes against 412,260). Replayed op
    by op it held 523,296, 6% more than eager's 492,884 then (before the eager loss's chunks stopped writing a second
    fp32 copy of their logits). At 1.3B/4096 the estimate has compiled 0.06 GiB above eager, where the GPU measured
    the same peak for both: inductor's backward frees saved activations as it goes, which the estimate holds to the
    graph's end (docs/estimate.md)."""
    if not compat.compiles_over_fake_tensors():
        pytest.skip(f"torch {torch.__version__} cannot compile over the trace's fake tensors (2.11 and later can)")
    base = [*SMALL, "trainer.device=cpu", "trainer.micro_batch_size=2", "trainer.global_batch_size=2",
            "data.synthetic.fixed_doc_length=32", "precision=bf16"]
    eager, compiled = (estimate.estimate([*base, f"trainer.compile={c}"], 1, "h100")["ranks"][0]
                       for c in ("false", "true"))
    assert compiled["activation_bytes"] <= eager["activation_bytes"], (compiled, eager)


@pytest.mark.slow  # 97 s of the default run (seven estimates through inductor), which keeps compiled blocks' memory
# and collectives, and the GPU's FP8 GEMMs in the trace (the three tests before this one)
def test_compiled_blocks_are_priced_as_inductor_compiles_them(monkeypatch):
    """`trainer.compile=true` is traced through inductor (megalm.measure.compiled_cost.InductorCosts): the same GEMM
    FLOPs, fewer bytes and a shorter step than eager, its generated kernels in the trace (before, the estimate
    priced it eager, silently: the probe's dispatch modes made dynamo skip the compiled frames). Where the CPU trace
    breaks a block's graph (attention over unequal documents, one SDPA call per document) the notes count the breaks;
    under a recipe whose linears compiled blocks run as opaque ops with their casts inside (fp8_rowwise) it is priced
    eager and the notes say so; per-tensor FP8 (current or delayed), whose casts are in the graph, is priced
    compiled."""
    from megalm.estimate import rank as estimate_rank

    traces: list[estimate_rank.OpCosts] = []

    class Recorded(estimate_rank.OpCosts):
        def __init__(self, gpu, tf32):
            super().__init__(gpu, tf32)
            traces.append(self)

    monkeypatch.setattr(estimate_rank, "OpCosts", Recorded)
    base = [*SMALL, "trainer.device=cpu", "trainer.micro_batch_size=2", "trainer.global_batch_size=2"]
    equal = ["data.synthetic.fixed_doc_length=32"]  # equal documents: the batched attention, no graph break
    runs = {compiled: estimate.estimate([*base, *equal, "precision=bf16", f"trainer.compile={compiled}"], 1, "h100")
            for compiled in ("false", "true")}
    eager, compiled = traces
    if not compat.compiles_over_fake_tensors():  # a torch before 2.11: eager, and the note says why
        assert compiled.total().bytes == eager.total().bytes, "priced compiled on a torch that cannot"
        assert any("cannot compile over the trace's fake tensors" in n for n in runs["true"]["notes"])
        return
    assert "inductor_generated" in compiled.by_op and "inductor_generated" not in eager.by_op
    assert compiled.by_category["gemm"].flops == eager.by_category["gemm"].flops  # inductor may fuse an add: addmm
    assert compiled.total().bytes < 0.9 * eager.total().bytes
    assert runs["true"]["step_time_s"] < runs["false"]["step_time_s"]
    assert runs["true"]["layout"]["compile"] and runs["true"]["notes"] == []
    # the breaks come per document, not per layer: one layer shows them
    one_layer = [o for o in base if not o.startswith("model.num_layers=")] + ["model.num_layers=1"]
    unequal = estimate.estimate([*one_layer, "precision=bf16", "trainer.compile=true"], 1, "h100")["notes"]
    assert any(re.match(r"trainer.compile=true: \d+ graph breaks", n) for n in unequal), unequal
    assert not any("priced eager" in n for n in estimate_rank.compile_notes(
        compose_config("precision=fp8_delayed", "trainer.compile=true")))
    rowwise = ["precision=fp8_rowwise", "trainer.compile=true"]
    assert any("trainer.compile=true, precision=fp8_rowwise: blocks priced eager" in n
               for n in estimate_rank.compile_notes(compose_config(*rowwise)))
    traced = compose_config(*rowwise)
    estimate_rank.trace_compiled_blocks(traced)  # what the fake trainer is then built with: compile off, said so
    assert not traced.trainer.compile
    # the zero-bubble schedule's compiled linears are ops whose fake kernels compute nothing (no GEMM FLOPs, no dy
    # and x kept for W): priced eager, said so
    zb = ["parallel.pp=2", "parallel.pp_schedule=zb", "trainer.compile=true"]
    assert any("parallel.pp_schedule=zb: blocks priced eager" in n
               for n in estimate_rank.compile_notes(compose_config(*zb)))
    traced = compose_config(*zb)
    estimate_rank.trace_compiled_blocks(traced)
    assert not traced.trainer.compile

    # per-tensor FP8 on an H100: its casts and its GEMMs (torch._scaled_mm) are ops of the compiled graph, from the
    # weights' FP8 copies made before each block runs, once per weight and step (2 micro-batches here)
    traces.clear()
    fp8_run = [*base, *equal, "trainer.micro_batch_size=1", "precision=fp8"]
    fp8 = {compiled: estimate.estimate([*fp8_run, f"trainer.compile={compiled}"], 1, "h100")
           for compiled in ("false", "true")}
    eager, compiled = traces
    assert fp8["true"]["notes"] == fp8["false"]["notes"], fp8["true"]["notes"]
    assert compiled.by_op["_scaled_mm"].flops == eager.by_op["_scaled_mm"].flops
    assert compiled.by_op["_scaled_mm"].bytes == eager.by_op["_scaled_mm"].bytes
    assert "fp8_linear" not in compiled.by_op
    assert compiled.by_op["fp8_cast_current"].kernels == compiled.by_op["_scaled_mm"].kernels // (3 * 2)
    assert compiled.total().bytes < 0.9 * eager.total().bytes
    assert fp8["true"]["step_time_s"] < fp8["false"]["step_time_s"]
    # the weights' FP8 copies are held as the eager trace holds them (fprop's and dgrad's column-major one; the
    # compiled layers keep their scale's inverse beside them too, 4 bytes each, which torch 2.11's trace counts)
    held = fp8["true"]["ranks"][0]["optimizer_bytes"], fp8["false"]["ranks"][0]["optimizer_bytes"]
    assert 0 <= held[0] - held[1] <= 4 * compiled.by_op["fp8_cast_current"].kernels, held
    # below sm89 (no FP8 GEMMs) the compiled linears are the op pair, priced by their FLOPs, and the weights' FP8
    # copies the ops make inside counted once per weight and step
    traces.clear()
    for compiled in ("false", "true"):
        estimate.estimate([*fp8_run, f"trainer.compile={compiled}"], 1, "a100")
    eager, compiled = traces
    assert compiled.by_category["gemm"].flops == eager.by_category["gemm"].flops
    assert compiled.by_op["fp8_weight_cast"].kernels == compiled.by_op["fp8_linear"].kernels // 2


def test_tensor_parallel_collectives_left_in_flight_are_hidden_behind_compute(monkeypatch):
    """TP's backward collectives run in flight beside the GEMMs (megalm/parallel/tensor/comm.py): the estimator
    hides each behind the roofline time of the ops run until its wait, up to its own time. Per block the backward
    leaves four of TP's ten collectives of [T, h] in flight (each column-parallel layer's re-gather and
    reduce-scatter), so at most 4/10 of their time hides; left synchronous (as before 2026-12-02) none does, with
    the same bytes moved."""
    from megalm.parallel.tensor import comm

    overrides = estimate.batch_overrides([*SMALL, "parallel.tp=2", "parallel.sequence_parallel=true",
                                          "precision=bf16", "trainer.device=cpu", "trainer.compile=false"], 2)
    in_flight = estimate.estimate(overrides, 2, "h100")
    monkeypatch.setattr(comm, "_in_flight", lambda: False)
    synchronous = estimate.estimate(overrides, 2, "h100")
    (a,), (b,) = in_flight["ranks"], synchronous["ranks"]
    assert a["collective_bytes"] == b["collective_bytes"] and a["compute_s"] == b["compute_s"]
    assert b["hidden_comm_s"] == 0
    assert a["comm_s"] + a["hidden_comm_s"] == pytest.approx(b["comm_s"], rel=1e-9)
    tp_s = a["collective_bytes"]["tp"] / LINKS["h100"].nvlink
    assert 0 < a["hidden_comm_s"] <= 0.4 * tp_s
    assert in_flight["step_time_s"] == pytest.approx(synchronous["step_time_s"] - a["hidden_comm_s"], rel=1e-9)



@pytest.mark.parametrize("world", [2, 4])
def test_an_all_reduce_sends_its_ring_share_of_the_buffer(world):
    """A ring all-reduce of n ranks sends 2·(n - 1)/n of its buffer through each rank's link (NCCL's bus bandwidth):
    the gradient buckets' (measured by the storage probe) under plain DP. Counted as 2 buffers whatever n until
    2026-12-05, which doubled a pair's traffic."""
    overrides = estimate.batch_overrides([*SMALL, "precision=bf16", "trainer.device=cpu"], world)
    (rank,) = estimate.estimate(overrides, world, "h100")["ranks"]
    assert rank["collective_bytes"] == {"dp": 2 * (world - 1) * rank["grad_bytes"] // world}


def test_a_pipeline_stage_s_sends_are_pp_s_and_its_receives_are_not_counted():
    """The stage's sends over the default group (global ranks, megalm/parallel/pipeline/p2p.py) were filed under
    `other` wherever dp > 1, and each receive was counted beside them, doubling a full-duplex link's bytes: the first
    stage sends each micro-batch's activations (1 sequence of model.seq_length × hidden, bf16) and receives their
    gradients; its pp bytes are the sends and the gradient norm's one fp32 all-reduced over the 2 stages."""
    overrides = [*SMALL, "precision=bf16", "trainer.device=cpu", "parallel.pp=2", "parallel.dp=2",
                 "trainer.micro_batch_size=1", "trainer.global_batch_size=4", "data.synthetic.mean_doc_length=100000",
                 "data.synthetic.num_docs=8"]
    cfg = compose_config(*overrides, tiny=False)
    first = next(r for r in estimate.estimate(overrides, 4, "h100")["ranks"] if r["role"] == "first stage")
    sends = 2 * cfg.model.seq_length * cfg.model.hidden_size * 2  # 2 micro-batches on each of dp 2
    assert "other" not in first["collective_bytes"]
    assert first["collective_bytes"]["pp"] == sends + 4


def test_hdp_under_expert_parallelism_prices_its_lockstep_waits():
    """HDP with ep > 1 runs its ranks in lockstep (fillers where a rank has fewer micro-batches), which the estimate
    runs as the trainer does. Each micro-batch position waits for the slowest rank of its EP group (and of the groups
    a ring there joins), which two traced ranks do not show: each measured rank's micro-batch compute is priced
    times HDP's simulated lockstep step over that rank's own simulated time on the step's plan, and a note says so
    (until 2026-12-05 the note said the waits were left out; then one domain-wide factor over the slowest rank's
    time). The optimizer step, once a step, is stretched by neither the waits nor the bubble."""
    from megalm.parallel.dims import ParallelDims, ParallelMesh
    from megalm.parallel.hdp.split import HdpSplit
    from megalm.training.validation import validate_run

    base = ["model=moe_tiny", "model.num_layers=2", "model.moe.aux_loss_coeff=0", "model.moe.seq_aux_loss_coeff=0.01",
            "data=synthetic", "data.varlen=true", "data.synthetic.mean_doc_length=200", "parallel.hdp=true",
            "parallel.dp=4", "precision=bf16", "trainer.device=cpu", "trainer.micro_batch_size=1",
            "trainer.global_batch_size=16", "parallel.hdp_cost=7b"]  # 7B's times: tokens, not a launch's latency
    lockstep = estimate.estimate([*base, "parallel.ep=2"], 4, "h100")
    hdp = lockstep["hdp"]
    factors = hdp["lockstep_factors"]
    # by hand: the step's plan simulated with EP groups of 2 consecutive domain ranks, the step over each rank's own
    cfg = validate_run(compose_config(*base, "parallel.ep=2", tiny=False), world_size=4)
    split = HdpSplit.for_config(cfg, ParallelMesh(ParallelDims(dp=4)))
    sim = simulate(split.plan(hdp["lengths"]), split.cost, ep=2)
    assert factors == pytest.approx([sim.step_time / own for own in sim.busy], rel=1e-12)
    assert max(factors) > 1.05, "this step's plan should leave ranks waiting at some position"
    h = max(range(4), key=lambda i: (hdp["largest_ring"][i], hdp["tokens_per_rank"][i]))
    measured = [h if r["role"].startswith("largest ring (") else 0 for r in lockstep["ranks"]]
    notes = [n for n in lockstep["notes"] if "lockstep" in n]
    assert notes == [lockstep["notes"][-1]]
    assert all(f"x{factors[i]:.3f} (domain rank {i})" in notes[0] for i in measured)
    step = max((r["compute_s"] - r["optimizer_s"]) * lockstep["bubble_factor"] * factors[i] + r["optimizer_s"]
               + r["comm_s"] for r, i in zip(lockstep["ranks"], measured, strict=True))
    assert lockstep["step_time_s"] == pytest.approx(step, rel=1e-9)
    assert sum(hdp["tokens_per_rank"]) == sum(hdp["lengths"])
    free = estimate.estimate(base, 4, "h100")
    assert not [n for n in free["notes"] if "lockstep" in n] and set(free["hdp"]["lockstep_factors"]) == {1.0}


def test_the_mfu_counts_the_step_s_own_documents():
    """The MFU's model FLOPs (6·N·T plus causal attention) are counted over the step's documents, as the trainer's
    are, so on one rank they are the FLOPs the trace prices (to the s(s + 1) against s² of the attention pairs).
    Counted as one document of model.seq_length a sequence until 2026-12-05, the MFU of packed documents shorter
    than the sequence read high (over 100% at 128K tokens)."""
    overrides = estimate.batch_overrides([*SMALL, "model.seq_length=512", "precision=bf16", "trainer.device=cpu"], 1)
    result = estimate.estimate(overrides, 1, "h100")
    assert result["global_flops"] == pytest.approx(result["ranks"][0]["flops"], rel=0.005)

def test_ring_attention_is_priced_as_ulysses_computes_it():
    """CP's ring attention runs as one op whose fake kernel computes nothing: the estimator prices its blocks' FLOPs
    from the layout (ring.ring_pairs, registered with torch's flop counter). Over the same documents a ring rank
    computes exactly what a Ulysses rank does (1/cp of the causal attention: all tokens, 1/cp of the heads), which
    the trace prices from torch's SDPA kernels, so the two ranks' FLOPs are equal; before, the ring's were missing
    (a 16K-token step's per-rank FLOPs 19% short, its MFU high). The ring's sends run beside its blocks: at most
    (cp - 1)/cp of them hides (collectives.InFlight)."""
    common = [*SMALL, "model.seq_length=512", "parallel.cp=2", "precision=bf16", "trainer.device=cpu",
              "trainer.compile=false"]
    ring, ulysses = (estimate.estimate(estimate.batch_overrides([*common, f"parallel.cp_comm={comm}"], 2), 2, "h100")
                     for comm in ("ring", "a2a"))
    (r,), (u,) = ring["ranks"], ulysses["ranks"]
    assert r["flops"] == pytest.approx(u["flops"], rel=1e-12), (r["flops"], u["flops"])
    ring_s = r["collective_bytes"]["cp"] / LINKS["h100"].nvlink
    assert 0 < r["hidden_comm_s"] <= ring_s / 2 + 1e-12

def test_the_reserve_counts_every_communicator_a_rank_talks_over():
    """NCCL buffers per parallel dimension in use (docs/estimate.md): expert parallelism's all-to-all group, the
    routed experts' gradient group and HSDP's replicate group were left out (ep 1, 2 and 4 at world 4 all had one)."""
    from megalm.estimate.rank import communicators

    assert communicators(tp=1, pp=1, cp=1, dp=4) == 1
    assert communicators(tp=1, pp=1, cp=1, dp=4, ep=2) == 3  # dp, ep, expert-dp (2 ranks)
    assert communicators(tp=1, pp=1, cp=1, dp=4, ep=4) == 2  # dp, ep: the expert-dp group is one rank
    assert communicators(tp=2, pp=1, cp=1, dp=2, experts_over_tp=True) == 3  # tp, dp, expert-dp over tp x dp
    assert communicators(tp=1, pp=2, cp=2, dp=2, hsdp=True) == 4
    moe = ["model=moe_tiny", "trainer.device=cpu", "precision=bf16"]
    small = estimate.estimate(estimate.batch_overrides(moe, 4), 4, "h100")
    wide = estimate.estimate(estimate.batch_overrides([*moe, "parallel.ep=2"], 4), 4, "h100")
    from megalm.estimate.rank import FRAGMENTATION, RESERVE_PER_COMMUNICATOR

    def fixed(result: dict) -> int:
        (rank,) = result["ranks"]
        return rank["reserve_bytes"] - int(FRAGMENTATION * (rank["peak_bytes"] - rank["reserve_bytes"]))

    assert fixed(wide) - fixed(small) == 2 * RESERVE_PER_COMMUNICATOR


@pytest.mark.parametrize("change, message", [
    ("precision=fp32", "which takes bf16 only, and precision=fp32 runs them in fp32; set precision=bf16"),
    # an fp8 recipe without autocast or bf16 weights runs the experts in fp32 too (a torch traceback until 2026-12-06)
    ("precision=fp8 precision.autocast=false precision.bf16_weights=false",
     "precision=fp8 runs them in fp32; set precision=bf16 or precision.bf16_weights=true"),
    # the trace runs on the CPU, where the trainer refused it "as there already"
    ("parallel.fsdp_cpu_offload=true", "megalm-estimate does not price parallel.fsdp_cpu_offload"),
    ("model.moe.expert_ffn_hidden_size=36", "multiples of 8): model.moe.expert_ffn_hidden_size=36")])
def test_what_the_estimator_cannot_trace_is_one_line(change, message, capsys):
    """The MoE shapes trained on the CPU and failed in megalm-estimate with a torch traceback from _grouped_mm's
    meta kernel; FSDP's CPU offload was refused for a reason that is not the user's."""
    extra = ["parallel.fsdp=true"] if "fsdp" in change else []
    assert estimate.main(["model=moe_tiny", "trainer.device=cpu", "precision=bf16", *extra, *change.split(),
                          "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err
