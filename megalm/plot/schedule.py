"""A pipeline schedule's simulated timeline: ranks on y, time on x, F/B/W bars, SEND/RECV above and OFFLOAD/RELOAD
below each row (the action lists the runtime executes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megalm.plot.figures import new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from megalm.parallel.pipeline.actions import Action, Schedule

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
    """The schedule the runtime executes (`executed_schedule`: with its SEND/RECV actions, and OFFLOAD/RELOAD for
    `offload` > 0: that fraction of micro-batch-chunks chosen by megalm.offload.policy, as the trainer's
    PipelineOffload chooses them, on the list with its communication; PipeOffload's copy/compute ratio 0)."""
    from megalm.parallel.pipeline.runtime import executed_schedule
    from megalm.parallel.pipeline.schedules import simulated_timeline

    hooks = None
    if offload > 0:
        from megalm.offload.hooks import PipelineOffload

        hooks = PipelineOffload(None, offload_policy, offload, simulated_timeline)
    return executed_schedule(name, pp, microbatches, vpp, hooks)
