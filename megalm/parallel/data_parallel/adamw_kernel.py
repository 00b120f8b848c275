"""AdamW over fp32 main weights in one Triton pass that also writes the working (bf16) copy:
`optim.implementation=triton`.

Why hand-written. With bf16 working weights the step is torch's fused AdamW over the fp32 main weights, then a
second kernel casting every main weight into its bf16 working copy (BucketAdamW). Per parameter that reads the
main weight, gradient and both moments (16 bytes) and writes the weight and moments back (12), plus the gradient
when the clip's scale is folded in (torch's kernel stores the unscaled gradient: 4), and the cast reads the main
weight again and writes 2 bytes: 38 bytes. One pass that keeps the weight in registers moves 30. Megatron gets
that pass from Apex's or Transformer Engine's multi-tensor Adam with master weights; neither installs here, and
torch's kernel has no working-copy output. On one H200 (2026-11-29, tools/bench/throughput.py --profile) torch's
kernel moved 2.4 TB/s, half the HBM peak: of the compiled 1.3B step's 176 ms of kernels, the optimizer's were 24.
On one H100 (2026-12-05, `tools/bench/adamw_kernels.py model=1.3b`) this kernel stepped the 1.42B parameters in
15.2 ms against 20.8 for torch's kernel and cast (1.37x), so `optim.implementation=auto` runs it on CUDA.

The update is torch's AdamW (Loshchilov & Hutter 2019, decoupled weight decay), in torch's order: the gradient
divided by the clip's scale where one is given, w <- w (1 - lr wd), m <- m + (1 - b1)(g - m) (torch's lerp),
v <- b2 v + (1 - b2) g^2, w <- w - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps), with correctly
rounded division and square root. The working copy is w rounded to nearest even (written as bf16 bits by hand:
the interpreter's own casts truncate). Same results as torch's kernel up to the order of fp32 roundings
(tests/unit/test_adamw_kernel.py, under TRITON_INTERPRET=1 on a CPU).
"""

from __future__ import annotations

import functools
import math

import torch

from megalm import compat

BLOCK = 4096  # elements per program: 16 KiB of each fp32 stream
_GRAD_DTYPES = (torch.float32, torch.bfloat16)


runnable = compat.triton_runs_on  # CUDA with triton importable, or a CPU under TRITON_INTERPRET=1


@functools.cache
def _kernel(interpret: bool):  # noqa: ANN202 - a triton.JITFunction
    """The jitted kernel, built once per interpreter mode (`interpret` is the cache key: triton.jit reads
    TRITON_INTERPRET when it decorates); triton is imported here, so megalm's import never does."""
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(main_ptr, grad_ptr, m_ptr, v_ptr, work_ptr, scale_ptr, n, beta1, beta2, eps, decay,
                     step_size, bias2_sqrt, HAS_SCALE: tl.constexpr, WORK: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        w = tl.load(main_ptr + offsets, mask=mask)
        g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)  # bf16 gradients (grad_reduce_dtype) widen
        m = tl.load(m_ptr + offsets, mask=mask)
        v = tl.load(v_ptr + offsets, mask=mask)
        if HAS_SCALE:
            g = tl.math.div_rn(g, tl.load(scale_ptr) + tl.zeros_like(g))
        w = w * decay
        m = m + (1.0 - beta1) * (g - m)
        v = v * beta2 + (1.0 - beta2) * (g * g)
        denom = tl.math.div_rn(tl.math.sqrt_rn(v), bias2_sqrt + tl.zeros_like(v)) + eps
        w = w - step_size * tl.math.div_rn(m, denom)
        tl.store(main_ptr + offsets, w, mask=mask)
        tl.store(m_ptr + offsets, m, mask=mask)
        tl.store(v_ptr + offsets, v, mask=mask)
        if WORK:  # bf16, as int16 bits: round to nearest even by hand (cvt.rn.bf16.f32), NaN kept a NaN
            bits = w.to(tl.uint32, bitcast=True)
            bits = tl.where(w != w, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            tl.store(work_ptr + offsets, bits.to(tl.int16), mask=mask)

    return adamw_kernel


def adamw_step_(main: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                work: torch.Tensor | None, *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: int, grad_scale: torch.Tensor | None = None) -> None:
    """One AdamW step (module docstring) of the flat fp32 `main` weights in place, and of their bf16 working copy
    `work` (same numel; None: none); `step` counts from 1. Every tensor 1-D and contiguous; `grad` fp32 or bf16
    (`parallel.grad_reduce_dtype=bf16`: read as it is, widened in registers, no fp32 copy)."""
    tensors = (main, grad, exp_avg, exp_avg_sq) + (() if work is None else (work,))
    if any(t.dim() != 1 or not t.is_contiguous() or t.numel() != main.numel() for t in tensors):
        raise ValueError("adamw_step_ takes 1-D contiguous tensors of one length")
    if any(t.dtype != torch.float32 for t in (main, exp_avg, exp_avg_sq)) or grad.dtype not in _GRAD_DTYPES or (
            work is not None and work.dtype != torch.bfloat16):
        raise TypeError("adamw_step_ steps fp32 main weights and moments by fp32 or bf16 gradients, and their bf16 "
                        "copy")
    n = main.numel()
    if n == 0:
        return
    bias1, bias2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    scale = grad_scale if grad_scale is not None else main  # any pointer: not read without HAS_SCALE
    out = main if work is None else work.view(torch.int16)  # main: any pointer, not written without WORK
    _kernel(compat.triton_interpreted())[(math.ceil(n / BLOCK),)](
        main, grad, exp_avg, exp_avg_sq, out, scale, n, beta1, beta2, eps, 1.0 - lr * weight_decay, lr / bias1,
        math.sqrt(bias2), HAS_SCALE=grad_scale is not None, WORK=work is not None, BLOCK=BLOCK, num_warps=8)


@torch.library.custom_op("megalm::adamw_step", mutates_args=("main", "exp_avg", "exp_avg_sq", "work"))
def traced_adamw_step(main: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      work: torch.Tensor | None, grad_scale: torch.Tensor | None, lr: float, beta1: float,
                      beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """`adamw_step_` as one op of torch's dispatcher, for fake tensors (megalm-estimate's and the step-cost tool's
    traces), where no Triton kernel launches: a trace sees it as one kernel and prices the bytes it reads and writes
    (megalm/measure/op_cost.py: 30 a parameter, the work copy written, not read). Real tensors launch the kernel
    directly (BucketAdamW), with no dispatcher call per parameter."""
    adamw_step_(main, grad, exp_avg, exp_avg_sq, work, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, step=step, grad_scale=grad_scale)


@traced_adamw_step.register_fake
def _(main: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
      work: torch.Tensor | None, grad_scale: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
      weight_decay: float, step: int) -> None:
    return None
