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
    assert "cudnn                 skipped: model.attention_backend=cudnn needs a CUDA device" in out
    assert "torch_varlen          skipped" in out


def test_the_cudnn_ragged_row_is_skipped_where_cudnn_cannot_run(capsys):
    rows = bench.main(["model=tiny", "model.seq_length=64", "--backends", "sdpa,cudnn_ragged", "--iters", "1",
                       "--warmup", "0", "--device", "cpu", "--ragged"])
    assert [row["backend"] for row in rows] == ["sdpa"]
    assert "cudnn_ragged          skipped: as cudnn would be: model.attention_backend=cudnn needs a CUDA device" in (
        capsys.readouterr().out)


def test_each_row_reports_its_distance_from_the_first(monkeypatch):
    """reference against sdpa agree to fp32 rounding; a kernel off by 1% in its output is seen."""
    rows = bench.main(["model=tiny", "model.seq_length=64", "--backends", "sdpa,reference", "--iters", "1",
                       "--warmup", "0", "--device", "cpu", "--ragged"])
    assert rows[0]["error"] == 0.0 and 0.0 < rows[1]["error"] < 1e-5
    real = bench.run_backend
    monkeypatch.setattr(bench, "run_backend", lambda backend, *args: real(backend, *args) * (
        1.01 if backend == "reference" else 1.0))
    rows = bench.main(["model=tiny", "model.seq_length=64", "--backends", "sdpa,reference", "--iters", "1",
                       "--warmup", "0", "--device", "cpu", "--ragged"])
    assert rows[1]["error"] == pytest.approx(0.01, rel=1e-3)


def test_the_layouts_are_cycled_one_a_call(monkeypatch):
    """--layouts 3: the timed calls go through three document layouts of one token count, in turn."""
    model = _model()
    layouts = [bench.document_lengths(model, 2, True, seed) for seed in range(3)]
    assert len({tuple(lengths) for lengths in layouts}) == 3 and {sum(lengths) for lengths in layouts} == {192}
    seen = []
    real = bench.run_backend
    monkeypatch.setattr(bench, "run_backend", lambda backend, q, k, v, cu, max_len: seen.append(cu.tolist()) or real(
        backend, q, k, v, cu, max_len))
    bench.main(["model=tiny", "model.seq_length=64", "--backends", "sdpa", "--iters", "4", "--warmup", "2",
                "--device", "cpu", "--ragged", "--layouts", "3"])
    first, timed = seen[0], seen[1:]  # the values' call on the first layout, then warmup and timed calls in turn
    assert len(timed) == 6 and timed[:3] != [timed[0]] * 3 and timed[3:] == timed[:3] and first == timed[0]


def test_a_backend_that_fails_leaves_the_other_rows(monkeypatch, capsys):
    real = bench.run_backend

    def failing(backend, *args):
        if backend == "reference":
            raise RuntimeError("cuDNN Frontend error: no execution plan\nmore")
        return real(backend, *args)

    monkeypatch.setattr(bench, "run_backend", failing)
    rows = bench.main(["model=tiny", "model.seq_length=64", "--backends", "reference,sdpa", "--iters", "1",
                       "--warmup", "0", "--device", "cpu"])
    assert [row["backend"] for row in rows] == ["sdpa"] and rows[0]["error"] == 0.0
    assert "reference             failed: cuDNN Frontend error: no execution plan\n" in capsys.readouterr().out


def test_bucketing_keeps_the_documents_and_bounds_the_longest():
    """cudnn_ragged_bucketed's shapes: empty documents pad the count to a multiple of 8 and the bound is a power of
    two at least the longest document; the non-empty documents are the same."""
    for lengths in ([5, 7, 18], [4] * 8, [1], [3000, 1096, 2000, 2096, 100, 92, 3900, 4]):
        cu, max_len, _ = bench.layout(lengths, torch.device("cpu"))
        padded, bound = bench.bucketed(cu, max_len)
        sizes = padded.diff().tolist()
        assert len(sizes) % bench.DOCUMENT_BUCKET == 0 and [n for n in sizes if n] == lengths
        assert bound >= max(lengths) and bound & (bound - 1) == 0 and bound < 2 * max(lengths)


def test_forward_only_times_the_forward_and_counts_its_third_of_the_flops(monkeypatch):
    """--forward-only: no backward runs (the call would fail if it did) and TFLOP/s counts the forward's FLOPs."""
    monkeypatch.setattr(torch.Tensor, "backward", lambda *a, **k: pytest.fail("a backward ran"))
    rows = bench.main(["model=tiny", "model.seq_length=64", "--backends", "sdpa,reference", "--iters", "1",
                       "--warmup", "0", "--device", "cpu", "--ragged", "--forward-only"])
    assert [row["backend"] for row in rows] == ["sdpa", "reference"] and 0.0 < rows[1]["error"] < 1e-5
    model = bench.resolve_model_defaults(bench.compose_config(["model=tiny", "model.seq_length=64"]).model)
    tflop = bench.attention_tflop(model, bench.document_lengths(model, 2, True)) / 3
    for row in rows:
        assert row["tflops_per_sec"] == pytest.approx(tflop / (row["ms"] / 1e3), rel=1e-9)
