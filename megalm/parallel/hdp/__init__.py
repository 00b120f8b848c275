"""ByteScale hybrid data parallelism: planner.py (which ranks run which documents, every step), cost.py
(the cost model and the plan execution model), pipelined.py (plans safe to run as pipelines), split.py
(this rank's micro-batches of a step's plan, in the trainer).

The names below are pure Python (no torch, no numpy), for the planner and tools/hdp_sim.py; import
`megalm.parallel.hdp.split` for the trainer side.
"""

from megalm.parallel.hdp.planner import (
    CostModel,
    MicroBatch,
    Plan,
    SimResult,
    check_plan,
    megatron_cp_size,
    plan_hdp,
    plan_megatron_hybrid,
    plan_static,
    ring_size,
    simulate,
)

__all__ = [
    "CostModel", "MicroBatch", "Plan", "SimResult", "check_plan", "megatron_cp_size", "plan_hdp",
    "plan_megatron_hybrid", "plan_static", "ring_size", "simulate",
]
