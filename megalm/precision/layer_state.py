"""What a linear layer's recipe remembers between calls: its seed stream, its FP8 amax histories and its weight's
FP8 copies, valid for one optimizer step (`WeightsVersion`).

Randomness and reproducibility. A GEMM that draws (RHT signs, SR noise) uses its own torch.Generator
seeded by (call seed, GEMM name), `gemm_generator`. Each forward call fixes its call seed and the
backward's GEMMs use it, so the draws do not depend on the order in which layers run backward
(pipeline schedules reorder them). The call seed comes from the layer's `LinearState`: a hash of (base seed,
layer name, step, micro-batch, shard, call index within the micro-batch). A trainer calls
`set_precision_step(model, step, micro_batch, shard)` (install.py) before each micro-batch's forward; then every
run of the same seed draws the same numbers whatever the pipeline schedule. Put the data-parallel rank into
`micro_batch` (e.g. the global micro-batch index) so that replicas draw independent noise, and the rank's position
on a context-parallel ring into `shard` so that the ring's token shards do too. Tensor-parallel ranks share
(micro_batch, shard): their RHT signs must match; their stochastic rounding draws apart by `noise_rank` (the TP
rank), else the partial products a collective sums (a column-parallel dgrad's) round alike and their errors add up
instead of averaging out (1.5x the error of a dgrad summed over tp 4 from alike shards with a non-zero mean:
tests/unit/test_precision_linear.py). Activation
recomputation re-runs forwards (advancing the call index), but the backward GEMMs use the seed their
original forward fixed, so recomputation changes no draw. Without a state and without `seed=`, a call
draws its seed from torch's default generator (reproducible under torch.manual_seed).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch

from megalm.precision.amax_history import AmaxHistory, compact_histories, roll_histories
from megalm.precision.gemm import Fp8Operand, hash_seed


def gemm_generator(seed: int, gemm: str, device: torch.device | str) -> torch.Generator:
    """The generator GEMM `gemm` of the call with seed `seed` draws its RHT signs and SR noise from."""
    return torch.Generator(device=device).manual_seed(hash_seed(seed, gemm))


class WeightsVersion:
    """How many times the optimizer that updates a model's weights has stepped: cached quantized weights are valid
    within one version. Counted by a post-step hook registered on that optimizer only (`watch`), never on all of
    torch. Until an optimizer is watched nothing is cached (fused AdamW updates weights in place without bumping
    their version counters, so an unwatched cache could serve a stale weight): every call quantizes afresh."""

    def __init__(self) -> None:
        self.steps = 0
        self.watched = False

    def watch(self, optimizer: object) -> None:
        """Count `optimizer`'s steps (a torch optimizer, or ZeRO-1's, which has the same hook)."""
        optimizer.register_step_post_hook(self._count)  # type: ignore[attr-defined]
        self.watched = True

    def _count(self, *_: object) -> None:
        self.steps += 1


class LinearState:
    """What a layer's recipe remembers between calls: its seed stream and FP8 amax histories.

    Call seed = hash(seed, name, step, micro_batch, calls): `set_step` at the start of each
    micro-batch makes the draws independent of anything but those (see the module docstring).
    """

    def __init__(self, name: str = "", seed: int = 0, amax_history_len: int = 16,
                 weights_version: WeightsVersion | None = None, noise_rank: int = 0) -> None:
        self.name, self.seed = name, seed
        # this rank's place among those that share the layer's call seeds but hold other shards of it (its TP rank):
        # their RHT signs must match, their stochastic rounding's noise must not (`RecipeGemms`)
        self.noise_rank = noise_rank
        self.weights_version = weights_version or WeightsVersion()
        self.step, self.micro_batch, self.shard, self.calls = 0, 0, 0, 0
        self.amax = {tensor: AmaxHistory(amax_history_len) for tensor in ("x", "w", "dy")}
        self.weights: dict[tuple, tuple[weakref.ref, tuple, Fp8Operand]] = {}

    def quantized_weight(self, key: tuple, weight: torch.Tensor, make: Callable[[], Fp8Operand]) -> Fp8Operand:
        """The weight's FP8 copy `key` (format, K dim), made once per optimizer step: every micro-batch of a
        step, and fprop and dgrad under per-tensor scales, reuse it (Transformer Engine's FP8 weight cache).
        Valid for the same tensor object (a weakref: a weight computed afresh per call, e.g. a detached
        alias or kv rows gathered over TP ranks, is never served another call's copy, even at a reused
        address) while the watched optimizer did not step (fused AdamW updates in place without bumping version
        counters) and its version counter is unchanged (any other in-place write, ZeRO-1's copy-back). Nothing
        is cached while no optimizer is watched (`WeightsVersion`)."""
        if not self.weights_version.watched:
            return make()
        token = self.weight_token(weight)
        cached = self.weights.get(key)
        if cached is None or cached[0]() is not weight or cached[1] != token:
            cached = self.weights[key] = (weakref.ref(weight), token, make())
        return cached[2]

    def weight_token(self, weight: torch.Tensor) -> tuple[int, int, int]:
        """What a weight's cached copies are valid for: the watched optimizer's steps, the weight's version counter,
        and W's delayed-scaling history count (a copy an evaluation made before the step's roll)."""
        return self.weights_version.steps, weight._version, self.amax["w"].count

    def set_step(self, step: int, micro_batch: int = 0, shard: int = 0) -> None:
        """Start the seed stream at (step, micro_batch, shard); a new step also ends the last one's amax histories
        (delayed scaling: `AmaxHistory.roll`)."""
        set_steps([self], step, micro_batch, shard)

    def next_seed(self) -> int:
        # shard 0 (a whole micro-batch, a ring's first rank) keeps the stream of one process
        where = (self.micro_batch,) if self.shard == 0 else (self.micro_batch, f"shard{self.shard}")
        seed = hash_seed(self.seed, self.name, self.step, *where, self.calls)
        self.calls += 1
        return seed

    def state_dict(self) -> dict:
        return {"amax": {k: v.state_dict() for k, v in self.amax.items()}}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state["amax"].items():
            self.amax[k].load_state_dict(v)


def set_steps(states: Iterable[LinearState], step: int, micro_batch: int = 0, shard: int = 0) -> None:
    """`LinearState.set_step` of many layers, their amax histories rolled (a new step) or compacted together in a
    few batched kernels (`amax_history.roll_histories`), not a few per history."""
    states = list(states)
    roll_histories([h for state in states if state.step != step for h in state.amax.values()])
    compact_histories([h for state in states if state.step == step for h in state.amax.values()])
    for state in states:
        state.step, state.micro_batch, state.shard, state.calls = step, micro_batch, shard, 0
