"""Pipeline parallelism equals one process (fp32, same seed, same global batch), for every schedule.

Each worker runs the pipelined trainer, compared with the single-process run of the same config (recorded once per file
by rank 0: single_process_reference in tests/dist/equivalence.py). Compared: the gradients
of the first step (every parameter a stage holds, by its full-model name, against the matching TP shard of the full
gradient), the loss of 5 optimizer steps (1e-5 relative) and the parameters after them.
"""

from __future__ import annotations

import pytest
import torch

from megalm.model.linear import linear_modules
from megalm.model.naming import canonical_named_modules, canonical_named_parameters
from megalm.parallel.pipeline.actions import Schedule
from megalm.parallel.pipeline.runtime import PipelineRuntime
from megalm.parallel.pipeline.schedules import peak_in_flight
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.equivalence import (
    assert_layout_matches,
    assert_resume_is_bit_exact,
    single_process_reference,
)
from tests.dist.launch import run_distributed

STEPS = 5
# 4 layers so that pp4 and pp2 x vpp2 hold one layer per virtual stage; micro-batches of 2 samples
# give 4 micro-batches per step (per DP rank: 2 under dp2).
COMMON = ["model.num_layers=4", "trainer.micro_batch_size=2"]


def check_pipeline(rank: int, world_size: int, overrides: list[str], tmp: str) -> None:
    """`overrides` configure the parallel run; the reference gets those that are not `parallel.*`."""
    same_model_and_data = [o for o in overrides if not o.startswith("parallel.")]
    reference = single_process_reference(rank, same_model_and_data, tmp, STEPS)
    par = Trainer(compose_config(*overrides), f"{tmp}/par")
    pipeline = par.parallel.runner
    assert isinstance(pipeline, PipelineRuntime)

    def peak_as_accounted() -> None:
        """The runtime held exactly as many micro-batch activations as the schedule's accounting says."""
        samples = par.cfg.trainer.global_batch_size
        sched = pipeline.schedule(samples // par.cfg.trainer.micro_batch_size // par.mesh.dims.dp)
        assert pipeline.peak_in_flight == peak_in_flight(sched)[par.mesh.pp_rank]

    # summation order: see assert_same_training
    assert_layout_matches(reference, par, rank, STEPS, 1e-3, peak_as_accounted)


LAYOUTS = {
    "pp2_1f1b": (2, ["parallel.pp=2"]),
    "pp4_1f1b": (4, ["parallel.pp=4"]),
    "pp2_vpp2_interleaved": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved"]),
    "pp2_zb": (2, ["parallel.pp=2", "parallel.pp_schedule=zb"]),
    "pp2_zb_dp2": (4, ["parallel.pp=2", "parallel.pp_schedule=zb", "parallel.dp=2"]),  # W feeds the DP hooks
    "pp2_tp2": (4, ["parallel.pp=2", "parallel.tp=2"]),
    "pp2_dp2": (4, ["parallel.pp=2", "parallel.dp=2"]),
    # micro-batches of different token counts (documents as samples), a hand-set layer split and
    # a different recompute mode per stage
    "pp2_varlen_split_recompute": (2, ["parallel.pp=2", "data.varlen=true", "parallel.layers_per_stage=[1,3]",
                                       "parallel.recompute=[full,selective]"]),
    # GPT-2: tied embeddings, copies on the first and last stage kept in sync
    "pp2_dp2_gpt2_tied": (4, ["model=gpt2_tiny", "parallel.pp=2", "parallel.dp=2"]),
    # ZeRO-1 shards the summed gradient: the tied copies are summed over the embedding group before it
    "pp2_dp2_zero1_gpt2_tied": (4, ["model=gpt2_tiny", "parallel.pp=2", "parallel.dp=2", "parallel.zero1=true"]),
    "pp2_zb_tp2_sp": (4, ["parallel.pp=2", "parallel.pp_schedule=zb", "parallel.tp=2",
                          "parallel.sequence_parallel=true"]),
    "pp2_vpp2_dp2_zero1": (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved",
                               "parallel.dp=2", "parallel.zero1=true"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_matches_single_process(tmp_path, name):
    world, parallel = LAYOUTS[name]
    run_distributed(check_pipeline, world, COMMON + parallel, str(tmp_path), timeout=300)


@pytest.mark.slow  # about 30 s: the default suite keeps test_resume_under_tp_dp_zero1_is_bit_exact
def test_pipeline_checkpoint_resumes_bit_exact_and_loads_into_one_process(tmp_path):
    """Every stage saves its part of one DCP checkpoint (tied embedding copies included); a resumed
    pp2 x tp2 run repeats the uninterrupted losses exactly, and the checkpoint loads into one process."""
    from megalm.model import GPT
    from megalm.training.checkpoint import latest_checkpoint, load_model_weights

    model = ["model=gpt2_tiny", *COMMON]
    layout = [*model, "parallel.pp=2", "parallel.tp=2", "trainer.max_steps=4"]
    assert_resume_is_bit_exact(tmp_path, 4, layout, stop_at=2)

    reference = Trainer(compose_config(*model, "trainer.max_steps=4"), tmp_path / "single")
    reference.fit()
    single = GPT(reference.cfg.model)
    load_model_weights(latest_checkpoint(tmp_path / "stopped"), single)
    expected = dict(reference.model.named_parameters())
    for name, p in single.named_parameters():
        torch.testing.assert_close(p, expected[name], rtol=1e-4, atol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


class HostOffload:
    """A stand-in for the offload feature: saved activations of the selected micro-batches move to a
    "host" copy at OFFLOAD and back at RELOAD; it records the order of events it sees."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.saved: dict[tuple[int, int], list] = {}
        self.events: list[tuple[str, tuple[int, int]]] = []

    def select(self, schedule: Schedule) -> set[tuple[int, int, int]]:
        return {(r, mb, 0) for r in range(schedule.num_stages) for mb in range(0, schedule.num_micro_batches, 2)}

    def forward_context(self, key, micro_batch=None):
        store = self.saved.setdefault(key, [])

        def pack(t: torch.Tensor):
            if isinstance(t, torch.nn.Parameter):
                return t
            store.append(t)
            return (key, len(store) - 1)

        def unpack(ref):
            if isinstance(ref, torch.Tensor):
                return ref
            k, i = ref
            assert ("reload", k) in self.events or k not in self.offloaded(), f"{k} used while offloaded"
            return self.saved[k][i]

        self.events.append(("forward", key))
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def offloaded(self) -> set:
        return {k for e, k in self.events if e == "offload"}

    def offload(self, key) -> None:
        self.events.append(("offload", key))
        self.saved[key] = [t.clone() for t in self.saved[key]]  # the "host" copies; originals dropped

    def reload(self, key) -> None:
        self.events.append(("reload", key))

    def start_step(self) -> None:
        self.events.clear()

    def release(self, key) -> None:
        self.events.append(("release", key))


def check_offload_actions(rank: int, world_size: int, tmp: str) -> None:
    overrides = [*COMMON, "parallel.pp=2"]
    plain = Trainer(compose_config(*overrides), f"{tmp}/plain")
    offloaded = Trainer(compose_config(*overrides), f"{tmp}/offloaded")
    hooks = HostOffload(rank)
    offloaded.parallel.runner.memory_hooks = hooks
    plain.forward_backward(0)
    offloaded.forward_backward(0)
    for (name, a), (_, b) in zip(canonical_named_parameters(plain.model), canonical_named_parameters(offloaded.model),
                                 strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
    kinds = [a.kind for a in offloaded.parallel.runner.schedule(4).actions[rank]]
    assert kinds.count("OFFLOAD") == kinds.count("RELOAD") == 2
    for mb in (0, 2):
        order = [e for e, k in hooks.events if k == (mb, 0)]
        assert order == ["forward", "offload", "reload", "release"], order


def test_offload_actions_run_between_forward_and_backward(tmp_path):
    run_distributed(check_offload_actions, 2, str(tmp_path), timeout=120)


def build_with_rank_dependent_config(rank: int, world_size: int, tmp: str) -> None:
    from megalm.errors import ConfigError

    schedule = "1f1b" if rank == 0 else "zb"  # e.g. a launcher that passed different overrides per rank
    with pytest.raises(ConfigError, match="config differs from rank"):
        Trainer(compose_config(*COMMON, "parallel.pp=2", f"parallel.pp_schedule={schedule}"), f"{tmp}/run")


def test_ranks_with_different_configs_fail_at_start(tmp_path):
    """A mismatched config would pair the wrong sends and receives and hang: every rank refuses it first."""
    run_distributed(build_with_rank_dependent_config, 2, str(tmp_path), timeout=60)


def check_zb_with_recipe(rank: int, world_size: int, recipe: str, tmp: str) -> None:
    """pp2 under ZB and under 1F1B with the same precision recipe: the linear layers carry both the recipe
    and ZB's weight-gradient sink, and the losses agree (the deferred dW is the recipe's own GEMM with the
    same seeds and scales)."""
    common = [*COMMON, "parallel.pp=2", f"precision={recipe}"]
    one_f_one_b = Trainer(compose_config(*common), f"{tmp}/1f1b")
    zb = Trainer(compose_config(*common, "parallel.pp_schedule=zb"), f"{tmp}/zb")
    store = zb.parallel.runner.store
    layers = dict(canonical_named_modules(zb.model))
    linears = {name for name, m in layers.items() if m in linear_modules(zb.model)}
    assert linears and all(layers[name].weight_grad_sink.sink is store for name in linears)
    assert all(layers[name].gemm_recipe is not None for name in linears - {"output"})  # the head is skipped
    expected = [one_f_one_b.train_step(s).loss for s in range(STEPS)]
    got = [zb.train_step(s).loss for s in range(STEPS)]
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{recipe} step {step}: zb loss {a} vs 1f1b {b}"
    assert got[-1] < got[0], f"{recipe} under ZB did not train: {got}"


@pytest.mark.parametrize("recipe", ["fp8", "mxfp4_rtn", "mxfp4"])
def test_zero_bubble_composes_with_precision_recipes(tmp_path, recipe):
    run_distributed(check_zb_with_recipe, 2, recipe, str(tmp_path), timeout=300)


def record_dropout_masks(rank: int, world_size: int, tmp: str) -> None:
    trainer = Trainer(compose_config("model.num_layers=2", "trainer.micro_batch_size=2", "model.dropout=0.5",
                                     "parallel.pp=2"), f"{tmp}/run")
    masks = {}
    for name, module in canonical_named_modules(trainer.model):
        if name.endswith(".dropout"):
            module.register_forward_hook(
                lambda _, args, out, name=name: masks.setdefault(name, []).append((out == 0) & (args[0] != 0)))
    trainer.forward_backward(0)
    torch.save(masks, f"{tmp}/masks{rank}.pt")


def test_pipeline_stages_draw_their_own_dropout_masks(tmp_path):
    """Every rank seeded alike made layer i on stage 0 and layer i + L/pp on stage 1 drop exactly the same elements
    for every micro-batch: correlated across layers, where one process draws each layer's afresh."""
    run_distributed(record_dropout_masks, 2, str(tmp_path), timeout=240)
    first, second = torch.load(tmp_path / "masks0.pt")["layers.0.dropout"], torch.load(tmp_path / "masks1.pt")[
        "layers.1.dropout"]
    assert len(first) == len(second) >= 4  # 4 micro-batches (a layer drops twice: after attention and the MLP)
    for a, b in zip(first, second, strict=True):
        agreement = (a == b).float().mean().item()
        assert 0.4 < agreement < 0.6, f"stage masks agree on {agreement:.3f} of the elements (independent: ~0.5)"
