"""GPU tier: the model's CUDA attention backends (megalm/model/attention.py) against the reference, in bf16.

One packed varlen batch: six documents of 1 to 300 tokens in one 513-token stream, grouped-query attention
(12 query heads over 4 kv heads), head dims 64 (the 125m model's) and 128. Each backend that runs on CUDA
(flash_attn when the package imports, torch_varlen, cudnn, sdpa) gets bf16 q/k/v and a bf16 output gradient; the
oracle is `reference` (explicit masked softmax in fp32) on the CPU, from the same bf16 values. Forward
output and the three input gradients are compared by relative Frobenius error. The ragged batch takes cudnn's
varlen route; a batch of equal documents takes its batched SDPA call, whose kernel on Hopper must be cuDNN's (the
profiler's kernel names say which ran).
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


def _runnable(backend: str, window: bool = False) -> str | None:
    """Why `backend` cannot run on this GPU in bf16 (with a sliding window), or None."""
    try:
        select_attention_backend(backend, torch.device("cuda"), torch.bfloat16, window=window)
    except Exception as e:  # ConfigError naming what is missing (package, sm80+)
        return str(e)
    return None


def _batch(head_dim: int, seed: int, lengths: list[int] = LENGTHS):
    """bf16 q [T, Hq, D], k/v [T, Hkv, D], output gradient [T, Hq, D] on CUDA; cu_seqlens int32; max length."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, HEADS, head_dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(total, KV_HEADS, head_dim, device="cuda", generator=g).bfloat16()
    v = torch.randn(total, KV_HEADS, head_dim, device="cuda", generator=g).bfloat16()
    dout = torch.randn(total, HEADS, head_dim, device="cuda", generator=g).bfloat16()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, dout, cu, max(lengths)


def _forward_backward(backend: str, q, k, v, dout, cu, max_len: int, dtype: torch.dtype, device: str,
                      window: int | None = None):
    """(out, dq, dk, dv) of `backend` on copies of the inputs in `dtype` on `device`."""
    leaves = [t.detach().to(device, dtype).requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, cu.to(device), max_len, backend, window=window)
    out.backward(dout.to(device, dtype))
    return (out, *(t.grad for t in leaves))


def _assert_matches_reference(backend: str, batch, window: int | None = None) -> None:
    got = _forward_backward(backend, *batch, torch.bfloat16, "cuda", window)
    want = _forward_backward("reference", *batch, torch.float32, "cpu", window)
    assert got[0].dtype == torch.bfloat16 and got[0].device.type == "cuda"
    for name, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want, (OUT_TOL, GRAD_TOL, GRAD_TOL, GRAD_TOL),
                               strict=True):
        err = rel_error(g, w)
        assert err < tol, f"{backend} {name}: relative error {err:.2e} >= {tol:.0e} against the fp32 reference"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "cudnn", "sdpa"])
def test_cuda_backend_matches_reference_on_packed_gqa_batch(backend: str, head_dim: int):
    why = _runnable(backend)
    if why is not None:
        pytest.skip(f"{backend} cannot run here: {why}")
    _assert_matches_reference(backend, _batch(head_dim, seed=head_dim))


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "cudnn", "sdpa"])
def test_cuda_backend_attends_within_a_sliding_window(backend: str):
    """model.sliding_window=64 over documents of up to 300 tokens: the varlen kernels' window_size (w - 1, 0) and
    SDPA's band mask against the reference's band (CPU-checked: tests/unit/test_sliding_window.py)."""
    why = _runnable(backend, window=True)
    if why is not None:
        pytest.skip(f"{backend} cannot run here: {why}")
    _assert_matches_reference(backend, _batch(64, seed=7), window=64)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("backend", ["cudnn", "sdpa"])
def test_equal_documents_run_one_batched_call_that_matches_reference(backend: str, head_dim: int):
    """Four documents of 256 tokens: the batched SDPA call, forward and backward. With cudnn on Hopper the kernels
    that ran must include cuDNN's (its forward and backward kernels' names carry "cudnn"), else the backend would be
    a slower path than its name says."""
    why = _runnable(backend)
    if why is not None:
        pytest.skip(f"{backend} cannot run here: {why}")
    batch = _batch(head_dim, seed=head_dim + 1, lengths=[256] * 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _forward_backward(backend, *batch, torch.bfloat16, "cuda")
        torch.cuda.synchronize()
    kernels = [event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    if backend == "cudnn" and capability()[0] == 9:
        assert any("cudnn" in name.lower() for name in kernels), sorted(set(kernels))[:20]
    _assert_matches_reference(backend, batch)


def test_auto_picks_a_flash_kernel_on_cuda_and_says_so(caplog):
    """No silent fallback: on sm80+ in bf16, auto resolves to flash_attn, cudnn (on Hopper) or torch_varlen (not the
    per-document sdpa loop), and the log names it; fp32 on CUDA goes to sdpa (flash kernels are fp16/bf16 only)."""
    if capability() < (8, 0):
        pytest.skip(f"flash kernels need sm80+, this GPU is sm{''.join(map(str, capability()))}")
    cuda = torch.device("cuda", torch.cuda.current_device())
    attention._resolve_backend.cache_clear()  # logged once per (device, dtype): forget earlier tests' lines
    with caplog.at_level(logging.INFO, logger="megalm"):
        backend = attention._resolve_backend("auto", cuda, torch.bfloat16, False)
        fp32_backend = attention._resolve_backend("auto", cuda, torch.float32, False)
    assert backend in ("flash_attn", "cudnn", "torch_varlen")
    assert fp32_backend == "sdpa"
    assert f"attention backend: {backend} (model.attention_backend=auto, {cuda}, bfloat16)" in caplog.text
    if capability()[0] == 9:
        assert backend == "cudnn", "on Hopper auto must prefer cuDNN's attention to the flash kernels"
    elif attention._flash_attn_importable():
        assert backend == "flash_attn", "flash-attn imports, so auto must prefer it off Hopper"


def test_selective_recompute_under_attention_dropout_keeps_the_forward_s_masks():
    """On CUDA, SDPA's fused kernel draws attention dropout from the default generator inside an op selective
    recompute keeps: kept, the recompute skipped the draw and the hidden dropout after it drew another mask (wrong
    gradients, ~100% off in a CPU stand-in, 2026-12-06). Now the kernel runs again: selective's gradients are none's."""
    from megalm.config import ModelConfig
    from megalm.model import GPT, init_weights
    from megalm.parallel.recompute import apply_recompute

    cfg = ModelConfig(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, ffn_hidden_size=256, vocab_size=256,
                      seq_length=256, dropout=0.2, attention_dropout=0.2, attention_backend="sdpa")
    tokens = torch.randint(0, 256, (256,), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(256, device="cuda")
    cu = torch.tensor([0, 256], dtype=torch.int32, device="cuda")
    grads = {}
    for mode in ("none", "selective"):
        model = GPT(cfg).cuda()
        init_weights(model, 0)
        apply_recompute(model, mode)
        torch.cuda.manual_seed(7)
        model(tokens, positions, cu, 256).float().pow(2).mean().backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads["none"].items():
        err = rel_error(grads["selective"][name], grad)
        assert err < 1e-4, f"{name}: selective recompute's gradient is {err:.2e} off recompute=none's"
