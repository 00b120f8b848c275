"""Data parallelism on gloo: bucketed overlapped grad reduction and the ZeRO-1 optimizer.

Every test runs 2 or 4 spawned processes on a tiny fp32 model and compares against the single-process
computation of the same global batch (each rank computes that reference itself, deterministically).
The global batch is split *unevenly* over ranks and micro-batches, with the loss normalised by the
global token count, so only a SUM over DP ranks reproduces the single-process gradient.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalm.parallel.data_parallel.bucket_adamw import BucketAdamW
from megalm.parallel.data_parallel.reducer import GradReducer
from megalm.training.optim import param_groups, set_lr

from .launch import run_distributed

TIMEOUT = 60  # seconds; a hang (unpaired collective) fails the test instead of stalling CI


def _collected(rank: int, world: int, fn, *args) -> None:
    """Run fn, then free its garbage before the launcher destroys the process group.

    torch.optim's constructor leaves a reference cycle through the caller's frames, which keeps the
    worker's locals (reducer, optimizer -> process group) alive until the cyclic GC runs; if that is
    at interpreter exit, a gloo worker thread may still be releasing a tensor and aborts (SIGABRT).
    """
    fn(rank, world, *args)
    gc.collect()


def _spawn(fn, world: int, *args) -> None:
    run_distributed(_collected, world, fn, *args, timeout=TIMEOUT)


# ---------------------------------------------------------------------------- model and data

BUCKET_MB = 256 / 2**20  # 256 bytes = 64 fp32 values: several buckets on the tiny model
IN, HID, OUT = 8, 16, 7  # OUT=7 makes bucket sizes odd, so ZeRO-1 must pad and cut through parameters
TOKENS = 24
SPLITS = {2: [10, 14], 4: [4, 6, 5, 9]}  # uneven tokens per rank


class Net(nn.Module):
    def __init__(self, extras: bool = True):
        super().__init__()
        if extras:  # registered first -> lands in the last bucket, after the overlapped ones
            self.unused = nn.Parameter(torch.randn(5))
        self.fc1 = nn.Linear(IN, HID)
        self.norm = nn.LayerNorm(HID)
        self.branch = nn.Linear(HID, HID)
        self.fc2 = nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.norm(self.fc1(x)))
        if use_branch:
            h = h + self.branch(h)
        return self.fc2(h)


def make_net(extras: bool = True) -> Net:
    torch.manual_seed(0)
    net = Net(extras)
    with torch.no_grad():  # non-trivial norm parameters so their gradients matter
        net.norm.weight.add_(0.1 * torch.randn(HID))
        net.norm.bias.add_(0.1 * torch.randn(HID))
    return net


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(TOKENS, IN, generator=g), torch.randint(0, OUT, (TOKENS,), generator=g)


def pieces(step: int, world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """[rank][micro_batch] -> (x, y): the global batch split unevenly over ranks, two micro-batches each."""
    x, y = global_batch(step)
    out = []
    for xr, yr in zip(x.split(SPLITS[world]), y.split(SPLITS[world]), strict=True):
        cut = [len(xr) // 2 - 1, len(xr) - len(xr) // 2 + 1]
        out.append(list(zip(xr.split(cut), yr.split(cut), strict=True)))
    return out


def loss_of(net: Net, x: torch.Tensor, y: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
    return F.cross_entropy(net(x, use_branch), y, reduction="sum") / TOKENS  # sum / global token count


def reference_grads(net: Net, step: int, world: int, use_branch=lambda rank, mb: True) -> None:
    """Single process: backward over every piece of the global batch into net's .grad."""
    for rank, mbs in enumerate(pieces(step, world)):
        for i, (x, y) in enumerate(mbs):
            loss_of(net, x, y, use_branch(rank, i)).backward()


def dp_grads(net: Net, reducer: GradReducer, step: int, rank: int, world: int,
             use_branch=lambda rank, mb: True) -> None:
    """This rank's part: start_step, two micro-batches, finish."""
    mbs = pieces(step, world)[rank]
    reducer.start_step(len(mbs))
    for i, (x, y) in enumerate(mbs):
        loss_of(net, x, y, use_branch(rank, i)).backward()
    reducer.finish()


def partial_branch(rank: int, mb: int) -> bool:
    """Rank 1 uses the branch in its first micro-batch only (1 of 2 hooks fire), rank 2 never, the others
    always: some ranks launch the branch's bucket during backward, others only in finish()."""
    return not (rank == 2 or (rank == 1 and mb == 1))


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------- all-reduce path


def _grads_worker(rank: int, world: int) -> None:
    net, ref = make_net(), make_net()
    reducer = GradReducer(net.parameters(), dist.group.WORLD, bucket_size_mb=BUCKET_MB)
    assert len(reducer.buckets) >= 3, [len(b.params) for b in reducer.buckets]

    # Step 0: every parameter but `unused` is used. All buckets except the last (the one holding
    # `unused`) must be launched from backward hooks, i.e. overlapped with the rest of backward.
    reference_grads(ref, 0, world)
    dp_grads(net, reducer, 0, rank, world)
    assert reducer.stats["buckets_in_backward"] == len(reducer.buckets) - 1, reducer.stats
    assert reducer.stats["buckets_in_finish"] == 1, reducer.stats
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        expected = torch.zeros_like(p) if q.grad is None else q.grad
        assert_close(p.grad, expected, f"step 0 grad of {name}")

    # Step 1: ranks disagree on whether `branch` is used (see partial_branch): nobody may hang, the
    # collectives must stay paired, and the sum must still be exact.
    net.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    reference_grads(ref, 1, world, partial_branch)
    dp_grads(net, reducer, 1, rank, world, partial_branch)
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        expected = torch.zeros_like(p) if q.grad is None else q.grad
        assert_close(p.grad, expected, f"step 1 grad of {name}")
    assert reducer.stats["collective_calls"] == 2 * len(reducer.buckets)


@pytest.mark.parametrize("world", [2, 4])
def test_bucketed_grads_equal_single_process(world):
    _spawn(_grads_worker, world)


def _bf16_worker(rank: int, world: int) -> None:
    net, ref = make_net(), make_net()
    reducer = GradReducer(net.parameters(), dist.group.WORLD, bucket_size_mb=BUCKET_MB, reduce_dtype=torch.bfloat16)
    reference_grads(ref, 0, world)
    dp_grads(net, reducer, 0, rank, world)
    differs = False
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        if q.grad is None:
            continue
        assert p.grad.dtype == torch.float32
        scale = q.grad.abs().max().item()
        assert_close(p.grad, q.grad, f"bf16-reduced grad of {name}", rtol=2e-2, atol=2e-2 * scale)
        differs |= not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    assert differs, "bf16 reduction gave fp32-exact gradients: it did not reduce in bf16"
    n_elems = sum(b.numel for b in reducer.buckets)
    assert reducer.stats["all_reduce_bytes"] == 2 * n_elems, reducer.stats


def test_bf16_reduction_is_close_but_not_exact():
    _spawn(_bf16_worker, 2)


def _bytes_worker(rank: int, world: int) -> None:
    n_params = sum(p.numel() for p in make_net().parameters())
    # Plain DP: one all-reduce of every gradient per step, fp32.
    net = make_net()
    plain = GradReducer(net.parameters(), dist.group.WORLD, bucket_size_mb=BUCKET_MB)
    for step in range(2):
        dp_grads(net, plain, step, rank, world)
        net.zero_grad()
    assert plain.stats["all_reduce_bytes"] == 2 * 4 * n_params, plain.stats
    assert plain.stats["reduce_scatter_bytes"] == plain.stats["all_gather_bytes"] == 0
    assert plain.stats["collective_calls"] == 2 * len(plain.buckets)
    ring = plain.bytes_sent_per_rank()
    assert ring["all_reduce"] == pytest.approx(2 * (world - 1) / world * 2 * 4 * n_params)

    # ZeRO-1: reduce-scatter of the padded grads + all-gather of the padded params, fp32.
    net = make_net(extras=False)
    n_params = sum(p.numel() for p in net.parameters())
    zero = GradReducer(net.parameters(), dist.group.WORLD, bucket_size_mb=BUCKET_MB, zero1=True)
    opt = BucketAdamW(param_groups(net, 0.1), zero, lr=1e-3)
    padded = sum(math.ceil(sum(p.numel() for p in b.params) / world) * world for b in zero.buckets)
    assert padded > n_params, "the test model should need padding"
    dp_grads(net, zero, 0, rank, world)
    assert [b.shard.numel() * world for b in zero.buckets] == [b.padded_numel for b in zero.buckets]
    opt.step()
    assert zero.stats["reduce_scatter_bytes"] == 4 * padded, zero.stats
    assert zero.stats["all_gather_bytes"] == 4 * padded, zero.stats
    assert zero.stats["all_reduce_bytes"] == 0
    ring = zero.bytes_sent_per_rank()
    assert ring["reduce_scatter"] == ring["all_gather"] == pytest.approx((world - 1) / world * 4 * padded)


def test_byte_counts_match_sizes():
    _spawn(_bytes_worker, 4)


# ---------------------------------------------------------------------------- ZeRO-1

LR, BETAS, EPS, WD, MAX_NORM = 2e-2, (0.9, 0.95), 1e-8, 0.5, 0.8


def lr_of(step: int) -> float:
    return LR * (0.5 + 0.1 * step)  # changes every step: set_lr must reach the sharded update


def zero_setup(world_group) -> tuple[Net, GradReducer, BucketAdamW]:
    net = make_net(extras=False)
    reducer = GradReducer(net.parameters(), world_group, bucket_size_mb=BUCKET_MB, zero1=True)
    opt = BucketAdamW(param_groups(net, WD), reducer, lr=LR, betas=BETAS, eps=EPS)
    return net, reducer, opt


def reference_setup() -> tuple[Net, torch.optim.AdamW]:
    ref = make_net(extras=False)
    return ref, torch.optim.AdamW(param_groups(ref, WD), lr=LR, betas=BETAS, eps=EPS)


def reference_step(ref: Net, opt: torch.optim.Optimizer, step: int, world: int) -> float:
    reference_grads(ref, step, world)
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
    set_lr(opt, lr_of(step))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def zero_step(net: Net, reducer: GradReducer, opt: BucketAdamW, step: int, rank: int, world: int) -> float:
    dp_grads(net, reducer, step, rank, world)
    norm = opt.clip_grad_norm_(MAX_NORM).item()
    set_lr(opt, lr_of(step))
    opt.step()
    opt.zero_grad()
    return norm


def _zero1_worker(rank: int, world: int) -> None:
    net, reducer, opt = zero_setup(dist.group.WORLD)
    ref, ref_opt = reference_setup()
    own = sum(b.shard.numel() for b in reducer.buckets)
    assert own < sum(p.numel() for p in net.parameters()), "each rank must hold only a shard of the state"
    clipped = 0
    for step in range(5):
        # Norm check before clipping: local squares summed over ranks = full grad norm squared.
        dp_grads(net, reducer, step, rank, world)
        sq = opt.local_grad_sq_norm()
        dist.all_reduce(sq)
        reference_grads(ref, step, world)
        full_sq = sum(p.grad.pow(2).sum() for p in ref.parameters())
        assert_close(sq, full_sq, f"step {step} grad norm^2")
        ref.zero_grad(set_to_none=True)
        # The same step again through clip/lr/AdamW: grads are recomputed from scratch both sides.
        ref_norm = reference_step(ref, ref_opt, step, world)
        norm = zero_step(net, reducer, opt, step, rank, world)
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        clipped += ref_norm > MAX_NORM
        for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
            assert_close(p, q, f"step {step} parameter {name}")
    assert 0 < clipped < 5, "clipping should be active in some steps but not all"


@pytest.mark.parametrize("world", [2, 4])
def test_zero1_matches_torch_adamw(world):
    _spawn(_zero1_worker, world)


def _save_worker(rank: int, world: int, path: str) -> None:
    net, reducer, opt = zero_setup(dist.group.WORLD)
    ref, ref_opt = reference_setup()
    for step in range(3):
        zero_step(net, reducer, opt, step, rank, world)
        reference_step(ref, ref_opt, step, world)
    state = opt.state_dict()  # collective: every rank gathers
    # The gathered state is torch AdamW's, parameter by parameter.
    ref_state = ref_opt.state_dict()
    assert ref_state["param_groups"][0]["params"] == state["param_groups"][0]["params"]
    for index, per_param in ref_state["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(state["state"][index][key], per_param[key], f"{key} of param {index}")
        assert float(state["state"][index]["step"]) == float(per_param["step"]) == 3.0
    if rank == 0:
        torch.save({"model": net.state_dict(), "optimizer": state}, path)


def _resume_worker(rank: int, world: int, path: str) -> None:
    saved = torch.load(path, weights_only=True)
    net, reducer, opt = zero_setup(dist.group.WORLD)
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    ref, ref_opt = reference_setup()
    for step in range(5):
        reference_step(ref, ref_opt, step, world)
        if step >= 3:
            zero_step(net, reducer, opt, step, rank, world)
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        assert_close(p, q, f"resumed parameter {name}")


def test_zero1_state_saved_at_dp4_resumes_at_dp2(tmp_path):
    path = str(tmp_path / "zero1.pt")
    _spawn(_save_worker, 4, path)
    _spawn(_resume_worker, 2, path)


# ---------------------------------------------------------------------------- single process (no dist)


def test_no_group_leaves_grads_untouched():
    net, ref = make_net(), make_net()
    reducer = GradReducer(net.parameters(), None, bucket_size_mb=BUCKET_MB)
    reference_grads(ref, 0, 2)
    reducer.start_step(4)
    for mbs in pieces(0, 2):
        for x, y in mbs:
            loss_of(net, x, y).backward()
    grads = [p.grad for p in net.parameters()]
    reducer.finish()
    assert [p.grad for p in net.parameters()] == grads  # the very same tensors
    assert net.unused.grad is None
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert p.grad is None or torch.equal(p.grad, q.grad)
    assert reducer.stats["collective_calls"] == 0


def test_zero1_without_group_is_adamw_and_checkpoints_interchange():
    from megalm.training.checkpoint import load_optimizer_tensors, optimizer_tensors

    net, reducer, opt = zero_setup(None)
    ref, ref_opt = reference_setup()
    for step in range(3):
        reference_step(ref, ref_opt, step, 2)
        reducer.start_step(4)
        for mbs in pieces(step, 2):
            for x, y in mbs:
                loss_of(net, x, y).backward()
        reducer.finish()
        opt.clip_grad_norm_(MAX_NORM)
        set_lr(opt, lr_of(step))
        opt.step()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert_close(p, q, "single-process ZeRO-1 parameter")
    # Named optimizer tensors (the checkpoint format) are the same for both optimizers, and a plain
    # AdamW state loads into ZeRO-1 and back.
    zt, zgroups = optimizer_tensors(net, opt)
    rt, rgroups = optimizer_tensors(ref, ref_opt)
    assert zt.keys() == rt.keys()
    for key in rt:
        assert_close(zt[key], rt[key], key)
    net2, _, opt2 = zero_setup(None)
    load_optimizer_tensors(net2, opt2, rt, rgroups)
    assert opt2.step_count == 3 and opt2.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for key, value in optimizer_tensors(net2, opt2)[0].items():
        assert_close(value, rt[key], f"reloaded {key}")
    net3, torch_opt = reference_setup()
    load_optimizer_tensors(net3, torch_opt, zt, zgroups)
    for key, value in optimizer_tensors(net3, torch_opt)[0].items():
        assert_close(value, rt[key], f"torch AdamW loaded from ZeRO-1: {key}")


def test_hooks_need_a_step_and_go_away_with_the_reducer():
    net = make_net(extras=False)
    x, y = global_batch(0)
    reducer = GradReducer(net.parameters(), None, zero1=True)
    with pytest.raises(RuntimeError, match="start_step"):
        loss_of(net, x, y).backward()  # a forgotten start_step must not silently skip the reduction
    net.zero_grad(set_to_none=True)
    del reducer  # hooks hold it weakly: no cycle keeps it (and its process group) alive
    loss_of(net, x, y).backward()
    assert all(p.grad is not None for p in net.parameters())


def test_weighted_local_grad_sq_norm_single_process():
    net, reducer, opt = zero_setup(None)
    ref = make_net(extras=False)
    reference_grads(ref, 0, 2)
    reducer.start_step(4)
    for mbs in pieces(0, 2):
        for x, y in mbs:
            loss_of(net, x, y).backward()
    reducer.finish()
    full = sum(p.grad.pow(2).sum() for p in ref.parameters())
    matrices = sum(p.grad.pow(2).sum() for p in ref.parameters() if p.ndim >= 2)
    assert_close(opt.local_grad_sq_norm(), full, "norm^2")
    assert_close(opt.local_grad_sq_norm(lambda p: float(p.ndim >= 2)), matrices, "weighted norm^2")
