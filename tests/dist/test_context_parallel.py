"""Context parallelism equals one process (fp32, same seed, same global batch), alone and composed.

Each worker runs the CP trainer, compared with the single-process run of the same model and data (recorded once per file
by rank 0: single_process_reference in tests/dist/equivalence.py). Compared: the gradients
of the first step (every parameter by its full-model name, against its TP shard of the full gradient), the grad norm, 5
optimizer steps of losses (1e-5 relative), the parameters after them and the validation loss.
"""

from __future__ import annotations

import pytest

from megalm.data.dataset import global_batch, micro_batches
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.equivalence import assert_layout_matches, single_process_reference
from tests.dist.launch import run_distributed

STEPS = 5
COMMON = ["trainer.micro_batch_size=2"]


def check_context(rank: int, world_size: int, overrides: list[str], tmp: str, param_atol: float) -> None:
    """`overrides` configure the parallel run; the reference gets those that are not `parallel.*`."""
    same_model_and_data = [o for o in overrides if not o.startswith("parallel.")]
    reference = single_process_reference(rank, same_model_and_data, tmp, STEPS)
    par = Trainer(compose_config(*overrides), f"{tmp}/par")
    cp = par.mesh.dims.cp
    assert cp > 1 and par.parallel.reducer.world == cp * par.mesh.dims.dp

    if par.cfg.data.varlen:  # the case the padding rule is for: documents that do not fill 2·cp chunks
        # the whole global batch: build_datasets reads no parallel.* key, so the layout's data is the one process's
        samples = global_batch(par.data.train, 0, par.cfg.trainer.global_batch_size)
        lengths = [n for mb in micro_batches(samples, par.cfg.trainer.micro_batch_size) for n in mb.doc_lengths]
        assert min(lengths) < 2 * cp and any(n % (2 * cp) for n in lengths), lengths
    assert_layout_matches(reference, par, rank, STEPS, param_atol)


# The ring merges attention blocks by log-sum-exp, so gradients differ from one process by fp32
# rounding (~3e-7 relative, measured) and Adam can amplify that in elements whose gradient is ~eps
# (see assert_same_training): parameters get the pipelines' 1e-3. With documents as samples many
# tokens are rare: an embedding element first gets a gradient of ~1e-8 (= Adam's eps) at step 3,
# where rounding moves its update by ~0.2 lr, so that layout allows one lr-sized step (lr = 3e-3).
PARAM_ATOL, RARE_TOKEN_PARAM_ATOL = 1e-3, 3e-3
LAYOUTS = {
    "cp2_ring": (2, ["parallel.cp=2"]),
    "cp4_ring": (4, ["parallel.cp=4"]),
    "cp2_a2a": (2, ["parallel.cp=2", "parallel.cp_comm=a2a"]),
    # selective recompute keeps the ring's output and runs the all-to-alls again (refused until 2026-12-04)
    "cp2_ring_selective": (2, ["parallel.cp=2", "parallel.recompute=selective"]),
    "cp2_a2a_selective": (2, ["parallel.cp=2", "parallel.cp_comm=a2a", "parallel.recompute=selective"]),
    # hierarchical: two all-to-all groups of 2 ranks, a ring across them per head group
    "cp4_a2a_p2p": (4, ["parallel.cp=4", "parallel.cp_comm=a2a+p2p", "parallel.cp_a2a_size=2"]),
    # documents as samples, many shorter than 2·cp tokens
    "cp2_ring_varlen": (2, ["parallel.cp=2", "data.varlen=true", "data.synthetic.mean_doc_length=12"]),
    # heads split over TP, the ring per head group, SP inside each CP shard (whose 2·c segments are
    # already a multiple of tp = 2; the SP padding of a shard: tests/unit/test_context_parallel.py)
    "cp2_tp2_sp": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "cp2_pp2": (4, ["parallel.cp=2", "parallel.pp=2", "model.num_layers=4"]),
    # gradients summed over dp x cp (checked per parameter), and ZeRO-1 sharded over those 4 ranks
    "cp2_dp2": (4, ["parallel.cp=2", "parallel.dp=2"]),
    "cp2_dp2_zero1": (4, ["parallel.cp=2", "parallel.dp=2", "parallel.zero1=true"]),
    # Ulysses attends whole documents of its heads, within a sliding window (rings refuse one)
    "cp2_a2a_window": (2, ["parallel.cp=2", "parallel.cp_comm=a2a", "model.sliding_window=6"]),
    # a window of the whole sequence holds every document: a ring attends as it does (it had been refused)
    "cp2_ring_whole_window": (2, ["parallel.cp=2", "model.sliding_window=32", "model.seq_length=32"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_matches_single_process(tmp_path, name):
    world, parallel = LAYOUTS[name]
    atol = RARE_TOKEN_PARAM_ATOL if "data.varlen=true" in parallel else PARAM_ATOL
    run_distributed(check_context, world, COMMON + parallel, str(tmp_path), atol, timeout=240)
