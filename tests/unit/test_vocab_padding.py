"""Vocab padding (Megatron's make_vocab_size_divisible_by x tp): the rule, the init of the real rows, the masked
logits in the loss and in generation, and checkpoints moving between paddings. The layouts (tp2, tp4 against one
unpadded process) are in tests/dist/test_trainer_parallel.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megalm.config import ModelConfig, resolve_model_defaults
from megalm.generate import sample
from megalm.model import GPT, init_weights, initial_value
from megalm.model.loss import token_loss_sum
from megalm.training.checkpoint import latest_checkpoint, load_model_weights
from megalm.training.trainer import Trainer
from megalm.training.validation import validate_run
from tests.conftest import compose_config


@pytest.mark.parametrize(("multiple", "tp", "rows"), [(64, 1, 320), (64, 2, 384), (64, 4, 512), (1, 2, 302),
                                                      (1, 1, 301), (128, 1, 384)])
def test_padded_rows_follow_megatrons_rule(multiple, tp, rows):
    cfg = compose_config("model.vocab_size=301", f"model.make_vocab_size_divisible_by={multiple}",
                         f"parallel.tp={tp}")
    resolved = validate_run(cfg, world_size=tp)
    assert resolved.model.padded_vocab_size == rows
    assert resolved.model.vocab_size == 301
    assert cfg.model.padded_vocab_size is None, "validation resolves a copy: the config passed in is unchanged"


def test_a_saved_padding_is_kept_without_a_layout():
    """megalm-generate rebuilds a saved model without its layout: the saved row count stands."""
    cfg = resolve_model_defaults(ModelConfig(vocab_size=301, make_vocab_size_divisible_by=64, padded_vocab_size=512))
    assert cfg.padded_vocab_size == 512
    assert resolve_model_defaults(ModelConfig(vocab_size=301, make_vocab_size_divisible_by=64)).padded_vocab_size == 320


@pytest.mark.parametrize("name", ["embedding.weight", "output.weight"])
def test_real_rows_do_not_depend_on_the_padding(name):
    cfg = ModelConfig(vocab_size=301, hidden_size=32)
    unpadded = initial_value(name, (301, 32), cfg, seed=5)
    for rows in (320, 512):
        padded = initial_value(name, (rows, 32), cfg, seed=5)
        assert torch.equal(padded[:301], unpadded)
        assert not padded[301:].any()


def _tiny(vocab: int, multiple: int) -> GPT:
    model = GPT(ModelConfig(num_layers=1, hidden_size=32, num_heads=4, vocab_size=vocab,
                            make_vocab_size_divisible_by=multiple, seq_length=16))
    init_weights(model, seed=3)
    return model


def test_padded_logits_get_no_mass_and_no_gradient():
    logits = torch.randn(6, 320, requires_grad=True)
    labels, mask = torch.randint(0, 301, (6,)), torch.ones(6)
    loss = token_loss_sum(logits, labels, mask, vocab_size=301)
    expected = torch.nn.functional.cross_entropy(logits[:, :301].detach(), labels, reduction="sum")
    torch.testing.assert_close(loss.detach(), expected)
    loss.backward()
    assert not logits.grad[:, 301:].any() and logits.grad[:, :301].abs().sum() > 0
    # a huge padding logit would dominate an unmasked softmax: the masked loss does not move
    with torch.no_grad():
        logits[:, 301:] = 1e4
    torch.testing.assert_close(token_loss_sum(logits, labels, mask, vocab_size=301).detach(), expected)


def test_generation_never_samples_a_padding_id():
    model = _tiny(301, 64)
    with torch.no_grad():
        model.output.weight[301:] = 10.0  # padding rows that would win every argmax and most draws
    greedy = sample(model, [1, 2, 3], max_new_tokens=8, temperature=0)
    drawn = sample(model, [1, 2, 3], max_new_tokens=8, temperature=2.0, generator=torch.Generator().manual_seed(0))
    assert max(greedy + drawn) < 301


def test_generation_stays_in_the_tokenizer_vocab_and_takes_a_tiny_temperature():
    """A model of 301 real rows trained with a 257-token tokenizer (the demo: bytes in a model of vocab 320): ids 257
    to 300 decode to nothing, and early in training they were drawn. And a temperature of 1e-40 divided logits into
    inf - inf = NaN probabilities (torch.multinomial raised); it now samples the argmax."""
    model = _tiny(301, 64)
    with torch.no_grad():
        model.output.weight[257:301] = 10.0  # ids past the tokenizer's that would win most draws
    drawn = sample(model, [1, 2, 3], max_new_tokens=8, temperature=2.0, generator=torch.Generator().manual_seed(0),
                   vocab_size=257)
    assert max(drawn) < 257
    greedy = sample(model, [1, 2, 3], max_new_tokens=8, temperature=0, vocab_size=257)
    assert max(greedy) < 257
    assert sample(model, [1, 2, 3], max_new_tokens=8, temperature=1e-40, vocab_size=257) == greedy


def test_checkpoint_loads_into_another_padding(tmp_path):
    """A run padded to 320 rows resumes padded to 304 (weights and Adam moments of the real rows kept) and its
    weights load into an unpadded model."""
    base = ["model.vocab_size=301", "trainer.max_steps=2", "trainer.save_interval=2"]
    first = Trainer(compose_config(*base, "model.make_vocab_size_divisible_by=64"), tmp_path / "run")
    first.fit()
    assert first.model.embedding.weight.shape[0] == 320
    saved = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    moments = first.optimizer.state[first.model.embedding.weight]["exp_avg"].clone()

    unpadded = GPT(dataclasses.replace(first.cfg.model, make_vocab_size_divisible_by=1, padded_vocab_size=None))
    load_model_weights(latest_checkpoint(tmp_path / "run"), unpadded)
    assert unpadded.embedding.weight.shape[0] == 301
    torch.testing.assert_close(unpadded.embedding.weight, saved["embedding.weight"][:301], rtol=0, atol=0)
    torch.testing.assert_close(unpadded.output.weight, saved["output.weight"][:301], rtol=0, atol=0)

    resumed = Trainer(compose_config(*base, "model.make_vocab_size_divisible_by=16", "trainer.max_steps=3"),
                      tmp_path / "run")
    assert resumed.model.embedding.weight.shape[0] == 304 and resumed.step == 2
    torch.testing.assert_close(resumed.model.embedding.weight[:301], saved["embedding.weight"][:301], rtol=0, atol=0)
    assert not resumed.model.embedding.weight[301:].any()
    state = resumed.optimizer.state[resumed.model.embedding.weight]["exp_avg"]
    torch.testing.assert_close(state[:301], moments[:301], rtol=0, atol=0)
    assert not state[301:].any()
