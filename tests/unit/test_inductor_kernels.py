"""tools/bench/inductor_kernels.py and the recorder behind it (megalm/measure/compiled_cost.py
`inductor_kernels_recorded`): what inductor generates for a compiled graph, kernel by kernel."""

from __future__ import annotations

import torch

from megalm.measure.compiled_cost import inductor_kernels_recorded
from tools.bench import inductor_kernels


def test_a_known_kernel_is_recorded_with_its_bytes_buffers_and_pass():
    """(x * 2).sum(-1) of [64, 128] fp32: one kernel reading x (32,768 bytes) and writing [64] (256 bytes) forward;
    backward, one reading the [64] gradient and writing x's [64, 128]."""
    graphs: list[dict] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sum(-1)

    torch._dynamo.reset()
    with inductor_kernels_recorded(graphs):
        torch.compile(f)(torch.randn(64, 128, requires_grad=True)).sum().backward()
    assert [g["backward"] for g in graphs] == [False, True]
    forward, backward = (g["kernels"] for g in graphs)
    assert [k["kernel"] for k in forward] == ["generated"]
    assert forward[0]["bytes"] == 64 * 128 * 4 + 64 * 4
    assert [r.split(": ")[1] for r in forward[0]["reads"]] == ["float32[64, 128]"]
    assert [w.split(": ")[1] for w in forward[0]["writes"]] == ["float32[64]"]
    assert {"mul.Tensor", "sum.dim_IntList"} <= set(forward[0]["ops"])
    assert backward[0]["bytes"] == 64 * 4 + 64 * 128 * 4
    assert [w.split(": ")[1] for w in backward[0]["writes"]] == ["float32[64, 128]"]


def _writes(graph: dict, dtype: str) -> list[str]:
    return [w for k in graph["kernels"] if k["kernel"] == "generated" for w in k["writes"] if f": {dtype}[" in w]


def test_the_tool_lists_each_recipes_block_graphs_and_where_fp8_casts_run(capsys):
    """bf16 and fp8_delayed on the tiny model: each recipe's block compiles to forward and backward graphs whose
    GEMMs and attention are extern kernels; only fp8's generated kernels write FP8 (x in e4m3 forward, dy in e5m2
    backward), and its second step's graphs (the history's scales) move fewer bytes than its first (the current
    amax's: a second pass over each cast tensor)."""
    rows = inductor_kernels.main(["--precisions", "bf16", "fp8_delayed", "--steps", "2", "--top", "1"])
    bf16, fp8 = rows
    assert all(not _writes(g, "float8_e4m3fn") and not _writes(g, "float8_e5m2") for g in bf16["graphs"])
    block = [g for g in bf16["graphs"] if any(k["kernel"].startswith("extern") for k in g["kernels"])]
    assert [g["backward"] for g in block] == [False, True], "one block graph each way: the layers share it"
    assert any("mm" in k["kernel"] for k in block[0]["kernels"]), block[0]["kernels"]
    fp8_block = [g for g in fp8["graphs"] if any(k["kernel"].startswith("extern") for k in g["kernels"])]
    assert [g["backward"] for g in fp8_block] == [False, True, False, True], "current amax, then the history's"
    assert all(_writes(g, "float8_e4m3fn") for g in fp8_block if not g["backward"])
    assert all(_writes(g, "float8_e5m2") for g in fp8_block if g["backward"])
    first, delayed = (inductor_kernels.graph_summary(g)["generated_bytes"] for g in fp8_block[0::2])
    assert delayed < first
    out = capsys.readouterr().out
    assert "| fp8_delayed | " in out and "generated kernels that move most" in out


def test_compiled_fp8_backward_casts_each_gradient_once_into_both_layouts(scaled_mm_on_cpu):
    """fp8_delayed's graphs as a GPU from sm89 compiles them (the GEMMs as torch._scaled_mm in the graph): in the
    backward graph of the history's scales, each gradient dy is cast to e5m2 by one kernel that writes both its
    row-major copy (dgrad's) and its column-major copy (wgrad's), where a column-major copy made by a loop over the
    transposed shape was a pass of its own over dy (compiled_linear.graph_column_major); and the fused projections'
    gradients have their per-row amax (the history's) in that kernel too."""
    (fp8,) = inductor_kernels.main(["--precisions", "fp8_delayed", "--steps", "2", "--top", "1"])
    backward = [g for g in fp8["graphs"] if g["backward"] and any(k["kernel"].startswith("extern")
                                                                   for k in g["kernels"])][-1]
    casts = [k for k in backward["kernels"] if k["kernel"] == "generated"
             and any(": float8_e5m2[" in w for w in k["writes"])]
    assert casts, backward["kernels"]
    for kernel in casts:
        copies = [w.split(": ")[1] for w in kernel["writes"] if ": float8_e5m2[" in w]
        assert len(copies) == 2 and copies[0] == copies[1], kernel  # [T, N] twice: row- and column-major strides
    widest = max(casts, key=lambda k: k["bytes"])  # [gate, up]'s gradient: a concatenation, no norm reads it
    tokens = widest["writes"][0].split("[")[1].split(",")[0]
    assert any(w.endswith(f"[{tokens}, 1]") for w in widest["writes"]), widest  # the amax, per row
