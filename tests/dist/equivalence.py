"""Shared checks of the equivalence tests: a parallel Trainer against the single-process one.

Parameters are compared by their full-model names (`canonical_named_parameters`: pipeline chunks
hold slices of the layers) and each rank's TP shard against the matching slice of the full tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from megalm.model.gpt import VOCAB_PARAMS, resize_vocab_rows
from megalm.model.naming import canonical_named_parameters, model_chunks
from megalm.model.shard import shard_specs
from megalm.training.optim import current_weights
from megalm.training.trainer import Trainer
from tests.conftest import compose_config


def shard_of(model: torch.nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full` for `model`'s parameter `name` (the whole of it when unsharded)."""
    spec = shard_specs(model).get(name)
    if name in VOCAB_PARAMS:  # layouts pad the vocab to different row counts; the padding rows are all 0
        rows = spec.full_shape[0] if spec is not None else model_chunks(model)[0].cfg.padded_vocab_size
        full = resize_vocab_rows(full, rows)
    return spec.shard(full) if spec is not None else full


def held_and_expected(model: torch.nn.Module, name: str, held: torch.Tensor, full: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """What this rank holds of `model`'s parameter (or gradient) `name` and the matching piece of the single-process
    `full` tensor: the TP shard, and of it the FSDP chunk when `held` is a DTensor shard."""
    expected = shard_of(model, name, full)
    if isinstance(held, DTensor):
        expected = distribute_tensor(expected, held.device_mesh, held.placements, src_data_rank=None).to_local()
        held = held.to_local()
    return held, expected


def assert_grads_match(ref: Trainer, par: Trainer, rank: int, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Every gradient `par` holds equals its shard of the single-process gradient."""
    current_weights(par.optimizer)  # ZeRO-1's overlapped all-gather is still in flight after a step
    ref_params = dict(canonical_named_parameters(ref.model))
    names = []
    for name, p in canonical_named_parameters(par.model):
        names.append(name)
        torch.testing.assert_close(*held_and_expected(par.model, name, p.grad, ref_params[name].grad), rtol=rtol,
                                   atol=atol,
                                   msg=lambda m, n=name: f"rank {rank} grad {n}: {m}")
    assert names, f"rank {rank} holds no parameters"


def assert_same_training(ref: Trainer, par: Trainer, rank: int, steps: int, param_atol: float = 2e-5) -> None:
    """`steps` optimizer steps: losses within 1e-5 relative, then the parameters close.

    Adam divides by sqrt(v): an element whose gradients are ~1e-10 (a token seen once) can turn
    summation-order noise into an update of up to lr, so layouts that reorder sums (pipelines) pass a
    looser `param_atol`; the losses and the first step's gradients are the strict checks.
    """
    ref_losses = [ref.train_step(s).loss for s in range(steps)]
    par_losses = [par.train_step(s).loss for s in range(steps)]
    for step, (a, b) in enumerate(zip(par_losses, ref_losses, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} step {step}: loss {a} vs single-process {b}"
    current_weights(par.optimizer)  # ZeRO-1's overlapped all-gather is still in flight after a step
    ref_params = dict(canonical_named_parameters(ref.model))
    for name, p in canonical_named_parameters(par.model):
        torch.testing.assert_close(*held_and_expected(par.model, name, p.detach(), ref_params[name].detach()),
                                   rtol=1e-4, atol=param_atol,
                                   msg=lambda m, n=name: f"rank {rank} param {n} after {steps} steps: {m}")


def assert_first_step_matches(ref: Trainer, par: Trainer, rank: int) -> None:
    """Step 0's gradients: `ref` (one process) on the whole global batch, `par` on its share of it.
    Every gradient by full-model name (not under ZeRO-1, which keeps shards) and the grad norm."""
    ref.forward_backward(0)
    par.forward_backward(0)
    if not par.cfg.parallel.zero1:  # ZeRO-1 keeps only gradient shards; its steps are compared later
        assert_grads_match(ref, par, rank)
    torch.testing.assert_close(par.grad_norm(), ref.grad_norm(), rtol=1e-5, atol=0)


def assert_training_and_eval_match(ref: Trainer, par: Trainer, rank: int, steps: int, param_atol: float) -> None:
    """After `assert_first_step_matches`: `steps` optimizer steps from scratch, then the validation loss."""
    for t in (ref, par):
        t.optimizer.zero_grad(set_to_none=True)
    assert_same_training(ref, par, rank, steps, param_atol=param_atol)
    assert abs(par.evaluate() - ref.evaluate()) <= 1e-5 * ref.evaluate()


def train_and_record(rank: int, world_size: int, overrides: list[str], run_dir: str, out: str) -> None:
    """`Trainer.fit()` under `overrides`; rank 0 writes the per-step losses to `out` (JSON)."""
    summary = Trainer(compose_config(*overrides), run_dir).fit()
    if rank == 0:
        Path(out).write_text(json.dumps([loss for _, loss in summary.losses]))


def assert_resume_is_bit_exact(tmp_path: Path, world_size: int, layout: list[str], stop_at: int,
                               timeout: float = 300) -> None:
    """Train `layout` straight through; train it again stopped at `stop_at` and resumed: the resumed
    losses must repeat the straight run's exactly. The stopped run is left in tmp_path / "stopped"."""
    from tests.dist.launch import run_distributed

    runs = {"straight": layout, "first": [*layout, f"trainer.stop_at_step={stop_at}"], "resumed": layout}
    for name, overrides in runs.items():
        run_dir = tmp_path / ("straight" if name == "straight" else "stopped")
        run_distributed(train_and_record, world_size, overrides, str(run_dir), str(tmp_path / f"{name}.json"),
                        timeout=timeout)
    losses = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in runs}
    assert losses["first"] == losses["straight"][:stop_at]
    assert losses["resumed"] == losses["straight"][stop_at:], f"resumed {layout} run diverged from the straight one"


def assert_resharded_run_continues(tmp_path: Path, common: list[str], segments: list[tuple[int, list[str]]],
                                   timeout: float = 240) -> None:
    """Train `common` in one run dir as `segments` ((ranks, layout) each, every one but the last stopping with
    trainer.stop_at_step), each resuming the last one's checkpoint: together their losses are one process's
    straight run's (1e-5 relative), so nothing of the weights or the optimizer state is lost between layouts."""
    from tests.dist.launch import run_distributed

    losses = []
    for index, (world, layout) in enumerate(segments):
        out = tmp_path / f"segment{index}.json"
        run_distributed(train_and_record, world, [*common, *layout], str(tmp_path / "run"), str(out), timeout=timeout)
        losses += json.loads(out.read_text())
    cfg = compose_config(*common)
    straight = [loss for _, loss in Trainer(cfg, tmp_path / "single").fit().losses]
    assert len(losses) == len(straight) == cfg.trainer.max_steps
    for step, (a, b) in enumerate(zip(losses, straight, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: resharded run {a} vs single process {b}"
