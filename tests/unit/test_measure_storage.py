"""The live-storage probe counts what torch holds: views share their storage, a freed tensor leaves the count, a
kept reference stays in it, and fake tensors count as real ones of their size."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megalm.measure import LiveStorages


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_counts_storages_not_views_and_frees_with_the_last_view(fake):
    mode = FakeTensorMode() if fake else torch.no_grad()
    with mode, LiveStorages() as live:
        a = torch.empty(1000, 250)  # 1,000,000 bytes
        b = a * 2
        view = b[:10]
        assert live.bytes() == 2_000_000 and live.bytes("cpu") == 2_000_000 and live.bytes("cuda") == 0
        del b
        assert live.bytes() == 2_000_000, "a view keeps its storage alive"
        del view
        assert live.bytes() == 1_000_000
        live.mark_peak()
        c = torch.empty(2000, 250)
        del c
        assert live.peak() == 3_000_000 and live.bytes() == 1_000_000
        del a
        assert live.bytes() == 0


def test_saved_activations_are_what_a_forward_leaves_live():
    """x.sin() saves x (a leaf, not counted: made outside) and cos for backward, so the forward leaves the
    product's saved input live; backward frees it and leaves the gradient."""
    x = torch.randn(256, 256, requires_grad=True)
    with LiveStorages() as live:
        y = x.sin()
        z = (y * y).sum()  # saves y twice: one storage
        held = live.bytes()
        assert held == 256 * 256 * 4 + 4, held  # y, and the 0-d loss
        z.backward()
        del y, z
        assert live.bytes() == 256 * 256 * 4  # x.grad


def test_a_leak_stays_counted():
    kept = []
    with LiveStorages() as live:
        for _ in range(3):
            t = torch.ones(1024)
            kept.append(t[:1])  # a leak through a small view holds the whole storage
        assert live.bytes() == 3 * 4096
    assert live.bytes() == 3 * 4096
    kept.clear()
    assert live.bytes() == 4096, "t still holds the last one"
    del t
    assert live.bytes() == 0


def test_tracks_tensors_made_before_it():
    w = torch.nn.Linear(64, 64, bias=False)
    with LiveStorages() as live:
        live.track(w.parameters())
        assert live.bytes() == 64 * 64 * 4


def test_storages_made_before_it_are_not_new_when_an_op_aliases_them():
    """A view, an in-place or an out= result of a storage made before the probe is that old storage, not a new one
    (counting it would make a parameter or a reused offload pool buffer look allocated by the step)."""
    weight, buffer = torch.randn(64, 64), torch.empty(4096, dtype=torch.uint8)
    with torch.no_grad(), LiveStorages() as live:
        weight.t()
        weight[:8].mul_(2)
        buffer[:1024].copy_(torch.zeros(1024, dtype=torch.uint8))
        torch.mul(weight, 2, out=weight)
        first, second = weight.split(32)
        assert live.bytes() == 0 and live.peak() == 1024  # only the zeros made inside, now freed
        fresh = weight * 3
        assert live.bytes() == 64 * 64 * 4
    del fresh


@pytest.mark.parametrize("fake", [False, True])
def test_a_storage_grown_in_place_counts_its_new_size(fake):
    """`Tensor.resize_` and an out= into a tensor too small grow the storage through a dispatched op that returns
    its input (not a new storage): the probe counted the old size."""
    import contextlib

    with FakeTensorMode() if fake else contextlib.nullcontext(), torch.no_grad(), LiveStorages() as live:
        grown = torch.empty(10)
        grown.resize_(1000)
        out = torch.empty(0)
        torch.add(torch.ones(500), 1, out=out)
        assert live.bytes() == 4000 + 2000 and live.peak() >= 4000 + 2000 + 2000  # the ones(500) were live too


def test_labelled_storages_count_under_their_label():
    """What an owner's method allocates while `labelling` is on counts under its label (an offload pool's host
    buffers on a CPU, where device and host are one memory); the method is the owner's own again afterwards."""

    class Pool:
        def allocate(self, n: int) -> torch.Tensor:
            return torch.empty(n, dtype=torch.uint8)

    pool = Pool()
    with LiveStorages() as live:
        with live.labelling(pool, "allocate", "host"):
            host = pool.allocate(1000)
            device = torch.empty(500, dtype=torch.uint8)
        assert live.bytes("host") == 1000 and live.bytes("cpu") == 500
        again = pool.allocate(10)
        assert live.bytes("cpu") == 510 and "allocate" not in vars(pool)
    del host, device, again


def test_activation_memory_tool_measures_what_full_recompute_keeps():
    """With full recompute a layer keeps its input only: s·h fp32 elements, 4 bytes each in fp32; without it
    a layer keeps far more. The tool's measurement (peaks of L and 2L layers) must find exactly that."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, str(root / "tools/bench/activation_memory.py"), "model=tiny",
                             "precision=fp32", "--recompute", "full,none"], capture_output=True, text=True,
                            timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {line.split("|")[1].strip(): float(line.split("|")[2]) for line in result.stdout.splitlines()
            if line.startswith("| full") or line.startswith("| none")}
    assert rows["full"] == 4.0, result.stdout
    assert rows["none"] > 4 * rows["full"], result.stdout


@pytest.mark.slow  # about 21 s: two fake-tensor steps per mode (a tool's test, as the docs' commands)
def test_activation_memory_tool_traces_fp8_as_the_gpu_runs_it():
    """`--gpu h100` traces an FP8 recipe as that GPU runs it: torch._scaled_mm writes bf16, so selective recompute
    keeps bf16 GEMM outputs and less than no recompute (the CPU's emulation saves fp32 ones: more); full recompute
    keeps the bf16 layer input, 2 s·h; and the FP8 weight copies are those live when the backward begins, the same
    in every mode (dgrad's column-major copies, made in the backward, are not subtracted from the activations)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, str(root / "tools/bench/activation_memory.py"), "model=tiny",
                             "precision=fp8", "precision.bf16_weights=true", "--gpu", "h100"],
                            capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {cells[0]: (float(cells[1]), float(cells[4])) for line in result.stdout.splitlines()
            if line.startswith("| ") and (cells := [c.strip() for c in line.strip("|").split("|")])[0] in
            ("none", "selective", "full")}
    assert rows["full"][0] == 2.0 and rows["selective"][0] < rows["none"][0], result.stdout
    assert rows["none"][1] == rows["selective"][1] == rows["full"][1] > 0, result.stdout


@pytest.mark.slow  # about 33 s: two fake-tensor steps per mode (a tool's test, as the docs' commands)
def test_activation_memory_tool_measures_compiled_blocks():
    """With trainer.compile=true the tool traces the blocks as inductor compiles them (megalm.estimate.rank.
    trace_compiled_blocks; before, inductor's own kernels ran on fake tensors and crashed). Under full recompute the
    compiled region saves its rng state by a higher-order op, which the probes must pass through, and it keeps the
    layer's bf16 input: Korthikanti's 2 s·h (give or take the rng state)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, str(root / "tools/bench/activation_memory.py"), "model=tiny",
                             "precision=bf16", "trainer.compile=true", "--recompute", "full"],
                            capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    full = next(float(line.split("|")[2]) for line in result.stdout.splitlines() if line.startswith("| full"))
    assert 2.0 <= full < 2.2, result.stdout


def test_chunked_loss_matches_and_never_holds_the_fp32_logits():
    """The chunked loss gives F.cross_entropy's loss and gradient (vocab padding and -100 labels included), and
    what is live when the backward begins is the bf16 logits only, where F.cross_entropy on fp32 logits keeps a
    [T, V] fp32 log-softmax; its peak is a fraction of F.cross_entropy's (measured, not counted)."""
    import functools

    import torch.nn.functional as F

    from megalm.model.loss import token_loss_sum

    torch.manual_seed(0)
    tokens, vocab, real = 512, 1000, 900
    labels = torch.randint(0, real, (tokens,))
    labels[::7] = -100
    mask = (torch.rand(tokens) > 0.1).float()
    base = torch.randn(tokens, vocab).to(torch.bfloat16)

    def run(loss_fn):
        logits = base.clone().requires_grad_()
        with LiveStorages() as live:
            live.track([logits])
            loss = loss_fn(logits)
            loss.backward()
        return loss, logits.grad, live.at_backward_start, live.peak()

    plain = lambda x: (F.cross_entropy(x.float()[:, :real], labels, reduction="none") * mask).sum()
    ref_loss, ref_grad, ref_held, ref_peak = run(plain)
    bf16_logits, fp32_logits = tokens * vocab * 2, tokens * vocab * 4
    assert ref_held >= bf16_logits + 0.9 * fp32_logits * real / vocab, "F.cross_entropy keeps a fp32 log-softmax"
    for chunk in (None, 64, 100):  # one chunk, even chunks, a ragged last chunk
        chunked = functools.partial(token_loss_sum, labels=labels, loss_mask=mask, vocab_size=real, chunk_tokens=chunk)
        loss, grad, held, peak = run(chunked)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-4)
        torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=1e-2, atol=1e-3)  # bf16 gradients
        assert held - bf16_logits < fp32_logits / 100, (chunk, held)
        if chunk is not None:
            assert peak < ref_peak / 2, (chunk, peak, ref_peak)


def test_the_training_loss_writes_the_gradient_over_the_logits():
    """TokenLoss (what the runners call) writes the logits' gradient over them, which nothing reads after the loss:
    from the backward's start to its end one [T, V] tensor is live where a gradient of its own makes two (live
    storages, measured); the head's gradients are token_loss_sum's."""
    import functools

    from megalm.model.loss import TokenLoss, token_loss_sum

    torch.manual_seed(0)
    tokens, vocab, real, hidden = 512, 1000, 900, 16
    labels, mask = torch.randint(0, real, (tokens,)), torch.ones(tokens)
    h0, w0 = torch.randn(tokens, hidden).to(torch.bfloat16), torch.randn(hidden, vocab).to(torch.bfloat16)

    def run(loss_fn):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        live = LiveStorages(on_backward_start=lambda: live.mark_peak())  # the backward's own peak
        with live:
            live.track([h, w])
            loss_fn(h @ w, labels, mask).backward()  # a head: the logits are an intermediate, as in training
        return h.grad, w.grad, live.peak() - live.at_backward_start

    own_h, own_w, own_rise = run(functools.partial(token_loss_sum, vocab_size=real))
    h_grad, w_grad, rise = run(TokenLoss(real))
    assert torch.equal(h_grad, own_h) and torch.equal(w_grad, own_w)
    logits_bytes = tokens * vocab * 2
    assert own_rise >= logits_bytes and rise < own_rise - 0.9 * logits_bytes, (rise, own_rise, logits_bytes)
