"""No silent recompiles: every torch.compile in megalm, run over the shapes a training run produces.

dynamo recompiles a function for each new guard failure and, past its recompile limit, silently runs it eager
from then on. megalm compiles FP8's fused casts (`fp8._quantize_fused`, CUDA only in training: the cast, the cast
returning its amax, and amax + scale + cast); they are compiled with dynamic shapes, so the token count of a
micro-batch and the weights' shapes must not add graphs: only their variants do (kind and scale layout x x dtype
x FP8 dtype, at most 7 x 3 x 2 = 42), each compiled once, as a code object of its own, so that dynamo's
recompile limit (8 graphs per code object) is never reached and never raised. Here the CPU runs the same compiled
functions (inductor's C++ backend) in place of the eager casts, through a tiny GPT's forward and backward under
each FP8 recipe, over micro-batches of several token counts, the first as many tokens as the hidden size (duck
sizing would make that equality a guard and recompile on the next count). It runs in a process of its own:
inductor imports triton, after which the Triton interpreter of the MX kernel tests fails. (The loss's chunk kernels,
which trainer.compile compiles, are counted in tests/unit/test_compile_blocks.py.)
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
VARIANTS_BOUND = 42  # fp8._quantize_fused's docstring: (3 + 1 + 3 kinds and layouts) x x dtype (3) x FP8 dtype (2)
RECIPES = ("fp8", "fp8_delayed", "fp8_rowwise")
TOKEN_COUNTS = ((64, 1), (96, 3), (128, 2), (48, 1), (112, 4))  # (tokens, documents) of successive micro-batches


def _step(model, tokens: int, docs: int) -> None:
    lengths = [tokens // docs] * (docs - 1) + [tokens - (tokens // docs) * (docs - 1)]
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,))
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids, pos, cu, max(lengths))
    torch.nn.functional.cross_entropy(logits.float(), ids.roll(-1)).backward()


def measure() -> dict:
    """Graphs compiled after each step, and dynamo's own counters (run in the subprocess)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    from megalm.config import ModelConfig
    from megalm.model.gpt import GPT, init_weights
    from megalm.precision import fp8
    from megalm.precision.install import apply_precision

    fp8.runs_fused = lambda x: True  # the CUDA path, on CPU tensors
    model = GPT(ModelConfig(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                            vocab_size=128, seq_length=128))
    init_weights(model, 0)
    graphs = []
    for recipe in RECIPES:
        apply_precision(model, recipe)
        for tokens, docs in TOKEN_COUNTS:
            _step(model, tokens, docs)
            graphs.append(counters["stats"]["unique_graphs"])
    per_variant = {}  # graphs of each compiled variant (its own code object), from dynamo's cache
    for kind, x_dtype, dtype, layout in itertools.product(("cast", "delayed", "current"),
                                                          (torch.float32, torch.bfloat16, torch.float16),
                                                          (fp8.E4M3, fp8.E5M2), ("tensor", "row", "column")):
        hits = fp8._quantize_fused.cache_info().hits
        compiled = fp8._quantize_fused(kind, x_dtype, dtype, layout)
        if fp8._quantize_fused.cache_info().hits > hits:  # a variant the run compiled
            code = compiled._torchdynamo_orig_callable.__code__
            per_variant[code.co_name] = len(_debug_get_cache_entry_list(code))
    return {"graphs": graphs, "per_variant": per_variant, "limit": torch._dynamo.config.recompile_limit,
            "stats": dict(counters["stats"])}


def test_fp8_fused_cast_compiles_its_variants_only():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    graphs, per_recipe = result["graphs"], len(TOKEN_COUNTS)
    print(f"fp8 fused cast: {graphs[-1]} graphs over {len(graphs)} steps of {len(RECIPES)} recipes")
    for r, recipe in enumerate(RECIPES):  # a recipe's variants appear in its first step; more token counts add none
        steps = graphs[r * per_recipe:(r + 1) * per_recipe]
        assert len(set(steps)) == 1, f"graphs after each step under {recipe}: {steps} (a token count recompiled)"
    assert 0 < graphs[-1] <= VARIANTS_BOUND, graphs
    per_variant = result["per_variant"]
    print(f"graphs per variant: {per_variant}")
    assert sum(per_variant.values()) == graphs[-1], (per_variant, graphs[-1])
    # one graph each: no size met in one call (64 tokens of hidden 64) is specialised and compiled again in the next
    assert set(per_variant.values()) == {1}, f"a variant compiled more than once: {per_variant}"
    assert result["limit"] == 8, "dynamo's default recompile limit: nothing raised it"
    assert not result["stats"].get("recompile_limit_hit"), result["stats"]


if __name__ == "__main__":
    print(json.dumps(measure()))
