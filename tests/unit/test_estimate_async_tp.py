"""megalm-estimate and async TP (`parallel.async_tp`, megalm/parallel/tensor/async_tp.py): the trace compiles the
blocks with inductor's micro-pipeline pass as a GPU run does and prices the fused collective GEMMs; where it cannot
(blocks priced eager, TP wider than a node) it says so. And the in-flight pricing of TP's eager collectives leaves
compiled graphs whole. Apart from test_estimate.py so that the suite's workers share these compiled traces."""

from __future__ import annotations

import pytest
import torch

from megalm import compat, estimate
from megalm.estimate.collectives import LINKS
from tests.unit.test_estimate import SMALL


def test_async_tp_hides_its_fused_collectives_behind_their_gemms():
    """`parallel.async_tp=true` (megalm/parallel/tensor/async_tp.py) is traced as inductor compiles it: the blocks'
    graphs get torch's fused collective GEMMs, whose bodies (the collective, then the GEMM) the trace prices, and
    each hides all but one chunk's share of the shorter of its transfer and its GEMM. Per block 8 of TP's 10
    collectives are fused, over 2 ranks: at most 8/10 x 1/2 of TP's time hides. The same bytes over TP and the same
    FLOPs as without; without, nothing hides (compiled blocks leave nothing in flight)."""
    if not compat.compiles_over_fake_tensors():
        pytest.skip(f"torch {torch.__version__} cannot compile over the trace's fake tensors (2.11 and later can)")
    base = [*SMALL, "trainer.device=cpu", "trainer.micro_batch_size=1", "trainer.global_batch_size=2",
            "data.varlen=true", "data.synthetic.fixed_doc_length=33", "precision=bf16", "parallel.tp=2",
            "parallel.sequence_parallel=true", "trainer.compile=true"]
    fused, plain = (estimate.estimate([*base, f"parallel.async_tp={flag}"], 2, "h100")
                    for flag in ("true", "false"))
    # whole graphs (documents of equal length): until 2026-12-02 the in-flight pricing's patches broke them at
    # every TP collective of the second micro-batch on, and eager ran what they cut out
    assert not [n for n in fused["notes"] + plain["notes"] if "graph breaks" in n], (fused["notes"], plain["notes"])
    (a,), (b,) = fused["ranks"], plain["ranks"]
    assert a["collective_bytes"] == b["collective_bytes"] and a["flops"] == b["flops"]
    assert b["hidden_comm_s"] == 0
    assert a["comm_s"] + a["hidden_comm_s"] == pytest.approx(b["comm_s"], rel=1e-9)
    tp_s = a["collective_bytes"]["tp"] / LINKS["h100"].nvlink
    assert 0 < a["hidden_comm_s"] <= 0.8 * 0.5 * tp_s
    # the fused ops' bodies against inductor's kernels around the unfused collectives: a few copies apart
    assert a["compute_s"] == pytest.approx(b["compute_s"], rel=0.05)
    assert fused["step_time_s"] < plain["step_time_s"]


@pytest.mark.slow  # 33 s of compiling on 2 cores
def test_pricing_collectives_in_flight_breaks_no_compiled_graph():
    """The estimator's in-flight pricing (`InFlight`) patches TP's `Pending`; a compiled block's trace runs through the
    patches, inside autograd.Functions, whose every closure cell dynamo must wrap. A closure over the InFlight object
    broke the graph at every TP collective once dynamo resumed after the CPU's per-document attention (unequal
    documents: a host read, the one break a CPU trace has by design, since 2026-12-04 at the call into that eager
    loop), and eager ran the rest. Every break is that host read."""
    if not compat.compiles_over_fake_tensors():
        pytest.skip(f"torch {torch.__version__} cannot compile over the trace's fake tensors (2.11 and later can)")
    from torch._dynamo.utils import counters

    counters["graph_break"].clear()
    estimate.estimate([*SMALL, "trainer.device=cpu", "trainer.micro_batch_size=1", "trainer.global_batch_size=2",
                       "precision=bf16", "parallel.tp=2", "parallel.sequence_parallel=true", "trainer.compile=true"],
                      2, "h100")
    from megalm.model.document_sdpa import per_document_sdpa

    reasons = list(counters["graph_break"])
    assert reasons and all(per_document_sdpa.__name__ in reason for reason in reasons), reasons


@pytest.mark.parametrize("overrides, refusal", [
    (["trainer.compile=false"], "parallel.async_tp=true is a pass of inductor's over compiled blocks"),
    (["parallel.sequence_parallel=false"], "parallel.async_tp=true pipelines sequence parallelism's"),
])
def test_async_tp_a_run_refuses_is_refused(overrides, refusal):
    """The trace turned async TP off wherever it could not price it, so the estimator priced configs megalm-train
    refuses (an audit, 2026-12-06): there it says the run's refusal."""
    from megalm.errors import ConfigError

    with pytest.raises(ConfigError, match=refusal):
        estimate.estimate([*SMALL, "trainer.device=cpu", "trainer.micro_batch_size=1", "trainer.global_batch_size=1",
                           "precision=bf16", "parallel.tp=2", "parallel.sequence_parallel=true",
                           "parallel.async_tp=true", *overrides], 2, "h100")


@pytest.mark.parametrize("overrides, why", [
    (["parallel.tp=2"], "the blocks are priced eager"),  # trainer.compile null: priced eager, as the CPU resolves it
    (["parallel.tp=16", "model.num_heads=16", "model.num_kv_heads=16"], "spans nodes"),  # said first, whatever else
])
def test_async_tp_left_out_of_the_trace_says_why(overrides, why):
    """Where the trace cannot price async TP as the GPU run does, it leaves it out and says so, rather than refusing
    a config training takes (null compile on CUDA) or hiding network time a run would not (TP over nodes)."""
    world = 16 if "parallel.tp=16" in overrides else 2
    result = estimate.estimate([*SMALL, "trainer.device=cpu", "trainer.micro_batch_size=1",
                                "trainer.global_batch_size=1", "precision=bf16", "parallel.sequence_parallel=true",
                                "parallel.async_tp=true", *overrides], world, "h100")
    assert [n for n in result["notes"] if n.startswith("parallel.async_tp=true: not priced") and why in n], \
        result["notes"]
