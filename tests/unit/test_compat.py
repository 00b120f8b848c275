"""megalm.compat calls each torch's varlen_attn in the form that torch defines, read from its signature: 2.10's
(is_causal, no scale, no window), 2.11's (window_size=(-1, 0) for causal, scale, no enable_gqa) and 2.12+'s
(enable_gqa=True for grouped-query shapes). Stand-ins with those signatures record what megalm passed; on the
torch actually installed, the fake-CUDA tier calls the real one (tests/unit/test_fake_cuda.py)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from megalm import compat


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return {"is_causal": is_causal}


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    return {"scale": scale, "window_size": window_size}


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None):
    return {"scale": scale, "window_size": window_size, "enable_gqa": enable_gqa}


def varlen_unknown(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
    return {}


@pytest.fixture
def torch_varlen(monkeypatch):
    def use(fn):
        compat.reset_varlen_resolution()
        module = type("varlen", (), {"varlen_attn": staticmethod(fn)})
        monkeypatch.setitem(__import__("sys").modules, "torch.nn.attention.varlen", module)
    yield use
    compat.reset_varlen_resolution()


def _call(heads: int = 8, kv_heads: int = 2, scale: float | None = None):
    q, k = torch.empty(16, heads, 32), torch.empty(16, kv_heads, 32)
    return compat.varlen_attn(q, k, k, torch.tensor([0, 16], dtype=torch.int32), 16, scale=scale)


def test_each_signature_gets_causal_attention_its_own_way(torch_varlen):
    torch_varlen(varlen_2_10)
    assert _call() == {"is_causal": True}
    assert _call(scale=32**-0.5) == {"is_causal": True}  # the default scale, said explicitly: fine
    with pytest.raises(ValueError, match="1/sqrt.head_dim. only"):
        _call(scale=0.5)
    torch_varlen(varlen_2_11)
    assert _call(scale=0.5) == {"scale": 0.5, "window_size": (-1, 0)}
    torch_varlen(varlen_2_13)
    assert _call() == {"scale": None, "window_size": (-1, 0), "enable_gqa": True}
    assert _call(heads=2) == {"scale": None, "window_size": (-1, 0), "enable_gqa": False}


def test_an_unknown_form_is_not_used(torch_varlen):
    torch_varlen(varlen_unknown)
    assert not compat.varlen_attn_available()
    with pytest.raises(RuntimeError, match="unknown form"):
        _call()


def test_a_compiled_block_calls_it_without_a_graph_break(torch_varlen):
    """The form is resolved (and its fallbacks logged) once in eager, as attention backend selection does; the
    traced call reads the result. Resolving inside the trace logged there: one graph break per layer on a GPU."""
    def varlen_2_11_math(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1)):
        return query * scale + value.sum()

    torch_varlen(varlen_2_11_math)
    assert compat.varlen_attn_available()
    q, k = torch.randn(16, 8, 32), torch.randn(16, 2, 32)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda q, k: compat.varlen_attn(q, k, k, cu, 16, scale=0.5), backend="eager")
    torch.testing.assert_close(compiled(q, k), q * 0.5 + k.sum())
    assert not counters["graph_break"], dict(counters["graph_break"])  # (dynamo.explain does not count this one)


def test_a_compiled_block_selects_its_cuda_backend_without_a_graph_break(torch_varlen):
    """Context-parallel attention selects its backend inside the compiled block (ulysses.py, hierarchical.py, the
    one-rank ring): on a CUDA device in bf16 that reads flash-attn's import, the device's capability and this
    torch's varlen form, and logs. Dynamo takes the selection's result as a constant instead of tracing it."""
    from megalm.model.attention import select_attention_backend

    torch_varlen(varlen_2_11)  # a form that logs a fallback when resolved
    cuda = torch.device("cuda")

    def block(x):
        return x * (2 if select_attention_backend("auto", cuda, torch.bfloat16) == "cudnn" else 3)  # sm90: cudnn

    with compat.simulated_cuda((9, 0)):
        torch._dynamo.reset()
        counters.clear()
        out = torch.compile(block, backend="eager")(torch.ones(2))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert out.tolist() == [2, 2]  # sm90: cudnn, with flash-attn installed too


def test_the_constant_mark_is_torchs_own():
    """compat.constant_to_dynamo sets what torch.compiler.assume_constant_result sets (no torch._dynamo import)."""
    def mine():
        return 1

    def theirs():
        return 1

    marked = torch.compiler.assume_constant_result(theirs)
    assert {k: v for k, v in vars(marked).items()} == vars(compat.constant_to_dynamo(mine))
