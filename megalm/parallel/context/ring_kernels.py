"""The per-block attention kernels of the CP ring (ring.py): attention of one block of queries onto one block
of keys, returning the block's output and log-sum-exp so that the ring can merge blocks, and its flash-style backward.

Each returns (out, lse) in fp32 (fp64 for fp64 inputs): `reference` (explicit math with a mask, O(T^2) memory: the
CPU path and the oracle), `torch_varlen` (torch's built-in varlen flash kernels, the ones torch.nn.attention.varlen
uses) and `flash_attn` (the flash-attn package), both CUDA fp16/bf16 sm80+, and `torch_efficient` (torch's
memory-efficient kernels, xformers' cutlass ones: CUDA fp32/fp16, bf16 on sm80+), which the ring runs on CUDA
wherever flash cannot. `block_kernel` logs its choice. Hand-written adapters, because no library exposes varlen
attention with its log-sum-exp and a backward that takes the final (merged) out and lse on every backend.
"""

from __future__ import annotations

import functools
import logging

import torch

from megalm import compat
from megalm.model.attention import select_attention_backend

log = logging.getLogger("megalm")

KERNELS = ("reference", "torch_varlen", "flash_attn", "torch_efficient")


# The reference kernel materialises [heads, T_q, T_k] fp32 scores: past this many bytes a ring block refuses it.
REFERENCE_LIMIT_BYTES = 2 * 2**30


def _efficient_capable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's memory-efficient kernels run here: NVIDIA CUDA sm50+, fp32/fp16, bf16 on sm80+ (the
    rule torch's SDPA applies). Not ROCm: its builds run other kernels (aotriton), unchecked against this adapter."""
    capability = compat.cuda_capability(device)  # None on ROCm too
    if capability is None or dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    return capability >= ((8, 0) if dtype == torch.bfloat16 else (5, 0))


def block_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The per-block kernel for a model attention backend (auto|flash_attn|torch_varlen|cudnn|sdpa|reference).

    The flash kernel the backend resolves to (cudnn's: torch_varlen, as for its unequal micro-batches: a ring block
    is not a batch of equal documents); where it resolves to sdpa (no log-sum-exp) torch's
    memory-efficient kernels on CUDA, and the O(T^2) reference only where those do not run either, or when
    asked for. Logged once per (device, dtype): the ring has no silent fallback to the reference.
    """
    resolved = select_attention_backend(backend, device, dtype)
    if resolved == "cudnn":
        kernel = "torch_varlen"
    elif resolved in KERNELS:
        kernel = resolved
    else:  # sdpa returns no log-sum-exp
        kernel = "torch_efficient" if _efficient_capable(device, dtype) else "reference"
    _log_kernel(kernel, device.type, str(dtype).removeprefix("torch."), resolved)
    return kernel


@functools.cache
def _log_kernel(kernel: str, device: str, dtype: str, resolved: str) -> None:
    level = logging.INFO
    if kernel == resolved:
        why = ""
    elif resolved == "cudnn":
        why = " (the varlen flash kernel cudnn runs on documents of unequal lengths)"
    elif kernel == "torch_efficient":
        why = f" ({resolved} returns no log-sum-exp; flash kernels need fp16/bf16 on sm80+)"
    elif device == "cuda":
        level = logging.WARNING  # a GPU run with O(T^2) memory per block
        why = (f" ({resolved} returns no log-sum-exp; this GPU has no flash or memory-efficient kernel for {dtype}: "
               "O(T^2) memory per block)")
    else:
        why = f" ({resolved} returns no log-sum-exp; on a CUDA GPU the ring runs flash or memory-efficient kernels)"
    log.log(level, "ring attention block kernel: %s on %s %s%s", kernel, device, dtype, why)


def _check_reference_size(q: torch.Tensor, k: torch.Tensor) -> None:
    """Refuse the O(T^2)-memory reference kernel on a block too large for it, naming the fix."""
    size = q.shape[0] * k.shape[0] * q.shape[1] * 4
    if size > REFERENCE_LIMIT_BYTES:
        raise ValueError(f"ring attention would run the O(T^2) reference kernel on a {q.shape[0]} x {k.shape[0]}-token "
                         f"block ({size / 2**30:.1f} GiB of scores); run on a CUDA GPU with model.attention_backend="
                         "auto (flash or memory-efficient kernels; bf16 needs sm80+), use more CP ranks or a smaller "
                         "model.seq_length")


# ----------------------------------------------------------------------------------------------- kernels


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _doc_and_pos(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of a packed stream: its document and its position in it (no host sync: output_size)."""
    cu = cu.long()
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu[1:] - cu[:-1], output_size=total)
    return doc, torch.arange(total, device=cu.device) - cu[doc]


def _block_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, tq: int, tk: int, causal: bool) -> torch.Tensor:
    """bool [Tq, Tk]: same document, and key position <= query position when `causal` (top-left aligned)."""
    doc_q, pos_q = _doc_and_pos(cu_q, tq)
    doc_k, pos_k = _doc_and_pos(cu_k, tk)
    allowed = doc_q[:, None] == doc_k[None, :]
    return allowed & (pos_q[:, None] >= pos_k[None, :]) if causal else allowed


def _reference_scores(q, k, cu_q, cu_k, causal, scale):
    """Masked scores [Hq, Tq, Tk] in the accumulation dtype, and the GQA group size."""
    acc, group = accumulation_dtype(q.dtype), q.shape[1] // k.shape[1]
    qf = q.to(acc).transpose(0, 1)
    kf = k.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale
    mask = _block_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal).to(q.device)
    return scores.masked_fill(~mask, float("-inf")), group


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows without a key) replaced by 0, so exp(score - lse) gives 0 there, not nan."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


# torch's memory-efficient attention ops (aten, CUDA only). Module attributes, so a test can swap them for a
# stand-in on CPU; `torch_efficient` reaches them nowhere else.
EFFICIENT_FORWARD = torch.ops.aten._efficient_attention_forward.default
EFFICIENT_BACKWARD = torch.ops.aten._efficient_attention_backward.default
_LSE_ALIGN = 32  # the kernels keep each document's log-sum-exp row padded to a multiple of this


def _efficient_rows(cu_q: torch.Tensor, cu_k: torch.Tensor, tq: int,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(document, position, has a key) of each query row. Causal is bottom-right aligned, as in the flash kernels
    (custom_mask_type 2): row i of a document with n_q queries and n_k keys sees keys j <= i + n_k - n_q.

    Only for n_k >= n_q: on a document with fewer keys than queries torch's kernel (2.11, H200, 2026-11-28) let
    rows see keys past that diagonal, as if its negative offset skipped the per-element mask. The ring asks
    causal only of documents with as many queries as keys (block_forward)."""
    doc, pos = _doc_and_pos(cu_q, tq)
    n_q, n_k = (cu_q[1:] - cu_q[:-1]).long()[doc], (cu_k[1:] - cu_k[:-1]).long()[doc]
    return doc, pos, (pos + n_k - n_q >= 0) if causal else (n_k > 0)


def _heads_expanded(t: torch.Tensor, group: int) -> torch.Tensor:
    """[T, Hkv, D] -> [1, T, Hq, D]: the kernels want as many kv heads as query heads (GQA: h reads h // group)."""
    return (t if group == 1 else t.repeat_interleave(group, dim=1)).contiguous().unsqueeze(0)


def _efficient_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                       max_q: int, max_k: int, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The `torch_efficient` block forward: varlen (batch 1 + cu_seqlens), lse [documents, H, padded max_q]
    read back per row into [Tq, H]; rows without a key get out 0, lse -inf (the kernel writes lse 0 there)."""
    tq, hq = q.shape[:2]
    acc = {"dtype": torch.float32, "device": q.device}
    if min(tq, k.shape[0], max_q, max_k) == 0:  # nothing to attend (and the backward refuses max_seqlen 0)
        return torch.zeros(tq, hq, v.shape[-1], **acc), torch.full((tq, hq), float("-inf"), **acc)
    group = hq // k.shape[1]
    out, lse, *_ = EFFICIENT_FORWARD(
        query=q.contiguous().unsqueeze(0), key=_heads_expanded(k, group), value=_heads_expanded(v, group), bias=None,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=0.0,
        custom_mask_type=2 if causal else 0, compute_log_sumexp=True, scale=scale)
    doc, pos, has_key = _efficient_rows(cu_q, cu_k, tq, causal)
    lse = lse[doc, :, pos].masked_fill(~has_key[:, None], float("-inf"))  # [Tq, H]
    return out[0].float().masked_fill(~has_key[:, None, None], 0.0), lse


def _efficient_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `torch_efficient` block backward: the final lse [Tq, H] goes back into the forward's padded layout;
    an lse of -inf (a row without keys) goes in as 0, where the kernel would make nan of exp(-inf - -inf).
    GQA gradients of the expanded kv heads are summed per kv head (in fp32)."""
    hq, hkv = q.shape[1], k.shape[1]
    if min(q.shape[0], k.shape[0], max_q, max_k) == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    group = hq // hkv
    doc, pos, has_key = _efficient_rows(cu_q, cu_k, q.shape[0], causal)
    width = -(-max_q // _LSE_ALIGN) * _LSE_ALIGN
    lse_docs = torch.full((len(cu_q) - 1, hq, width), float("inf"), dtype=torch.float32, device=q.device)
    lse_docs[doc, :, pos] = finite_lse(lse.float())
    unused = torch.empty((), dtype=torch.long, device=q.device)  # no dropout: no philox state
    dq, dk, dv, _ = EFFICIENT_BACKWARD(
        grad_out_=dout.to(q.dtype).contiguous().unsqueeze(0), query=q.contiguous().unsqueeze(0),
        key=_heads_expanded(k, group), value=_heads_expanded(v, group), bias=None,
        out=out.to(q.dtype).contiguous().unsqueeze(0), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
        max_seqlen_k=max_k, logsumexp=lse_docs, dropout_p=0.0, philox_seed=unused, philox_offset=unused,
        custom_mask_type=2 if causal else 0, bias_requires_grad=False, scale=scale)
    # The kernel writes no gradient for a document it has nothing to loop over: dq of a document without keys
    # stayed as allocated (garbage on the first GPU run, H200, 2026-11-28). dk/dv of a document without queries
    # are zeroed likewise, defensively (no GPU test has reached that case yet). Both are 0.
    doc_k, _ = _doc_and_pos(cu_k, k.shape[0])
    has_query = (cu_q[1:] - cu_q[:-1] > 0)[doc_k][:, None, None]
    fold = lambda t: t[0] if group == 1 else t[0].unflatten(1, (hkv, group)).sum(2, dtype=torch.float32)
    return (dq[0].masked_fill(~has_key[:, None, None], 0.0), fold(dk).masked_fill(~has_query, 0.0),
            fold(dv).masked_fill(~has_query, 0.0))


def block_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, kernel="reference"):
    """Attention of q [Tq, Hq, D] onto k/v [Tk, Hkv, D] per document -> (out [Tq, Hq, D], lse [Tq, Hq]).

    Both in the accumulation dtype (fp32, fp64 for fp64 inputs). Rows without any key get out 0, lse -inf.
    `causal` is asked only of blocks whose documents have as many queries as keys (zigzag steps s == r), where
    the reference's top-left mask and the GPU kernels' bottom-right one agree.
    """
    if kernel == "reference":
        _check_reference_size(q, k)
        scores, group = _reference_scores(q, k, cu_q, cu_k, causal, scale)
        lse = torch.logsumexp(scores, dim=-1)  # [H, Tq]
        probs = torch.exp(scores - finite_lse(lse)[..., None])
        vf = v.to(scores.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        return (probs @ vf).transpose(0, 1), lse.transpose(0, 1)
    cu_q, cu_k = cu_q.to(torch.int32).contiguous(), cu_k.to(torch.int32).contiguous()
    if kernel == "torch_efficient":
        return _efficient_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    if kernel == "torch_varlen":
        out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                                               False, scale=scale)
    elif kernel == "flash_attn":
        from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

        res = _call(_flash_attn_varlen_forward, q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=0.0, softmax_scale=scale, causal=causal,
                    return_softmax=False)
        out, lse = res[0], res[1] if len(res) == 4 else res[5]  # flash-attn >= 2.6 | older 8-tuple
    else:
        raise ValueError(f"unknown ring attention kernel {kernel!r}; one of {', '.join(KERNELS)}")
    return out.float(), lse.float().transpose(0, 1)  # varlen kernels give lse as [H, Tq]


def block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, kernel="reference"):
    """Gradients (dq, dk, dv) of one block given the FINAL out and lse of the query rows (flash backward).

    P = exp(s - lse) is the block's share of the full softmax; with delta = rowsum(dO ∘ O):
    dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - delta), dQ = dS K · scale, dK = dSᵀ Q · scale (GQA: summed per kv head).
    """
    if kernel == "reference":
        scores, group = _reference_scores(q, k, cu_q, cu_k, causal, scale)
        acc = scores.dtype
        probs = torch.exp(scores - finite_lse(lse.to(acc)).transpose(0, 1)[..., None])  # [H, Tq, Tk]
        do, o = dout.to(acc).transpose(0, 1), out.to(acc).transpose(0, 1)
        qf = q.to(acc).transpose(0, 1)
        kf, vf = (t.to(acc).repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        delta = (do * o).sum(-1, keepdim=True)
        ds = probs * (do @ vf.transpose(1, 2) - delta)
        dq = (ds @ kf) * scale
        dk = (ds.transpose(1, 2) @ qf) * scale
        dv = probs.transpose(1, 2) @ do
        fold = lambda t: t.reshape(k.shape[1], group, *t.shape[1:]).sum(1).transpose(0, 1)  # [Tk, Hkv, D]
        return dq.transpose(0, 1), fold(dk), fold(dv)
    cu_q, cu_k = cu_q.to(torch.int32).contiguous(), cu_k.to(torch.int32).contiguous()
    if kernel == "torch_efficient":
        return _efficient_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)
    lse_ht = lse.float().transpose(0, 1).contiguous()
    dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
    if kernel == "torch_varlen":
        rng, unused = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
        return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse_ht, cu_q, cu_k, max_q, max_k, 0.0,
                                                        causal, rng, unused, scale=scale)
    if kernel == "flash_attn":
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _call(_flash_attn_varlen_backward, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse_ht, dq=dq, dk=dk,
              dv=dv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=0.0,
              softmax_scale=scale, causal=causal, deterministic=False, rng_state=None)
        return dq, dk, dv
    raise ValueError(f"unknown ring attention kernel {kernel!r}; one of {', '.join(KERNELS)}")


_FLASH_DEFAULTS = {"window_size_left": -1, "window_size_right": -1, "window_size": (-1, -1), "softcap": 0.0,
                   "alibi_slopes": None}


def _call(fn, **kwargs):
    """Call a flash-attn internal with the keywords its version knows (window/softcap/alibi defaults added)."""
    return compat.call_with_known_keywords(fn, _FLASH_DEFAULTS, **kwargs)
