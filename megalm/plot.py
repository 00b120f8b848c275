"""Charts: a run's training curves, pipeline-schedule timelines, HDP plans and their balance.

Why: what these draw is already data (a run's `metrics.jsonl`, the pipeline schedules' action lists,
HDP plans and their simulated timelines), and a picture is the quickest way to see a loss spike, a
pipeline bubble or an idle rank. matplotlib is an optional extra (`pip install 'megalm[plots]'`): it
is imported only inside the functions that draw, so training and the simulators run without it, and a
missing install is one line (`PlotError`). Figures are built on the Agg canvas directly (no display,
no pyplot state to leak between figures). A chart replaces only a chart megalm drew (its PNG says so): a
re-run refreshes its own charts, and any other file at an output path is left as it was, with a one-line error.

    megalm-plot RUN_DIR [--out DIR]      loss (train, valid), lr, grad norm, tokens/s against step
    megalm-plot schedule --pp 4 --microbatches 8 --schedule 1f1b --out 1f1b.png

The HDP charts (`plot_hdp_plan`, `plot_hdp_balance`) are drawn by tools/hdp_sim.py and tools/hdp_plan.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megalm.errors import MegalmError

if TYPE_CHECKING:  # only for annotations: importing this module must not need matplotlib
    from matplotlib.figure import Figure

    from megalm.parallel.hdp import Plan
    from megalm.parallel.hdp.cost import SimResult as HdpSimResult
    from megalm.parallel.pipeline.actions import Action, Schedule

INSTALL_HINT = "plotting needs matplotlib; pip install 'megalm[plots]'"
WRITER = "megalm-plot"  # the PNG text chunk `Software` of every chart written here starts with it
DPI = 110


class PlotError(MegalmError):
    """A chart cannot be drawn: matplotlib missing, or its input (a run dir, metrics.jsonl) is unusable."""


def require_matplotlib() -> None:
    """Raise PlotError (one line, with the install command) if matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
        import matplotlib.figure  # noqa: F401
    except ImportError as e:
        raise PlotError(INSTALL_HINT) from e


def new_figure(width: float, height: float) -> Figure:
    """A Figure on the Agg canvas (no display), sized in inches."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def written_here(path: str | Path) -> bool:
    """Whether `path` is a PNG that megalm's plots wrote (their `Software` text chunk says so): the one kind of
    file a new chart may replace, as a re-run refreshes its own charts."""
    from PIL import Image, UnidentifiedImageError  # matplotlib's own dependency

    try:
        with Image.open(path) as image:
            return image.format == "PNG" and str(image.info.get("Software", "")).startswith(WRITER)
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError):  # not ours either way
        return False


def check_replaceable(*paths: str | Path) -> None:
    """PlotError (one line) if any of `paths` exists and is not a chart megalm wrote: nothing of the user's is
    overwritten. Callers check every chart they will write before writing the first."""
    for path in map(Path, paths):
        if path.is_dir() or (path.exists() and not written_here(path)):
            raise PlotError(f"{path} exists and is not a chart megalm drew; nothing was written: move it or "
                            "pick another output path")


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write `fig` as a PNG (parent directories created), atomically (a temporary file renamed over the path), and
    marked as megalm's in its `Software` text chunk; refuses (`check_replaceable`) to replace another file.
    Returns the path."""
    import matplotlib

    path = Path(path)
    check_replaceable(path)
    ours = path.exists()  # a chart megalm drew (checked): replaced; else the path is taken only if still free
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        fig.savefig(partial, dpi=DPI, format="png",
                    metadata={"Software": f"{WRITER} (matplotlib {matplotlib.__version__})"})
        if ours:
            os.replace(partial, path)
        else:
            try:
                os.link(partial, path)  # fails if a file appeared there since the check
            except FileExistsError:
                raise PlotError(f"{path} appeared while the chart was drawn; nothing was written: move it or "
                                "pick another output path") from None
    finally:
        partial.unlink(missing_ok=True)
    return path


# ---------------------------------------------------------------------------------------------
# Training curves from metrics.jsonl


def load_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl; PlotError (naming the line) if the dir, the file or a line is bad."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlotError(f"run dir {run_dir} does not exist (or is not a directory)")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path} not found: is {run_dir} a megalm run dir (megalm-train writes it)?")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise PlotError(f"{path} line {n} is not valid JSON ({e.msg}); truncated by a crash? "
                            "delete or fix that line") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)):
            raise PlotError(f"{path} line {n} is not a metrics record (a JSON object with a numeric 'step')")
        records.append(record)
    if not records:
        raise PlotError(f"{path} is empty: the run logged no step yet")
    return records


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pairs], [v for _, v in pairs]


# name: (keys, labels, y label, title)
CURVES = {
    "loss": (("loss", "val_loss"), ("train loss", "valid loss"), "cross-entropy loss (nats/token)", "loss"),
    "lr": (("lr",), ("learning rate",), "learning rate", "learning rate"),
    "grad_norm": (("grad_norm",), ("gradient norm",), "gradient norm (global L2, before clipping)",
                  "gradient norm"),
    "throughput": (("tokens_per_sec", "tokens_per_sec_per_gpu"), ("all ranks", "per GPU"), "tokens/s",
                   "throughput"),
}


def plot_metrics(records: list[dict[str, Any]], run_name: str = "", log_loss: bool = False) -> dict[str, Figure]:
    """One figure per curve in CURVES whose key a record has: {name: Figure}, x = optimizer step; `log_loss`: the
    loss on a log y-axis (late training's small gains stay visible)."""
    figures = {}
    for name, (keys, labels, ylabel, title) in CURVES.items():
        present = [(k, lab) for k, lab in zip(keys, labels, strict=True) if _series(records, k)[0]]
        if name == "throughput" and _series(records, "tokens_per_sec") == _series(records, "tokens_per_sec_per_gpu"):
            present = present[:1]  # one GPU: the per-GPU rate is the same curve
        if not present:
            continue
        fig = new_figure(7.5, 4.2)
        ax = fig.add_subplot()
        for k, lab in present:
            steps, values = _series(records, k)
            few = len(steps) <= 30
            ax.plot(steps, values, label=lab, marker="o" if few or k == "val_loss" else None, markersize=3)
        if name == "throughput" and "tokens_per_sec_per_gpu" in dict(present):
            ax.set_ylabel("tokens/s (all ranks, and per GPU)")
        else:
            ax.set_ylabel(ylabel)
        if name == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        if name == "loss" and log_loss:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(f"{title} — {run_name}" if run_name else title)
        ax.grid(alpha=0.3)
        ax.legend()
        figures[name] = fig
    loads = [(r["step"], r["moe_load"]) for r in records if isinstance(r.get("moe_load"), list)]
    if loads:
        figures["expert_load"] = plot_expert_load(loads, run_name)
    return figures


def plot_expert_load(loads: list[tuple[int, list[float]]], run_name: str = "") -> Figure:
    """Expert load over steps, one curve per MoE layer: the busiest expert's tokens over the mean (1 = uniform;
    metrics.jsonl's `moe_load`, megalm/training/expert_load.py)."""
    fig = new_figure(7.5, 4.2)
    ax = fig.add_subplot()
    steps = [s for s, _ in loads]
    for i in range(len(loads[0][1])):
        ax.plot(steps, [values[i] for _, values in loads], label=f"MoE layer {i + 1}")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8, label="uniform")
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean tokens per expert")
    ax.set_title(f"expert load — {run_name}" if run_name else "expert load")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


# ---------------------------------------------------------------------------------------------
# Pipeline schedules

KIND_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
EVENT_STYLE = {  # kind: (marker, colour, where in the row: +1 above the bars, -1 below)
    "SEND_F": (">", "#333333", 1), "RECV_F": ("<", "#333333", 1),
    "SEND_B": (">", "#C44E52", 1), "RECV_B": ("<", "#C44E52", 1),
    "OFFLOAD": ("v", "#8172B3", -1), "RELOAD": ("^", "#8172B3", -1),
}
EVENT_LABELS = {"SEND_F": "SEND activations", "RECV_F": "RECV activations", "SEND_B": "SEND gradients",
                "RECV_B": "RECV gradients", "OFFLOAD": "OFFLOAD to host", "RELOAD": "RELOAD from host"}


def schedule_events(sched: Schedule, timeline: list[list[tuple[Action, float, float]]]
                    ) -> list[list[tuple[Action, float]]]:
    """Per rank, the non-compute actions (SEND/RECV, OFFLOAD/RELOAD) of `sched` with their time on the
    compute `timeline` (schedules.simulate_schedule: communication is free): a SEND or an OFFLOAD at the end of
    the compute action before it, a RECV or a RELOAD at the start of the compute action after it."""
    out = []
    for rank, acts in enumerate(sched.actions):
        spans = timeline[rank]
        events, done = [], 0  # done: compute actions of this rank seen so far
        for a in acts:
            if a.is_compute:
                done += 1
                continue
            before = spans[done - 1][2] if done else 0.0
            after = spans[done][1] if done < len(spans) else before
            events.append((a, before if a.kind.startswith("SEND") or a.kind == "OFFLOAD" else after))
        out.append(events)
    return out


def plot_schedule(sched: Schedule, f: float = 1.0, b: float = 1.0, w: float = 1.0, title: str | None = None
                  ) -> Figure:
    """Timeline of a pipeline schedule: ranks on y, simulated time on x, F/B/W bars (micro-batch number
    inside, model chunk by shade), SEND/RECV above and OFFLOAD/RELOAD below each row as markers.
    Costs per action as in `schedules.simulate_schedule` (an unsplit B costs b + w)."""
    from megalm.parallel.pipeline.schedules import simulate_schedule

    res = simulate_schedule(sched, f, b, w)
    p, vpp = sched.num_stages, sched.vpp
    fig = new_figure(13, 1.2 + 0.62 * p)
    ax = fig.add_subplot()
    kinds = ("F", "B", "W") if sched.split_backward else ("F", "B")
    names = {"F": "F forward", "B": "B input-grad backward" if sched.split_backward else "B backward (full)",
             "W": "W weight-grad backward"}
    n_per_rank = max(len(t) for t in res.timeline)
    for kind in kinds:
        for chunk in range(vpp):
            spans = [(rank, s, e, a) for rank, t in enumerate(res.timeline) for a, s, e in t
                     if a.kind == kind and a.chunk == chunk]
            if not spans:
                continue
            label = names[kind] + (f", chunk {chunk}" if vpp > 1 else "")
            alpha = 1.0 - 0.45 * chunk / max(vpp - 1, 1)
            ax.barh([r for r, *_ in spans], [e - s for _, s, e, _ in spans], left=[s for _, s, _, _ in spans],
                    height=0.62, color=KIND_COLORS[kind], alpha=alpha, edgecolor="white", linewidth=0.8,
                    label=label)
            if n_per_rank <= 80:
                for r, s, e, a in spans:
                    ax.text((s + e) / 2, r, str(a.micro_batch), ha="center", va="center", fontsize=7,
                            color="white" if chunk == 0 else "black")
    events = schedule_events(sched, res.timeline)
    for kind, (marker, color, side) in EVENT_STYLE.items():
        pts = [(t, rank) for rank, ev in enumerate(events) for a, t in ev if a.kind == kind]
        if pts:
            nudge = -0.08 if kind.startswith("SEND") or kind == "OFFLOAD" else 0.08  # a send and a receive
            ax.scatter([t + nudge for t, _ in pts], [r - side * 0.42 for _, r in pts], marker=marker, s=16,
                       color=color, label=EVENT_LABELS[kind], zorder=3, linewidths=0)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.4, -0.6)
    ax.set_xlim(0, res.makespan * 1.005)
    ax.set_xlabel(f"time (cost units: F = {f:g}, B = {b if sched.split_backward else b + w:g}"
                  + (f", W = {w:g}" if sched.split_backward else "") + " per micro-batch and chunk)")
    ax.set_ylabel("pipeline rank")
    ax.grid(axis="x", alpha=0.25)
    ax.set_title(title or f"{sched.name}: p = {p}, m = {sched.num_micro_batches}, makespan {res.makespan:g}, "
                          f"bubble {res.bubble_fraction:.1%} (communication free)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    return fig


def build_plotted_schedule(name: str, pp: int, microbatches: int, vpp: int = 1, offload: float = 0.0,
                           offload_policy: str = "lifespan") -> Schedule:
    """The schedule the runtime executes (with its SEND/RECV actions, and OFFLOAD/RELOAD for `offload` > 0:
    that fraction of micro-batch-chunks chosen by megalm.offload.policy)."""
    from megalm.parallel.pipeline.rendezvous import with_comm
    from megalm.parallel.pipeline.schedules import build_schedule, simulate_schedule

    sched = build_schedule(name, pp, microbatches, vpp)
    if offload > 0:
        from megalm.offload.policy import COSTS, select_pipeline

        timeline = simulate_schedule(sched, COSTS["F"], 1.0 if sched.split_backward else COSTS["B"] / 2,
                            1.0 if sched.split_backward else COSTS["B"] / 2).timeline
        chosen = select_pipeline(sched, timeline, offload_policy, offload)
        return with_comm(sched).with_offload(chosen)
    return with_comm(sched)


# ---------------------------------------------------------------------------------------------
# HDP plans (tools/hdp_sim.py, tools/hdp_plan.py)

PACKED_COLORS = ("#6FA8DC", "#3D78B8")  # consecutive packed micro-batches alternate
COMM_COLOR, FILL_COLOR, STEP_COLOR = "#8C8C8C", "#F4E4A1", "#D62728"


def _shade(rgba: tuple, k: int) -> tuple:
    """Lighten or darken a colour a little, by a hash of k, so neighbouring rings differ."""
    j = ((k * 2654435761) % 97) / 97 - 0.5
    return tuple(min(1.0, max(0.0, c + 0.18 * j)) for c in rgba[:3]) + (1.0,)


def hdp_rows(num_ranks: int, max_rows: int) -> list[int]:
    """The ranks a Gantt chart shows: all, or `max_rows` spread evenly (the first rank always)."""
    n = min(num_ranks, max_rows)
    return [y * num_ranks // n for y in range(n)]


def plot_hdp_plan(plan: Plan, sim: HdpSimResult, t_max: float | None = None, title: str = "",
                  max_rows: int = 128) -> Figure:
    """Gantt chart of an HDP plan on the cost model's clock: one row per rank (at most `max_rows`, evenly
    sampled, said in the title), packed single-rank micro-batches in blue, ring micro-batches coloured by
    ring size (colour bar) with their exposed communication in grey, pipeline fill/drain in yellow, the
    step time as a red line; on the right, each shown rank's compute / exposed comm / idle seconds."""
    import matplotlib as mpl
    from matplotlib.collections import PolyCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    D = plan.num_ranks
    rows = hdp_rows(D, max_rows)
    t_max = t_max or 1.02 * max(sim.step_time, 1e-12)
    scale, unit = (1.0, "s") if t_max >= 1 else (1e3, "ms")
    max_ring = max([len(mb.ranks) for mb in plan.micro_batches if mb.seqs and len(mb.ranks) > 1], default=2)
    top = max(4, 2 ** math.ceil(math.log2(max_ring)))
    norm = mpl.colors.LogNorm(vmin=2, vmax=top)
    # YlOrRd without its palest third, which would read as the yellow of pipeline fill/drain
    cmap = mpl.colors.ListedColormap(mpl.colormaps["YlOrRd"]([0.35 + 0.65 * i / 255 for i in range(256)]))

    def rect(y: int, t0: float, t1: float) -> list[tuple[float, float]]:
        x0, x1 = t0 * scale, max(t1 * scale, t0 * scale + t_max * scale * 4e-4)
        return [(x0, y - 0.5), (x1, y - 0.5), (x1, y + 0.5), (x0, y + 0.5)]

    packed, packed_c, ring, ring_c, comm, fill = [], [], [], [], [], []
    for y, r in enumerate(rows):
        n_packed = 0
        for t0, t1, k in sim.timeline[r]:
            mb = plan.micro_batches[k]
            if len(mb.ranks) == 1:
                packed.append(rect(y, t0, t1))
                packed_c.append(PACKED_COLORS[n_packed % 2])
                n_packed += 1
            elif mb.seqs:
                compute, exposed = sim.durations[k]
                ring.append(rect(y, t0, min(t1, t0 + compute)))
                ring_c.append(_shade(cmap(norm(len(mb.ranks))), k))
                if t1 > t0 + compute:
                    comm.append(rect(y, t0 + compute, t1))
        end = sim.timeline[r][-1][1] if sim.timeline[r] else 0.0
        if sim.finish[r] > end:
            fill.append(rect(y, end, sim.finish[r]))

    fig = new_figure(14, 8 if len(rows) > 32 else 2.2 + 0.28 * len(rows))
    gantt, side = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [5, 1]})
    for name, polys, colors in (("packed micro-batch", packed, packed_c), ("ring micro-batch", ring, ring_c),
                                ("exposed ring communication", comm, COMM_COLOR),
                                ("pipeline fill/drain", fill, FILL_COLOR)):
        gantt.add_collection(PolyCollection(polys, facecolors=colors, linewidths=0, label=name))
    gantt.axvline(sim.step_time * scale, color=STEP_COLOR, lw=1.5)
    gantt.set_xlim(0, t_max * scale)
    gantt.set_ylim(len(rows) - 0.5, -0.5)
    step = 2 ** max(0, math.ceil(math.log2(D / 9)))  # at most ~9 rank ticks, at multiples of a power of 2
    ticks = [y for y, r in enumerate(rows) if r % step == 0]
    if len(ticks) < 2 or len(ticks) > 12:
        ticks = sorted({round(i * (len(rows) - 1) / 8) for i in range(9)})
    gantt.set_yticks(ticks, [str(rows[y]) for y in ticks])
    shown = f"every {D // len(rows)}th of {D} ranks shown" if len(rows) < D else f"{D} ranks"
    gantt.set_ylabel(f"HDP rank ({shown})")
    gantt.set_xlabel(f"time in the step ({unit}, cost model)")
    fig.suptitle(title + (f" ({len(rows)} of {D} ranks drawn)" if len(rows) < D else ""))
    handles = [Patch(color=PACKED_COLORS[1], label="packed micro-batch (one rank)"),
               Patch(color=cmap(norm(max(2, max_ring // 2))), label="ring micro-batch (colour: ring size)"),
               Patch(color=COMM_COLOR, label="exposed ring communication"),
               Patch(color=FILL_COLOR, label="pipeline fill/drain"),
               Patch(facecolor="white", edgecolor="#999999", label="idle / waiting for ring partners"),
               Line2D([], [], color=STEP_COLOR, lw=1.5, label=f"step time {sim.step_time * scale:.3g} {unit}")]
    gantt.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.04), ncol=3, fontsize=8,
                 frameon=False)
    cbar = fig.colorbar(mpl.cm.ScalarMappable(norm=norm, cmap=cmap), ax=side, fraction=0.25, pad=0.04)
    cbar.set_label("ring size (ranks)")
    cbar.set_ticks([2 ** i for i in range(1, int(math.log2(top)) + 1)], labels=[str(2 ** i) for i in
                   range(1, int(math.log2(top)) + 1)])
    cbar.minorticks_off()

    ys = list(range(len(rows)))
    compute = [sim.compute[r] * scale for r in rows]
    exposed = [sim.comm[r] * scale for r in rows]
    idle = [max(0.0, sim.step_time * scale - c - e) for c, e in zip(compute, exposed, strict=True)]
    h = 1.0 if len(rows) > 32 else 0.8
    side.barh(ys, compute, height=h, color="#3D78B8", label="compute", linewidth=0)
    side.barh(ys, exposed, left=compute, height=h, color=COMM_COLOR, label="exposed comm", linewidth=0)
    side.barh(ys, idle, left=[c + e for c, e in zip(compute, exposed, strict=True)], height=h, color="#EEEEEE",
              label="idle, fill/drain", linewidth=0)
    side.set_xlim(0, t_max * scale)
    side.set_xlabel(f"per-rank time ({unit})")
    side.set_title("balance", loc="left")
    side.legend(loc="lower center", bbox_to_anchor=(0.5, 1.04), fontsize=8, frameon=False)
    return fig


def plot_hdp_balance(results: dict[str, HdpSimResult], title: str = "", bins: int = 60) -> Figure:
    """Histogram of the per-rank busy time (compute + exposed ring communication) under each policy, one
    outline per policy, its step time as a dashed line of the same colour: the gap from a rank's busy time
    to the line is its idle time, so a balanced plan is a narrow peak close to its line."""
    fig = new_figure(10, 4.8)
    ax = fig.add_subplot()
    busy = {name: [c + e for c, e in zip(sim.compute, sim.comm, strict=True)] for name, sim in results.items()}
    t_max = max(sim.step_time for sim in results.values())
    scale, unit = (1.0, "s") if t_max >= 1 else (1e3, "ms")
    lo = 0.95 * min(min(b) for b in busy.values()) * scale
    edges = [lo + i * (1.02 * t_max * scale - lo) / bins for i in range(bins + 1)]
    colors = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3")
    for n, (name, sim) in enumerate(results.items()):
        c = colors[n % len(colors)]
        util = sum(sim.compute) / (len(sim.compute) * sim.step_time) if sim.step_time else 0.0
        ax.hist([x * scale for x in busy[name]], bins=edges, histtype="step", lw=1.8, color=c,
                label=f"{name}: step {sim.step_time * scale:.3g} {unit}, utilisation {util:.0%}")
        ax.axvline(sim.step_time * scale, color=c, ls="--", lw=1.2)
    ax.set_xlabel(f"busy time per rank: compute + exposed ring communication ({unit}); dashed: step time")
    ax.set_ylabel("ranks")
    ax.set_title(title or "per-rank load")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------------------------------------
# CLI


def _run_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megalm-plot", description="Plot a run's metrics.jsonl: loss (train and "
                                "valid), learning rate, gradient norm, tokens/s and an MoE model's expert load against "
                                "step. "
                                "`megalm-plot schedule -h` draws a pipeline schedule.")
    p.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    p.add_argument("--out", default=None, help="where the PNGs go (default RUN_DIR/plots); only charts "
                   "megalm drew are replaced there")
    p.add_argument("--log-loss", action="store_true", help="the loss on a log y-axis")
    args = p.parse_args(argv)
    records = load_metrics(args.run_dir)
    require_matplotlib()
    out = Path(args.out) if args.out else Path(args.run_dir) / "plots"
    if out.exists() and not out.is_dir():
        raise PlotError(f"--out {out} is a file; pass a directory for the PNGs")
    run_name = "/".join(Path(args.run_dir).resolve().parts[-2:])  # hydra's runs are DATE/TIME
    figures = plot_metrics(records, run_name, log_loss=args.log_loss)
    check_replaceable(*(out / f"{name}.png" for name in figures))  # all or none written
    for name, fig in figures.items():
        print(f"wrote {save_figure(fig, out / f'{name}.png')}")
    return 0


def _schedule_main(argv: list[str]) -> int:
    from megalm.offload.policy import POLICIES
    from megalm.parallel.pipeline.schedules import SCHEDULES

    p = argparse.ArgumentParser(prog="megalm-plot schedule", description="Draw a pipeline schedule's simulated "
                                "timeline: ranks on y, time on x, F/B/W bars, SEND/RECV and OFFLOAD/RELOAD marks.")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--vpp", type=int, default=None, help="model chunks per rank (interleaved; default 2)")
    p.add_argument("--offload", type=float, default=0.0, help="fraction of micro-batch-chunks to offload")
    p.add_argument("--offload-policy", choices=[x for x in POLICIES if x != "auto"], default="lifespan")
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
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    sys.exit(main())
