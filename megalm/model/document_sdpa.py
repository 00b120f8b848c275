"""torch SDPA over packed documents, where no varlen kernel runs them (a CPU; cuDNN's kernel on equal documents).
A sliding window (`model.sliding_window`) is a boolean band mask, SDPA's `is_causal` having no window: the queries in
blocks of at least the window's length, each block against only the keys its window reaches, under one band mask
they share (`causal_sdpa`), so that a document of S tokens costs S x (block + window - 1) scores and one
[block, block + window - 1] mask, not the S x S square and its mask (a 32K document's mask is 1 GiB a layer). Inside
a graph being compiled the document stays one call under the whole band mask: a loop over blocks would specialise
the graph on the document's length (a recompile for each new length, a second reader found).

Documents all of one length are one batched SDPA call on [B, H, S, D] views (`batched_sdpa`); unequal ones are one
call per document (`per_document_sdpa`), a Python loop over their offsets, which compiled blocks leave out of their
graphs (megalm/model/eager_attention.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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


MIN_BLOCK = 64  # the fewest queries a block of a windowed call holds: a short window is not one SDPA call a token


def causal_sdpa(sdpa: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: int | None) -> torch.Tensor:
    """`sdpa` of [..., S, D] views, causal, within a sliding `window` where one is set and shorter than S. Queries
    [start, end) see keys [start - window + 1, end): each block is one call against those keys alone, masked by a
    slice of one band (the relation i - j < window is the same in every block). A flash kernel skips the band's
    empty tiles; here the keys before the band's reach are not computed at all, and each block computes its
    rectangle of (block + window - 1) keys: (block + window - 1) / window of the band's scores, about twice from a
    window of 64 tokens on (blocks hold at least 64 queries). Compiling, one call (the module docstring)."""
    length = q.shape[-2]
    if window is None or window >= length:
        return sdpa(q, k, v, is_causal=True)
    if torch.compiler.is_compiling():
        return sdpa(q, k, v, attn_mask=window_mask(length, length, window, q.device))
    block = max(window, MIN_BLOCK)
    band = window_mask(block, block + window - 1, window, q.device)  # a whole block's: key columns from start - w + 1
    outs = []
    for start in range(0, length, block):
        end, first = min(start + block, length), max(0, start - window + 1)
        column = first - (start - window + 1)  # the block's first key in the band's columns
        mask = band[: end - start, column:column + end - first]
        outs.append(sdpa(q[..., start:end, :], k[..., first:end, :], v[..., first:end, :], attn_mask=mask))
    return torch.cat(outs, dim=-2)


def batched_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 dropout_p: float, scale: float | None, window: int | None = None) -> torch.Tensor:
    """Documents all max_seqlen long: one torch SDPA call on [B, H, S, D] views of the packed [T, H, D] tensors."""
    total, num_heads, head_dim = q.shape
    num_docs = cu_seqlens.numel() - 1
    to_bhsd = lambda t: t.reshape(num_docs, max_seqlen, t.shape[1], head_dim).transpose(1, 2)
    sdpa = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout_p, scale=scale,
                             enable_gqa=num_heads != k.shape[1])
    out = causal_sdpa(sdpa, to_bhsd(q), to_bhsd(k), to_bhsd(v), window)
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
            outs.append(causal_sdpa(sdpa, q_doc, k_doc, v_doc, window).squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)
