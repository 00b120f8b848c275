"""GPU tier: activation offload on CUDA, where its copies run on side streams with events and pinned buffers.

On CPU the same code runs synchronously (tests/unit/test_offload.py); here the stream ordering is what is
tested: gradients must be bit-identical to no offload (an unsynchronised copy would show as a wrong value; both runs
use deterministic kernels, so any difference is the copy's),
reloads must have been prefetched (no sync reloads, but for an offloaded last block), and the device's peak
allocated memory must fall.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megalm.config import ModelConfig
from megalm.model import GPT, init_weights
from megalm.offload import ActivationStore, LayerOffload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model() -> GPT:
    model = GPT(ModelConfig(num_layers=8, hidden_size=512, num_heads=8, vocab_size=512, seq_length=2048))
    init_weights(model, 0)
    return model.cuda()


def _step(model: GPT, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 512, (4096,), generator=gen).cuda()
    pos = torch.cat([torch.arange(2048), torch.arange(2048)]).cuda()
    cu = torch.tensor([0, 2048, 4096], dtype=torch.int32).cuda()
    logits = model(tokens, pos, cu, 2048)
    nn.functional.cross_entropy(logits.float(), tokens.roll(-1)).backward()


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_layer_offload_on_cuda_is_exact_prefetched_and_saves_memory(fraction, no_tf32, deterministic):
    plain, offloaded = _model(), _model()
    store = ActivationStore("cuda", offloaded.parameters())
    layers = LayerOffload(offloaded.layers, store, fraction)
    assert store.pool.pin
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for seed in range(2):
        _step(plain, seed)
    torch.cuda.synchronize()
    plain_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for seed in range(2):
        with layers.micro_batch():
            _step(offloaded, seed)
    torch.cuda.synchronize()
    offload_peak = torch.cuda.max_memory_allocated() - base
    for (name, a), (_, b) in zip(plain.named_parameters(), offloaded.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    assert store.sync_reloads == (2 if fraction == 1.0 else 0)
    assert store.offloaded_bytes == store.reloaded_bytes > 0
    assert offload_peak < plain_peak, (offload_peak, plain_peak)
    assert store.pool.allocations <= 2 * len(layers.offloaded[(0,)])  # buffers reused by the second micro-batch
