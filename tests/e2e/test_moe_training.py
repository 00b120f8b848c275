"""The MoE demo model learns the demo corpus as the dense demo does, with each balancing method on its own."""

from __future__ import annotations

import pytest

from megalm.training.trainer import Trainer
from tests.conftest import compose_config

METHODS = {"aux_loss": "model.moe.aux_loss_coeff=0.01", "seq_aux_loss": "model.moe.seq_aux_loss_coeff=0.01",
           "z_loss": "model.moe.z_loss_coeff=0.001", "aux_loss_free": "model.moe.bias_update_rate=0.001"}


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_moe_tiny_loss_falls_on_the_demo_corpus(tmp_path, method):
    """30 steps of `model=moe_tiny` on the demo corpus (shorter sequences), only `method` balancing: the loss ends
    at most 0.6 x its first value, the dense demo's bar (tests/e2e/test_demo.py)."""
    off = ["model.moe.aux_loss_coeff=0", "model.moe.z_loss_coeff=0"]
    cfg = compose_config("model=moe_tiny", *off, METHODS[method], "model.seq_length=128", "trainer.max_steps=30",
                         "trainer.log_interval=10", "trainer.eval_interval=0", "logging.tensorboard=false",
                         tiny=False)
    summary = Trainer(cfg, tmp_path).fit()
    assert summary.last_loss <= 0.6 * summary.first_loss, (summary.first_loss, summary.last_loss)
