"""Fused projections (megalm/model/fused.py): one GEMM for q/k/v and one for gate/up, the same function as the
separate projections they replace, and checkpoints that keep the layout of before the fusion.

`tests/data/pre_fusion_run` is a run dir written by megalm before the fusion (commit 3196704: a one-layer tiny
model with GQA, hidden 32, 4 heads, 2 kv heads, ffn 64, trained 2 steps with the tests' TINY overrides and
trainer.save_interval=2); its checkpoint stores q_proj, k_proj, v_proj, gate_proj and up_proj.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from megalm.config import resolve_model_defaults
from megalm.model.attention import varlen_attention
from megalm.model.fused import fuse_tensors, part_rows, unfuse_tensors
from megalm.model.gpt import GPT, init_weights
from megalm.model.naming import canonical_named_parameters
from megalm.model.rope import apply_rope, rope_cos_sin
from megalm.training.trainer import Trainer
from tests.conftest import compose_config

PRE_FUSION = Path(__file__).resolve().parents[1] / "data" / "pre_fusion_run"
PRE_FUSION_MODEL = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2",
                    "model.ffn_hidden_size=64"]


def test_fused_layers_compute_what_the_separate_projections_do():
    """A block's attention and MLP against q, k, v, gate and up computed one by one from the fused weights' parts
    (fp32, 1e-6)."""
    cfg = resolve_model_defaults(compose_config(*PRE_FUSION_MODEL).model)
    model = GPT(cfg)
    init_weights(model, 3)
    block = model.layers[0]
    tokens, head_dim = 24, cfg.hidden_size // cfg.num_heads
    x = torch.randn(tokens, cfg.hidden_size)
    cu_seqlens = torch.tensor([0, 10, 24], dtype=torch.int32)
    positions = torch.cat([torch.arange(10), torch.arange(14)])
    cos, sin = rope_cos_sin(positions, head_dim, cfg.rope_theta)

    wq, wk, wv = block.attention.qkv_proj.weight.detach().split(part_rows("attention.qkv_proj", cfg))
    q, k, v = (F.linear(x, w).view(tokens, -1, head_dim) for w in (wq, wk, wv))
    attended = varlen_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, cu_seqlens, 14, "reference")
    expected = F.linear(attended.reshape(tokens, -1), block.attention.o_proj.weight)
    got = block.attention(x, cu_seqlens, 14, (cos, sin))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)

    wg, wu = block.mlp.gate_up_proj.weight.detach().split(part_rows("mlp.gate_up_proj", cfg))
    expected = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), block.mlp.down_proj.weight)
    torch.testing.assert_close(block.mlp(x), expected, rtol=1e-6, atol=1e-6)


def test_fuse_and_unfuse_are_inverse_and_init_draws_the_parts_as_before():
    cfg = resolve_model_defaults(compose_config(*PRE_FUSION_MODEL).model)
    model = GPT(cfg)
    init_weights(model, 5)
    weights = {n: p.detach() for n, p in canonical_named_parameters(model)}
    parts = unfuse_tensors(weights, cfg)
    assert {"layers.0.attention.q_proj.weight", "layers.0.mlp.gate_proj.weight"} <= set(parts)
    assert not any("qkv_proj" in n or "gate_up" in n for n in parts)
    fused = fuse_tensors(parts, cfg)
    assert fused.keys() == weights.keys() and all(torch.equal(fused[n], weights[n]) for n in weights)
    # each part is drawn under its unfused name: what the model before the fusion started from
    from megalm.model.gpt import initial_value

    q = initial_value("layers.0.attention.q_proj.weight", (32, 32), cfg, 5)
    assert torch.equal(parts["layers.0.attention.q_proj.weight"], q)


def test_checkpoints_store_the_parts_under_their_unfused_names(tmp_path):
    Trainer(compose_config("trainer.max_steps=1"), tmp_path).fit()
    files = list((tmp_path / "checkpoints" / "step_00000001").glob("shard-*.safetensors"))
    keys = {k for f in files for k in load_file(str(f))}
    assert "model/layers.0.attention.q_proj.weight" in keys and "optim/layers.0.mlp.up_proj.weight::exp_avg" in keys
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in keys)


def test_a_checkpoint_from_before_the_fusion_resumes(tmp_path):
    """Its parts become the fused weights and optimizer moments exactly; the resumed step matches a run of today's
    code that never stopped (the same initial weights and data; only the dgrad GEMMs' summation order differs)."""
    run = tmp_path / "run"
    shutil.copytree(PRE_FUSION, run)
    stored = {k: v for f in (run / "checkpoints" / "step_00000002").glob("shard-*.safetensors")
              for k, v in load_file(str(f)).items()}
    overrides = [*PRE_FUSION_MODEL, "trainer.max_steps=3", "trainer.save_interval=2"]
    resumed = Trainer(compose_config(*overrides, "trainer.resume=auto"), run)
    assert resumed.step == 2
    cfg = resumed.cfg.model
    weights = fuse_tensors({k.removeprefix("model/"): v for k, v in stored.items() if k.startswith("model/")}, cfg)
    moments = fuse_tensors({k.removeprefix("optim/").removesuffix("::exp_avg"): v for k, v in stored.items()
                            if k.endswith("::exp_avg")}, cfg)
    state = resumed.optimizer.state
    for name, p in canonical_named_parameters(resumed.model):
        assert torch.equal(p.detach(), weights[name]), name
        assert torch.equal(state[p]["exp_avg"], moments[name]), name
    loss = resumed.fit().losses[-1][1]
    straight = Trainer(compose_config(*overrides), tmp_path / "straight").fit().losses[-1][1]
    assert abs(loss - straight) <= 1e-5 * abs(straight), (loss, straight)
