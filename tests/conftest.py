"""Shared test helpers: compose a real config from configs/ with overrides, small and fast; gpu tests skip
without CUDA."""

from __future__ import annotations

import pytest
import torch

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
    """A validated-by-schema MegalmConfig from configs/config.yaml and the given overrides."""
    from hydra import compose, initialize_config_dir

    from megalm.config import register_schema, to_dataclass
    from megalm.train import CONFIG_DIR

    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=(TINY if tiny else []) + list(overrides))
    return to_dataclass(cfg)


@pytest.fixture
def make_config():
    return compose_config


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip themselves where no CUDA device is visible, so `pytest -m gpu` on a CPU machine
    reports skips, not failures (the default run deselects them: pyproject.toml's addopts)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device visible (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker itself, not a `gpu` directory in the node id
            item.add_marker(skip)
