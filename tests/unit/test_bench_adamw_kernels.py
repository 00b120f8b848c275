"""tools/bench/adamw_kernels.py: it steps the model's own parameters (their shapes, on the meta device), times the
path `optim.implementation=auto` runs, and names the kernel it cannot run instead of timing something else."""

from __future__ import annotations

from megalm.parallel.data_parallel import adamw_kernel
from tests.conftest import TINY, compose_config
from tools.bench import adamw_kernels as bench


def test_it_steps_the_models_parameters_and_says_what_it_cannot_run(monkeypatch, capsys):
    from megalm.config.checks import resolve_model_defaults
    from megalm.model.gpt import GPT

    overrides = [o for o in TINY if o.startswith("model.")]
    model = GPT(resolve_model_defaults(compose_config(*overrides).model))
    assert bench.segments(overrides) == [p.numel() for p in model.parameters()]
    monkeypatch.setattr(adamw_kernel, "runnable", lambda device: False)
    report = bench.main([*overrides, "--iters", "1", "--warmup", "0"])
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    assert report["rows"]["torch"]["ms"] > 0
    assert "cannot run on cpu" in report["rows"]["triton"]["skipped"]
    assert "triton  skipped" in capsys.readouterr().out
