"""The command lines a user types: megalm-train, megalm-generate, megalm-preprocess.

Each bad-input case must exit non-zero with exactly one `error:` line on stderr, no traceback,
and leave what the user had untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def run(cmd: list[str], cwd: Path, timeout: int = TIMEOUT, threads: int = 1) -> subprocess.CompletedProcess:
    """`cmd` with `threads` OpenMP threads a process: 1 unless the test times a run on both cores, since a 2-thread run
    beside another busy process (an xdist worker, a second rank) runs 2.6x slower (docs/benchmarks.md)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def train(args: list[str], cwd: Path, tiny: bool = True) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "megalm.train", *(TINY if tiny else []), *args], cwd)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def write_corpus(directory: Path, n_docs: int = 60) -> Path:
    corpus = directory / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 3}) + "\n"
                              for i in range(n_docs)))
    return corpus


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """One short real run through the CLI that later tests sample from and try to clobber."""
    from megalm.data.preprocess import preprocess

    cwd = tmp_path_factory.mktemp("cli")
    preprocess([str(write_corpus(cwd))], str(cwd / "corpus"), "byte", show_progress=False)
    proc = train(["hydra.run.dir=run", "trainer.max_steps=4", "trainer.save_interval=2", "data=indexed",
                  f"data.path={cwd / 'corpus'}"], cwd)
    assert proc.returncode == 0, proc.stderr
    return cwd / "run"


def test_train_writes_config_metrics_and_checkpoints(trained_run):
    records = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_sec"} <= set(records[0])
    assert (trained_run / "config.yaml").is_file()
    assert (trained_run / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    # precision=auto (the default) is saved as the recipe it chose (fp32 on a CPU), as if that was written
    line = next(ln for ln in (trained_run / "train.log").read_text().splitlines() if "precision: auto -> " in ln)
    recipe = line.split("precision: auto -> ")[1].split()[0]
    assert recipe in ("fp32", "bf16") and (torch.cuda.is_available() or line.endswith("auto -> fp32 (cpu)")), line
    for saved in (trained_run / "config.yaml", trained_run / "checkpoints" / "step_00000004" / "config.yaml"):
        assert f"precision:\n  name: {recipe}\n" in saved.read_text(), saved
    assert sorted(p.name for p in (trained_run / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]


def test_checkpoint_of_another_model_is_refused_and_kept(trained_run):
    shard = next((trained_run / "checkpoints" / "step_00000004").glob("shard-*.safetensors"))
    before = shard.read_bytes()
    proc = train(["hydra.run.dir=run", "trainer.max_steps=6", "model.hidden_size=128"], trained_run.parent)
    assert_one_line_error(proc, "another model", "hidden_size=64")
    assert shard.read_bytes() == before
    assert (trained_run / "checkpoints" / "latest").read_text().strip() == "step_00000004"


@pytest.mark.parametrize("args, fragments", [
    (["model.hiden_size=3"], ["unknown config key 'model.hiden_size'"]),
    (["+trainer.foo=3"], ["unknown config key 'trainer.foo'"]),
    (["trainer.max_steps=abc"], ["trainer.max_steps"]),
    (["model=nonexistent"], ["model/nonexistent", "tiny"]),
    (["model.num_heads=3"], ["model.num_heads=3"]),
    (["trainer.micro_batch_size=3"], ["global_batch_size=8", "micro_batch_size"]),
    (["parallel.tp=2"], ["world size 1 is not divisible by tp*pp*cp = 2"]),
    (["parallel.cp=2"], ["world size 1 is not divisible by tp*pp*cp = 1*1*2"]),
    (["model.seq_length=64", "model.max_position_embeddings=32"], ["exceeds the model's positions"]),
    (["data=indexed"], ["data.path"]),
    (["data=indexed", "data.path=/nonexistent/corpus"], ["/nonexistent/corpus"]),
])
def test_bad_input_is_one_line_error(tmp_path, args, fragments):
    assert_one_line_error(train(args, tmp_path), *fragments)


def test_debug_keeps_the_traceback(tmp_path):
    proc = train(["model.num_heads=3", "debug=true"], tmp_path)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_corrupt_data_and_vocab_too_large(tmp_path):
    corpus = write_corpus(tmp_path)
    proc = run(["megalm-preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "docs")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    too_small = train(["data=indexed", f"data.path={tmp_path / 'docs'}", "model.vocab_size=200"], tmp_path)
    assert_one_line_error(too_small, "model.vocab_size")
    idx = tmp_path / "docs.idx"
    idx.write_bytes(idx.read_bytes()[:20])
    assert_one_line_error(train(["data=indexed", f"data.path={tmp_path / 'docs'}"], tmp_path), "corrupt")
    again = run(["megalm-preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "docs")], tmp_path)
    assert_one_line_error(again, "--overwrite")
    assert len(idx.read_bytes()) == 20, "an existing dataset must not be overwritten"


def test_generate_from_the_run(trained_run):
    proc = run(["megalm-generate", str(trained_run), "--prompt", "def ", "--max-new-tokens", "12"], trained_run)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def ")
    bad = run(["megalm-generate", str(trained_run / "missing")], trained_run)
    assert_one_line_error(bad, "does not exist")


def test_console_script_and_multirun(tmp_path):
    exe = shutil.which("megalm-train")
    assert exe is not None, "megalm-train is not on PATH: pip install -e . first"
    proc = run([exe, "-m", *TINY, "trainer.max_steps=2", "optim.lr=1e-3,2e-3", "hydra.sweep.dir=sweep"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    runs = sorted((tmp_path / "sweep").glob("*/metrics.jsonl"))
    assert len(runs) == 2
    lrs = [json.loads(p.read_text().splitlines()[-1])["lr"] for p in runs]
    assert lrs[0] != lrs[1]
