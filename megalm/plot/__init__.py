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

from megalm.plot.cli import main
from megalm.plot.curves import load_metrics, plot_expert_load, plot_metrics
from megalm.plot.figures import (
    INSTALL_HINT,
    PlotError,
    check_replaceable,
    new_figure,
    require_matplotlib,
    save_figure,
    written_here,
)
from megalm.plot.hdp import hdp_rows, plot_hdp_balance, plot_hdp_plan
from megalm.plot.schedule import build_plotted_schedule, plot_schedule, schedule_events

__all__ = ["INSTALL_HINT", "PlotError", "build_plotted_schedule", "check_replaceable", "hdp_rows", "load_metrics",
           "main", "new_figure", "plot_expert_load", "plot_hdp_balance", "plot_hdp_plan", "plot_metrics",
           "plot_schedule", "require_matplotlib", "save_figure", "schedule_events", "written_here"]
