"""Llama 3.1's RoPE frequency scaling (`model.rope_scaling.type=llama3`, megalm/model/rope.py): the clamped
one-expression form against Meta's three cases written out, and the config's rules. Hugging Face's logits are
checked in tests/unit/test_hf_interop.py."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from megalm.config.schema import ModelConfig, RopeScalingConfig
from megalm.errors import ConfigError
from megalm.model import GPT
from megalm.model.rope import llama3_inv_freq, rope_cos_sin, yarn_attention_factor, yarn_inv_freq
from megalm.training.checkpoint import function_differences


def three_cases(inv_freq: list[float], s: RopeScalingConfig) -> list[float]:
    """Meta's `apply_scaling`, one frequency at a time: kept above the high band, divided below the low one,
    interpolated between."""
    out = []
    for w in inv_freq:
        wavelength = 2 * math.pi / w
        if wavelength < s.original_max_position_embeddings / s.high_freq_factor:
            out.append(w)
        elif wavelength > s.original_max_position_embeddings / s.low_freq_factor:
            out.append(w / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelength - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            out.append((1 - smooth) * w / s.factor + smooth * w)
    return out


@pytest.mark.parametrize("head_dim, theta, scaling", [
    (128, 500000.0, RopeScalingConfig(type="llama3")),  # Llama 3.1 8B
    (64, 500000.0, RopeScalingConfig(type="llama3", factor=32.0)),  # Llama 3.2 1B
    (16, 5000.0, RopeScalingConfig(type="llama3", original_max_position_embeddings=32)),  # every band, small
])
def test_llama3_frequencies_are_meta_s_three_cases(head_dim, theta, scaling):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    expected = torch.tensor(three_cases(inv_freq.tolist(), scaling), dtype=torch.float64)
    torch.testing.assert_close(llama3_inv_freq(inv_freq, scaling), expected, rtol=1e-12, atol=0)
    kept = inv_freq == expected
    assert kept.any() and (expected == inv_freq / scaling.factor).any() and not kept.all()


def test_the_tables_take_the_scaled_frequencies_and_none_leaves_them():
    positions = torch.arange(300)
    plain = rope_cos_sin(positions, 64, 500000.0)
    none = rope_cos_sin(positions, 64, 500000.0, RopeScalingConfig())
    scaling = RopeScalingConfig(type="llama3", original_max_position_embeddings=64)
    scaled = rope_cos_sin(positions, 64, 500000.0, scaling)
    assert all(torch.equal(a, b) for a, b in zip(plain, none, strict=True))
    assert not torch.allclose(plain[0], scaled[0])
    torch.testing.assert_close(plain[0][:, 0], scaled[0][:, 0])  # the fastest frequency is kept


@pytest.mark.parametrize("model, message", [
    (dict(position_embedding="learned", rope_scaling=RopeScalingConfig(type="llama3")),
     "model.position_embedding=learned has none"),
    (dict(rope_scaling=RopeScalingConfig(type="llama3", factor=0.5)), "factor=0.5 must be >= 1"),
    (dict(rope_scaling=RopeScalingConfig(type="llama3", low_freq_factor=4.0)), "must be below high_freq_factor"),
    (dict(rope_scaling=RopeScalingConfig(type="llama3", high_freq_factor=float("nan"))), "finite number > 0"),
    (dict(rope_scaling=RopeScalingConfig(type="llama3", original_max_position_embeddings=0)),
     "original_max_position_embeddings=0 must be a finite number > 0"),
])
def test_a_rope_scaling_that_cannot_run_is_one_line(model, message):
    with pytest.raises(ConfigError, match=message):
        GPT(ModelConfig(**model))


def test_a_factor_without_the_type_is_said_unread(caplog):
    with caplog.at_level(logging.WARNING, logger="megalm"):
        GPT(ModelConfig(rope_scaling=RopeScalingConfig(factor=32.0)))
    assert "factor=32.0 set with model.rope_scaling.type=none: not used" in caplog.text


def test_a_change_of_scaling_is_a_change_of_function_and_an_old_config_has_none():
    """A resume or init_from names a changed scaling (the weights compute another function); a config saved before
    model.rope_scaling existed reads as type none, not as a difference."""
    old = {"rope_theta": 500000.0}
    none = {"rope_theta": 500000.0, "rope_scaling": {"type": "none", "factor": 8.0}}
    llama3 = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8192}}
    assert function_differences(old, none) == []
    assert function_differences(old, llama3)[:2] == ["rope_scaling.type=none (this run: llama3)",
                                                     "rope_scaling.factor=None (this run: 8.0)"]
    assert function_differences(llama3, {**llama3, "rope_scaling": {**llama3["rope_scaling"], "factor": 32.0}}) == [
        "rope_scaling.factor=8.0 (this run: 32.0)"]
    # YaRN's fields, which a llama3 config saved before them lacks, are not llama3's: no difference; YaRN's are
    yarn_fields = {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "truncate": True}
    assert function_differences(llama3, {**llama3, "rope_scaling": {**llama3["rope_scaling"], **yarn_fields}}) == []
    yarn = {"rope_theta": 1e6,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert function_differences(yarn, {**yarn, "rope_scaling": {**yarn["rope_scaling"], **yarn_fields}}) == []
    assert function_differences(yarn, {**yarn, "rope_scaling": {**yarn["rope_scaling"], "beta_fast": 16.0}}) == [
        "rope_scaling.beta_fast=32.0 (this run: 16.0)"]
    # an attention factor named at its default value is the same function as none named
    named = {**yarn["rope_scaling"], "attention_factor": 0.1 * math.log(4.0) + 1}
    assert function_differences(yarn, {**yarn, "rope_scaling": named}) == []
    assert function_differences(yarn, {**yarn, "rope_scaling": {**named, "attention_factor": 1.0}}) == [
        f"rope_scaling.attention_factor={0.1 * math.log(4.0) + 1} (this run: 1.0)"]


def yarn_by_pair(inv_freq: list[float], theta: float, s: RopeScalingConfig) -> list[float]:
    """YaRN's frequencies (Peng et al. 2023, sec. 3.2) one pair at a time: the pair turning r times over the original
    context sits at d(r) = D·ln(L / 2πr) / (2·ln theta); below d(beta_fast) kept, above d(beta_slow) divided by the
    factor, a straight line between."""
    dim, L = 2 * len(inv_freq), s.original_max_position_embeddings
    d = [dim * math.log(L / (r * 2 * math.pi)) / (2 * math.log(theta)) for r in (s.beta_fast, s.beta_slow)]
    if s.truncate:
        d = [math.floor(d[0]), math.ceil(d[1])]
    low, high = max(d[0], 0), min(d[1], dim - 1)
    out = []
    for i, w in enumerate(inv_freq):
        share = 0.0 if i <= low else 1.0 if i >= high else (i - low) / (high - low)  # of the interpolated frequency
        out.append(share * w / s.factor + (1 - share) * w)
    return out


@pytest.mark.parametrize("head_dim, theta, scaling", [
    (128, 1000000.0, RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=32768)),  # Qwen3
    (64, 10000.0, RopeScalingConfig(type="yarn", factor=8.0, original_max_position_embeddings=4096, truncate=False)),
    (16, 5000.0, RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=16.0,
                                   beta_slow=2.0)),
])
def test_yarn_frequencies_are_the_paper_s_ramp(head_dim, theta, scaling):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    expected = torch.tensor(yarn_by_pair(inv_freq.tolist(), theta, scaling), dtype=torch.float64)
    torch.testing.assert_close(yarn_inv_freq(inv_freq, theta, scaling), expected, rtol=1e-12, atol=0)
    assert (expected == inv_freq).any() and (expected == inv_freq / scaling.factor).any()


def test_yarn_scales_both_tables_by_its_attention_factor():
    """cos and sin times 0.1·ln(factor) + 1 (the logits by its square), or the factor a config names."""
    positions = torch.arange(50)
    scaling = RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=32)
    cos, sin = rope_cos_sin(positions, 16, 5000.0, scaling)
    assert yarn_attention_factor(scaling) == pytest.approx(0.1 * math.log(4.0) + 1)
    torch.testing.assert_close(cos[0], torch.full((16,), yarn_attention_factor(scaling)))
    torch.testing.assert_close(cos.square() + sin.square(), torch.full((50, 16), yarn_attention_factor(scaling) ** 2))
    named = RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=32, attention_factor=1.0)
    torch.testing.assert_close(rope_cos_sin(positions, 16, 5000.0, named)[0][0], torch.ones(16))


def test_yarn_rules_and_the_other_type_s_fields(caplog):
    with pytest.raises(ConfigError, match="beta_slow=32.0 must be below beta_fast=32.0"):
        GPT(ModelConfig(rope_scaling=RopeScalingConfig(type="yarn", beta_slow=32.0)))
    with pytest.raises(ConfigError, match="attention_factor=0.0 must be a finite number > 0"):
        GPT(ModelConfig(rope_scaling=RopeScalingConfig(type="yarn", attention_factor=0.0)))
    with caplog.at_level(logging.WARNING, logger="megalm"):
        GPT(ModelConfig(rope_scaling=RopeScalingConfig(type="yarn", low_freq_factor=2.0)))
        GPT(ModelConfig(rope_scaling=RopeScalingConfig(type="llama3", beta_fast=16.0)))
    assert "low_freq_factor=2.0 set with model.rope_scaling.type=yarn: not used" in caplog.text
    assert "beta_fast=16.0 set with model.rope_scaling.type=llama3: not used" in caplog.text
