"""MoE models under the layouts that compose with them today equal one process (fp32, gloo, 5 steps): losses, the
first step's gradients, the parameters, and the aux-loss-free bias every rank moved from the batch's counts. The
balancing losses of a pipeline stage that is not the last reach the gradient too; with a capacity factor the same
assignments are dropped (the losses and the logged drops agree)."""

from __future__ import annotations

import pytest
import torch

from megalm.model.moe import moe_modules
from megalm.parallel.dims import ParallelDims, ParallelMesh
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.equivalence import assert_grads_match, assert_same_training
from tests.dist.launch import run_distributed

MOE = ["model=moe_tiny", "model.num_layers=2", "model.hidden_size=64", "model.moe.expert_ffn_hidden_size=32",
       "model.moe.aux_loss_coeff=0.01", "model.moe.seq_aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001",
       "model.moe.bias_update_rate=0.01"]
STEPS = 5


def check_moe_layout(rank: int, world_size: int, overrides: list[str], tmp: str) -> None:
    ref = Trainer(compose_config(*MOE, *overrides[:1]), f"{tmp}/ref{rank}", mesh=ParallelMesh(ParallelDims()))
    par = Trainer(compose_config(*MOE, *overrides), f"{tmp}/par")
    ref.forward_backward(0)
    par.forward_backward(0)
    if not par.cfg.parallel.zero1:  # ZeRO-1 ranks keep their slice of the gradient only
        assert_grads_match(ref, par, rank)
    for t in (ref, par):
        t.optimizer.zero_grad(set_to_none=True)
        t.expert_load.take(t.device)  # the gradient check's counts: not a step's
    assert_same_training(ref, par, rank, STEPS)
    ref_step, par_step = ref.train_step(STEPS), par.train_step(STEPS)  # the logged load, drops and losses agree
    for key, value in ref_step.moe.items():
        assert par_step.moe[key] == pytest.approx(value, rel=1e-5), key
    if ref.cfg.model.moe.capacity_factor is not None:
        assert ref_step.moe["moe_dropped"] > 0  # the case drops assignments
    ref_bias = {i: m.router.expert_bias for i, m in moe_modules(ref.model).items()}
    for layer, module in moe_modules(par.model).items():
        assert module.router.expert_bias.abs().sum() > 0
        torch.testing.assert_close(module.router.expert_bias, ref_bias[layer], rtol=0, atol=0)


LAYOUTS = {
    "dp2": (2, ["model.moe.capacity_factor=1.0", "parallel.dp=2"]),
    "pp2": (2, ["model.moe.capacity_factor=null", "parallel.pp=2"]),
    "pp2_capacity": (2, ["model.moe.capacity_factor=1.0", "parallel.pp=2"]),
    "pp2_offload": (2, ["model.moe.capacity_factor=null", "parallel.pp=2", "offload.enabled=true",
                        "offload.min_tensor_bytes=0"]),
    "dp2_zero1_recompute": (2, ["model.moe.capacity_factor=null", "parallel.dp=2", "parallel.zero1=true",
                                "parallel.recompute=full"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(tmp_path, name):
    world, overrides = LAYOUTS[name]
    run_distributed(check_moe_layout, world, overrides, str(tmp_path), timeout=240)
