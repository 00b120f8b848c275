"""`trainer.compile=true`: each transformer block is one graph, forward and backward, with no graph break and no
recompile per step, for the single-process layouts whose blocks hold no Python that dynamo cannot trace; and a
compiled run trains exactly as the eager one (fp32). Documents of equal length: the CPU's per-document SDPA loop
for unequal ones reads `cu_seqlens` on the host and stays eager (`torch.compiler.disable`: one graph break by design,
and no graph compiled per document count)."""

from __future__ import annotations

import functools
import logging
import re
from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters

from megalm import compat
from megalm.model.linear import linear_modules
from megalm.training.trainer import Trainer
from tests.conftest import compose_config, loss_kernel_graphs, packed_layouts

EQUAL_DOCS = ["data=synthetic", "data.varlen=true", "data.synthetic.fixed_doc_length=33", "model.seq_length=32"]


def compiled_trainer(tmp_path, backend: str, *overrides: str) -> Trainer:
    torch._dynamo.reset()
    counters.clear()
    cfg = compose_config("trainer.compile=true", f"trainer.compile_backend={backend}", *EQUAL_DOCS, *overrides)
    return Trainer(cfg, tmp_path)


def assert_compiles_once(trainer: Trainer, steps: int = 20, first_step: int = 0) -> None:
    """`steps` training steps of a trainer from `compiled_trainer` (those from `first_step` on: the earlier ones ran
    already) with no graph break, and the block's code, shared by all blocks, compiled once and never again
    (recompute's inner function is a frame of its own on torch 2.9: at most 2). The loss's two chunk kernels are
    compiled too, each once (one chunk of a micro-batch's tokens)."""
    for step in range(first_step, steps):
        trainer.train_step(step)
    assert not counters["graph_break"], dict(counters["graph_break"])
    loss = sum(loss_kernel_graphs().values())
    assert loss == 2, loss
    assert counters["frames"]["total"] - loss <= 2, dict(counters["frames"])
    assert counters["stats"]["unique_graphs"] - loss <= 2, dict(counters["stats"])

FP32_ACTIVATIONS = ["precision.autocast=false"]
RECIPES = ["fp8", "fp8_delayed", "fp8_rowwise", "mxfp8", "mxfp4"]  # the FP8/MX recipes' linears: one op pair each


@pytest.mark.parametrize("overrides", [
    [], ["parallel.recompute=full"], ["parallel.recompute=selective"], ["precision=bf16"],
    ["precision=bf16", "parallel.gradient_accumulation_fusion=true"],
    ["offload.enabled=true"], ["offload.enabled=true", "offload.min_tensor_bytes=0", "parallel.recompute=full"],
    *[[f"precision={recipe}"] for recipe in RECIPES], ["precision=mxfp4", "parallel.recompute=selective"],
    ["precision=mxfp4_rtn", "parallel.recompute=full"], ["model.sliding_window=6"],
], ids=["fp32", "recompute_full", "recompute_selective", "bf16", "bf16_fused_wgrad", "offload", "offload_recompute",
        *RECIPES, "mxfp4_selective", "mxfp4_rtn_full", "sliding_window"])
def test_blocks_compile_to_one_graph_without_breaks(tmp_path, overrides):
    assert_compiles_once(compiled_trainer(tmp_path, "eager", *overrides))


def test_a_break_is_seen(tmp_path, monkeypatch):
    """The count above can fail: a log call inside the block's forward (what attention's backend selection did)
    breaks its graph."""
    from megalm.model import gpt

    original = gpt.TransformerBlock.forward

    def logging_forward(self, *args, **kwargs):
        logging.getLogger("megalm").debug("inside the block")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(gpt.TransformerBlock, "forward", logging_forward)
    trainer = compiled_trainer(tmp_path, "eager")
    trainer.train_step(0)
    assert counters["graph_break"]


def test_unequal_documents_on_a_cpu_leave_the_per_document_loop_eager_and_train_as_eager(tmp_path):
    """On a CPU, documents of unequal lengths run one SDPA call per document (no varlen kernel). That loop stays out
    of the graph: its only break is the call into it, and no frame resumes inside it, where dynamo had compiled the
    loop unrolled on the documents' offsets, read as Python ints (15 recompiles in 20 steps, then its recompile limit
    under inductor). The compiled steps (aot_eager, fp32) give eager's losses."""
    from megalm.model.document_sdpa import per_document_sdpa
    from megalm.model.gpt import TransformerBlock

    overrides = ["data=synthetic", "data.varlen=true"]
    eager = Trainer(compose_config(*overrides, "trainer.compile=false"), tmp_path / "eager")
    torch._dynamo.reset()
    counters.clear()
    compiled = Trainer(compose_config("trainer.compile=true", "trainer.compile_backend=aot_eager", *overrides),
                       tmp_path / "compiled")
    layouts = set()
    forward = TransformerBlock.forward

    def counting_forward(self, x, cu_seqlens, *args, **kwargs):  # the eager model's blocks (the compiled ones hold
        layouts.add(tuple(cu_seqlens.tolist()))  # their compiled forward as an attribute of their own)
        return forward(self, x, cu_seqlens, *args, **kwargs)

    for step in range(20):
        with mock.patch.object(TransformerBlock, "forward", counting_forward):
            expected = eager.train_step(step).loss
        assert compiled.train_step(step).loss == pytest.approx(expected, rel=1e-6, abs=1e-7), step
    unequal = {offsets for offsets in layouts
               if len({b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)}) > 1}
    assert len(unequal) > 8, layouts  # more layouts of unequal documents than dynamo's recompile limit
    breaks = dict(counters["graph_break"])
    assert breaks and all(per_document_sdpa.__name__ in reason for reason in breaks), breaks
    frames = {code.co_name for code in torch._dynamo.utils.guard_failures}
    assert not any("sdpa" in name and name.startswith("torch_dynamo_resume") for name in frames), frames
    assert not counters["stats"].get("recompile_limit_hit"), dict(counters["stats"])


MOE = ["model=moe_tiny", "precision=bf16", "model.moe.capacity_factor=1.25", "model.moe.seq_aux_loss_coeff=0.01"]


@pytest.mark.parametrize("overrides", [
    [], ["parallel.recompute=full"], ["parallel.recompute=selective"],
    ["offload.enabled=true", "offload.min_tensor_bytes=0"],
    ["model.moe.router_score=sigmoid", "model.moe.num_shared_experts=1", "model.moe.shared_ffn_hidden_size=64",
     "model.moe.first_k_dense=1", "model.moe.bias_update_rate=0.01"],
], ids=["moe", "recompute_full", "recompute_selective", "offload", "sigmoid_shared_dense_bias"])
def test_moe_blocks_compile_whole_and_train_as_eager(tmp_path, overrides):
    """An MoE model's blocks are one graph without breaks too (the router with a capacity, the switch, sequence and
    z losses, the grouped GEMMs; one graph more for the dense first layer), compiled once over 20 steps, and train
    as eager: the same losses and logged balancing losses each step, the same weights, load counts and router bias.
    The counts are added by an op that asks at run time whether it is a recomputation in the backward (eager's
    count is checked in tests/unit/test_moe.py; a check dynamo cannot trace broke the graph and, through AOT autograd,
    moved the losses by 5e-5). bf16 (the grouped GEMM traces bf16 only), through AOT autograd (inductor's front end;
    dynamo's `eager` backend cannot recompute them: test_the_eager_backend_refuses_to_recompute_moe_blocks)."""
    eager = Trainer(compose_config(*EQUAL_DOCS, *MOE, *overrides, "trainer.compile=false"), tmp_path / "eager")
    compiled = compiled_trainer(tmp_path / "compiled", "aot_eager", *MOE, *overrides)
    for step in range(5):
        a, b = eager.train_step(step), compiled.train_step(step)
        assert a.loss == pytest.approx(b.loss, rel=1e-6), step
        assert a.moe.keys() == b.moe.keys() and "moe_seq_aux_loss" in a.moe, (a.moe, b.moe)
        for name, value in a.moe.items():
            assert value == pytest.approx(b.moe[name], rel=1e-5, abs=1e-7), (step, name, a.moe, b.moe)
    for (name, p), (_, q) in zip(eager.model.named_parameters(), compiled.model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-3, msg=lambda m, name=name: f"{name}: {m}")
    for (name, a), (_, b) in zip(eager.model.named_buffers(), compiled.model.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert_compiles_once(compiled, first_step=5)


def test_the_eager_backend_refuses_to_recompute_moe_blocks():
    """Dynamo's `eager` backend runs a compiled block's checkpoint with the module's buffers as inputs, so the
    router's load counts change after the checkpoint saved them and its recomputation fails deep in the backward:
    refused in one line before the run."""
    from megalm.errors import ConfigError
    from megalm.training.validation import validate_run

    for recompute in ("full", "selective", "[none,full]"):
        pp = ["parallel.pp=2"] if recompute.startswith("[") else []
        cfg = compose_config("trainer.compile=true", "trainer.compile_backend=eager", *MOE, *pp,
                             f"parallel.recompute={recompute}")
        with pytest.raises(ConfigError, match="compile_backend=aot_eager or inductor") as error:
            validate_run(cfg, world_size=2 if pp else 1)
        assert "\n" not in str(error.value)
    for fine in (["trainer.compile_backend=aot_eager", "parallel.recompute=full"], ["trainer.compile_backend=eager"]):
        validate_run(compose_config("trainer.compile=true", *MOE, *fine))


def test_async_tp_refuses_blocks_inductor_does_not_compile():
    """Async TP is a pass of inductor's: refused in one line where the blocks run eager (trainer.compile=false, or
    null resolved to eager, as on this CPU) or compile with another backend; accepted with inductor."""
    from megalm.errors import ConfigError
    from megalm.training.validation import validate_run

    sp = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.async_tp=true"]
    aot = "trainer.compile_backend=aot_eager"
    for bad, why in ((["trainer.compile=false"], "trainer.compile=false"), ([], "trainer.compile=false"),
                     (["trainer.compile=true", aot], aot)):
        with pytest.raises(ConfigError, match=f"which {re.escape(why)}.* does not run; set trainer.compile=true") \
                as error:
            validate_run(compose_config(*sp, *bad), world_size=2, device=torch.device("cpu"))
        assert "\n" not in str(error.value)
    assert validate_run(compose_config(*sp, "trainer.compile=true"), world_size=2).parallel.async_tp


def test_full_recompute_of_a_drawing_recipe_is_refused_compiled():
    """A compiled block's recipe op returns its call seed for the backward; under full recompute the partitioner
    re-ran the op in the backward, which drew the next seed: mxfp4's dgrad and wgrad rounded with other numbers than
    eager's (gradients 0.56 apart, relative; an audit, 2026-12-04). Refused for the recipes that draw; those that do
    not (mxfp4_rtn, the FP8 ones) recompute the same scales and run."""
    from megalm.errors import ConfigError
    from megalm.training.validation import validate_run

    with pytest.raises(ConfigError) as error:
        validate_run(compose_config("precision=mxfp4", "parallel.recompute=full", "trainer.compile=true"))
    assert "use parallel.recompute=selective" in str(error.value) and "\n" not in str(error.value)
    for fine in (["precision=mxfp4_rtn", "parallel.recompute=full"],
                 ["precision=mxfp4", "parallel.recompute=selective"],
                 ["precision=mxfp4", "parallel.recompute=full", "trainer.compile=false"]):
        validate_run(compose_config("trainer.compile=true", *fine))


@pytest.mark.parametrize("overrides", [[], ["offload.enabled=true", "offload.min_tensor_bytes=0"],
                                       ["precision=fp8", *FP32_ACTIVATIONS],
                                       ["precision=fp8_delayed", *FP32_ACTIVATIONS],
                                       ["precision=mxfp4", *FP32_ACTIVATIONS],
                                       ["precision=mxfp4", *FP32_ACTIVATIONS, "parallel.recompute=selective"],
                                       ["model.sliding_window=6"]],
                         ids=["plain", "offload", "fp8", "fp8_delayed", "mxfp4", "mxfp4_selective", "sliding_window"])
def test_compiled_training_matches_eager(tmp_path, overrides):
    """aot_eager traces forward and backward through AOT autograd (what inductor compiles) and runs the traced
    graphs: the same losses (1e-6) and weights as eager, in fp32. With layer offload, the compiled graph's saved
    activations still go through the offload store's hooks (they stay outside the compiled forward). Under the
    FP8/MX recipes the linears' GEMMs are opaque ops running the eager recipe code
    (megalm/precision/compiled_linear.py): the same seeds per call and step (mxfp4's stochastic rounding), the same
    amax histories (fp8_delayed), the same FP8 scales from forward to backward; fp8's casts are ops of the graph,
    the same math as eager's; in practice the same numbers bit for bit. Their activations stay fp32 here (no
    autocast): in bf16, AOT's decompositions of the elementwise ops round differently from eager on
    torch 2.9 (a 5e-5 loss difference from the first backward, with or without a recipe)."""
    eager = Trainer(compose_config(*EQUAL_DOCS, *overrides, "trainer.compile=false"), tmp_path / "eager")
    compiled = compiled_trainer(tmp_path / "compiled", "aot_eager", *overrides)
    # FP8/MX: 3 steps. Rounding to 8 bits can turn a last-bit difference of AOT's fp32 decompositions into one
    # quantization step: on torch 2.9, fp8_delayed's weights part by 5e-4 at the 4th step (2.13: never)
    steps = 3 if FP32_ACTIVATIONS[0] in overrides else 5
    for step in range(steps):
        a, b = eager.train_step(step), compiled.train_step(step)
        assert a.loss == pytest.approx(b.loss, rel=1e-6, abs=1e-7), step
    for (name, p), (_, q) in zip(eager.model.named_parameters(), compiled.model.named_parameters(), strict=True):
        # AdamW divides by sqrt(v) + eps: a rounding difference of a near-zero gradient moves a weight by ~1e-6
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert not counters["graph_break"]
    assert eager.model.state_dict().keys() == compiled.model.state_dict().keys(), "checkpoints keep their names"
    if "precision=fp8_delayed" in overrides:  # cast in the graphs with the histories' scales, the amaxes handed
        # back through each layer's sink: the histories are eager's
        pairs = [(m.gemm_recipe, n.gemm_recipe) for m, n in zip(linear_modules(eager.model),
                                                                linear_modules(compiled.model), strict=True)
                 if getattr(m, "gemm_recipe", None) is not None]
        assert pairs and all(ours._graph_sink is not None for _, ours in pairs), "the casts in the graph"
        for theirs, ours in pairs:
            for name in ("x", "w", "dy"):
                assert ours.state.amax[name].count == theirs.state.amax[name].count == steps - 1
                torch.testing.assert_close(ours.state.amax[name].history, theirs.state.amax[name].history,
                                           rtol=1e-6, atol=0)
    if "offload.enabled=true" in overrides:  # the compiled blocks' activations went to the host and back, as the
        # eager ones did; AOT's partitioner saves fewer of them (it recomputes cheap ops in the backward), so fewer
        # bytes move
        stores = eager.parallel.offload_store, compiled.parallel.offload_store
        assert 0 < stores[1].offloaded_bytes <= stores[0].offloaded_bytes


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.sequence_parallel=true"],
                                    ["parallel.pp=2", "parallel.pp_schedule=zb"]], ids=["sp", "zb"])
def test_compiled_recipes_refuse_what_their_op_lacks(layout):
    """The recipe op has no input gather (SP) and no deferred weight gradient (ZB): refused in one line, not a
    graph break per layer."""
    from megalm.errors import ConfigError
    from megalm.training.validation import validate_run

    cfg = compose_config("trainer.compile=true", "precision=fp8", *layout)
    with pytest.raises(ConfigError, match="trainer.compile=true runs precision=fp8 without") as error:
        validate_run(cfg, world_size=2)
    assert "\n" not in str(error.value)


def test_rings_of_other_ranks_and_sizes_share_the_compiled_graph(monkeypatch):
    """HDP gives each micro-batch its own ring: what varies (ranks, ring size, layout) reaches the ring op in
    tensors, so five rings of 2 to 4 ranks compile at most twice (the second graph takes the ring's size as
    dynamic), never once per ring. The op's communication is stubbed: only dynamo's view of the call counts."""
    from megalm.parallel.context import ring
    from megalm.parallel.context.attention import RingContext
    from megalm.parallel.context.ring_kernels import accumulation_dtype
    from megalm.parallel.context.zigzag import zigzag_layout
    from megalm.parallel.progress import Progress

    monkeypatch.setattr(ring, "_ring_forward", lambda q, k, v, *_: (
        torch.zeros_like(q), torch.zeros(q.shape[:2], dtype=accumulation_dtype(q.dtype))))
    torch._dynamo.reset()
    counters.clear()
    attend = torch.compile(lambda q, k, v, context: context.attend(q, k, v, "reference") * 2, backend="aot_eager")
    for ranks in [(0, 1), (2, 3), (0, 1, 2), (0, 1, 2, 3), (1, 0)]:
        layout = zigzag_layout([4, 4], len(ranks))
        q, k, v = (torch.randn(layout.local_tokens, 2, 8) for _ in range(3))
        attend(q, k, v, RingContext(ranks, 0, layout, progress=Progress()))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_the_cudnn_backend_compiles_each_of_its_two_kernels_once_dynamic(monkeypatch):
    """Backend cudnn (auto on Hopper) branches on the shapes: equal documents take a batched SDPA call, unequal ones
    torch's varlen kernel (a stand-in op here: the real one is CUDA's). Over the fake-CUDA tier's 20 micro-batches
    (equal documents first, then unequal ones of several token counts) the block compiles three times, as with
    torch_varlen alone: the first graph, then the document count and the token count made dynamic. Equal documents
    after that add one graph, the dynamic one of the other branch, and no more: four at most, and no break."""
    import itertools

    from megalm.config import ModelConfig
    from megalm.model import GPT, Attention
    from megalm.training.compile import compile_blocks

    varlen_calls = []  # counted where the op runs, not where dynamo traces (a traced append would be guarded on)

    @torch.library.custom_op("megalm_test::varlen_stand_in", mutates_args=())
    def stand_in_op(q: torch.Tensor) -> torch.Tensor:
        varlen_calls.append(1)
        return q * 2

    stand_in_op.register_fake(lambda q: torch.empty_like(q))
    stand_in_op.register_autograd(lambda ctx, grad: grad * 2)
    monkeypatch.setattr(compat, "varlen_attn",
                        lambda q, k, v, cu_seqlens, max_seqlen, scale=None, window=None: stand_in_op(q))
    torch.manual_seed(0)
    model = GPT(ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=128, seq_length=128))
    for module in model.modules():
        if isinstance(module, Attention):
            module.chosen[("cpu", torch.float32, False)] = "cudnn"
    compile_blocks(model, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    frames = []
    for docs in [*packed_layouts(20), (48, 48), (32,) * 4, (16,) * 8, (64,)]:  # then equal documents again
        cu = torch.tensor([0, *itertools.accumulate(docs)], dtype=torch.int32)
        ids = torch.randint(0, 128, (sum(docs),))
        pos = torch.cat([torch.arange(n) for n in docs])
        model(ids, pos, cu, max(docs)).sum().backward()
        frames.append(counters["frames"]["total"])
    assert len(varlen_calls) == 2 * 16  # each layer of the 16 unequal micro-batches, and only those
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert frames[19] == 3 and frames[-1] == 4, frames


def test_selective_recompute_keeps_the_compiled_recipe_gemms(tmp_path, monkeypatch):
    """Selective recompute saves GEMM outputs; in a compiled block an FP8 recipe's linear is one opaque op, which it
    must save as a GEMM too: each linear runs once per micro-batch, not again in the backward."""
    from megalm.model.linear import linear_modules
    from megalm.precision import linear

    calls = []
    fprop = linear.RecipeGemms.fprop
    monkeypatch.setattr(linear.RecipeGemms, "fprop", lambda self, *args: calls.append(1) or fprop(self, *args))
    trainer = compiled_trainer(tmp_path, "aot_eager", "precision=fp8", "parallel.recompute=selective",
                               "trainer.global_batch_size=2", "trainer.micro_batch_size=1")
    trainer.train_step(0)  # compiles
    calls.clear()
    trainer.train_step(1)
    recipe_layers = [m for m in linear_modules(trainer.model) if m.gemm_recipe is not None]
    assert len(calls) == 2 * len(recipe_layers), (len(calls), len(recipe_layers))
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_the_whole_model_is_one_graph(tmp_path, precision):
    """On documents of equal length the whole model's forward, embedding to logits, compiles to one graph
    (fullgraph=True raises at the first break), and stays one over three steps."""
    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(compose_config(*EQUAL_DOCS, f"precision={precision}"), tmp_path)
    trainer.model.forward = torch.compile(trainer.model.forward, backend="eager", fullgraph=True)
    for step in range(3):
        trainer.train_step(step)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _recording_backend(graphs: dict[str, list[str]]):
    """aot_eager that keeps the text of every forward and backward graph it compiles in `graphs`."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def recorder(kind: str):
        def record(gm, _inputs):
            graphs.setdefault(kind, []).append(str(gm.graph))
            return make_boxed_func(gm.forward)
        return record

    return aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))


def train_compiled_against_eager(tmp_path, overrides: list[str], fp8_layers_per_block, graphs: int = 2
                                 ) -> tuple[Trainer, Trainer, dict[str, list[str]]]:
    """3 steps of `overrides` in eager and with blocks compiled by a recording aot_eager: the same losses (1e-6) and
    weights; no break; one graph each (shared by every block; on torch 2.9 recompute's inner function is a frame of
    its own, and the graphs of both hold the block's GEMMs: at most `graphs`), every graph with GEMMs holding a
    `_scaled_mm` per FP8 layer of the block (`fp8_layers_per_block(model)`) in its forward, with fast accumulation,
    and two in its backward, without. Returns both trainers and the graphs' text."""
    from megalm.training.compile import compile_blocks

    eager = Trainer(compose_config(*overrides), tmp_path / "eager")
    torch._dynamo.reset()
    counters.clear()
    compiled = Trainer(compose_config(*overrides), tmp_path / "compiled")
    recorded: dict[str, list[str]] = {}
    compile_blocks(compiled.model, _recording_backend(recorded))
    for step in range(3):
        a, b = eager.train_step(step), compiled.train_step(step)
        assert a.loss == pytest.approx(b.loss, rel=1e-6, abs=1e-7), step
    for (name, p), (_, q) in zip(eager.model.named_parameters(), compiled.model.named_parameters(), strict=True):
        # the losses above are the equivalence; here no weight may move apart by more than an AdamW step of a
        # near-zero gradient whose last bits differ (lr 3e-3): on torch 2.9, AOT's fp32 decompositions move 3 of
        # 20,480-24,576 weights by up to 2.3e-4 in 3 steps (2.11 and 2.13: all within 1e-5)
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-3, msg=lambda m, name=name: f"{name}: {m}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    per_block = fp8_layers_per_block(compiled.model)
    assert len(recorded["forward"]) == len(recorded["backward"]) <= graphs, recorded
    gemms = {kind: {graph.count("aten._scaled_mm.default") for graph in recorded[kind]} - {0} for kind in recorded}
    assert per_block > 0 and gemms == {"forward": {per_block}, "backward": {2 * per_block}}, gemms
    # the forward GEMMs accumulate fast, the gradients' promote (fp8.py: TE's and torchao's setting)
    fast_gemm = re.compile(r"aten\._scaled_mm\.default\]\(args = \([^)]*, True\)")  # its last argument, use_fast_accum
    fast = {kind: {len(fast_gemm.findall(graph)) for graph in recorded[kind]} - {0} for kind in recorded}
    assert fast == {"forward": {per_block}, "backward": set()}, fast
    return eager, compiled, recorded


@pytest.mark.parametrize("layout", [[], ["offload.enabled=true", "offload.min_tensor_bytes=0"],
                                    ["parallel.recompute=selective"]], ids=["plain", "offload", "recompute"])
def test_where_scaled_mm_runs_fp8_trains_compiled_as_eager_with_its_gemms_in_the_graph(tmp_path, scaled_mm_on_cpu,
                                                                                     layout):
    """Where torch._scaled_mm takes a layer's GEMMs, a compiled block runs them as ops of its graph, from the weight
    FP8 copies made before the block runs (once per optimizer step), and no op pair: the forward graph has a
    `_scaled_mm` per recipe layer, the backward two, and neither calls the recipe's ops. Trained 3 steps (the weights
    change after each, so a stale copy would show from the second loss on): the same losses and weights as eager.
    With layer offload the weight copies the graph keeps for its backward stay in place, as weights do: the compiled
    blocks offload what the eager ones do, give or take the scales of the calls (4 bytes each, which the eager path
    keeps in the call's state, not in autograd's saved tensors; the copies would be 1 byte a weight)."""
    from megalm.model.linear import linear_modules

    recipe_layers = lambda model: sum(m.gemm_recipe is not None for m in linear_modules(model.layers[1]))  # noqa: E731
    overrides = [*EQUAL_DOCS, "precision=fp8", *FP32_ACTIVATIONS, *layout]
    eager, compiled, graphs = train_compiled_against_eager(tmp_path, overrides, recipe_layers)
    assert "megalm" not in "".join(graphs["forward"] + graphs["backward"])
    assert all(getattr(m.gemm_recipe, "graph_weights", None) is None for m in linear_modules(compiled.model)), \
        "the copies are the graph's inputs for one call only"
    if "offload.enabled=true" in layout:
        eager_bytes, compiled_bytes = eager.parallel.offload_store.offloaded_bytes, \
            compiled.parallel.offload_store.offloaded_bytes
        assert eager_bytes > 0 and abs(compiled_bytes - eager_bytes) < 1024, (compiled_bytes, eager_bytes)


@pytest.mark.parametrize("layout", [[], ["parallel.recompute=selective"]], ids=["plain", "recompute"])
def test_where_scaled_mm_runs_delayed_scaling_trains_compiled_as_eager(tmp_path, scaled_mm_on_cpu, layout):
    """fp8_delayed where torch._scaled_mm runs: the GEMMs and the casts with the histories' scales in the graph, the
    weights' copies made before the block runs from the weight's history (one per optimizer step), the amaxes back
    through each layer's sink; 3 steps of the same losses, weights and histories as eager. One graph more than fp8's:
    the first step's casts scale by the current amax (the histories are empty), as eager's first step does."""
    from megalm.model.linear import linear_modules

    recipe_layers = lambda model: sum(m.gemm_recipe is not None for m in linear_modules(model.layers[1]))  # noqa: E731
    overrides = [*EQUAL_DOCS, "precision=fp8_delayed", *FP32_ACTIVATIONS, *layout]
    eager, compiled, graphs = train_compiled_against_eager(tmp_path, overrides, recipe_layers, graphs=2)
    assert "megalm" not in "".join(graphs["forward"] + graphs["backward"])
    for m, n in zip(linear_modules(eager.model), linear_modules(compiled.model), strict=True):
        if m.gemm_recipe is not None:
            for name in ("x", "w", "dy"):
                theirs, ours = m.gemm_recipe.state.amax[name], n.gemm_recipe.state.amax[name]
                assert ours.count == theirs.count > 0 and torch.equal(ours.history, theirs.history), name


def test_without_a_per_step_weight_cache_the_graph_holds_no_fp8_weights(scaled_mm_on_cpu):
    """Under FSDP no optimizer is watched (a layer's weight exists only while its unit is gathered) and the recipe
    casts it after every gather: a graph that took the copies as inputs would keep each one from its forward to its
    backward, a whole FP8 model per rank. The layer's GEMMs then stay in the op pair, which casts in the backward."""
    from megalm.model.linear import Linear
    from megalm.precision.layer_state import LinearState
    from megalm.precision.linear import RecipeGemms
    from megalm.precision.recipes import get_recipe

    layer = Linear(64, 32, bias=False)
    state = LinearState("layer")
    layer.gemm_recipe = gemms = RecipeGemms(get_recipe("fp8"), state, module=layer)
    gemms.prepare_graph_weights()
    assert gemms.graph_weights is None
    state.weights_version.watch(torch.optim.SGD(layer.parameters(), lr=0.1))
    gemms.prepare_graph_weights()
    rows, columns, inverse = gemms.graph_weights
    assert rows.shape == columns.shape == layer.weight.shape and columns.t().is_contiguous()
    assert isinstance(rows, torch.nn.Parameter) and not rows.requires_grad  # a weight to dynamo and to offload


def test_a_blocks_fp8_weight_copies_are_cast_in_one_call_once_per_optimizer_step(tmp_path, scaled_mm_on_cpu):
    """Before a compiled block runs, the FP8 copies its layers' GEMMs read are made in one call for the block
    (`fp8.quantize_weights`; a call per weight cost the host about 40 us each, 96 a step at 1.3B), once per optimizer
    step: the step's second micro-batch finds them. The call's copies are the per-weight cast's, bit for bit, and
    column-major as torch._scaled_mm takes them."""
    from megalm.model.linear import linear_modules
    from megalm.precision import fp8

    calls: list[int] = []

    def checked(weights, dtype):
        copies = original(weights, dtype)
        for w, (rows, columns, scale, inverse) in zip(weights, copies, strict=True):
            q, reference_scale = fp8.quantize_current(w.detach(), dtype)
            assert torch.equal(rows.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale, reference_scale)
            assert torch.equal(inverse, fp8.inverse_scale(reference_scale))
            assert torch.equal(columns.view(torch.uint8), q.view(torch.uint8)) and columns.t().is_contiguous()
        calls.append(len(weights))
        return copies

    original = fp8.quantize_weights
    trainer = compiled_trainer(tmp_path, "eager", "precision=fp8", "trainer.global_batch_size=4",
                               "trainer.micro_batch_size=2")
    blocks = len(trainer.model.layers)
    per_block = sum(m.gemm_recipe is not None for m in linear_modules(trainer.model.layers[0]))
    with mock.patch.object(fp8, "quantize_weights", checked):
        for step in range(3):
            trainer.train_step(step)
            assert calls == [per_block] * blocks, (step, calls)  # two micro-batches, one cast of each block's weights
            calls.clear()


def test_a_replaced_weight_gets_copies_of_its_own(scaled_mm_on_cpu):
    """The copies' token holds the weight by weak reference: a layer whose weight is replaced while the old one lives
    on (an optimizer, a caller holding it) gets copies of the new weight, and the check does not compare the two
    tensors (two live weak references compare their referents with ==, which for tensors raises)."""
    from megalm.model.linear import Linear
    from megalm.precision import fp8
    from megalm.precision.compiled_linear import prepared_weights
    from megalm.precision.layer_state import LinearState
    from megalm.precision.linear import RecipeGemms
    from megalm.precision.recipes import get_recipe

    layer = Linear(64, 32, bias=False)
    layer.weight = torch.nn.Parameter(torch.randn(32, 64))  # fresh, as its replacement: equal version counters
    state = LinearState("layer")
    layer.gemm_recipe = gemms = RecipeGemms(get_recipe("fp8"), state, module=layer)
    state.weights_version.watch(torch.optim.SGD(layer.parameters(), lr=0.1))
    with prepared_weights([layer]):
        first = gemms.graph_weights
    old = layer.weight  # alive, as an optimizer would keep it
    layer.weight = torch.nn.Parameter(torch.randn(32, 64))
    assert state.weight_token(old) == state.weight_token(layer.weight)  # only the weight's identity tells them apart
    with prepared_weights([layer]):
        rows = gemms.graph_weights[0]
    expected, _ = fp8.quantize_current(layer.weight.detach(), fp8.E4M3)
    assert rows is not first[0] and torch.equal(rows.view(torch.uint8), expected.view(torch.uint8))


def test_a_layers_old_fp8_copies_are_freed_before_its_new_ones_are_cast(scaled_mm_on_cpu):
    """After an optimizer step, a block's old FP8 weight copies (the graph's and the layer cache's) are gone by the
    time its new ones are cast: the two never sit side by side (a whole block's worth at once, 1.7 GB at 70B)."""
    import weakref

    from megalm.model.linear import Linear
    from megalm.precision import fp8
    from megalm.precision.compiled_linear import prepared_weights
    from megalm.precision.layer_state import LinearState
    from megalm.precision.linear import RecipeGemms
    from megalm.precision.recipes import get_recipe

    layer = Linear(64, 32, bias=False)
    state = LinearState("layer")
    layer.gemm_recipe = gemms = RecipeGemms(get_recipe("fp8"), state, module=layer)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    state.weights_version.watch(optimizer)
    with prepared_weights([layer]):
        cached = [state.weights[key][2][0] for key in gemms._tensor_scale_keys()]  # what the layer's cache holds
        old = [weakref.ref(t) for t in (*cached, *gemms.graph_weights[:2])]
        del cached
    assert all(ref() is not None for ref in old)
    layer.weight.grad = torch.ones_like(layer.weight)
    optimizer.step()
    alive_at_cast = []
    original = fp8.quantize_weights

    def checked(weights, dtype):
        alive_at_cast.append(sum(ref() is not None for ref in old))
        return original(weights, dtype)

    with mock.patch.object(fp8, "quantize_weights", checked), prepared_weights([layer]):
        pass
    assert alive_at_cast == [0]


def test_fp8_gemms_in_the_graph_compile_once_without_breaks(tmp_path, scaled_mm_on_cpu):
    """The weight copies are graph inputs, not parameters: their shapes must stay static to dynamo (else attention's
    head count turns symbolic and SDPA breaks the graph), and a new copy each optimizer step must not recompile."""
    assert_compiles_once(compiled_trainer(tmp_path, "eager", "precision=fp8"))


@pytest.mark.parametrize("overrides, device, expected, why", [
    ([], "cuda", True, "compiled on CUDA"),
    ([], "cpu", False, "eager on cpu"),
    (["parallel.tp=2"], "cuda", True, "compiled on CUDA"),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], "cuda", True, "compiled on CUDA"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "precision=fp8"], "cuda", False,
     "precision=fp8 without sequence parallelism only"),
    (["model=moe_tiny"], "cuda", False, "compiled MoE blocks are not yet measured"),
    (["precision.backend=te", "precision=fp8"], "cuda", False, "Transformer Engine"),
    (["parallel.pp=2", "parallel.pp_schedule=zb"], "cuda", False, "compiled zero-bubble blocks"),
    (["parallel.pp=2", "parallel.pp_schedule=1f1b"], "cuda", True, "compiled on CUDA"),
    (["parallel.dp=2", "parallel.fsdp=true"], "cuda", True, "compiled on CUDA"),
    ([], "no_triton", False, "need triton"),
], ids=["cuda", "cpu", "tp", "sp", "sp_fp8", "moe", "te", "zb", "1f1b", "fsdp", "no_triton"])
def test_compile_auto_compiles_on_cuda_where_compiled_blocks_were_measured_faster(overrides, device, expected, why,
                                                                                  caplog, monkeypatch):
    """`trainer.compile` defaults to null, auto: compiled on CUDA (the GPU rows of docs/benchmarks.md: 1.16x bf16,
    1.58x fp8 at 1.3B), eager on a CPU, where inductor cannot compile (no triton), and where compiled blocks lose
    (ZB's deferred weight gradients break the graph) or are not yet measured (MoE); one log line says which and
    why. true/false stay."""
    from megalm.training import compile as compile_module

    problem = "inductor's CUDA kernels need triton, which is not installed" if device == "no_triton" else None
    monkeypatch.setattr(compile_module, "inductor_cannot_compile", lambda device: problem)
    device = "cuda" if device == "no_triton" else device
    resolve_auto_compile = compile_module.resolve_auto_compile
    precision = [] if any(o.startswith("precision=") for o in overrides) else ["precision=bf16"]
    cfg = compose_config(*precision, *overrides)
    assert cfg.trainer.compile is None, "the default is auto"
    with caplog.at_level(logging.INFO, logger="megalm"):
        assert resolve_auto_compile(cfg, torch.device(device)) is expected
    assert cfg.trainer.compile is expected
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trainer.compile: null (auto) ->")]
    assert len(lines) == 1 and why in lines[0] and "\n" not in lines[0], lines
    for explicit in (True, False):
        cfg.trainer.compile = explicit
        assert resolve_auto_compile(cfg, torch.device(device)) is None and cfg.trainer.compile is explicit


def test_a_default_run_on_the_cpu_stays_eager(tmp_path):
    """The CPU trainer resolves auto to eager before the blocks would be compiled: no block's forward is wrapped."""
    from megalm.model import TransformerBlock

    trainer = Trainer(compose_config(*EQUAL_DOCS, "trainer.device=cpu"), tmp_path)
    assert trainer.cfg.trainer.compile is False
    blocks = [m for m in trainer.model.modules() if isinstance(m, TransformerBlock)]
    assert blocks and all("forward" not in vars(block) for block in blocks)



@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp=2", "parallel.sequence_parallel=true"], "without sequence parallelism only; set "
                                                           "parallel.sequence_parallel=false or trainer.compile=false"),
    (["parallel.pp=2", "parallel.pp_schedule=zb"], "without the zero-bubble schedule's deferred weight gradients; "
                                                   "use another parallel.pp_schedule or trainer.compile=false")],
    ids=["sp", "zb"])
def test_compiled_fp8_and_mx_linears_refuse_sp_and_zb_in_one_line(overrides, message):
    """A compiled block runs a native FP8/MX recipe's linears as one opaque op, with no SP input gather and no ZB
    deferred weight gradient: `trainer.compile=true` says so in one line; bf16 compiles in both layouts."""
    from megalm.errors import ConfigError
    from megalm.training.validation import validate_run

    for precision in ("fp8", "mxfp8"):
        with pytest.raises(ConfigError, match=f"runs precision={precision} {message}") as error:
            validate_run(compose_config(f"precision={precision}", "trainer.compile=true", *overrides), 2,
                         torch.device("cpu"))
        assert "\n" not in str(error.value)
    validate_run(compose_config("precision=bf16", "trainer.compile=true", *overrides), 2, torch.device("cpu"))


def test_the_chunked_loss_compiles_with_its_gradient():
    """megalm's chunked cross entropy (megalm.model.loss) under torch.compile (AOT autograd): the same loss and logits
    gradient as eager. It builds its sum in place, which torch 2.11's dynamo traced into a zero gradient until the
    function returned a view (megalm.compat.as_function_output; 0.0 against 93.6 at this size, by a review)."""
    from megalm.model.loss import token_loss_sum

    torch.manual_seed(0)
    logits, labels = torch.randn(24, 40), torch.randint(0, 37, (24,))
    mask = torch.ones(24)
    results = []
    for fn in (token_loss_sum, torch.compile(token_loss_sum, backend="aot_eager", fullgraph=True)):
        x = logits.clone().requires_grad_()
        loss = fn(x, labels, mask, 37, 10)  # padded vocab, three chunks
        loss.backward()
        results.append((loss.detach(), x.grad))
    (eager, eager_grad), (compiled, compiled_grad) = results
    torch.testing.assert_close(compiled, eager)
    assert eager_grad.abs().sum() > 0
    torch.testing.assert_close(compiled_grad, eager_grad)


def _loss_case(dtype: torch.dtype, tokens: int = 300, vocab: int = 512, real: int = 500):
    """Logits with a padded vocab, ignored (-100) and masked labels: what a trainer's micro-batch gives the loss. Every
    fifth token predicts its label confidently (its logit 12 above the rest: p - 1 ~ -2e-5), whose gradient is lost
    if p is rounded to bf16 first."""
    torch.manual_seed(0)
    labels = torch.randint(0, real, (tokens,))
    labels[::7] = -100
    mask = (torch.rand(tokens) > 0.1).float()
    logits = torch.randn(tokens, vocab) * 4
    confident = torch.arange(1, tokens, 5)
    logits[confident, labels[confident].clamp(min=0)] = logits[confident].max(dim=-1).values + 12
    return logits.to(dtype), labels, mask, real


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_loss_kernels_give_the_eager_loss_and_gradient(dtype):
    """trainer.compile compiles the loss's chunk kernels (megalm.model.loss.TokenLoss.compile), the gradient as one
    fused expression: by inductor, the loss and logits gradient of eager and of F.cross_entropy, with the padding
    columns getting none, over even chunks and a ragged last one (at most two graphs a kernel: the second dynamic)."""
    import torch.nn.functional as F

    from megalm.model.loss import TokenLoss

    base, labels, mask, real = _loss_case(dtype)
    reference = base.float().clone().requires_grad_()
    ref_loss = (F.cross_entropy(reference[:, :real], labels, reduction="none") * mask).sum()
    ref_loss.backward()
    results = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        loss_fn = TokenLoss(real, chunk_tokens=128)  # 128, 128, 44 tokens
        if compiled:
            loss_fn.compile("inductor")
        for _ in range(2):  # the second call reuses the graphs
            logits = base.clone().requires_grad_()
            loss = loss_fn(logits, labels, mask)
            loss.backward()
        results[compiled] = (loss.detach(), logits.grad)
        if compiled:
            assert sum(loss_kernel_graphs().values()) == 4
    (eager_loss, eager_grad), (loss, grad) = results[False], results[True]
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-6, atol=0)
    assert grad.dtype == dtype and not grad[:, real:].any()
    # one rounding of each fp32 value into the logits' dtype, as eager does (inductor sums a row's exponentials in
    # another order: a few fp32 roundings of 1.0 apart)
    torch.testing.assert_close(grad, eager_grad, **({"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}))
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-4}
    torch.testing.assert_close(grad.float(), reference.grad, **tolerance)
    # the confident tokens' label entries, p - 1 of -7e-6 to -4e-5: within fp32's noise at 1.0 (the sum of
    # exponentials) and a bf16 rounding of the reference; p rounded to bf16 before subtracting 1 would give 0
    rows = torch.arange(1, len(labels), 5)
    rows = rows[(labels[rows] >= 0) & (mask[rows] > 0)]
    want = reference.grad[rows, labels[rows]]
    assert (want.abs() > 5e-6).all()
    for got in (grad, eager_grad):
        torch.testing.assert_close(got[rows, labels[rows]].float(), want, rtol=2**-7, atol=1e-6)


def test_the_loss_leaves_its_logits_alone_unless_training_asks():
    """token_loss_sum writes the gradient into a tensor of its own; TokenLoss (the runners', which read the logits no
    more) writes it over the logits. Either way the same gradient."""
    from megalm.model.loss import TokenLoss, token_loss_sum

    base, labels, mask, real = _loss_case(torch.bfloat16)
    grads = []
    for loss_fn, overwrites in ((functools.partial(token_loss_sum, vocab_size=real), False), (TokenLoss(real), True)):
        leaf = base.clone().requires_grad_()
        logits = leaf * 1  # an intermediate, as the head's output is
        (grad,) = torch.autograd.grad(loss_fn(logits, labels, mask), leaf)
        assert torch.equal(logits, grad) == overwrites and torch.equal(logits, base) != overwrites
        grads.append(grad)
    assert torch.equal(*grads)


def test_the_compiled_loss_kernels_compile_at_most_four_times_each():
    """Over micro-batches of many token counts (chunks of 16: ragged last chunks, one-token ones, and a one-token
    micro-batch, as HDP's fillers are), each chunk kernel compiles at most four graphs: the chunk's, a dynamic token
    count's and two of one token (dynamo specialises sizes and storage offsets of 0 and 1); never up to dynamo's
    recompile limit (8)."""
    from megalm.model.loss import TokenLoss

    torch._dynamo.reset()
    counters.clear()
    loss_fn = TokenLoss(60, chunk_tokens=16)
    loss_fn.compile("eager")  # dynamo's graphs and guards: the backend does not change them
    for tokens in (32, 40, 33, 47, 17, 50, 16, 1, 64, 23):
        logits = torch.randn(tokens, 64, requires_grad=True)
        loss_fn(logits * 1, torch.randint(0, 60, (tokens,)), torch.ones(tokens)).backward()
    graphs = loss_kernel_graphs()
    assert set(graphs.values()) == {4}, graphs
    assert not counters["graph_break"] and not counters["stats"].get("recompile_limit_hit"), dict(counters["stats"])


def test_compiled_loss_moves_a_fraction_of_the_eager_bytes():
    """What the compiled chunk kernels move, by inductor's own count of each generated kernel (megalm.measure.
    compiled_cost), against the eager kernels' traced bytes: the forward reads the bf16 logits for their max and the
    sum of exponentials, the backward once more as it writes the bf16 gradient over them (6.0 bytes an element
    measured), where eager kernels write and re-read fp32 copies. (The eager form of the gradient compiled instead,
    its scatter and in-place ops, moves 6 more.)"""
    from megalm.measure.compiled_cost import InductorCosts
    from megalm.measure.op_cost import GPUS, OpCosts
    from megalm.model.loss import TokenLoss

    base, labels, mask, real = _loss_case(torch.bfloat16, tokens=1024, vocab=4096, real=4000)
    moved = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        loss_fn = TokenLoss(real, chunk_tokens=256)
        if compiled:
            loss_fn.compile(InductorCosts())
            loss_fn(base.clone().requires_grad_(), labels, mask).backward()  # compiles outside the trace
        logits = base.clone().requires_grad_()
        with OpCosts(GPUS["h100"]) as costs:  # the gradient as the head's backward takes it: no leaf's copy
            torch.autograd.grad(loss_fn(logits, labels, mask), logits)
        moved[compiled] = costs.total().bytes / base.numel()
    assert moved[True] < 8.5 and moved[False] > 5 * moved[True], moved
    # eager: the max of the bf16 logits as they are, and the gradient scaled into them as it is rounded, not through
    # fp32 copies written and re-read (64.8 bytes an element before, 47.2 since)
    assert moved[False] < 50, moved


def test_a_misaligned_chunk_of_the_compiled_loss_is_said(caplog, monkeypatch):
    """On a GPU inductor copies an input that starts off a 16-byte boundary in and out of its kernel: a chunk of bf16
    logits whose width is not a multiple of 8 columns does, after the first. `misaligned_chunks` counts them (the
    storage offset included), and a compiled TokenLoss says so once, in one line naming the fix; aligned, or eager,
    or on a CPU (where inductor's C++ kernels need no alignment), it says nothing."""
    from megalm.model import loss as loss_module
    from megalm.model.loss import TokenLoss, misaligned_chunks

    assert misaligned_chunks(torch.zeros(10, 1000, dtype=torch.bfloat16), chunk_tokens=3) == 0  # 2,000 bytes a row
    assert misaligned_chunks(torch.zeros(10, 1001, dtype=torch.bfloat16), chunk_tokens=3) == 3  # rows 3, 6, 9
    assert misaligned_chunks(torch.zeros(10, 1001, dtype=torch.bfloat16), chunk_tokens=5) == 1  # row 5
    assert misaligned_chunks(torch.zeros(10, 1001, dtype=torch.bfloat16), chunk_tokens=8) == 0  # 8 rows: 16,016 B
    assert misaligned_chunks(torch.zeros(10, 1001), chunk_tokens=4) == 0  # fp32: 4 rows are 16,016 bytes
    assert misaligned_chunks(torch.zeros(11, 1001, dtype=torch.bfloat16)[1:], chunk_tokens=8) == 2  # offset 2,002
    assert misaligned_chunks(torch.zeros(10, 1001, dtype=torch.bfloat16)) == 0  # one chunk: it starts the storage

    class OnAGpu(torch.Tensor):  # what the check reads of a CUDA tensor: its device type
        @property
        def device(self):
            return torch.device("cuda")

    def said(loss_fn, logits) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="megalm"):
            loss_fn.check_alignment(logits)
        return [r.getMessage() for r in caplog.records if "boundary" in r.getMessage()]

    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 3 * 4 * 1001)  # three tokens a chunk
    odd = torch.zeros(10, 1001, dtype=torch.bfloat16)
    compiled = TokenLoss(1001)
    compiled.kernels = loss_module.ChunkKernels(loss_module.chunk_statistics, loss_module.fused_chunk_logits_grad_)
    assert said(compiled, odd) == []  # on a CPU
    lines = said(compiled, odd.as_subclass(OnAGpu))
    assert len(lines) == 1 and "3 of the loss's chunks" in lines[0] and "make_vocab_size_divisible_by" in lines[0]
    assert said(compiled, odd.as_subclass(OnAGpu)) == []  # once
    assert said(TokenLoss(1001), odd.as_subclass(OnAGpu)) == []  # eager kernels: no inductor copies
    aligned = TokenLoss(1000)
    aligned.kernels = compiled.kernels
    assert said(aligned, torch.zeros(10, 1000, dtype=torch.bfloat16).as_subclass(OnAGpu)) == []
