"""FSDP gathering torchao's FP8 weights (`precision.fp8_all_gather=true`, precision=fp8 precision.backend=torchao).

On fp32 weights the FP8 gather casts each fp32 shard with the whole weight's scale, which is what the plain gather's
cast of the whole fp32 weight computes: the two runs train to the bit, while the FP8 gather moves 1 byte an element
of each converted weight where the plain one moves 4 (bytes counted from the all-gathers' own input tensors). On bf16
working weights the plain gather moves 2 bytes and torchao casts the gathered bf16 weight, where the FP8 gather casts
the fp32 shard (as TorchTitan's does): one rounding where there were two, so a few elements a step land one E4M3
step apart and the losses agree to 1e-3 (1.6e-4 by step 4 against one process, 2026-12-04). After each optimizer
step every converted weight's scale is precomputed at once (torchao's precompute_float8_dynamic_scale_for_fsdp):
the gathers then take no all-reduce of their own.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalm.model.naming import canonical_named_parameters
from megalm.precision.torchao_fp8 import torchao_problem
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.equivalence import assert_resume_is_bit_exact
from tests.dist.launch import run_distributed

TORCHAO_FSDP = ["trainer.micro_batch_size=2", "parallel.fsdp=true", "precision=fp8", "precision.backend=torchao"]
WEIGHTS = {"fp32": (["precision.bf16_weights=false", "precision.autocast=false"], 4, 0.0),  # bytes, loss rtol
           "bf16": (["precision.bf16_weights=true"], 2, 1e-3)}
STEPS = 3


class Collectives(TorchDispatchMode):
    """The bytes the all-gathers send (their input tensors) and the all-reduces run by plain c10d or functional
    collectives (torchao's per-weight amax takes one in each gather that has no precomputed scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.gathered_bytes = self.all_reduces = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = str(func.overloadpacket)
        if name.endswith("_allgather_base_"):
            self.gathered_bytes += args[1].numel() * args[1].element_size()
        elif "all_reduce" in name or "allreduce" in name:
            self.all_reduces += 1
        return func(*args, **(kwargs or {}))


def fp8_weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p for _, p in canonical_named_parameters(trainer.model)
            if type(p.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"]


def check_fp8_gather(rank: int, world_size: int, tmp: str, weights_dtype: str, pp: int) -> None:
    overrides, plain_bytes_each, loss_rtol = WEIGHTS[weights_dtype]
    dp = world_size // pp
    layout = [f"parallel.dp={dp}", f"parallel.pp={pp}", f"trainer.global_batch_size={4 * dp}"]
    runs = {}
    for name, extra in (("plain", []), ("fp8", ["precision.fp8_all_gather=true"])):
        trainer = Trainer(compose_config(*TORCHAO_FSDP, *layout, *overrides, *extra), f"{tmp}/{name}")
        steps = []
        for step in range(STEPS):
            with Collectives() as seen:
                loss = trainer.train_step(step).loss
            steps.append((loss, seen.gathered_bytes, seen.all_reduces))
        runs[name] = (trainer, steps)
    plain, fp8 = runs["plain"], runs["fp8"]
    for (a, _, _), (b, _, _) in zip(plain[1], fp8[1], strict=True):
        assert abs(a - b) <= loss_rtol * abs(a), (rank, weights_dtype, plain[1], fp8[1])
    assert not fp8_weights(plain[0]), "the plain run's weights are torchao's FSDP extension"
    weights = fp8_weights(fp8[0])
    assert weights, f"rank {rank}: no weight is gathered in FP8"
    # torchao casts a shard without FSDP's padding: a weight whose rows do not divide over the ranks stays plain
    # (dp 3 here: qkv's 128 rows and the 64 of o and down; gate/up's 384 divide)
    converted = [m for m in fp8[0].model.modules() if type(m).__name__ == "Float8Linear"]
    even = [m for m in converted if m.out_features % dp == 0]
    assert len(weights) == len(even) and (dp == 2) == (len(even) == len(converted)), (rank, len(weights))
    # every block is gathered twice a micro-batch (its forward, and again for its backward: reshard_after_forward)
    t = fp8[0].cfg.trainer
    micro_batches = t.global_batch_size // (t.micro_batch_size * dp)
    fewer = 2 * micro_batches * (plain_bytes_each - 1) * sum(w.to_local().numel() for w in weights)
    for step, ((_, plain_bytes, plain_reduces), (_, fp8_bytes, fp8_reduces)) in enumerate(zip(plain[1], fp8[1],
                                                                                            strict=True)):
        assert plain_bytes - fp8_bytes == fewer, (rank, step, plain_bytes, fp8_bytes, fewer)
        # step 0 has no precomputed scale yet (a checkpoint may load the weights first): a weight's gathers take
        # their amax with an all-reduce each; after each optimizer step the scales are made for all at once
        if step == 0:
            assert fp8_reduces > plain_reduces, (rank, fp8_reduces, plain_reduces)
        else:
            assert fp8_reduces == plain_reduces, (rank, step, fp8_reduces, plain_reduces)
    e4m3_max = torch.finfo(torch.float8_e4m3fn).max
    for weight in weights:  # the precomputed scale is the whole weight's, as the last optimizer step left it
        amax = weight.full_tensor().abs().amax().double()
        assert torch.equal(weight._local_tensor._precomputed_scale, (e4m3_max / amax).float()), rank


@pytest.fixture(autouse=True)
def _needs_torchao() -> None:
    if torchao_problem() is not None:
        pytest.skip(torchao_problem())


@pytest.mark.parametrize("weights_dtype, dp, pp", [("fp32", 2, 1), ("bf16", 2, 1), ("fp32", 3, 1), ("fp32", 2, 2)],
                         ids=["fp32", "bf16", "fp32_dp3_uneven", "fp32_pp2_dp2"])
def test_fp8_all_gather_trains_as_the_plain_gather_moving_a_byte_an_element(tmp_path, weights_dtype, dp, pp):
    """pp 2: each stage's chunk precomputes its own weights' scales over its stage's data-parallel ranks."""
    run_distributed(check_fp8_gather, dp * pp, str(tmp_path), weights_dtype, pp, timeout=240)


def test_fp8_all_gather_resumes_bit_exactly(tmp_path):
    """Stopped and resumed: the resumed run's first gathers take their scales without a precomputed one, which
    must cast as the straight run's precomputed scales did."""
    layout = [*TORCHAO_FSDP, "parallel.dp=2", "precision.fp8_all_gather=true", "trainer.max_steps=4",
              "trainer.save_interval=1"]
    assert_resume_is_bit_exact(tmp_path, 2, layout, stop_at=2, timeout=240)
