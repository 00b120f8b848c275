"""Activation recomputation gives the same gradients, and recomputes what its mode says.

`full` re-runs whole blocks in backward (their matmuls included); `selective` re-runs the cheap ops
(norms, activations, RoPE) but none of the matmuls; `none` re-runs nothing. Counted by watching
which ops the backward pass executes.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalm.errors import ConfigError
from megalm.model import GPT, init_weights
from megalm.parallel.recompute import apply_recompute, stage_mode
from tests.conftest import compose_config

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def run(model: GPT, mode: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], Counter]:
    """Output, gradients, and the ops the backward pass ran."""
    model = copy.deepcopy(model)
    apply_recompute(model, mode)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (96,), generator=g)
    positions = torch.cat([torch.arange(64), torch.arange(32)])
    cu = torch.tensor([0, 64, 96], dtype=torch.int32)
    torch.manual_seed(7)  # dropout masks
    out = model(tokens, positions, cu, 64)
    loss = out.float().pow(2).mean()
    with OpCounter() as counter:
        loss.backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}, counter.ops


def test_recompute_modes_same_gradients_and_what_they_recompute():
    model = GPT(compose_config("model.dropout=0.1", "model.hidden_size=64", "model.num_layers=2").model)
    init_weights(model, 0)
    results = {mode: run(model, mode) for mode in ("none", "full", "selective")}
    out, grads, ops = results["none"]
    for mode in ("full", "selective"):
        torch.testing.assert_close(results[mode][0], out, rtol=0, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(results[mode][1][name], grad, rtol=1e-5, atol=1e-7)

    def matmuls(counter: Counter) -> int:
        return sum(counter[op] for op in MATMULS)

    def norms(counter: Counter) -> int:  # RMSNorm's forward: x * rsqrt(mean(x^2) + eps)
        return counter[aten.rsqrt.default]

    none, full, selective = ops, results["full"][2], results["selective"][2]
    assert matmuls(full) > matmuls(none), "full recomputation must re-run the blocks' matmuls"
    assert matmuls(selective) == matmuls(none), "selective recomputation must keep every matmul output"
    assert norms(selective) > norms(none) and norms(full) > norms(none), "norms must be recomputed"


def test_stage_mode():
    assert stage_mode("full", 1, 4) == "full"
    assert stage_mode(["full", "selective", "none", "none"], 1, 4) == "selective"
    with pytest.raises(ConfigError, match="one mode per pipeline rank"):
        stage_mode(["full"], 0, 2)
    with pytest.raises(ValueError, match="recompute mode"):
        apply_recompute(torch.nn.Linear(2, 2), "some")


@torch.library.custom_op("megalm_test::fake_flash_attn_fwd", mutates_args=())
def _fake_flash_attn(x: torch.Tensor) -> torch.Tensor:
    return x.tanh()


@_fake_flash_attn.register_fake
def _(x):
    return torch.empty_like(x)


_fake_flash_attn.register_autograd(lambda ctx, grad: grad * (1 - ctx.y ** 2),
                                   setup_context=lambda ctx, inputs, output: setattr(ctx, "y", output))


def test_selective_keeps_attention_custom_ops():
    """Selective recomputation saves attention kernels registered as custom ops (flash-attn's, torch's varlen,
    TE's), matched by name, instead of running them again in the backward (full recomputation re-runs it)."""
    class Block(torch.nn.Module):
        def forward(self, x):
            return _fake_flash_attn(x * 2).sum(-1, keepdim=True) * x

    reruns = {}
    for mode in ("selective", "full"):
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([Block()])
        apply_recompute(model, mode)
        out = model.layers[0](torch.randn(4, 3, requires_grad=True)).sum()
        with OpCounter() as counter:
            out.backward()
        reruns[mode] = sum(n for op, n in counter.ops.items() if "fake_flash_attn" in str(op))
    assert reruns == {"selective": 0, "full": 1}


@torch.library.custom_op("megalm_test::fake_flash_attn_dropout", mutates_args=())
def _fake_flash_attn_dropout(x: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """A GPU attention kernel's dropout, as flash-attn's and torch's fused kernels draw it: from the default
    generator, inside the op."""
    if dropout_p == 0:
        return x.tanh()
    return x.tanh() * torch.bernoulli(torch.full_like(x, 1 - dropout_p)) / (1 - dropout_p)


@_fake_flash_attn_dropout.register_fake
def _(x, dropout_p):
    return torch.empty_like(x)


def _fake_flash_attn_dropout_backward(ctx, grad):  # (the mask is re-drawn nowhere: tanh's derivative on kept entries)
    return grad * ctx.kept * (1 - ctx.x.tanh() ** 2) / (1 - ctx.p), None


_fake_flash_attn_dropout.register_autograd(
    _fake_flash_attn_dropout_backward,
    setup_context=lambda ctx, inputs, output: (setattr(ctx, "x", inputs[0]), setattr(ctx, "p", inputs[1]),
                                               setattr(ctx, "kept", output != 0)))


@pytest.mark.parametrize("attention_dropout", [0.0, 0.3])
def test_selective_reruns_attention_kernels_that_draw_dropout(attention_dropout):
    """On a GPU, attention dropout is drawn inside the fused kernel that selective keeps. Kept, the recompute skipped
    its draw, so the hidden dropout after it drew another mask than the forward's and the gradients were wrong (an
    audit, 2026-12-06: ~100% off); a kernel drawing dropout now runs again, one without dropout is still kept."""
    class Block(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.dropout(_fake_flash_attn_dropout(x * 2, attention_dropout), 0.5) * x

    grads, reruns = {}, {}
    for mode in ("none", "selective"):
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([Block()])
        apply_recompute(model, mode)
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
        torch.manual_seed(7)
        out = model.layers[0](x).sum()
        with OpCounter() as counter:
            out.backward()
        grads[mode] = x.grad
        reruns[mode] = sum(n for op, n in counter.ops.items() if "fake_flash_attn_dropout" in str(op))
    torch.testing.assert_close(grads["selective"], grads["none"], rtol=0, atol=0)
    assert reruns == {"none": 0, "selective": 1 if attention_dropout else 0}


def test_selective_keeps_the_gemms_compiled_linears_run_as_ops():
    """A compiled block runs some linears' GEMMs as custom ops (an FP8/MX recipe's, a zero-bubble layer's): selective
    recomputation saves their outputs, as it saves a plain GEMM's, rather than running the GEMM again in the backward
    (megalm::deferred_fprop was recomputed until it was named: a third read of each weight per micro-batch)."""
    from torch.utils.checkpoint import CheckpointPolicy

    import megalm.model.deferred_wgrad  # noqa: F401 - registers megalm::deferred_fprop
    import megalm.precision.compiled_linear  # noqa: F401 - registers megalm::recipe_linear, megalm::fp8_linear
    from megalm.parallel.recompute import _selective_policy

    ops = torch.ops.megalm
    import megalm.parallel.context.ring  # noqa: F401 - registers megalm::ring_attention (CP's, saved as attention is)

    for op in (ops.deferred_fprop.default, ops.recipe_linear.default, ops.fp8_linear.default,
               ops.ring_attention.default, torch.ops.aten.mm.default):
        assert _selective_policy(None, op) is CheckpointPolicy.MUST_SAVE, op
    assert _selective_policy(None, torch.ops.aten.mul.Tensor) is CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("strip", [False, True], ids=["as_traced", "tags_of_custom_functions_lost"])
def test_full_recompute_of_a_compiled_block_keeps_its_input_alone(strip, monkeypatch):
    """Under full recompute a compiled block saves its inputs (the layer input, RoPE's tables, the documents'
    offsets), its weights and buffers and the RNG state, no tensor it computes; and it trains as eager. Compiled by
    `trainer.compile_backend=aot_eager`, which runs megalm's joint-graph passes before its partition, as inductor
    does (compile.aot_eager_with_block_passes; dynamo's own aot_eager runs none). `tags_of_custom_functions_lost`:
    every forward op but the GEMMs and attention loses its checkpoint tag first, as torch 2.11 leaves the ops of the
    custom autograd.Functions in a full region (RMSNorm, RoPE, SwiGLU: pytorch#177396);
    `compile.recompute_custom_functions` must tag them again, or the partitioner saves their outputs (on torch 2.11
    it did, in the first case too: 7x the layer input)."""
    from megalm.model import choose_attention_backends
    from megalm.training import compile as compile_module

    still_tagged = {aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default}
    joint_pass, joint_graphs = compile_module.block_joint_pass, []

    def recorded_pass(graph):  # stripped first in the second case
        joint_graphs.append(graph)
        for node in graph.nodes if strip else ():
            if node.target not in still_tagged:
                node.meta.pop("recompute", None)
                node.meta.pop("ac_graph_id", None)
        joint_pass(graph)

    monkeypatch.setattr(compile_module, "block_joint_pass", recorded_pass)
    eager = GPT(compose_config("model.dropout=0.1", "model.hidden_size=64", "model.num_layers=1").model)
    init_weights(eager, 0)
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        apply_recompute(model, "full")
    torch._dynamo.reset()
    choose_attention_backends(compiled, torch.device("cpu"), torch.float32)  # before compile, as the trainer does
    compile_module.compile_blocks(compiled, "aot_eager")
    block, saved, inputs = compiled.layers[0], [], []
    forward = block.forward

    def recorded(*args, **kwargs):
        inputs.extend(t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            return forward(*args, **kwargs)

    block.forward = recorded
    tokens = torch.randint(0, eager.cfg.vocab_size, (96,), generator=torch.Generator().manual_seed(0))
    positions, cu = torch.arange(96), torch.tensor([0, 96], dtype=torch.int32)
    losses = []
    for model in (eager, compiled):
        torch.manual_seed(7)  # dropout masks
        losses.append(model(tokens, positions, cu, 96).float().pow(2).mean())
        losses[-1].backward()
    kept = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers(), *inputs)}
    activations = [t for t in saved if t.untyped_storage().data_ptr() not in kept and t.is_floating_point()]
    assert joint_graphs, "the block's joint graph never went through megalm's passes"
    assert not activations, [(tuple(t.shape), t.dtype) for t in activations]
    assert any(t.untyped_storage().data_ptr() == inputs[0].untyped_storage().data_ptr() for t in saved)
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
