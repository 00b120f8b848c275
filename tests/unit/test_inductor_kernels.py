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
