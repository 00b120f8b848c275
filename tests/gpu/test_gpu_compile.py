"""GPU tier: compiled blocks on CUDA over documents of unequal lengths, what the CPU tier cannot show.

On a CPU, unequal documents run SDPA once per document, reading `cu_seqlens` on the host: that loop stays eager
by design (tests/unit/test_compile_blocks.py compiles equal-length documents). On CUDA the varlen flash kernel
takes `cu_seqlens` and the longest document as tensors, so a compiled block must trace through it with no graph
break and must not recompile as the packed lengths and document counts change from step to step (at most 2 graphs
per block over 20 varlen steps; 3 where auto's cudnn also takes equal documents on their own route). Inductor
generates Triton kernels here, not the CPU's C++ ones.

Tolerance of compiled against eager: both run the same bf16 operands; inductor fuses the elementwise ops between
the GEMMs and rounds their intermediate results to bf16 less often, a difference of a few bf16 epsilons
(2^-8 ~ 4e-3) per op on the activations, which the loss averages over the tokens. 2e-2 relative on each of the
first three losses leaves room for that and catches a wrong kernel (a skipped mask, a wrong document boundary
moves the tiny model's loss by more than 10%).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from megalm.model import attention
from megalm.model.gpt import TransformerBlock
from megalm.training.trainer import Trainer
from tests.conftest import compose_config
from tests.gpu.conftest import capability

pytestmark = pytest.mark.gpu

# Documents of ~40 tokens packed into 128-token sequences: each micro-batch holds a different number of them, of
# different lengths (the synthetic source draws lengths around the mean).
UNEQUAL_DOCS = ["data=synthetic", "data.varlen=true", "data.synthetic.mean_doc_length=40", "model.seq_length=128",
                "trainer.device=cuda", "trainer.eval_interval=0", "trainer.save_interval=0"]
STEPS = 20
LOSS_TOL = 2e-2


def _losses(trainer: Trainer, steps: int) -> list[float]:
    return [trainer.train_step(step).loss for step in range(steps)]


MOE = ["model=moe_tiny", "model.moe.capacity_factor=1.25", "model.moe.seq_aux_loss_coeff=0.01"]


@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8_delayed", "moe_bf16"])
def test_compiled_blocks_on_cuda_take_unequal_documents_without_breaks(tmp_path, precision):
    """moe_bf16: an MoE model's blocks (the router, its capacity queues and per-document loss, the grouped GEMMs)
    through inductor on CUDA; the CPU tiers trace them (tests/unit/test_compile_blocks.py, test_fake_cuda.py).
    fp8_delayed: its casts with the histories' scales in inductor's kernels, a graph more for its first step (the
    current amax scales it, as eager's first step)."""
    if precision.startswith("fp8") and capability() < (8, 9):
        pytest.skip(f"FP8 GEMMs need compute capability 8.9+, this GPU has {capability()}")
    attention._resolve_backend.cache_clear()
    torch._dynamo.reset()
    counters.clear()
    moe = precision.startswith("moe_")
    overrides = [*UNEQUAL_DOCS, *(MOE if moe else []), f"precision={precision.removeprefix('moe_')}"]
    compiled = Trainer(compose_config(*overrides, "trainer.compile=true"), tmp_path / "compiled")
    compiled_losses = _losses(compiled, STEPS)
    assert not counters["graph_break"], dict(counters["graph_break"])
    graphs = len(_debug_get_cache_entry_list(TransformerBlock.forward.__code__))
    # auto's cudnn (Hopper) runs a micro-batch that happens to be one whole document (or several of one length) on
    # its other route: one graph more, the bound of 2 recompiles (tests/unit/test_compile_blocks.py)
    chosen = {b for m in compiled.model.modules() if isinstance(m, attention.Attention) for b in m.chosen.values()}
    bound = (3 if "cudnn" in chosen else 2) + (precision == "fp8_delayed")
    assert 1 <= graphs <= bound, f"{graphs} graphs of the block over {STEPS} steps of unequal documents"

    eager = Trainer(compose_config(*overrides, "trainer.compile=false"), tmp_path / "eager")  # auto would compile
    eager_losses = _losses(eager, 3)
    for step, (got, want) in enumerate(zip(compiled_losses[:3], eager_losses, strict=True)):
        assert abs(got / want - 1) < LOSS_TOL, f"step {step + 1}: compiled loss {got:.5f}, eager {want:.5f}"


def test_compiled_zero_bubble_blocks_defer_their_weight_gradients_through_inductor():
    """The zero-bubble schedule's compiled blocks through inductor's Triton kernels: the deferred linears' ops, their
    closures reading dy and x after the graph (inductor without in-place buffers: megalm.training.compile), the W
    action's gradients equal to eager's (fp32; inductor's reductions round differently). One GPU runs no pipeline, so
    the store is driven by hand, as the unit test does on a CPU through aot_eager."""
    from tests.unit.test_weight_grad import compiled_split_matches_eager

    compiled_split_matches_eager("cuda", "inductor", {"rtol": 1e-4, "atol": 1e-5})
