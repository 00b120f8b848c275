"""ByteScale hybrid data parallelism: plan.py (a plan as data), planner.py (HDP's: which ranks run which documents,
every step; sizing.py its ring sizes), baselines.py (the static mesh and Megatron-LM's hybrid CP, for comparison),
cost.py (the cost model and the plan execution model), pipelined.py (plans safe to run as pipelines), split.py
(this rank's micro-batches of a step's plan, in the trainer).

The names below are pure Python (no torch, no numpy), for the planner and tools/hdp_sim.py; import
`megalm.parallel.hdp.split` for the trainer side.
"""

from megalm.parallel.hdp.baselines import megatron_cp_size, plan_megatron_hybrid, plan_static
from megalm.parallel.hdp.cost import CostModel, SimResult, check_plan, ring_size, simulate
from megalm.parallel.hdp.plan import MicroBatch, Plan, TooFewRanks
from megalm.parallel.hdp.planner import plan_hdp

__all__ = [
    "CostModel", "MicroBatch", "Plan", "SimResult", "TooFewRanks", "check_plan", "megatron_cp_size", "plan_hdp",
    "plan_megatron_hybrid", "plan_static", "ring_size", "simulate",
]
