"""FSDP (ZeRO-3 through FSDP2's fully_shard) equals one process (fp32, same seed, same global batch), alone and
composed with TP, PP and CP.

Each worker runs the FSDP trainer, compared with the single-process run of the same model and data (recorded once per
file by rank 0: single_process_reference in tests/dist/equivalence.py). Compared (tests/dist/equivalence.py): every
gradient of the first step (this rank's FSDP shard against its chunk of the full gradient), the grad norm, 5 optimizer
steps of losses (1e-5 relative), the parameters after them and the validation loss.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from megalm.model.naming import canonical_named_parameters
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.equivalence import (
    assert_layout_matches,
    assert_resharded_run_continues,
    assert_resume_is_bit_exact,
    held_and_expected,
    single_process_reference,
)
from tests.dist.launch import run_distributed

STEPS = 5
COMMON = ["trainer.micro_batch_size=2"]


def check_fsdp(rank: int, world_size: int, overrides: list[str], tmp: str, param_atol: float) -> None:
    """`overrides` configure the FSDP run; the reference gets those that are not `parallel.*`."""
    same_model_and_data = [o for o in overrides if not o.startswith("parallel.")]
    reference = single_process_reference(rank, same_model_and_data, tmp, STEPS)
    par = Trainer(compose_config("parallel.fsdp=true", *overrides), f"{tmp}/par")
    shards = par.parallel.fsdp_mesh.shape[-1]  # HSDP: (replicate, shard)
    params = [p for _, p in canonical_named_parameters(par.model)]
    assert shards > 1 and all(isinstance(p, DTensor) for p in params)
    # every rank holds 1/shards of each parameter's rows (its chunk; a parameter with fewer rows than ranks: some
    # ranks hold none)
    held = sum(p.to_local().numel() for p in params)
    assert held <= sum(p.numel() for p in params) // shards + sum(math.prod(p.shape[1:]) for p in params), held

    def offloaded_as_one_process() -> None:
        """Activations only: FSDP's gathered weights are parameters the store leaves alone. Under a clip below the
        norm, every step clips (TINY's norms are 0.82-0.90: at the default 1.0 no layout clipped)."""
        if par.cfg.trainer.grad_clip < 0.82:
            assert float(par.grad_norm()) > par.cfg.trainer.grad_clip
        if par.cfg.offload.enabled:
            par_bytes = par.parallel.offload_store.offloaded_bytes
            assert par_bytes > 0 and reference.offloaded_bytes == par.mesh.dims.dp * par_bytes, \
                (reference.offloaded_bytes, par_bytes)

    assert_layout_matches(reference, par, rank, STEPS, param_atol, offloaded_as_one_process)


PARAM_ATOL = 1e-3  # as the other layouts that reorder sums (tests/dist/test_context_parallel.py)
LAYOUTS = {
    "dp2": (2, ["parallel.dp=2"]),
    "dp4": (4, ["parallel.dp=4"]),
    "dp4_keep_gathered": (4, ["parallel.dp=4", "parallel.fsdp_reshard_after_forward=false"]),
    "dp2_keep_gathered": (2, ["parallel.dp=2", "parallel.fsdp_reshard_after_forward=false"]),
    # one kv head: its rows are replicated over TP, so the grad norm weighs ranges of the fused qkv rows, which an
    # FSDP shard must place by its offset
    "tp2_dp2_sp": (4, ["parallel.tp=2", "parallel.dp=2", "parallel.sequence_parallel=true", "model.num_kv_heads=1"]),
    # the tied embedding's first- and last-stage shards are summed after FSDP's reduce-scatter
    "pp2_dp2_tied": (4, ["parallel.pp=2", "parallel.dp=2", "model.num_layers=4", "model.tie_embeddings=true"]),
    "cp2_dp2": (4, ["parallel.cp=2", "parallel.dp=2"]),
    "hsdp_dp4": (4, ["parallel.dp=4", "parallel.fsdp_shard_size=2"]),
    # two micro-batches a rank: the replicas' all-reduce deferred to each unit's last backward (FsdpGrads)
    "hsdp_dp4_accumulated": (4, ["parallel.dp=4", "parallel.fsdp_shard_size=2", "trainer.global_batch_size=16"]),
    # three micro-batches a rank, reduce-scattered once: the unsharded gradients accumulate in between
    "dp2_reduce_once": (2, ["parallel.dp=2", "parallel.fsdp_reduce_each_micro_batch=false"]),
    # and each pipeline chunk's last backward found in the interleaved schedule (PipelineRuntime)
    "pp2_vpp2_dp2_reduce_once": (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved",
                                     "parallel.dp=2", "model.num_layers=4",
                                     "parallel.fsdp_reduce_each_micro_batch=false", "trainer.global_batch_size=16"]),
    "dp2_offload": (2, ["parallel.dp=2", "offload.enabled=true"]),
    "dp2_selective": (2, ["parallel.dp=2", "parallel.recompute=selective"]),
    # the clip's coefficient applied to the shards (FsdpGrads.scale_grads): no other layout clipped (a test audit)
    "dp2_clipped": (2, ["parallel.dp=2", "trainer.grad_clip=0.3"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fsdp_matches_single_process(tmp_path, name):
    world, parallel = LAYOUTS[name]
    run_distributed(check_fsdp, world, COMMON + parallel, str(tmp_path), PARAM_ATOL, timeout=240)


def test_fsdp_starts_from_init_from_weights(tmp_path):
    """model.init_from under FSDP: each rank copies its own rows of every weight into its DTensor shard (it raised
    "mixed torch.Tensor and DTensor"), and trains as one process started from the same weights."""
    source = Trainer(compose_config(*COMMON, "model.init_std=0.05", "trainer.max_steps=1"), tmp_path / "source")
    source.train_step(0)
    checkpoint = source.save()
    run_distributed(check_fsdp, 2, [*COMMON, "parallel.dp=2", f"model.init_from={checkpoint}"], str(tmp_path),
                    PARAM_ATOL, timeout=240)


def test_fsdp_resume_is_bit_exact(tmp_path):
    """An FSDP run stopped and resumed (its sharded weights and Adam moments gathered into the layout-free files,
    then scattered back; saved in the background, every step) repeats the straight run's losses exactly."""
    layout = ["parallel.fsdp=true", "parallel.dp=2", "trainer.max_steps=4", "trainer.async_save=true",
              "trainer.save_interval=1"]
    assert_resume_is_bit_exact(tmp_path, 2, layout, stop_at=2, timeout=240)


def test_fsdp_checkpoints_reshard_through_zero1_and_back(tmp_path):
    """FSDP dp4 -> FSDP tp2 dp2 -> tp2 dp2 ZeRO-1 -> FSDP dp2 in one run dir, each resuming the last one's
    checkpoint: every segment's losses are the single-process run's (1e-5 relative), so nothing of the weights or the
    optimizer state is lost or misplaced between the layouts. FSDP under TP saves and loads its chunks over both
    (`checkpoint.tensors.fsdp_tp_mesh`), the one kv head's rows, which both TP ranks hold, over FSDP's alone."""
    common = ["trainer.max_steps=8", "model.num_kv_heads=1", *COMMON]
    segments = [(4, ["parallel.fsdp=true", "parallel.dp=4", "trainer.stop_at_step=2"]),
                (4, ["parallel.fsdp=true", "parallel.tp=2", "parallel.dp=2", "parallel.sequence_parallel=true",
                     "trainer.stop_at_step=4"]),
                (4, ["parallel.tp=2", "parallel.dp=2", "parallel.zero1=true", "trainer.stop_at_step=6"]),
                (2, ["parallel.fsdp=true", "parallel.dp=2"])]
    assert_resharded_run_continues(tmp_path, common, segments)


def check_recipe_under_fsdp(rank: int, world_size: int, overrides: list[str], tmp: str) -> None:
    """FSDP dp2 against plain dp2 under one FP8/MX recipe: every rank quantizes the same gathered weights (after each
    gather, no per-step cache) and its own activations, and two ranks' sums are the same either way, so the runs
    agree to fp32 rounding: first-step gradients and the losses of a few steps."""
    plain = Trainer(compose_config(*overrides, "parallel.dp=2"), f"{tmp}/plain")
    fsdp = Trainer(compose_config(*overrides, "parallel.dp=2", "parallel.fsdp=true"), f"{tmp}/fsdp")
    for t in (plain, fsdp):
        t.forward_backward(0)
    full = dict(canonical_named_parameters(plain.model))
    for name, p in canonical_named_parameters(fsdp.model):
        torch.testing.assert_close(*held_and_expected(fsdp.model, name, p.grad, full[name].grad), rtol=1e-5,
                                   atol=1e-7, msg=lambda m, n=name: f"rank {rank} {overrides} grad {n}: {m}")
    for t in (plain, fsdp):
        t.optimizer.zero_grad(set_to_none=True)
    a = [plain.train_step(s).loss for s in range(3)]
    b = [fsdp.train_step(s).loss for s in range(3)]
    assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b, strict=True)), (overrides, a, b)


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8"])
def test_fp8_and_mx_recipes_under_fsdp_match_plain_data_parallel(tmp_path, recipe):
    run_distributed(check_recipe_under_fsdp, 2, [*COMMON, f"precision={recipe}", "precision.autocast=false"],
                    str(tmp_path), timeout=240)


def check_checkpoint_memory(rank: int, world_size: int, tmp: str, parallel: list[str]) -> None:
    from megalm.measure import LiveStorages
    from megalm.training.checkpoint import load_checkpoint

    layout = [*COMMON, *parallel, "parallel.fsdp=true", "model.num_layers=4", "model.hidden_size=128",
              "trainer.max_steps=1"]
    trainer = Trainer(compose_config(*layout), f"{tmp}/run")
    trainer.fit()
    params = [p for _, p in canonical_named_parameters(trainer.model)]
    shard = sum(p.to_local().nbytes for p in params)  # this rank's fp32 weights; each Adam moment as much
    # the whole tensor gathered at a time (over TP too)
    largest = max(p.numel() * p.element_size() for p in params) * trainer.mesh.dims.tp
    with LiveStorages() as live:
        path = trainer.save()
    assert live.peak("cpu") <= 3 * shard + 2 * largest, (live.peak("cpu"), shard, largest)
    fresh = Trainer(compose_config(*layout, "trainer.resume=never"), f"{tmp}/fresh")
    with LiveStorages() as live:  # the targets (3 shards), the moments it keeps (2), one whole tensor at a time
        load_checkpoint(path, fresh.model, fresh.optimizer, fresh.mesh, fresh.device)
    assert live.peak("cpu") <= 5 * shard + 3 * largest, (live.peak("cpu"), shard, largest)
    for (_, loaded), (_, saved) in zip(canonical_named_parameters(fresh.model), canonical_named_parameters(
            trainer.model), strict=True):
        assert torch.equal(loaded.to_local(), saved.to_local())


@pytest.mark.parametrize("world, parallel", [
    pytest.param(4, ["parallel.dp=4"], id="dp4"),
    pytest.param(4, ["parallel.tp=2", "parallel.dp=2", "parallel.sequence_parallel=true"], id="tp2_dp2"),
    # HSDP under TP: chunks over a 3-D mesh (replicate, shard, tp); 19 s
    pytest.param(8, ["parallel.tp=2", "parallel.dp=4", "parallel.fsdp_shard_size=2",
                     "parallel.sequence_parallel=true"], id="tp2_hsdp4", marks=pytest.mark.slow)])
def test_fsdp_checkpoints_hold_this_rank_s_shards_and_one_whole_tensor(tmp_path, world, parallel):
    """A save hands DCP each rank's chunk of every stored piece (`checkpoint.tensors.fsdp_pieces_chunk`) and a load
    reads into such chunks, gathering one whole tensor at a time: the storage probe's peak over a save stays within
    the rank's weights and moments (3 shards) and two whole tensors, over a load within the targets, the moments it
    keeps and three. Until 2026-12-05 DCP was handed every gathered weight and moment at once: 11.9 MB of a save's
    peak and 23.3 MB of a load's, against 2.9 and 5.2 MB now (0.87 MB shards of a 3.5 MB model, 4 ranks). Under
    tp 2 each rank's chunks are cut from the whole tensor over the FSDP and TP ranks together
    (`checkpoint.tensors.fsdp_tp_mesh`), where until the day's second session each rank held its TP slice of every
    tensor whole: a save's peak 5.4 → 3.1 MB, a load's 7.2 → 4.9 MB (0.89 MB shards)."""
    run_distributed(check_checkpoint_memory, world, str(tmp_path), parallel, timeout=300)


ACCUMULATED = ["trainer.global_batch_size=16", "trainer.micro_batch_size=2"]  # dp 4: 2 micro-batches a rank


def check_reductions_per_step(rank: int, world_size: int, tmp: str, overrides: list[str]) -> None:
    """The collectives FSDP runs over a step's backward, counted where torch.distributed is called (FSDP2 calls
    `dist.reduce_scatter_single` on torch 2.13, `dist.reduce_scatter_tensor` on 2.11, and under HSDP `dist.all_reduce`
    over the replicate group), against the number of FSDP units: each unit sends across replicas once a step, and
    with `fsdp_reduce_each_micro_batch=false` reduce-scatters once a step too."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    trainer = Trainer(compose_config(*COMMON, *ACCUMULATED, "parallel.fsdp=true", *overrides), f"{tmp}/run")
    mesh = trainer.parallel.fsdp_mesh
    calls = {"reduce_scatter": 0, "replicas": 0}
    counted = {"reduce_scatter_single": ("reduce_scatter", mesh.get_group(mesh.ndim - 1)),
               "reduce_scatter_tensor": ("reduce_scatter", mesh.get_group(mesh.ndim - 1)),
               "all_reduce": ("replicas", mesh.get_group(0) if mesh.ndim > 1 else None)}
    wrapped = {name: getattr(dist, name) for name in counted if hasattr(dist, name)}

    def counting(name):
        def call(*args, **kwargs):
            kind, group = counted[name]
            calls[kind] += group is not None and kwargs.get("group") is group
            return wrapped[name](*args, **kwargs)
        return call

    units = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
    for name in wrapped:
        setattr(dist, name, counting(name))
    try:
        _, share = trainer.forward_backward(0)
    finally:
        for name, function in wrapped.items():
            setattr(dist, name, function)
    micro_batches = len(share.micro_batches)
    assert micro_batches == 2, micro_batches
    reduce_once = "parallel.fsdp_reduce_each_micro_batch=false" in overrides
    assert calls["reduce_scatter"] == units * (1 if reduce_once else micro_batches), (calls, units)
    # bf16 sums: each micro-batch's joins the fp32 shard, where FSDP would hold them summed in bf16
    in_bf16 = "parallel.grad_reduce_dtype=bf16" in overrides and not reduce_once
    assert calls["replicas"] == (units * (micro_batches if in_bf16 else 1) if mesh.ndim > 1 else 0), (calls, units)


@pytest.mark.parametrize("overrides", [
    pytest.param(["parallel.dp=4", "parallel.fsdp_shard_size=2"], id="hsdp"),
    pytest.param(["parallel.dp=4", "parallel.fsdp_shard_size=2", "parallel.fsdp_reduce_each_micro_batch=false"],
                 id="hsdp_reduce_once"),
    pytest.param(["parallel.dp=4", "parallel.fsdp_reduce_each_micro_batch=false"], id="fsdp_reduce_once"),
    pytest.param(["parallel.dp=4", "parallel.fsdp_shard_size=2", "parallel.grad_reduce_dtype=bf16"],
                 id="hsdp_bf16_sums")])
def test_fsdp_sends_gradients_across_replicas_once_a_step(tmp_path, overrides):
    """Under gradient accumulation HSDP all-reduces across replicas in each unit's last backward only (TorchTitan's
    set_requires_all_reduce), where it had all-reduced every micro-batch, except where the held sums would be bf16
    (`grad_reduce_dtype=bf16`: a second reader measured 7.7e-3 relative error against 3.0e-3 over 32
    micro-batches); `fsdp_reduce_each_micro_batch=false` also reduce-scatters once. That the deferred sums arrive
    whole is the equivalence tests' (LAYOUTS)."""
    run_distributed(check_reductions_per_step, 4, str(tmp_path), overrides, timeout=240)
