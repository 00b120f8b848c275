"""Show the HDP plan a training run executes at one step: which rank runs which documents, on which ring.

    python tools/hdp_plan.py --step 0 --png plan.png parallel.hdp=true parallel.dp=8 data.varlen=true \
        parallel.hdp_capacity=512 model.seq_length=2048 trainer.tokens_per_step=16384

Arguments without dashes are the run's Hydra overrides (the same ones `megalm-train` gets; set
`parallel.dp` and `parallel.cp`, since there is no torchrun world to derive them from). The tool
reads the step's sample lengths exactly as the trainer does (no token is read), plans them with the
trainer's planner and cost model (`megalm.parallel.hdp.split.HdpSplit.plan`: with pp > 1 the
rings are aligned across pipelines), prints one line per HDP rank, and with --png draws the plan as
a Gantt chart on the cost model's clock (megalm.plot.plot_hdp_plan, as tools/hdp_sim.py: blue packed
micro-batches, orange to red rings by size, grey their exposed ring traffic, yellow pipeline fill/drain,
and each rank's compute / comm / idle time beside it). --png needs matplotlib (pip install 'megalm[plots]').
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalm.config.compose import compose_config  # noqa: E402
from megalm.data.build import build_datasets  # noqa: E402
from megalm.data.steps import step_samples  # noqa: E402
from megalm.errors import ConfigError  # noqa: E402
from megalm.parallel.dims import ParallelDims, ParallelMesh  # noqa: E402
from megalm.parallel.hdp import Plan, simulate  # noqa: E402
from megalm.parallel.hdp.split import HdpSplit  # noqa: E402
from megalm.training.validation import validate_run  # noqa: E402
from tools.bench.cli import run_main  # noqa: E402


def describe(plan: Plan, lengths: list[int]) -> list[str]:
    """One line per HDP rank: its micro-batches in order, `[docs: tokens]` packed, `ring(d)@i` sharded (`a2a/u ring`
    for a hierarchical one: all-to-all groups of u ranks)."""
    lines = []
    for h, todo in enumerate(plan.per_rank):
        parts = []
        for k in todo:
            mb = plan.micro_batches[k]
            if not mb.seqs:
                parts.append("filler")
            elif len(mb.ranks) == 1:
                parts.append(f"[{len(mb.seqs)} docs: {mb.tokens} tok]")
            else:
                kind = f"a2a/{mb.inner} ring" if mb.inner > 1 else "ring"
                parts.append(f"{kind}{mb.ranks}@{mb.ranks.index(h)} doc {mb.seqs[0]} ({lengths[mb.seqs[0]]} tok)")
        lines.append(f"rank {h:>3}: " + " | ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> tuple[Plan, list[int]]:
    """Plan and print (and draw) one step; returns the plan and the documents' input lengths."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step", type=int, default=0, help="training step (0-based)")
    p.add_argument("--png", default=None, help="write the plan's Gantt chart here (replacing only a chart megalm drew)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the run")
    args = p.parse_args(argv)
    if args.step < 0:
        raise ConfigError(f"--step {args.step} must be >= 0 (steps count from 0)")
    if args.png:
        from megalm.plot import PlotError, check_replaceable, require_matplotlib

        try:  # before anything is computed
            require_matplotlib()
            check_replaceable(args.png)
        except PlotError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    cfg = compose_config(args.overrides)
    par = cfg.parallel
    if par.dp is None or not par.hdp:
        raise ConfigError("set parallel.hdp=true and parallel.dp (and parallel.cp): the HDP domain is dp*cp ranks")
    cfg = validate_run(cfg, world_size=par.tp * par.pp * par.cp * par.dp)
    if args.step >= cfg.trainer.max_steps:  # (a token budget's steps are found by scanning every one before it)
        raise ConfigError(f"--step {args.step} is past the run's last step, {cfg.trainer.max_steps - 1} "
                          f"(trainer.max_steps={cfg.trainer.max_steps}); set trainer.max_steps to the run's")
    par = cfg.parallel  # validated: parallel.hdp_capacity filled where unset
    data = build_datasets(cfg)
    t = cfg.trainer
    ids = step_samples(t, data.train).ids(args.step)
    lengths = [data.train.sample_length(k) - 1 for k in ids]
    runtime = HdpSplit.for_config(cfg, ParallelMesh(ParallelDims(cp=par.cp, dp=par.dp)))
    plan = runtime.plan(lengths)
    sim = simulate(plan, runtime.cost, pp=par.pp, ep=par.ep)
    vpp = f", vpp = {par.vpp}" if par.vpp > 1 else ""
    print(f"step {args.step}: {len(lengths)} documents, {sum(lengths)} tokens over {runtime.num_ranks} HDP ranks, "
          f"C = {par.hdp_capacity}, pp = {par.pp}{vpp}; {plan.stats['rings']} rings, "
          f"{plan.stats.get('fillers', 0)} fillers; estimated step {sim.step_time * 1e3:.2f} ms ({runtime.cost.name})")
    if par.ep > 1:
        free = simulate(plan, runtime.cost, pp=par.pp).step_time
        print(f"parallel.ep={par.ep}: the ranks run in lockstep (fillers pad every rank to the longest list), and each "
              "micro-batch position waits for the slowest rank of its EP group (and of the groups a ring there "
              f"joins) at the MoE all-to-alls: the estimated step includes the waits ({free * 1e3:.2f} ms without "
              "them)")
    elif runtime.lockstep:
        print(f"parallel.vpp={par.vpp}: the interleaved pipelines run in lockstep, each as many micro-batches, a "
              f"multiple of pp = {par.pp} (fillers pad the shorter lists)")
    print("\n".join(describe(plan, lengths)))
    if args.png:
        utilisation = sum(sim.compute) / (runtime.num_ranks * sim.step_time) if sim.step_time else 0.0
        title = (f"HDP plan of step {args.step}: {len(lengths)} documents on {runtime.num_ranks} ranks, capacity "
                 f"{par.hdp_capacity}, pp {par.pp}, {plan.stats['rings']} rings, utilisation {utilisation:.0%} "
                 f"({runtime.cost.name})")
        from megalm.plot import plot_hdp_plan, save_figure

        save_figure(plot_hdp_plan(plan, sim, 1.02 * max(sim.step_time, 1e-12), title), args.png)
        print(f"wrote {args.png}")
    return plan, lengths


if __name__ == "__main__":
    run_main(main)
