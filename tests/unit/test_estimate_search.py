"""megalm-estimate --search: layouts enumerated, priced by a closed form, the best confirmed by the estimator at a
shallow depth and extrapolated. The extrapolation must equal a full-depth run of the estimator (static bytes to the
byte, the peak within 1%),
and the layouts the search returns must fit and be ordered by the tokens/s the estimator predicts for them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from megalm import estimate
from megalm.config.checks import resolve_model_defaults
from megalm.config.compose import compose_config
from megalm.estimate import layout_search
from megalm.estimate.layout_search import Layout
from megalm.training.flops import matmul_params
from tests.conftest import TINY

SMALL = [o for o in TINY if "batch_size" not in o] + ["model.num_layers=8", "precision=bf16", "trainer.device=cpu"]


# an MoE model whose first block is dense (DeepSeek's first_k_dense): the shallow runs keep it in the first chunk
MOE = ["model=moe_tiny", "model.num_layers=8", "model.moe.first_k_dense=1", "model.moe.num_shared_experts=1",
       "model.moe.shared_ffn_hidden_size=128", "precision=bf16", "trainer.device=cpu"]


@pytest.mark.parametrize("layout, model", [
    (Layout(tp=2, pp=2, vpp=1, cp=1, dp=2, zero1=False, recompute="none", offload=False, hdp=False), SMALL),
    pytest.param(Layout(tp=1, pp=2, vpp=2, cp=1, dp=2, zero1=True, recompute="full", offload=False, hdp=False),
                 SMALL, marks=pytest.mark.slow),  # about 35 s
    (Layout(tp=1, pp=1, vpp=1, cp=2, dp=4, zero1=False, recompute="full", offload=True, hdp=False), SMALL),
    pytest.param(Layout(tp=2, pp=2, vpp=1, cp=1, dp=2, zero1=True, recompute="none", offload=False, hdp=False,
                        ep=2), MOE, marks=pytest.mark.slow),  # about 80 s
    pytest.param(Layout(tp=1, pp=1, vpp=1, cp=1, dp=2, zero1=False, recompute="none", offload=False, hdp=False,
                        ep=2), MOE, marks=pytest.mark.slow),  # one stage: the dense block and an MoE one, shallow
    # Muon: run at the full depth (which matrices a rank orthogonalises depends on all of its stage's), the
    # micro-batches scaled but for the iterations, which run once a step
    (Layout(tp=2, pp=2, vpp=1, cp=1, dp=2, zero1=True, recompute="none", offload=False, hdp=False),
     [*SMALL, "optim.name=muon"]),
], ids=["tp2_pp2", "pp2_vpp2_zero1_full", "cp2_offload_full", "moe_ep2_tp2_pp2_zero1", "moe_ep2_pp1", "muon_zero1"])
def test_the_shallow_runs_extrapolate_to_the_full_depth_run(layout, model):
    """Runs of one and two layers (per stage and chunk) and the stage's micro-batches in flight, extrapolated to 8
    layers and 4·pp micro-batches, against the estimator run at 8 layers and 4·pp micro-batches."""
    world = layout.tp * layout.pp * layout.cp * layout.dp
    micro_batches = 4 * layout.pp
    overrides = [*model, *layout.overrides(), "trainer.micro_batch_size=1",
                 f"trainer.global_batch_size={micro_batches * layout.dp}",
                 "model.seq_length=256", "data.synthetic.num_docs=40",
                 "data.synthetic.mean_doc_length=40000"]  # few document boundaries
    shape, base, _ = layout_search.search_shape(overrides, world)
    for role, stage in estimate.roles(layout.pp):
        full = estimate.estimate_rank(overrides, world, stage, role, "h100")
        shallow = layout_search.shallow_rank(base, layout, shape, stage, role, "h100")
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "comm_bytes"):
            assert getattr(shallow, key) == getattr(full, key), (role, key, getattr(shallow, key), getattr(full, key))
        # the peak is set by the micro-batches in flight, other samples in the shallow run: where one of them holds
        # a document boundary, its per-document tensors differ by tens of KB
        for key in ("peak_bytes", "reserve_bytes"):
            assert getattr(shallow, key) == pytest.approx(getattr(full, key), rel=0.01), (role, key)
        for key in ("activation_bytes", "host_bytes"):  # tens of KB of a few hundred KB
            assert getattr(shallow, key) == pytest.approx(getattr(full, key), rel=0.05), (role, key)
        assert shallow.collective_bytes == pytest.approx(full.collective_bytes, rel=1e-6, abs=1), role
        # compute scales with the micro-batches but for the optimizer step, which runs once; the step's other
        # once-a-step ops (grad norm, bucket zeroing; an MoE model's load counts too) are scaled too: a few % of this
        # tiny model's step at 256 tokens a micro-batch (15% at 32; 8% for the MoE one), well under 0.1% at 70B
        # and 8K
        rel = 0.1 if model is MOE else 0.05
        assert shallow.compute_s == pytest.approx(full.compute_s, rel=rel), role
        # FLOPs likewise, Muon's once-a-step iterations unscaled (scaled with the micro-batches until 2026-12-08: 25%
        # high here)
        assert shallow.flops == pytest.approx(full.flops, rel=rel), role
        # TP's collectives in flight, and the CP ring's sends beside its blocks (since 2026-12-05), hide behind the
        # compute beside them: per micro-batch and layer, as compute does
        assert shallow.hidden_comm_s == pytest.approx(full.hidden_comm_s, rel=rel), role
        assert (shallow.hidden_comm_s > 0) == (layout.tp > 1 or layout.cp > 1), role
        # (an MoE model's expert buckets pad to their group's size at each depth: a few parts in a million)
        assert shallow.optimizer_s == pytest.approx(full.optimizer_s, rel=1e-5 if model is MOE else 1e-6), role


@pytest.mark.slow  # about 2 min on 2 cores: two searches (fake-tensor runs of each confirmed layout), a full estimate
def test_search_returns_layouts_that_fit_best_first(capsys):
    """A tiny model on 4 ranks with a memory limit at the smaller of two layouts' peaks: what is returned fits, is
    ordered by the estimator's tokens/s, and the best layout run by the plain estimator (full depth)
    has the peak reported (within 1%: other samples in flight)."""
    overrides = [*SMALL, "trainer.micro_batch_size=1", "trainer.global_batch_size=16"]
    # no time budget: on a busy 2-core machine the default 90 s confirmed one layout, not two (CI beside other tests)
    unlimited = layout_search.search(overrides, 4, "h100", top=2, max_confirm=2, budget_s=float("inf"))
    assert len(unlimited["layouts"]) == 2, unlimited
    limit = min(f["peak_bytes"] for f in unlimited["layouts"])  # the larger of the two no longer fits
    assert estimate.main([*overrides, "--world", "4", "--search", "--top", "2", "--json",
                          "--gpu-memory", str(limit / 2**30)]) == 0
    result = json.loads(capsys.readouterr().out)
    found = result["layouts"]
    assert found and all(f["peak_bytes"] <= limit for f in found), found
    rates = [f["tokens_per_s"] for f in found]
    assert rates == sorted(rates, reverse=True)
    best = found[0]
    direct = estimate.estimate([*overrides, *best["overrides"]], 4, "h100")
    assert max(r["peak_bytes"] for r in direct["ranks"]) == pytest.approx(best["peak_bytes"], rel=0.01)
    assert {"overrides", "peak_bytes", "tokens_per_s"} <= best.keys()


def test_search_says_when_nothing_fits(capsys):
    assert estimate.main([*SMALL, "trainer.micro_batch_size=1", "trainer.global_batch_size=16", "--world", "4",
                          "--search", "--gpu-memory", "0.1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "none of the" in err and "fits" in err and len(err.splitlines()) == 1, err
    assert "lower trainer.micro_batch_size" not in err, "a micro-batch of 1 is as low as it goes"
    # --json: the search's counts and notes on stdout (the line said "notes with --json" and --json printed none)
    assert estimate.main([*SMALL, "trainer.micro_batch_size=1", "trainer.global_batch_size=16", "--world", "4",
                          "--search", "--gpu-memory", "0.1", "--json"]) == 2
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["layouts"] == [] and result["candidates"] > 0 and len(err.strip().splitlines()) == 1, err


def test_search_says_when_no_layout_splits_the_batch(capsys):
    """6 GPUs and a global batch of 4: no data-parallel size (6 or 3 with tp, pp and cp powers of two) divides the
    batch, and the search had said that none of its 0 layouts fit in memory, naming fixes that could not help."""
    assert estimate.main([*SMALL, "trainer.micro_batch_size=1", "trainer.global_batch_size=4", "--world", "6",
                          "--search"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: no layout of 6 GPUs the search tries (tp, pp and cp powers of two) splits the global batch: "
                   "no data-parallel size they leave (at most 6) divides 4 sequences into micro-batches of 1; set "
                   "trainer.global_batch_size to a multiple of dp x 1, e.g. 6 (dp 6), or estimate another layout by "
                   "name (parallel.pp=3)"), err
    # the batch it names splits
    assert estimate.main([*SMALL, "trainer.micro_batch_size=1", "trainer.global_batch_size=6", "--world", "6",
                          "--search", "--top", "1"]) == 0


@pytest.mark.parametrize("setting, fragment", [
    ("parallel.fsdp=true", "--search does not price parallel.fsdp=true"),
    ("trainer.tokens_per_step=1024", "--search does not price trainer.tokens_per_step=1024"),
    ("parallel.cp_comm=a2a+p2p", "--search does not price parallel.cp_comm=a2a+p2p")])
def test_search_refuses_the_settings_its_closed_form_does_not_price(capsys, setting, fragment):
    """FSDP was pruned at ZeRO-1's bytes ("none of the 0 layouts fits" where tp1 dp8 fits), a token budget's tokens/s
    came out 22x low, the hierarchical ring's groups are not searched: each is one line naming the way out (an
    audit)."""
    extra = ["data.varlen=true"] if "tokens_per_step" in setting else []
    assert estimate.main([*SMALL, *extra, setting, "--world", "2", "--search"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {fragment}") and "without --search" in err and "\n" not in err, err


@pytest.mark.parametrize("tp, dp", [(2, 2), (4, 1)])
def test_the_closed_form_static_bytes_are_the_estimators(tp, dp):
    """The closed form's parameters per rank and bytes per parameter (the pruning rule) against a run; at tp 4 past
    the model's 2 kv heads, each rank keeps a whole one (the search had skipped such a tp, which megalm runs)."""
    layout = Layout(tp=tp, pp=2, vpp=1, cp=1, dp=dp, zero1=dp > 1, recompute="none", offload=False, hdp=False)
    overrides = [*SMALL, *layout.overrides(), "trainer.micro_batch_size=1", "trainer.global_batch_size=8"]
    shape, _, _ = layout_search.search_shape(overrides, 8)
    assert layout in layout_search.layouts(shape)
    rank = estimate.estimate_rank(overrides, 8, 0, "first stage", "h100")
    n, routed = layout_search.stage_parameters(shape, layout)
    assert rank.param_bytes == 2 * n and routed == 0
    static = rank.param_bytes + rank.grad_bytes + rank.optimizer_bytes + rank.comm_bytes
    assert static == pytest.approx(layout_search.static_bytes_per_parameter(True, dp > 1, dp) * n, abs=256)


def test_the_closed_form_s_link_bytes_are_the_estimators():
    """The closed form's bytes over the CP and DP links against a run's, at tp 2 and at tp 4 past the model's 2 kv
    heads, where each rank's ring passes a whole replicated head (it had priced half of one); and TP's bytes of those
    replicas, whose gradients every micro-batch all-reduces over TP: what a model of 4 kv heads does not send. One
    document a sequence, so that no document is padded to the ring's 2·cp (which the closed form leaves out)."""
    def both(tp: int, kv_heads: int = 2) -> tuple[dict[str, int], dict[str, float]]:
        layout = Layout(tp=tp, pp=1, vpp=1, cp=2, dp=1, zero1=False, recompute="none", offload=False, hdp=False)
        overrides = [*SMALL, *layout.overrides(), "trainer.micro_batch_size=1", "trainer.global_batch_size=2",
                     f"model.num_kv_heads={kv_heads}", "data.synthetic.mean_doc_length=100000",
                     "data.synthetic.num_docs=4"]
        shape, _, _ = layout_search.search_shape(overrides, 2 * tp)
        assert layout in layout_search.layouts(shape)
        rank = estimate.estimate_rank(overrides, 2 * tp, 0, "first stage", "h100")
        return rank.collective_bytes, layout_search.link_bytes(shape, layout)

    for tp in (2, 4):
        measured, closed = both(tp)
        assert measured["cp"] == closed["cp"], tp
        assert measured["dp_cp"] == pytest.approx(closed["dp"], abs=1024), tp  # and the final norm's
    unreplicated, unreplicated_closed = both(4, kv_heads=4)
    assert measured["tp"] - unreplicated["tp"] == closed["tp"] - unreplicated_closed["tp"] > 0


EAGER_FLOPS = [
    ("dense", 1, []), ("dense", 2, []), ("moe", 1, []), ("moe", 2, []),
    # a down projection that saves after its GEMM runs again under full recompute
    ("dense", 1, ["model.dropout=0.1"]), ("dense", 1, ["precision=fp8"]),
    ("dense", 1, ["parallel.gradient_accumulation_fusion=true"]),
    ("dense", 1, ["precision=fp8", "precision.skip=[output,'layers.*.mlp.down_proj']"])]
# compiled blocks run neither projection again (AOT's partitioner saves the residual), but as an opaque op
COMPILED_FLOPS = [("dense", 1, ["trainer.compile=true"]), ("dense", 1, ["trainer.compile=true", "model.dropout=0.1"]),
                  ("dense", 1, ["trainer.compile=true", "precision=mxfp8"]), ("moe", 1, ["trainer.compile=true"])]


@pytest.mark.parametrize("model, pp, extra, recompute", [
    *[(*case, recompute) for recompute in ("none", "full") for case in EAGER_FLOPS],
    *[(*case, "full") for case in COMPILED_FLOPS]])
def test_the_closed_form_s_flops_are_the_last_stage_s(model, pp, extra, recompute):
    """The closed form's FLOPs are the last stage's, which holds the output layer (a tenth of this small model's
    step) and, of an MoE model in a pipeline, MoE blocks only (the dense first block is the first stage's): the
    estimator's for that rank, to causal attention's s² against the step's documents' Σ s(s + 1). One document a
    sequence. They had been the layers' spread evenly over the stages, without the output layer. Full recompute
    runs a block's forward again but a dense block's down projection (torch's checkpoint stops early): priced as a
    whole forward until 2026-12-05, 6% high here. It does run again where it saves after its GEMM: under dropout,
    a recipe's linear or gradient accumulation fusion (where the closed form had priced it 6% low), on the layers
    the recipe does not skip. Compiled, neither the down nor the output projection runs again but as a recipe's
    opaque op (the closed form had priced the compiled step 2 to 8% high here)."""
    layout = Layout(tp=1, pp=pp, vpp=1, cp=1, dp=2, zero1=False, recompute=recompute, offload=False, hdp=False)
    overrides = [*(SMALL if model == "dense" else MOE), *extra, *layout.overrides(), "trainer.micro_batch_size=1",
                 "trainer.global_batch_size=4",
                 "data.synthetic.mean_doc_length=100000", "data.synthetic.num_docs=8"]
    shape, _, _ = layout_search.search_shape(overrides, 2 * pp)
    rank = estimate.estimate_rank(overrides, 2 * pp, pp - 1, "last stage", "h100")
    assert rank.flops == pytest.approx(layout_search.last_stage_flops(shape, layout), rel=0.02)


def test_what_full_recompute_runs_again_is_counted_over_the_blocks_that_have_it():
    """The shares of the GEMMs whose output only joins the residual that full recompute runs again. Eager: every
    attention output projection and MoE block's experts; the dense blocks' down projections under dropout, those a
    GEMM recipe does not skip, none without a recipe (an MoE model's dense blocks only). Compiled: neither projection
    but a recipe's opaque op."""
    from megalm.config.compose import compose_config
    from megalm.estimate.layout_search import Reruns

    def reruns(*overrides: str) -> Reruns:
        return layout_search.recompute_reruns(compose_config(list(overrides)))

    assert reruns(*SMALL) == Reruns(0.0, 1.0, 1.0) and reruns(*SMALL, "model.dropout=0.1") == Reruns(1.0, 1.0, 1.0)
    assert reruns(*SMALL, "precision=fp8").down == 1.0
    assert reruns(*SMALL, "precision=fp8", "precision.skip=[output,'layers.{last}.*']").down == 7 / 8
    assert reruns(*MOE, "precision=fp8").down == 1.0  # the one dense block (first_k_dense=1) runs the recipe
    assert reruns(*MOE, "precision=fp8", "precision.skip=[output,'layers.0.*']").down == 0.0
    compiled = [*SMALL, "trainer.compile=true"]
    assert reruns(*compiled, "model.dropout=0.1", "precision=fp8") == Reruns(0.0, 0.0, 0.0)  # FP8's casts in the graph
    assert reruns(*compiled, "precision=mxfp8", "precision.skip=[output,'layers.0.*']") == Reruns(7 / 8, 7 / 8, 0.0)


@pytest.mark.parametrize("pp, vpp", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_the_closed_form_s_pipeline_sends_are_the_estimators(pp, vpp):
    """The closed form's pp bytes are the first stage's sends, as the estimator counts them (interleaved, each chunk
    boundary it holds, one each way), and the gradient norm's one fp32 all-reduced over pp: what the search's
    confirmation measures (the first and last stages). It had counted 2 a micro-batch whatever the layout, and before
    2026-12-05's second session each receive beside each send (4)."""
    layout = Layout(tp=1, pp=pp, vpp=vpp, cp=1, dp=1, zero1=False, recompute="none", offload=False, hdp=False)
    overrides = [*SMALL, *layout.overrides(), "trainer.micro_batch_size=1", f"trainer.global_batch_size={pp}",
                 "data.synthetic.mean_doc_length=100000", "data.synthetic.num_docs=8"]
    shape, _, _ = layout_search.search_shape(overrides, pp)
    assert layout in layout_search.layouts(shape)
    rank = estimate.estimate_rank(overrides, pp, 0, "first stage", "h100")
    link = 2 * 4 * (pp - 1) // pp  # the gradient norm's square
    assert rank.collective_bytes["pp"] == layout_search.link_bytes(shape, layout)["pp"] + link


@pytest.mark.slow  # about 25 s: a fake-tensor step of a 16-rank layout
def test_the_closed_form_prices_an_moe_model_by_its_experts():
    """MoE: the parameters of the fuller stage (the last: no dense block), the routed experts among them split over
    ep, against a run; ZeRO-1 shards the experts' states over the expert-data-parallel ranks (dp / ep, times tp
    under sequence parallelism) and every other parameter's over dp; the FLOPs count active parameters only; every
    ep dividing dp and the experts is priced."""
    layout = Layout(tp=2, pp=2, vpp=1, cp=1, dp=4, zero1=True, recompute="none", offload=False, hdp=False, ep=2)
    overrides = [*MOE, *layout.overrides(), "trainer.micro_batch_size=1", "trainer.global_batch_size=8"]
    shape, _, _ = layout_search.search_shape(overrides, 16)
    rank = estimate.estimate_rank(overrides, 16, 1, "last stage", "h100")
    n, routed = layout_search.stage_parameters(shape, layout)
    assert rank.param_bytes == 2 * (n + 256)  # and the final norm, which the closed form leaves out
    assert routed == 4 * 8 // 2 * 3 * 256 * 128  # 4 layers of 8 experts over ep 2
    static = rank.param_bytes + rank.grad_bytes + rank.optimizer_bytes + rank.comm_bytes
    closed = layout_search.static_bytes_per_parameter(True, True, 4) * (n + 256 - routed) + \
        layout_search.static_bytes_per_parameter(True, True, 4 // 2 * 2) * routed
    assert static == pytest.approx(closed, abs=1024)
    peak, _ = layout_search.closed_form(shape, layout, "h100")
    assert peak > static
    assert {lay.ep for lay in layout_search.layouts(shape) if lay.dp == 4 and lay.cp == 1} == {1, 2, 4}
    model = resolve_model_defaults(compose_config(overrides).model)
    head = model.hidden_size * model.padded_vocab_size
    assert layout_search.active_layer_params(shape) * model.num_layers == matmul_params(model) - head


def test_layouts_the_rules_refuse_are_not_counted_as_confirmations(monkeypatch):
    """Under a backend that runs tp = 1 only (precision.backend=torchao, te), the closed form's best layouts may all be
    refused: each is named (the first five) or counted in the notes, and the `max_confirm` tries go to layouts the
    rules admit. The estimator's runs are stubbed: what is checked is which layouts reach them."""
    from types import SimpleNamespace

    from megalm.errors import ConfigError

    refused, reached = set(), []

    def shallow_rank(base, layout, shape, stage, role, gpu):
        if layout in refused or len(refused) < 7:  # the closed form's 7 best (the stages of one layout agree)
            refused.add(layout)
            raise ConfigError(f"{layout} refused")
        reached.append(layout)
        return SimpleNamespace(compute_s=1.0, optimizer_s=0.25, comm_s=0.0, peak_bytes=1, role=role, rank=0,
                               documents=[8], sequences=1)

    monkeypatch.setattr(layout_search, "shallow_rank", shallow_rank)
    result = layout_search.search([*SMALL, "trainer.micro_batch_size=1", "trainer.global_batch_size=16"], 4, "h100",
                                  top=8, max_confirm=2)
    refusals = [n for n in result["notes"] if n.startswith(("refused by the config's rules", "... and"))]
    assert result["confirmed"] == 2 and refusals, result
    assert len({*reached}) == 2 and not refused & {*reached}
    assert len(refusals) == layout_search.REFUSALS_SHOWN + 1 and refusals[-1].startswith("... and 2 more"), refusals
    for found in result["layouts"]:  # the bubble stretches the micro-batches' compute, not the optimizer step's
        layout = found["layout"]
        bubble = layout_search._bubble(layout["pp"], 16 // layout["dp"], layout["vpp"])
        assert found["step_time_s"] == pytest.approx(0.75 * bubble + 0.25, rel=1e-12), layout


def test_the_closed_form_prices_the_last_stage_s_logits_as_the_estimator():
    """The last stage's logits, by the vocabulary's share of the peak: what a larger vocabulary adds to the closed
    form's peak (the head's parameters and the loss's bytes: bf16 logits whose gradient the loss writes over them,
    and the fp32 chunk it holds at a time) is what it adds to the estimator's run, under TP's vocab-parallel loss (6
    bytes an element of the rank's [T, V/tp] at this size, where the whole shard is one chunk; 10 while its chunks
    wrote a second fp32 copy, and 6 before the loss was chunked)."""
    layout = Layout(tp=2, pp=2, vpp=1, cp=1, dp=1, zero1=False, recompute="none", offload=False, hdp=False)
    closed, estimated = [], []
    for vocab in (4096, 8192):
        overrides = [*SMALL, *layout.overrides(), "trainer.micro_batch_size=1", "trainer.global_batch_size=8",
                     "model.seq_length=256", f"model.vocab_size={vocab}"]
        shape, _, _ = layout_search.search_shape(overrides, 4)
        closed.append(layout_search.closed_form(shape, layout, "h100")[0])
        estimated.append(estimate.estimate_rank(overrides, 4, 1, "last stage", "h100").peak_bytes)
    assert closed[1] - closed[0] == pytest.approx(estimated[1] - estimated[0], rel=0.01), (closed, estimated)


def test_every_layout_the_search_prices_trains_as_priced():
    """Without trainer.micro_batch_size the search prices one sequence a micro-batch, but its layouts' overrides
    said nothing of it: the command plus a layout trained megalm-train's default of 6 (the docs' 70B answer was
    refused: 1024 is not divisible by 6 x 16). Each layout's overrides now carry the batch the search priced."""
    from megalm.training.validation import validate_run

    command = [*SMALL, "trainer.global_batch_size=8"]
    shape, _, _ = layout_search.search_shape(command, 4)
    batch = layout_search.priced_batch(command, shape)
    assert batch == ["trainer.micro_batch_size=1"]
    for layout in layout_search.layouts(shape):
        cfg = validate_run(compose_config([*command, *layout.overrides(), *batch]), world_size=4)
        assert (cfg.trainer.micro_batch_size, cfg.trainer.global_batch_size) == (shape.micro_batch,
                                                                                shape.global_batch), layout
    assert layout_search.priced_batch(SMALL, layout_search.search_shape(SMALL, 4)[0]) == [
        "trainer.micro_batch_size=1", "trainer.global_batch_size=4"]


def test_a_command_s_layout_keys_come_back_at_what_was_priced():
    """The search sets a command's offload, vpp, schedule, HDP and ep aside and prices each layout without them, but
    a layout's overrides named them only when on: the command plus the overrides trained offload the search had not
    priced (an audit, 2026-12-06)."""
    from megalm.training.validation import validate_run

    command = [*SMALL, "trainer.global_batch_size=8", "offload.enabled=true", "parallel.dp=4", "parallel.cp_comm=a2a"]
    shape, _, _ = layout_search.search_shape(command, 4)
    batch = layout_search.priced_batch(command, shape)
    seen = set()
    every = layout_search.layouts(shape)
    some = [*[x for x in every if x.offload][:3], *[x for x in every if not x.offload][:3],
            *[x for x in every if x.vpp > 1][:1]]  # each kind a few times (all of them: 21 s)
    for layout in some:
        overrides = layout_search.priced_layout(command, layout)
        cfg = validate_run(compose_config([*command, *overrides, *batch]), world_size=4)
        assert (cfg.offload.enabled, cfg.parallel.vpp, cfg.parallel.dp, cfg.parallel.cp_comm) == (
            layout.offload, layout.vpp, layout.dp, layout.cp_comm), overrides
        seen.add(layout.offload)
    assert seen == {False, True}


@pytest.mark.parametrize("bf16", [True, False])
def test_the_closed_form_s_ring_bytes_are_the_ring_s(bf16):
    """The closed form prices a layer's ring attention at what the ring op sends (ring.ring_sent_bytes, which the
    estimator counts and tests/dist/test_estimate_measured.py holds to a real run's sends): K/V forward and backward,
    dK/dV in fp32. It had priced 3·(cp - 1) K/V volumes, half the 4·cp - 2 a bf16 ring of 2 moves."""
    import torch

    from megalm.parallel.context.ring import ring_sent_bytes

    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k = torch.empty(64, 8, 16, dtype=dtype), torch.empty(64, 2, 16, dtype=dtype)
    for cp in (2, 4, 8):
        sent = ring_sent_bytes(q, k, cp, backward=False) + ring_sent_bytes(q, k, cp, backward=True)
        assert layout_search.ring_bytes(2 * k.numel(), cp, bf16, recomputed=False) == sent
        recomputed = sent + ring_sent_bytes(q, k, cp, backward=False)
        assert layout_search.ring_bytes(2 * k.numel(), cp, bf16, recomputed=True) == recomputed


@pytest.mark.parametrize("tp, recompute", [(1, "none"), (2, "none"), (1, "selective"), (1, "full")])
def test_the_closed_form_s_ulysses_bytes_are_the_estimators(tp, recompute):
    """Ulysses (`parallel.cp_comm=a2a`) is searched where cp divides each TP rank's query and kv heads: the closed
    form's CP bytes, four all-to-alls of q, k, v and the output a layer, mirrored in the backward and run again by
    either recompute, equal the estimator's trace of them."""
    layout = Layout(tp=tp, pp=1, vpp=1, cp=2, dp=1, zero1=False, recompute=recompute, offload=False, hdp=False,
                    cp_comm="a2a")
    overrides = [*SMALL, *layout.overrides(), "trainer.micro_batch_size=1", "trainer.global_batch_size=2",
                 "model.num_heads=8", "model.num_kv_heads=4", "data.synthetic.mean_doc_length=100000",
                 "data.synthetic.num_docs=4"]
    shape, _, _ = layout_search.search_shape(overrides, 2 * tp)
    assert layout in layout_search.layouts(shape)
    rank = estimate.estimate_rank(overrides, 2 * tp, 0, "first stage", "h100")
    assert rank.collective_bytes["cp"] == layout_search.link_bytes(shape, layout)["cp"] > 0


def test_a_sliding_window_is_searched_with_ulysses_alone():
    """Rings (and HDP's) refuse a sliding window: a windowed model's context-parallel layouts are all Ulysses, where
    its heads allow it, and none where they do not (the search had offered rings, each refused at confirmation)."""
    def windowed(*extra: str) -> list[Layout]:
        command = [*SMALL, "trainer.global_batch_size=8", "data.varlen=true", "model.sliding_window=8", *extra]
        return layout_search.layouts(layout_search.search_shape(command, 4)[0])

    both = windowed("model.num_heads=4", "model.num_kv_heads=2")
    assert {x.cp_comm for x in both if x.cp > 1} == {"a2a"} and not any(x.hdp for x in both)
    assert any(x.cp == 2 for x in both)
    assert not any(x.cp > 1 for x in windowed("model.num_heads=3", "model.num_kv_heads=1", "model.hidden_size=48"))
    # attention dropout refuses rings and HDP too
    command = [*SMALL, "trainer.global_batch_size=8", "data.varlen=true", "model.attention_dropout=0.1"]
    priced = layout_search.layouts(layout_search.search_shape(command, 4)[0])
    assert {x.cp_comm for x in priced if x.cp > 1} == {"a2a"} and not any(x.hdp for x in priced)
    # a window as long as the sequence holds every document whole: rings and HDP run it, and the search offers them
    # (a second reader found them offered and then refused at confirmation: the config refused any window)
    from megalm.training.validation import validate_run

    command = [*SMALL, "trainer.global_batch_size=8", "data.varlen=true", "model.sliding_window=32",
               "model.seq_length=32"]
    shape = layout_search.search_shape(command, 4)[0]
    priced = layout_search.layouts(shape)
    ring, hdp = (next(x for x in priced if test(x)) for test in (lambda x: x.cp > 1 and x.cp_comm == "ring",
                                                                  lambda x: x.hdp))
    for layout in (ring, hdp):
        validate_run(compose_config([*command, *layout.overrides(), *layout_search.priced_batch(command, shape)]),
                     world_size=4)
    unwindowed = layout_search.layouts(layout_search.search_shape([*SMALL, "trainer.global_batch_size=8",
                                                                   "data.varlen=true"], 4)[0])
    assert {x.cp_comm for x in unwindowed if x.cp > 1} == {"ring", "a2a"} and any(x.hdp for x in unwindowed)


def muon_and_adamw(model: list[str], layout: Layout, domain_index: int = 0):
    """The closed form's view and the estimator's last-stage rank (at data coordinate `domain_index`) of `layout`
    under Muon, and its rank under AdamW."""
    world = layout.tp * layout.pp * layout.cp * layout.dp
    runs = []
    for name in ("muon", "adamw"):
        overrides = [*model, f"optim.name={name}", *layout.overrides(), "trainer.micro_batch_size=1",
                     f"trainer.global_batch_size={2 * layout.dp}", "data.synthetic.mean_doc_length=100000",
                     "data.synthetic.num_docs=8"]
        shape, _, _ = layout_search.search_shape(overrides, world)
        assert layout in layout_search.layouts(shape)
        runs.append((shape, estimate.estimate_rank(overrides, world, layout.pp - 1, "last stage", "h100",
                                                   domain_index)))
    (shape, muon), (_, adamw) = runs
    return shape, muon, adamw


@pytest.mark.parametrize("model, layout", [
    (SMALL, Layout(tp=2, pp=2, vpp=1, cp=1, dp=2, zero1=False, recompute="none", offload=False, hdp=False)),
    pytest.param(MOE, Layout(tp=2, pp=1, vpp=1, cp=1, dp=2, zero1=False, recompute="none", offload=False, hdp=False,
                             ep=2), marks=pytest.mark.slow),  # about 15 s
], ids=["dense_tp2_pp2_dp2", "moe_ep2_tp2_dp2"])
def test_the_closed_form_prices_muon_as_the_estimator(model, layout):
    """Under optim.name=muon the closed form's static bytes (4 bytes of momentum a matrix element where AdamW keeps 8
    of moments; AdamW's for the vocabulary matrices, norms and routers), its Newton-Schulz FLOPs (the rank's share of
    its replicas' matrices, whole on every TP rank), and what Muon adds to the links (the broadcast fp32 updates over
    the replicas, the owners' gathers of the TP shards) against the estimator's run. It had priced Muon as AdamW:
    8.6 against 12 bytes of states a parameter at 1.3B, none of the iterations (8 of 78 TFLOP a step at dp 8)."""
    from megalm.estimate import muon_form

    shape, muon, adamw = muon_and_adamw(model, layout)
    assert shape.muon == 5
    stage = layout_search.fuller_stage(shape, layout)
    n, routed = stage.parameters
    static = muon.param_bytes + muon.grad_bytes + muon.optimizer_bytes + muon.comm_bytes
    experts = layout.dp * layout.cp * layout.tp // layout.ep
    closed = (muon_form.static_bytes(True, False, 2, n - routed - stage.adamw, stage.adamw)
              + muon_form.static_bytes(True, False, experts, routed, 0))
    assert static == pytest.approx(closed, rel=1e-3)  # the final norm, the biases the closed form leaves out
    # the rank owns its replicas' mean share of the iterations, within one matrix's (the costliest first to the least
    # loaded): exactly half of the dense model's (two of every matrix), 1.7% over it in the MoE one's
    flops = layout_search.rank_newton_schulz_flops(shape, layout, stage.dense_blocks, stage.moe_blocks)
    m, e = shape.model, shape.experts
    sides = [m.hidden, m.kv_dim, m.ffn] + ([e.ffn, e.shared_ffn] if e else [])
    largest = max(muon_form.newton_schulz_flops(rows, m.hidden, shape.muon) for rows in sides)
    assert adamw.optimizer_flops == 0 and abs(muon.optimizer_flops - flops) <= largest
    assert layout.ep > 1 or muon.optimizer_flops == flops
    added = {dim: layout_search.link_bytes(shape, layout)[dim] - layout_search.link_bytes(
        replace(shape, muon=0), layout)[dim] for dim in ("dp", "tp", "expert_dp") if dim != "expert_dp" or routed}
    measured = {dim: muon.collective_bytes[dim] - adamw.collective_bytes[dim] for dim in added}
    assert measured["tp"] == pytest.approx(added["tp"], rel=0.02) and measured["tp"] > 0  # the owners' gathers
    assert {k: v for k, v in measured.items() if k != "tp"} == {k: v for k, v in added.items() if k != "tp"}


def test_a_muon_step_waits_for_its_busiest_replica():
    """Three layers' matrices do not share out evenly over two replicas; each broadcast of an update waits for its
    owner, so both replicas' steps are priced at the busier one's iterations: the idler's own, traced, plus the
    busier one's excess over them (the owners' iterations priced by the same trace, on one matrix of each shape).
    Every replica runs the same AdamW step and momenta (without ZeRO-1), so the two ranks' traced optimizer steps
    differ by their iterations alone: the wait makes them equal. It had priced the idler's own."""
    layout = Layout(tp=1, pp=1, vpp=1, cp=1, dp=2, zero1=False, recompute="none", offload=False, hdp=False)
    ranks = [muon_and_adamw([*SMALL, "model.num_layers=3"], layout, index)[1] for index in (0, 1)]
    assert ranks[0].optimizer_flops != ranks[1].optimizer_flops and sum(r.muon_wait_s > 0 for r in ranks) == 1
    assert ranks[0].optimizer_s == pytest.approx(ranks[1].optimizer_s, rel=1e-9)


def test_the_wait_for_the_busiest_replicas_is_each_group_s(monkeypatch):
    """A rank's dense matrices and an MoE model's experts are shared out over different groups of replicas (the
    experts' span the TP peers, who iterate on the same dense matrices as this rank): each group's busiest replica's
    excess over this rank's share is waited for. Summed over owners across groups, rank 1's 3 s of dense matrices
    looked less than this rank's 1 + 5, and no wait was priced."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megalm.estimate import muon_form

    dense, experts = object(), object()
    matrices = {key: SimpleNamespace(full_shape=(rows, 8), parts=(rows,), replicas=group)
                for key, rows, group in (("a", 1, dense), ("b", 3, dense), ("c", 5, experts), ("d", 1, experts))}
    optimizer = SimpleNamespace(update=SimpleNamespace(matrices=matrices, owners={"a": 0, "b": 1, "c": 0, "d": 2}))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    assert muon_form.replica_seconds(optimizer, lambda shape: float(shape[-2])) == (6.0, 8.0)
