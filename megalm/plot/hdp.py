"""HDP plans and their balance (drawn by tools/hdp_sim.py and tools/hdp_plan.py): each rank's packed micro-batches
and CP rings over time, and the spread of the ranks' busy time under each policy."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megalm.plot.figures import new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from megalm.parallel.hdp import Plan
    from megalm.parallel.hdp.cost import SimResult as HdpSimResult

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
