"""The plain training step reads the device once: one device-to-host sync per step (everything the log needs,
read together), and no pageable host-to-device copy made from Python values.

Counted on CPU with the device guard's notion of host tensors (tests/dist/device_guard.py): a read of a
tensor that was not made on the host (.item(), .tolist(), int(), float(), bool()) is a sync; so is a
`torch.tensor(values, device=...)`, a copy from pageable memory. The CPU attention path (SDPA per
document, which reads cu_seqlens) is left out: on a GPU the varlen kernels take max_seqlen as a host int.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from megalm.config import moe_layer_ids
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.dist.device_guard import HostTensorGuard
from tests.dist.launch import run_distributed

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__bool__, torch.Tensor.__index__}


class SyncCounter(HostTensorGuard):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # dynamo tracing a compiled function (FP8's casts): it cannot sync inside
            return func(*args, **kwargs)
        caller = next((f for f in reversed(traceback.extract_stack()[:-1]) if "/megalm/" in f.filename), None)
        counted = caller is not None and not caller.filename.endswith(("model/attention.py", "model/document_sdpa.py"))
        if counted and func in READS and isinstance(args[0], torch.Tensor) and self.site(args[0]) is None:
            self.syncs.append(f"{func.__name__} at {caller.filename}:{caller.lineno}")
        if counted and func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None \
                and not isinstance(args[0], torch.Tensor):
            self.syncs.append(f"host copy at {caller.filename}:{caller.lineno}")
        out = super().__torch_function__(func, types, args, kwargs)
        if func is torch.from_numpy:  # data made on the host
            self._tag(out, "from_numpy")
        return out


MOE = ["model=moe_tiny", "model.num_layers=2", "model.hidden_size=64", "model.moe.seq_aux_loss_coeff=0.01",
       "model.moe.bias_update_rate=0.01", "model.moe.capacity_factor=1.0"]


@pytest.mark.parametrize("model", [[], MOE], ids=["dense", "moe"])
def test_one_host_sync_per_training_step(tmp_path, model):
    """MoE adds none: its routing stays on the device, its load and losses are read with the step's totals."""
    trainer = Trainer(compose_config("trainer.max_steps=3", *model), tmp_path)
    trainer.train_step(0)  # first-call work (caches, backend choice) is not per step
    with SyncCounter() as counter:
        result = trainer.train_step(1)
    assert len(counter.syncs) == 1, counter.syncs
    assert "trainer.py" in counter.syncs[0] and result.tokens > 0


def test_fp8_on_its_cuda_code_adds_no_host_sync(tmp_path, scaled_mm_on_cpu):
    """FP8 as a GPU from sm89 runs it (compiled casts, torch._scaled_mm, weight copies cached per optimizer step; on
    CPU tensors, as tools/bench/host_overhead.py does): still the step's one sync. A sync per linear would drain
    the GPU's queue of launches at every layer (the first GPU run measured FP8 at 0.67x bf16's tokens/s)."""
    trainer = Trainer(compose_config("trainer.max_steps=3", "precision=fp8"), tmp_path)
    trainer.train_step(0)
    with SyncCounter() as counter:
        trainer.train_step(1)
    assert len(counter.syncs) == 1, counter.syncs
    assert "trainer.py" in counter.syncs[0]


def _count_expert_parallel_syncs(rank: int, world_size: int, tmp: str) -> None:
    trainer = Trainer(compose_config("trainer.max_steps=3", "parallel.ep=2", *MOE), tmp)
    trainer.train_step(0)
    with SyncCounter() as counter:
        trainer.train_step(1)
    micro_batches = trainer.cfg.trainer.global_batch_size // (trainer.cfg.trainer.micro_batch_size * world_size)
    per_layer = [s for s in counter.syncs if "expert/dispatch.py" in s]
    assert len(per_layer) == len(moe_layer_ids(trainer.cfg.model)) * micro_batches > 0, counter.syncs
    assert len(counter.syncs) == 1 + len(per_layer), counter.syncs


def test_expert_parallelism_adds_one_host_sync_per_moe_layer_and_micro_batch(tmp_path):
    """An all-to-all with variable splits needs them on the host (NCCL's as gloo's): each MoE layer reads its
    exchanged counts once per micro-batch's forward, and nothing else; the backward reuses them."""
    run_distributed(_count_expert_parallel_syncs, 2, str(tmp_path), timeout=120)


def _count_data_parallel_syncs(rank: int, world_size: int, tmp: str) -> None:
    trainer = Trainer(compose_config("trainer.max_steps=3", "parallel.dp=2"), tmp)
    assert trainer.preemption.distributed and trainer.preemption.signals
    trainer.train_step(0)
    with SyncCounter() as counter:
        result = trainer.train_step(1)
        assert not trainer.preemption.requested(result.preempt)  # as Trainer.fit asks after every step
    assert len(counter.syncs) == 1 and "trainer.py" in counter.syncs[0], counter.syncs


def test_the_preemption_check_adds_no_host_sync_to_a_distributed_step(tmp_path):
    """The ranks agree on a preemption signal every step: its all-reduce was read on its own after the step, a
    second device-to-host sync that kept the host from queueing the next step (an audit, 2026-12-04). The flag is
    read with the step's totals now."""
    run_distributed(_count_data_parallel_syncs, 2, str(tmp_path), timeout=120)
