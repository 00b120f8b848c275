"""GPU tier: the ring's per-block attention kernels (megalm/parallel/context/ring_kernels.py) against the
reference kernel.

`block_forward` gives one block's (out, lse), `block_backward` its (dq, dk, dv) from the final out and lse.
Every kernel in `ring.KERNELS` when the tests run (torch_varlen; flash_attn where the package imports; any
kernel added since, such as torch's memory-efficient one; and `reference` itself, run on CUDA) runs on the
GPU, in bf16 and in fp32 where it takes fp32, the three kinds of block a zigzag ring step makes, with
ragged documents and GQA (8 query heads over 2 kv heads):

    diagonal  the local segments (2·c_d tokens per document) onto themselves, causal   (step s == r)
    front     all local queries onto the front chunks (c_d tokens) of a block, full     (s < r)
    back      the back queries (c_d tokens) onto a whole block (2·c_d tokens), full     (s > r)

and is compared, log-sum-exp included, with the reference kernel on the CPU from the same inputs. A
simulated ring (every rank's steps run in this process, no communication) checks that a kernel's lse
merges across steps as the reference's does. A kernel without a rule in `_skip_reason` must run in both dtypes.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megalm.model import attention
from megalm.parallel.context import ring_kernels as ring
from megalm.parallel.context.ring import ring_step_backward, ring_step_forward
from megalm.parallel.context.ring_kernels import block_backward, block_forward, block_kernel
from megalm.parallel.context.zigzag import shard_tensor, zigzag_plan
from tests.gpu.conftest import TF32, capability, eps, rel_error

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
CHUNKS = [1, 9, 64, 150, 3]  # c_d: tokens per zigzag chunk of each document
FLASH_KERNELS = {"torch_varlen", "flash_attn"}  # fp16/bf16 only, sm80+
KNOWN_KERNELS = {"reference", "torch_efficient", *FLASH_KERNELS}  # these must run where _skip_reason lets them
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# reference on CUDA against reference on the CPU: fp32 arithmetic on both (TF32 off), only the summation
# order differs (~1e-6); 1e-4 leaves room for the cancellation in dS = P (dP - delta).
EXACT = {"out": 1e-4, "grad": 1e-4, "lse": 1e-4}
# GPU kernels in bf16: out is rounded to bf16 (~2e-3 per element) and P to bf16 before P·V; the backward
# rounds P and dS to bf16 before its GEMMs; lse is fp32 statistics of exact bf16 products (only summation
# order and the fast exp2/log differ, ~1e-5), so it is held to an absolute 1e-3.
FAST_BF16 = {"out": 1.5 * eps(torch.bfloat16), "grad": 3 * eps(torch.bfloat16), "lse": 1e-3}
# GPU kernels in fp32: fp32 in and out, but the products may run on tensor cores in TF32 (10-bit mantissa
# operands, ~5e-4 relative), which is what such kernels on sm80+ do unless they emulate full fp32.
FAST_FP32 = {"out": 2 * eps(TF32), "grad": 4 * eps(TF32), "lse": 1e-3}  # backward: three TF32 GEMMs


def _cu(sizes: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)


LOCAL, HALF = [2 * c for c in CHUNKS], CHUNKS
BLOCKS = {"diagonal": (LOCAL, LOCAL, True), "front": (LOCAL, HALF, False), "back": (HALF, LOCAL, False)}


def _skip_reason(kernel: str, dtype: torch.dtype) -> str | None:
    """Why `kernel` does not run `dtype` on this GPU, or None (a kernel without a rule here is expected to run)."""
    if kernel == "reference":
        return None
    if kernel in FLASH_KERNELS and dtype not in (torch.float16, torch.bfloat16):
        return f"{kernel} is a flash kernel: fp16/bf16 only"
    if (kernel in FLASH_KERNELS or dtype == torch.bfloat16) and capability() < (8, 0):
        return f"{kernel} in {dtype} needs sm80+"
    if kernel == "flash_attn" and not attention._flash_attn_importable():
        return "flash-attn is not installed"
    return None


def _tolerances(kernel: str, dtype: torch.dtype) -> dict[str, float]:
    if kernel == "reference":
        return EXACT
    return FAST_BF16 if dtype == torch.bfloat16 else FAST_FP32


def _check(kernel: str, dtype: torch.dtype, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    tol = _tolerances(kernel, dtype)
    for name in ("out", "dq", "dk", "dv"):
        err = rel_error(got[name], want[name])
        limit = tol["out" if name == "out" else "grad"]
        assert err < limit, f"{kernel} {name}: relative error {err:.2e} >= {limit:.0e} against the CPU reference"
    lse_got, lse_want = got["lse"].double().cpu(), want["lse"].double().cpu()
    assert lse_got.shape == lse_want.shape, f"{kernel} lse: shape {tuple(lse_got.shape)}, expected [Tq, Hq]"
    assert torch.isfinite(lse_got).all(), f"{kernel}: lse not finite (every query row here has a key)"
    diff = (lse_got - lse_want).abs().max().item()
    assert diff < tol["lse"], f"{kernel} lse: max abs difference {diff:.2e} >= {tol['lse']:.0e}"


def _block(kernel: str, device: str, q, k, v, dout, cu_q, cu_k, causal: bool) -> dict[str, torch.Tensor]:
    """block_forward then block_backward (with the block's own out and lse, as the final ones) on `device`."""
    q, k, v, dout, cu_q, cu_k = (t.to(device) for t in (q, k, v, dout, cu_q, cu_k))
    max_q, max_k = int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
    scale = HEAD_DIM**-0.5
    out, lse = block_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, kernel=kernel)
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, kernel=kernel)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("block", sorted(BLOCKS))
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("kernel", ring.KERNELS)
def test_block_kernel_on_cuda_matches_reference(kernel: str, dtype_name: str, block: str, no_tf32) -> None:
    dtype = DTYPES[dtype_name]
    why = _skip_reason(kernel, dtype)
    if why is not None:
        pytest.skip(why)
    q_sizes, k_sizes, causal = BLOCKS[block]
    g = torch.Generator().manual_seed(len(block))
    tq, tk = sum(q_sizes), sum(k_sizes)
    q = torch.randn(tq, HEADS, HEAD_DIM, generator=g).to(dtype)
    k, v = (torch.randn(tk, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(tq, HEADS, HEAD_DIM, generator=g).to(dtype)
    try:
        got = _block(kernel, "cuda", q, k, v, dout, _cu(q_sizes), _cu(k_sizes), causal)
    except (ImportError, NotImplementedError) as e:  # a kernel added to KERNELS that this machine cannot run
        if kernel in KNOWN_KERNELS:
            raise
        pytest.skip(f"{kernel} cannot run here: {type(e).__name__}: {e}")
    assert got["out"].device.type == "cuda" and got["dq"].shape == q.shape and got["dk"].shape == k.shape
    want = _block("reference", "cpu", q, k, v, dout, _cu(q_sizes), _cu(k_sizes), causal)
    _check(kernel, dtype, got, want)


def _simulated_ring(kernel: str, device: str, shards, douts, plan, n: int) -> dict[str, list[torch.Tensor]]:
    """Every rank's forward steps, then every rank's backward steps, of an n-rank ring, in one process."""
    layout = plan.layout.to(device)
    shards = [[t.to(device) for t in shard] for shard in shards]
    scale = HEAD_DIM**-0.5
    outs, lses = [], []
    for r in range(n):
        q = shards[r][0]
        out = torch.zeros(q.shape, dtype=torch.float32, device=device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=device)
        for j in range(n):
            s = (r - j) % n
            ring_step_forward(q, shards[s][1], shards[s][2], out, lse, layout, r, s, scale, kernel)
        outs.append(out)
        lses.append(lse)
    grads = [[torch.zeros(t.shape, dtype=torch.float32, device=device) for t in shard] for shard in shards]
    for r in range(n):
        saved_out = outs[r].to(shards[r][0].dtype)  # the ring saves out in q's dtype for the backward
        for s in range(n):
            ring_step_backward(douts[r].to(device), shards[r][0], shards[s][1], shards[s][2], saved_out, lses[r],
                               grads[r][0], grads[s][1], grads[s][2], layout, r, s, scale, kernel)
    return {"out": outs, "lse": lses, "dq": [g[0] for g in grads], "dk": [g[1] for g in grads],
            "dv": [g[2] for g in grads]}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("kernel", [k for k in ring.KERNELS if k != "reference"])
def test_simulated_ring_on_cuda_matches_reference_ring(kernel: str, dtype_name: str, n: int, no_tf32) -> None:
    dtype = DTYPES[dtype_name]
    why = _skip_reason(kernel, dtype)
    if why is not None:
        pytest.skip(why)
    lengths = [13, 3, 200, 77]  # padded to multiples of 2n: every rank holds both chunks of every document
    plan = zigzag_plan(_cu(lengths), n)
    g = torch.Generator().manual_seed(n)
    total = sum(lengths)
    full = [torch.randn(total, h, HEAD_DIM, generator=g).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS)]
    shards = [[shard_tensor(t, plan, r) for t in full] for r in range(n)]
    douts = [torch.randn(shards[r][0].shape, generator=g).to(dtype) for r in range(n)]
    try:
        got = _simulated_ring(kernel, "cuda", shards, douts, plan, n)
    except (ImportError, NotImplementedError) as e:
        if kernel in KNOWN_KERNELS:
            raise
        pytest.skip(f"{kernel} cannot run here: {type(e).__name__}: {e}")
    want = _simulated_ring("reference", "cpu", shards, douts, plan, n)
    for r in range(n):
        _check(kernel, dtype, {name: values[r] for name, values in got.items()},
               {name: values[r] for name, values in want.items()})


def test_ring_block_kernel_on_cuda_is_a_flash_kernel_and_logged(caplog) -> None:
    """No silent O(T^2) fallback: in bf16 on sm80+ the ring's block kernel is a flash kernel, and the log names
    it; in fp32 (no flash kernel) it is torch's memory-efficient one where ring.py has it, else the reference,
    and the log says which and why."""
    if capability() < (8, 0):
        pytest.skip("flash kernels need sm80+")
    cuda = torch.device("cuda", torch.cuda.current_device())
    ring._log_kernel.cache_clear()
    with caplog.at_level(logging.INFO, logger="megalm"):
        bf16_kernel = block_kernel("auto", cuda, torch.bfloat16)
        fp32_kernel = block_kernel("auto", cuda, torch.float32)
    assert bf16_kernel in ("flash_attn", "torch_varlen")
    # (on Hopper auto resolves to cudnn, whose ring blocks run torch_varlen: the line then says why)
    assert any(m.startswith(f"ring attention block kernel: {bf16_kernel} on cuda bfloat16") for m in caplog.messages)
    assert fp32_kernel == ("torch_efficient" if "torch_efficient" in ring.KERNELS else "reference")
    assert any(m.startswith(f"ring attention block kernel: {fp32_kernel} on cuda float32 (sdpa returns no log-sum-exp")
               for m in caplog.messages), caplog.messages
