"""Gradient accumulation fusion: each weight-gradient GEMM adds dW = dyᵀ x into the fp32 main gradient itself.

Megatron-LM's `gradient_accumulation_fusion` (there an apex or Transformer Engine kernel). Under precision=bf16 the
reducer sums each micro-batch's weight gradients in fp32 buckets (reducer.py, "main_grad"): unfused, the GEMM writes
dW in bf16, autograd hands it to the parameter, and the reducer's hook adds it into the bucket, a kernel per
parameter: per element and micro-batch the GEMM writes 2 bytes, the hook reads them and writes 4 (and reads the 4 of
the sum so far after the first micro-batch), and each micro-batch's dW is rounded to bf16 before it is summed. Fused,
the GEMM takes the parameter's slice of the bucket as its accumulator, C = dyᵀ x + β C (β = 0 for the step's first
micro-batch, so the buckets need no zeroing pass), and writes it in fp32: 4 bytes the first time, 8 after, no bf16
dW, no copy kernel, and every micro-batch's dW summed as the GEMM's fp32 accumulator left it.

On CUDA that is one cuBLAS GEMM through torch's `out_dtype` overload of addmm (bf16 operands, fp32 accumulator and
output), so neither apex nor TE is needed; its fp32 accumulator came with pytorch/pytorch#167931 (November 2025),
and a torch without it is probed, said and left unfused. A CPU has no such kernel: there the GEMM runs in fp32 on
upcast operands (bf16 products are exact in fp32, so it sums what the CUDA GEMM sums), slower than the unfused path
and said so in one log line; it is what the CPU tests compare.

How it reaches the GEMM: as a zero-bubble pipeline's W action does (megalm/parallel/pipeline/weight_grad.py),
through the linear layer's `weight_grad_sink` hook (megalm/model/linear.py). The layer's weight is detached in the
forward, so autograd never reaches its AccumulateGrad; its backward computes dx and hands dy and x to the sink
(`LayerSink.accumulate`), whose store here is `MainGradAccumulator`: the GEMM into the reducer's `main_grad(param)`,
then `added_to_main_grad(param)`, which counts the arrival as the reducer's hook would (and launches the bucket's
reduction when it completes). Inside a compiled block the same call runs from the layer's custom op
(megalm/model/deferred_wgrad.py), in eager, so the graph stays whole.

Under a zero-bubble schedule the layer's sink is the pipeline's (weight_grad.py): it keeps dy and x, and the W action
runs the same GEMM into the main gradient.

Left out, keeping autograd's gradient and the reducer's hook: layers with a precision recipe (their wgrad is the
recipe's own GEMM), weights another layer shares, weights that reach the GEMM through another op (TP's replicated kv
rows), MoE's grouped expert GEMMs, embeddings and norms.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter

import torch
from torch import nn

from megalm import compat
from megalm.model.deferred_wgrad import LayerSink
from megalm.model.linear import linear_modules
from megalm.parallel.data_parallel.reducer import GradReducer

log = logging.getLogger("megalm")


def gemm_accumulates(dy: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether one GEMM can read and write `out`'s dtype from `dy`'s operands: the same dtype, CUDA's `out_dtype`
    overload, or a cost trace of a CUDA GPU on fake tensors (compat.fp8_traced_as_gpu) where this torch's fake
    tensors run that overload (else the trace prices the CPU's emulation)."""
    return (dy.dtype == out.dtype or dy.is_cuda
            or (compat.fp8_traced_capability() is not None and compat.is_fake(dy)
                and accumulator_problem("cpu", fake=True) is None))


@functools.cache
def accumulator_problem(device: str, fake: bool = False) -> str | None:
    """Why this torch's addmm cannot add bf16 operands into an fp32 tensor in place on `device` (`fake`: on fake
    tensors, as cost traces run it), or None. Probed once. CUDA's `out_dtype` overload took `self` in the operands'
    dtype only until pytorch/pytorch#167931 (November 2025); torch 2.11's fake tensors route the overload to plain
    addmm's decomposition, which takes the dtype for beta and fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")  # which logs the failure it raises
    disabled, fake_log.disabled = fake_log.disabled, fake_log.disabled or fake
    try:
        with contextlib.ExitStack() as stack:
            if fake:
                stack.enter_context(unset_fake_temporarily())
                stack.enter_context(FakeTensorMode())
            c = torch.zeros(16, 16, device=device)
            a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
            if not fake and not torch.equal(c, torch.full_like(c, 16.0)):
                return f"torch {torch.__version__}'s addmm summed wrong"
    except (RuntimeError, TypeError) as error:
        return f"torch {torch.__version__}'s addmm takes no fp32 accumulator beside bf16 operands ({error})"
    finally:
        fake_log.disabled = disabled
    return None


def wgrad_into(out: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, first: bool) -> None:
    """out = dyᵀ x, plus out unless `first` (whose content is then ignored, NaNs included), in out's dtype:
    dy [T, out_features] and x [T, in_features] in the GEMM's dtype, out [out_features, in_features]."""
    beta = 0.0 if first else 1.0
    if dy.dtype == out.dtype:
        out.addmm_(dy.t(), x, beta=beta)
    elif gemm_accumulates(dy, out):
        torch.addmm(out, dy.t(), x, beta=beta, out_dtype=out.dtype, out=out)
    else:  # a CPU: the same products (exact in fp32) and sums, on upcast operands
        out.addmm_(dy.t().to(out.dtype), x.to(out.dtype), beta=beta)


class MainGradAccumulator:
    """The store of the fused layers' sinks: each weight gradient is added into its parameter's main gradient in
    the reducer's bucket, by the GEMM that computes it."""

    accumulates = True  # LayerSink asks: `accumulate(param, dy, x)` now, not `stash` for later

    def __init__(self, reducer: GradReducer) -> None:
        self.reducer = reducer

    def accumulate(self, param: nn.Parameter, dy: torch.Tensor, x: torch.Tensor) -> None:
        self.accumulate_all(param, [(dy, x)])

    def accumulate_all(self, param: nn.Parameter, operands: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One micro-batch's weight gradient of `param`, Σ dyᵀ x over `operands`, added into its main gradient: one
        arrival for the reducer."""
        main_grad, first = self.reducer.main_grad(param)
        for n, (dy, x) in enumerate(operands):
            wgrad_into(main_grad, dy, x, first and n == 0)
        self.reducer.added_to_main_grad(param)

    def stash(self, param: nn.Parameter, compute: object) -> None:
        raise RuntimeError("gradient accumulation fusion takes plain GEMMs only; a layer with a precision recipe "
                           "keeps autograd's gradient (fuse_weight_grads leaves it out)")


def fuse_weight_grads(model: nn.Module, reducer: GradReducer, device: torch.device) -> int:
    """Make every linear layer of `model` that can (module docstring) add its weight gradient into `reducer`'s
    fp32 buckets in its GEMM; returns how many, and says in one line what stays unfused and why. Where this torch's
    CUDA GEMM cannot, none is fused, and the line says so."""
    if device.type == "cuda" and (problem := accumulator_problem(str(device))) is not None:
        log.warning("parallel.gradient_accumulation_fusion: %s; the weight gradients accumulate unfused (a newer "
                    "torch fuses them)", problem)
        return 0
    store = MainGradAccumulator(reducer)
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    fused, at_w = 0, 0
    kept = {"a precision recipe": 0, "a weight shared with another layer": 0,
            "rows shared over tensor-parallel ranks": 0, "a weight-gradient sink of another kind": 0}
    for module in linear_modules(model):
        sink = module.weight_grad_sink
        if module.gemm_recipe is not None:
            kept["a precision recipe"] += 1
        elif uses[id(module.weight)] > 1:  # its other use's gradient comes through autograd: one arrival, not two
            kept["a weight shared with another layer"] += 1
        elif getattr(module, "shared_rows", ()):  # TP's kv rows held by several ranks: summed over them by autograd
            kept["rows shared over tensor-parallel ranks"] += 1
        elif not module.weight.requires_grad:
            continue
        elif sink is None:
            module.weight_grad_sink = LayerSink(store, module)
            fused += 1
        elif isinstance(sink, LayerSink) and hasattr(sink.sink, "accumulator"):  # a zero-bubble store: fused at W
            sink.sink.accumulator, sink.fused = store, True
            at_w += 1
        else:
            kept["a weight-gradient sink of another kind"] += 1
    left = ", ".join(f"{n} with {why}" for why, n in kept.items() if n)
    w = f" ({at_w} of them at the zero-bubble schedule's W actions)" if at_w else ""
    log.info("parallel.gradient_accumulation_fusion: %d linear layers add their weight gradients into the gradient "
             "buckets in the GEMM%s%s%s", fused + at_w, w, f"; unfused: {left}" if left else "",
             "" if device.type == "cuda" else
             f" (on {device.type} emulated by an fp32 GEMM of upcast operands, slower than unfused: CUDA's bf16 "
             "GEMM with an fp32 accumulator has no CPU kernel)")
    return fused + at_w
