"""The distributed trainer equals the single-process trainer (fp32, same seed, same global batch).

Every layout runs 5 optimizer steps on CPU/gloo. Each worker also builds the single-process
trainer in-process (an explicit one-rank mesh), so its reference is computed from the same
config; the comparison covers per-step losses, the gradients of the first step (each rank's
shard against the matching slice of the full gradient) and the parameters after 5 steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megalm.data.dataset import global_batch, loss_token_count
from megalm.parallel.dims import ParallelDims, ParallelMesh
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.launch import run_distributed

STEPS = 5


def shard_of(param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    shard_full = getattr(param, "shard_full", None)
    return shard_full(full) if shard_full is not None else full


def check_layout(rank: int, world_size: int, overrides: list[str], tmp: str, compare_grads: bool) -> None:
    cfg = compose_config(*overrides)
    ref = Trainer(compose_config(), f"{tmp}/ref{rank}", mesh=ParallelMesh(ParallelDims()))
    par = Trainer(cfg, f"{tmp}/par")

    if compare_grads:
        samples = global_batch(ref.data.train, 0, cfg.trainer.global_batch_size)
        ref.forward_backward(samples, loss_token_count(samples))
        par.forward_backward_step(0)
        ref_grads = dict(ref.model.named_parameters())
        for name, p in par.model.named_parameters():
            expected = shard_of(p, ref_grads[name].grad)
            torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6, msg=f"rank {rank} grad {name}")
        for t in (ref, par):
            t.optimizer.zero_grad(set_to_none=True)

    ref_losses = [ref.train_step(s).loss for s in range(STEPS)]
    par_losses = [par.train_step(s).loss for s in range(STEPS)]
    for step, (a, b) in enumerate(zip(par_losses, ref_losses, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} step {step}: loss {a} vs single-process {b}"
    ref_params = dict(ref.model.named_parameters())
    for name, p in par.model.named_parameters():
        torch.testing.assert_close(p.detach(), shard_of(p, ref_params[name].detach()), rtol=1e-4, atol=2e-5,
                                   msg=f"rank {rank} param {name} after {STEPS} steps")


LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"], True),
    "dp2": (2, ["parallel.dp=2"], True),
    "dp4_zero1": (4, ["parallel.dp=4", "trainer.micro_batch_size=2", "parallel.zero1=true"], False),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], True),
    "tp2_dp2": (4, ["parallel.tp=2", "parallel.dp=2"], True),
    "tp4_gqa_kv2": (4, ["parallel.tp=4"], True),
    "tp2_dp2_zero1": (4, ["parallel.tp=2", "parallel.dp=2", "parallel.zero1=true"], False),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(tmp_path, name):
    world, overrides, grads = LAYOUTS[name]
    run_distributed(check_layout, world, overrides, str(tmp_path), grads, timeout=240)


def train_and_record(rank: int, world_size: int, overrides: list[str], run_dir: str, out: str) -> None:
    summary = Trainer(compose_config(*overrides), run_dir).fit()
    if rank == 0:
        Path(out).write_text(json.dumps([loss for _, loss in summary.losses]))


def test_resume_under_tp_dp_zero1_is_bit_exact(tmp_path):
    layout = ["parallel.tp=2", "parallel.dp=2", "parallel.zero1=true", "trainer.max_steps=6"]
    run_distributed(train_and_record, 4, layout, str(tmp_path / "straight"), str(tmp_path / "straight.json"),
                    timeout=240)
    run_distributed(train_and_record, 4, [*layout, "trainer.stop_at_step=3"], str(tmp_path / "stopped"),
                    str(tmp_path / "first.json"), timeout=240)
    run_distributed(train_and_record, 4, layout, str(tmp_path / "stopped"), str(tmp_path / "resumed.json"),
                    timeout=240)
    straight = json.loads((tmp_path / "straight.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert json.loads((tmp_path / "first.json").read_text()) == straight[:3]
    assert resumed == straight[3:], "a resumed TP x DP x ZeRO-1 run must repeat the uninterrupted losses exactly"
    shards = sorted(p.name for p in (tmp_path / "stopped" / "checkpoints" / "step_00000006").glob("shard-*"))
    assert len(shards) > 1, f"every rank with distinct shards writes its own file, got {shards}"


def test_checkpoint_saved_under_tp4_loads_into_one_process(tmp_path):
    """Save under tp4 (kv heads replicated) x 2 steps; reshard into a single-process model on load."""
    from megalm.model import GPT
    from megalm.training.checkpoint import latest_checkpoint, load_model_weights

    overrides = ["parallel.tp=4", "trainer.max_steps=2"]
    run_distributed(train_and_record, 4, overrides, str(tmp_path / "tp4"), str(tmp_path / "tp4.json"), timeout=240)
    reference = Trainer(compose_config("trainer.max_steps=2"), tmp_path / "single")
    reference.fit()
    model = GPT(reference.cfg.model)
    load_model_weights(latest_checkpoint(tmp_path / "tp4"), model)
    expected = dict(reference.model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, expected[name], rtol=1e-4, atol=2e-5, msg=name)
