"""`trainer.gc_interval`: Python's garbage collector runs between steps only while training (megalm/training/
python_gc.py), which is safe because a step leaves no reference cycle holding a tensor: checked here across recipes
and layouts, one process and a gloo group of two."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from megalm.errors import ConfigError
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.launch import run_distributed


@contextlib.contextmanager
def collections_seen(trainer: Trainer, threshold: int) -> Iterator[list[tuple[int, bool, bool]]]:
    """(generation, inside a step, automatic: the collector on) of every collection while the block runs; the
    automatic collector's first threshold lowered to `threshold` allocations, so that it would collect inside every
    step of the tiny model."""
    seen: list[tuple[int, bool, bool]] = []
    inside = [False]
    train_step = trainer.train_step

    def timed_step(step: int):
        inside[0] = True
        try:
            return train_step(step)
        finally:
            inside[0] = False

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append((info["generation"], inside[0], gc.isenabled()))

    thresholds = gc.get_threshold()
    trainer.train_step = timed_step
    gc.set_threshold(threshold, *thresholds[1:])
    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*thresholds)


@pytest.mark.parametrize("interval", [3, 0])
def test_the_collector_runs_between_steps_only(tmp_path, interval):
    """gc_interval=3 over 7 steps, evaluated after step 5 and saved at the end: no collection inside a step (the
    control, gc_interval=0, collects inside steps at the same thresholds), the young generations after steps 3 and
    6, full collections at the start, after the evaluation and after the save, and the collector on again after."""
    cfg = compose_config(f"trainer.gc_interval={interval}", "trainer.max_steps=7", "trainer.eval_interval=5",
                         "trainer.eval_iters=1")
    trainer = Trainer(cfg, tmp_path)
    with collections_seen(trainer, threshold=50) as seen:
        trainer.fit()
    inside = [generation for generation, in_step, _ in seen if in_step]
    if interval == 0:
        assert inside, "the control: the automatic collector collects inside the steps at this threshold"
        return
    assert not inside, seen
    run = [i for i, (_, _, automatic) in enumerate(seen) if not automatic]  # fit's own collections, and between
    assert [seen[i][0] for i in range(run[0], run[-1] + 1)] == [2, 1, 2, 1, 2], seen  # them no automatic one
    assert gc.isenabled()


def test_the_collector_is_left_as_it_was_when_training_fails(tmp_path):
    trainer = Trainer(compose_config("trainer.max_steps=3"), tmp_path)

    def failing_step(step: int):
        assert not gc.isenabled(), "off while training"
        raise RuntimeError("a failing step")

    trainer.train_step = failing_step
    with pytest.raises(RuntimeError, match="a failing step"):
        trainer.fit()
    assert gc.isenabled()
    gc.disable()  # a process that turned it off itself keeps it off
    try:
        with pytest.raises(RuntimeError, match="a failing step"):
            trainer.fit()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_negative_interval_is_refused_in_one_line():
    from megalm.training.validation import validate_run

    with pytest.raises(ConfigError, match="trainer.gc_interval") as error:
        validate_run(compose_config("trainer.gc_interval=-1"), world_size=1)
    assert "\n" not in str(error.value)


def cyclic_tensors(trainer: Trainer, first_step: int, steps: int) -> list[str]:
    """Shapes of the tensors that `steps` training steps left reachable from reference cycles only: what the
    automatic collector would have freed and a collection every gc_interval steps keeps alive until then."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for step in range(first_step, first_step + steps):
            trainer.train_step(step)
        gc.collect()
        proxies = (weakref.ProxyType, weakref.CallableProxyType)  # a dead referent's proxy cannot be asked its type
        return [f"{type(o).__name__}{tuple(o.shape)}" for o in gc.garbage
                if not isinstance(o, proxies) and isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()


EQUAL_DOCS = ["data.varlen=true", "data.synthetic.fixed_doc_length=33"]


@pytest.mark.parametrize("overrides", [
    [], ["precision=bf16"], ["precision=fp8_delayed"], ["precision=mxfp4"], ["parallel.recompute=full"],
    ["parallel.recompute=selective"], ["offload.enabled=true", "offload.min_tensor_bytes=0"], ["model=moe_tiny"],
    ["trainer.compile=true", "trainer.compile_backend=aot_eager", *EQUAL_DOCS],
], ids=["fp32", "bf16", "fp8_delayed", "mxfp4", "recompute_full", "recompute_selective", "offload", "moe", "compiled"])
def test_a_step_leaves_no_cycle_holding_a_tensor(tmp_path, overrides):
    trainer = Trainer(compose_config(*overrides), tmp_path)
    for step in range(2):  # the first steps make what lasts (state, compiled graphs)
        trainer.train_step(step)
    assert cyclic_tensors(trainer, first_step=2, steps=3) == []


def _no_cycles_in_a_group(rank: int, world_size: int, tmp: str, overrides: list[str]) -> None:
    trainer = Trainer(compose_config(*overrides), f"{tmp}/{rank}")
    for step in range(2):
        trainer.train_step(step)
    assert cyclic_tensors(trainer, first_step=2, steps=2) == [], rank


@pytest.mark.parametrize("overrides", [
    ["parallel.tp=2", "parallel.sequence_parallel=true", "precision=bf16"],
    ["parallel.dp=2", "parallel.zero1=true", "precision=bf16"],
    ["parallel.pp=2", "parallel.pp_schedule=zb"],
    ["parallel.cp=2"],
    ["parallel.fsdp=true", "parallel.dp=2"],
], ids=["tp2_sp_bf16", "zero1_bf16", "pp2_zb", "cp2", "fsdp"])
def test_a_parallel_step_leaves_no_cycle_holding_a_tensor(tmp_path, overrides):
    run_distributed(_no_cycles_in_a_group, 2, str(tmp_path), overrides, timeout=240)


def test_a_cycle_holding_a_tensor_is_found(tmp_path, monkeypatch):
    """The check above can fail: a step that leaves a tensor in a cycle."""
    trainer = Trainer(compose_config(), tmp_path)
    train_step = trainer.train_step

    def leaking_step(step: int):
        result = train_step(step)
        cycle: dict = {"grad": torch.zeros(3, 5)}
        cycle["self"] = cycle
        return result

    trainer.train_step = leaking_step
    assert cyclic_tensors(trainer, first_step=0, steps=1) == ["Tensor(3, 5)"]
