"""No host tensor reaches a collective in any layout (what NCCL needs), checked on gloo by how tensors are made
(tests/dist/device_guard.py): 2 training steps, an evaluation, a checkpoint save, and a resume that loads it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.device_guard import host_tensor_guard
from tests.dist.launch import run_distributed


def train_and_resume_under_guard(rank: int, world_size: int, overrides: list[str], tmp: str) -> None:
    common = [*overrides, "trainer.eval_interval=2", "trainer.eval_iters=1"]
    with host_tensor_guard():
        Trainer(compose_config(*common, "trainer.max_steps=2"), f"{tmp}/run").fit()
        resumed = Trainer(compose_config(*common, "trainer.max_steps=3"), f"{tmp}/run")
        assert resumed.step == 2
        resumed.fit()


HDP = ["parallel.hdp=true", "parallel.hdp_capacity=16", "data.varlen=true", "model.seq_length=48",
       "data.synthetic.mean_doc_length=30", "trainer.global_batch_size=12"]
LAYOUTS = {
    "tp4_kv_replicated": (4, ["parallel.tp=4"]),
    "tp2_dp2_zero1_sp": (4, ["parallel.tp=2", "parallel.dp=2", "parallel.zero1=true",
                             "parallel.sequence_parallel=true"]),
    "pp2_zb_gpt2_tied": (2, ["model=gpt2_tiny", "model.num_layers=4", "trainer.micro_batch_size=2", "parallel.pp=2",
                             "parallel.pp_schedule=zb"]),
    "hdp_dp2_cp2": (4, [*HDP, "parallel.dp=2", "parallel.cp=2"]),
    "cp2_a2a_dp2": (4, ["parallel.cp=2", "parallel.cp_comm=a2a", "parallel.dp=2", "trainer.micro_batch_size=2"]),
    # MoE: the counts' and the tokens' all-to-alls, the CP ring's gather of the routing, expert buckets, EP shards
    "moe_ep2_cp2_zero1": (4, ["model=moe_tiny", "model.num_layers=2", "model.hidden_size=64",
                              "model.moe.capacity_factor=1.0", "model.moe.bias_update_rate=0.01", "parallel.ep=2",
                              "parallel.cp=2", "parallel.zero1=true", "data.varlen=true",
                              "trainer.micro_batch_size=2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_no_host_tensor_reaches_a_collective(tmp_path, name):
    world, overrides = LAYOUTS[name]
    run_distributed(train_and_resume_under_guard, world, overrides, str(tmp_path), timeout=240)


def host_tensor_fails(rank: int, world_size: int) -> None:
    with host_tensor_guard():
        with pytest.raises(AssertionError, match="made on the host"):
            dist.all_reduce(torch.tensor([1.0]))
        with pytest.raises(AssertionError, match="made on the host"):
            dist.all_reduce(torch.zeros(2) * 3)  # computed from a host tensor
        dist.all_reduce(torch.zeros(2, device="cpu"))  # made on the run's device: passes
        dist.all_reduce(torch.tensor([1.0]).to("cpu"))  # moved there: passes


def test_the_guard_catches_a_host_tensor():
    run_distributed(host_tensor_fails, 2, timeout=60)
