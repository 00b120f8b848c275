"""megalm-plot: `megalm-plot RUN_DIR [--out DIR]` draws a run's curves, `megalm-plot schedule ...` a pipeline
schedule; errors are one line and exit status 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megalm.errors import os_error_line
from megalm.plot.curves import load_metrics, plot_metrics, resolve_run_dir
from megalm.plot.figures import PlotError, check_replaceable, require_matplotlib, save_figure
from megalm.plot.schedule import build_plotted_schedule, plot_schedule


def _run_main(argv: list[str]) -> int:
    usage = ("megalm-plot [-h] RUN_DIR [--out DIR] [--log-loss]\n"
             "       megalm-plot schedule [-h] --out PNG [--schedule ...]")
    p = argparse.ArgumentParser(prog="megalm-plot", usage=usage, description="Plot a run's metrics.jsonl: loss "
                                "(train and valid), learning rate, gradient norm, tokens/s and an MoE model's expert "
                                "load against step. `megalm-plot schedule -h` draws a pipeline schedule.")
    p.add_argument("run_dir", help="a run directory holding metrics.jsonl (or that file), or a dir of runs such as "
                   "outputs/ (its newest run)")
    p.add_argument("--out", default=None, help="where the PNGs go (default RUN_DIR/plots); only charts "
                   "megalm drew are replaced there")
    p.add_argument("--log-loss", action="store_true", help="the loss on a log y-axis")
    args = p.parse_args(argv)
    run_dir = resolve_run_dir(args.run_dir)
    records = load_metrics(run_dir)
    if run_dir != Path(args.run_dir).expanduser():  # a dir of runs' newest, or the run of a metrics.jsonl named
        print(f"megalm-plot: plotting {run_dir}", file=sys.stderr)
    require_matplotlib()
    out = Path(args.out) if args.out else run_dir / "plots"
    if out.exists() and not out.is_dir():
        raise PlotError(f"--out {out} is a file; pass a directory for the PNGs")
    run_name = "/".join(run_dir.resolve().parts[-2:])  # hydra's runs are DATE/TIME
    figures = plot_metrics(records, run_name, log_loss=args.log_loss)
    if not figures:  # records without a curve: it exited 0 having drawn nothing
        raise PlotError(f"{run_dir}: its metrics.jsonl has steps but no loss, lr or other curve to draw; is it a "
                        "megalm run's?")
    check_replaceable(*(out / f"{name}.png" for name in figures))  # all or none written
    for name, fig in figures.items():
        print(f"wrote {save_figure(fig, out / f'{name}.png')}")
    return 0


def _schedule_main(argv: list[str]) -> int:
    from megalm.offload.policy import POLICIES
    from megalm.parallel.pipeline.schedules import SCHEDULES

    p = argparse.ArgumentParser(prog="megalm-plot schedule", description="Draw a pipeline schedule's simulated "
                                "timeline: ranks on y, time on x, F/B/W bars, SEND/RECV and OFFLOAD/RELOAD marks.")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="the pipeline schedule (default 1f1b)")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches a step (default 8)")
    p.add_argument("--vpp", type=int, default=None, help="model chunks per rank (interleaved; default 2)")
    p.add_argument("--offload", type=float, default=0.0, help="fraction of micro-batch-chunks to offload")
    p.add_argument("--offload-policy", choices=[x for x in POLICIES if x != "auto"], default="lifespan",
                   help="which micro-batch-chunks offload (default lifespan)")
    p.add_argument("--out", required=True, help="the PNG to write (it replaces only a chart megalm drew)")
    args = p.parse_args(argv)
    vpp = args.vpp if args.vpp is not None else (2 if args.schedule == "interleaved" else 1)
    if not 0.0 <= args.offload <= 1.0:
        raise PlotError(f"--offload {args.offload:g} is a fraction of the micro-batch-chunks: pass one in [0, 1]")
    require_matplotlib()
    check_replaceable(args.out)
    try:
        sched = build_plotted_schedule(args.schedule, args.pp, args.microbatches, vpp, args.offload,
                                       args.offload_policy)
    except ValueError as e:
        raise PlotError(str(e)) from None
    # One unit = one micro-batch's forward through one pipeline rank's layers, so that makespans compare.
    f = 1.0 / vpp
    fig = plot_schedule(sched, f, f, f)
    if args.offload > 0:
        n = sum(a.kind == "OFFLOAD" for acts in sched.actions for a in acts)
        ax = fig.axes[0]
        ax.set_title(f"{ax.get_title()}\n{n} of {args.pp * args.microbatches * vpp} micro-batch-chunks offloaded "
                     f"({args.offload_policy} policy, fraction {args.offload:g})")
    print(f"wrote {save_figure(fig, args.out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`megalm-plot RUN_DIR [--out DIR]` or `megalm-plot schedule ...`; errors are one line, exit status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["schedule"] and not Path("schedule").is_dir():
            return _schedule_main(argv[1:])
        return _run_main(argv)
    except (PlotError, OSError) as e:
        print(f"error: {os_error_line(e) if isinstance(e, OSError) else e}", file=sys.stderr)
        sys.exit(2)
