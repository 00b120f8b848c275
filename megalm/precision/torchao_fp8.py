"""torchao's float8 training on megalm's linear layers (`precision=fp8 precision.backend=torchao`).

Why a third fp8 path: torchao's `Float8Linear` is TorchTitan's fp8 (its `quantize.linear.float8` converter), written
for torch.compile: under compiled blocks its casts, amaxes and `torch._scaled_mm` calls are ops of the graph. On the
first GPU run (docs/benchmarks.md) TorchTitan's compiled fp8 ran 1.16x its bf16 where megalm's eager fp8 ran 0.83x
its own. With this backend the same trainer, model, data and step run either implementation, so one GPU run
compares the backends and nothing else (`megalm_torchao` in tools/bench/compare.py), and the faster one can be
kept. megalm's native path (precision/linear.py) stays the default: it also runs the recipes torchao has no form
for (delayed scaling, MX, the zero-bubble schedule's deferred weight gradients, tensor and sequence parallelism).

How, from outside the model (docs/architecture.md): `convert_to_float8_training` swaps every selected model
`Linear` (an nn.Linear) for a `Float8Linear` holding the same weight and bias Parameters, so names,
initialisation, checkpoints and the optimizer see no change. The recipe is torchao's tensorwise dynamic scaling,
which is megalm's `fp8`: E4M3 input and weight, E5M2 output gradient, one scale per tensor from its current amax.
On a CPU both emulate the FP8 GEMMs, and a layer's output and both gradients agree to about 1e-7 (fp32) between
them (tests/unit/test_precision_torchao.py). What differs: `Float8Linear` casts the weight in every forward (the
native path once per optimizer step) and keeps the input and weight in their own dtype for the backward (the
native path keeps the input's FP8 copy), casting both again in the backward; its forward GEMM accumulates fast, as
TorchTitan runs it. Under FSDP (torch's `fully_shard`) the weights are gathered in their own dtype and cast after
the gather, as the native path casts them; with `precision.fp8_all_gather=true`, torchao's float8 all-gather
(`enable_fsdp_float8_all_gather`): each weight is cast from its fp32 shard and gathered in FP8, half of bf16's bytes,
with the whole weight's scale, precomputed for all weights after each optimizer step (`precompute_weight_scales`).

Where `torch._scaled_mm` does not run (a CPU, a GPU below compute capability 8.9) torchao emulates
(`Float8LinearConfig(emulate=True)`: the casts round as on a GPU, the GEMMs run in the inputs' dtype), as the native
path does there; the start-up log says which.
"""

from __future__ import annotations

import functools

from torch import nn

from megalm import compat
from megalm.model.linear import Linear
from megalm.model.naming import canonical_named_modules
from megalm.precision import fp8
from megalm.precision.install import skip_predicate

TORCHAO_RECIPES = ("fp8",)
TORCHAO_MIN_VERSION = (0, 17)  # the release tools/compare_peers.txt pins for TorchTitan; converts and trains there
# torchao 0.17 loads its extensions from torch 2.11 on and 0.18 does not import on torch 2.9; there, 0.17's import
# (without its extensions) makes a later inductor-compiled megalm FP8 op pair crash the process (a segfault, on the
# CPU, in tests/unit/test_precision_fp8_casts.py run after it), so torchao is not even imported on an older torch
TORCH_MIN_VERSION = (2, 11)


@functools.cache
def torchao_problem() -> str | None:
    """Why torchao's float8 training cannot run here (with the fix), or None. Cached: asked once per model chunk."""
    import torch

    if compat.major_minor(torch.__version__) < TORCH_MIN_VERSION:
        return (f"precision.backend=torchao needs torch >= {'.'.join(map(str, TORCH_MIN_VERSION))} (torchao's own "
                f"floor; found {torch.__version__}); upgrade torch or use precision.backend=native")
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except Exception as e:  # ImportError, or a build that does not load on this torch
        return f"torchao is not importable ({type(e).__name__}: {e}); pip install 'torchao>=0.17'"
    if compat.major_minor(str(getattr(torchao, "__version__", "0.0"))) < TORCHAO_MIN_VERSION:
        floor = ".".join(map(str, TORCHAO_MIN_VERSION))
        return f"torchao {torchao.__version__} is older than {floor}; pip install 'torchao>={floor}'"
    return None


def apply_torchao(model: nn.Module, skip: list[str] | tuple[str, ...] = (), emulate: bool = False,
                  fp8_gather_shards: int | None = None) -> tuple[int, int, list[str]]:
    """Swap the model `Linear` layers of `model` not matched by `skip` (as `apply_precision` reads it) for torchao
    `Float8Linear` layers with tensorwise scaling and the same Parameters. `emulate`: FP8 casts with GEMMs in the
    inputs' dtype (no torch._scaled_mm). `fp8_gather_shards` (`precision.fp8_all_gather`: the ranks FSDP shards each
    weight's rows over): the weights become torchao's FSDP2 extension (`WeightWithDynamicFloat8CastTensor`), which
    FSDP gathers in FP8, where their rows divide evenly over those ranks; torchao casts a shard without FSDP's
    padding, so an uneven one would send fewer bytes than its peers. Returns (layers swapped, layers left as they
    are because torch._scaled_mm takes no dimension that is not a multiple of 16: megalm's native path emulates
    those, torchao's would fail, the names of swapped layers gathered in their own dtype for uneven rows)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    skipped = skip_predicate(model, skip)
    layers = [(name, module) for name, module in canonical_named_modules(model)
              if type(module) is Linear and not skipped(name, module)]
    multiple = fp8.SCALED_MM_TOKEN_MULTIPLE  # torch._scaled_mm's rule, for every GEMM dimension
    chosen = [(name, m) for name, m in layers
              if emulate or (m.in_features % multiple == 0 and m.out_features % multiple == 0)]
    gathered = {id(m) for _, m in chosen if fp8_gather_shards and m.out_features % fp8_gather_shards == 0}
    uneven = [name for name, m in chosen if fp8_gather_shards and id(m) not in gathered]
    for in_fp8 in (True, False):
        ids = {id(m) for _, m in chosen if (id(m) in gathered) == in_fp8}
        if ids:
            convert_to_float8_training(model, module_filter_fn=lambda module, _fqn, ids=ids: id(module) in ids,
                                       config=Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=in_fp8))
    return len(chosen), len(layers) - len(chosen), uneven


def precompute_weight_scales(chunks: list[nn.Module]) -> None:
    """The scales the next FP8 all-gathers cast with, of every converted weight of each chunk (FSDP-sharded), from
    one all-reduce of their shards' amaxes a chunk (torchao's `precompute_float8_dynamic_scale_for_fsdp`, which
    TorchTitan calls after each optimizer step); without it each gather all-reduces its own weight's amax."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for chunk in chunks:
        precompute_float8_dynamic_scale_for_fsdp(chunk)
