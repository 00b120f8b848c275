"""tools/bench/attention_kernels.py: the shapes it times are the model's, its FLOPs are megalm's MFU formula's
attention term, and on a CPU it times what runs there and names what cannot run."""

from __future__ import annotations

import pytest
import torch

from megalm.config import ModelConfig
from megalm.training.flops import matmul_params, training_flops
from tools.bench import attention_kernels as bench


def _model() -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                       vocab_size=128, seq_length=96)


@pytest.mark.parametrize("ragged", [False, True])
def test_the_operands_are_the_models_attention_shape(ragged: bool):
    model = _model()
    (q, k, v), dout, cu, max_len, lengths = bench.packed_operands(model, 3, ragged, torch.float32,
                                                                 torch.device("cpu"))
    assert q.shape == (3 * 96, 4, 16) and k.shape == v.shape == (3 * 96, 2, 16) and dout.shape == q.shape
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert max_len == max(lengths)
    if ragged:  # each sequence cut in four, so that `cudnn` takes its varlen route
        assert len(lengths) == 12 and len(set(lengths)) > 1
    else:  # one document per sequence: `cudnn`'s batched SDPA call
        assert lengths == [96] * 3


def test_its_flops_are_the_mfu_formulas_attention_term():
    """The attention part of `training_flops` for a 1-layer model: its FLOPs over these documents less its GEMMs'."""
    model, lengths = _model(), [96, 40, 7, 49]
    gemms = 3 * 2.0 * sum(lengths) * matmul_params(model)
    assert bench.attention_tflop(model, lengths) * 1e12 == pytest.approx(training_flops(model, lengths) - gemms,
                                                                         rel=1e-12)


def test_a_model_config_without_kv_heads_is_multi_head():
    """gpt2's configs leave num_kv_heads (and head_dim) to be derived: as many kv heads as query heads."""
    rows = bench.main(["model=gpt2_tiny", "model.seq_length=32", "--backends", "sdpa", "--iters", "1", "--warmup", "0",
                       "--device", "cpu"])
    assert [row["backend"] for row in rows] == ["sdpa"]


def test_on_a_cpu_it_times_what_runs_and_names_what_cannot(capsys):
    rows = bench.main(["model=tiny", "model.seq_length=64", "--backends", "sdpa,reference,cudnn,torch_varlen",
                       "--iters", "2", "--warmup", "0", "--device", "cpu", "--ragged"])
    assert [row["backend"] for row in rows] == ["sdpa", "reference"]
    assert all(row["ms"] > 0 and row["tflops_per_sec"] > 0 and row["kernels"] == [] for row in rows)
    out = capsys.readouterr().out
    assert "cudnn         skipped: model.attention_backend=cudnn needs a CUDA device" in out
    assert "torch_varlen  skipped" in out
