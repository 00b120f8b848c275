"""`trainer.compile`: torch.compile per transformer block, as TorchTitan compiles its `TransformerBlock`s, and the
loss's chunk kernels (megalm.model.loss), as TorchTitan compiles its loss.

Per block, not the whole model: every block has the same code and shapes, so dynamo compiles one graph and reuses
it for all (its cache is per code object), the pipeline stages and recomputation wrappers stay in eager Python
around it, and a compile error names one block. `nn.Module.compile` compiles in place, so parameter names, the
state dict and checkpoints are the same as without it. What must hold for the graphs to be whole: nothing in a
block's forward logs or selects a backend (`megalm.model.choose_attention_backends` runs before), and nothing
reads a tensor's value on the host (documents of equal length take the batched attention path).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megalm import compat
from megalm.config import TrainerConfig, schema_default, zero_bubble
from megalm.errors import ConfigError
from megalm.model import TransformerBlock
from megalm.model.deferred_wgrad import LayerSink
from megalm.model.linear import linear_modules
from megalm.model.loss import TokenLoss
from megalm.parallel.recompute import recompute_modes
from megalm.precision import compiled_recipe_conflict
from megalm.precision.compiled_linear import prepared_weights

log = logging.getLogger("megalm")


def compile_blocks(model: nn.Module, backend: str | Callable = "inductor",
                   layout_options: dict[str, Any] | None = None) -> int:
    """torch.compile every `TransformerBlock` of `model` in place with `backend` (a name, or a backend callable
    such as tools/bench/step_cost.py's); returns how many. A zero-bubble pipeline defers its linears' weight gradients
    first (the pipeline runtime, built with the model): the options of the blocks that then defer are chosen here.
    `layout_options`: inductor options the parallel layout asks for (`Parallelism.inductor_config`: async TP's), for
    inductor by name; a backend callable takes its options itself (megalm-estimate merges them into its own)."""
    blocks = [module for module in model.modules() if isinstance(module, TransformerBlock)]
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
    if backend == "aot_eager":  # dynamo's, plus the joint-graph passes inductor runs: what the blocks save is the same
        backend, name = aot_eager_with_block_passes(), "aot_eager, with megalm's joint-graph passes"
    compat.load_inductor_layout_prim()  # what compiled FP8 graphs read (compiled_linear.graph_column_major)
    # inductor by name gets SP's re-gathers as a compile option; a backend callable calling inductor (the cost
    # traces' InductorCosts) passes `inductor_options()` to compile_fx itself
    for block in blocks:  # its forward, not the module call: the module's hooks (layer offload's) stay eager
        options = (inductor_options(keeps_inputs=defers_weight_grads(block)) | (layout_options or {})
                   if backend == "inductor" else None)
        block.forward = functools.partial(_run_compiled, torch.compile(block.forward, backend=backend,
                                                                       options=options), linear_modules(block))
    log.info("trainer.compile: %d transformer blocks compiled (backend %s)", len(blocks), name)
    return len(blocks)


def compile_loss(loss_fn: TokenLoss, backend: str | Callable = "inductor") -> None:
    """torch.compile the chunk kernels of the loss the runners call (megalm.model.loss.TokenLoss, or its
    vocab-parallel form under TP, whose collectives run between the kernels), fused by inductor so that no fp32 copy
    of the logits is written."""
    loss_fn.compile(backend)
    log.info("trainer.compile: the loss's chunk kernels compiled (backend %s)", backend)


def auto_compile(cfg: Any, device: torch.device) -> tuple[bool, str]:
    """What `trainer.compile=null` (auto, the default) means for `cfg` (its precision resolved) on `device`, and
    why: compiled on CUDA, where the GPU rows measured it faster (docs/benchmarks.md, 2026-11-29: 1.16x in bf16 and
    1.58x in fp8 at 1.3B on one H200), except where inductor cannot or compiled blocks are known to lose; eager
    elsewhere."""
    parallel, precision = cfg.parallel, cfg.precision
    if device.type != "cuda":
        return False, f"eager on {device.type}: compiled blocks are measured faster on CUDA only"
    if problem := inductor_cannot_compile(device):
        return False, f"eager: {problem}"
    if conflict := compiled_recipe_conflict(cfg):
        return False, f"eager: compiled blocks run precision={precision.name} {conflict[0]}"
    if cfg.model.moe.num_experts:
        return False, ("eager: compiled MoE blocks are not yet measured on a GPU; trainer.compile=true compiles them "
                       "whole (under expert parallelism, split at each all-to-all's host read of its sizes)")
    if precision.backend == "te":
        return False, "eager: Transformer Engine's modules (precision.backend=te) are not compiled by megalm"
    if zero_bubble(parallel):
        return False, ("eager: compiled zero-bubble blocks (each deferred linear's GEMMs in opaque ops, inductor "
                       "without in-place kernels) are not yet measured on a GPU, and one GPU runs no pipeline; "
                       "trainer.compile=true compiles them whole")
    return True, "compiled on CUDA (trainer.compile=false for eager)"


def validate_compile(cfg: Any) -> None:
    """What a compiled run refuses, in one line: async TP without inductor's compiled blocks (auto compile
    resolved to eager included), and an MoE model under recomputation compiled by dynamo's `eager` backend. That
    backend runs the block's checkpoint with the module's buffers as its inputs, and the router's load counts (a
    buffer, megalm/model/moe.py) change after the checkpoint saved them, which its recomputation rejects; AOT
    autograd (`aot_eager`, `inductor`) moves the update out of the checkpointed region."""
    backend = cfg.trainer.compile_backend  # a callable: a cost trace's backend that runs inductor (InductorCosts)
    if not cfg.trainer.compile and isinstance(backend, str) and backend != schema_default(TrainerConfig,
                                                                                          "compile_backend"):
        log.warning(f"trainer.compile_backend={backend} is read by compiled blocks only, and this run is eager "
                    "(trainer.compile=false, as set or as null resolves for it): not used")
    if cfg.parallel.async_tp and not (cfg.trainer.compile and (backend == "inductor" or callable(backend))):
        why = ("trainer.compile=false (as set, or as null resolves for this run)" if not cfg.trainer.compile
               else f"trainer.compile_backend={backend}")
        raise ConfigError(f"parallel.async_tp=true is a pass of inductor's over compiled blocks, which {why} does not "
                          "run; set trainer.compile=true with trainer.compile_backend=inductor, or turn it off")
    if not (cfg.trainer.compile and backend == "eager" and cfg.model.moe.num_experts):
        return
    if any(mode != "none" for mode in recompute_modes(cfg.parallel.recompute, cfg.parallel.pp)):
        raise ConfigError("trainer.compile_backend=eager cannot recompute an MoE model's compiled blocks (its load "
                          "counts change inside the checkpoint); use trainer.compile_backend=aot_eager or inductor, "
                          "or parallel.recompute=none")


def inductor_cannot_compile(device: torch.device) -> str | None:
    """Why inductor cannot generate kernels for CUDA `device` (None: it can): triton missing, or a GPU below sm70."""
    if importlib.util.find_spec("triton") is None:
        return "inductor's CUDA kernels need triton, which is not installed"
    capability = compat.cuda_capability(device)
    if capability is not None and capability < (7, 0):
        return f"inductor's Triton kernels need compute capability 7.0+ (this GPU: {capability})"
    return None


def resolve_auto_compile(cfg: Any, device: torch.device) -> bool | None:
    """Replace `trainer.compile=null` (auto, the default) in `cfg` (a MegalmConfig or a composed Hydra config) by
    `auto_compile`'s answer for `device`, logged in one line; returns it, or None when `cfg` says true or false
    itself (then nothing changes)."""
    if cfg.trainer.compile is not None:
        return None
    cfg.trainer.compile, why = auto_compile(cfg, device)
    log.info("trainer.compile: null (auto) -> %s (%s)", str(cfg.trainer.compile).lower(), why)
    return cfg.trainer.compile


REGATHER_REGION = 1 << 30  # the recompute region id `regather_in_backward` gives the gathers it marks


def _backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes of a joint graph that a tangent reaches: the backward's own."""
    backward: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    return backward


def recompute_custom_functions(graph: torch.fx.Graph) -> int:
    """Inductor's joint-graph pass that keeps full recomputation's memory saving in a compiled block on torch 2.11.

    There (pytorch#177396, fixed in 2.12) dynamo tags the ops of a full checkpoint region for recomputation before
    it inlines the custom autograd.Functions inside it, so the ops of megalm's RMSNormFunction, RotaryFunction and
    SwiGLUFunction reach the joint graph untagged and the partitioner saves their outputs: 14.6 s·h bytes a layer
    where the layer input alone is 2 s·h (model=tiny, bf16, measured by tools/bench/activation_memory.py). Each
    untagged forward op whose output a full region's op reads is given that region's tag, walking back from the
    region's ops (the autograd.Functions' intermediates reach it through their outputs). Selective regions are tagged
    per op by their dispatch mode, custom functions included, and left as they are; ops that write their inputs
    (the MoE router's count updates, after the region) are never tagged. Returns how many ops it tagged: none where
    torch tags them itself."""
    from torch.utils.checkpoint import CheckpointPolicy

    recompute, saves = CheckpointPolicy.PREFER_RECOMPUTE, (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
    backward = _backward_nodes(graph)
    selective = {node.meta.get("ac_graph_id") for node in graph.nodes if node.meta.get("recompute") in saves}
    skip = selective | {REGATHER_REGION}
    tagged = 0
    for node in reversed(graph.nodes):
        if node.op != "call_function" or node in backward or "recompute" in node.meta or _writes_inputs(node):
            continue
        region = next((user.meta.get("ac_graph_id") for user in node.users if user not in backward
                       and user.meta.get("recompute") == recompute and user.meta.get("ac_graph_id") not in skip), None)
        if region is not None:
            node.meta["recompute"], node.meta["ac_graph_id"] = recompute, region
            tagged += 1
    return tagged


def _writes_inputs(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def block_joint_pass(graph: torch.fx.Graph) -> None:
    """The joint-graph passes megalm's compiled blocks run (`inductor_options`): full recompute's tags completed,
    then SP's re-gathers marked."""
    recompute_custom_functions(graph)
    regather_in_backward(graph)


def regather_in_backward(graph: torch.fx.Graph) -> None:
    """Inductor's joint-graph pass (`joint_custom_pre_pass`) that keeps sequence parallelism's memory saving in a
    compiled block. A shard the joint graph all-gathers more than once outside the backward is one that the backward
    gathers again (megalm.model.linear's SP GEMMs gather their input in the forward and again for the weight
    gradient); those gathers are marked for recomputation, so the backward gathers the [T/tp, h] shard again, as
    eager SP does (Korthikanti et al. 2022), instead of keeping the gathered [T, h]. Unmarked, the partitioner
    recomputes no collective: it merges the two gathers (common-subexpression elimination, after this pass) and
    keeps the output. tests/unit/test_estimate.py measures the bytes, tests/dist/test_compile_layouts.py trains
    with it as eager does."""
    from torch.utils.checkpoint import CheckpointPolicy

    functional = torch.ops._c10d_functional
    gather, wait = functional.all_gather_into_tensor.default, functional.wait_tensor.default
    backward = _backward_nodes(graph)
    by_shard: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.target is gather and node not in backward:
            by_shard.setdefault(node.args[0], []).append(node)
    for gathers in by_shard.values():
        if len(gathers) < 2:
            continue
        for node in gathers:
            for marked in (node, *(user for user in node.users if user.target is wait)):
                marked.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                # a recompute region's id, which torch 2.9's partitioner reads from every marked node: one of its
                # own, above any selective-checkpoint region's, so no neighbouring region's rule applies to it
                marked.meta.setdefault("ac_graph_id", REGATHER_REGION)


@functools.cache
def _block_joint_pass() -> Any:
    """`block_joint_pass` as inductor's `CustomGraphPass`: its uuid (this file's hash) keeps the FX graph and
    AOT autograd caches on (a plain function would bypass them), and changes when the pass does."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class BlockJointPass(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            block_joint_pass(graph)

        def uuid(self) -> bytes:
            return get_hash_for_files((__file__,))

    return BlockJointPass()


def aot_eager_with_block_passes() -> Callable:
    """dynamo's `aot_eager` debug backend (AOT autograd, the min-cut partition inductor uses, the graphs run op by op,
    no code generated) with `block_joint_pass` run on the joint graph before the partition, where inductor runs it.
    Without it the debug backend saved what inductor's blocks do not: on torch 2.11 the custom functions' outputs
    under full recompute (6.5x the layer input, a tiny block), under SP the gathered [T, h] inputs."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint: torch.fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        block_joint_pass(joint.graph)
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition,
                        keep_inference_input_mutations=True)


def inductor_options(keeps_inputs: bool = False) -> dict[str, Any]:
    """The inductor config megalm compiles blocks with: its joint-graph passes (`block_joint_pass`: full recompute
    on torch 2.11, SP's re-gathers kept in the backward). `keeps_inputs`: the block's backward hands tensors of its
    graph to a zero-bubble W action (megalm/model/deferred_wgrad.py), which reads them after the graph ends, so
    inductor's scheduler neither reuses a buffer's memory for a later value nor writes a kernel's output over its
    input (which it did: tests/dist/test_compile_layouts.py). Its post-grad pass that makes a scatter or index_put in
    place is not governed by these options; a block's linears have none."""
    options: dict[str, Any] = {"joint_custom_pre_pass": _block_joint_pass()}
    if keeps_inputs:
        options |= {"allow_buffer_reuse": False, "inplace_buffers": False}
    return options


def defers_weight_grads(block: nn.Module) -> bool:
    """Whether `block` hands weight gradients to a zero-bubble pipeline's W action (gradient accumulation fusion's
    sink multiplies them while its op runs, nothing outlives the graph; at a W action, fused or not, they do)."""
    return any(isinstance(sink, LayerSink) and sink.defers
               for sink in (getattr(m, "weight_grad_sink", None) for m in block.modules()))


def _run_compiled(compiled: Callable, linears: list[nn.Module], *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    """A compiled block's call: first, in eager and after the block's pre-hooks, what its graph reads that dynamo
    cannot make (an FP8 recipe's weight copies, once per optimizer step: compiled_linear.prepared_weights)."""
    with prepared_weights(linears):
        return compiled(*args, **kwargs)
