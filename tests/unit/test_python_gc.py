"""`trainer.gc_interval`: Python's garbage collector runs between steps only while training (megalm/training/
python_gc.py), which is safe because a step leaves no reference cycle holding a tensor: checked here across recipes
and layouts, one process and a gloo group of two."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch

from megalm.errors import ConfigError
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.launch import run_distributed
from tools.bench.python_gc import timed_collections


@contextlib.contextmanager
def collections_seen(trainer: Trainer, threshold: int) -> Iterator[list[tuple[int, bool, bool, float]]]:
    """(generation, inside a step, automatic: the collector on, seconds) of every collection while the block runs
    (tools/bench/python_gc.py's record); the automatic collector's first threshold lowered to `threshold`
    allocations, so that it would collect inside every step of the tiny model."""
    thresholds = gc.get_threshold()
    gc.set_threshold(threshold, *thresholds[1:])
    try:
        with timed_collections(trainer) as seen:
            yield seen
    finally:
        gc.set_threshold(*thresholds)


@pytest.mark.parametrize("interval", [1, 3, 0])
def test_the_collector_runs_between_steps_only(tmp_path, interval):
    """7 steps, evaluated and saved after step 5 and saved at the end: no collection inside a step (the control,
    gc_interval=0, collects inside steps at the same thresholds), the young generations after every `interval`-th
    step, full collections at the start and once at each boundary that evaluated or saved, and the collector on
    again after."""
    cfg = compose_config(f"trainer.gc_interval={interval}", "trainer.max_steps=7", "trainer.eval_interval=5",
                         "trainer.save_interval=5", "trainer.eval_iters=1")
    trainer = Trainer(cfg, tmp_path)
    with collections_seen(trainer, threshold=50) as seen:
        trainer.fit()
    inside = [generation for generation, in_step, _, _ in seen if in_step]
    if interval == 0:
        assert inside, "the control: the automatic collector collects inside the steps at this threshold"
        return
    assert not inside, seen
    run = [i for i, (_, _, automatic, _) in enumerate(seen) if not automatic]  # fit's own collections, and between
    expected = [2]  # fit's own, in order: at the start; after each interval-th step; once after the evaluation and
    for step in range(1, 8):  # the save of step 5, and after the last step's save
        expected += [1] * (step % interval == 0) + [2] * (step in (5, 7))
    # the start's full collection runs just before the collector goes off; between fit's own, no automatic one
    assert [seen[i][0] for i in range(run[0] - 1, run[-1] + 1)] == expected, seen
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


def drain() -> None:
    """Full collections until one finds nothing: what an earlier test or a compile left is released in stages."""
    for _ in range(20):
        if not gc.collect():
            return


def cyclic_tensors(work: Callable[[], object]) -> list[str]:
    """The tensors and autograd nodes (which hold saved tensors in C++) that `work` (training steps, an evaluation)
    left reachable from reference cycles only: what the automatic collector would have freed and a collection every
    gc_interval steps keeps alive until then."""
    drain()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        work()
        gc.collect()
        proxies = (weakref.ProxyType, weakref.CallableProxyType)  # a dead referent's proxy cannot be asked its type
        live = [o for o in gc.garbage if not isinstance(o, proxies)]
        return ([f"{type(o).__name__}{tuple(o.shape)}" for o in live if isinstance(o, torch.Tensor)]
                + [type(o).__name__ for o in live if isinstance(o, torch.autograd.graph.Node)])
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()


EQUAL_DOCS = ["data.varlen=true", "data.synthetic.fixed_doc_length=33"]
LAYOUTS = {  # (ranks, overrides)
    "fp32": (1, []), "bf16": (1, ["precision=bf16"]), "fp8_delayed": (1, ["precision=fp8_delayed"]),
    "mxfp4": (1, ["precision=mxfp4"]), "recompute_full": (1, ["parallel.recompute=full"]),
    "recompute_selective": (1, ["parallel.recompute=selective"]),
    "offload": (1, ["offload.enabled=true", "offload.min_tensor_bytes=0"]), "moe": (1, ["model=moe_tiny"]),
    "compiled": (1, ["trainer.compile=true", "trainer.compile_backend=aot_eager", *EQUAL_DOCS]),
    "compiled_fp8_delayed": (1, ["trainer.compile=true", "trainer.compile_backend=aot_eager", "precision=fp8_delayed",
                                 *EQUAL_DOCS]),
    "tp2_sp_bf16": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "precision=bf16"]),
    "zero1_bf16": (2, ["parallel.dp=2", "parallel.zero1=true", "precision=bf16"]),
    "pp2_zb": (2, ["parallel.pp=2", "parallel.pp_schedule=zb"]), "cp2": (2, ["parallel.cp=2"]),
    "fsdp": (2, ["parallel.fsdp=true", "parallel.dp=2"]),
}


def _no_cycles(rank: int, world_size: int, tmp: str, overrides: list[str]) -> None:
    trainer = Trainer(compose_config(*overrides), f"{tmp}/{rank}")
    for step in range(3):  # the first steps make what lasts (state, compiled graphs); what compiling held is
        trainer.train_step(step)  # drained before the measured steps (python_gc.py's docstring)
    assert cyclic_tensors(lambda: [trainer.train_step(step) for step in range(3, 6)]) == [], rank
    assert cyclic_tensors(trainer.evaluate) == [], rank  # a checkpoint's save leaves cycles, of no tensor: fit runs
    # a full collection after it


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_leaves_no_cycle_holding_a_tensor(tmp_path, layout):
    """Each layout in a process of its own, as a run has it: in a process that ran a compiled trainer before, what
    torch's autograd_function_apply made for that trainer's steps (a class per call, in a cycle with the tensors it
    saved) can still be released during a later trainer's step."""
    if layout.startswith("compiled") and tuple(int(n) for n in torch.__version__.split(".")[:2]) < (2, 13):
        pytest.skip(f"torch {torch.__version__}'s compiled blocks leave, every step, a class its "
                    "autograd_function_apply makes in a cycle with the tensors it saved (2.13 does not); the default "
                    "trainer.gc_interval=1 frees them at the step's end")
    ranks, overrides = LAYOUTS[layout]
    run_distributed(_no_cycles, ranks, str(tmp_path), overrides, timeout=240)


def test_a_cycle_holding_a_tensor_or_a_graph_is_found(tmp_path):
    """The check above can fail: a step that leaves a tensor in a cycle, or an autograd node (its saved tensors)."""
    trainer = Trainer(compose_config(), tmp_path)
    train_step = trainer.train_step

    def leaking_step(step: int):
        result = train_step(step)
        x = torch.ones(2, requires_grad=True)
        cycle: dict = {"grad": torch.zeros(3, 5), "node": (x * x).grad_fn}
        cycle["self"] = cycle
        return result

    trainer.train_step = leaking_step
    found = cyclic_tensors(lambda: trainer.train_step(0))
    assert "Tensor(3, 5)" in found and "MulBackward0" in found, found


def test_a_step_that_compiled_is_followed_by_full_collections(tmp_path):
    """After any step in which dynamo compiled, the next DRAIN_STEPS boundaries run a full collection each (what
    compiling held is released in stages); then the young generations every interval, as before."""
    from megalm.training.python_gc import DRAIN_STEPS

    trainer = Trainer(compose_config("trainer.max_steps=6", "trainer.gc_interval=1", "trainer.compile=true",
                                     "trainer.compile_backend=eager", *EQUAL_DOCS), tmp_path)
    with collections_seen(trainer, threshold=700) as seen:
        trainer.fit()
    ours = [generation for generation, in_step, automatic, _ in seen if not automatic and not in_step]
    first_young = ours.index(1)  # the full collections of the boundaries after the steps that compiled, before it
    assert first_young >= DRAIN_STEPS and set(ours[:first_young]) == {2}, ours
    assert ours[first_young:-1] == [1] * len(ours[first_young:-1]), ours  # the rest: young, then the final save's
