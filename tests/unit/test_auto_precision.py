"""precision=auto (the configs' default): bf16 on CUDA sm80+, fp32 on CPU and older GPUs, resolved into the chosen
recipe's own section before validation. No GPU needed: the capability is passed in, or torch.cuda is patched."""

from __future__ import annotations

import logging

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from megalm.config import config_to_dict, register_schema
from megalm.train import CONFIG_DIR
from megalm.training.device import auto_recipe, resolve_auto_precision
from megalm.training.trainer import Trainer
from megalm.training.validation import validate_run
from tests.conftest import TINY, compose_config


def hydra_config(*overrides: str):
    """The composed Hydra config (what megalm-train resolves and writes to the run dir), not a dataclass."""
    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=[*TINY, *overrides])


def test_the_default_is_auto():
    assert compose_config().precision.name == "auto"


@pytest.mark.parametrize("capability, recipe", [((9, 0), "bf16"), ((8, 0), "bf16"), ((8, 9), "bf16"),
                                                ((7, 5), "fp32"), ((7, 0), "fp32")])
def test_auto_recipe_by_compute_capability(capability, recipe):
    chosen, why = auto_recipe(torch.device("cuda", 0), capability)
    assert chosen == recipe
    assert why.startswith(f"cuda:0 sm{capability[0]}{capability[1]}")
    if recipe == "fp32":
        assert "before sm80" in why, "an old GPU's fp32 says why"


def test_auto_recipe_on_cpu():
    assert auto_recipe("cpu") == ("fp32", "cpu")


def test_cuda_sm90_resolves_to_the_bf16_recipe_and_logs_it(caplog):
    cfg = compose_config()
    with caplog.at_level(logging.INFO, logger="megalm"):
        assert resolve_auto_precision(cfg, torch.device("cuda", 0), capability=(9, 0)) == "bf16"
    assert "precision: auto -> bf16 (cuda:0 sm90)" in caplog.messages
    assert config_to_dict(cfg) == config_to_dict(compose_config("precision=bf16")), "as if precision=bf16 was written"


def test_sm75_resolves_to_fp32_with_the_reason(caplog):
    cfg = compose_config()
    with caplog.at_level(logging.INFO, logger="megalm"):
        assert resolve_auto_precision(cfg, "cuda:1", capability=(7, 5)) == "fp32"
    line = next(m for m in caplog.messages if m.startswith("precision: auto ->"))
    assert line.startswith("precision: auto -> fp32 (cuda:1 sm75: ") and "sm80" in line
    assert config_to_dict(cfg) == config_to_dict(compose_config("precision=fp32"))


def test_cpu_resolves_to_fp32(caplog):
    cfg = compose_config()
    with caplog.at_level(logging.INFO, logger="megalm"):
        assert resolve_auto_precision(cfg, torch.device("cpu")) == "fp32"
    assert "precision: auto -> fp32 (cpu)" in caplog.messages
    assert cfg.precision == compose_config("precision=fp32").precision


def test_capability_is_read_from_the_device(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (9, 0))
    cfg = compose_config()
    assert resolve_auto_precision(cfg, torch.device("cuda", 3)) == "bf16"
    assert asked == [torch.device("cuda", 3)]


@pytest.mark.parametrize("recipe", ["fp32", "bf16", "fp8"])
def test_an_explicit_precision_is_left_alone(recipe, caplog):
    cfg, hydra_cfg = compose_config(f"precision={recipe}"), hydra_config(f"precision={recipe}")
    before, hydra_before = config_to_dict(cfg), OmegaConf.to_yaml(hydra_cfg)
    with caplog.at_level(logging.INFO, logger="megalm"):
        assert resolve_auto_precision(cfg, "cuda:0", capability=(9, 0)) is None
        assert resolve_auto_precision(hydra_cfg, "cpu") is None
    assert config_to_dict(cfg) == before and OmegaConf.to_yaml(hydra_cfg) == hydra_before
    assert not [m for m in caplog.messages if m.startswith("precision:")]


def test_keys_set_under_auto_are_kept():
    cfg = compose_config("precision.tf32=false", "precision.autocast=false")
    resolve_auto_precision(cfg, "cuda:0", capability=(9, 0))
    written = compose_config("precision=bf16", "precision.tf32=false", "precision.autocast=false")
    assert cfg.precision == written.precision


def test_the_hydra_config_becomes_the_recipes_as_written():
    """What megalm-train writes to the run dir: the same YAML as a run given precision=bf16."""
    cfg = hydra_config("precision.tf32=false")
    assert resolve_auto_precision(cfg, "cuda:0", capability=(8, 0)) == "bf16"
    assert OmegaConf.to_yaml(cfg, resolve=True) == OmegaConf.to_yaml(hydra_config("precision=bf16",
                                                                                  "precision.tf32=false"), resolve=True)
    assert OmegaConf.get_type(cfg.precision).__name__ == "PrecisionConfig", "still typed by the schema"


def test_validation_never_sees_auto(monkeypatch):
    assert validate_run(compose_config("trainer.device=cpu")).precision.name == "fp32"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert validate_run(compose_config(), device=torch.device("cuda", 0)).precision.name == "bf16"


def test_a_run_with_auto_saves_and_resumes_the_concrete_recipe(tmp_path):
    first = Trainer(compose_config("trainer.max_steps=2", "trainer.device=cpu"), tmp_path)
    assert first.cfg.precision.name == "fp32" and first.config_dict["precision"]["name"] == "fp32"
    summary = first.fit()
    saved = OmegaConf.load(summary.checkpoint / "config.yaml")
    assert saved.precision.name == "fp32"
    resumed = Trainer(compose_config("trainer.max_steps=3", "trainer.device=cpu"), tmp_path)
    assert resumed.step == 2 and resumed.cfg.precision.name == "fp32"


def test_validation_resolves_a_copy_and_leaves_the_config_as_it_was():
    """validate_run fills derived values (dp, model sizes, the padded vocab, precision=auto) in a copy it returns;
    the config it checked compares equal to its state before (a caller's config is never changed under it)."""
    import copy

    cfg = compose_config("parallel.tp=2", "model.vocab_size=301")
    before = copy.deepcopy(cfg)
    resolved = validate_run(cfg, world_size=4, device=torch.device("cpu"))
    assert cfg == before
    assert resolved.parallel.dp == 2 and resolved.precision.name == "fp32" and resolved.model.padded_vocab_size
    assert (cfg.parallel.dp, cfg.precision.name) == (before.parallel.dp, "auto")
