"""The op-cost trace counts kernels, FLOPs and bytes from the dispatched ops: a GEMM's 2mnk FLOPs and its operands'
bytes, no kernel for a view, and the step-cost tool's GEMM FLOPs equal 6 x (linear weights) x tokens, the count
every training-FLOPs estimate starts from (each weight: 2 FLOPs per token forward, 4 backward), compiled blocks
included (their GEMMs are inductor's extern kernels, replayed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megalm.measure.op_cost import GPUS, OpCosts, category
from megalm.model.gpt import GPT

ROOT = Path(__file__).resolve().parents[2]


def test_a_gemm_costs_2mnk_flops_and_its_operands_bytes():
    a, b = torch.randn(64, 128), torch.randn(128, 32)
    with OpCosts(GPUS["h100"]) as costs:
        view = a.t()  # a view: no kernel
        (a @ b).relu()
    del view
    gemm = costs.by_category["gemm"]
    assert gemm.kernels == 1 and gemm.flops == 2 * 64 * 128 * 32
    assert gemm.bytes == (64 * 128 + 128 * 32 + 64 * 32) * 4
    assert costs.total().kernels == 2, dict(costs.by_op)
    tf32_s = gemm.flops / (GPUS["h100"].tf32_tflops * 1e12)
    hbm_s = gemm.bytes / (GPUS["h100"].hbm_tbytes_per_s * 1e12)
    assert abs(gemm.ms - max(tf32_s, hbm_s) * 1e3) < 1e-12


def test_views_that_do_not_say_so_and_in_place_shape_changes_are_no_kernel():
    """F.linear on a 3-D input without a bias is mm, then `_unsafe_view` (a view its schema does not mark); and `t_`,
    `unsqueeze_` change metadata only. Each was priced as a kernel reading and writing its tensor (HF's Llama rows:
    37 such kernels and 4% of the bytes at the tiny model)."""
    x, w = torch.randn(2, 16, 32), torch.randn(8, 32)
    y = torch.randn(4, 4)
    with OpCosts(GPUS["h100"]) as costs:
        torch.nn.functional.linear(x, w)
        y.t_().unsqueeze_(0)
    assert dict(costs.by_op).keys() == {"mm"}, dict(costs.by_op)
    assert costs.total().bytes == (32 * 32 + 8 * 32 + 32 * 8) * 4


def test_a_bf16_gemm_meets_the_bf16_peak_and_fake_tensors_cost_the_same():
    with FakeTensorMode():
        a = torch.randn(4096, 4096, dtype=torch.bfloat16)
        with OpCosts(GPUS["h200"]) as costs:
            a @ a
    gemm = costs.by_category["gemm"]
    assert gemm.flops == 2 * 4096 ** 3
    assert abs(gemm.ms - gemm.flops / (GPUS["h200"].bf16_tflops * 1e12) * 1e3) < 1e-9


def test_categories():
    assert category("mm") == "gemm" and category("_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert category("_to_copy") == "cast/copy" and category("_log_softmax_backward_data") == "loss"
    assert category("_fused_adamw_") == "optimizer" and category("mul") == "elementwise/other"


def tiny_linear_weights() -> tuple[Any, int]:
    """The tiny model's resolved config and its linear layers' weight count (blocks and the output head)."""
    from megalm.config import resolve_model_defaults
    from tests.conftest import compose_config

    m = resolve_model_defaults(compose_config("model=tiny", tiny=False).model)
    kv = m.hidden_size // m.num_heads * m.num_kv_heads
    per_layer = m.hidden_size * (m.hidden_size * 2 + 2 * kv) + 3 * m.hidden_size * m.ffn_hidden_size
    return m, m.num_layers * per_layer + m.hidden_size * m.padded_vocab_size


def test_the_step_cost_tool_counts_six_flops_per_weight_and_token():
    result = subprocess.run([sys.executable, str(ROOT / "tools/bench/step_cost.py"), "model=tiny", "--json"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    rows = {r["system"]: r for r in report["systems"]}
    titan = not any(note.startswith("torchtitan") for note in report["notes"])  # at compare_peers.txt's pin
    expected = {"megalm", "megalm_autocast", "hf_llama", "megalm_compiled"}
    assert set(rows) == expected | ({"torchtitan", "torchtitan_compiled"} if titan else set()), report["notes"]
    assert [note for note in report["notes"] if not note.startswith("torchtitan")] == [], report["notes"]
    m, weights = tiny_linear_weights()
    with torch.device("meta"):
        tensors = len(list(GPT(m).parameters()))
    for system, row in rows.items():
        gemm_tflop = row["by_category"]["gemm"]["tflop"]
        assert abs(gemm_tflop * 1e12 - 6 * weights * m.seq_length) < 1e-6 * gemm_tflop * 1e12, system
        # the clip's foreach norm and its scale, fused AdamW per param group: a few kernels, not one per parameter (a
        # per-parameter norm alone would add 27, the tiny model's parameter tensors); megalm's Triton AdamW (auto on
        # a GPU, behind bf16 working weights) launches once per parameter tensor, writing its bf16 copy too
        optimizer, triton = row["optimizer"], system in ("megalm", "megalm_compiled")
        steps = optimizer["by_category"]["optimizer"]["kernels"] if triton else 0
        assert steps == (tensors if triton else 0), (system, optimizer)
        assert optimizer["kernels"] - steps <= 20, (system, optimizer["kernels"])
        assert set(row["by_category"]) >= {"gemm", "attention", "cast/copy", "elementwise/other", "loss"}
        # the loss, from the logits to the scalar, forward and backward, whatever ops compute it (megalm's chunks are
        # generic ops, counted as elementwise/other by name): at least the bf16 logits read once
        loss_bytes = row["by_category"]["loss"]["gbytes"] * 1e9
        assert loss_bytes >= m.seq_length * m.padded_vocab_size * 2, (system, row["by_category"]["loss"])
    # every system's attention is causal over one document, as each runs it on a GPU: the same FLOPs (HF's would
    # double under fake tensors, where it cannot read its position ids and builds a mask: step_cost.py)
    attention = {system: row["by_category"]["attention"]["tflop"] for system, row in rows.items()}
    assert len(set(attention.values())) == 1, attention
    # compiled: inductor's generated kernels replace the blocks' elementwise ops (fewer kernels, fewer bytes); its
    # GEMMs, traced from the replay of the extern kernels inductor calls, still count 6 FLOPs per weight and token
    for system in [name for name in rows if name.endswith("_compiled")]:
        eager, compiled = rows[system.removesuffix("_compiled")], rows[system]
        graphs = compiled["inductor_graphs"]
        assert all(g["generated_kernels"] > 0 and g["extern_replayed"] == sum(g["extern"].values()) for g in graphs)
        assert compiled["kernels"] < eager["kernels"] and compiled["gbytes"] < eager["gbytes"], (compiled, eager)
        for name in ("gemm", "attention"):  # the same kernels (inductor may fold the residual add into an addmm)
            for key in ("kernels", "tflop"):
                assert compiled["by_category"][name][key] == eager["by_category"][name][key], (system, name, key)


@pytest.mark.parametrize("system", ["megalm", pytest.param("megalm_compiled", marks=pytest.mark.slow)])
def test_gradient_accumulation_fusion_saves_four_bytes_per_weight_in_the_trace(system):
    """The step as a GPU runs it (--gpu), two micro-batches: fused, each weight-gradient GEMM writes its fp32 sum (4
    bytes; the second reads and writes it, 8) where it wrote a bf16 gradient that the hook read and copied in (2 + 2 +
    4) or added in (2 + 2 + 4 + 4): 4 bytes a linear weight less per micro-batch, and the copies are gone; the same
    FLOPs (6 per weight and token). Compiled too (a long test, by hand: two inductor compiles, 60 s of the default
    run on 2 cores; the layers' ops are priced op by op, as eager's are)."""
    from megalm.parallel.data_parallel.fused_wgrad import accumulator_problem

    if accumulator_problem("cpu", fake=True):
        pytest.skip(f"torch {torch.__version__}'s fake tensors cannot run the fused GEMM (the trace prices the CPU's "
                    "emulation, and says so)")
    rows = {}
    for fused in (False, True):
        result = subprocess.run([sys.executable, str(ROOT / "tools/bench/step_cost.py"), "--gpu", "h100", "--json",
                                 "--systems", system, "model=tiny", "trainer.global_batch_size=2",
                                 f"parallel.gradient_accumulation_fusion={str(fused).lower()}"],
                                capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert result.returncode == 0, result.stderr[-2000:]
        rows[fused] = {r["system"]: r for r in json.loads(result.stdout)["systems"]}
    _, weights = tiny_linear_weights()
    plain, fused = rows[False][system], rows[True][system]
    assert fused["tflop"] == plain["tflop"]
    saved = (plain["gbytes"] - fused["gbytes"]) * 1e9
    copies = (plain["by_category"]["cast/copy"]["gbytes"] - fused["by_category"]["cast/copy"]["gbytes"]) * 1e9
    assert copies >= 6 * weights * (1 - 1e-6), (copies, weights)
    if system == "megalm":  # compiled, inductor's kernels around the layers' ops change too (a few more)
        assert abs(saved - 2 * 4 * weights) <= 1e-6 * saved, (saved, weights)
    assert saved > 0 and fused["roofline_ms"] < plain["roofline_ms"]


def test_a_gemm_accumulating_into_fp32_runs_at_its_bf16_operands_peak():
    """C + A B with bf16 A and B and an fp32 C (a fused weight gradient after a step's first micro-batch): the tensor
    cores multiply bf16, so the bf16 peak, not TF32's; with beta = 0, C is not read."""
    from megalm.parallel.data_parallel.fused_wgrad import accumulator_problem

    if accumulator_problem("cpu", fake=True):
        pytest.skip(f"torch {torch.__version__}'s fake tensors cannot run addmm's out_dtype overload")
    gpu = GPUS["h100"]
    with FakeTensorMode():
        a, b = torch.empty(8192, 8192, dtype=torch.bfloat16), torch.empty(8192, 8192, dtype=torch.bfloat16)
        c = torch.empty(8192, 8192)
        costs = {}
        for beta in (0.0, 1.0):
            with OpCosts(gpu) as costs[beta]:
                torch.addmm(c, a, b, beta=beta, out_dtype=torch.float32, out=c)
    flops = 2 * 8192**3
    for beta, cost in costs.items():
        gemm = cost.by_category["gemm"]
        assert gemm.flops == flops and gemm.ms == pytest.approx(flops / (gpu.bf16_tflops * 1e12) * 1e3), beta
        assert gemm.bytes == 2 * a.numel() * 2 + c.numel() * 4 * (2 if beta else 1), beta


def test_a_counted_call_and_its_backward_count_under_its_category():
    """`OpCosts.call_counted_as`: the memory-bound ops the call runs, and those of the backward of the autograd nodes
    it made, move to its category; the GEMM before it, the op after it and their backward keep theirs, and the
    totals do not change."""
    def step(costs: OpCosts, counted: bool) -> None:
        w = torch.randn(8, 8, dtype=torch.bfloat16, requires_grad=True)
        y = torch.randn(4, 8, dtype=torch.bfloat16) @ w
        loss = (lambda t: t.float().exp().sum())  # a cast, an exp and a sum; ToCopy's and Exp's backward
        total = costs.call_counted_as("loss", loss, y) if counted else loss(y)
        (total * 2).backward()  # a multiply after it, and its backward, outside

    costs = {}
    for counted in (False, True):
        with OpCosts() as costs[counted]:
            step(costs[counted], counted)
    plain, counted = (costs[k].by_category for k in (False, True))
    assert counted["loss"].kernels == 5 and plain["loss"].kernels == 0, counted
    assert counted["gemm"].kernels == plain["gemm"].kernels > 0
    moved = sum(plain[n].kernels - counted[n].kernels for n in ("elementwise/other", "cast/copy"))
    assert moved == 5 and costs[True].total().kernels == costs[False].total().kernels
    assert counted["elementwise/other"].kernels >= 2  # the multiply after the loss, forward and backward


@pytest.mark.slow  # 48 s of the default run (inductor over fake tensors), which keeps the dense model's compiled row
# (test_the_step_cost_tool_counts_six_flops_per_weight_and_token) and the MoE blocks' compiled layouts
def test_the_step_cost_tool_traces_compiled_moe_blocks():
    """An MoE model's compiled blocks through inductor over fake tensors: fewer kernels and bytes than eager, the
    same GEMM FLOPs. Its micro-batch is one document, whose sequence loss scatter-adds the tokens into a tensor of
    one element: inductor's C++ kernels fail on that (torch 2.9 to 2.13, an InductorError), so the router keeps a
    slot more (megalm/model/moe.py)."""
    result = subprocess.run([sys.executable, str(ROOT / "tools/bench/step_cost.py"), "--systems",
                             "megalm,megalm_compiled", "--json", "model=moe_tiny", "model.seq_length=256",
                             "model.moe.seq_aux_loss_coeff=0.01"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {r["system"]: r for r in json.loads(result.stdout)["systems"]}
    eager, compiled = rows["megalm"], rows["megalm_compiled"]
    assert compiled["kernels"] < eager["kernels"] and compiled["gbytes"] < eager["gbytes"], (compiled, eager)
    assert compiled["by_category"]["gemm"]["tflop"] == eager["by_category"]["gemm"]["tflop"]


def test_grouped_gemms_forward_and_backward_cost_what_the_per_expert_loop_costs():
    """MoE experts as grouped GEMMs (torch's flop counter has no formula for them): the forward and both backward
    GEMMs (input gradient: [N, out] x [G, out, in]; weight gradient: [in, N] x [N, out] grouped along N) count the
    FLOPs of the per-expert loop, 2 · rows · in · out each, whatever the split."""
    from megalm.model.moe import expert_loop, grouped_linear

    counts = torch.tensor([5, 0, 7, 4])
    x = torch.randn(int(counts.sum()), 8, requires_grad=True)
    weight = torch.randn(4, 12, 8, requires_grad=True)
    costs = {}
    for name, fn in (("grouped", grouped_linear), ("loop", expert_loop)):
        with OpCosts() as cost:
            fn(x, weight, counts).sum().backward()
        costs[name] = cost.total().flops
    assert costs["grouped"] == costs["loop"] == 3 * 2 * 16 * 8 * 12


def test_overwrites_fills_and_allocations_read_nothing_they_do_not_read():
    """A copy into an fp32 gradient bucket reads its bf16 source and writes the bucket: 6 bytes per element, not 10.
    A fill writes only; an allocation runs no kernel."""
    bucket, grad = torch.empty(1000), torch.ones(1000, dtype=torch.bfloat16)
    with OpCosts(GPUS["h100"]) as costs:
        bucket.copy_(grad)
        bucket.zero_()
        torch.empty_like(bucket)
        torch.zeros_like(grad)
    assert costs.by_op["copy_"].bytes == 1000 * (2 + 4)
    assert costs.by_op["zero_"].bytes == 1000 * 4
    assert costs.by_op["zeros_like"].bytes == 1000 * 2
    assert "empty_like" not in costs.by_op
    out = torch.empty(8, 8)
    with OpCosts(GPUS["h100"]) as costs:
        torch.mm(torch.ones(8, 4), torch.ones(4, 8), out=out)
    assert costs.by_op["mm"].bytes == 4 * (8 * 4 + 4 * 8 + 8 * 8), "an out= tensor is written, not read"
    with OpCosts(GPUS["h100"]) as costs:
        torch.max(torch.ones(8, 4), 1, out=(torch.empty(8), torch.empty(8, dtype=torch.long)))
    assert costs.by_op["max"].bytes == 8 * 4 * 4 + 8 * 4 + 8 * 8, "every out= tensor, whatever its name"


def test_in_place_ops_that_return_nothing_write_what_they_update():
    """Fused AdamW reads the weights, gradients and both moments and writes the weights and moments back: 28 bytes
    per fp32 parameter (it returns nothing, so only its schema says what it writes). A foreach copy into bf16
    working weights reads the fp32 source and writes the copy."""
    params = [torch.nn.Parameter(torch.ones(1000))]
    params[0].grad = torch.ones(1000)
    optimizer = torch.optim.AdamW(params, lr=0.1, fused=True)
    optimizer.step()  # the moments exist from here on
    with OpCosts(GPUS["h100"]) as costs:
        optimizer.step()
        torch._foreach_copy_([torch.empty(1000, dtype=torch.bfloat16)], [params[0].detach()])
    assert costs.by_op["_fused_adamw_"].bytes == 1000 * 4 * (4 + 3) + 4  # + the step count read
    assert costs.by_op["_foreach_copy_"].bytes == 1000 * (4 + 2)


def test_a_wrapper_subclass_is_priced_by_the_kernels_its_dispatch_runs():
    """An op on a tensor subclass that wraps others (torchao's FP8 training tensor, DTensor) is whatever kernels its
    `__torch_dispatch__` runs on the inner tensors, not one op priced at the wrapper's nominal dtype: torchao's
    Float8Linear multiplies through `torch._scaled_mm` inside such an `mm`. torch's TwoTensor runs each op twice."""
    from torch.testing._internal.two_tensor import TwoTensor

    a = TwoTensor(torch.randn(8, 16), torch.randn(8, 16))
    with OpCosts(GPUS["h100"]) as costs:
        a @ torch.randn(16, 4)
    assert costs.by_op["mm"].kernels == 2 and costs.by_op["mm"].flops == 2 * (2 * 8 * 16 * 4), dict(costs.by_op)


def test_a_dtensor_op_costs_and_holds_its_shard_only():
    """DTensor's sharding propagation reruns an op on fresh fake tensors of the global shape to learn its output's
    metadata (at a cache miss; on torch 2.11 at every op of its slow path), and places an op without a sharding rule
    by running its decomposition on meta tensors: no kernel, nothing held. The probes pass it through, so an FSDP
    rank is priced and its memory counted by its shard (on torch 2.11 its optimizer step had cost its shard plus the
    whole model, and the estimator's activation peak doubled)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from megalm import compat
    from megalm.measure import LiveStorages

    world, rows, cols = 4, 37, 11  # a shape no other test propagates: the propagation cache misses
    compat.init_fake_process_group(0, world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        with FakeTensorMode():
            x = DTensor.from_local(torch.empty(rows, cols), mesh, [Shard(0)], run_check=False)
            with LiveStorages() as live, OpCosts(GPUS["h100"]) as costs:
                y = x * 2
            assert y.shape == (world * rows, cols)
            unruled = OpCosts(GPUS["h100"])
            if importlib.util.find_spec("torch.distributed.tensor._decompositions"):  # from torch 2.11 (2.9 refuses)
                with unruled:  # an op without a sharding rule of its own: placed through its decomposition
                    torch.nn.functional.hardswish(x)
    finally:
        dist.destroy_process_group()
    shard = rows * cols * 4
    assert costs.by_op["mul"].kernels == 1 and costs.by_op["mul"].bytes == 2 * shard, dict(costs.by_op)
    assert live.peak("cpu") == shard, live.peak("cpu")
    assert unruled.total().bytes <= 2 * shard, dict(unruled.by_op)  # one elementwise pass over the shard at most


def test_torchtitan_fp8_is_traced_with_the_gemms_its_gpu_runs():
    """TorchTitan's fp8 rows (its Float8 converter: torchao's Float8Linear) multiply in FP8 as megalm's do: the same
    GEMM FLOPs at the FP8 peak (compute-bound shapes, the output head bf16 in both), eager and compiled; and megalm's
    compiled FP8 graphs replay exactly the extern kernels inductor calls. Runs where tools/compare_peers.txt's
    TorchTitan is installed (the CI leg of the GPU image's torch)."""
    import pytest

    from tools.bench.compare_run import pin_problem

    if problem := pin_problem("torchtitan") or pin_problem("torchao"):
        pytest.skip(problem)
    result = subprocess.run([sys.executable, str(ROOT / "tools/bench/step_cost.py"), "--gpu", "h100", "--json",
                             "model=1.3b", "model.num_layers=1", "model.seq_length=2048", "model.vocab_size=1024",
                             "precision=fp8", "precision.bf16_weights=true"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    rows = {r["system"]: r["by_category"]["gemm"] for r in report["systems"]}
    assert set(rows) == {"megalm", "megalm_compiled", "torchtitan", "torchtitan_compiled"}, report["notes"]
    assert [n for n in report["notes"] if not n.startswith("hf_llama left out")] == [], report["notes"]
    for system, gemm in rows.items():
        assert gemm["tflop"] == rows["megalm"]["tflop"], system
        assert abs(gemm["ms"] - rows["megalm"]["ms"]) < 1e-3 * rows["megalm"]["ms"], (system, gemm, rows["megalm"])


def test_collectives_take_no_hbm_time():
    """A collective's time is its link's, priced by the estimator from the bytes it moves (estimate/collectives.py):
    the trace counts it as a kernel of the communication category at 0 ms, eager (`c10d`) and functional alike, and
    so does a compiled graph's (inductor's extern kernel, replayed). Priced as a read and a write of its buffers at
    HBM bandwidth too, every collective had been counted twice (a tp8 1.3B step's compute 13% too long)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from megalm import compat
    from megalm.measure.compiled_cost import InductorCosts

    compat.init_fake_process_group(0, 4)
    try:
        group = dist.group.WORLD
        with FakeTensorMode():
            x = torch.empty(1024, 64)
            with OpCosts(GPUS["h100"]) as eager:
                dist.all_reduce(x)
                funcol.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(x, 4, group.group_name))
            backend = InductorCosts()
            compiled = torch.compile(lambda t: funcol.all_reduce(t * 2, "sum", group) + 1, backend=backend,
                                     fullgraph=True)
            with OpCosts(GPUS["h100"]) as traced:
                compiled(x)
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    communication = eager.by_category["communication"]
    assert communication.kernels == 2 and communication.bytes > 0 and communication.ms == 0.0, dict(eager.by_op)
    assert eager.total().ms == 0.0, dict(eager.by_category)
    assert traced.by_category["communication"].kernels == 1 and traced.by_category["communication"].ms == 0.0, \
        dict(traced.by_op)
    assert traced.by_category["elementwise/other"].kernels == 2, backend.graphs  # x * 2, then + 1: not fused over it


def test_a_trace_of_a_gpu_step_prices_megalm_s_one_pass_adamw_at_30_bytes_a_parameter():
    """`optim.implementation=auto` steps bf16 working weights' fp32 main weights with megalm's Triton AdamW on CUDA
    (1.37x torch's kernel and cast on an H100, 2026-12-05); a trace of a GPU step (fake tensors, on any device) steps
    it too, as one op a parameter tensor (megalm::adamw_step) of 30 bytes a parameter: the main weight, gradient and
    moments read (16), the three written back and the bf16 copy written (14), plus the clip's scale read (4 bytes a
    call). `fused` is torch's kernel, which writes the unscaled gradients back (4 more), and then the copy into the
    working weights (reading the main weight again, writing bf16: 6): 38."""
    from tools.bench.step_cost import megalm_step

    m, _ = tiny_linear_weights()
    with torch.device("meta"):
        params = list(GPT(m).parameters())
    count = sum(p.numel() for p in params)
    steps = {impl: megalm_step(["model=tiny", f"optim.implementation={impl}"], "h100")["optimizer"]["by_category"]
             for impl in ("auto", "fused")}
    one_pass = steps["auto"]["optimizer"]
    assert one_pass["kernels"] == len(params)
    assert one_pass["gbytes"] * 1e9 == pytest.approx(30 * count + 4 * len(params), abs=1)
    assert steps["fused"]["optimizer"]["gbytes"] * 1e9 == pytest.approx(38 * count, abs=1024)


def test_an_attention_backward_runs_at_the_peak_of_its_bf16_operands():
    """The attention backward takes the forward's fp32 logsumexp beside its bf16 q, k, v: the peak is its operands'
    (the narrowest floating dtype), where the fp32 input had priced it at TF32's, half the rate (every step-cost
    table's attention column 1.7x too long)."""
    with FakeTensorMode():
        q, k, v = (torch.randn(1, 16, 4096, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        with OpCosts(GPUS["h100"]) as costs:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.randn_like(out))
    attention = {name: c for name, c in costs.by_op.items() if category(name) == "attention"}
    assert len(attention) == 2, dict(costs.by_op)
    half_square = 4 * 16 * 4096 * 4096 * 128 / 2  # QKᵀ and PV, causal
    for name, cost in attention.items():
        assert cost.flops == half_square * (2 if name.endswith("backward") else 1), name
        assert cost.ms == pytest.approx(cost.flops / (GPUS["h100"].bf16_tflops * 1e12) * 1e3, rel=1e-9), name


@pytest.mark.parametrize("kernel, extra", [("_scaled_dot_product_flash_attention", (0.0, True)),
                                           ("_scaled_dot_product_efficient_attention", (None, False, 0.0, True)),
                                           ("_scaled_dot_product_cudnn_attention", (None, False, 0.0, True))])
def test_torch_s_cuda_attention_kernels_count_half_the_square_when_causal(kernel, extra):
    """torch's FLOP formulas for its CUDA attention kernels count the whole square, causal or not; a causal call
    computes half of it (flash kernels skip the masked blocks), as the CPU kernel's formula here says."""
    with FakeTensorMode():
        q, k, v = (torch.empty(1, 16, 1024, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        flops = {}
        for causal in (True, False):
            with OpCosts(GPUS["h100"]) as costs:
                getattr(torch.ops.aten, kernel)(q, k, v, *extra[:-1], causal)
            flops[causal] = costs.total().flops
    assert flops[False] == 4 * 16 * 1024 * 1024 * 128 and flops[True] == flops[False] / 2, flops


def test_ops_that_touch_the_elements_their_indices_name_are_priced_by_those():
    """The loss's gathers and scatters, an embedding's rows and nll_loss's one logit a row: priced as reading (and
    writing) whole tensors, each had cost a full pass over the [T, V] logits (8 of the 48 bytes a logit of the
    1.3B step's loss)."""
    T, V, h = 256, 5000, 64
    with FakeTensorMode():
        logits, index = torch.empty(T, V, dtype=torch.bfloat16), torch.zeros(T, 1, dtype=torch.long)
        weight, tokens = torch.empty(V, h, dtype=torch.bfloat16), torch.zeros(T, dtype=torch.long)
        log_probs, targets = torch.empty(T, V), torch.zeros(T, dtype=torch.long)
        table, rows, values, zero = torch.empty(1000, 100), torch.arange(10), torch.empty(10, 100), torch.empty(())
        cases = {  # bytes: what is read (indices and the elements they name) and written
            "gather": (lambda: logits.gather(-1, index), T * 8 + 2 * T * 2),
            "scatter_": (lambda: logits.scatter_(-1, index, torch.empty(T, 1, dtype=torch.bfloat16)),
                         T * 8 + 2 * T * 2),
            "scatter_add_": (lambda: logits.scatter_add_(-1, index, torch.empty(T, 1, dtype=torch.bfloat16)),
                             T * 8 + 3 * T * 2),
            "embedding": (lambda: torch.nn.functional.embedding(tokens, weight), T * 8 + 2 * T * h * 2),
            "nll_loss_forward": (lambda: torch.ops.aten.nll_loss_forward(log_probs, targets, None, 1, -100),
                                 T * 8 + T * 4 + 2 * 4),
            "index_put_": (lambda: table.index_put_((rows,), values), 10 * 8 + 2 * 10 * 100 * 4),
            "index_put_ broadcast": (lambda: table.index_put_((rows,), zero), 10 * 8 + 4 + 10 * 100 * 4),
        }
        for name, (op, expected) in cases.items():
            with OpCosts(GPUS["h100"]) as costs:
                op()
            assert costs.total().bytes == expected, (name, costs.total().bytes, expected)
