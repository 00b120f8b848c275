"""tools/bench/compare.py on the CPU: a row per (framework, shape, seq, precision) that names the kernels it ran,
one FLOP formula for all frameworks, runs alternated A B A B, and a reason for every framework that could not
run. The peers' pinned builds: tests/unit/test_compare_peers.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megalm.config import ModelConfig
from megalm.training.flops import training_flops

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ["megalm", "megatron", "torchtitan"]
SEQS = [32, 64]
REPEATS = 2
PEAK_TFLOPS = 0.5  # a made-up device peak, so that MFU is computed (a CPU has none in flops.py)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("compare") / "compare.json"
    command = [sys.executable, str(ROOT / "tools/bench/compare.py"), "--tiny", "--precisions", "fp32",
               "--seqs", ",".join(map(str, SEQS)), "--steps", "1", "--warmup", "0", "--repeats", str(REPEATS),
               "--tokens-per-step", "128", "--peak-tflops", str(PEAK_TFLOPS), "--frameworks", ",".join(FRAMEWORKS),
               "--profile", "1", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.timeout(120)
def test_a_row_per_framework_shape_seq_precision(report):
    rows = report[0]["rows"]
    keys = [(r["framework"], r["shape"], r["seq"], r["precision"]) for r in rows]
    assert sorted(keys) == sorted((fw, "tiny", seq, "fp32") for fw in FRAMEWORKS for seq in SEQS)
    assert report[0]["complete"]  # rewritten after every cell; true once the last one is in
    for r in rows:
        assert r["status"] in ("ok", "skipped")
        if r["status"] == "skipped":  # a peer that cannot run here says exactly why
            assert r["reason"] and r["tokens_per_sec"] is None


@pytest.mark.timeout(120)
def test_megalm_runs_and_megatron_core_runs_on_cpu(report):
    rows = report[0]["rows"]
    for r in rows:
        if r["framework"] == "megalm":
            assert r["status"] == "ok", r["reason"]
            assert r["tokens_per_sec"] > 0 and r["peak_memory_gib"] > 0
            assert r["tokens_per_step"] == r["batch"] * r["seq"] == 128  # one full document per sample
            assert len(r["tokens_per_sec_per_repeat"]) == REPEATS
    if any(r["framework"] == "megatron" for r in rows) and report[0]["versions"]["megatron-core"]:
        megatron = [r for r in rows if r["framework"] == "megatron"]
        assert all(r["status"] == "ok" for r in megatron), [r["reason"] for r in megatron]


@pytest.mark.timeout(120)
def test_every_row_that_ran_says_where_its_time_went(report):
    """--profile: one more step of each row's last repeat under torch.profiler, summed into the same kinds for every
    framework (on a CPU the aten ops' self time), so that rows compare kind by kind (on a GPU: what TorchTitan's
    step spends less on than megalm's)."""
    ran = [r for r in report[0]["rows"] if r["status"] == "ok"]
    assert ran
    for r in ran:
        profile = r["profile"]
        assert profile["steps"] == 1 and profile["device"] == "cpu", (r["framework"], profile)
        assert profile["by_kind"]["gemm"] > 0 and 0 < profile["busy_ms"] <= 1.05 * profile["wall_ms"], profile
        assert profile["unprofiled_ms"] > 0  # the timed steps of the same repeat, without the profiler
    assert "profile (aten op ms per step" in report[1]


@pytest.mark.timeout(120)
def test_torchtitan_runs_on_cpu_at_its_pin(report):
    """Eager on a CPU (its per-block compile is for CUDA) where the pinned release is installed; else one line."""
    data = report[0]
    titan = [r for r in data["rows"] if r["framework"] == "torchtitan"]
    if data["versions"]["torchtitan"] != data["pins"]["torchtitan"]:
        assert all(r["status"] == "skipped" and "tools/compare_peers.txt pins" in r["reason"] for r in titan)
        pytest.skip(titan[0]["reason"])  # e.g. "torchtitan not installed (tools/compare_peers.txt pins 0.2.2)"
    assert all(r["status"] == "ok" for r in titan), [r["reason"] for r in titan]


@pytest.mark.timeout(120)
def test_every_row_names_its_kernels(report):
    data, stdout = report
    pins = (ROOT / "tools" / "compare_peers.txt").read_text()
    assert all(f"{name}=={pin}" in pins for name, pin in data["pins"].items()) and "torchtitan" in data["pins"]
    assert set(data["versions"]) == {"torch", *data["pins"]}  # the JSON says what ran, each pin included
    for r in data["rows"]:
        assert r["label"]
        if r["framework"] == "megatron":
            assert "custom spec: SDPA core attention" in r["label"]  # not Megatron's own local spec
        if r["status"] != "ok":
            continue
        assert set(r["kernels"]) == {"attention", "gemm", "compile", "loss"} and all(r["kernels"].values())
        for key, what in r["kernels"].items():
            assert f"    {key}: {what}" in stdout.splitlines()
    ran = {r["framework"]: r["kernels"] for r in data["rows"] if r["status"] == "ok"}
    if "megatron" in ran:
        assert "SDPA" in ran["megatron"]["attention"] and "eager" in ran["megatron"]["compile"]
    if "torchtitan" in ran:
        assert "SDPA" in ran["torchtitan"]["attention"] and "eager" in ran["torchtitan"]["compile"]
    assert "sdpa" in ran["megalm"]["attention"]  # megalm's CPU backend (torch_varlen needs CUDA)


@pytest.mark.timeout(120)
def test_one_flop_formula_for_all(report):
    """TFLOP/s and MFU recomputed from the JSON alone: megalm's training_flops of the shape over the step time."""
    ok = [r for r in report[0]["rows"] if r["status"] == "ok"]
    assert ok
    for r in ok:
        model = ModelConfig(**r["model"])
        assert model.hidden_size == 64 and model.num_layers == 2 and model.num_kv_heads == 2  # the --tiny shape
        step_s = r["tokens_per_step"] / r["tokens_per_sec"]
        flops = training_flops(model, [r["seq"]] * r["batch"])
        assert r["tflops_per_sec"] == pytest.approx(flops / step_s / 1e12, rel=1e-9)
        assert r["mfu"] == pytest.approx(flops / step_s / (PEAK_TFLOPS * 1e12), rel=1e-9)


@pytest.mark.timeout(120)
def test_each_run_is_printed_as_it_ends(report):
    """A cell's rows wait for every framework's runs; a call cut inside a cell (gpu_check's time limits) still shows
    the runs it finished: each run's line comes before its cell's rows, with that run's own tokens/s and MFU."""
    data, stdout = report
    lines = stdout.splitlines()
    ok = [r for r in data["rows"] if r["status"] == "ok"]
    assert ok
    for r in ok:
        flops = training_flops(ModelConfig(**r["model"]), [r["seq"]] * r["batch"])
        row_line = next(i for i, line in enumerate(lines)
                        if line.startswith(r["framework"]) and f" {r['seq']} " in line)
        for k, tokens_per_sec in enumerate(r["tokens_per_sec_per_repeat"]):
            prefix = f"  {r['framework']} tiny/{r['seq']} fp32, run {k + 1} of {REPEATS}: "
            at = next(i for i, line in enumerate(lines) if line.startswith(prefix))
            mfu = flops * tokens_per_sec / r["tokens_per_step"] / (PEAK_TFLOPS * 1e12)
            assert f", {tokens_per_sec:,.0f} tokens/s, MFU {mfu:.1%}, " in lines[at], lines[at]
            assert at < row_line


@pytest.mark.timeout(120)
def test_runs_alternate_between_frameworks(report):
    data, _ = report
    for seq in SEQS:
        cell = [o for o in data["run_order"] if o["seq"] == seq]
        ran = [fw for fw in FRAMEWORKS
               if next(r for r in data["rows"] if r["framework"] == fw and r["seq"] == seq)["status"] == "ok"]
        runs = [(o["framework"], o["repeat"]) for o in cell if o["framework"] in ran]
        assert runs == [(fw, k) for k in range(REPEATS) for fw in ran]  # A B A B, never A A B B
    assert data["settings"]["repeats"] == REPEATS


@pytest.mark.timeout(120)
def test_skip_reasons_printed_one_line_each(report):
    data, stdout = report
    for r in data["rows"]:
        if r["status"] == "skipped":
            line = next(line for line in stdout.splitlines() if line.startswith(r["framework"]) and
                        f" {r['seq']} " in line)
            assert line.endswith(f"skipped: {r['reason']}") and "\n" not in r["reason"]


def test_the_compiled_megalm_row_compiles_and_runs_on_cuda_only(monkeypatch):
    """megalm_compiled is megalm's own run with trainer.compile=true (the setting beside TorchTitan's compiled
    blocks), and on a CPU a skip that says why; its kernels entry says what compiled."""
    import torch

    from tests.conftest import compose_config
    from tests.unit.test_compare_peers import compare

    cfg = compose_config()
    assert not cfg.trainer.compile
    with pytest.raises(compare.Skip, match="on CUDA only"):
        compare.run_megalm_compiled(cfg, [], torch.device("cpu"), 0, 1)
    seen = []
    monkeypatch.setattr(compare, "run_megalm", lambda cfg, *args: seen.append(cfg.trainer.compile))
    compare.run_megalm_compiled(cfg, [], torch.device("cuda"), 0, 1)
    assert seen == [True] and compare.RUNNERS["megalm_compiled"] is compare.run_megalm_compiled
    trainer, cpu = SimpleNamespace(precision=SimpleNamespace(note="")), torch.device("cpu")
    assert compare.megalm_kernels(trainer, cfg, 1, cpu)["compile"].startswith("eager")
    compiled = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, compile=True))
    compile_entry = compare.megalm_kernels(trainer, compiled, 1, cpu)["compile"]
    assert compile_entry.startswith("torch.compile per transformer block")


def test_the_torchao_megalm_row_runs_fp8_cells_on_torchao_compiled_on_cuda(monkeypatch):
    """megalm_torchao is megalm's own run with precision.backend=torchao (TorchTitan's FP8 linears in megalm's step),
    compiled per block on CUDA as TorchTitan's are; in a bf16 cell a skip that says it would be the megalm row."""
    import torch

    from tests.conftest import compose_config
    from tests.unit.test_compare_peers import compare

    with pytest.raises(compare.Skip, match="this is the megalm row"):
        compare.run_megalm_torchao(compose_config("precision=bf16"), [], torch.device("cuda"), 0, 1)
    monkeypatch.setattr("megalm.precision.torchao_fp8.torchao_problem", lambda: None)
    seen = []
    monkeypatch.setattr(compare, "run_megalm", lambda cfg, *args: seen.append((cfg.precision.backend,
                                                                                cfg.trainer.compile)))
    for device in ("cuda", "cpu"):
        compare.run_megalm_torchao(compose_config("precision=fp8"), [], torch.device(device), 0, 1)
    assert seen == [("torchao", True), ("torchao", False)]
    assert compare.RUNNERS["megalm_torchao"] is compare.run_megalm_torchao


@pytest.mark.timeout(240)
def test_micro_batches_accumulate_to_the_same_training_in_every_framework(tmp_path):
    """`--micro-batches 2`: each framework's step is two forwards and backwards of half the sequences and one
    optimizer step, which trains as one micro-batch of all of them does (fp32: the same losses and pre-clip gradient
    norms step by step, to summation order), and its FLOPs and tokens are the whole step's. A peer that divided no
    loss by the micro-batch count (its gradient norm doubles), or zeroed its gradients between them, would differ."""
    pytest.importorskip("megatron.core")  # the peer whose loop runs on a CPU
    base = [sys.executable, str(ROOT / "tools/bench/compare.py"), "--tiny", "--precisions", "fp32", "--seqs", "64",
            "--steps", "3", "--warmup", "0", "--repeats", "1", "--tokens-per-step", "256", "--peak-tflops",
            str(PEAK_TFLOPS), "--frameworks", ",".join(FRAMEWORKS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    reports = []
    for n in (1, 2):
        out = tmp_path / f"compare{n}.json"
        proc = subprocess.run([*base, "--micro-batches", str(n), "--json", str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports.append(json.loads(out.read_text()))
    whole, split = reports
    assert split["settings"]["micro_batches"] == 2
    ran = []
    for one, two in zip(whole["rows"], split["rows"], strict=True):
        assert one["framework"] == two["framework"] and one["status"] == two["status"]
        if one["status"] != "ok":
            continue
        ran.append(one["framework"])
        assert (one["batch"], one["micro_batches"], two["batch"], two["micro_batches"]) == (4, 1, 2, 2)
        assert one["tokens_per_step"] == two["tokens_per_step"] == 256
        # one FLOP count for the step, whatever its split
        assert one["tflops_per_sec"] * one["step_seconds"] == pytest.approx(two["tflops_per_sec"] * two["step_seconds"])
        assert len(one["losses"]) == len(two["losses"]) == len(two["grad_norms"]) == 3
        assert two["losses"] == pytest.approx(one["losses"], rel=1e-5), one["framework"]
        assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-4), one["framework"]
        assert one["losses"][2] != pytest.approx(one["losses"][0], rel=1e-5)  # it trains: the check can tell
    assert {"megalm", "megatron"} <= set(ran), ran  # TorchTitan too where its pin is installed


def test_a_step_that_is_no_whole_number_of_micro_batches_is_refused(capsys):
    from tests.unit.test_compare_peers import compare

    with pytest.raises(SystemExit):
        compare.parse_args(["--seqs", "8192", "--micro-batches", "4"])  # 16,384 tokens: 2 sequences, not 4
    assert "pass a multiple of 32768" in capsys.readouterr().err


def test_a_megalm_row_that_raises_fails_the_run_where_a_peer_is_skipped(monkeypatch, tmp_path):
    """A megalm row that raises (not a skip) is "failed" and the exit status is 1, whichever megalm row it is; a peer
    that raises is "skipped" with the error's first line, as a peer that cannot run is a result."""
    from tests.unit.test_compare_peers import compare

    def boom(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("broken\nsecond line")

    monkeypatch.setitem(compare.RUNNERS, "megalm_torchao", boom)
    monkeypatch.setitem(compare.RUNNERS, "megatron", boom)
    args, overrides = compare.parse_args(["--tiny", "--precisions", "fp8", "--seqs", "32", "--repeats", "1",
                                          "--frameworks", "megalm_torchao,megatron"])
    rows = {r.framework: r for r in compare.run_cell(compare.Cell("tiny", 32, "fp8"), args, overrides,
                                                     compare.torch.device("cpu"), [])}
    assert (rows["megalm_torchao"].status, rows["megalm_torchao"].reason) == ("failed", "RuntimeError: broken")
    assert (rows["megatron"].status, rows["megatron"].reason) == ("skipped", "RuntimeError: broken")
    report = {"rows": [dataclasses.asdict(r) for r in rows.values()]}
    assert compare.exit_status(report) == 1
    report["rows"][0].update(status="skipped")  # e.g. megalm_torchao where torchao cannot run: a result
    assert compare.exit_status(report) == 0
