"""A run's training curves (loss, learning rate, gradient norm, tokens/s) and an MoE model's expert load, from its
metrics.jsonl."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megalm.plot.figures import PlotError, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def last_attempt(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A resumed run's history: metrics.jsonl is appended to, so after a restart from an earlier checkpoint the
    steps an attempt logged past it are there twice. A record whose step is not past the one before it starts a new
    attempt, whose records replace the earlier one's from that step on."""
    kept: list[dict[str, Any]] = []
    for record in records:
        while kept and kept[-1]["step"] >= record["step"]:
            kept.pop()
        kept.append(record)
    return kept


def resolve_run_dir(path: str | Path) -> Path:
    """The run dir a user named: a run dir; its metrics.jsonl; or a dir of runs (such as `outputs/`, which a bare
    `megalm-train` writes DATE/TIME dirs into), whose newest metrics.jsonl wins, as megalm-generate's newest run."""
    path = Path(path).expanduser()
    if path.is_file() and path.name == "metrics.jsonl":
        return path.parent
    if path.is_dir() and not (path / "metrics.jsonl").exists():
        # DATE/TIME under outputs/, DATE/TIME/N under multirun/: three levels, not the whole tree of `.` or `~`
        found = [run for depth in (1, 2, 3) for run in path.glob("*/" * depth + "metrics.jsonl")]
        runs = sorted(found, key=lambda p: p.stat().st_mtime)
        if runs:
            return runs[-1].parent
    return path


def load_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl as the run's last attempt left them (`last_attempt`); PlotError (naming
    the line) if the dir, the file or a record is bad. A line that is not JSON (one a crash tore; megalm-train
    starts its next record on a line of its own) is skipped with a warning on stderr."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise PlotError(f"run dir {run_dir} does not exist")
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir} is a file; pass the run dir that holds metrics.jsonl")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path} not found: is {run_dir} a megalm run dir (megalm-train writes it)?")
    records, torn = [], []
    for n, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)  # bytes: a line a crash left undecodable is torn like any other
        except (json.JSONDecodeError, UnicodeDecodeError):
            torn.append(n)
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)):
            raise PlotError(f"{path} line {n} is not a metrics record (a JSON object with a numeric 'step')")
        records.append(record)
    if not records:
        torn_note = " (only a line torn by a crash)" if torn else ""
        raise PlotError(f"{path} is empty: the run logged no step yet{torn_note}")
    if torn:
        print(f"warning: {path}: skipped {len(torn)} line(s) that are not JSON (torn by a crash?): line "
              f"{', '.join(map(str, torn[:5]))}{' ...' if len(torn) > 5 else ''}", file=sys.stderr)
    return last_attempt(records)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pairs], [v for _, v in pairs]


# name: (keys, labels, y label, title)
CURVES = {
    "loss": (("loss", "loss_avg", "val_loss"), ("train loss", "train loss, mean since the last record", "valid loss"),
             "cross-entropy loss (nats/token)", "loss"),
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
