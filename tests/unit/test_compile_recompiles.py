"""No silent recompiles: every torch.compile in megalm, run over the shapes a training run produces.

dynamo recompiles a function for each new guard failure and, past its recompile limit, silently runs it eager
from then on. megalm compiles one function, FP8's fused cast (`fp8._quantize_fused`, CUDA only in training); it
is compiled with dynamic shapes, so the token count of a micro-batch and the weights' shapes must not add graphs:
only its variants do (x dtype x FP8 dtype x scale layout, at most 3 x 2 x 3 = 18, under the raised limit of 24).
Here the CPU runs the same compiled function (inductor's C++ backend) in place of the eager cast, through a tiny
GPT's forward and backward under each FP8 recipe, over micro-batches of several token counts.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from megalm.config import ModelConfig
from megalm.model.gpt import GPT, init_weights
from megalm.precision import fp8
from megalm.precision.linear import apply_precision

VARIANTS_BOUND = 18  # fp8._quantize_fused's docstring: x dtype (3) x FP8 dtype (2) x scale layout (3)


def _step(model: GPT, tokens: int, docs: int) -> None:
    lengths = [tokens // docs] * (docs - 1) + [tokens - (tokens // docs) * (docs - 1)]
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,))
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids, pos, cu, max(lengths))
    torch.nn.functional.cross_entropy(logits.float(), ids.roll(-1)).backward()


@pytest.mark.parametrize("recipes", [("fp8", "fp8_delayed", "fp8_rowwise")])
def test_fp8_fused_cast_compiles_its_variants_only(monkeypatch, recipes):
    monkeypatch.setattr(fp8, "quantize", fp8.quantize_compiled)  # the CUDA path, on CPU tensors
    torch._dynamo.reset()
    counters.clear()
    fp8._quantize_fused.cache_clear()
    model = GPT(ModelConfig(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                            vocab_size=128, seq_length=128))
    init_weights(model, 0)
    graphs = []
    for recipe in recipes:
        apply_precision(model, recipe)
        for tokens, docs in ((64, 1), (96, 3), (128, 2), (48, 1), (112, 4)):  # the token counts training varies
            _step(model, tokens, docs)
            graphs.append(counters["stats"]["unique_graphs"])
    first = graphs[len(graphs) // len(recipes) - 1]
    # one recipe's variants appear in its first step; later token counts add none
    assert graphs[0] == first, f"graphs per step under {recipes[0]}: {graphs[:5]} (a token count recompiled)"
    print(f"fp8 fused cast: {graphs[-1]} graphs over {len(graphs)} steps of {len(recipes)} recipes")
    assert 0 < graphs[-1] <= VARIANTS_BOUND, graphs
    limit = torch._dynamo.config.recompile_limit
    assert graphs[-1] <= limit, f"{graphs[-1]} graphs > recompile limit {limit}: dynamo would fall back to eager"
    assert not counters["stats"].get("recompile_limit_hit") and not counters.get("frames", {}).get("fallback"), \
        dict(counters["stats"])
