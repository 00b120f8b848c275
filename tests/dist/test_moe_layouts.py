"""MoE models under the layouts that compose with them today equal one process (fp32, gloo, 5 steps): losses, the
first step's gradients, the parameters, and the aux-loss-free bias every rank moved from the batch's counts. The
balancing losses of a pipeline stage that is not the last reach the gradient too; with a capacity factor the same
assignments are dropped (the losses and the logged drops agree)."""

from __future__ import annotations

import pytest
import torch

from megalm.model.moe import moe_modules
from megalm.parallel.dims import ParallelDims, ParallelMesh
from megalm.parallel.expert.dispatch import AllToAllDispatcher
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.equivalence import assert_grads_match, assert_resharded_run_continues, assert_same_training
from tests.dist.launch import run_distributed

MOE = ["model=moe_tiny", "model.num_layers=2", "model.hidden_size=64", "model.moe.expert_ffn_hidden_size=32",
       "model.moe.aux_loss_coeff=0.01", "model.moe.seq_aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001",
       "model.moe.bias_update_rate=0.01"]
STEPS = 5


def check_moe_layout(rank: int, world_size: int, same: list[str], layout: list[str], tmp: str) -> None:
    """`same`: the model and data of both runs; `layout`: the parallel run's."""
    ref = Trainer(compose_config(*MOE, *same), f"{tmp}/ref{rank}", mesh=ParallelMesh(ParallelDims()))
    par = Trainer(compose_config(*MOE, *same, *layout), f"{tmp}/par")
    assert (f" ep={par.cfg.parallel.ep}" in par.parallel.describe()) == (par.cfg.parallel.ep > 1)
    ref.forward_backward(0)
    par.forward_backward(0)
    if not par.cfg.parallel.zero1:  # ZeRO-1 ranks keep their slice of the gradient only
        assert_grads_match(ref, par, rank)
    torch.testing.assert_close(par.grad_norm(), ref.grad_norm(), rtol=1e-5, atol=0)  # each element counted once
    for t in (ref, par):
        t.optimizer.zero_grad(set_to_none=True)
        t.expert_load.take(t.device)  # the gradient check's counts: not a step's
    assert_same_training(ref, par, rank, STEPS)
    moved = same_bias(ref, par)
    ref_step, par_step = ref.train_step(STEPS), par.train_step(STEPS)  # the logged load, drops and losses agree
    for key, value in ref_step.moe.items():
        assert par_step.moe[key] == pytest.approx(value, rel=1e-5), key
    if ref.cfg.model.moe.capacity_factor is not None:
        assert ref_step.moe["moe_dropped"] > 0  # the case drops assignments
    assert same_bias(ref, par) or moved  # sign steps of one size can cancel after an even number of steps


def same_bias(ref: Trainer, par: Trainer) -> bool:
    """The aux-loss-free bias every rank moved equals the single process's, exactly; whether any is not 0."""
    ref_bias = {i: m.router.expert_bias for i, m in moe_modules(ref.model).items()}
    for layer, module in moe_modules(par.model).items():
        torch.testing.assert_close(module.router.expert_bias, ref_bias[layer], rtol=0, atol=0)
    return any(bias.abs().sum() > 0 for bias in ref_bias.values())


DROPLESS, CAPACITY = ["model.moe.capacity_factor=null"], ["model.moe.capacity_factor=1.0"]
PROBS = ["model.moe.drop_policy=probs"]
SHARED = ["model.moe.num_shared_experts=1", "model.moe.shared_ffn_hidden_size=48"]  # TP splits them as an MLP
VARLEN = ["data.varlen=true"]  # documents of every length: zigzag pads them, and the routers must not count it
BATCH16 = ["trainer.global_batch_size=16"]  # 4 data-parallel ranks of micro-batches of 4 samples
LAYOUTS = {  # name: (ranks, the model and data of both runs, the layout)
    "dp2": (2, CAPACITY, ["parallel.dp=2"]),
    "pp2_capacity": (2, CAPACITY, ["parallel.pp=2"]),
    "pp2_offload": (2, DROPLESS, ["parallel.pp=2", "offload.enabled=true", "offload.min_tensor_bytes=0"]),
    "dp2_zero1_recompute": (2, DROPLESS, ["parallel.dp=2", "parallel.zero1=true", "parallel.recompute=full"]),
    "ep2": (2, DROPLESS, ["parallel.ep=2"]),
    # FSDP: the experts a unit over their expert-data-parallel ranks (here the TP pair, under SP), the rest over dp
    "ep2_tp2_sp_fsdp": (4, CAPACITY + SHARED, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                               "parallel.fsdp=true"]),
    "ep4": (4, DROPLESS + BATCH16, ["parallel.ep=4"]),
    "ep2_dp4_capacity": (4, CAPACITY + BATCH16, ["parallel.ep=2"]),
    "ep2_zero1": (2, DROPLESS, ["parallel.ep=2", "parallel.zero1=true"]),
    # selective recompute runs the dispatcher's all-to-alls again (kept, the counts' in-place output was garbage)
    "ep2_selective": (2, DROPLESS, ["parallel.ep=2", "parallel.recompute=selective"]),
    # zero-bubble: the experts' grouped GEMMs defer their weight gradients to W
    "ep2_pp2_zb": (4, DROPLESS + ["trainer.micro_batch_size=2"], ["parallel.ep=2", "parallel.pp=2",
                                                                  "parallel.pp_schedule=zb"]),
    "ep2_pp2_interleaved": (4, DROPLESS + ["model.num_layers=4", "trainer.micro_batch_size=2"],
                            ["parallel.ep=2", "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved"]),
    "tp2_shared": (2, CAPACITY + SHARED, ["parallel.tp=2"]),
    # sequence parallelism: each TP rank routes its own tokens; varlen micro-batches of odd lengths are padded
    "tp2_sp_capacity": (2, CAPACITY + SHARED + VARLEN, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "ep2_tp2_sp_zero1": (4, DROPLESS + SHARED, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                                "parallel.zero1=true"]),
    "cp2_a2a_capacity": (2, CAPACITY + VARLEN, ["parallel.cp=2", "parallel.cp_comm=a2a"]),
    "ep2_cp2": (4, DROPLESS + VARLEN, ["parallel.ep=2", "parallel.cp=2"]),
    # drops by routing weight: each expert's queue ordered by the whole micro-batch's weights, gathered over the
    # ranks that split its tokens (CP's ring, SP's TP ranks)
    "cp2_probs": (2, CAPACITY + PROBS + VARLEN, ["parallel.cp=2"]),
    "tp2_sp_probs": (2, CAPACITY + PROBS + VARLEN, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(tmp_path, name):
    world, same, layout = LAYOUTS[name]
    run_distributed(check_moe_layout, world, same, layout, str(tmp_path), timeout=240)


def test_expert_parallel_checkpoints_reshard(tmp_path):
    """A run saved at ep4 resumes at ep2 x tp2 (ZeRO-1), then at ep2 under FSDP, then at ep1 (dp2, FSDP): the expert
    slices, their Adam moments and the routers' bias load into any ep and any sharding, and the continued losses
    equal one process's straight run."""
    common = [*MOE, *DROPLESS, *SHARED, "trainer.max_steps=6", "trainer.micro_batch_size=2"]
    segments = [(4, ["parallel.ep=4", "trainer.stop_at_step=2"]),
                (4, ["parallel.ep=2", "parallel.tp=2", "parallel.zero1=true", "trainer.stop_at_step=4"]),
                (2, ["parallel.ep=2", "parallel.fsdp=true", "trainer.stop_at_step=5"]),
                (2, ["parallel.dp=2", "parallel.fsdp=true"])]
    assert_resharded_run_continues(tmp_path, common, segments)


def compiled_expert_parallel(rank: int, world_size: int, tmp: str) -> None:
    """ep2 with `trainer.compile=true` (AOT autograd) against ep2 eager, one step in bf16 (the experts' grouped GEMM
    traces bf16 only): the same loss, and the same update; the blocks break their graphs at host reads only: the
    all-to-all's sizes, and on a CPU the per-document attention's lengths (these documents are unequal; without
    expert parallelism, on equal documents, the blocks are whole: test_compile_layouts.py). The
    dispatcher's all-to-all is an autograd function with a collective in its forward, which torch 2.11's dynamo
    traced into zero gradients before megalm.compat.as_function_output: AdamW's first step moves each weight by
    lr * sign(gradient), so 34-40% of the experts' weights moved otherwise. bf16 rounding may flip the sign of a
    near-zero gradient: torch 2.9's AOT autograd rounds a little differently from eager (at most 0.12% of a weight's
    elements, measured); 2.11 and 2.13 move none otherwise."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    runs = [Trainer(compose_config(*MOE, *DROPLESS, "parallel.ep=2", "precision=bf16", "trainer.compile=" + compiled,
                                   "trainer.compile_backend=aot_eager"), f"{tmp}/{compiled}")
            for compiled in ("false", "true")]
    for trainer in runs:
        assert all(isinstance(m.dispatcher, AllToAllDispatcher) for m in moe_modules(trainer.model).values())
    eager, compiled = (trainer.train_step(0).loss for trainer in runs)
    assert compiled == pytest.approx(eager, rel=1e-6), (rank, compiled, eager)
    breaks = list(counters["graph_break"])
    from megalm.model.document_sdpa import per_document_sdpa  # eager on unequal documents (torch.compiler.disable)

    host_reads = ("_local_scalar_dense", per_document_sdpa.__name__)
    assert breaks and all(any(read in reason for read in host_reads) for reason in breaks), (rank, breaks)
    lr = runs[0].cfg.optim.lr
    for (name, p), q in zip(runs[0].model.named_parameters(), runs[1].model.parameters(), strict=True):
        moved_otherwise = ((p.float() - q.float()).abs() > lr / 2).float().mean().item()
        assert moved_otherwise <= 0.01, (rank, name, moved_otherwise)


def test_compiled_expert_parallelism_trains_as_eager(tmp_path):
    run_distributed(compiled_expert_parallel, 2, str(tmp_path), timeout=300)
