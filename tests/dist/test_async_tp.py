"""`parallel.async_tp`: inductor's micro-pipeline pass fuses megalm's compiled SP block's collectives with their
GEMMs, and the fused ops train as the plain compiled block does.

The GPU's parts are stood in for on the CPU, each by torch's own means: the two fused ops get CPU kernels, torch's
fallbacks (the all-gather or reduce-scatter as a functional collective, then the GEMM: the ops' meaning without the
micro-pipelining, which only CUDA symmetric memory runs); the pass's check that NCCL is built in (the CPU wheel has
none) answers true; the TP group's backend check (gloo here) is passed. Symmetric memory is enabled on the gloo group
as on NCCL's. What stays unchecked on a CPU: the CUDA kernels' chunked pipelining itself (torch's tests), and
whether it is faster (one lent GPU runs no TP)."""

from __future__ import annotations

import logging

import pytest
import torch

from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.launch import run_distributed

SP_COMPILED = ["data=synthetic", "data.varlen=true", "data.synthetic.fixed_doc_length=33", "model.seq_length=32",
               "parallel.tp=2", "parallel.sequence_parallel=true", "trainer.compile=true",
               "trainer.compile_backend=inductor"]
FUSED = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")


def stand_in_for_cuda(calls: dict[str, int]) -> None:
    """The module docstring's stand-ins; `calls` counts the fused ops' runs."""
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as symm_mem

    from megalm.parallel.tensor import async_tp

    dist.is_nccl_available = lambda: True
    async_tp.async_tp_problem = lambda group: None
    for name in FUSED:
        fallback = getattr(symm_mem, f"_{name}_fallback")

        def counted(*args, name=name, fallback=fallback, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return fallback(*args, **kwargs)

        torch.library.impl(symm_mem.lib, name, "CPU")(counted)


def fused_in_graphs(graphs: list[list[str]]) -> None:
    """Record, per graph inductor compiles, its call targets after the post-grad passes (the micro-pipeline pass
    included)."""
    import torch._inductor.config as inductor_config

    inductor_config.post_grad_custom_post_pass = lambda graph: graphs.append(
        [str(node.target) for node in graph.nodes if node.op == "call_function"])


def async_and_plain(rank: int, world_size: int, tmp: str, out: str) -> None:
    """3 steps with parallel.async_tp and without from the same seed: losses, the largest weight difference, each
    compiled graph's collectives and fused ops, the fused ops' runs; and the log of async TP on gloo as it is."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("megalm").addHandler(handler)
    Trainer(compose_config(*SP_COMPILED, "parallel.async_tp=true"), f"{tmp}/gloo")  # no stand-ins yet: refused
    refused = [m for m in messages if m.startswith("parallel.async_tp")]

    calls = dict.fromkeys(FUSED, 0)
    stand_in_for_cuda(calls)
    runs = {}
    for name, flag in (("async", "true"), ("plain", "false")):
        torch._dynamo.reset()
        graphs: list[list[str]] = []
        fused_in_graphs(graphs)
        trainer = Trainer(compose_config(*SP_COMPILED, f"parallel.async_tp={flag}"), f"{tmp}/{name}")
        losses = [trainer.train_step(step).loss for step in range(3)]
        block_graphs = [g for g in graphs if any("_c10d_functional" in t or "symm_mem" in t for t in g)]
        runs[name] = {"losses": losses, "model": trainer.model, "calls": dict(calls),
                      "graphs": [{kind: sum(kind in t for t in g) for kind in (*FUSED, "all_gather_into_tensor",
                                                                              "reduce_scatter_tensor")}
                                 for g in block_graphs]}
        calls.update(dict.fromkeys(FUSED, 0))
    weights = max((p - q).abs().max().item() for p, q in zip(runs["async"]["model"].parameters(),
                                                             runs["plain"]["model"].parameters(), strict=True))
    for run in runs.values():
        del run["model"]
    torch.save({"runs": runs, "weight_diff": weights, "refused": refused}, f"{out}.{rank}")


def test_async_tp_fuses_the_sp_blocks_collectives_and_trains_as_without(tmp_path, monkeypatch):
    """Per compiled block, the forward graph has the q/k/v and gate/up all-gathers fused with their GEMMs and the
    o and down reduce-scatters fused with theirs, no collective left apart; the backward graph the o and down input
    gradients' gathers of dy and the q/k/v and gate/up input gradients' reduce-scatters, the two re-gathers of the
    column-parallel inputs for their weight gradients left apart (async_tp.py says why). The fused ops run 8 times
    per block and micro-batch, and the losses and weights are those of the same compiled blocks without the pass.
    On gloo as it is, the run says in one line that async TP is off, and runs."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # as test_compile_layouts: in-process kernel builds
    run_distributed(async_and_plain, 2, str(tmp_path), str(tmp_path / "out"), timeout=900)
    for rank in range(2):
        result = torch.load(tmp_path / f"out.{rank}")
        assert len(result["refused"]) == 1 and "backend is gloo" in result["refused"][0], result["refused"]
        fused, plain = result["runs"]["async"], result["runs"]["plain"]
        forward, backward = fused["graphs"]  # one block graph each way: every block reuses it
        assert forward == {"fused_all_gather_matmul": 2, "fused_matmul_reduce_scatter": 2,
                           "all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}, forward
        assert backward == {"fused_all_gather_matmul": 2, "fused_matmul_reduce_scatter": 2,
                            "all_gather_into_tensor": 2, "reduce_scatter_tensor": 0}, backward
        assert plain["graphs"] == [{"fused_all_gather_matmul": 0, "fused_matmul_reduce_scatter": 0,
                                    "all_gather_into_tensor": 2, "reduce_scatter_tensor": 2},
                                   {"fused_all_gather_matmul": 0, "fused_matmul_reduce_scatter": 0,
                                    "all_gather_into_tensor": 4, "reduce_scatter_tensor": 2}], plain["graphs"]
        blocks_runs = 2 * 3 * 2  # layers x steps x micro-batches (12 samples a step, 6 a micro-batch)
        assert fused["calls"] == dict.fromkeys(FUSED, 4 * blocks_runs), fused["calls"]  # 2 forward, 2 backward
        assert plain["calls"] == dict.fromkeys(FUSED, 0), plain["calls"]
        for step, (a, b) in enumerate(zip(fused["losses"], plain["losses"], strict=True)):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7), (rank, step, fused["losses"], plain["losses"])
        assert result["weight_diff"] < 1e-5, (rank, result["weight_diff"])
