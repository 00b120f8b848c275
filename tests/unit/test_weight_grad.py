"""The zero-bubble B/W split: B leaves linear weights without gradient, W adds exactly the gradient a
plain backward gives, through AccumulateGrad (so post-accumulate-grad hooks fire once, at W)."""

from __future__ import annotations

import copy

import pytest
import torch

from megalm.model import GPT, init_weights
from megalm.model.linear import linear_modules
from megalm.model.moe import GroupedLinear, MoE
from megalm.parallel.pipeline.weight_grad import WeightGradStore, defer_weight_grads
from megalm.precision.install import apply_precision, set_precision_step
from tests.conftest import compose_config


def tiny_model() -> GPT:
    model = GPT(compose_config("model=gpt2_tiny", "model.num_layers=2", "model.hidden_size=64",
                               "model.num_heads=4", "model.num_kv_heads=4").model)
    init_weights(model, 3)
    return model


def batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (48,), generator=g)
    positions = torch.cat([torch.arange(30), torch.arange(18)])
    return tokens, positions, torch.tensor([0, 30, 48], dtype=torch.int32), 30


@pytest.mark.parametrize("autocast", [False, True])
def test_split_backward_equals_plain_backward(autocast):
    plain, split = tiny_model(), tiny_model()
    store = WeightGradStore()
    rerouted = defer_weight_grads(split, store)
    assert rerouted == 2 * 4  # qkv, o, up, down in each of 2 layers (the tied head is no Linear)
    fires: dict[str, int] = {}
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: fires.__setitem__(name, fires.get(name, 0) + 1))
    args = batch(plain.cfg.vocab_size)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else torch.enable_grad
    for model in (plain, split):
        for mb in range(2):  # two micro-batches accumulate
            with ctx():
                out = model(*args)
            with store.collect(("mb", mb)) if model is split else torch.enable_grad():
                out.float().pow(2).mean().mul(mb + 1).backward()
    linear_weights = [n for n, m in split.named_modules() if isinstance(m, torch.nn.Linear)]
    for name in linear_weights:
        assert split.get_submodule(name).weight.grad is None, f"{name}.weight got its gradient in B"
        assert f"{name}.weight" not in fires
    assert fires["final_norm.weight"] == 2  # non-linear parameters keep their gradient in B
    for mb in range(2):
        store.apply(("mb", mb))
    assert not store.pending
    plain_grads = dict(plain.named_parameters())
    tol = {"rtol": 2e-2, "atol": 1e-4} if autocast else {"rtol": 1e-5, "atol": 1e-7}
    for name, p in split.named_parameters():
        torch.testing.assert_close(p.grad, plain_grads[name].grad, **tol, msg=lambda m, n=name: f"{n}: {m}")
        assert fires[name] == 2, f"{name}: hook fired {fires.get(name)} times for 2 micro-batches"


def test_split_backward_defers_the_experts_grouped_gemms():
    """An MoE model's stacked expert weights wait for W too (the grouped GEMMs' deferred dW), and W gives exactly
    the gradients of a plain backward; the router keeps its gradient in B."""
    cfg = compose_config("model=moe_tiny", "model.num_layers=2", "model.hidden_size=64",
                         "model.moe.expert_ffn_hidden_size=32", "model.moe.aux_loss_coeff=0.01").model
    plain, split = GPT(cfg), GPT(cfg)
    for model in (plain, split):
        init_weights(model, 3)
    store = WeightGradStore()
    rerouted = defer_weight_grads(split, store)
    experts = [m.weight for m in split.modules() if isinstance(m, GroupedLinear)]
    assert rerouted == len(linear_modules(split)) + len(experts) and len(experts) == 2 * cfg.num_layers
    args = batch(plain.cfg.vocab_size)
    for model in (plain, split):
        for mb in range(2):
            out = model(*args)
            with store.collect(("mb", mb)) if model is split else torch.enable_grad():
                out.pow(2).mean().mul(mb + 1).backward()
    assert all(w.grad is None for w in experts)
    assert all(m.router.weight.grad is not None for m in split.modules() if isinstance(m, MoE))
    for mb in range(2):
        store.apply(("mb", mb))
    plain_grads = dict(plain.named_parameters())
    for name, p in split.named_parameters():
        torch.testing.assert_close(p.grad, plain_grads[name].grad, rtol=1e-6, atol=1e-9,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_store_refuses_backward_without_key_and_double_collect():
    model = tiny_model()
    store = WeightGradStore()
    defer_weight_grads(model, store)
    out = model(*batch(model.cfg.vocab_size))
    with pytest.raises(RuntimeError, match="outside WeightGradStore.collect"):
        out.sum().backward()
    store.collect(0)
    with pytest.raises(RuntimeError, match="already pending"):
        store.collect(0)


def test_no_grad_forward_is_plain():
    model = tiny_model()
    reference = copy.deepcopy(model)
    defer_weight_grads(model, WeightGradStore())
    args = batch(model.cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(*args), reference(*args), rtol=0, atol=0)


@pytest.mark.parametrize("recipe", ["fp8", "mxfp4_rtn", "mxfp4"])
def test_split_backward_composes_with_precision_recipes(recipe):
    """A layer with a precision recipe and a weight-gradient sink: B leaves the weight without gradient, and W
    computes exactly the recipe's dW of a plain backward (same GEMM, same call seed and FP8 scales)."""
    plain, split = tiny_model(), tiny_model()
    for model in (plain, split):
        apply_precision(model, recipe, seed=3)
        set_precision_step(model, step=2, micro_batch=1)
    store = WeightGradStore()
    assert defer_weight_grads(split, store) == 2 * 4
    assert all(m.gemm_recipe is not None and m.weight_grad_sink.sink is store for m in linear_modules(split))
    args = batch(plain.cfg.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_out, split_out = plain(*args), split(*args)
    plain_out.float().pow(2).mean().backward()
    with store.collect(0):
        split_out.float().pow(2).mean().backward()
    assert all(m.weight.grad is None for m in linear_modules(split)), "a weight got its gradient in B"
    store.apply(0)
    plain_grads = dict(plain.named_parameters())
    for name, p in split.named_parameters():
        torch.testing.assert_close(p.grad, plain_grads[name].grad, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def compiled_split_matches_eager(device: str, backend: str, tol: dict) -> None:
    """Compiled blocks (`compile_blocks`) of a model whose linears defer to a store: no graph break, no linear weight
    gradient and no post-accumulate-grad hook of one in B (a parameter that were an input of the block's graph would
    have its hooks called there, with no gradient), and at W the gradients of the same model in eager. Two
    micro-batches of two equal documents; `tests/gpu/test_gpu_compile.py` runs it through inductor on CUDA."""
    from torch._dynamo.utils import counters

    from megalm.model import choose_attention_backends
    from megalm.training.compile import compile_blocks

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = tiny_model().to(device), tiny_model().to(device)
    stores = {id(eager): WeightGradStore(), id(compiled): WeightGradStore()}
    for model in (eager, compiled):
        defer_weight_grads(model, stores[id(model)])
    choose_attention_backends(compiled, torch.device(device), torch.float32)  # as the trainer does, before compiling
    compile_blocks(compiled, backend)
    fires: dict[str, int] = {}
    for name, p in compiled.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: fires.__setitem__(name, fires.get(name, 0) + 1))
    tokens, _, _, _ = batch(eager.cfg.vocab_size)
    args = (tokens[:48].to(device), torch.arange(24, device=device).repeat(2),
            torch.tensor([0, 24, 48], dtype=torch.int32, device=device), 24)
    linears = {f"{n}.weight" for n, m in compiled.named_modules() if m in linear_modules(compiled)}
    for model in (eager, compiled):
        for mb in range(2):
            with stores[id(model)].collect(mb):
                model(*args).float().pow(2).mean().mul(mb + 1).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not linears & set(fires), f"hooks called in B: {sorted(linears & set(fires))}"
    assert all(compiled.get_parameter(name).grad is None for name in linears)
    for model in (eager, compiled):
        for mb in range(2):
            stores[id(model)].apply(mb)
    assert all(fires[name] == 2 for name in linears), fires
    eager_grads = dict(eager.named_parameters())
    for name, p in compiled.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name].grad, **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_compiled_blocks_defer_their_weight_gradients_as_eager_ones():
    compiled_split_matches_eager("cpu", "aot_eager", {"rtol": 1e-6, "atol": 1e-7})


def test_the_w_action_holds_one_weight_gradient_at_a_time():
    """Each parameter's dW goes into it (autograd, the DP hooks) as soon as its last stash under the key is computed,
    so the W action's peak is about one dW, not every deferred dW of the chunk at once (at 1.3B with pp 2, 1.1 GiB on
    the last stage: docs/benchmarks.md). Measured by the live-storage probe, not by the store."""
    from megalm.measure.storage import LiveStorages

    model = tiny_model()
    store = WeightGradStore()
    defer_weight_grads(model, store)
    for mb in range(2):
        with store.collect(mb):
            model(*batch(model.cfg.vocab_size)).float().pow(2).mean().backward()
    store.apply(0)  # the gradients exist: the second W action adds into them, and its dW are freed after
    weights = [m.weight for m in linear_modules(model)]
    grads = [w.grad.clone() for w in weights]
    with LiveStorages() as live:
        store.apply(1)
    every = sum(w.numel() * w.element_size() for w in weights)
    largest = max(w.numel() * w.element_size() for w in weights)
    assert all(not torch.equal(w.grad, g) for w, g in zip(weights, grads, strict=True))  # every one was added to
    assert live.bytes() == 0 and live.peak() <= 2 * largest < every / 2, (live.peak(), largest, every)
