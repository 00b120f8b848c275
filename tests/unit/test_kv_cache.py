"""megalm-generate's KV cache (megalm/model/kv_cache.py): a forward of the tokens after those cached gives the logits
a forward of the whole context gives (fp32), for every kind of attention the model builds, and sampling with it
draws what sampling without it draws, past the model's positions too."""

from __future__ import annotations

import logging

import pytest
import torch

from megalm.config.schema import ModelConfig, MoEConfig
from megalm.generate import _warn_once, sample
from megalm.model import GPT
from megalm.model.gpt import init_weights
from megalm.model.kv_cache import KVCache

SHAPE = dict(vocab_size=300, hidden_size=64, num_layers=3, num_heads=4, ffn_hidden_size=128, seq_length=32,
             max_position_embeddings=48)
MODELS = {
    "llama_gqa": dict(num_kv_heads=2),
    "gpt2": dict(num_kv_heads=4, position_embedding="learned", norm="layernorm", bias=True, activation="gelu",
                 tie_embeddings=True),
    "qk_norm": dict(num_kv_heads=2, qk_norm=True),
    "moe": dict(num_kv_heads=2, moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=64)),
    "window": dict(num_kv_heads=2, sliding_window=5),  # shorter than the prompt's chunks: their keys are masked
}


@pytest.fixture(autouse=True)
def warnings_said_afresh():
    """megalm-generate says each fallback once a process: each test here sees its own."""
    _warn_once.cache_clear()


def model_of(kind: str, **extra) -> GPT:
    model = GPT(ModelConfig(**SHAPE, **{**MODELS[kind], **extra}))
    init_weights(model, 3)
    return model.eval()


def forward(model: GPT, tokens: list[int], first: int = 0, cache: KVCache | None = None) -> torch.Tensor:
    n = len(tokens)
    return model(torch.tensor(tokens), torch.arange(first, first + n), torch.tensor([0, n], dtype=torch.int32), n,
                 context=cache)


@pytest.mark.parametrize("kind", sorted(MODELS))
@torch.no_grad()
def test_cached_forwards_give_the_whole_contexts_logits(kind):
    """The prompt in two chunks (the second attends to the first's cached keys under a causal mask), then one token
    at a time: each forward's logits are those of the same positions in a forward of everything so far."""
    model = model_of(kind)
    ids = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = forward(model, ids)
    cache = KVCache(len(model.layers), 48)
    pieces = [forward(model, ids[:7], 0, cache), forward(model, ids[7:12], 7, cache)]
    pieces += [forward(model, [t], i, cache) for i, t in enumerate(ids[12:], start=12)]
    assert cache.length == 30
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt2", "window"])
def test_sampling_with_the_cache_draws_what_recomputing_draws(kind, caplog):
    """Top-k at a temperature, from one seed, 40 new tokens after 20: past the 48 positions, where the cache stops
    (said once a process, as --num-samples samples again) and each further token is a forward of the newest 48, as
    without it."""
    model = model_of(kind)
    prompt = list(range(5, 25))
    drawn = {}
    with caplog.at_level(logging.INFO, logger="megalm"):
        for cached in (True, True, False):
            drawn[cached] = sample(model, prompt, 40, temperature=1.5, top_k=50, kv_cache=cached,
                                   generator=torch.Generator().manual_seed(1))
    outgrew = [r for r in caplog.records if "outgrew model.max_position_embeddings=48" in r.getMessage()]
    assert len(outgrew) == 1, caplog.text
    assert len(drawn[True]) == 40 and drawn[True] == drawn[False]


@pytest.mark.parametrize("kind, prompt, new, slots", [
    ("llama_gqa", 3, 5, 8),  # 3 + 5 tokens' slots
    ("window", 12, 20, 5)])  # under a window of 5: its ring, however long the sample (Mistral's rolling buffer)
def test_the_cache_holds_what_a_sample_can_feed(monkeypatch, kind, prompt, new, slots):
    """Slots for the prompt and the new tokens, not for every position of the model (an import's 32K or 128K
    positions were GiBs of keys and values a layer on a GPU), and under a sliding window the window's alone; read
    off the cache's own tensors' storages."""
    import megalm.model.kv_cache

    made = []

    class Recorded(KVCache):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(megalm.model.kv_cache, "KVCache", Recorded)
    sample(model_of(kind), list(range(1, prompt + 1)), new, temperature=0)
    (cache,) = made
    for keys in (*cache._keys, *cache._values):
        assert keys.untyped_storage().nbytes() == slots * keys[0].numel() * keys.element_size()
    assert cache.length == prompt + new - 1  # the last token drawn is never fed


def test_a_model_in_training_mode_with_attention_dropout_samples_without_the_cache(caplog):
    """A cached key would keep the dropout drawn when it was made: such a model recomputes, and says so; in
    evaluation mode it samples with the cache."""
    model = model_of("llama_gqa", attention_dropout=0.5).train()
    fed = []
    model.register_forward_pre_hook(lambda module, args: fed.append(args[0].numel()))
    with caplog.at_level(logging.INFO, logger="megalm"):
        sample(model, [1, 2, 3], 3, temperature=0)
        model.eval()
        sample(model, [1, 2, 3], 3, temperature=0)
    assert fed == [3, 4, 5, 3, 1, 1] and "training mode with model.attention_dropout" in caplog.text


def test_sampling_feeds_the_prompt_once_then_one_token_a_forward():
    """What the cache is for: forwards of the prompt, then of one token each, until the positions run out; without
    it every forward is the whole context (a sampler that quietly stopped using its cache fails here)."""
    model = model_of("llama_gqa")
    fed = []
    model.register_forward_pre_hook(lambda module, args: fed.append(args[0].numel()))
    sample(model, list(range(40)), 12, temperature=0)
    assert fed == [40] + [1] * 8 + [48] * 3  # 48 positions: tokens 41 ... 48 cached, then the newest 48 each time
    fed.clear()
    sample(model, list(range(40)), 4, temperature=0, kv_cache=False)
    assert fed == [40, 41, 42, 43]


def test_an_moe_that_drops_tokens_samples_without_the_cache(caplog):
    """An expert's capacity follows the tokens a forward routes (ceil(cf · T · k / E)), so one token a forward
    would route what the whole context drops: such a model recomputes the context, and says so."""
    model = model_of("moe", moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=64, capacity_factor=1.0))
    fed = []
    model.register_forward_pre_hook(lambda module, args: fed.append(args[0].numel()))
    with caplog.at_level(logging.INFO, logger="megalm"):
        sample(model, [1, 2, 3], 3, temperature=0)
    assert fed == [3, 4, 5] and "model.moe.capacity_factor" in caplog.text


def test_a_cache_refuses_what_it_cannot_hold():
    cache = KVCache(1, 4)
    q = torch.zeros(3, 2, 8)
    cache.attend(q, q, q, "sdpa")
    with pytest.raises(ValueError, match="cannot take 3 after 3"):
        cache.attend(q, q, q, "sdpa")
    with pytest.raises(ValueError, match="without dropout: call model.eval"):
        KVCache(1, 4).attend(q, q, q, "sdpa", dropout_p=0.1)
    with pytest.raises(ValueError, match="needs layers and capacity"):
        KVCache(0, 4)
    with pytest.raises(ValueError, match="a prompt of one token or more"):
        sample(model_of("llama_gqa"), [], 1)


@torch.no_grad()
def test_a_windowed_cache_takes_prompts_longer_than_its_blocks():
    """Under a window of 20, a 150-token prompt (attended in blocks of 64 queries, no [150, 150] mask), an 80-token
    chunk after it (the ring's 19 keys read back in order) and single tokens give the whole context's logits."""
    model = GPT(ModelConfig(**{**SHAPE, "num_layers": 2, "seq_length": 300, "max_position_embeddings": 400},
                            num_kv_heads=2, sliding_window=20))
    init_weights(model, 3)
    model.eval()
    ids = torch.randint(0, 300, (260,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = KVCache(len(model.layers), 400)
    pieces = [forward(model, ids[:150], 0, cache), forward(model, ids[150:230], 150, cache)]
    pieces += [forward(model, [t], i, cache) for i, t in enumerate(ids[230:], start=230)]
    assert cache._keys[0].shape[0] == 20
    torch.testing.assert_close(torch.cat(pieces), forward(model, ids), rtol=1e-5, atol=1e-5)
