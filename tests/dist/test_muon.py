"""optim.name=muon under each layout that keeps fp32 parameters whole per rank equals one process (fp32, same seed):
step 0's gradients and grad norm, 5 optimizer steps of losses, the parameters after them and the validation loss.
TP gathers each shard into the whole matrix (q, k and v split apart under GQA, kv heads replicated when tp exceeds
them), pipeline stages and expert slices orthogonalise what they hold, and the DP, CP and HDP replicas share the
reduced gradients' matrices out. (megalm/parallel/matrices.py; the step itself against torch.optim.Muon:
tests/unit/test_muon.py.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from megalm.parallel.data_parallel.layerwise import LayerwiseOptimizer
from megalm.parallel.matrices import iteration_flops
from megalm.training.checkpoint.tensors import optimizer_tensors
from megalm.training.muon import Muon
from megalm.training.optim import current_weights
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.equivalence import assert_layout_matches, assert_resume_is_bit_exact, single_process_reference
from tests.dist.launch import run_distributed

STEPS = 5
# Muon moves every element of a matrix each step (no Adam denominator to blow fp32 rounding up): the layouts keep
# to 1e-5 of one process's weights
PARAM_ATOL = 1e-5
COMMON = ["optim.name=muon", "trainer.micro_batch_size=2"]
LAYOUTS = {
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp4_kv_replicated": (4, ["parallel.tp=4"]),  # 2 kv heads over 4 TP ranks: each k/v slice held twice
    "dp2": (2, ["parallel.dp=2"]),
    "pp2": (2, ["parallel.pp=2", "model.num_layers=4"]),
    "cp2": (2, ["parallel.cp=2"]),
    "moe_ep2": (2, ["model=moe_tiny", "parallel.dp=2", "parallel.ep=2"]),
    "moe_tp2_sp_ep2_pp2": (8, ["model=moe_tiny", "model.num_layers=4", "parallel.tp=2",
                               "parallel.sequence_parallel=true", "parallel.dp=2", "parallel.ep=2", "parallel.pp=2"]),
    "hdp_dp2": (2, ["parallel.hdp=true", "parallel.dp=2", "data.varlen=true", "trainer.micro_batch_size=1"]),
    # ZeRO-1 by whole parameters (megalm/parallel/data_parallel/layerwise.py): each replica steps its own and
    # broadcasts them; TP groups gather the matrices their replica owns; the expert slices have replicas of their own
    "dp2_zero1": (2, ["parallel.dp=2", "parallel.zero1=true"]),
    "moe_tp2_sp_dp2_zero1": (4, ["model=moe_tiny", "parallel.tp=2", "parallel.sequence_parallel=true",
                                 "parallel.dp=2", "parallel.zero1=true"]),
    # each stage's copy of the tied embedding has an owner of its own; the expert slices' replicas (dp4 ep2: 2) are
    # not the dense parameters' (4); the CP ranks are replicas too
    "pp2_tied_dp2_zero1": (4, ["parallel.pp=2", "model.num_layers=4", "model.tie_embeddings=true", "parallel.dp=2",
                               "parallel.zero1=true"]),
    "moe_dp4_ep2_zero1": (4, ["model=moe_tiny", "parallel.dp=4", "parallel.ep=2", "parallel.zero1=true"]),
    "cp2_dp2_zero1": (4, ["parallel.cp=2", "parallel.dp=2", "parallel.zero1=true"]),
}


def check_muon(rank: int, world_size: int, overrides: list[str], tmp: str) -> None:
    reference = single_process_reference(rank, [o for o in overrides if not o.startswith("parallel.")], tmp, STEPS)
    par = Trainer(compose_config(*overrides), f"{tmp}/par")
    assert isinstance(par.optimizer, LayerwiseOptimizer if "parallel.zero1=true" in overrides else Muon)
    assert_layout_matches(reference, par, rank, STEPS, PARAM_ATOL)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_under_a_layout_matches_one_process(tmp_path, name):
    world, parallel = LAYOUTS[name]
    run_distributed(check_muon, world, [*COMMON, *parallel], str(tmp_path), timeout=300)


def count_orthogonalised(rank: int, world_size: int, overrides: list[str], out: str) -> None:
    """One step under `overrides`; each rank writes the matrices it orthogonalised (by shape) to `out`.rank."""
    import json
    from pathlib import Path

    import megalm.training.muon as muon

    done = []
    orthogonalise = muon.orthogonalise

    def counted(matrix, steps, eps=1e-7):
        done.append(list(matrix.shape))
        return orthogonalise(matrix, steps, eps)

    muon.orthogonalise = counted
    trainer = Trainer(compose_config(*overrides), f"{out}.run")
    trainer.train_step(0)
    Path(f"{out}.rank{rank}").write_text(json.dumps({"dp": trainer.mesh.dp_rank, "tp": trainer.mesh.tp_rank,
                                                     "done": done, "matrices": len(trainer.optimizer.matrices)}))


def test_the_data_parallel_ranks_share_the_iterations_out(tmp_path):
    """Each matrix is orthogonalised by one data-parallel replica (both ranks of its TP group, which gathers it), not
    by all of them: over dp = 2 the replicas split the model's matrices, each once, the costliest first to the least
    loaded (their work, Σ rows·cols·min(rows, cols), within one parameter's of each other). The layouts' updates are
    still one process's (above)."""
    import json

    overrides = [*COMMON, "model.num_layers=4"]
    run_distributed(count_orthogonalised, 4, [*overrides, "parallel.tp=2", "parallel.dp=2"], str(tmp_path / "c"),
                    timeout=300)
    ranks = [json.loads((tmp_path / f"c.rank{r}").read_text()) for r in range(4)]
    by_replica: dict[int, list] = {}
    for r in ranks:
        by_replica.setdefault(r["dp"], []).append(sorted(map(tuple, r["done"])))
    assert all(a == b for a, b in by_replica.values()), "the TP ranks of a replica orthogonalise the same matrices"
    shares = [done[0] for done in by_replica.values()]
    one = Trainer(compose_config(*overrides), tmp_path / "one")
    one.train_step(0)  # (counted by the same wrapper: the one process orthogonalises every matrix)
    whole = sorted(tuple(m.shape) for layout in one.optimizer.matrices.values() for m in layout.split(
        torch.empty(layout.full_shape, device="meta")))
    assert sorted(shares[0] + shares[1]) == whole and all(shares)

    def work(done):
        return sum(iteration_flops(rows, cols) for rows, cols in done)

    largest = max(layout.cost for layout in one.optimizer.matrices.values())
    assert abs(work(shares[0]) - work(shares[1])) <= largest


def check_layerwise_is_plain_dp(rank: int, world_size: int, tmp: str) -> None:
    """bf16 weights at dp = 2: ZeRO-1 by whole matrices against plain data parallelism, bit for bit (the owner of
    each piece steps it as every replica would), and the optimizer's storages, measured as it is built, split
    between the replicas: together they are plain DP's, each within one piece's state of half."""
    from megalm.measure.storage import LiveStorages
    from megalm.model.naming import canonical_named_parameters
    from megalm.training.optim import build_optimizer, full_precision_weights

    base = ["optim.name=muon", "precision=bf16", "parallel.dp=2", "model=moe_tiny"]
    plain = Trainer(compose_config(*base), f"{tmp}/plain")
    layerwise = Trainer(compose_config(*base, "parallel.zero1=true"), f"{tmp}/layerwise")
    assert isinstance(layerwise.optimizer, LayerwiseOptimizer) and "zero1 (layer-wise)" in layerwise.parallel.describe()
    owned = {id(p) for p in layerwise.optimizer.owned}
    assert 0 < len(owned) < len(list(layerwise.model.parameters())), f"rank {rank} owns {len(owned)} parameters"
    for step in range(3):
        a, b = plain.train_step(step), layerwise.train_step(step)
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm), f"rank {rank} step {step}: {b} vs {a}"
    pairs = list(zip(canonical_named_parameters(plain.model), canonical_named_parameters(layerwise.model),
                     strict=True))
    current_weights(layerwise.optimizer)  # the last step's broadcasts are in flight (parallel.overlap_param_gather)
    for (name, p), (_, q) in pairs:
        assert torch.equal(p, q), f"rank {rank}: working weight {name}"
    with full_precision_weights(plain.optimizer), full_precision_weights(layerwise.optimizer):
        for (name, p), (_, q) in pairs:
            assert p.dtype == q.dtype == torch.float32 and torch.equal(p, q), f"rank {rank}: main weight {name}"
    measured = {}
    for name, run in (("plain", plain), ("layerwise", layerwise)):
        with LiveStorages() as live:
            optimizer = build_optimizer(run.model, run.cfg.optim, run.parallel)
        measured[name] = live.bytes()
        del optimizer
    together = torch.tensor([measured["layerwise"]], dtype=torch.float64)
    torch.distributed.all_reduce(together)
    assert together.item() == measured["plain"], (rank, measured, together.item())  # each parameter's state once
    # within one piece's state of half: a whole matrix, or half an AdamW parameter's rows (each replica steps a block
    # of the embedding's and of the output layer's: whole, they had landed on one replica each)
    model = layerwise.model
    for vocab in (model.embedding.weight, model.output.weight):
        assert sum(piece.rows is not None for piece in layerwise.optimizer.owned if piece.param is vocab) == 1, rank
    largest = max(12 * p.numel() // (1 if p.ndim < 2 or id(p) in layerwise.optimizer.matrix_ids else 2)
                  for p in model.parameters())
    assert measured["layerwise"] <= measured["plain"] / 2 + largest, (rank, measured)


def test_zero1_by_whole_parameters_is_plain_dp_bit_for_bit_in_half_the_state(tmp_path):
    run_distributed(check_layerwise_is_plain_dp, 2, str(tmp_path), timeout=300)


def check_layerwise_overlap(rank: int, world_size: int, tmp: str) -> None:
    """The weights' broadcasts left in flight after a step (parallel.overlap_param_gather, the default) against
    waiting for them in the step, bit for bit; issued in forward order, each waited for by the first module that
    reads it: when step 1's first block begins, its own weights have landed and the head's (the final norm, the
    output layer) are still in flight."""
    from megalm.model.naming import model_chunks

    base = ["optim.name=muon", "precision=bf16", "parallel.dp=2", "parallel.zero1=true"]
    waiting = Trainer(compose_config(*base, "parallel.overlap_param_gather=false"), f"{tmp}/waiting")
    overlapped = Trainer(compose_config(*base), f"{tmp}/overlapped")
    optimizer, model = overlapped.optimizer, model_chunks(overlapped.model)[0]
    assert optimizer.overlaps_param_gather and not waiting.optimizer.overlaps_param_gather
    sent = set(optimizer._sent(model.parameters()))
    head, block = (set(optimizer._sent(params)) for params in (
        [*model.final_norm.parameters(), *model.output.parameters()], list(model.layers[0].parameters())))
    assert head and block, rank
    pending: list[set[int]] = []  # registered after the optimizer's hooks: what the block's own wait left
    model.layers[0].register_forward_pre_hook(lambda *_: pending.append(set(optimizer._pending)))
    for step in range(3):
        a, b = waiting.train_step(step), overlapped.train_step(step)
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm), f"rank {rank} step {step}: {b} vs {a}"
    assert pending[0] == set() and head <= pending[1] and not block & pending[1], (rank, pending[1])
    assert optimizer._pending.keys() == sent  # the last step's, until something reads the weights
    current_weights(optimizer)
    for p, q in zip(waiting.model.parameters(), overlapped.model.parameters(), strict=True):
        assert torch.equal(p, q), rank


def test_zero1_by_whole_parameters_overlaps_its_broadcasts_with_the_next_forward(tmp_path):
    run_distributed(check_layerwise_overlap, 2, str(tmp_path), timeout=120)


def test_zero1_by_whole_parameters_resumes_bit_exact_and_its_state_loads_in_one_process(tmp_path):
    """The checkpoint holds each parameter's state whole (its owner's, broadcast: torch's format): the run resumes
    exactly, and one process on fp32 weights takes every matrix's momentum from it."""
    layout = ["optim.name=muon", "precision=bf16", "parallel.dp=2", "parallel.zero1=true", "model=moe_tiny",
              "trainer.max_steps=4"]
    assert_resume_is_bit_exact(tmp_path, 2, layout, stop_at=2)
    run_distributed(save_loaded_state, 2, layout, str(tmp_path / "stopped"), str(tmp_path / "state.safetensors"),
                    timeout=120)
    one = Trainer(compose_config("optim.name=muon", "model=moe_tiny", "trainer.max_steps=6"), tmp_path / "stopped")
    assert one.step == 4 and isinstance(one.optimizer, Muon)
    theirs, _ = optimizer_tensors(one.model, one.optimizer)
    ours = load_file(tmp_path / "state.safetensors")
    assert ours.keys() == theirs.keys() and any(k.endswith("::momentum_buffer") for k in ours)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value.reshape(ours[key].shape)), key


def save_loaded_state(rank: int, world_size: int, overrides: list[str], run_dir: str, out: str) -> None:
    """The optimizer state the layout loaded from `run_dir`'s last checkpoint, as the checkpoints flatten it (every
    parameter's, from its owner); rank 0 writes it to `out`."""
    trainer = Trainer(compose_config(*overrides), run_dir)
    assert isinstance(trainer.optimizer, LayerwiseOptimizer) and trainer.step == 4
    tensors, _ = optimizer_tensors(trainer.model, trainer.optimizer)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in tensors.items()}, out)
