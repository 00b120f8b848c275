"""Shared test helpers: compose a real config from configs/ with overrides, small and fast; gpu tests skip
without CUDA."""

from __future__ import annotations

import gc
import os
import random
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernel tests run under Triton's interpreter, which must be on before triton is first
# imported: torch._dynamo imports it, and test modules import torch._dynamo (or megalm.measure) at collection,
# before tests/unit/triton_env.py could set it. Harmless elsewhere here: on a CPU, torch.compile writes C++.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test models are tiny: one intra-op thread is faster than two (less sync), and leaves the second
# core of the CI machine to the multi-process tests.
torch.set_num_threads(1)

TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.seq_length=32",
    "data=synthetic",
    "data.synthetic.num_docs=400",
    "data.synthetic.mean_doc_length=40",
    "data.valid_fraction=0.05",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
    "trainer.log_interval=1",
    "trainer.eval_interval=0",
    "trainer.save_interval=0",
    "logging.tensorboard=false",
    "optim.warmup_steps=2",
]


def compose_config(*overrides: str, tiny: bool = True):
    """A validated-by-schema MegalmConfig from configs/config.yaml and the given overrides, composed as
    megalm-train composes it (a bad key or value is a one-line ConfigError)."""
    from megalm.train import compose_config as compose_run_config

    return compose_run_config((TINY if tiny else []) + list(overrides))


def packed_layouts(count: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Documents per micro-batch as a trainer packs them, for the compile tests' recompile counts: equal lengths first
    (one document, several), then unequal cuts of 64, 96 or 128 tokens (HDP's micro-batches vary in tokens too)."""
    rng = random.Random(seed)
    layouts = [(64,), (32, 32), (16,) * 4, (8,) * 8]
    while len(layouts) < count:
        tokens = rng.choice([64, 96, 128])
        cuts = sorted(rng.sample(range(1, tokens), rng.randint(1, 6)))
        layouts.append(tuple(b - a for a, b in zip([0, *cuts], [*cuts, tokens], strict=True)))
    return layouts


def loss_kernel_graphs() -> dict[str, int]:
    """Dynamo's compiled graphs of each of the loss's two chunk kernels (trainer.compile compiles them beside the
    blocks: megalm.model.loss), from its cache entries per code object; the compile tests subtract their sum from
    dynamo's process-wide frame and graph counts, which then count the blocks'."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from megalm.model.loss import chunk_statistics, fused_chunk_logits_grad_

    return {fn.__name__: len(_debug_get_cache_entry_list(fn.__code__)) for fn in (chunk_statistics,
                                                                                   fused_chunk_logits_grad_)}


@pytest.fixture
def make_config():
    return compose_config


@pytest.fixture
def scaled_mm_on_cpu():
    """FP8 on CPU tensors as a GPU from sm89 runs it: GEMMs through torch._scaled_mm, the eager path's and the
    compiled blocks' graph GEMMs (compiled_linear.fp8_graph_linear), and the eager casts as the compiled functions
    CUDA calls (whose outputs carry dynamo's dynamic-dim marks). Each _scaled_mm call is checked by the op's meta
    kernel, which holds it to CUDA's rules (layouts, multiples of 16) where the CPU's kernel does not, and computed by
    an fp32 emulation in place of the CPU's kernel, which is slow at any size (host_overhead.scaled_mm_emulated)."""
    from tools.bench.host_overhead import fp8_cuda_code_on_cpu, scaled_mm_emulated

    one, q = torch.ones(()), torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(q, q.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (AttributeError, NotImplementedError, RuntimeError) as error:
        pytest.skip(f"torch {torch.__version__} has no CPU kernel for torch._scaled_mm: {str(error).splitlines()[0]}")
    with scaled_mm_emulated(), fp8_cuda_code_on_cpu():
        yield


# (node id, whether it is a long test) of every test this session collected, `-m` deselection or not: what a test of
# the suite's own layout reads (the `collected_tests` fixture) instead of collecting again in a process of its own
COLLECTED: set[tuple[str, bool]] = set()


@pytest.fixture
def collected_tests() -> set[tuple[str, bool]]:
    """(node id, long test or not) of every test this session collected (a fixture: the module pytest loaded as
    conftest, whose hook filled it, may not be the one an import of tests.conftest gives)."""
    return COLLECTED


class LaunchedOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops dispatched inside, by name, views left out (they launch no kernel): what a test counts to show
    that a batched path's kernels do not grow with the model."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if not func.is_view:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def long_cases() -> set[str]:
    """The node ids of tests/long_cases.txt: default-suite cases run with the long tests, for the default run's
    time budget (the file says which and why)."""
    text = (Path(__file__).parent / "long_cases.txt").read_text()
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return {line for line in lines if line}


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, a crashed worker fails the run at once, naming its test (`--max-worker-restart 0` unless
    given): a replaced worker under `--dist loadfile` can hang the run for good (xdist's scheduler; a CI floor leg
    once waited so until CI's time limit). Here rather than in addopts, which would not parse where xdist is not
    installed (the GPU machine). Runs before xdist's own configure (trylast), which reads the option."""
    if getattr(config.option, "maxworkerrestart", "") is None:
        config.option.maxworkerrestart = "0"


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, megalm, every test module) goes to the collector's permanent generation
    (gc.freeze), where no collection walks it again: a full collection (each Trainer.fit starts with one, and runs
    them after a compile, an evaluation, a checkpoint: megalm/training/python_gc.py) walked the whole process, 0.2-0.4
    s each in a test worker. Three trainer test files took 77 s instead of 115 (2026-12-07). Nothing a test makes is
    frozen; test_python_gc.py's cycles are the tests' own."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Frozen objects are left out of the interpreter's last collection at exit too: Triton's bindings (nanobind) then
    report hundreds of leaked functions. Unfrozen first, they are freed as in any run."""
    gc.unfreeze()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The cases of tests/long_cases.txt get the `slow` marker. Tests marked `gpu` skip themselves where no CUDA
    device is visible, so `pytest -m gpu` on a CPU machine reports skips, not failures (the default run deselects
    them: pyproject.toml's addopts)."""
    long = long_cases()
    for item in items:
        if item.nodeid in long:
            item.add_marker(pytest.mark.slow)
    COLLECTED.update((item.nodeid, item.get_closest_marker("slow") is not None) for item in items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device visible (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker itself, not a `gpu` directory in the node id
            item.add_marker(skip)
