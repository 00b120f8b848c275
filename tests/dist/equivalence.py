"""Shared checks of the equivalence tests: a parallel Trainer against the single-process one.

Parameters are compared by their full-model names (`canonical_named_parameters`: pipeline chunks
hold slices of the layers) and each rank's TP shard against the matching slice of the full tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from megalm.model.gpt import VOCAB_PARAMS, resize_vocab_rows
from megalm.model.naming import canonical_named_parameters, model_chunks
from megalm.model.shard import shard_specs
from megalm.parallel.dims import ParallelDims, ParallelMesh
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


def _assert_held_match(par: Trainer, rank: int, what: str, held: dict[str, torch.Tensor],
                       full: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    """Every tensor `par` holds (by full-model name) equals its piece of the single-process `full` one."""
    assert held, f"rank {rank} holds no parameters"
    for name, tensor in held.items():
        torch.testing.assert_close(*held_and_expected(par.model, name, tensor, full[name]), rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"rank {rank} {what} {n}: {m}")


def assert_grads_match(ref: Trainer, par: Trainer, rank: int, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Every gradient `par` holds equals its shard of the single-process gradient."""
    _assert_grads_are(par, rank, {n: p.grad for n, p in canonical_named_parameters(ref.model)}, rtol, atol)


def _assert_grads_are(par: Trainer, rank: int, full: dict[str, torch.Tensor], rtol: float = 1e-4,
                      atol: float = 1e-6) -> None:
    """Every gradient `par` holds equals its shard of `full`, the single-process gradients by full-model name."""
    current_weights(par.optimizer)  # ZeRO-1's overlapped all-gather is still in flight after a step
    _assert_held_match(par, rank, "grad", {n: p.grad for n, p in canonical_named_parameters(par.model)}, full, rtol,
                       atol)


def assert_same_training(ref: Trainer, par: Trainer, rank: int, steps: int, param_atol: float = 2e-5) -> None:
    """`steps` optimizer steps: losses within 1e-5 relative, then the parameters close.

    Adam divides by sqrt(v): an element whose gradients are ~1e-10 (a token seen once) can turn
    summation-order noise into an update of up to lr, so layouts that reorder sums (pipelines) pass a
    looser `param_atol`; the losses and the first step's gradients are the strict checks.
    """
    ref_losses = [ref.train_step(s).loss for s in range(steps)]
    _assert_same_steps(par, rank, steps, ref_losses, dict(canonical_named_parameters(ref.model)), param_atol)


def _assert_same_steps(par: Trainer, rank: int, steps: int, ref_losses: list[float],
                       ref_params: dict[str, torch.Tensor], param_atol: float) -> None:
    """`par`'s `steps` optimizer steps against the one process's losses and the parameters after them."""
    par_losses = [par.train_step(s).loss for s in range(steps)]
    for step, (a, b) in enumerate(zip(par_losses, ref_losses, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} step {step}: loss {a} vs single-process {b}"
    current_weights(par.optimizer)  # ZeRO-1's overlapped all-gather is still in flight after a step
    _assert_held_match(par, rank, f"param after {steps} steps",
                       {n: p.detach() for n, p in canonical_named_parameters(par.model)},
                       {n: p.detach() for n, p in ref_params.items()}, rtol=1e-4, atol=param_atol)


def assert_first_step_matches(ref: Trainer, par: Trainer, rank: int) -> None:
    """Step 0's gradients: `ref` (one process) on the whole global batch, `par` on its share of it.
    Every gradient by full-model name (not under ZeRO-1, which keeps shards) and the grad norm."""
    ref.forward_backward(0)
    par.forward_backward(0)
    if not par.cfg.parallel.zero1:  # ZeRO-1 keeps only gradient shards; its steps are compared later
        assert_grads_match(ref, par, rank)
    torch.testing.assert_close(par.grad_norm(), ref.grad_norm(), rtol=1e-5, atol=0)


@dataclass
class Reference:
    """The single-process run a layout is compared with, recorded once: the first step's gradients (by full-model
    name) and grad norm, the offload store's bytes after it, then from zeroed gradients `steps` optimizer steps'
    losses, the parameters after them and the validation loss."""

    grads: dict[str, torch.Tensor]
    grad_norm: torch.Tensor
    offloaded_bytes: int
    losses: list[float]
    params: dict[str, torch.Tensor]
    eval_loss: float

    @classmethod
    def record(cls, overrides: list[str], run_dir: str | Path, steps: int) -> Reference:
        ref = Trainer(compose_config(*overrides), run_dir, mesh=ParallelMesh(ParallelDims()))
        ref.forward_backward(0)
        grads = {name: p.grad.detach().clone() for name, p in canonical_named_parameters(ref.model)}
        grad_norm = ref.grad_norm().detach().clone()
        store = ref.parallel.offload_store
        offloaded = store.offloaded_bytes if store is not None else 0
        ref.optimizer.zero_grad(set_to_none=True)
        losses = [ref.train_step(s).loss for s in range(steps)]
        params = {name: p.detach().clone() for name, p in canonical_named_parameters(ref.model)}
        return cls(grads, grad_norm, offloaded, losses, params, ref.evaluate())

    def save(self, path: Path) -> None:
        tensors = {**{f"grad/{n}": t for n, t in self.grads.items()},
                   **{f"param/{n}": t for n, t in self.params.items()}, "grad_norm": self.grad_norm}
        meta = {"losses": json.dumps(self.losses), "eval_loss": repr(self.eval_loss),
                "offloaded_bytes": str(self.offloaded_bytes)}
        partial = path.with_suffix(".partial")
        save_file({n: t.contiguous() for n, t in tensors.items()}, partial, metadata=meta)
        partial.replace(path)  # atomic: another test reading the cache sees a whole file or none

    @classmethod
    def load(cls, path: Path) -> Reference:
        tensors = load_file(path)
        with safe_open(path, "pt") as f:
            meta = f.metadata()
        pick = lambda prefix: {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}  # noqa: E731
        return cls(pick("grad/"), tensors["grad_norm"], int(meta["offloaded_bytes"]), json.loads(meta["losses"]),
                   pick("param/"), float(meta["eval_loss"]))


def single_process_reference(rank: int, overrides: list[str], tmp: str, steps: int) -> Reference:
    """The one-process run of `overrides` (`Reference`), made once and read by every rank: before, each rank of a
    4-rank test trained its own copy beside the layout, and every case of a file trained the same one again (the same
    model and data under each layout). Rank 0 records it into a cache beside the test's directory (the pytest worker's
    base temp dir: one per xdist worker and session), keyed by the overrides and steps; the others wait at a barrier
    and read it. The one process is deterministic, so a cached run is the run."""
    key = hashlib.sha256(json.dumps([list(overrides), steps]).encode()).hexdigest()[:16]
    cache = Path(tmp).parent / "single_process_references"
    path = cache / f"{key}.safetensors"
    if rank == 0 and not path.exists():
        cache.mkdir(exist_ok=True)
        Reference.record(overrides, cache / f"{key}.run{os.getpid()}", steps).save(path)
    dist.barrier()
    return Reference.load(path)


def assert_layout_matches(reference: Reference, par: Trainer, rank: int, steps: int, param_atol: float,
                          check_first_step: Callable[[], None] | None = None, grads: bool = True) -> None:
    """`par` against the recorded one-process run: step 0's gradients (not under ZeRO-1, which keeps shards, nor
    with `grads` false) and grad norm, then `check_first_step` (the layout's own checks of its first step), then from
    zeroed gradients `steps` optimizer steps (`_assert_same_steps`) and the validation loss."""
    par.forward_backward(0)
    if grads and not par.cfg.parallel.zero1:  # ZeRO-1 keeps only gradient shards; its steps are compared later
        _assert_grads_are(par, rank, reference.grads)
    torch.testing.assert_close(par.grad_norm(), reference.grad_norm, rtol=1e-5, atol=0)
    if check_first_step is not None:
        check_first_step()
    par.optimizer.zero_grad(set_to_none=True)
    _assert_same_steps(par, rank, steps, reference.losses, reference.params, param_atol)
    assert abs(par.evaluate() - reference.eval_loss) <= 1e-5 * reference.eval_loss
    # the weight norm (logging.params_norm), read after an evaluation as a logged step reads it: FSDP units that keep
    # their gathered weights after a forward (fsdp_reshard_after_forward=false) hold them unsharded then
    full_norm = torch.stack([p.detach().double().square().sum() for p in reference.params.values()]).sum().sqrt()
    torch.testing.assert_close(par.parallel.weight_norm(par.optimizer).double(), full_norm, rtol=1e-5, atol=0,
                               msg=lambda m: f"rank {rank} weight norm after {steps} steps: {m}")


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
