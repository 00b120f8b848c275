"""GPU tier: the model's CUDA attention backends (megalm/model/attention.py) against the reference, in bf16.

One packed varlen batch: six documents of 1 to 300 tokens in one 513-token stream, grouped-query attention
(12 query heads over 4 kv heads), head dims 64 (the 125m model's) and 128. Each backend that runs on CUDA
(flash_attn when the package imports, torch_varlen, sdpa) gets bf16 q/k/v and a bf16 output gradient; the
oracle is `reference` (explicit masked softmax in fp32) on the CPU, from the same bf16 values. Forward
output and the three input gradients are compared by relative Frobenius error.
"""

from __future__ import annotations

import logging

import pytest
import torch

from megalm.model import attention
from megalm.model.attention import select_attention_backend, varlen_attention
from tests.gpu.conftest import capability, eps, rel_error

pytestmark = pytest.mark.gpu

LENGTHS = [1, 17, 128, 300, 64, 3]  # ragged, a 1-token document included: the block-diagonal mask matters
HEADS, KV_HEADS = 12, 4
# bf16 output: every element is rounded to 8 significant bits (~2e-3 relative), and the flash kernels also
# round the probabilities to bf16 before the P·V product; the reference keeps fp32 throughout.
OUT_TOL = 1.5 * eps(torch.bfloat16)  # 0.0117
# gradients: the flash backward rounds P and dS to bf16 before each of its three GEMMs, so a bit more.
GRAD_TOL = 3 * eps(torch.bfloat16)  # 0.0234


def _runnable(backend: str) -> str | None:
    """Why `backend` cannot run on this GPU in bf16, or None."""
    try:
        select_attention_backend(backend, torch.device("cuda"), torch.bfloat16)
    except Exception as e:  # ConfigError naming what is missing (package, sm80+)
        return str(e)
    return None


def _batch(head_dim: int, seed: int):
    """bf16 q [T, Hq, D], k/v [T, Hkv, D], output gradient [T, Hq, D] on CUDA; cu_seqlens int32; max length."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(LENGTHS)
    q = torch.randn(total, HEADS, head_dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(total, KV_HEADS, head_dim, device="cuda", generator=g).bfloat16()
    v = torch.randn(total, KV_HEADS, head_dim, device="cuda", generator=g).bfloat16()
    dout = torch.randn(total, HEADS, head_dim, device="cuda", generator=g).bfloat16()
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, dout, cu, max(LENGTHS)


def _forward_backward(backend: str, q, k, v, dout, cu, max_len: int, dtype: torch.dtype, device: str):
    """(out, dq, dk, dv) of `backend` on copies of the inputs in `dtype` on `device`."""
    leaves = [t.detach().to(device, dtype).requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, cu.to(device), max_len, backend)
    out.backward(dout.to(device, dtype))
    return (out, *(t.grad for t in leaves))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "sdpa"])
def test_cuda_backend_matches_reference_on_packed_gqa_batch(backend: str, head_dim: int):
    why = _runnable(backend)
    if why is not None:
        pytest.skip(f"{backend} cannot run here: {why}")
    q, k, v, dout, cu, max_len = _batch(head_dim, seed=head_dim)
    got = _forward_backward(backend, q, k, v, dout, cu, max_len, torch.bfloat16, "cuda")
    want = _forward_backward("reference", q, k, v, dout, cu, max_len, torch.float32, "cpu")
    assert got[0].dtype == torch.bfloat16 and got[0].device.type == "cuda"
    for name, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want, (OUT_TOL, GRAD_TOL, GRAD_TOL, GRAD_TOL),
                               strict=True):
        err = rel_error(g, w)
        assert err < tol, f"{backend} {name}: relative error {err:.2e} >= {tol:.0e} against the fp32 reference"


def test_auto_picks_a_flash_kernel_on_cuda_and_says_so(caplog):
    """No silent fallback: on sm80+ in bf16, auto resolves to flash_attn or torch_varlen (not the per-document
    sdpa loop), and the log names it; fp32 on CUDA goes to sdpa (flash kernels are fp16/bf16 only)."""
    if capability() < (8, 0):
        pytest.skip(f"flash kernels need sm80+, this GPU is sm{''.join(map(str, capability()))}")
    cuda = torch.device("cuda", torch.cuda.current_device())
    attention._resolve_backend.cache_clear()  # logged once per (device, dtype): forget earlier tests' lines
    with caplog.at_level(logging.INFO, logger="megalm"):
        backend = attention._resolve_backend("auto", cuda, torch.bfloat16, False)
        fp32_backend = attention._resolve_backend("auto", cuda, torch.float32, False)
    assert backend in ("flash_attn", "torch_varlen")
    assert fp32_backend == "sdpa"
    assert f"attention backend: {backend} (model.attention_backend=auto, {cuda}, bfloat16)" in caplog.text
    if attention._flash_attn_importable():
        assert backend == "flash_attn", "flash-attn imports, so auto must prefer it"
