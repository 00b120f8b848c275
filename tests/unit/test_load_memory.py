"""Loading weights holds no second copy of the model in host memory. `model.init_from` reads a Hugging Face dir one
tensor at a time and a megalm checkpoint straight into the parameters (DCP, as a resume reads it); before, every rank
read the whole source into fp32 first, about twice the model per rank (a Llama-70B start on an 8-GPU node asked for
~2 TB of host memory). A resume loads the weights in place and a fused projection's Adam moments into one tensor
(they were read into new tensors, then concatenated): 2.4x the model's fp32 bytes beyond the moments it must hold,
before.

Measured independently of the loader: the process's anonymous resident memory (the kernel's RssAnon, file-backed
pages of the memory-mapped safetensors excluded), read at every parameter copy and by a thread every millisecond,
in a fresh interpreter with glibc's mmap threshold fixed, so that a freed large tensor goes back to the system.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalm.config import config_to_dict, validate
from megalm.model import GPT, init_weights
from megalm.training.checkpoint import save_checkpoint
from tests.conftest import compose_config

pytestmark = pytest.mark.slow  # fresh interpreters loading a 57 MB model: 14 s, measured in the long tests' leg

# 16 blocks of 0.85M parameters: the model is 57 MB in fp32, its largest tensor (a gate/up pair) 1.6 MB
SHAPE = ["model.num_layers=16", "model.hidden_size=256", "model.num_heads=4", "model.num_kv_heads=4",
         "model.ffn_hidden_size=768", "model.vocab_size=512"]

# what both measurements run first: RssAnon, and a thread that keeps its peak while `measuring` (started by
# `start()`, ended by `stop()`, which returns the peak above the start)
PROBE = r"""
import json, sys, threading, time
from pathlib import Path
import torch
from megalm.config import validate
from megalm.model import GPT
from tests.conftest import compose_config

def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

peak, done, baseline = [0], threading.Event(), [0]

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.001)

thread = threading.Thread(target=sample, daemon=True)

def start():
    baseline[0] = rss_anon()
    thread.start()

def stop():
    done.set()
    thread.join()
    return max(peak[0], rss_anon()) - baseline[0]
"""

INIT_FROM = PROBE + r"""
from megalm.model.hf import model_config_dict
from megalm.training import init_from
from megalm.training.checkpoint import tensors as checkpoint_tensors
from megalm.training.init_from import load_init_weights, read_init_source, read_megalm_weights

spec, checkpoint, shape = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = GPT(validate(compose_config(*shape)).model)
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

def sampled(copy):  # the level at every parameter's copy too, whatever the thread saw
    def wrapper(param, value):
        peak[0] = max(peak[0], rss_anon())
        copy(param, value)
    return wrapper

for module in (init_from, checkpoint_tensors):
    module.copy_full_value = sampled(module.copy_full_value)
read_init_source(spec)  # what reading the configs imports (triton, by the model's kernels) is not a copy
start()
load_init_weights(spec, model, model_config_dict(model.cfg))
extra = stop()
source = read_megalm_weights(checkpoint)[2]
params = dict(model.named_parameters())
diff = max((params[n] - v).abs().max().item() for n, v in source.items())
print(json.dumps({"extra": extra, "model_bytes": model_bytes, "diff": diff}))
"""

RESUME = PROBE + r"""
from megalm.training.checkpoint import load_checkpoint

checkpoint, shape = Path(sys.argv[1]), json.loads(sys.argv[2])
cfg = validate(compose_config(*shape)).model
load_checkpoint(checkpoint, GPT(cfg), None)  # what loading imports is not the load's
model = GPT(cfg)
optimizer = torch.optim.AdamW(model.parameters())  # a fresh one, as a resumed run's: no state until loaded
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
start()
load_checkpoint(checkpoint, model, optimizer)
extra = stop()
moments = sum(v.numel() * v.element_size() for state in optimizer.state.values() for k, v in state.items()
              if k != "step")
print(json.dumps({"extra": extra, "model_bytes": model_bytes, "moments": moments}))
"""


CONVERT = PROBE + r"""
from megalm.interop.export import export_hf
from megalm.interop.hf_import import import_hf

command, source, out, shard = sys.argv[1:5]
run = {"export": lambda target: export_hf(source, target, dtype="float32", max_shard_size=shard),
       "import": lambda target: import_hf(source, target, tokenizer="none", max_shard_size=shard)}[command]
run(out + "-first")  # what converting imports (DCP, safetensors, the models' kernels) is not the conversion
start()
run(out)
print(json.dumps({"extra": stop()}))
"""


def measured(script: str, *args: str) -> dict:
    """`script`'s JSON line, run in a fresh interpreter with glibc's mmap threshold fixed (a freed large tensor goes
    back to the system, so the peak is what was live)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                            timeout=300, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, Path]:
    """A megalm checkpoint of random weights (and a step's Adam moments) and its Hugging Face export (fp32: the
    weights compare exactly)."""
    from megalm.interop.export import export_hf

    tmp = tmp_path_factory.mktemp("init_from_memory")
    cfg = validate(compose_config(*SHAPE))
    model = GPT(cfg.model)
    init_weights(model, 5)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # Adam moments for the resume to load
    save_checkpoint(tmp / "run", 1, model, optimizer, {"consumed_tokens": 0},
                    config_to_dict(cfg), keep_last=1)
    return tmp / "run", export_hf(tmp / "run", tmp / "hf", dtype="float32")


@pytest.mark.parametrize("via", ["checkpoint", "hf"])
def test_init_from_holds_no_second_copy_of_the_model(source, via):
    run, hf_dir = source
    result = measured(INIT_FROM, str(run) if via == "checkpoint" else f"hf:{hf_dir}", str(run), json.dumps(SHAPE))
    assert result["diff"] == 0.0  # the source's weights, every one
    # a few tensors of 1.6 MB and the interpreter's own growth; the whole model in fp32 would be 57 MB more
    assert result["extra"] < 0.2 * result["model_bytes"], result


def test_a_resume_holds_the_moments_and_no_second_copy(source):
    run, _ = source
    result = measured(RESUME, str(next((run / "checkpoints").glob("step_*"))), json.dumps(SHAPE))
    assert result["moments"] == 2 * result["model_bytes"]  # AdamW's two, loaded
    # the moments it must hold, a few tensors besides; before: 2.4x the model more
    assert result["extra"] < result["moments"] + 0.2 * result["model_bytes"], result


@pytest.mark.parametrize("command", ["export", "import"])
def test_export_and_import_hold_a_block_and_a_file_not_the_model(source, command, tmp_path):
    """megalm-export and megalm-import read the model a block at a time and write each weight file once its tensors
    are read: host memory holds a block, the file being filled and safetensors' serialized copy of it. Both held the
    whole model in fp32 before (export 1.7x the model's bytes above its start, import 2.4x; 2026-12-07). The output
    is the source's, file by file (`max_shard_size` cuts it into 16 files)."""
    from megalm.model.hf_files import SafetensorsDir
    from megalm.training.init_from import read_megalm_weights

    run, hf_dir = source
    src, out = (run, tmp_path / "hf") if command == "export" else (hf_dir, tmp_path / "imported")
    result = measured(CONVERT, command, str(src), str(out), "4MB")
    model_bytes = sum(t.nbytes for t in read_megalm_weights(run)[2].values())
    if command == "export":
        written, expected = SafetensorsDir(out), SafetensorsDir(hf_dir)
        assert len(list(out.glob("*.safetensors"))) > 8
    else:
        written, expected = read_megalm_weights(out)[2], read_megalm_weights(run)[2]
        assert len(list(out.glob("shard-*.safetensors"))) > 8
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)
    # a block (3.4 MB), its parts' copies and a 4 MB file twice: about a quarter of the model's 57 MB
    assert result["extra"] < 0.35 * model_bytes, (result, model_bytes)
