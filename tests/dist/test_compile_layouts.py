"""`trainer.compile=true` under the parallel layouts: each rank's blocks compile without a graph break and without
a recompile per step (dynamo's own counters, on every rank), on documents of equal length. The CP ring (cp2_ring,
and HDP's rings) runs as one opaque custom op (megalm/parallel/context/ring.py), which dynamo does not trace
into; through AOT autograd (what inductor compiles) it trains as the eager ring does."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from megalm import compat
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.launch import run_distributed

EQUAL_DOCS = ["data=synthetic", "data.varlen=true", "data.synthetic.fixed_doc_length=33", "model.seq_length=32",
              "trainer.compile=true", "trainer.compile_backend=eager"]


def compile_and_count(rank: int, world_size: int, overrides: list[str], tmp: str, out: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(compose_config(*EQUAL_DOCS, *overrides), f"{tmp}/run")
    for step in range(4):
        trainer.train_step(step)
    reasons = sorted({" ".join(reason.split())[:600] for reason in counters["graph_break"]})
    torch.save({"breaks": reasons, "frames": counters["frames"]["total"],
                "graphs": counters["stats"]["unique_graphs"]}, f"{out}.{rank}")


LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2", "trainer.micro_batch_size=2"]),
    "dp2": (2, ["parallel.dp=2"]),
    "fsdp2": (2, ["parallel.dp=2", "parallel.fsdp=true"]),
    "cp2_ring": (2, ["parallel.cp=2"]),
    "cp2_a2a": (2, ["parallel.cp=2", "parallel.cp_comm=a2a"]),
    # HDP: 32-token documents packed two per micro-batch (C = 64), no ring; then C = 16, every document a ring
    "hdp2_packed": (2, ["parallel.dp=2", "parallel.hdp=true", "parallel.hdp_capacity=64"]),
    "hdp2_rings": (2, ["parallel.dp=2", "parallel.hdp=true", "parallel.hdp_capacity=16"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_blocks_compile_without_breaks(tmp_path, name):
    world, overrides = LAYOUTS[name]
    run_distributed(compile_and_count, world, overrides, str(tmp_path), str(tmp_path / "counts"), timeout=300)
    for rank in range(world):
        counts = torch.load(tmp_path / f"counts.{rank}")
        assert counts["breaks"] == [], (name, rank, counts)
        assert counts["frames"] <= 2 and counts["graphs"] <= 2, (name, rank, counts)


def compiled_and_eager_losses(rank: int, world_size: int, overrides: list[str], tmp: str, out: str,
                              backend: str = "aot_eager") -> None:
    torch._dynamo.reset()
    plain = [o for o in EQUAL_DOCS if not o.startswith("trainer.compile")]
    eager = Trainer(compose_config(*plain, *overrides, "trainer.compile=false"), f"{tmp}/eager")
    compiled = Trainer(compose_config(*plain, "trainer.compile=true", f"trainer.compile_backend={backend}",
                                      *overrides), f"{tmp}/compiled")
    losses = [(eager.train_step(step).loss, compiled.train_step(step).loss) for step in range(3)]
    local = (lambda t: t.to_local() if hasattr(t, "to_local") else t)  # FSDP's DTensor: this rank's shard
    weights = [(local(p) - local(q)).abs().max().item()
               for p, q in zip(eager.model.parameters(), compiled.model.parameters(), strict=True)]
    torch.save({"losses": losses, "weight_diff": max(weights)}, f"{out}.{rank}")


@pytest.mark.parametrize("name", ["cp2_ring", "fsdp2"])
def test_compiled_layout_trains_as_eager(tmp_path, name):
    """cp2_ring: the ring op's forward and backward under AOT autograd: the same losses and weights as the eager
    ring (fp32). Both run the same op (checked against one process in test_context_parallel); this checks what the
    traced graph hands it and keeps for its backward: a scale off by 0.1% in the traced call only moves a weight by
    5e-4. fsdp2: FSDP2's gathers and reduce-scatters stay in its eager hooks around each compiled block (what
    `trainer.compile=null`, auto, compiles on CUDA)."""
    world, overrides = LAYOUTS[name]
    run_distributed(compiled_and_eager_losses, world, overrides, str(tmp_path), str(tmp_path / "ring"), timeout=300)
    for rank in range(world):
        result = torch.load(tmp_path / f"ring.{rank}")
        for step, (a, b) in enumerate(result["losses"]):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7), (rank, step, result)
        assert result["weight_diff"] < 1e-5, (rank, result)


@pytest.mark.xfail(compat.major_minor(torch.__version__) == (2, 11), strict=True,
                   reason="torch 2.11's inductor trains compiled SP blocks differently from eager (the losses part at "
                          "the second step, with or without regather_in_backward): megalm warns, and auto stays eager")
def test_inductor_under_sequence_parallelism_trains_as_eager(tmp_path, monkeypatch):
    """Under SP, inductor's partitioner re-gathers each column-parallel input in the backward (megalm.training.
    compile.regather_in_backward marks those all-gathers for recomputation) instead of keeping the gathered [T, h]:
    the same losses and weights as eager SP, so the backward's collectives are the eager ones, in the same order
    on every rank. (The bytes it keeps: tests/unit/test_estimate.py.)"""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # each rank builds its kernels in-process: 13 s on 2
    # cores, where inductor's pool of compile workers per rank would crowd the suite's other files
    run_distributed(compiled_and_eager_losses, 2, ["parallel.tp=2", "parallel.sequence_parallel=true"],
                    str(tmp_path), str(tmp_path / "sp"), "inductor", timeout=900)
    for rank in range(2):
        result = torch.load(tmp_path / f"sp.{rank}")
        for step, (a, b) in enumerate(result["losses"]):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7), (rank, step, result)
        # inductor's fused kernels round differently from eager's ops, and AdamW divides by sqrt(v) + eps: a
        # last-bit difference of a near-zero gradient moves a weight by ~1e-5 (measured 1.1e-5 after 3 steps)
        assert result["weight_diff"] < 1e-4, (rank, result)
