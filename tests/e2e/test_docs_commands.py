"""Every command in README.md and docs/ runs (those that write files twice), so the docs cannot rot and stay
copy-paste safe (slow: a few minutes; CI runs it, but the variants of `variants`, which
`test_documented_variants_run` runs by hand).

Commands are read from the fenced code blocks and from inline `code` that starts like a command. Each
runs in a scratch directory, in document order (a resume follows its first run, generation follows
training), and then the document's commands that wrote files where they name (a run dir, an output file or prefix,
a redirect, megalm-plot's plots) run a second time in the same directory, as a reader who pastes them again would
(an output that refuses to be replaced, a run dir that refuses to continue, fail it; a command that only printed,
or wrote into a new timestamped run dir, cannot meet its own output, and is not run again).
Two docs run at a time (`doc_runs`; one under pytest-xdist), each in a directory of its own; the Python commands (but
torchrun) fork from a process that imported torch once (tests/e2e/forked_python.py: 3-4 s of CPU less each). With
tiny overrides: a small model on the documented data (the demo corpus is built in the scratch directory in a second),
3 steps (stops and token budgets scaled down), benchmarks cut to one short repetition, outputs redirected away from
docs/. Commands that need a GPU cluster are checked by config validation at their world size; the GPU tier's script
(`tools/gpu_check.sh`), which refuses to run without CUDA, by bash parsing it (tests/gpu/test_gpu_check_script.py
checks its refusal); the set-up commands (`pip install`, `pytest`, `docker`, `tools/gpu_wheels.sh`) are what CI
itself runs, or cannot run without a Docker engine or a package index. A documented command this file cannot classify
fails the test: add a rule for it.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.docs_pages import DOCS, ROOT, prose
from tests.e2e.forked_python import ForkedPython, forkable

STARTS = r"(megalm-\w+|python |torchrun |NPROC=|MASTER_ADDR=|(scripts|tools)/\S+\.sh\b|pytest|pip |docker |sbatch )"
# How an inline span in prose that is a command begins (within one line: a span over a line break is none)
INLINE_COMMAND = r"(megalm-\w+ |python (tools|-m megalm)|torchrun )"

# Appended to every training run unless the command sets the key itself (later overrides win).
TINY = {"model.num_layers": "4", "model.hidden_size": "64", "model.num_heads": "4", "model.num_kv_heads": "2",
        "model.ffn_hidden_size": "128", "model.seq_length": "32", "trainer.eval_interval": "0",
        "trainer.log_interval": "1", "logging.tensorboard": "false", "trainer.max_steps": "3"}
# Values scaled down wherever a command sets them.
SCALED = {"trainer.max_steps": "3", "trainer.stop_at_step": "2", "trainer.tokens_per_step": "600",
          "trainer.eval_iters": "2", "trainer.save_interval": "0",
          "profiling.start_step": "1", "profiling.steps": "1"}  # a profile's window inside the 3 steps
FLAGS = {"--steps": ["1"], "--warmup": ["0"], "--reps": ["1"], "--seq": ["64"], "--nproc": None,
         "--global-tokens": ["4M"]}
# Benchmarks that train: flags appended (argparse keeps the last value) so that they run one short repetition.
TOOL_FLAGS = {"precision_convergence.py": ["--steps", "2"], "throughput.py": ["--steps", "1", "--warmup", "0"],
              # cp 1 and 2 (--nproc 2): four gloo ranks on two cores cost most of its time, and
              # tests/dist/test_context_parallel.py checks cp 4 against one process
              "context_parallel.py": ["--steps", "1", "--warmup", "0", "--seq", "64", "--nproc", "2"],
              "comm_volume.py": [],
              "offload.py": ["--steps", "1", "--warmup", "0", "--fractions", "0.5"],  # each policy once
              "checkpoint_save.py": ["--reps", "1"],
              "compare.py": ["--tiny", "--seqs", "64", "--precisions", "fp32", "--repeats", "1"],
              "step_cost.py": ["--systems", "megalm"],  # every system: test_measure_op_cost.py runs the tool whole
              "activation_memory.py": ["model.num_heads=8",  # 8 heads: its tp8 command shards them
                                       "--recompute", "none"],  # each mode: tests/unit/test_measure_storage.py
              "moe_balance.py": ["--steps", "2"],
              "host_overhead.py": ["--steps", "1", "--warmup", "1"],
              "python_gc.py": ["--steps", "2"],
              "kv_cache.py": ["--reps", "1", "--prompt-tokens", "8", "--new-tokens", "16"],  # within the tiny positions
              "attention_kernels.py": ["--iters", "1", "--warmup", "0"],
              "adamw_kernels.py": ["--iters", "1", "--warmup", "0"],
              # its documented 8,192 tokens: CPU's emulated FP8 GEMMs ran past 600 s on CI (2026-12-06), 4 min here
              "fp8_gemms.py": ["--iters", "1", "--warmup", "0", "--back-to-back", "1", "model.seq_length=64"],
              "inductor_kernels.py": ["--steps", "2", "--top", "1", "model.seq_length=64"],
              # its documented 4,096-token, 8-layer shape compiled took 216 s of CI's long tests (2026-12-01)
              "zero_bubble_blocks.py": ["--iters", "1", "--warmup", "0", "--rows", "zb_eager,zb_compiled",
                                        "model.seq_length=64", "model.num_layers=2"]}
# Benchmarks that set their own model shapes (a tiny model would not shard over their layouts): only these flags.
OWN_SHAPE_FLAGS = {"estimate_vs_formula.py": ["--models", "8b", "--recompute", "full", "--num-layers", "4"],
                   "fsdp_memory.py": ["--dp", "2", "--models"]}  # the tiny model's real runs at dp 2, no 8B/70B
SET_UP = ("pip install", "pytest", "docker ", "tools/gpu_wheels.sh",
          "python tools/slurm_local/")  # the loopback Slurm cluster needs root and apt: tests/e2e/test_slurm.py runs it
GPU_ONLY = ("tools/gpu_check.sh",)  # exits 2 without CUDA by design
# pyproject's console scripts, run as modules of this checkout
CONSOLE_SCRIPTS = {"megalm-train": "megalm.train", "megalm-generate": "megalm.generate",
                   "megalm-preprocess": "megalm.data.preprocess", "megalm-plot": "megalm.plot",
                   "megalm-export": "megalm.interop.export", "megalm-import": "megalm.interop.hf_import",
                   "megalm-estimate": "megalm.estimate"}
# megalm-estimate keeps the documented layout and shrinks the model to a shape that layout still shards (the
# values replace the command's own: it runs one rank of the layout under fake tensors either way). Layers: as many
# as the pipeline has stages (`estimate_layers`), 8 for a search, which chooses among pipelines up to that depth.
ESTIMATE_SHAPE = {"model.hidden_size": "64", "model.num_heads": "8",
                  "model.num_kv_heads": "8", "model.ffn_hidden_size": "128", "model.seq_length": "64",
                  "model.vocab_size": "512"}
# A command that names where it writes (a run dir, an output file or prefix, a redirect) can meet its own output when
# pasted again; one that writes to a new timestamped run dir (hydra's default) or into a temporary dir cannot.
NAMED_OUTPUT = re.compile(r"hydra\.run\.dir=|--out\b|--out-dir\b|--output-prefix\b|--png\b|--png-dir\b|>\s*\S|"
                          r"^megalm-plot\b")
# Where each command's wall time is appended, when set (.ci/run prints the slowest).
TIMINGS = os.environ.get("MEGALM_DOCS_TIMINGS")
NAMES_IN_PROSE = {"torchrun -m megalm.train", "python -m megalm.train", "megalm-generate --debug"}


def first_errors(stderr: str, lines: int = 40) -> str:
    """The first error lines of a failed run and what follows them: under torchrun the failing rank's traceback
    comes early, and the launcher's own report of the failure fills the tail."""
    text = stderr.splitlines()
    start = next((i for i, line in enumerate(text) if re.search(r"Traceback|error:|Error\b", line)), len(text))
    return "\n".join(text[start:start + lines])


def documented_commands(path: Path) -> list[str]:
    """The commands of one doc, in order: fenced blocks (continuations joined), then inline spans."""
    text = path.read_text()
    found = []
    for block in re.findall(r"```\w*\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split("  #")[0].strip()
            if re.match(STARTS, line):
                found.append(line)
    found += [span for span in re.findall(r"`([^`\n]+)`", prose(text)) if re.match(INLINE_COMMAND, span)]
    return list(dict.fromkeys(found))


def estimate_layers(words: list[str]) -> str:
    """The fewest layers the documented layout shards (one per pipeline stage and virtual stage, at least 2), or 8
    for a search: the estimator's time grows with the layers it traces (a compiled 1.3B command: 16 s at 8, 10 at 2)."""
    if "--search" in words:
        return "8"
    value = {w.split("=", 1)[0]: w.split("=", 1)[1] for w in words if "=" in w and not w.startswith("-")}
    return str(max(2, int(value.get("parallel.pp", 1)) * int(value.get("parallel.vpp", 1))))


def is_pattern(command: str) -> bool:
    """A usage pattern (placeholders, or an ellipsis for the arguments), not a command to run."""
    return command in NAMES_IN_PROSE or bool(re.search(r"<[^>]*>|\[--|\bN\b|\bR\b|FILE\.json|(^| )\.\.\.( |$)",
                                                       command))


def hydra_overrides(words: list[str]) -> list[str]:
    """The words Hydra reads as overrides (key=value, not a flag)."""
    return [w for w in words if "=" in w and not w.startswith("-")]


def overrides_set(words: list[str]) -> set[str]:
    return {w.split("=", 1)[0] for w in hydra_overrides(words)}


def shrink(words: list[str], tmp: Path) -> list[str]:
    """Scaled values, cut benchmark flags, outputs in `tmp`, repo paths absolute."""
    out, skip = [], 0
    for i, w in enumerate(words):
        if skip:
            skip -= 1
            continue
        key = w.split("=", 1)[0]
        if key in SCALED and "=" in w:
            w = f"{key}={SCALED[key]}"
        elif w in FLAGS:
            values = []
            for v in words[i + 1:]:
                if v.startswith("-") or "=" in v:
                    break
                values.append(v)
            skip = len(values)
            if FLAGS[w] is None:  # keep, capped
                values = [str(min(int(values[0]), 4))] if w == "--nproc" else values
            else:
                values = FLAGS[w]
            out += [w, *values]
            continue
        elif w in ("--png-dir",):
            out += [w, str(tmp)]
            skip = 1
            continue
        elif w == "--png":
            out += [w, str(tmp / "plan.png")]
            skip = 1
            continue
        w = w.replace("/tmp/", f"{tmp}/")
        if re.match(r"(tools|scripts|configs)/", w):
            w = str(ROOT / w)
        out.append(w)
    return out


def runnable(command: str, tmp: Path) -> tuple[list[str], dict[str, str]] | None:
    """The argv and extra environment that run `command` small; None for set-up commands."""
    if command.startswith(SET_UP):
        return None
    env, words = {}, shlex.split(command)
    while words and re.match(r"[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    exe = words.pop(0)
    python = [sys.executable]
    if exe == "python":
        if words[:1] == ["-c"]:  # a data-making one-liner with its redirection
            return ["bash", "-c", command.replace("python", shlex.quote(sys.executable), 1)
                    .replace("/tmp/", f"{tmp}/")], env
        head = python
    elif exe in CONSOLE_SCRIPTS:
        head = python + ["-m", CONSOLE_SCRIPTS[exe]]
    elif exe == "torchrun":
        head = python + ["-m", "torch.distributed.run"]
    elif exe.startswith("scripts/"):
        head = ["bash", str(ROOT / exe)]
    else:
        raise AssertionError(f"no rule to run the documented command: {command}")
    words = shrink(words, tmp)
    tool = next((name for name in TOOL_FLAGS if any(w.endswith(name) for w in words)), None)
    own_shape = next((name for name in OWN_SHAPE_FLAGS if any(w.endswith(name) for w in words)), None)
    if own_shape is not None:
        words += OWN_SHAPE_FLAGS[own_shape]
    elif tool is not None:  # a benchmark: one short repetition, a small model; it runs its own steps
        words += TOOL_FLAGS[tool]
        if tool == "offload.py" and "--pp" in words:  # its pp 4, four gloo ranks on two cores: 37 s (2026-12-01)
            words += ["--pp", "2"]
        words += [f"{k}={v}" for k, v in TINY.items() if k.startswith("model.") and k not in overrides_set(words)]
    elif exe == "megalm-estimate":
        layers = estimate_layers(words)
        words = [w for w in words if w.split("=", 1)[0] not in {*ESTIMATE_SHAPE, "model.num_layers"}]
        words += [f"{k}={v}" for k, v in ESTIMATE_SHAPE.items()] + [f"model.num_layers={layers}"]
        if "--search" in words and "--top" not in words:  # one layout confirmed, not five: the path is the same
            words += ["--top", "1"]
    elif ("megalm.train" in head + words or exe.startswith("scripts/")) and "--cfg" not in words:
        words += [f"{k}={v}" for k, v in TINY.items() if k not in overrides_set(words)]
    return head + words, env


def parse_only(command: str) -> None:
    """A GPU-only script: it exists and bash parses it (running it here would only show its refusal)."""
    script = ROOT / shlex.split(command)[0]
    assert script.is_file(), f"documented script {script} does not exist"
    subprocess.run(["bash", "-n", str(script)], check=True)


def validate_sbatch(command: str) -> None:
    """A Slurm submission: the template exists and bash parses it; its overrides pass validation at its world size
    (8 GPUs a node, the nodes from --nodes= or the template's #SBATCH --nodes; --gpus-per-node=0: one process).
    tests/e2e/test_slurm.py submits the templates to a real (loopback) Slurm."""
    from megalm.training.validation import validate_run
    from tests.conftest import compose_config

    words = shlex.split(command)[1:]
    script = ROOT / next(w for w in words if w.endswith(".sbatch"))
    assert script.is_file(), f"documented template {script} does not exist"
    subprocess.run(["bash", "-n", str(script)], check=True)
    nodes_line = re.search(r"#SBATCH --nodes=(\d+)", script.read_text())
    nodes = next((int(w.split("=")[1]) for w in words if w.startswith("--nodes=")),
                 int(nodes_line.group(1)) if nodes_line else 1)
    world = 1 if "--gpus-per-node=0" in words else 8 * nodes
    overrides = [w for w in words[words.index(next(w for w in words if w.endswith(".sbatch"))) + 1:] if "=" in w]
    validate_run(compose_config(*overrides, tiny=False), world_size=world)


def validate_only(command: str) -> None:
    """A multi-node GPU command: its overrides must pass validation at its world size (8 GPUs a node)."""
    from megalm.training.validation import validate_run
    from tests.conftest import compose_config

    words = shlex.split(command)
    nodes = int(next(w.split("=")[1] for w in words if w.startswith("NNODES=")))
    overrides = [w for w in words if "=" in w and not re.match(r"[A-Z_]+=", w)]
    validate_run(compose_config(*overrides, tiny=False), world_size=8 * nodes)


def checked_without_running(command: str) -> Callable[[str], None] | None:
    """How a command this machine cannot run is checked instead (a multi-node or Slurm launch: its config validated
    at its world size; the GPU script: bash parses it); None for a command that runs."""
    if command.startswith("MASTER_ADDR=") or "NNODES=" in command:
        return validate_only
    if command.startswith("sbatch "):
        return validate_sbatch
    if command.startswith(GPU_ONLY):
        return parse_only
    return None


_IN_PROCESS = threading.Lock()  # Hydra's compose (the validations below) keeps global state: one at a time
# A command whose output no later command reads (an estimate, a benchmark, a simulation; a training run under
# torchrun into a run directory of its own time stamp, which no later command can name) runs where it first appears, in
# DOCS' order; a later one that differs from an earlier one in its Hydra overrides only, as run here (the same tool with
# the same flags: a variant, e.g. step_cost.py at another precision, the same command in another doc, another layout on
# torchrun's four ranks) is not run in CI's run: the tool's own path has run once, and
# tests/unit/test_docs_commands_parse.py composes the variant's overrides into a config megalm's schema accepts (a
# torchrun variant's validated at its world size, as its ranks would first do; tests/dist runs each layout against one
# process). `test_documented_variants_run` (a long test run by hand, .ci/long_tests_by_hand.txt) runs them: on
# 2026-12-02 CI's docs commands spent 1,050 of their 3,300 s (two at a time, beside the other long tests) on 35
# report-only variants; in a later run that day (2,039 s in all) the README's and hdp.md's four-rank torchrun layouts
# after the first took 222 s.
VARIANT_TOOLS = ("megalm-estimate ", "python tools/bench/", "python tools/hdp_sim.py ", "torchrun ")


def variant_shape(command: str) -> tuple[str, ...] | None:
    """The tool and flags as run (Hydra overrides left out) of a command whose output no later command reads; None
    for other commands."""
    if not command.startswith(VARIANT_TOOLS) or NAMED_OUTPUT.search(command) or is_pattern(command):
        return None
    spec = runnable(command, Path("/scratch"))
    if spec is None:
        return None
    overrides = set(hydra_overrides(spec[0]))
    return tuple(w for w in spec[0][1:] if w not in overrides)


@functools.cache
def variants() -> dict[str, list[str]]:
    """{doc name: its commands whose shape (`variant_shape`) an earlier command (in DOCS' order) runs}."""
    seen: set[tuple[str, ...]] = set()
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for command in documented_commands(doc):
            if (shape := variant_shape(command)) is None:
                continue
            if shape in seen:
                found.setdefault(doc.name, []).append(command)
            seen.add(shape)
    return found


def files_of(tmp_path: Path) -> dict[Path, int]:
    """Every file under a doc's scratch directory, with its modification time (the tools' caches left out)."""
    cache = tmp_path / "cache"
    return {f: f.stat().st_mtime_ns for f in tmp_path.rglob("*") if f.is_file() and cache not in f.parents}


def run_doc(doc: Path, tmp_path: Path, only_variants: bool = False) -> None:
    """Every command of `doc` but its variants (`variants`), in order, in `tmp_path`, and then again those that
    wrote files where they name (only those can meet their own output when pasted again: `NAMED_OUTPUT`); raises on
    the first failure. `only_variants`: run the doc's variants only."""
    left_out = variants().get(doc.name, [])
    commands = left_out if only_variants else [c for c in documented_commands(doc)
                                               if not is_pattern(c) and c not in left_out]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    with ForkedPython(env) as python:  # forks the Python commands it can: no `import torch` of their own
        run_commands(doc, commands, tmp_path, env, python)


def run_commands(doc: Path, commands: list[str], tmp_path: Path, env: dict[str, str], python: ForkedPython) -> None:
    """`run_doc`'s commands, first runs, then second ones."""
    writers: set[str] = set()
    for attempt, command in [(attempt, c) for attempt in ("first", "second") for c in commands]:
        if attempt == "second" and command not in writers:
            continue
        if (check := checked_without_running(command)) is not None:
            with _IN_PROCESS:  # the validations compose configs (bash parsing the GPU script is brief)
                check(command)
            continue
        spec = runnable(command, tmp_path)
        if spec is None:
            continue
        argv, extra = spec
        before, started = files_of(tmp_path), time.perf_counter()
        if (fork := forkable(argv)) is not None:
            proc = python.run(*fork, cwd=tmp_path, env={**env, **extra}, timeout=600)
            assert not proc.timed_out, f"{doc.name}: `{command}` ran past 600 s on its {attempt} run"
        else:
            proc = subprocess.run(argv, cwd=tmp_path, env={**env, **extra}, capture_output=True, text=True,
                                  timeout=600)
        if TIMINGS:  # CI prints the slowest commands from this file
            with open(TIMINGS, "a") as f:
                f.write(f"{time.perf_counter() - started:7.1f} s  {doc.name} ({attempt}): {command[:150]}\n")
        if files_of(tmp_path) != before and NAMED_OUTPUT.search(command):
            writers.add(command)
        wandb_missing = "logging.wandb.enabled=true" in command and "pip install wandb" in proc.stderr
        assert proc.returncode == 0 or wandb_missing, \
            f"{doc.name}: `{command}` failed on its {attempt} run as `{' '.join(argv)}`:\n{first_errors(proc.stderr)}" \
            f"\n...\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def doc_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Future]:
    """Every selected doc's run, started at once on two worker threads: most commands are one single-threaded
    process, so two docs at a time keep both cores of a CI machine busy. Each doc has its own directory and
    cache; the longest docs start first. Under pytest-xdist (`.ci/run` runs the long tests on two workers) another
    worker keeps the second core busy: one doc at a time, in the tests' order, so that no test waits on another
    doc's run and the demo's two threads never share the cores with three processes (its 900 s limit)."""
    selected = [item.callspec.params["doc"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_documented_commands_run"]
    beside_a_worker = "PYTEST_XDIST_WORKER" in os.environ
    order = selected if beside_a_worker else sorted(selected, key=lambda doc: -len(documented_commands(doc)))
    pool = ThreadPoolExecutor(1 if beside_a_worker else 2, thread_name_prefix="docs")
    runs = {doc: pool.submit(run_doc, doc, tmp_path_factory.mktemp(doc.stem)) for doc in order}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_documented_commands_run(doc: Path, doc_runs: dict[Path, Future]):
    doc_runs[doc].result()  # re-raises the doc's failure


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("doc", [doc for doc in DOCS if doc.name in variants()], ids=lambda p: p.name)
def test_documented_variants_run(doc: Path, tmp_path: Path):
    """The commands `test_documented_commands_run` leaves out (`variants`), run."""
    run_doc(doc, tmp_path, only_variants=True)
