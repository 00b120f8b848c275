"""model.sliding_window: each token attends to its last `sliding_window` tokens, itself included (Mistral 7B v0.1's
attention, transformers' `q - k < sliding_window`, Megatron's --window-size (w - 1, 0)). Every CPU kernel equals an
attention written out token by token; MFU counts the pairs a window computes; the layouts whose attention cannot
window are refused in one line. (The layouts that train with a window equal one process: tests/dist; Hugging Face
Mistral's logits: tests/unit/test_hf_interop.py; the KV cache: tests/unit/test_kv_cache.py.)"""

from __future__ import annotations

import pytest
import torch

from megalm.config import ModelConfig
from megalm.errors import ConfigError
from megalm.model import attention
from megalm.model.attention import reference_varlen_attention, varlen_attention
from megalm.training.flops import attended_pairs, forward_flops
from tests.conftest import compose_config


def written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                window: int | None) -> torch.Tensor:
    """Attention one query at a time over the keys it may see (the test's oracle)."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        for i in range(start, end):
            first = start if window is None else max(start, i - window + 1)
            keys, values = (t[first:i + 1].repeat_interleave(group, dim=1) for t in (k, v))  # [n, H, D]
            weights = torch.softmax(torch.einsum("hd,nhd->hn", q[i], keys) * q.shape[-1] ** -0.5, dim=-1)
            out[i] = torch.einsum("hn,nhd->hd", weights, values)
    return out


@pytest.mark.parametrize("window", [None, 1, 5, 20, 100])
@pytest.mark.parametrize("documents", [[20, 20], [7, 23, 10], [150, 150], [70, 230, 30]],
                         ids=["equal", "unequal", "equal_blocks", "unequal_blocks"])
def test_every_cpu_kernel_attends_within_the_window(documents, window):
    """sdpa (one batched call on equal documents, one per document otherwise: a band mask, the queries in blocks of
    at least 64 past a window's length, document_sdpa.causal_sdpa) and reference (a block-diagonal band) equal the
    written-out attention, for windows shorter and longer than the documents and the blocks."""
    generator = torch.Generator().manual_seed(0)
    total = sum(documents)
    q, k, v = torch.randn(total, 4, 8, generator=generator), *torch.randn(2, total, 2, 8, generator=generator)
    bounds = [0, *torch.tensor(documents).cumsum(0).tolist()]
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    expected = written_out(q, k, v, bounds, window)
    torch.testing.assert_close(reference_varlen_attention(q, k, v, cu_seqlens, window=window), expected)
    for backend in ("sdpa", "reference"):
        got = varlen_attention(q, k, v, cu_seqlens, max(documents), backend, window=window)
        torch.testing.assert_close(got, expected, msg=backend)
    if window is not None and window < max(documents):  # and the window is not the whole document's attention
        assert not torch.allclose(varlen_attention(q, k, v, cu_seqlens, max(documents), "sdpa"), expected)


def test_windowed_sdpa_holds_no_square_of_the_document():
    """The CPU's windowed attention computes blocks of queries against the keys their window reaches, under one band
    mask they share: over forward and backward of a 2,048-token document with a 32-token window it holds less above
    causal attention's peak than one [S, S] bool mask (4 MiB), where the whole document's band mask and scores held
    19.9 MB more (before 2026-12-07; the live-storage probe)."""
    from megalm.measure import LiveStorages

    length, generator = 2048, torch.Generator().manual_seed(0)
    q = torch.randn(length, 4, 16, generator=generator, requires_grad=True)
    k, v = (torch.randn(length, 2, 16, generator=generator, requires_grad=True) for _ in range(2))
    cu_seqlens = torch.tensor([0, length], dtype=torch.int32)
    peaks = {}
    for window in (None, 32):
        with LiveStorages() as live:
            varlen_attention(q, k, v, cu_seqlens, length, "sdpa", window=window).sum().backward()
        peaks[window] = live.peak("cpu")
    assert peaks[32] - peaks[None] < length * length, peaks


def test_mfu_counts_the_pairs_a_window_computes():
    for length in (1, 4, 5, 6, 50):
        for window in (None, 1, 5, 64):
            assert attended_pairs(length, window) == sum(min(i + 1, window or length) for i in range(length))
    shape = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                 seq_length=64, max_position_embeddings=64)
    whole, windowed = ModelConfig(**shape), ModelConfig(**shape, sliding_window=8)
    hq, layers = 64, 2
    # one 64-token document: 2080 pairs causal, 36 + 56 * 8 = 484 within a window of 8, at 4·h_q FLOPs a layer
    assert forward_flops(whole, [64]) - forward_flops(windowed, [64]) == layers * 4 * hq * (2080 - 484)


@pytest.mark.parametrize(("world", "overrides", "message"), [
    (1, ["model.sliding_window=0"], "model.sliding_window=0 must be a finite number > 0"),
    (2, ["parallel.cp=2"], "model.sliding_window=8 with parallel.cp_comm=ring is not supported"),
    (2, ["parallel.cp=2", "parallel.cp_comm=a2a+p2p", "parallel.cp_a2a_size=2"], "cp_comm=a2a\\+p2p is not supported"),
    (2, ["parallel.hdp=true", "data.varlen=true"], "model.sliding_window=8 with parallel.hdp=true is not supported")])
def test_layouts_whose_attention_cannot_window_are_refused(world, overrides, message):
    from megalm.training.validation import validate_run

    with pytest.raises(ConfigError, match=message) as error:
        validate_run(compose_config("model.sliding_window=8", "trainer.micro_batch_size=2", *overrides), world,
                     torch.device("cpu"))
    assert "\n" not in str(error.value)
    # Ulysses attends whole documents of its heads: it windows
    validate_run(compose_config("model.sliding_window=8", "trainer.micro_batch_size=2", "parallel.cp=2",
                                "parallel.cp_comm=a2a"), 2, torch.device("cpu"))
    # a window of at least the sequence holds every document whole: rings attend as it does (Mistral 7B v0.1's 4,096
    # at a 4,096-token sequence had been refused)
    layout = [o for o in overrides if not o.startswith("model.sliding_window")]
    validate_run(compose_config("model.sliding_window=32", "model.seq_length=32", "trainer.micro_batch_size=2",
                                *layout), world, torch.device("cpu"))


def test_a_varlen_kernel_without_a_window_is_not_chosen_for_one(monkeypatch):
    """torch 2.10's varlen_attn takes no window_size: auto passes over it (and cuDNN's, whose unequal documents run
    it) for a windowed model, and naming it is one line naming the fix."""
    monkeypatch.setattr(attention, "_flash_capable", lambda device, dtype: True)
    monkeypatch.setattr(attention, "_flash_attn_importable", lambda: False)
    monkeypatch.setattr(attention, "_hopper", lambda device: True)
    monkeypatch.setattr(attention.compat, "varlen_attn_available", lambda: True)
    monkeypatch.setattr(attention.compat, "varlen_window_available", lambda: False)
    select = attention.select_attention_backend
    assert select("auto", "cpu", torch.bfloat16) == "cudnn"
    assert select("auto", "cpu", torch.bfloat16, window=True) == "sdpa"
    for backend in ("torch_varlen", "cudnn"):
        with pytest.raises(ConfigError, match=f"attention_backend={backend} with model.sliding_window needs torch >= "
                           "2.11"):
            select(backend, "cpu", torch.bfloat16, window=True)
    monkeypatch.setattr(attention.compat, "varlen_window_available", lambda: True)
    assert select("auto", "cpu", torch.bfloat16, window=True) == "cudnn"


def test_an_export_with_a_window_keeps_it_in_every_layer():
    """A Llama-style model with a window exports as MistralForCausalLM, an MoE one as Mixtral, one with QK-norm or
    q/k/v biases as Qwen3 / Qwen2 with use_sliding_window in every layer (max_window_layers 0): transformers reads
    the window from each config.json megalm writes, and so does megalm's import. GPT-2 has none: refused."""
    import transformers

    from megalm.config import resolve_model_defaults
    from megalm.errors import InteropError
    from megalm.model.hf import architecture_of, hf_config, model_config_from_hf

    def cfg(*overrides: str) -> ModelConfig:
        return resolve_model_defaults(compose_config("model.sliding_window=8", *overrides).model)

    for overrides, arch in (([], "mistral"), (["model=moe_tiny", "model.moe.norm_topk_prob=true"], "mixtral"),
                            (["model.qk_norm=true"], "qwen3"), (["model.qkv_bias=true"], "qwen2")):
        model = cfg(*overrides)
        assert architecture_of(model) == arch
        config = hf_config(model, arch, "float32", None, None)
        theirs = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "model_type"},
                                                   model_type=arch)
        assert theirs.sliding_window == 8 and set(getattr(theirs, "layer_types", None) or ["sliding_attention"]) \
            == {"sliding_attention"}, arch
        assert model_config_from_hf(config, "d")[1].sliding_window == 8, arch
    with pytest.raises(InteropError, match="a sliding window map to Hugging Face with rmsnorm"):
        architecture_of(cfg("model=gpt2_tiny"))


def test_qwen_windows_import_where_every_layer_has_the_one_window():
    """Qwen's use_sliding_window: Qwen3-MoE's window is every layer's (transformers applies it to all), Qwen2's and
    Qwen3's the layers' from max_window_layers on (transformers' default 28: none of a smaller model's). megalm has
    one window for every layer: all or none import, a mix is refused unless the window reaches every position."""
    import transformers

    from megalm.errors import InteropError
    from megalm.model.hf import model_config_from_hf

    base = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
            "use_sliding_window": True, "sliding_window": 16}
    cases = [("qwen3", {}, None), ("qwen3", {"max_window_layers": 0}, 16), ("qwen2", {"max_window_layers": 0}, 16),
             ("qwen3", {"layer_types": ["sliding_attention"] * 4}, 16),
             ("qwen3", {"max_window_layers": 2, "sliding_window": 256}, None),  # reaches every position
             ("qwen3_moe", {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}, 16)]
    for model_type, extra, window in cases:
        config = {**base, "model_type": model_type, **extra}
        theirs = transformers.AutoConfig.for_model(**config)
        sliding = getattr(theirs, "layer_types", None) or ["sliding_attention"] * 4
        assert (theirs.sliding_window is not None and "sliding_attention" in sliding) == (window is not None) or \
            window is None and theirs.sliding_window >= 256, (model_type, extra)
        assert model_config_from_hf(config, "d")[1].sliding_window == window, (model_type, extra)
    with pytest.raises(InteropError, match="some layers' only"):
        model_config_from_hf({**base, "model_type": "qwen3", "max_window_layers": 2}, "d")
