"""Trainer: grad accumulation is exact, resume is bit-exact, loss falls, bad configs are refused."""

import importlib.machinery
import importlib.util
import shutil
import sys
import time
import types

import pytest
import torch

from megalm.data.dataset import global_batch, loss_token_count
from megalm.errors import CheckpointError, ConfigError
from megalm.training.metrics import read_metrics
from megalm.training.trainer import Trainer
from tests.conftest import compose_config


def grads_after_one_batch(tmp_path, micro_batch_size: int) -> tuple[float, dict[str, torch.Tensor]]:
    cfg = compose_config(f"trainer.micro_batch_size={micro_batch_size}", "trainer.global_batch_size=8")
    trainer = Trainer(cfg, tmp_path / f"mbs{micro_batch_size}")
    loss, share = trainer.forward_backward(0)
    n = loss_token_count(global_batch(trainer.data.train, 0, 8))
    assert share.loss_tokens == n, "the normaliser is the loss-token count of the whole global batch"
    return loss.item() / n, {k: p.grad.clone() for k, p in trainer.model.named_parameters()}


def test_grad_accumulation_equals_one_big_batch(tmp_path):
    loss_big, big = grads_after_one_batch(tmp_path, 8)
    loss_acc, acc = grads_after_one_batch(tmp_path, 2)
    assert loss_acc == pytest.approx(loss_big, rel=1e-6)
    for name, g in big.items():
        torch.testing.assert_close(acc[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_training_trajectory_independent_of_micro_batch_split(tmp_path):
    runs = {}
    for mbs in (8, 1):
        cfg = compose_config(f"trainer.micro_batch_size={mbs}", "trainer.max_steps=4")
        trainer = Trainer(cfg, tmp_path / f"{mbs}-full")
        runs[mbs] = [trainer.train_step(s).loss for s in range(4)]
    assert runs[1] == pytest.approx(runs[8], rel=1e-5)


def test_each_record_averages_the_losses_since_the_last_one(tmp_path, caplog):
    """metrics.jsonl's `loss_avg` and the console's "(avg …)": the mean of the step losses since the previous record
    (Megatron's lm loss over its log interval), beside the logged step's own `loss`."""
    with caplog.at_level("INFO", logger="megalm"):
        summary = Trainer(compose_config("trainer.max_steps=7", "trainer.log_interval=3"), tmp_path).fit()
    step_loss = dict(summary.losses)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 3, 6, 7]
    for record, steps in zip(records, ([1], [2, 3], [4, 5, 6], [7]), strict=True):
        assert record["loss"] == step_loss[record["step"]]
        assert record["loss_avg"] == pytest.approx(sum(step_loss[s] for s in steps) / len(steps), rel=1e-12)
    assert f"(avg {records[2]['loss_avg']:.4f})" in caplog.text


def test_resume_is_bit_exact(tmp_path):
    common = ["trainer.max_steps=12", "model.dropout=0.1", "trainer.save_interval=4"]
    straight = Trainer(compose_config(*common), tmp_path / "straight").fit()

    stopped_dir = tmp_path / "stopped"
    first = Trainer(compose_config(*common, "trainer.stop_at_step=6"), stopped_dir).fit()
    assert first.steps == 6
    resumed_trainer = Trainer(compose_config(*common, "trainer.resume=auto"), stopped_dir)
    assert resumed_trainer.step == 6 and resumed_trainer.resumed_from.name == "step_00000006"
    resumed_trainer.fit()

    expected = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "straight")}
    got = {r["step"]: r["loss"] for r in read_metrics(stopped_dir)}
    assert sorted(got) == list(range(1, 13))
    for step in range(7, 13):
        assert got[step] == expected[step], f"step {step}: {got[step]} != {expected[step]}"
    assert [loss for _, loss in straight.losses][6:] == [got[s] for s in range(7, 13)]


def test_a_run_resumed_from_before_its_last_logged_step_is_drawn_once(tmp_path):
    """A crash after step 6 with the last checkpoint at step 4: the resumed run logs steps 5 and 6 again.
    megalm-plot draws the last attempt's records and TensorBoard drops the first attempt's steps 5 and 6."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megalm.plot.curves import load_metrics

    common = ["trainer.max_steps=8", "trainer.save_interval=4", "logging.tensorboard=true"]
    Trainer(compose_config(*common, "trainer.stop_at_step=6"), tmp_path).fit()
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000006")  # the crash came before this save
    resumed = Trainer(compose_config(*common, "trainer.resume=auto"), tmp_path)
    assert resumed.step == 4
    resumed.fit()
    written = read_metrics(tmp_path)
    assert [r["step"] for r in written] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    drawn = load_metrics(tmp_path)
    assert [r["step"] for r in drawn] == list(range(1, 9)) and drawn[4:] == written[6:]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (r["step"], pytest.approx(r["loss"])) for r in drawn]


def test_throughput_leaves_out_evaluation_and_checkpoint_saves(tmp_path, monkeypatch):
    """tokens/s and MFU are the training steps' (Megatron stops its interval timer around both): on a clock that
    moves only while the run evaluates, saves or collects garbage after them, every logged window's rate is
    unbounded. Before, a save's time
    landed in the next window, an evaluation's in its own: periodic dips in the throughput curve."""
    from megalm.training import metrics

    clock = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])

    def slow(method):
        def run(self, *args, **kwargs):
            clock[0] += 1000.0
            return method(self, *args, **kwargs)
        return run

    monkeypatch.setattr(Trainer, "save", slow(Trainer.save))
    monkeypatch.setattr(Trainer, "evaluate", slow(Trainer.evaluate))
    # and the full collection after each (and the one before the first step): on the clock, it dipped the next
    # window's tokens/s tenfold (an audit, 2026-12-04)
    from megalm.training.python_gc import StepBoundaryGC

    monkeypatch.setattr(StepBoundaryGC, "full", slow(StepBoundaryGC.full))
    Trainer(compose_config("trainer.max_steps=6", "trainer.save_interval=2", "trainer.eval_interval=3",
                           "trainer.log_interval=1"), tmp_path).fit()
    rates = [r["tokens_per_sec"] for r in read_metrics(tmp_path)]
    assert len(rates) == 6 and min(rates) > 1e9, rates


def test_a_long_evaluation_is_progress_to_the_hang_watchdog(tmp_path):
    """The watchdog heard from the loop only between steps, evaluations and saves: an evaluation of many batches
    longer than trainer.hang_minutes was reported as a hang and the run killed. Each batch is a beat now."""
    trainer = Trainer(compose_config("trainer.eval_iters=5", "trainer.max_steps=1"), tmp_path)
    beats = []
    trainer.watchdog.beat = lambda step=None: beats.append(step)
    trainer.evaluate()
    assert beats == [None] * 5


def test_resume_refuses_other_model_and_changed_data_order(tmp_path):
    Trainer(compose_config("trainer.max_steps=2"), tmp_path).fit()
    with pytest.raises(CheckpointError, match="hidden_size=64 .this run: 128"):
        Trainer(compose_config("trainer.max_steps=4", "model.hidden_size=128"), tmp_path)
    with pytest.raises(CheckpointError, match="global_batch_size=8, this run has 16"):
        Trainer(compose_config("trainer.max_steps=4", "trainer.global_batch_size=16"), tmp_path)
    with pytest.raises(CheckpointError, match="already has checkpoints"):
        Trainer(compose_config("trainer.max_steps=4", "trainer.resume=never"), tmp_path)


def test_a_resume_that_changes_what_the_model_computes_is_said(tmp_path, caplog):
    """A resume with another model.rope_theta or dropout loads (no tensor changes shape) and continues another function
    than the run it resumes: one warning line names the keys (it had said nothing; model.init_from did)."""
    import logging

    Trainer(compose_config("trainer.max_steps=1"), tmp_path).fit()
    with caplog.at_level(logging.WARNING, logger="megalm"):
        Trainer(compose_config("trainer.max_steps=2"), tmp_path)
        assert not [r for r in caplog.records if "was trained with model." in r.getMessage()]
        Trainer(compose_config("trainer.max_steps=2", "model.rope_theta=100", "model.dropout=0.1"), tmp_path)
    said = [r.getMessage() for r in caplog.records if "was trained with model." in r.getMessage()]
    assert len(said) == 1 and "model.rope_theta=10000.0 (this run: 100.0), model.dropout=0.0 (this run: 0.1)" in \
        said[0], said


def test_a_run_started_from_another_s_checkpoint_continues_its_own_when_requeued(tmp_path, caplog):
    """trainer.resume=PATH starts a run from another run's checkpoint; the same command again (a Slurm requeue, a
    torchrun restart) continues the run dir's own checkpoints rather than going back to PATH, or refusing them, as
    TorchTitan reads its initial_load_path only while the run has none. A PATH inside the run dir that is older
    than its checkpoints (a rollback) is refused: the run's saves would replace them."""
    import logging

    common = ["trainer.max_steps=6", "trainer.save_interval=2"]
    Trainer(compose_config(*common, "trainer.stop_at_step=2"), tmp_path / "source").fit()
    start = tmp_path / "source" / "checkpoints" / "step_00000002"
    run = tmp_path / "run"
    first = Trainer(compose_config(*common, "trainer.stop_at_step=4", f"trainer.resume={start}"), run)
    assert first.step == 2 and first.resumed_from == start
    first.fit()
    with caplog.at_level(logging.INFO, logger="megalm"):
        requeued = Trainer(compose_config(*common, f"trainer.resume={start}"), run)
    assert requeued.step == 4 and requeued.resumed_from.name == "step_00000004"
    assert any("not used" in r.message and "step_00000004" in r.message for r in caplog.records)
    requeued.fit()  # to step 6
    with pytest.raises(CheckpointError, match="after step 4 .step_00000006.*trainer.resume=auto"):
        Trainer(compose_config(*common, f"trainer.resume={run / 'checkpoints' / 'step_00000004'}"), run)
    # the source run went on and pruned PATH (keep_last): a requeue still continues its own (it said "no such
    # path", an audit 2026-12-06); a PATH that never was is refused while the run has nothing to continue
    shutil.rmtree(start)
    assert Trainer(compose_config(*common, f"trainer.resume={start}"), run).step == 6
    with pytest.raises(CheckpointError, match="no such path"):
        Trainer(compose_config(*common, f"trainer.resume={start}"), tmp_path / "new")


def test_loss_falls_and_metrics_are_written(tmp_path):
    cfg = compose_config("trainer.max_steps=40", "optim.lr=1e-2", "data.synthetic.fixed_doc_length=33",
                         "trainer.eval_interval=20", "trainer.log_interval=10")
    # Synthetic tokens are uniform noise, so learning shows as loss -> log(vocab_used), far below the
    # initial loss when the used vocabulary is small.
    cfg.data.synthetic.num_docs = 64
    cfg.model.vocab_size = 320
    summary = Trainer(cfg, tmp_path).fit()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 10, 20, 30, 40]
    for key in ("loss", "grad_norm", "lr", "tokens", "tokens_per_sec"):
        assert all(key in r for r in records), key
    assert "val_loss" in records[2] and "val_loss" in records[4]
    assert records[-1]["tokens"] == 40 * 8 * 32
    assert summary.checkpoint is not None and summary.checkpoint.name == "step_00000040"
    assert summary.last_loss < summary.first_loss


def test_the_summary_names_this_run_s_first_and_last_step_losses(tmp_path, caplog):
    """The summary's losses were the logged steps' (every log_interval): a resumed run whose one logged step was its
    last read "loss 3.441 -> 3.441", and a preempted one gave the last logged step's as the final loss. They are the
    run's own first and last steps', with the steps named."""
    import logging

    common = ["trainer.max_steps=8", "trainer.log_interval=5"]
    Trainer(compose_config(*common, "trainer.stop_at_step=3"), tmp_path).fit()
    with caplog.at_level(logging.INFO, logger="megalm"):
        summary = Trainer(compose_config(*common), tmp_path).fit()
    assert [s for s, _ in summary.losses] == [4, 5, 6, 7, 8]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 3, 5, 8]  # step 4, the first resumed, is not logged
    first, last = summary.losses[0][1], summary.losses[-1][1]
    assert (summary.first_loss, summary.last_loss) == (first, last)
    line = next(r.message for r in caplog.records if r.message.startswith("finished at step 8/8"))
    assert f"loss {first:.3f} at step 4 -> {last:.3f} at step 8" in line, line


def test_bf16_autocast_trains(tmp_path):
    cfg = compose_config("precision=bf16_autocast", "trainer.max_steps=3")
    trainer = Trainer(cfg, tmp_path)
    losses = [trainer.train_step(s).loss for s in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters()), "master weights stay fp32"
    fp32 = Trainer(compose_config("precision=fp32", "trainer.max_steps=3"), tmp_path / "fp32")  # not auto: bf16 on GPUs
    ref = fp32.train_step(0).loss
    assert losses[0] == pytest.approx(ref, rel=2e-2) and losses[0] != ref


@pytest.mark.parametrize("override, message", [
    ("model.num_heads=3", "not divisible by model.num_heads"),
    ("model.num_kv_heads=3", "not divisible by model.num_kv_heads"),
    ("trainer.micro_batch_size=3", "not divisible by micro_batch_size"),
    ("parallel.tp=2", "world size 1 is not divisible by tp"),
    ("parallel.pp=2", r"world size 1 is not divisible by tp\*pp\*cp = 1\*2\*1"),
    ("model.max_position_embeddings=16", "exceeds the model's positions"),
    ("optim.schedule=exp", "optim.schedule=exp is not one of"),
    ("precision.name=fp4", "precision=fp4 is not one of"),
    ("precision.forward=fp8", "applies to the mxfp4 recipes only"),
    ("precision.backend=te", "precision.backend=te runs Transformer Engine's fp8 recipes"),
])
def test_bad_config_is_a_one_line_error(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message) as info:
        Trainer(compose_config(override), tmp_path)
    assert "\n" not in str(info.value)


class FakeWandb(types.ModuleType):
    """Stands in for wandb: records init arguments and logged scalars, never touches a network."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits, self.logged, self.finished = [], [], False

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, scalars, step):
        self.logged.append((step, scalars))

    def finish(self):
        self.finished = True


def test_tensorboard_and_wandb_offline_receive_the_metrics(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = compose_config("trainer.max_steps=2", "logging.tensorboard=true", "logging.wandb.enabled=true")
    Trainer(cfg, tmp_path).fit()
    assert fake.inits[0]["mode"] == "offline" and fake.finished
    assert [step for step, _ in fake.logged] == [1, 2] and "loss" in fake.logged[0][1]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("override, package", [("logging.wandb.enabled=true", "wandb"),
                                               ("logging.tensorboard=true", "tensorboard")])
def test_a_logger_asked_for_but_missing_is_a_config_error_before_the_run(tmp_path, monkeypatch, override, package):
    """Refused with the config's rules (megalm-train's pre-check runs them before Hydra makes the run dir): it had been
    refused only when the trainer opened its loggers, after the data and the model were built."""
    from megalm.training.validation import validate_run

    monkeypatch.setitem(sys.modules, package, None)  # makes `import wandb` and find_spec fail
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else _find(name, *a))
    with pytest.raises(ConfigError, match=f"pip install {package}"):
        validate_run(compose_config("trainer.max_steps=1", override))


_find = importlib.util.find_spec


def test_an_unused_run_dir_is_removed_once_and_a_used_one_kept(tmp_path):
    """Under torchrun, ranks whose clocks gave them the same Hydra run dir (not rank 0's) each remove it: the
    second finds it gone, which must not fail that rank (it did, as FileNotFoundError, on a loaded machine)."""
    from megalm.training.run_dir import remove_unused_run_dir

    unused = tmp_path / "09-19-27"
    (unused / ".hydra").mkdir(parents=True)
    (unused / "train.log").write_text("")
    remove_unused_run_dir(unused)  # one rank removes it ...
    remove_unused_run_dir(unused)  # ... the other finds it gone
    assert not unused.exists()
    used = tmp_path / "09-19-28"
    (used / "checkpoints").mkdir(parents=True)
    remove_unused_run_dir(used)
    assert (used / "checkpoints").is_dir(), "a run dir with anything of a run in it is kept"


def test_the_last_step_is_evaluated_too(tmp_path):
    """trainer.eval_interval=2 over 3 steps evaluates at steps 2 and 3: the last was not evaluated, and the closing
    line's val loss was step 2's (Megatron-LM evaluates at the end of training; a newcomer's audit)."""
    summary = Trainer(compose_config("trainer.max_steps=3", "trainer.eval_interval=2"), tmp_path).fit()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if "val_loss" in r] == [2, 3]
    assert summary.val_loss == records[-1]["val_loss"]


def test_evaluation_without_a_validation_split_is_said(tmp_path, caplog):
    """data.valid_fraction=0 leaves no validation split: trainer.eval_interval then evaluates nothing, said in one
    line at the start (until 2026-12-04 it was skipped without a word, an audit found)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="megalm"):
        summary = Trainer(compose_config("trainer.max_steps=2", "trainer.eval_interval=1", "data.valid_fraction=0"),
                          tmp_path).fit()
    said = [r.getMessage() for r in caplog.records if "there is no validation split" in r.getMessage()]
    assert len(said) == 1 and summary.val_loss is None, said


def test_evaluation_past_the_end_of_the_validation_split_is_said(tmp_path, caplog):
    """An evaluation that reads more samples than the validation split holds scores some twice: said in one line
    at the start (it was silent until 2026-12-06); one that fits says nothing."""
    import logging

    common = ["trainer.max_steps=1", "trainer.eval_interval=1", "trainer.global_batch_size=4",
              "trainer.micro_batch_size=4", "data.valid_fraction=0.05"]
    for iters in (1, 40):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megalm"):
            trainer = Trainer(compose_config(*common, f"trainer.eval_iters={iters}"), tmp_path / str(iters))
            trainer.fit()
        held = trainer.data.valid.samples_per_epoch
        assert 4 <= held < 160, held  # the first evaluation fits the split, the second does not
        said = [m for m in caplog.messages if "validation samples" in m]
        # the fixes it names fit: eval_iters that read at most the split, a fraction that holds 160 samples (it
        # named the values set until 2026-12-06: "lower trainer.eval_iters=2" where 2 was the value read)
        assert said == ([] if iters == 1 else [
            f"each evaluation reads 160 validation samples, and the split holds {held}: {160 - held} of them score "
            f"samples again; set trainer.eval_iters={held // 4} (now 40) or data.valid_fraction to about "
            f"{0.05 * 160 / held:.2g} or more (now 0.05)"])


def test_generation_samples_a_checkpoint_whose_run_named_a_gpu_attention_backend(tmp_path):
    """A bf16 GPU run may name model.attention_backend=cudnn (or flash_attn, torch_varlen); megalm-generate rebuilt
    the model with it and refused its own fp32 model, naming a fix it has no flag for (an audit, 2026-12-04)."""
    from megalm.generate import load_for_generation, sample

    trainer = Trainer(compose_config("trainer.max_steps=1", "data=demo"), tmp_path)
    path = trainer.save()
    config = path / "config.yaml"
    config.write_text(config.read_text().replace("attention_backend: auto", "attention_backend: cudnn"))
    assert "attention_backend: cudnn" in config.read_text()
    model, tokenizer, stops, start, _ = load_for_generation(str(path))
    assert len(sample(model, tokenizer.encode("def "), 3, temperature=0)) == 3
    assert stops == {tokenizer.eod_id} and start == []  # megalm's documents start after an eod, with no bos


def test_generation_stops_at_an_imported_models_own_eos_ids(tmp_path):
    """An imported chat model ends a turn with its config's eos ids (Llama-3-Instruct's <|eot_id|> beside
    <|end_of_text|>): sampling stopped at the tokenizer's eod only and ran on to --max-new-tokens (an audit)."""
    import json

    from megalm.generate import load_for_generation, sample

    trainer = Trainer(compose_config("trainer.max_steps=1", "data=demo"), tmp_path)
    path = trainer.save()
    model, tokenizer, *_ = load_for_generation(str(path))
    prompt = tokenizer.encode("def ")
    first, *_ = sample(model, prompt, 3, temperature=0)
    state = json.loads((path / "state.json").read_text())
    state["source"] = {"format": "hf", "eos_token_id": [first, 7]}
    (path / "state.json").write_text(json.dumps(state))
    model, tokenizer, stops, *_ = load_for_generation(str(path))
    assert stops == {tokenizer.eod_id, first, 7}
    assert sample(model, prompt, 3, temperature=0, eod_id=stops) == [first]
    assert load_for_generation(str(path), tokenizer="byte").stops == {tokenizer.eod_id}  # another tokenizer: its eod


def test_the_summary_suggests_sampling_only_from_a_run_with_text(tmp_path):
    """It printed a megalm-generate command after a synthetic-data run, which the command refuses (no tokenizer)."""
    synthetic = Trainer(compose_config("trainer.max_steps=1"), tmp_path / "synthetic").fit()
    text = Trainer(compose_config("trainer.max_steps=1", "data=demo"), tmp_path / "demo run").fit()
    assert not any("megalm-generate" in line for line in synthetic.lines(1, 0.0))
    # a run dir with a space is quoted, so the line pastes into a shell (it split at the space until 2026-12-06)
    assert f"sample from it: megalm-generate '{text.checkpoint}' --prompt 'def '" in text.lines(1, 0.0)


def test_a_refused_resume_leaves_the_run_dir_s_record_of_its_command(tmp_path):
    """Continuing a run dir with another model's shapes (or trainer.resume=never) is refused by megalm-train's
    pre-check, before Hydra rewrites the dir's .hydra/ and config.yaml: the trainer refused it too, but only after
    the record of the command that wrote the checkpoints had been replaced by the refused one."""
    import os
    import subprocess

    from tests.conftest import TINY

    run = tmp_path / "run"
    base = [sys.executable, "-m", "megalm.train", *TINY, "trainer.max_steps=1", "optim.warmup_steps=0",
            f"hydra.run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert subprocess.run(base, capture_output=True, text=True, timeout=300, env=env).returncode == 0
    record = {p: p.read_text() for p in (run / ".hydra" / "overrides.yaml", run / "config.yaml")}
    for extra, message in ((["model.hidden_size=128"], "is from another model: hidden_size=64 (this run: 128)"),
                           (["trainer.resume=never"], "already has checkpoints (step_00000001)")):
        proc = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=300, env=env)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
        assert {p: p.read_text() for p in record} == record


def test_the_host_time_making_batches_is_measured_and_said(tmp_path, monkeypatch, caplog):
    """batch_ms and batch_share (TorchTitan's data-loading time): a slow input shows in metrics.jsonl and on the console
    line, measured against a timer of its own around the slow part; a fast one stays off the console line."""
    from megalm.parallel.parallelism import Parallelism

    prepare, spent = Parallelism._prepare, []

    def slow_prepare(self, mb):  # a slow reader: 60 ms a micro-batch, timed here on its own
        began = time.perf_counter()
        time.sleep(0.06)
        prepared = prepare(self, mb)
        spent.append(time.perf_counter() - began)
        return prepared

    overrides = ("trainer.max_steps=3", "trainer.log_interval=1", "trainer.eval_interval=0",
                 "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "model.seq_length=256",
                 "model.num_layers=4", "model.hidden_size=128", "model.ffn_hidden_size=256")  # ~1% making batches
    with caplog.at_level("INFO", logger="megalm"):
        Trainer(compose_config(*overrides), tmp_path / "fast").fit()
    fast = read_metrics(tmp_path / "fast")
    assert all(r["batch_ms"] > 0 and r["batch_share"] < 0.05 for r in fast), fast
    assert "batches" not in caplog.text
    monkeypatch.setattr(Parallelism, "_prepare", slow_prepare)
    caplog.clear()
    with caplog.at_level("INFO", logger="megalm"):
        Trainer(compose_config(*overrides), tmp_path / "slow").fit()
    slow = read_metrics(tmp_path / "slow")
    per_step = [1e3 * (a + b) for a, b in zip(spent[::2], spent[1::2], strict=True)]  # two micro-batches a step
    for record, timed in zip(slow, per_step, strict=True):
        # the rest of making the batches is ~1.5 ms here, a step ~640 ms: 100 ms leaves room for a loaded machine's
        # stalls and none for a step counted in
        assert timed <= record["batch_ms"] <= timed + 100, (record["batch_ms"], timed)
        assert record["batch_share"] > 0.05
    assert "% of the time" in caplog.text and "batches" in caplog.text


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_weight_norm_is_logged_when_asked(tmp_path, precision):
    """`logging.params_norm=true` (Megatron's --log-params-norm): each logged record has the L2 norm of the weights
    the step left, on the console too; the layouts give one process's (tests/dist/equivalence.py compares them)."""
    from megalm.training.metrics import format_line

    run = ["trainer.max_steps=2", f"precision={precision}"]
    trainer = Trainer(compose_config(*run, "logging.params_norm=true"), tmp_path / "on")
    trainer.fit()
    records = read_metrics(tmp_path / "on")
    weights = torch.cat([p.detach().double().reshape(-1) for p in trainer.model.parameters()])
    assert [r["step"] for r in records] == [1, 2] and records[0]["params_norm"] != records[1]["params_norm"]
    assert records[-1]["params_norm"] == pytest.approx(float(weights.norm()), rel=1e-6)
    assert f"| params {records[-1]['params_norm']:.3f} |" in format_line(records[-1], 2)
    Trainer(compose_config(*run), tmp_path / "off").fit()
    assert not any("params_norm" in r for r in read_metrics(tmp_path / "off"))
