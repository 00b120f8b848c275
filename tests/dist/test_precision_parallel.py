"""Precision recipes compose with tensor parallelism: tp2 trains like tp1 under the same recipe.

A TP shard quantizes its own K-slice. With hidden 128 / 4 heads / 2 kv heads every sharded K (q, k,
v, gate, up outputs; o, down inputs) splits into whole 32-element blocks, so round-to-nearest recipes
(mxfp8, mxfp4_rtn) quantize exactly tp1's blocks. With the rest of the model in fp32
(`precision.autocast=false`) tp2 then equals tp1 up to fp32 summation order. Where that order differs
(the CPU's GEMM kernels split K differently for a shard than for the whole; which ones depends on the
machine), an element on a rounding boundary moves a whole MX step, and the flip travels on through the
quantized GEMMs: the first step's gradients of the head (output and final norm, no MX GEMM before them)
agree to 1e-4, every other one to a few percent (measured on a 2-core AMD EPYC: mxfp8 up to 0.7%,
mxfp4_rtn up to 5.3% in the first block). A skipped reduction or a block quantized across a shard
boundary is off by O(1) instead.
Later steps drift apart slowly (losses ~5e-5 apart after 4 steps; mxfp4_rtn up to 3.3e-4).

Why not under bf16 autocast: a row-parallel layer sums bf16 partial products over TP where tp1 rounds
one GEMM, a ~0.4% difference in the gradients, and a 4-bit quantizer amplifies such a perturbation
(an element near a rounding boundary moves a whole step, ~20% of its value): the FP4 gradients of
tp1 and tp2 then differ by ~5-20%, as two draws would. mxfp4 (SR + RHT) draws its noise per shard
shape, so tp2 draws other (equally unbiased) noise than tp1: there the losses agree up to SR noise.
"""

from __future__ import annotations

import pytest

from megalm.model.naming import canonical_named_parameters
from megalm.parallel.dims import ParallelDims, ParallelMesh
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.equivalence import shard_of
from tests.dist.launch import run_distributed

# make_vocab_size_divisible_by=32: 320 rows under tp1 and tp2 alike. A padding that differs between the two
# (Megatron's rule pads tiny's 320 to 384 for tp2) changes the fp32 summation of the head's input gradient by
# ~1e-7, which the FP8/MX gradient quantizers then amplify to ~0.5%: what this test checks is the recipes under
# TP, so both layouts get the same rows (tests/dist/test_trainer_parallel.py covers the padding in fp32).
MODEL = ["model.hidden_size=128", "model.num_heads=4", "model.num_kv_heads=2", "model.make_vocab_size_divisible_by=32"]
STEPS = 4


def check_tp_recipe(rank: int, world_size: int, overrides: list[str], loss_rtol: float,
                    grad_rtol: tuple[float, float, bool], tmp: str) -> None:
    """grad_rtol: (the head, which no rounding flip reaches; every other parameter; whether that bound is on their
    median: mxfp4's stochastic rounding and Hadamard signs per shard leave each within 0.23-0.53, a skipped TP
    reduction leaves them near 0.8)."""
    import statistics

    one = Trainer(compose_config(*MODEL, *overrides), f"{tmp}/one{rank}", mesh=ParallelMesh(ParallelDims()))
    tp = Trainer(compose_config(*MODEL, *overrides, "parallel.tp=2"), f"{tmp}/tp")
    if grad_rtol is not None:
        errors = []
        one.forward_backward(0)
        tp.forward_backward(0)
        # the summed fp32 gradients: .grad, or a parameter's slice of the buckets behind bf16 working weights
        summed = lambda trainer, p: trainer.parallel.reducer.summed_grad(p).float()  # noqa: E731
        full = {name: summed(one, p) for name, p in canonical_named_parameters(one.model)}
        for name, p in canonical_named_parameters(tp.model):
            expected = shard_of(tp.model, name, full[name])  # vocab tables: tp2 pads more rows (zero grads)
            error = ((summed(tp, p) - expected).norm() / expected.norm()).item()
            exact = name in ("output.weight", "final_norm.weight")
            limit = grad_rtol[0] if exact else grad_rtol[1]
            if exact or not grad_rtol[2]:
                assert error <= limit, f"{overrides} {name}: tp2 grad differs from tp1 by {error:.3g} (relative)"
            else:
                errors.append(error)
        if errors:
            middle = statistics.median(errors)
            assert middle <= grad_rtol[1], f"{overrides}: tp2 grads differ from tp1 by {middle:.3g} (the median)"
        for t in (one, tp):
            t.optimizer.zero_grad(set_to_none=True)
    a = [one.train_step(s).loss for s in range(STEPS)]
    b = [tp.train_step(s).loss for s in range(STEPS)]
    for step, (x, y) in enumerate(zip(b, a, strict=True)):
        assert abs(x - y) <= loss_rtol * abs(y), f"{overrides} step {step}: tp2 loss {x} vs tp1 {y}"


@pytest.mark.parametrize("overrides, loss_rtol, grad_rtol", [
    (["precision=mxfp8", "precision.autocast=false"], 3e-4, (1e-4, 3e-2, False)),
    (["precision=mxfp4_rtn", "precision.autocast=false"], 1e-3, (1e-4, 1.5e-1, False)),
    # SR + RHT noise per shard, bf16 around: the head's (bf16 only) within 2e-2, the others' median within 0.6 (0.39
    # measured; a skipped TP reduction of the input gradients ~0.8: with losses only it passed, a test-quality audit)
    (["precision=mxfp4"], 3e-3, (2e-2, 0.6, True)),
], ids=["mxfp8", "mxfp4_rtn", "mxfp4"])
def test_tp2_matches_tp1(tmp_path, overrides, loss_rtol, grad_rtol):
    run_distributed(check_tp_recipe, 2, overrides, loss_rtol, grad_rtol, str(tmp_path), timeout=240)


def record_wgrad_seeds(rank: int, world_size: int, layout: str, tmp: str) -> None:
    """One mxfp4 step under `layout`: the wgrad generator seeds each rank drew, in call order, saved per rank."""
    import torch

    import megalm.precision.linear as recipe_linear

    seeds, make = [], recipe_linear.gemm_generator

    def recording(seed, gemm, device):
        if gemm == "wgrad":
            seeds.append(seed)
        return make(seed, gemm, device)

    recipe_linear.gemm_generator = recording
    try:
        Trainer(compose_config(*MODEL, "precision=mxfp4", layout), f"{tmp}/run").train_step(0)
    finally:
        recipe_linear.gemm_generator = make
    torch.save(seeds, f"{tmp}/seeds{rank}.pt")


@pytest.mark.parametrize("layout, shared", [("parallel.cp=2", False), ("parallel.tp=2", True)], ids=["cp2", "tp2"])
def test_ring_ranks_draw_their_own_rounding_noise(tmp_path, layout, shared):
    """A CP ring's ranks hold different tokens of one micro-batch, so each draws its own SR noise and RHT signs, as
    one process draws independent noise for every token (shared draws correlate the ring's rounding errors: the
    summed weight gradient's error grew with cp, 1.3x at cp=4). TP ranks split one GEMM's K and must share them."""
    import torch

    run_distributed(record_wgrad_seeds, 2, layout, str(tmp_path), timeout=240)
    first, second = (torch.load(tmp_path / f"seeds{rank}.pt") for rank in (0, 1))
    assert first and len(first) == len(second)
    common = len(set(first) & set(second))
    assert common == (len(first) if shared else 0), f"{layout}: {common} of {len(first)} wgrad seeds shared"


def check_delayed_histories(rank: int, world_size: int, layout: list[str], tmp: str) -> None:
    """fp8_delayed under `layout`, 3 steps (4 under HDP): the losses are one process's; every rank's amax histories
    (rings and the step's pending max) are saved for the test to compare. Under HDP a rank may run no micro-batch in a
    step (what is checked)."""
    import torch

    from megalm.precision.install import amax_history_tensors

    model = [*MODEL, "precision=fp8_delayed", "precision.autocast=false"]
    same_data = [o for o in layout if not o.startswith("parallel.")]
    one = Trainer(compose_config(*model, *same_data), f"{tmp}/one{rank}", mesh=ParallelMesh(ParallelDims()))
    par = Trainer(compose_config(*model, *layout), f"{tmp}/par")
    idle = []
    # DP sums the same products in another order; CP's first step scales by each shard's amax and HDP's micro-batches
    # are cut otherwise, and an FP8 rounding flip then grows: 3.5e-4 by step 2 under CP on an AVX-512 Xeon, under
    # 1e-4 on an AMD EPYC (2026-12-06: the CPU's kernels round differently). The histories' checks below are exact.
    rtol = 1e-4 if layout == ["parallel.dp=2"] else 1e-3
    for step in range(4 if par.cfg.parallel.hdp else 3):
        a, b = one.train_step(step).loss, par.train_step(step).loss
        assert abs(a - b) <= rtol * abs(a), f"{layout} step {step}: loss {b} vs one process's {a}"
        if par.cfg.parallel.hdp:
            idle.append([not todo for todo in par.parallel.split.last_plan.per_rank])
    if par.cfg.parallel.hdp:  # a rank idle in a step after one it worked in (the case that went wrong)
        assert any(idle[s][r] and not idle[s - 1][r] for s in range(1, len(idle)) for r in range(world_size)), idle
    for name, trainer in (("one", one), ("par", par)):  # keys "amax/<layout>/<layer>/<tensor>/<part>"
        torch.save({key.split("/", 2)[2]: value for key, value in amax_history_tensors(trainer.model, "").items()},
                   f"{tmp}/{name}{rank}.pt")


HDP_IDLE = ["parallel.hdp=true", "parallel.dp=2", "parallel.hdp_capacity=24", "data.varlen=true",
            "model.seq_length=48", "data.synthetic.mean_doc_length=30", "trainer.tokens_per_step=20"]


@pytest.mark.parametrize("layout", [["parallel.dp=2"], ["parallel.cp=2"], HDP_IDLE], ids=["dp2", "cp2", "hdp_idle"])
def test_delayed_scaling_histories_agree_over_the_batch_s_ranks(tmp_path, layout):
    """A DP rank sees its micro-batches, a CP rank its half of each: their amaxes are maxed over the ranks after each
    step's backward, so every rank casts the next step with the same scales, one process's under DP (unreduced, dp
    rank 1's x history of the first layer read 3.72 where one process's read 3.89). Under CP the first step scales
    by each shard's current amax (as current scaling does; docs/guide.md), so the runs part by ~4e-5 there and
    the histories, equal on the ring's ranks, follow their own run. Under HDP a rank idle in a step joined the
    reduction with the step before's max and skipped a roll (its ring a step behind: an audit, 2026-12-06)."""
    import torch

    run_distributed(check_delayed_histories, 2, layout, str(tmp_path), timeout=240)
    ranks = [torch.load(tmp_path / f"par{rank}.pt") for rank in (0, 1)]
    one = torch.load(tmp_path / "one0.pt")
    assert ranks[0].keys() == ranks[1].keys() == one.keys() and any(k.endswith("/history") for k in one)
    for key, value in ranks[0].items():
        assert torch.equal(ranks[1][key], value), f"{layout} {key}: the ranks' histories differ"
        if layout != ["parallel.cp=2"]:  # under HDP dy's maxes follow the loss's drift: a few % by the 4th step
            rtol = 5e-2 if layout is HDP_IDLE and (key.endswith("/pending") or "/dy/" in key) else 1e-5
            torch.testing.assert_close(value, one[key], rtol=rtol, atol=0,
                                       msg=lambda m, key=key: f"{key}: not one process's: {m}")


def resume_delayed_histories(rank: int, world_size: int, tmp: str, split: str, first: bool) -> None:
    """Under pp 2 and layer split `split`, train tmp/run to step 2 (`first`) or resume it and save this rank's amax
    histories."""
    import torch

    from megalm.precision.install import amax_history_tensors

    common = ["precision=fp8_delayed", "model.num_layers=4", "trainer.max_steps=4", "parallel.pp=2",
              f"parallel.layers_per_stage={split}"]
    if first:
        Trainer(compose_config(*common, "trainer.stop_at_step=2"), f"{tmp}/run").fit()
        return
    resumed = Trainer(compose_config(*common), f"{tmp}/run")
    torch.save({key.split("/", 2)[2]: value for key, value in amax_history_tensors(resumed.model, "").items()},
               f"{tmp}/{split}{rank}.pt")


@pytest.mark.parametrize("saved, moved", [("[3,1]", "[1,3]"), ("[4,0]", "[2,2]")], ids=["3_1_to_1_3", "4_0_to_2_2"])
def test_delayed_histories_follow_a_layer_to_its_new_stage(tmp_path, saved, moved):
    """A resume that moves layers between pipeline stages (parallel.layers_per_stage [3,1] -> [1,3]) keeps the layout
    tag, so each rank read only its own file, and layers 1 and 2, now on stage 1, started afresh without a word (an
    audit, 2026-12-06). Each layer's history is now read from the file of the stage that held it: the union of the
    ranks' histories is the same as after a resume under the split that saved them; also where the new stage had
    saved none ([4,0]: stage 1 held the head only, which precision.skip keeps out of FP8)."""
    import torch

    for split, first in ((saved, True), (saved, False), (moved, False)):
        run_distributed(resume_delayed_histories, 2, str(tmp_path), split, first, timeout=300)
    kept, after = ({k: v for rank in (0, 1) for k, v in torch.load(tmp_path / f"{split}{rank}.pt").items()}
                   for split in (saved, moved))
    layers = {key.split("/")[0].split(".")[1] for key in kept if key.endswith("/history")}
    assert layers == {"0", "1", "2", "3"}, sorted(kept)
    assert after.keys() == kept.keys()
    for key, value in kept.items():
        assert torch.equal(after[key], value), key
