"""GPU tier: a 125m-shaped Llama training step on CUDA against the same step on the CPU in fp32.

The model and step are what megalm-train runs: a config composed from configs/ (model=125m: 12 layers,
hidden 768, 12 heads, SwiGLU 2048, RoPE, vocab 50304) and `Trainer.train_step` (forward, backward, clip,
AdamW), at 512 tokens per sequence, one sequence per step, synthetic documents of ~400 tokens (so a sequence
packs several and the varlen mask matters), the same seed and data on both devices. Two steps: the second
loss sees the first update. The first step's gradients are compared per parameter.

The CUDA run must also take the fast paths, as its log and start-up note say: a flash attention kernel
(not the per-document sdpa loop), TF32 for the fp32 matmuls, and for fp8 torch._scaled_mm.

Tolerances, against these differences measured with the CPU's own bf16 recipe (bf16 weights, fp32 main weights
and gradient sums) / FP8 emulation against fp32 (same config, torch 2.13, 2026-11-27): loss 4e-5 (bf16) and 3e-4
(fp8) relative; gradient norm 1.5e-3 and 2.0e-2; smallest per-parameter gradient cosine 0.9998 (bf16: a layer's
mlp_norm weight) and 0.979 (fp8: its quantization noise). The GPU's kernels round differently (flash attention
rounds P and dS to bf16), hence the margins.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megalm.model import attention
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.gpu.conftest import CountOps, capability

pytestmark = pytest.mark.gpu

OVERRIDES = ["model=125m", "model.seq_length=512", "data=synthetic", "data.synthetic.num_docs=64",
             "data.synthetic.mean_doc_length=400", "data.valid_fraction=0", "trainer.global_batch_size=1",
             "trainer.micro_batch_size=1", "trainer.max_steps=2", "trainer.eval_interval=0",
             "trainer.save_interval=0", "trainer.log_interval=1", "logging.tensorboard=false"]
# precision: (loss relative, gradient-norm relative, smallest per-parameter gradient cosine)
TOLERANCES = {
    "bf16": (2e-2, 3e-2, 0.99),  # bf16 operands, fp32 accumulation: ~500x / ~20x the measured CPU bf16 error
    # FP8 operand noise on top: its own 2.0e-2 gradient-norm difference on the CPU, 3x that (the cosine is FP8's
    # own error too, not a GPU mismatch)
    "fp8": (2e-2, 6e-2, 0.90),
    "fp8_torchao": (2e-2, 6e-2, 0.90),  # the same recipe through torchao's Float8Linear (precision.backend=torchao)
}
BACKENDS = {"fp8_torchao": ("fp8", ["precision.backend=torchao"])}  # a case that is a recipe on another backend


@dataclass
class StepRun:
    losses: list[float]
    grad_norms: list[float]
    grads: dict[str, torch.Tensor]  # the first step's gradients (after clipping), fp32 on the CPU
    note: str  # the precision part of the trainer's start-up log line
    device: torch.device
    scaled_mm_calls: int  # FP8 GEMMs on the FP8 units in the two steps (counted for fp8 recipes only)
    moe: list[dict]  # each step's MoE metrics (expert load, drops, balancing losses; empty for a dense model)


def train_two_steps(run_dir: Path, device: str, precision: str, overrides: list[str] = OVERRIDES) -> StepRun:
    """Two training steps of the 125m model (or the model `overrides` make) through Trainer on `device` in
    `precision`."""
    threads = torch.get_num_threads()
    precision, backend = BACKENDS.get(precision, (precision, []))
    # eager on both devices (trainer.compile's default, null, compiles on CUDA): test_gpu_compile.py compares
    # compiled runs
    cfg = compose_config(*overrides, f"trainer.device={device}", f"precision={precision}", *backend,
                         "trainer.compile=false", tiny=False)
    if device == "cpu":
        cfg.trainer.num_threads = min(os.cpu_count() or 1, 16)  # the fp32 reference: use the machine's cores
    try:
        trainer = Trainer(cfg, run_dir)
        grads: dict[str, torch.Tensor] = {}

        def snapshot(optimizer, args, kwargs) -> None:  # p.grad, or the fp32 bucket sums under precision=bf16
            if not grads:
                summed = {name: trainer.parallel.reducer.summed_grad(p) for name, p in trainer.model.named_parameters()}
                grads.update({name: g.detach().float().cpu().clone() for name, g in summed.items() if g is not None})

        handle = trainer.optimizer.register_step_pre_hook(snapshot)
        counter = CountOps("_scaled_mm") if precision.startswith("fp8") else contextlib.nullcontext()
        with counter:
            results = [trainer.train_step(step) for step in range(2)]
        handle.remove()
    finally:
        torch.set_num_threads(threads)
    return StepRun([r.loss for r in results], [r.grad_norm for r in results], grads, trainer.precision.note,
                   next(trainer.model.parameters()).device, getattr(counter, "calls", 0), [r.moe for r in results])


@pytest.fixture(scope="module")
def cpu_fp32(tmp_path_factory) -> StepRun:
    """The reference: the same two steps on the CPU in fp32 (computed once for the module)."""
    return train_two_steps(tmp_path_factory.mktemp("cpu_fp32"), "cpu", "fp32")


@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8_torchao"])
def test_125m_step_on_cuda_matches_cpu_fp32(precision: str, cpu_fp32: StepRun, tmp_path, caplog) -> None:
    from megalm.precision.torchao_fp8 import torchao_problem

    if precision.startswith("fp8") and capability() < (8, 9):
        pytest.skip(f"FP8 GEMMs need compute capability 8.9+, this GPU has {capability()}")
    if precision == "fp8_torchao" and torchao_problem() is not None:
        pytest.skip(torchao_problem())
    attention._resolve_backend.cache_clear()  # the backend is logged once per (device, dtype)
    with caplog.at_level(logging.INFO, logger="megalm"):
        got = train_two_steps(tmp_path, "cuda", precision)
    loss_tol, norm_tol, min_cos = TOLERANCES[precision]

    # It ran on the GPU, on the fast paths, and said so.
    assert got.device.type == "cuda"
    backends = re.findall(r"attention backend: (\w+) \(model\.attention_backend=auto, (cuda\S*), bfloat16\)",
                          caplog.text)
    assert backends, f"no attention backend line for cuda bf16 in the log:\n{caplog.text}"
    if capability() >= (8, 0):
        assert {b for b, _ in backends} <= {"flash_attn", "torch_varlen", "cudnn"}, f"attention fell back: {backends}"
    assert re.search(r"fp32 matmuls on cuda\S*: TF32 \(precision\.tf32=true\)", caplog.text)
    if precision in ("bf16", "fp8"):  # fp32 main weights behind bf16 working weights: megalm's one pass steps them
        assert "optim.implementation=auto: megalm's one-pass Triton AdamW" in caplog.text, caplog.text[-2000:]
    if precision.startswith("fp8"):
        path = "torchao Float8Linear, tensorwise; torch._scaled_mm" if precision == "fp8_torchao" else \
            "FP8 GEMMs torch._scaled_mm"
        assert path in got.note, got.note
        assert got.scaled_mm_calls > 0, f"precision={precision} on an FP8 GPU ran no torch._scaled_mm"
    else:
        assert got.note == "bf16 (bf16 weights, fp32 main weights and gradient sums)", got.note  # the default recipe

    # The same numbers as the fp32 CPU step, within what the precision explains.
    for step in range(2):
        rel = abs(got.losses[step] / cpu_fp32.losses[step] - 1)
        assert rel < loss_tol, f"step {step + 1} loss {got.losses[step]:.5f} vs cpu fp32 {cpu_fp32.losses[step]:.5f}"
        rel = abs(got.grad_norms[step] / cpu_fp32.grad_norms[step] - 1)
        assert rel < norm_tol, (f"step {step + 1} grad norm {got.grad_norms[step]:.4f} vs cpu fp32 "
                                f"{cpu_fp32.grad_norms[step]:.4f}")
    assert got.grads.keys() == cpu_fp32.grads.keys()
    cosines = {name: torch.nn.functional.cosine_similarity(g.flatten().double(),
                                                           cpu_fp32.grads[name].flatten().double(), dim=0).item()
               for name, g in got.grads.items()}
    worst = min(cosines, key=cosines.get)
    assert cosines[worst] > min_cos, f"{worst}: gradient cosine {cosines[worst]:.4f} <= {min_cos} against cpu fp32"
