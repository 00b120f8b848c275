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
from tests.e2e.forked_python import run_one_thread

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def run(cmd: list[str], cwd: Path, timeout: int = TIMEOUT, threads: int = 1) -> subprocess.CompletedProcess:
    """`cmd` with `threads` OpenMP threads a process: 1 unless the test times a run on both cores, since a 2-thread run
    beside another busy process (an xdist worker, a second rank) runs 2.6x slower (docs/benchmarks.md).
    One-thread `python -m ...` and `python SCRIPT.py` commands fork from a server that imported torch once
    (tests/e2e/forked_python.py: 4-5 s of CPU less a command); the others start fresh."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    if threads != 1:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return run_one_thread(cmd, cwd, env, timeout)


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
    before, config = shard.read_bytes(), (trained_run / "config.yaml").read_bytes()
    proc = train(["hydra.run.dir=run", "trainer.max_steps=6", "model.hidden_size=128"], trained_run.parent)
    assert_one_line_error(proc, "another model", "hidden_size=64")
    assert shard.read_bytes() == before
    assert (trained_run / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert (trained_run / "config.yaml").read_bytes() == config, "a refused run rewrote the run's config.yaml"


def test_resuming_an_earlier_checkpoint_into_the_run_dir_keeps_the_later_ones(trained_run, tmp_path):
    """trainer.resume=PATH of step 2 into the run dir that has step 4: the run's saves would replace step 4. And a
    checkpoint past trainer.max_steps, or a resume path that does not exist, is one line naming the fix."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    later = run_dir / "checkpoints" / "step_00000004"
    before = {f.name: f.read_bytes() for f in later.iterdir()}
    earlier = run_dir / "checkpoints" / "step_00000002"
    proc = train([f"hydra.run.dir={run_dir}", "trainer.max_steps=4", "trainer.save_interval=2",
                  f"trainer.resume={earlier}"], tmp_path)
    assert_one_line_error(proc, "has checkpoints after step 2 (step_00000004)", "new hydra.run.dir")
    assert {f.name: f.read_bytes() for f in later.iterdir()} == before
    assert_one_line_error(train([f"hydra.run.dir={run_dir}", "trainer.max_steps=2", "optim.warmup_steps=1"], tmp_path),
                          "is at step 4, past trainer.max_steps=2", "raise trainer.max_steps")
    # a stop before the checkpoint trains nothing (a requeued chunk of a run that went on since) and said only "stopped
    # early" (an audit): it says why
    again = train([f"hydra.run.dir={run_dir}", "trainer.max_steps=4", "trainer.save_interval=2",
                   "trainer.stop_at_step=3", "data=indexed", f"data.path={trained_run.parent / 'corpus'}"], tmp_path)
    assert again.returncode == 0 and "past trainer.stop_at_step=3: nothing to train" in again.stdout + again.stderr
    # Hydra keeps a ~: the run would go to ./~/..., where no pre-check looked
    assert_one_line_error(train(["hydra.run.dir='~/megalm_run'"], tmp_path), "Hydra does not expand ~", "$HOME")
    assert not (tmp_path / "~").exists()
    assert_one_line_error(train(["hydra.run.dir=new", "trainer.resume=autp"], tmp_path),
                          "trainer.resume=autp: no such path", "auto, never")


def test_a_checkpoint_as_the_run_dir_is_refused_and_kept(trained_run, tmp_path):
    """hydra.run.dir naming a checkpoint (where trainer.resume=PATH was meant): its config.yaml has model and trainer
    sections as a run's has, and the run wrote its own over it, leaving the weights unreadable (another model's
    shapes). Refused before anything is written, naming trainer.resume."""
    checkpoint = tmp_path / "step_00000002"
    shutil.copytree(trained_run / "checkpoints" / "step_00000002", checkpoint)
    before = {f.name: f.read_bytes() for f in checkpoint.iterdir()}
    proc = train([f"hydra.run.dir={checkpoint}", "model.hidden_size=128"], tmp_path)
    assert_one_line_error(proc, "is a checkpoint, and a run there would overwrite its config.yaml",
                          f"trainer.resume={checkpoint}")
    assert {f.name: f.read_bytes() for f in checkpoint.iterdir()} == before


def test_a_run_dir_holding_other_files_is_refused_and_kept(tmp_path):
    """A run writes config.yaml and appends to metrics.jsonl: a directory whose files of those names are not a
    megalm run's is refused before either is touched; so is a run dir that is a file or lies under one."""
    cases = {"mine": {"config.yaml": "notes: mine\n", "metrics.jsonl": "my line\n"},
             "metrics_only": {"metrics.jsonl": "my line\n"}}
    for name, files in cases.items():
        (tmp_path / name).mkdir()
        for file, text in files.items():
            (tmp_path / name / file).write_text(text)
        fragment = "not a megalm run's config.yaml" if "config.yaml" in files else "without the config.yaml"
        assert_one_line_error(train([f"hydra.run.dir={name}"], tmp_path), fragment, "new or empty run dir")
        assert {f.name: f.read_text() for f in (tmp_path / name).iterdir() if f.is_file()} == files
    # a run dir not on the command line (a sweep's job dir) is checked in the run, after Hydra made it
    (tmp_path / "sweep" / "0").mkdir(parents=True)
    (tmp_path / "sweep" / "0" / "config.yaml").write_text("notes: mine\n")
    proc = run([sys.executable, "-m", "megalm.train", "-m", *TINY, "hydra.sweep.dir=sweep"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "not a megalm run's config.yaml" in proc.stderr and "hydra.sweep.dir under -m" in proc.stderr
    assert (tmp_path / "sweep" / "0" / "config.yaml").read_text() == "notes: mine\n"
    (tmp_path / "notes.txt").write_text("mine")
    assert_one_line_error(train(["hydra.run.dir=notes.txt"], tmp_path), "hydra.run.dir=notes.txt is a file")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert_one_line_error(train(["hydra.run.dir=notes.txt/run"], tmp_path),  # Hydra could not make it
                          f"hydra.run.dir=notes.txt/run: {tmp_path / 'notes.txt'} is a file")
    assert_one_line_error(train(["hydra.run.dir=/proc/megalm_run"], tmp_path),  # no one may write there, not root
                          "hydra.run.dir=/proc/megalm_run: cannot write in /proc")
    (tmp_path / "outputs").write_text("mine too")
    assert_one_line_error(train([], tmp_path), "outputs (the default run dir is outputs/DATE/TIME) is a file")
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "outputs").read_text() == "mine too"


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
    (["trainer.preempt_signals=[SIGFOO]"], ["trainer.preempt_signals has 'SIGFOO'"]),
    (["data=indexed", "data.path=/nonexistent/corpus"], ["/nonexistent/corpus"]),
    # refused when the trainer built them, after Hydra had made the run dir (until 2026-12-06, an audit found)
    (["model.attention_backend=flash_attn", "trainer.device=cpu"],
     ["model.attention_backend=flash_attn needs the flash-attn package"]),
    (["optim.implementation=triton", "precision=fp32"], ["optim.implementation=triton steps fp32 main weights"]),
    (["data=demo", "data.tokenizer=tok.json"], ["data=demo is byte-tokenized, got data.tokenizer=tok.json"]),
    (["hydra.run.dir="], ["hydra.run.dir is empty"]),  # an unset $RUN: it trained in the current directory
    (["banana"], ["Error parsing override 'banana': an override is key=value"]),  # Hydra's 4 lines, exit 1
    (["trainer.max_steps=2)"], ["Error parsing override 'trainer.max_steps=2)': extraneous input ')'"]),
])
def test_bad_input_is_one_line_error(tmp_path, args, fragments):
    """A config refused by its rules is refused before Hydra starts the run: no run dir is left behind
    (outputs/DATE/TIME with Hydra's files). A corpus is read when the run starts (a config checked on a laptop may
    name a cluster's path)."""
    assert_one_line_error(train(args, tmp_path), *fragments)
    if "data.path=/nonexistent/corpus" not in args:
        assert not (tmp_path / "outputs").exists(), sorted(str(p) for p in (tmp_path / "outputs").rglob("*"))


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
    # a run dir (or a dir of runs) is resolved to a checkpoint: which one is said, on stderr (stdout is the sample)
    latest = trained_run / "checkpoints" / "step_00000004"
    assert f"megalm-generate: sampling from {latest}" in proc.stderr, proc.stderr
    named = run(["megalm-generate", str(latest), "--prompt", "def ", "--max-new-tokens", "2"], trained_run)
    assert named.returncode == 0 and "sampling from" not in named.stderr, named.stderr
    bad = run(["megalm-generate", str(trained_run / "missing"), "--prompt", "def "], trained_run)
    assert_one_line_error(bad, "does not exist")


@pytest.mark.parametrize("flags, fragments", [
    (["--top-k", "-3"], ["--top-k -3 must be >= 0"]),
    (["--temperature", "-1"], ["--temperature -1.0 must be a finite number >= 0 (0: greedy)"]),
    (["--temperature", "nan"], ["--temperature nan must be a finite number >= 0"]),  # passed `< 0`, then a traceback
    (["--temperature", "inf"], ["--temperature inf must be a finite number >= 0"]),
    (["--num-samples", "0"], ["--num-samples 0 must be >= 1"]),
    (["--device", "banana"], ["--device banana is not a device"]),
    (["--tokenizer", "no_such_dir/tokenizer.json"], ["not found"]),
    # an empty context: no trained position reads eod, which it was (the first token sampled from noise; an audit)
    (["--prompt", ""], ["needs --prompt TEXT", "never learns a document's first token"]),
])
def test_generate_refuses_bad_flags_in_one_line(trained_run, flags, fragments):
    proc = run(["megalm-generate", str(trained_run), "--max-new-tokens", "2", "--device", "cpu", "--prompt", "def ",
                *flags], ROOT)
    assert_one_line_error(proc, *fragments)


def test_generate_refuses_a_tokenizer_the_run_did_not_train_with(trained_run, tmp_path):
    """The run trained on bytes (257 tokens, recorded in its checkpoint): a BPE tokenizer of 270, which the model's
    320 rows would admit, would decode its ids into other text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def f(x): return x + 1\n" * 4] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    proc = run(["megalm-generate", str(trained_run), "--max-new-tokens", "2", "--device", "cpu", "--tokenizer",
                str(tmp_path / "tokenizer.json"), "--prompt", "def "], tmp_path)
    assert_one_line_error(proc, "tokens, the run's had 257", "--tokenizer PATH")
    byte = run(["megalm-generate", str(trained_run), "--max-new-tokens", "2", "--device", "cpu", "--tokenizer",
                "byte", "--prompt", "def "], tmp_path)
    assert byte.returncode == 0 and byte.stdout.startswith("def "), byte.stderr


def test_a_sweep_s_bad_value_fails_as_one_line_before_its_first_job(tmp_path):
    """A sweep (-m) is checked value by value before its first job: a misspelled key had Hydra's several lines,
    exit 1 and its advice to add the key with `+`; a value that breaks a rule, second in its list, failed only after
    the first job had trained."""
    for args, fragments in [
        (["trainer.max_step=2", "optim.lr=1e-3,2e-3"], ["unknown config key 'trainer.max_step'"]),
        (["banana", "optim.lr=1e-3,2e-3"], ["Error parsing override 'banana': an override is key=value"]),
        (["optim.lr=interval(0.001,0.01)"], ["an interval needs a sweeper plugin"]),  # the basic sweeper's trace
        (["trainer.max_steps=2", "model.num_heads=4,3", "model.num_kv_heads=1"],
         ["model.hidden_size=64", "model.num_heads=3", "(a job of the sweep: ", "model.num_heads=3 "]),
    ]:
        proc = run([sys.executable, "-m", "megalm.train", "-m", *TINY, *args, "hydra.sweep.dir=sweep"], tmp_path)
        assert_one_line_error(proc, *fragments)
        assert proc.returncode == 2, proc.stderr
        assert not (tmp_path / "sweep").exists(), "no job of a refused sweep ran"
    # Hydra's flags before the overrides (Hydra's usage, 9 lines, where a flag came after them)
    assert_one_line_error(train(["-m", "optim.lr=1e-3,2e-3"], tmp_path), "Hydra's flags go before the overrides: "
                          f"megalm-train -m {' '.join(TINY)} optim.lr=1e-3,2e-3 (here -m came after {TINY[-1]}, "
                          "before optim.lr=1e-3,2e-3)")


def test_console_script_and_multirun(tmp_path):
    exe = shutil.which("megalm-train")
    assert exe is not None, "megalm-train is not on PATH: pip install -e . first"
    proc = run([exe, "-m", *TINY, "trainer.max_steps=2", "optim.lr=1e-3,2e-3", "hydra.sweep.dir=sweep"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    runs = sorted((tmp_path / "sweep").glob("*/metrics.jsonl"))
    assert len(runs) == 2
    lrs = [json.loads(p.read_text().splitlines()[-1])["lr"] for p in runs]
    assert lrs[0] != lrs[1]
