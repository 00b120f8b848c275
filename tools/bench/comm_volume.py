"""Communication volume of one training step, per collective type, for a parallel layout.

    python tools/bench/comm_volume.py --nproc 4 parallel.tp=2 parallel.dp=2
    python tools/bench/comm_volume.py --nproc 4 parallel.dp=4 parallel.zero1=true model=125m

Spawns `--nproc` CPU processes (gloo), builds the real Trainer with the given Hydra overrides
(data defaults to synthetic), runs one warm-up step, then counts every torch.distributed
collective issued by one more step: calls, payload bytes (the full, unsharded buffer of each
collective), and the bytes a ring algorithm puts on the wire per rank: all-reduce 2(n-1)/n of the
buffer, reduce-scatter and all-gather (n-1)/n. Counting wraps the torch.distributed functions in
the benchmark process, so the library code carries no instrumentation.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as distributed_c10d

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megalm.config.compose import compose_config  # noqa: E402
from tools.bench.cli import run_main  # noqa: E402
from tools.bench.ranks import free_port, run_cpu_ranks  # noqa: E402

FULL_BUFFER_IN_OUTPUT = ("all_gather_into_tensor", "all_gather_single")  # (output, input): output is full
FULL_BUFFER_IN_INPUT = ("reduce_scatter_tensor", "reduce_scatter_single")  # (output, input): input is full
COUNTED = ("all_reduce", *FULL_BUFFER_IN_OUTPUT, *FULL_BUFFER_IN_INPUT, "all_gather", "broadcast",
           "isend", "irecv", "send", "recv")


def _group(kwargs: dict, args: tuple, position: int):
    return kwargs.get("group", args[position] if len(args) > position else None)


def _wire_factor(name: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if name == "all_reduce":
        return 2 * (n - 1) / n
    if name in (*FULL_BUFFER_IN_OUTPUT, *FULL_BUFFER_IN_INPUT, "all_gather"):
        return (n - 1) / n
    return 1.0


class Counters:
    """Adds each collective call to stats["name[group]"] = [calls, payload, wire bytes] while on."""

    def __init__(self) -> None:
        self.on = False
        self.stats: dict = collections.defaultdict(lambda: [0, 0, 0.0])
        self.group_names: dict = {}


def install_counters(counters: Counters) -> None:
    """Wrap the torch.distributed collectives. Call it before megalm is imported: modules that bind
    a collective at import time (`x = dist.all_gather_into_tensor`) then bind the wrapper."""
    for name in COUNTED:
        original = getattr(dist, name, None)
        if original is None:  # a collective this torch lacks (all_gather_single, reduce_scatter_single: not in 2.11)
            continue

        def counted(*args, _name=name, _original=original, **kwargs):
            if not counters.on:
                return _original(*args, **kwargs)
            if _name in FULL_BUFFER_IN_INPUT:
                tensor, group = args[1], _group(kwargs, args, 3)
            elif _name in FULL_BUFFER_IN_OUTPUT:
                tensor, group = args[0], _group(kwargs, args, 2)
            elif _name == "all_gather":  # (list of outputs, input)
                tensor, group = args[1], _group(kwargs, args, 2)
            else:
                tensor, group = args[0], _group(kwargs, args, 2)  # (tensor, op | src | dst, group, ...)
            size = dist.get_world_size(group)
            nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
            if _name == "all_gather":
                nbytes *= size  # each rank's input lands in every rank's list
            label = counters.group_names.get(group, "world" if group is None else "?")
            entry = counters.stats[f"{_name}[{label}]"]
            entry[0] += 1
            entry[1] += nbytes
            entry[2] += nbytes * _wire_factor(_name, size)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
        if name in ("isend", "irecv"):  # P2POp (batch_isend_irecv: ring attention) checks op against these
            setattr(distributed_c10d, name, counted)


def _worker(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    counters = Counters()
    install_counters(counters)
    from hydra import compose, initialize_config_dir

    from megalm.config import register_schema, to_dataclass
    from megalm.train import CONFIG_DIR
    from megalm.training.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    register_schema()
    base = ["data=synthetic", "trainer.eval_interval=0", "trainer.save_interval=0", "logging.tensorboard=false",
            "trainer.max_steps=2", "trainer.compile=false"]  # eager: each step's collectives through dist.*
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = to_dataclass(compose(config_name="config", overrides=base + overrides))
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        trainer.train_step(0)
        mesh = trainer.mesh
        counters.group_names = {mesh.dp_cp_group: "dp×cp", mesh.tp_group: "tp", mesh.dp_group: "dp",
                                mesh.cp_group: "cp", mesh.pp_group: "pp"}  # dp_cp_group is dp_group when cp = 1
        counters.on = True
        trainer.train_step(1)
        counters.on = False
    gathered = [None] * world
    dist.all_gather_object(gathered, dict(counters.stats))
    if rank == 0:
        Path(out).write_text(json.dumps({"layout": overrides, "world_size": world, "per_rank": gathered}))
    del trainer
    gc.collect()  # nothing may hold the process group when it is destroyed (see megalm.train)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes (gloo ranks) of the measured run (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args, overrides = parser.parse_known_args(argv)
    compose_config(overrides)  # a bad override is one line here, not a traceback from each spawned rank
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "stats.json")
        run_cpu_ranks(_worker, args.nproc, args.nproc, free_port(), overrides, out)
        report = json.loads(Path(out).read_text())
    print(f"one step, layout {' '.join(overrides) or '(default)'} on {args.nproc} ranks; per rank, rank 0 shown")
    print(f"{'collective[group]':<32}{'calls':>8}{'payload MB':>14}{'ring wire MB':>14}")
    for name, (calls, payload, wire) in sorted(report["per_rank"][0].items()):
        print(f"{name:<32}{calls:>8}{payload / 2**20:>14.3f}{wire / 2**20:>14.3f}")
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    run_main(main)
