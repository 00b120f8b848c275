"""precision.backend=te, tested with a stand-in transformer_engine (the real one cannot be built here).

The stand-in's Linear computes exactly what nn.Linear does and refuses to run outside fp8_autocast,
which records the recipe it was given: so these tests check the wiring (which layers are swapped,
that parameters keep their names and initial values, that every forward runs under TE's autocast
with the right recipe, the fallback when TE is missing), not TE's numerics.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types

import pytest
import torch
from torch import nn

from megalm.errors import ConfigError
from megalm.model.linear import Linear
from megalm.parallel.dims import ParallelDims, ParallelMesh
from megalm.precision import transformer_engine_available, transformer_engine_problem
from megalm.precision.te import version_problem
from megalm.training.trainer import Trainer
from megalm.training.validation import validate_run


class _Recipe:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


@pytest.fixture
def fake_te(monkeypatch):
    state = {"active": 0, "recipes": [], "forwards": 0}

    class Linear(nn.Linear):
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
            super().__init__(in_features, out_features, bias=bias, dtype=params_dtype, device=device)

        def forward(self, x):
            assert state["active"], "a TE Linear ran outside fp8_autocast"
            assert x.shape[0] % 16 == 0, f"TE's FP8 GEMMs need tokens % 16 == 0, got {x.shape[0]}"
            state["forwards"] += 1
            return super().forward(x)

    @contextlib.contextmanager
    def fp8_autocast(enabled=False, fp8_recipe=None, fp8_group=None):
        state["recipes"].append(fp8_recipe)
        state.setdefault("groups", []).append(fp8_group)
        state["active"] += 1
        try:
            yield
        finally:
            state["active"] -= 1

    root = types.ModuleType("transformer_engine")
    pytorch = types.ModuleType("transformer_engine.pytorch")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    pytorch.Linear, pytorch.fp8_autocast = Linear, fp8_autocast
    recipe.Format = types.SimpleNamespace(HYBRID="HYBRID", E4M3="E4M3")
    recipe.DelayedScaling = type("DelayedScaling", (_Recipe,), {})
    recipe.Float8CurrentScaling = type("Float8CurrentScaling", (_Recipe,), {})
    root.pytorch, root.common, common.recipe = pytorch, common, recipe
    root.__version__ = "2.8.0+cu128"
    for name, module in (("transformer_engine", root), ("transformer_engine.pytorch", pytorch),
                         ("transformer_engine.common", common), ("transformer_engine.common.recipe", recipe)):
        monkeypatch.setitem(sys.modules, name, module)
    transformer_engine_available.cache_clear()
    transformer_engine_problem.cache_clear()
    monkeypatch.setattr("megalm.precision.te.TE_DEVICES", ("cuda", "cpu"))  # the stand-in runs on CPU
    state["Linear"] = Linear
    yield state
    transformer_engine_available.cache_clear()
    transformer_engine_problem.cache_clear()


def one_process(make_config, tmp_path, name, *overrides):
    return Trainer(make_config(*overrides), tmp_path / name, mesh=ParallelMesh(ParallelDims()))


@pytest.mark.parametrize("recipe, te_class", [("fp8", "Float8CurrentScaling"), ("fp8_delayed", "DelayedScaling")])
def test_te_backend_swaps_linears_and_runs_every_forward_under_its_recipe(fake_te, make_config, tmp_path, recipe,
                                                                          te_class):
    te = one_process(make_config, tmp_path, "te", f"precision={recipe}", "precision.backend=te",
                     "precision.autocast=false")
    swapped = {name for name, m in te.model.named_modules() if isinstance(m, fake_te["Linear"])}
    linears = {name for name, m in te.model.named_modules() if isinstance(m, nn.Linear)}
    assert swapped == linears - {"output"}, "every linear layer but the skipped head runs in TE"
    assert f"transformer_engine {te_class}" in te.precision.note

    ref = one_process(make_config, tmp_path, "ref", "precision=fp32")
    for (name, p), (ref_name, q) in zip(te.model.named_parameters(), ref.model.named_parameters(), strict=True):
        assert name == ref_name and torch.equal(p, q), f"{name}: TE layers must keep the names and initial values"
    # the stand-in computes what nn.Linear does, so the step equals fp32's exactly
    assert te.train_step(0).loss == ref.train_step(0).loss
    assert fake_te["forwards"] > 0 and fake_te["recipes"]
    assert all(type(r).__name__ == te_class and r.kwargs["fp8_format"] == "HYBRID" for r in fake_te["recipes"])
    if recipe == "fp8_delayed":
        assert fake_te["recipes"][0].kwargs["amax_history_len"] == 16


def test_te_backend_reads_skip_as_the_native_path_does(fake_te, make_config, tmp_path):
    """`precision.skip` means the same layers under TE: `{last}` is the model's last block (it had matched nothing)."""
    te = one_process(make_config, tmp_path, "te", "precision=fp8", "precision.backend=te",
                     "precision.skip=[output,'layers.{last}.*']")
    kept = {name for name, m in te.model.named_modules() if type(m) is Linear}
    last = te.cfg.model.num_layers - 1
    assert kept and kept == {"output"} | {n for n in kept if n.startswith(f"layers.{last}.")}, kept
    assert any(n.startswith(f"layers.{last}.") for n in kept)


def test_te_backend_without_te_runs_the_native_path_and_says_so(make_config, tmp_path, caplog):
    transformer_engine_available.cache_clear()
    transformer_engine_problem.cache_clear()
    if transformer_engine_available():
        pytest.skip("transformer_engine is installed here")
    with caplog.at_level(logging.WARNING, logger="megalm"):
        trainer = one_process(make_config, tmp_path, "native", "precision=fp8", "precision.backend=te")
    assert "transformer_engine not importable" in trainer.precision.note
    assert "running the native fp8 path" in caplog.text
    assert not any(type(m).__module__.startswith("transformer_engine") for m in trainer.model.modules())


def test_te_backend_on_cpu_runs_the_native_path(fake_te, make_config, tmp_path, monkeypatch):
    monkeypatch.setattr("megalm.precision.te.TE_DEVICES", ("cuda",))
    trainer = one_process(make_config, tmp_path, "cpu", "precision=fp8", "precision.backend=te")
    assert "no CUDA device" in trainer.precision.note
    assert not any(isinstance(m, fake_te["Linear"]) for m in trainer.model.modules())


def test_te_too_old_for_current_scaling_runs_the_native_path_and_names_the_fix(fake_te, make_config, tmp_path,
                                                                             monkeypatch, caplog):
    monkeypatch.setattr(sys.modules["transformer_engine"], "__version__", "2.1.0")
    with caplog.at_level(logging.WARNING, logger="megalm"):
        trainer = one_process(make_config, tmp_path, "old", "precision=fp8", "precision.backend=te")
    assert not any(isinstance(m, fake_te["Linear"]) for m in trainer.model.modules())
    warning = [r.getMessage() for r in caplog.records if "precision.backend=te" in r.getMessage()]
    assert len(warning) == 1 and "2.1.0 has no Float8CurrentScaling" in warning[0]
    assert "transformer-engine>=2.2" in warning[0] and "running the native fp8 path" in warning[0]
    # DelayedScaling is older than 2.2: the same TE still runs fp8_delayed
    delayed = one_process(make_config, tmp_path, "delayed", "precision=fp8_delayed", "precision.backend=te")
    assert any(isinstance(m, fake_te["Linear"]) for m in delayed.model.modules())


@pytest.mark.parametrize("version, ok", [("2.2.0", True), ("2.10.1+cu12", True), ("3.0", True), ("2.1.0", False),
                                         ("1.13.0", False), ("", False)])
def test_te_version_floor_for_current_scaling(version, ok):
    assert (version_problem("fp8", version) is None) == ok
    assert version_problem("fp8_delayed", version) is None


@pytest.mark.parametrize("overrides, message", [
    (["precision=fp8_rowwise", "precision.backend=te"], "fp8, fp8_delayed"),
    (["precision=fp8", "precision.backend=te", "parallel.recompute=full"], "parallel.recompute=none"),
    (["precision=fp8", "precision.backend=te", "parallel.tp=2"], "parallel.tp=1"),
    # TE reduces amaxes in every micro-batch: ranks running different numbers of them would hang
    (["precision=fp8_delayed", "precision.backend=te", "parallel.hdp=true", "data.varlen=true"],
     "drop parallel.hdp=true"),
    (["precision=fp8", "precision.backend=te", "data.varlen=true", "trainer.tokens_per_step=64"],
     "drop trainer.tokens_per_step"),
])
def test_te_backend_config_rules(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_run(make_config(*overrides), world_size=2)


def test_te_backend_takes_a_per_stage_recompute_list_that_recomputes_nothing(make_config):
    """[none, none] recomputes nothing, as none does: it was refused (an audit, 2026-12-06); [none, full] is not."""
    base = ["precision=fp8", "precision.backend=te", "parallel.pp=2", "model.num_layers=2"]
    validate_run(make_config(*base, "parallel.recompute=[none,none]"), world_size=2)
    with pytest.raises(ConfigError, match="parallel.recompute=none"):
        validate_run(make_config(*base, "parallel.recompute=[none,full]"), world_size=2)


def test_te_reduces_its_amaxes_over_the_ranks_that_split_the_batch(fake_te, make_config, tmp_path, monkeypatch):
    """TE's fp8_autocast gets the parallelism's data x context group as its amax group (Megatron passes its amax
    group): TE's default, the whole world, would mix pipeline stages of other layers. In one process the group is
    None; a converter given a group passes that one."""
    import torch

    from megalm.precision import Precision

    unset = object()  # what a converter's group is until the parallelism sets it (one process's: None)
    original = Precision.__init__

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        self.amax_group = unset

    monkeypatch.setattr(Precision, "__init__", init)
    trainer = one_process(make_config, tmp_path, "one", "precision=fp8_delayed", "precision.backend=te")
    assert trainer.precision.amax_group is trainer.mesh.dp_cp_group is None
    monkeypatch.setattr(Precision, "__init__", original)
    cfg = make_config("precision=fp8_delayed", "precision.backend=te").precision
    converter, group = Precision(cfg, seed=0, device=torch.device("cpu")), object()
    converter.amax_group = group
    with converter.forward_context():
        pass
    assert fake_te["groups"][-1] is group


def test_a_resume_says_te_s_delayed_histories_start_afresh(caplog):
    """TE's amax histories live in its layers' extra state (pickled), which checkpoints do not hold: a resumed TE
    fp8_delayed run restarted them without a word (an audit, 2026-12-06). The native backend restores its own."""
    from dataclasses import asdict
    from pathlib import Path

    from megalm.config.schema import PrecisionConfig
    from megalm.training.checkpoint import note_precision_change

    for backend, said in (("te", 1), ("native", 0)):
        section = {**asdict(PrecisionConfig()), "name": "fp8_delayed", "backend": backend}
        caplog.clear()
        with caplog.at_level("WARNING", logger="megalm"):
            note_precision_change(section, section, Path("ckpt"))
        lines = [r.getMessage() for r in caplog.records if "start afresh" in r.getMessage()]
        assert len(lines) == said, (backend, caplog.messages)
