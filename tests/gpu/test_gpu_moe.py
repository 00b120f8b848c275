"""GPU tier: the mixture-of-experts layer's CUDA paths (megalm/model/moe.py), never run on a GPU before.

- The experts' grouped GEMM, `torch._grouped_mm`: on sm90 and sm100 in bf16 it is CUTLASS's grouped kernel, which
  reads the group offsets on the device; in fp32 (and on other GPUs) torch runs a per-group loop that copies the
  offsets to the host. Both, forward and backward, against the per-expert loop in fp64 on the CPU, with an empty
  expert and uneven groups.
- A bf16 MoE layer's forward and backward on one GPU make no host sync (`torch.cuda.set_sync_debug_mode`): routing,
  the stable sort by expert, the grouped GEMMs, the scatter back and the load counters stay on the device, as they
  must for the step to run ahead of the host. (Expert parallelism reads its all-to-all splits on the host by design:
  megalm/parallel/expert/dispatch.py.)
- Two training steps of a small MoE model on CUDA in the default bf16 recipe against the CPU in fp32, as
  test_gpu_train_step.py does for the dense 125m model.

Tolerances: the GEMMs in units of their dtype's epsilon (bf16 operands round at 2^-8 relative, fp32 accumulation
over K = 512 terms); the step as test_gpu_train_step.py's bf16 row, with each step's busiest-expert load (max / mean
per layer) within 5% and no drops (bf16 rounding moves a few near-tied choices).
"""

from __future__ import annotations

import pytest
import torch

from megalm.model.moe import expert_loop, grouped_linear, set_aux_loss_scale
from tests.gpu.conftest import capability, eps, rel_error
from tests.gpu.test_gpu_train_step import train_two_steps

pytestmark = pytest.mark.gpu

# A small MoE model at shapes the grouped kernel takes (rows of 16 bytes): moe_tiny's routing, wider experts.
MOE_OVERRIDES = ["model=moe_tiny", "model.hidden_size=512", "model.num_heads=8", "model.num_kv_heads=4",
                 "model.moe.expert_ffn_hidden_size=256", "model.seq_length=512", "data=synthetic",
                 "data.synthetic.num_docs=64", "data.synthetic.mean_doc_length=400", "data.valid_fraction=0",
                 "trainer.global_batch_size=2", "trainer.micro_batch_size=1", "trainer.max_steps=2",
                 "trainer.eval_interval=0", "trainer.save_interval=0", "trainer.log_interval=1",
                 "logging.tensorboard=false"]


def grouped_problem(dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """x [N, 512] sorted by group, w [8, 256, 512], rows per group (one empty, one large), dy [N, 256]."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([37, 0, 301, 5, 64, 1, 90, 14])
    x = torch.randn(int(counts.sum()), 512, generator=gen)
    w = torch.randn(8, 256, 512, generator=gen) / 512**0.5
    dy = torch.randn(x.shape[0], 256, generator=gen)
    return tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in (x, w, counts, dy))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemm_on_cuda_matches_the_expert_loop(dtype, no_tf32):
    x, w, counts, dy = grouped_problem(dtype, "cuda")
    x.requires_grad_(), w.requires_grad_()
    y = grouped_linear(x, w, counts)
    assert y.dtype == dtype and y.device.type == "cuda"
    got = (y, *torch.autograd.grad(y, (x, w), dy))
    # the oracle: the same operands (already rounded to dtype) one expert at a time in fp64 on the CPU
    x64, w64, counts64, dy64 = (t.detach().cpu().double() if t.is_floating_point() else t.cpu()
                                for t in (x, w, counts, dy))
    x64.requires_grad_(), w64.requires_grad_()
    y64 = expert_loop(x64, w64, counts64)
    want = (y64, *torch.autograd.grad(y64, (x64, w64), dy64))
    tolerance = 2 * eps(dtype) if dtype == torch.bfloat16 else 1e-5  # each output rounds once, by <= eps / 2
    for name, g, r in zip(("y", "dx", "dw"), got, want, strict=True):
        assert rel_error(g, r) < tolerance, f"{dtype} {name}: relative error {rel_error(g, r):.2e} >= {tolerance:.1e}"
    assert got[2][1].abs().max().item() == 0, "the empty expert got a weight gradient"


def test_bf16_moe_layer_makes_no_host_sync():
    if capability()[0] not in (9, 10):
        pytest.skip(f"torch's bf16 grouped kernel is built for sm90 and sm100; on {capability()} it reads the "
                    "group offsets on the host")
    from megalm.config import ModelConfig, MoEConfig
    from megalm.model import GPT, init_weights

    cfg = ModelConfig(num_layers=1, hidden_size=512, num_heads=8, num_kv_heads=4, ffn_hidden_size=1024,
                      vocab_size=512, seq_length=1024, attention_backend="sdpa",
                      moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_hidden_size=256, aux_loss_coeff=0.01,
                                    seq_aux_loss_coeff=1e-4, z_loss_coeff=1e-3))
    model = GPT(cfg)
    init_weights(model, 0)
    layer = model.layers[0].mlp.to("cuda").train()
    for p in layer.parameters():  # bf16 weights, as precision=bf16 keeps them; the fp32/fp64 buffers stay
        p.data = p.data.to(torch.bfloat16)
    set_aux_loss_scale(layer, 1.0)  # each layer's own scale (what a trainer's step sets)
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu_seqlens = torch.tensor([0, 300, 1024], dtype=torch.int32, device="cuda")
    dy = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, cu_seqlens).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert layer.stats[:8].sum().item() == 1024 * 2, "the load counters did not count every assignment"
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def cpu_fp32_moe(tmp_path_factory):
    """The reference: the same two MoE steps on the CPU in fp32."""
    return train_two_steps(tmp_path_factory.mktemp("moe_cpu_fp32"), "cpu", "fp32", MOE_OVERRIDES)


def test_moe_step_on_cuda_matches_cpu_fp32(cpu_fp32_moe, tmp_path):
    got, want = train_two_steps(tmp_path, "cuda", "bf16", MOE_OVERRIDES), cpu_fp32_moe
    assert got.device.type == "cuda"
    for step in range(2):
        rel = abs(got.losses[step] / want.losses[step] - 1)
        assert rel < 2e-2, f"step {step + 1} loss {got.losses[step]:.5f} vs cpu fp32 {want.losses[step]:.5f}"
        rel = abs(got.grad_norms[step] / want.grad_norms[step] - 1)
        assert rel < 3e-2, f"step {step + 1} grad norm {got.grad_norms[step]:.4f} vs {want.grad_norms[step]:.4f}"
    assert got.grads.keys() == want.grads.keys()
    for name in ("router.weight", "gate_up_proj.weight", "down_proj.weight"):
        cosines = [torch.nn.functional.cosine_similarity(g.flatten().double(),
                                                         want.grads[k].flatten().double(), dim=0).item()
                   for k, g in got.grads.items() if k.endswith(name)]
        assert cosines and min(cosines) > 0.98, f"{name}: gradient cosines {cosines} against cpu fp32"
    for step, (moe, moe_want) in enumerate(zip(got.moe, want.moe, strict=True)):
        assert moe["moe_dropped"] == moe_want["moe_dropped"] == 0, (step, moe, moe_want)
        for layer, (load, load_want) in enumerate(zip(moe["moe_load"], moe_want["moe_load"], strict=True)):
            assert abs(load / load_want - 1) < 0.05, f"step {step + 1} layer {layer}: load {load} vs {load_want}"
