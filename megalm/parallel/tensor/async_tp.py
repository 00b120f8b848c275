"""Async tensor parallelism (`parallel.async_tp`, TorchTitan's `enable_async_tensor_parallel`): in compiled blocks
under sequence parallelism, each GEMM and the all-gather or reduce-scatter that feeds or drains it run as one
micro-pipelined op, the collective moving one rank's chunk while the GEMM multiplies the chunk before it
(Wang et al. 2022, "Overlap communication with dependent computation via decomposition"; Megatron-LM's
`--tp-comm-overlap` does the same through Transformer Engine's userbuffers).

megalm writes none of the pipelining; it is torch's: inductor's post-grad pass `_micro_pipeline_tp` finds, in each
compiled graph, an all-gather whose output the GEMMs read as their first operand, and a GEMM whose only reader is a
reduce-scatter, and replaces each pair by `symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter`, which
run over CUDA symmetric memory (peer-to-peer copies over NVLink) on the TP group. This module turns both on: the
group's symmetric memory, the pass in the blocks' inductor options (megalm/training/compile.py). Per block and
micro-batch the pass pairs the forward's q/k/v and gate/up gathers and the o/down reduce-scatters, and in the
backward the o/down input gradient's gather of dy and the q/k/v and gate/up input gradients' reduce-scatters
(tests/dist/test_async_tp.py counts them in megalm's graphs). Left exposed: the backward's re-gather of each
column-parallel input for its weight gradient (the gathered input is that GEMM's second operand, which the pass does
not split), and every collective of a block whose linears run as opaque ops (the FP8/MX recipes' linears,
gradient accumulation fusion's and the zero-bubble schedule's weight-gradient ops hide the backward's GEMMs).

Eager blocks have an overlap of their own, the backward's collectives left in flight beside the weight gradient's
GEMM (megalm/parallel/tensor/comm.py); async TP is the compiled blocks', the CUDA default. The fused ops run on CUDA
with NCCL only: on another backend megalm says so in one log line and compiles the blocks without the pass.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch.distributed as dist

log = logging.getLogger("megalm")


def async_tp_problem(group: dist.ProcessGroup) -> str | None:
    """Why torch's fused collective GEMMs cannot run on the TP `group` (None: they can)."""
    backend = str(dist.get_backend(group))
    if ":" in backend:  # per device type, "cuda:nccl,cpu:gloo" (FSDP's CPU offload): the GEMMs' tensors are CUDA's
        backend = dict(part.split(":", 1) for part in backend.split(",")).get("cuda", backend)
    if backend not in ("nccl", "fake"):  # fake: torch's, which megalm-estimate's ranks join in NCCL's place
        return (f"the TP group's backend is {backend}; torch's fused all-gather/reduce-scatter GEMMs run on CUDA "
                "symmetric memory with NCCL only")
    local = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's ranks on this node; TP's are consecutive ranks
    if backend == "nccl" and local is not None and int(local) % group.size():
        return (f"the TP group's {group.size()} ranks span nodes (LOCAL_WORLD_SIZE={local} is no multiple of them); "
                "symmetric memory joins the GPUs of one node")
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as e:  # a torch built without symmetric memory
        return f"this torch has no symmetric memory ({e})"
    return None


def enable_symmetric_memory(group: dist.ProcessGroup) -> None:
    """Register `group` for CUDA symmetric memory, which inductor's pass checks before it fuses the group's
    collectives. (torch 2.11-2.13 mark the call deprecated, yet their pass still reads the registration.)"""
    from torch.distributed import _symmetric_memory

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        _symmetric_memory.enable_symm_mem_for_group(group.group_name)


def async_tp_inductor_config(group: dist.ProcessGroup | None) -> dict[str, Any]:
    """The inductor options that make the compiled blocks' TP collectives micro-pipelined on `group`, its symmetric
    memory enabled; {} with one log line where they cannot run (`async_tp_problem`), and for a one-rank reference
    mesh (no TP group, nothing to fuse)."""
    if group is None:
        return {}
    if problem := async_tp_problem(group):
        log.warning("parallel.async_tp: %s; the compiled blocks keep TP's collectives apart from their GEMMs", problem)
        return {}
    enable_symmetric_memory(group)
    log.info("parallel.async_tp: the compiled blocks' TP all-gathers and reduce-scatters run micro-pipelined with "
             "their GEMMs (inductor's _micro_pipeline_tp over symmetric memory, %d ranks)", group.size())
    return {"_micro_pipeline_tp": True}
