"""megalm.measure.kernel_profile sums torch.profiler's events per step: on a GPU the kernels' busy time (their
intervals' union) against the wall time, on a CPU the aten ops' self time; tools/bench/throughput.py --profile
prints it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megalm.measure.kernel_profile import STEP_SPAN, format_profile, kernel_kind, summarize

ROOT = Path(__file__).resolve().parents[2]
# Wide enough that the ops, not Python, fill most of the step: an op's time counted with its children's (a linear
# and its mm) would then pass the wall time (1.34x measured, against 0.83x for the self time).
TINY = ["model.num_layers=2", "model.hidden_size=256", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=512", "model.seq_length=256", "trainer.global_batch_size=2",
        "trainer.micro_batch_size=1"]


@pytest.mark.parametrize(("name", "kind"), [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>(Flash_fwd_params)",
     "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),  # not sm90_'s gemm
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "compiled (triton)"),
    # inductor names a kernel after the ops fused into it: an FP8 cast feeding torch._scaled_mm; a GEMM template
    ("triton_poi_fused__scaled_mm__to_copy_clamp_clone_eq_inductor_force_stride_order_isinf_2", "compiled (triton)"),
    ("triton_red_fused__fused_rms_norm_backward_add_cat_flash_attention_backward_1", "compiled (triton)"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::NormOps<float>>>", "reduction"),
    ("Memcpy DtoD (Device -> Device)", "copy/cast"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("some_new_kernel", "other"),
])
def test_kernel_names_are_sorted_by_kind(name: str, kind: str) -> None:
    assert kernel_kind(name) == kind


def _kernel(name: str, start: float, end: float, annotation: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=SimpleNamespace(name="CUDA"), is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start, end=end), self_cpu_time_total=0.0)


def test_busy_time_is_the_union_of_kernel_intervals() -> None:
    """Two streams overlapping: the GPU is busy for the union (µs), kernels sum to more; per step over 2 steps."""
    host_op = SimpleNamespace(name="aten::mm", device_type=SimpleNamespace(name="CPU"),
                              time_range=SimpleNamespace(start=0, end=5000), self_cpu_time_total=5000.0)
    optimizer_span = _kernel("Optimizer.step#AdamW.step", 0, 3500, annotation=True)  # a span, not a kernel
    events = [host_op, _kernel("gemm_a", 0, 1000), _kernel("gemm_a", 500, 1500), _kernel("copy_b", 3000, 3500),
              _kernel("gemm_a", 3200, 3300), optimizer_span]
    profile = summarize(events, steps=2, wall_s=0.008)
    assert profile.device == "cuda"
    assert profile.busy_ms == pytest.approx((1500 + 500) / 1e3 / 2)  # [0, 1500) and [3000, 3500)
    assert profile.kernel_ms == pytest.approx((1000 + 1000 + 500 + 100) / 1e3 / 2)
    assert profile.kernels == 2 and profile.wall_ms == pytest.approx(4.0)
    assert profile.idle_share == pytest.approx(1 - 1.0 / 4.0)
    assert profile.by_kind == pytest.approx({"gemm": 1.05, "copy/cast": 0.25})
    assert profile.top[0] == ("gemm_a", 1.5, pytest.approx(1.05))
    assert "idle 75.0% of the wall" in format_profile(profile)
    assert profile.host_syncs == 0 and profile.device_to_host == 0
    profile.unprofiled_ms = 2.5  # the step timed without the profiler's host cost
    assert profile.unprofiled_idle_share == pytest.approx(0.6)
    assert "against the unprofiled step (2.5 ms) idle 60.0%" in format_profile(profile)


def test_host_syncs_and_copies_to_the_host_are_counted_per_step() -> None:
    """An `.item()` on a GPU tensor as the profiler records it: a copy kernel to the host and the runtime call that
    waits for it (host side); launches and a device-to-device copy are neither."""
    def runtime(name: str, at: float = 0) -> SimpleNamespace:
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name="CPU"),
                               time_range=SimpleNamespace(start=at, end=at + 1), self_cpu_time_total=1.0)

    events = [_kernel("gemm_a", 0, 100), runtime("cudaLaunchKernel"), runtime("cudaMemcpyAsync"),
              _kernel("Memcpy DtoH (Device -> Pageable)", 100, 101), runtime("cudaStreamSynchronize"),
              _kernel("Memcpy DtoD (Device -> Device)", 101, 102), runtime("cudaDeviceSynchronize"),
              _kernel("Memcpy DtoH (Device -> Pinned)", 102, 103), runtime("cudaStreamSynchronize")]
    profile = summarize(events, steps=2, wall_s=0.001)
    assert profile.host_syncs == 1.5 and profile.device_to_host == 1.0
    # with the steps' spans recorded, a sync outside them (the harness timing the steps) is not the step's
    step_span = SimpleNamespace(name=STEP_SPAN, device_type=SimpleNamespace(name="CPU"),
                                time_range=SimpleNamespace(start=0, end=50), self_cpu_time_total=0.0)
    profile = summarize([*events, step_span, runtime("cudaDeviceSynchronize", at=60)], steps=2, wall_s=0.001)
    assert profile.host_syncs == 1.5
    assert "host syncs 1.5 per step" in format_profile(profile)
    assert "device-to-host copies 1.0" in format_profile(profile)


def _throughput():
    spec = importlib.util.spec_from_file_location("throughput_bench", ROOT / "tools/bench/throughput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_throughput_profiles_the_cpu_step(capsys) -> None:
    """On a CPU: the aten ops' self time, which cannot exceed the wall time, per step (the op counts of one step
    and of the mean of two agree: training steps of the same shapes dispatch the same ops)."""
    bench = _throughput()
    one = bench.main(["--steps", "1", "--warmup", "1", "--profile", "1", *TINY])["profile"]
    two = bench.main(["--steps", "1", "--warmup", "1", "--profile", "2", *TINY])["profile"]
    for profile in (one, two):
        assert profile["device"] == "cpu" and profile["idle_share"] is None
        assert 0 < profile["busy_ms"] <= 1.05 * profile["wall_ms"]
        assert profile["by_kind"]["gemm"] > 0
        assert any(name in ("aten::mm", "aten::addmm") for name, _, _ in profile["top"])
    calls = lambda profile: {name: n for name, n, _ in profile["top"]}  # noqa: E731
    mm = "aten::mm"
    assert calls(one)[mm] == calls(two)[mm]
    assert "aten ops (self CPU time)" in capsys.readouterr().out


def test_profile_arguments_are_checked(tmp_path, monkeypatch) -> None:
    """--profile-trace needs --profile; a file already there is refused before the run (the profiler replaced it),
    a missing folder is made (the profiler failed to write, exit 0), and a trace the profiler did not write is an
    error (an audit, 2026-12-06)."""
    from megalm.errors import ConfigError

    bench = _throughput()
    with pytest.raises(SystemExit):
        bench.main(["--profile-trace", "t.json", *TINY])
    mine = tmp_path / "notes.json"
    mine.write_text("mine")
    with pytest.raises(ConfigError, match="notes.json exists; nothing was run"):
        bench.main(["--steps", "1", "--warmup", "0", "--profile", "1", "--profile-trace", str(mine), *TINY])
    assert mine.read_text() == "mine"
    trace = tmp_path / "new" / "trace.json"
    bench.main(["--steps", "1", "--warmup", "0", "--profile", "1", "--profile-trace", str(trace), *TINY])
    assert json.loads(trace.read_text())["traceEvents"]
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", lambda self, path: None)
    with pytest.raises(OSError, match="the profiler wrote no Chrome trace"):
        bench.main(["--steps", "1", "--warmup", "0", "--profile", "1", "--profile-trace", str(tmp_path / "t.json"),
                    *TINY])


def test_throughput_runs_the_default_warm_up_without_a_warning(caplog) -> None:
    """A benchmark of a few steps under the default 20-step warm-up: the config check's line that the learning rate
    never ends warming up was noise beside the timing (the schedule does not change a step's time), so the warm-up
    is shortened to the run; a warm-up the command names is kept, and warned about."""
    import logging

    bench = _throughput()
    default = [o for o in TINY if not o.startswith("optim.warmup_steps=")]
    with caplog.at_level(logging.WARNING, logger="megalm"):
        bench.main(["--steps", "1", "--warmup", "1", *default])
    assert "warms up for the whole run" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="megalm"):
        bench.main(["--steps", "1", "--warmup", "1", *default, "optim.warmup_steps=20"])
    assert "optim.warmup_steps=20 >= trainer.max_steps=2" in caplog.text


def test_throughput_counts_the_compiled_blocks_graph_breaks(monkeypatch, capsys) -> None:
    """With trainer.compile=true the row says whether the blocks were whole graphs, from dynamo's own counters: none
    broken on the tiny model; a block that breaks (a graph break put into its forward) is counted and named."""
    from megalm.model.gpt import TransformerBlock

    bench = _throughput()
    compiled = ["trainer.compile=true", "trainer.compile_backend=eager"]
    whole = bench.main(["--steps", "2", "--warmup", "1", *TINY, *compiled])["compile"]
    assert whole["graph_breaks"] == 0 and whole["frames"] >= 1 and whole["failed_frames"] == 0, whole
    assert "dynamo over the run: 0 graph breaks" in capsys.readouterr().out
    forward = TransformerBlock.forward

    def broken(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TransformerBlock, "forward", broken)
    cut = bench.main(["--steps", "2", "--warmup", "1", *TINY, *compiled])["compile"]
    assert cut["graph_breaks"] > 0 and cut["break_reasons"], cut
