"""scripts/train_node.sh and train_multinode.sh start one process per GPU of the node: with a stub torchrun that
prints its arguments and a stub nvidia-smi, the --nproc-per-node they pass. A failing nvidia-smi gave torchrun a
two-line count ("1\n1", its partial count and the fallback), and MIG slices counted as GPUs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_LINES = "GPU 0: NVIDIA H100 (UUID: GPU-0)\nGPU 1: NVIDIA H100 (UUID: GPU-1)\n"
MIG_LINES = ("GPU 0: NVIDIA H100 (UUID: GPU-0)\n  MIG 3g.40gb Device 0: (UUID: MIG-a)\n"
             "  MIG 3g.40gb Device 1: (UUID: MIG-b)\n")


def nproc(tmp_path: Path, script: str, nvidia_smi: str | None, env: dict[str, str]) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "torchrun").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    if nvidia_smi is not None:
        (bin_dir / "nvidia-smi").write_text(nvidia_smi)
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("NPROC", "NPROC_PER_NODE", "CUDA_VISIBLE_DEVICES")}
    path = f"{bin_dir}:/usr/bin:/bin"  # no real nvidia-smi from elsewhere
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script), "model=tiny", "parallel.recompute=[full, none]"],
                          env={**base, "PATH": path, "MASTER_ADDR": "h0", "NNODES": "2", **env},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    args = proc.stdout.splitlines()
    assert args[-2:] == ["model=tiny", "parallel.recompute=[full, none]"]  # overrides passed through as they were
    return args[args.index("--nproc-per-node") + 1]


@pytest.mark.parametrize("script", ["train_node.sh", "train_multinode.sh"])
@pytest.mark.parametrize("nvidia_smi, env, expected", [
    (f"#!/bin/sh\nprintf '{GPU_LINES}'\n", {}, "2"),
    (None, {}, "1"),  # no GPU tools: one CPU process
    ("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver'\nexit 9\n", {}, "1"),
    (f"#!/bin/sh\nprintf '{MIG_LINES}'\n", {}, "1"),
    (f"#!/bin/sh\nprintf '{GPU_LINES}'\n", {"CUDA_VISIBLE_DEVICES": "1"}, "1"),
    (f"#!/bin/sh\nprintf '{GPU_LINES}'\n", {"CUDA_VISIBLE_DEVICES": "0,1"}, "2"),
    # set but empty: no GPU visible, one CPU process (it had been read as unset: nvidia-smi's 2)
    (f"#!/bin/sh\nprintf '{GPU_LINES}'\n", {"CUDA_VISIBLE_DEVICES": ""}, "1"),
    (f"#!/bin/sh\nprintf '{GPU_LINES}'\n", {"NPROC": "3", "NPROC_PER_NODE": "3"}, "3"),
])
def test_processes_per_node(tmp_path, script, nvidia_smi, env, expected):
    assert nproc(tmp_path, script, nvidia_smi, env) == expected
