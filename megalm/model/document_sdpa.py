"""torch SDPA over packed documents, where no varlen kernel runs them (a CPU; cuDNN's kernel on equal documents).
A sliding window (`model.sliding_window`) is a boolean band mask, SDPA's `is_causal` having no window.

Documents all of one length are one batched SDPA call on [B, H, S, D] views (`batched_sdpa`); unequal ones are one
call per document (`per_document_sdpa`), a Python loop over their offsets, which compiled blocks leave out of their
graphs (megalm/model/eager_attention.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def equal_documents(q: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> bool:
    """Every document is max_seqlen long, read from shapes alone (no device sync). N documents of lengths l_i with
    sum T (cu_seqlens[-1] == T) and max_seqlen = max l_i give N * max_seqlen >= T, equal only when every l_i is
    max_seqlen; every caller passes the exact longest document (a larger one only makes this False)."""
    return (cu_seqlens.numel() - 1) * max_seqlen == q.shape[0]


def window_mask(queries: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """[queries, keys] bool, True where query i (the last `queries` of `keys` positions) sees key j: j <= its position
    and within its last `window` keys, itself included (transformers' sliding window: i - j < window)."""
    position = torch.arange(keys - queries, keys, device=device)[:, None]
    key = torch.arange(keys, device=device)
    return (key <= position) & (key > position - window)


def _causal(length: int, window: int | None, device: torch.device) -> dict:
    """SDPA's keywords for causal attention over `length` tokens, within a sliding window where one is set and
    shorter than the tokens (a mask: SDPA's is_causal has no window)."""
    if window is None or window >= length:
        return {"is_causal": True}
    return {"attn_mask": window_mask(length, length, window, device)}


def batched_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 dropout_p: float, scale: float | None, window: int | None = None) -> torch.Tensor:
    """Documents all max_seqlen long: one torch SDPA call on [B, H, S, D] views of the packed [T, H, D] tensors."""
    total, num_heads, head_dim = q.shape
    num_docs = cu_seqlens.numel() - 1
    to_bhsd = lambda t: t.reshape(num_docs, max_seqlen, t.shape[1], head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), dropout_p=dropout_p, scale=scale,
                                         enable_gqa=num_heads != k.shape[1], **_causal(max_seqlen, window, q.device))
    return out.transpose(1, 2).reshape(total, num_heads, head_dim)


def per_document_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      dropout_p: float, scale: float | None, window: int | None = None) -> torch.Tensor:
    """Documents of unequal lengths without a varlen kernel (a CPU): one SDPA call per document. Eager under
    torch.compile (megalm/model/eager_attention.py): the loop runs over the documents' offsets read to the host as
    Python ints, on which a traced loop would be specialised and compiled again for almost every micro-batch (to
    dynamo's recompile limit, then eager with a warning); left out of the graph, the block breaks once here and its
    graphs compile for the token count."""
    sdpa = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout_p, scale=scale,
                             enable_gqa=q.shape[1] != k.shape[1])
    bounds = cu_seqlens.tolist()  # host copy: a device sync on CUDA, acceptable on this fallback path
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:  # [1, H, S, D] views of this document
            q_doc, k_doc, v_doc = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(sdpa(q_doc, k_doc, v_doc, **_causal(end - start, window, q.device)).squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)
