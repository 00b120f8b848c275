"""Zigzag context-parallel sharding, one process: plan/shard/unshard round trips, the padding rule,
and a simulated ring (every rank's steps run here, without communication) against full attention.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from megalm.data.batch import packed_from_documents
from megalm.model.attention import reference_varlen_attention
from megalm.parallel.context.attention import RingContext
from megalm.parallel.context.ring import ring_attention, ring_step_backward, ring_step_forward
from megalm.parallel.context.ring_kernels import block_backward, block_forward, block_kernel
from megalm.parallel.context.ulysses import ulysses_attention
from megalm.parallel.context.zigzag import (
    layout_from_local_cu_seqlens,
    shard_batch,
    shard_tensor,
    unshard,
    zigzag_plan,
)
from tests.unit.ring_sim import simulated_ring

DOCS = [[1], [5], [8], [7, 1, 12], [3, 9, 2, 30]]  # shorter than 2N, not divisible by 2N, several docs


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _batch(lengths: list[int]):
    """Documents of distinct token ids (100 + index), so a token tells where it came from."""
    total, docs = 0, []
    for n in lengths:
        docs.append(torch.arange(100 + total, 100 + total + n + 1))  # n + 1 tokens -> n inputs
        total += n + 1
    return packed_from_documents(docs)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("lengths", DOCS)
def test_plan_padding_and_chunks(n: int, lengths: list[int]) -> None:
    plan = zigzag_plan(_cu(lengths), n)
    for length, padded, chunk in zip(lengths, plan.padded_lengths, plan.chunk_sizes, strict=True):
        assert padded % (2 * n) == 0 and length <= padded < length + 2 * n and padded == 2 * n * chunk
    assert plan.local_tokens * n == sum(plan.padded_lengths)
    # rank i holds chunks i and 2n-1-i of every document, in that order
    start = 0
    for d, (padded, chunk) in enumerate(zip(plan.padded_lengths, plan.chunk_sizes, strict=True)):
        for i in range(n):
            local = plan.layout.indices[i, int(plan.local_cu_seqlens[d]):int(plan.local_cu_seqlens[d + 1])]
            want = [start + i * chunk + t for t in range(chunk)] + [start + (2 * n - 1 - i) * chunk + t
                                                                   for t in range(chunk)]
            assert local.tolist() == want
        start += padded


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("lengths", DOCS)
def test_shard_batch_round_trip(n: int, lengths: list[int]) -> None:
    batch = _batch(lengths)
    plan = zigzag_plan(batch.cu_seqlens, n)
    shards = [shard_batch(batch, plan, i) for i in range(n)]
    for field in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(unshard([getattr(s, field) for s in shards], plan), getattr(batch, field)), field
    assert sum(s.num_loss_tokens() for s in shards) == batch.num_loss_tokens()
    features = torch.randn(batch.num_tokens, 2, 3)
    assert torch.equal(unshard([shard_tensor(features, plan, i) for i in range(n)], plan), features)
    for i, shard in enumerate(shards):
        src = plan.local_source(i)
        pad = src < 0
        assert shard.num_tokens == plan.local_tokens
        assert torch.equal(shard.position_ids[~pad], batch.position_ids[src[~pad]])  # original positions
        assert (shard.loss_mask[pad] == 0).all() and (shard.tokens[pad] == 0).all() and (shard.labels[pad] == 0).all()
        # padding continues its document's positions (always after the last real token)
        assert torch.equal(shard.position_ids[pad], plan.padded_positions[plan.layout.indices[i]][pad])
        assert (shard.position_ids[pad] >= torch.tensor(lengths).repeat_interleave(
            torch.tensor(shard.doc_lengths))[pad]).all()
        assert torch.equal(shard.cu_seqlens, _cu(shard.doc_lengths))
        assert shard.doc_lengths == [2 * c for c in plan.chunk_sizes]
        assert shard.max_seqlen == max(shard.doc_lengths)
        layout = layout_from_local_cu_seqlens(shard.cu_seqlens, n)
        assert torch.equal(layout.indices, plan.layout.indices) and torch.equal(layout.back, plan.layout.back)


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="n >= 1"):
        zigzag_plan(_cu([4]), 0)
    with pytest.raises(ValueError, match="non-decreasing"):
        zigzag_plan(torch.tensor([0, 5, 3]), 2)
    plan = zigzag_plan(_cu([4, 4]), 2)
    with pytest.raises(ValueError, match="different document boundaries"):
        shard_batch(_batch([3, 5]), plan, 0)


def _qkv(total: int, hq: int, hkv: int, dim: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(total, h, dim, generator=gen, requires_grad=True) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize(("lengths", "hq", "hkv"), [([24], 2, 2), ([13, 3, 1, 20, 7], 4, 2), ([5, 16], 4, 1)])
def test_simulated_ring_matches_full_attention(n: int, lengths: list[int], hq: int, hkv: int) -> None:
    """All N ranks' ring steps in one process (the block masks, the lse merge, the backward) = full attention."""
    cu = _cu(lengths)
    plan, layout = zigzag_plan(cu, n), zigzag_plan(cu, n).layout
    q, k, v = _qkv(int(cu[-1]), hq, hkv)
    grad_out = torch.randn(q.shape)
    want = reference_varlen_attention(q, k, v, cu)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)

    scale = q.shape[-1] ** -0.5
    shards = [[shard_tensor(t.detach(), plan, i) for t in (q, k, v)] for i in range(n)]
    outs, lses = [], []
    for r in range(n):
        out = torch.zeros(shards[r][0].shape)
        lse = torch.full(out.shape[:2], float("-inf"))
        for j in range(n):
            s = (r - j) % n
            ring_step_forward(shards[r][0], shards[s][1], shards[s][2], out, lse, layout, r, s, scale)
        outs.append(out)
        lses.append(lse)
    torch.testing.assert_close(unshard(outs, plan), want, atol=1e-5, rtol=1e-5)

    grads = [[torch.zeros(t.shape) for t in shard] for shard in shards]
    for r in range(n):
        dout = shard_tensor(grad_out, plan, r)
        for s in range(n):
            ring_step_backward(dout, shards[r][0], shards[s][1], shards[s][2], outs[r], lses[r], grads[r][0],
                               grads[s][1], grads[s][2], layout, r, s, scale)
    for which, want_grad in enumerate(want_grads):
        torch.testing.assert_close(unshard([g[which] for g in grads], plan), want_grad, atol=1e-5, rtol=1e-5)


def test_single_rank_is_local_attention() -> None:
    """N == 1: no communication, plain varlen attention over the padded documents (no process group needed)."""
    cu = _cu([6, 1, 11])
    plan = zigzag_plan(cu, 1)
    q, k, v = _qkv(int(cu[-1]), 4, 2)
    grad_out = torch.randn(q.shape)
    want = reference_varlen_attention(q, k, v, cu)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    shards = [shard_tensor(t, plan, 0) for t in (q, k, v)]
    layout = layout_from_local_cu_seqlens(plan.local_cu_seqlens, 1)
    for got in (ring_attention(*shards, plan, [0], 0, backend="reference"),
                ulysses_attention(*shards, plan, [3], 0, backend="sdpa"),
                RingContext((5,), 0, layout, "ring").attend(*shards, "sdpa"),
                RingContext((5,), 0, layout, "a2a").attend(*shards, "reference")):
        full = unshard([got], plan)
        torch.testing.assert_close(full, want, atol=1e-5, rtol=1e-5)
        for g, w in zip(torch.autograd.grad(full, (q, k, v), grad_out, retain_graph=True), want_grads, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_ulysses_rejects_heads_not_divisible() -> None:
    plan = zigzag_plan(_cu([8]), 2)
    q, k, v = (t.detach() for t in _qkv(plan.local_tokens, 4, 1))
    with pytest.raises(ValueError, match="cp_comm=ring or a cp that divides the kv heads"):
        ulysses_attention(q, k, v, plan, [0, 1], 0, backend="reference")


def test_ring_rejects_mismatched_ring() -> None:
    plan = zigzag_plan(_cu([8]), 2)
    q, k, v = (t.detach() for t in _qkv(plan.local_tokens, 2, 2))
    with pytest.raises(ValueError, match="distinct ranks"):
        ring_attention(q, k, v, plan, [0, 1, 2], 0)
    with pytest.raises(ValueError, match="local tokens"):
        ring_attention(q[:-1], k, v, plan, [0, 1], 0)


def test_block_kernel_and_layout_device() -> None:
    """CPU backends map to the reference block kernel (sdpa returns no log-sum-exp); layouts move devices."""
    for backend in ("auto", "sdpa", "reference"):
        assert block_kernel(backend, torch.device("cpu"), torch.float32) == "reference"
    layout = zigzag_plan(_cu([5, 9]), 3).layout
    moved = layout.to("meta")
    assert moved.indices.device.type == "meta" and moved.n == 3 and moved.max_chunk == layout.max_chunk


# flash-attn >= 2.7 registers its varlen internals as torch.library.custom_op, whose Python signature is
# (*args, **kwargs). This stand-in does the same, on CPU, with the reference block kernel inside.
@torch.library.custom_op("megalm_test_flash::varlen_fwd", mutates_args=())
def _fake_flash_varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
    window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False, block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert window_size_left == -1 and window_size_right == -1 and softcap == 0.0 and not return_softmax
    out, lse = block_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    return out.to(q.dtype), lse.transpose(0, 1).contiguous(), q.new_empty(0), q.new_empty(2)


@torch.library.custom_op("megalm_test_flash::varlen_bwd", mutates_args=("dq", "dk", "dv"))
def _fake_flash_varlen_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
    causal: bool, window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: torch.Tensor | None,
    deterministic: bool, rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    grads = block_backward(dout, q, k, v, out, softmax_lse.transpose(0, 1), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, causal, softmax_scale)
    for buffer, grad in zip((dq, dk, dv), grads, strict=True):
        buffer.copy_(grad)
    return softmax_lse.new_empty(0)


@pytest.fixture
def fake_flash_attn(monkeypatch):
    package = types.ModuleType("flash_attn")
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_varlen_forward = _fake_flash_varlen_forward
    interface._flash_attn_varlen_backward = _fake_flash_varlen_backward
    package.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)


def test_ring_runs_flash_attn_internals_registered_as_custom_ops(fake_flash_attn) -> None:
    """The ring's flash_attn block kernel passes every argument to custom-op internals (whose signature
    hides their parameters) and gives the reference ring's output and gradients."""
    cu, n = _cu([13, 3, 20]), 3
    plan, layout = zigzag_plan(cu, n), zigzag_plan(cu, n).layout
    q, k, v = _qkv(int(cu[-1]), 4, 2)
    scale = q.shape[-1] ** -0.5
    shards = [[shard_tensor(t.detach(), plan, i) for t in (q, k, v)] for i in range(n)]
    results = {kernel: simulated_ring(shards, layout, scale, kernel) for kernel in ("reference", "flash_attn")}
    for got, want in zip(results["flash_attn"][0], results["reference"][0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(results["flash_attn"][1], results["reference"][1], strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_ring_kernel_is_logged_and_the_reference_refuses_huge_blocks(caplog, monkeypatch):
    """No silent O(T^2) fallback: the ring says which block kernel it runs, and the reference kernel refuses a
    block whose scores would not fit, naming the fix."""
    import logging

    from megalm.parallel.context import ring_kernels

    ring_kernels._log_kernel.cache_clear()
    with caplog.at_level(logging.INFO, logger="megalm"):
        assert block_kernel("auto", torch.device("cpu"), torch.float32) == "reference"
    assert "ring attention block kernel: reference on cpu float32 (sdpa returns no log-sum-exp" in caplog.text
    monkeypatch.setattr(ring_kernels, "REFERENCE_LIMIT_BYTES", 1000)
    cu = _cu([24])
    q, k, v = _qkv(24, 2, 2)
    with pytest.raises(ValueError, match="O\\(T\\^2\\) reference kernel on a 24 x 24-token block"):
        block_forward(q, k, v, cu, cu, 24, 24, True, 0.5)
