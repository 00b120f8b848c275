"""A key/value cache for sampling: each new token attends to the keys and values of the tokens before it, kept from
the forwards that made them, instead of recomputing the whole context for every token (what `megalm-generate` did
before 2026-12-07: O(n) forwards of up to n tokens for n new tokens, where a cache runs one of the prompt and then
one token each).

It is an `AttentionContext` (megalm/model/attention.py): the model passes it to every attention layer, which calls
`attend` in place of its own kernel, so the model needs no cache argument and no code of its own for decoding. The
layers call `attend` in their order, once each per forward: the i-th call of a forward is layer i. The cache holds
one document, the sample's context, at absolute positions 0, 1, ... (RoPE's and learned positions both encode them
into k or the hidden states before `attend`), at most `capacity` tokens: within the model's positions. Under a
sliding window a layer keeps only its last `window` keys and values, in a ring of that many slots (position p in slot
p mod window; softmax attention does not read the keys' order, their positions being in them already), and each
token attends to those alone: the cache and a decoding step's work stay bounded by the window, however long the
sample grows (Mistral's rolling buffer cache). A forward
that stops part-way (an error) leaves the layers' counts apart: a cache serves one sample, made afresh for each.
Hand-written because the model's packed varlen layout is not transformers' `Cache` classes' [batch, heads, seq, dim].
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megalm.model.document_sdpa import causal_sdpa, window_mask


class KVCache:
    """Keys and values of one document's tokens, per layer: [capacity, kv heads, head_dim] each, filled from the
    front. One forward feeds the tokens after those cached (the prompt first, then one sampled token at a time) at
    positions `length`, `length` + 1, ...; its queries attend causally to everything cached and to themselves."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        if num_layers < 1 or capacity < 1:
            raise ValueError(f"a KV cache needs layers and capacity (got {num_layers} layers, {capacity} tokens)")
        self.num_layers, self.capacity = num_layers, capacity
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._lengths = [0] * num_layers
        self._calls = 0  # attend calls so far: call c is layer c % num_layers

    @property
    def length(self) -> int:
        """Tokens cached (by every layer, between forwards)."""
        return self._lengths[-1]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, dropout_p: float = 0.0,
               scale: float | None = None, window: int | None = None) -> torch.Tensor:
        """q [n, heads, head_dim], k and v [n, kv heads, head_dim] of the n tokens after those cached -> [n, heads,
        head_dim]. `backend` is not read: torch SDPA runs it (a decoding step's one query row is no varlen kernel's
        case). No attention dropout (a model in evaluation mode): what a cached key saw would be drawn once."""
        if dropout_p:
            raise ValueError("a KV cache attends without dropout: call model.eval() first")
        layer = self._calls % self.num_layers
        self._calls += 1
        past, n = self._lengths[layer], q.shape[0]
        if past + n > self.capacity:
            raise ValueError(f"a KV cache of {self.capacity} tokens cannot take {n} after {past}")
        if window is not None and window < self.capacity:
            return self._attend_in_window(layer, q, k, v, scale, window)
        if self._keys[layer] is None:
            self._keys[layer] = k.new_empty(self.capacity, *k.shape[1:])
            self._values[layer] = v.new_empty(self.capacity, *v.shape[1:])
        keys, values = self._keys[layer], self._values[layer]
        keys[past:past + n], values[past:past + n] = k, v
        self._lengths[layer] = past + n
        # [1, heads, tokens, head_dim]: query i (position past + i) sees keys 0 ... past + i
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, keys[:past + n], values[:past + n]))
        mask = None
        if (n > 1 and past) or (window is not None and past + n > window):  # (a window: keys past it are masked)
            mask = window_mask(n, past + n, past + n if window is None else window, q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None and n > 1,
                                             scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1)

    def _attend_in_window(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                          window: int) -> torch.Tensor:
        """`attend` under a window shorter than the capacity, over the layer's ring of `window` slots. One new token
        is written into its slot and attends to every filled slot: exactly its window. Several (a prompt) attend to
        the window's keys before them, read out of the ring in order, and to their own, under the band mask (the
        first, with none before them, in blocks: document_sdpa.causal_sdpa); then the last `window` of all those go
        into the ring."""
        past, n = self._lengths[layer], q.shape[0]
        if self._keys[layer] is None:
            self._keys[layer] = k.new_empty(window, *k.shape[1:])
            self._values[layer] = v.new_empty(window, *v.shape[1:])
        ring_k, ring_v = self._keys[layer], self._values[layer]
        self._lengths[layer] = past + n
        if n == 1:
            ring_k[past % window], ring_v[past % window] = k[0], v[0]
            filled = min(past + 1, window)
            keys, values, mask = ring_k[:filled], ring_v[:filled], None
        else:
            first = max(0, past - window + 1)  # the earliest position the first new query sees
            held = torch.arange(first, past, device=k.device) % window
            keys, values = torch.cat([ring_k[held], k]), torch.cat([ring_v[held], v])
            mask = window_mask(n, keys.shape[0], window, q.device) if past else None
            kept = torch.arange(max(first, past + n - window), past + n, device=k.device)
            ring_k[kept % window], ring_v[kept % window] = keys[kept - first], values[kept - first]
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, keys, values))
        sdpa = functools.partial(F.scaled_dot_product_attention, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        if n > 1 and not past:  # a prompt: its queries in blocks against their window's keys, no [n, n] mask
            return causal_sdpa(sdpa, qh, kh, vh, window)[0].transpose(0, 1)
        return sdpa(qh, kh, vh, attn_mask=mask)[0].transpose(0, 1)
