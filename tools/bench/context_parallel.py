"""Context parallelism: step time and memory per rank against sequence length, for cp = 1 .. N.

    python tools/bench/context_parallel.py --nproc 4 --seq 1024 2048 4096
    python tools/bench/context_parallel.py --nproc 2 --seq 8192 --comm a2a model=125m

For every cp (default: the powers of two up to `--nproc`) and every sequence length S, spawns cp
processes (gloo on CPU, NCCL with one GPU per rank on CUDA) and trains the real Trainer on one
document of S tokens per step (`data.varlen=true`, synthetic documents of exactly S + 1 tokens, global
batch 1): every rank holds the zigzag shard of S / cp tokens and attends over the whole document
through the ring (or all-to-all). Arguments without dashes are Hydra overrides (default model: tiny).

Per rank it reports: the median time of `Trainer.train_step` (forward, backward, AdamW) after
`--warmup` steps; the activations saved for backward (bytes of the distinct non-parameter storages
packed by autograd's saved-tensor hooks: the memory context parallelism divides); and the peak memory
of the timed steps above the memory held before them (CUDA: max_memory_allocated; CPU: the resident
set's high-water mark, reset through /proc/self/clear_refs, so it includes allocator slack and
transient buffers such as attention scores). Each (cp, S) runs in fresh processes.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megalm.config.compose import compose_config  # noqa: E402
from tools.bench.cli import parse_flags_and_overrides, run_main  # noqa: E402
from tools.bench.ranks import free_port, run_cpu_ranks  # noqa: E402


def _rss_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak(device: torch.device) -> int:
    """Reset the peak-memory counter; returns the bytes in use now."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current VmRSS (Linux >= 4.0)
        f.write("5")
    return _rss_kib("VmRSS") * 1024


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _rss_kib("VmHWM") * 1024


class SavedActivations:
    """Counts the bytes autograd saves for backward (distinct storages, parameters excluded)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def _worker(rank: int, world: int, port: int, seq: int, overrides: list[str], steps: int, warmup: int,
            out: str) -> None:
    from hydra import compose, initialize_config_dir

    from megalm.config import register_schema, to_dataclass
    from megalm.model.attention import one_kernel_backend
    from megalm.precision import compute_dtype
    from megalm.train import CONFIG_DIR
    from megalm.training.trainer import Trainer, select_device

    torch.set_num_threads(1)
    register_schema()
    base = ["data=synthetic", "data.varlen=true", f"data.synthetic.fixed_doc_length={seq + 1}",
            "data.synthetic.num_docs=64", f"model.seq_length={seq}", "trainer.global_batch_size=1",
            "trainer.micro_batch_size=1", f"parallel.cp={world}", f"trainer.max_steps={warmup + steps}",
            "trainer.eval_interval=0", "trainer.save_interval=0", "logging.tensorboard=false"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = to_dataclass(compose(config_name="config", overrides=base + overrides))
    device = select_device(cfg.trainer.device)
    # cp 1 attends whole documents, cp >= 2 blocks of them: one kernel for all (auto's cudnn would run cp 1 on another)
    cfg.model.attention_backend = one_kernel_backend(cfg.model.attention_backend, device, compute_dtype(cfg.precision),
                                                     dropout=cfg.model.attention_dropout > 0)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", rank % torch.cuda.device_count())
        cfg.trainer.device = str(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        for step in range(warmup):
            trainer.train_step(step)
        before = _reset_peak(device)
        times, saved_bytes = [], 0
        for step in range(warmup, warmup + steps):
            saved = SavedActivations(trainer.model)  # per step: storages freed in a backward may be reused
            dist.barrier()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                trainer.train_step(step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            saved_bytes = max(saved_bytes, saved.nbytes)
        mine = {"rank": rank, "step_s": statistics.median(times), "saved_bytes": saved_bytes,
                "peak_over_before": _peak(device) - before, "before": before}
        del trainer
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    gc.collect()
    dist.destroy_process_group()


def run(cp: int, seq: int, overrides: list[str], steps: int, warmup: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        run_cpu_ranks(_worker, cp, cp, free_port(), seq, overrides, steps, warmup, out)
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="largest cp (one process per rank)")
    parser.add_argument("--cp", type=int, nargs="*", help="cp sizes (default: powers of two up to --nproc)")
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096], help="sequence lengths")
    parser.add_argument("--comm", default="ring", choices=("ring", "a2a"), help="parallel.cp_comm")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args, overrides = parse_flags_and_overrides(parser, argv)
    compose_config(overrides)  # a bad override is one line here, not a traceback from each spawned rank
    cps = args.cp or [2**i for i in range(args.nproc.bit_length()) if 2**i <= args.nproc]
    # eager unless asked (trainer.compile=true): a few steps per length would time compiles, not the ring
    overrides = [f"parallel.cp_comm={args.comm}", "trainer.compile=false", *overrides]
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"overrides: {' '.join(overrides)}")
    print("| seq | cp | tokens per rank | step time s | tokens/s | saved activations MiB per rank "
          "| peak over start MiB per rank |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for seq in args.seq:
        for cp in cps:
            ranks = run(cp, seq, overrides, args.steps, args.warmup)
            step = max(r["step_s"] for r in ranks)  # the step ends when the slowest rank does
            saved = max(r["saved_bytes"] for r in ranks) / 2**20
            peak = max(r["peak_over_before"] for r in ranks) / 2**20
            local = -(-seq // (2 * cp)) * 2  # zigzag: 2 chunks of ceil(S / 2cp) tokens
            rows.append({"seq": seq, "cp": cp, "comm": args.comm, "step_s": step, "tokens_per_s": seq / step,
                         "saved_mib": saved, "peak_mib": peak, "ranks": ranks})
            print(f"| {seq} | {cp} | {local} | {step:.3f} | {seq / step:,.0f} | {saved:.1f} | {peak:.1f} |",
                  flush=True)
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    run_main(main)
