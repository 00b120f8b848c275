"""Checkpoint files: round trip, atomicity under a crash mid-save, pruning, refusing foreign checkpoints."""

import os

import pytest
import torch

from megalm.errors import CheckpointError
from megalm.training import checkpoint as ckpt
from megalm.training.checkpoint import save as ckpt_save


class Net(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(self.fc(x))


def trained(seed: int = 0, steps: int = 3, width: int = 8):
    torch.manual_seed(seed)
    net = Net(width)
    opt = torch.optim.AdamW([{"params": [net.fc.weight]}, {"params": [net.fc.bias, *net.norm.parameters()],
                                                           "weight_decay": 0.0}], lr=1e-2)
    for _ in range(steps):
        net(torch.randn(4, width)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


CONFIG = {"model": {"hidden_size": 8, "num_layers": 1}}


def save(run_dir, step, net, opt, keep=3):
    return ckpt.save_checkpoint(run_dir, step, net, opt, {"consumed_tokens": step * 10}, CONFIG, keep)


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path):
    net, opt = trained()
    torch.manual_seed(7)
    path = save(tmp_path, 3, net, opt)
    expected_rng = torch.rand(3)

    net2, opt2 = trained(seed=1, steps=1)
    meta = ckpt.load_checkpoint(path, net2, opt2)
    assert torch.equal(torch.rand(3), expected_rng), "RNG state must be restored"
    assert meta.state["step"] == 3 and meta.state["consumed_tokens"] == 30
    for (n, a), (_, b) in zip(net.state_dict().items(), net2.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    # One more identical update from both must stay identical (moments and step count restored).
    x = torch.randn(4, 8)
    for n_, o_ in ((net, opt), (net2, opt2)):
        n_(x).square().mean().backward()
        o_.step()
    for a, b in zip(net.parameters(), net2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_each_device_gets_back_its_own_cuda_stream(tmp_path, monkeypatch):
    """12 visible devices (a 16-GPU node without a CUDA_VISIBLE_DEVICES per rank): device i's state goes back to
    device i, not in the text order of the names (torch_cuda_10 before torch_cuda_2)."""
    from safetensors.torch import load_file, save_file

    net, opt = trained()
    path = save(tmp_path, 3, net, opt)
    rng_file = path / "rng-rank00000.safetensors"
    rng = load_file(str(rng_file)) | {f"torch_cuda_{i}": torch.full((16,), i, dtype=torch.uint8) for i in range(12)}
    save_file(rng, str(rng_file))
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 12)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.extend(int(s[0]) for s in states))
    ckpt.load_checkpoint(path, net, opt)
    assert restored == list(range(12))


@pytest.mark.parametrize("fail_at", ["tensors", "rng", "rename", "latest"])
def test_crash_mid_save_keeps_previous_checkpoint_usable(tmp_path, monkeypatch, fail_at):
    net, opt = trained()
    first = save(tmp_path, 1, net, opt)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    net2, opt2 = trained(seed=5)

    class Crash(BaseException):
        pass

    writer = ckpt_save  # the module whose steps a crash interrupts
    real_dcp, real_save, real_write = writer.save_tensors, writer.save_file, writer.write_text_atomic
    real_rename = os.rename

    def crashing_dcp(tensors, path):
        if fail_at == "tensors":
            (path / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"\x00" * 17)  # half-written
            raise Crash
        real_dcp(tensors, path)

    def crashing_save(tensors, filename):
        if fail_at == "rng":
            raise Crash
        real_save(tensors, filename)

    def crashing_rename(src, dst):
        if fail_at == "rename":
            raise Crash
        real_rename(src, dst)

    def crashing_latest(path, text):
        if fail_at == "latest":
            with open(path.with_name(".latest.partial"), "w") as f:
                f.write("step_0000")
            raise Crash
        real_write(path, text)

    monkeypatch.setattr(writer, "save_tensors", crashing_dcp)
    monkeypatch.setattr(writer, "save_file", crashing_save)
    monkeypatch.setattr(writer.os, "rename", crashing_rename)
    monkeypatch.setattr(writer, "write_text_atomic", crashing_latest)
    with pytest.raises(Crash):
        save(tmp_path, 2, net2, opt2)
    monkeypatch.undo()

    assert ckpt.latest_checkpoint(tmp_path) == first
    restored, ropt = trained(seed=9, steps=1)
    ckpt.load_checkpoint(first, restored, ropt)
    for k, v in restored.state_dict().items():
        assert torch.equal(v, before[k])
    # The next save succeeds and clears the debris of the crashed one.
    third = save(tmp_path, 3, net2, opt2)
    assert ckpt.latest_checkpoint(tmp_path) == third
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_keeps_last_k(tmp_path):
    net, opt = trained()
    for step in range(1, 6):
        save(tmp_path, step, net, opt, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == ["step_00000004", "step_00000005"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000005"
    assert ckpt.resolve_checkpoint_path(tmp_path).name == "step_00000005"


def test_refuses_another_model_and_corrupt_files(tmp_path):
    net, opt = trained()
    path = save(tmp_path, 1, net, opt)
    with pytest.raises(CheckpointError, match="hidden_size=8 .this run: 16"):
        ckpt.check_model_config({"hidden_size": 8}, {"hidden_size": 16}, path)
    bigger, bigger_opt = trained(width=16)
    with pytest.raises(CheckpointError, match="cannot be read into this model|of shape"):
        ckpt.load_checkpoint(path, bigger, bigger_opt)
    next(path.glob("shard-*.safetensors")).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        ckpt.load_checkpoint(path, net, opt)
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.resolve_checkpoint_path(tmp_path / "nope")


def test_torch_floor_is_checked_and_matches_pyproject():
    """The floor pyproject.toml states is the one megalm checks, and the DCP API behind it is there."""
    import inspect
    import re
    from pathlib import Path

    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from megalm import compat

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    floor = tuple(int(x) for x in re.search(r'"torch>=(\d+)\.(\d+)"', pyproject).groups())
    assert floor == compat.TORCH_FLOOR
    assert "save_distributed" in inspect.signature(HuggingFaceStorageWriter.__init__).parameters
    compat.check_torch_version(torch.__version__)
    compat.check_torch_version("2.11.0a0+nv26.04")
    with pytest.raises(ImportError, match=r"torch>=2\.11.*found 2\.10\.0"):
        compat.check_torch_version("2.10.0")


def test_a_full_disk_is_one_error_line_and_the_next_save_clears_its_files(tmp_path, monkeypatch):
    """A save that runs out of space: a CheckpointError naming the cause (DCP's CheckpointException printed a
    traceback of every rank's), the previous checkpoint kept, and the failed save's files removed by the next save
    of any step before it writes (they filled the disk that save needed: a preemption's or the final step's)."""
    import errno

    from megalm import compat

    net, opt = trained()
    first = save(tmp_path, 1, net, opt)
    real = compat.hf_storage_writer

    def full_disk(path):
        writer = real(path)

        def write_data(plan, planner):
            (tmp_path / "checkpoints" / ".tmp-step_00000002" / "shard-partial.safetensors").write_bytes(b"\0" * 64)
            raise OSError(errno.ENOSPC, "No space left on device")

        writer.write_data = write_data
        return writer

    monkeypatch.setattr(compat, "hf_storage_writer", full_disk)
    with pytest.raises(CheckpointError, match=r"could not be written \(OSError: \[Errno 28\] No space left on device"
                                              r"\); the checkpoints saved before it are kept") as error:
        save(tmp_path, 2, net, opt)
    assert "\n" not in str(error.value)
    assert ckpt.latest_checkpoint(tmp_path) == first
    debris = tmp_path / "checkpoints" / ".tmp-step_00000002"
    assert debris.is_dir()
    monkeypatch.undo()

    seen = []
    real_save_tensors = ckpt_save.save_tensors

    def writes_after_the_debris_is_gone(tensors, path):
        seen.append(debris.exists())
        real_save_tensors(tensors, path)

    monkeypatch.setattr(ckpt_save, "save_tensors", writes_after_the_debris_is_gone)
    assert save(tmp_path, 3, net, opt).name == "step_00000003"
    assert seen == [False]


def test_a_checkpoint_holds_the_files_its_save_wrote(tmp_path):
    """state.json lists every safetensors file of the save by size (what verify_checkpoint checks)."""
    import json

    net, opt = trained()
    path = save(tmp_path, 1, net, opt)
    files = json.loads((path / "state.json").read_text())["files"]
    assert files == {f.name: f.stat().st_size for f in path.glob("*.safetensors")} and len(files) == 2
