"""megalm.plot: the figures' contents (axes, legends, bar and line counts), megalm-plot's files and one-line errors."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from megalm import plot  # noqa: E402
from megalm.parallel.hdp import plan_hdp, plan_static, simulate  # noqa: E402
from megalm.parallel.hdp.cost import load_cost  # noqa: E402
from megalm.parallel.pipeline.rendezvous import with_comm  # noqa: E402
from megalm.parallel.pipeline.schedules import interleaved_1f1b, one_f_one_b, zb_h1  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def bars(ax) -> dict[str, int]:
    """{label: number of bars} of an axes' bar containers."""
    return {c.get_label(): len(c.patches) for c in ax.containers}


def write_run(run: Path, records: list[dict], extra: str = "") -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + extra)
    return run


def records(n: int = 10) -> list[dict]:
    out = []
    for s in range(1, n + 1):
        r = {"step": s, "loss": 5.0 - 0.1 * s, "grad_norm": 1.0 / s, "lr": 1e-4 * s, "tokens": 1000 * s,
             "tokens_per_sec": 2000.0 + s, "tokens_per_sec_per_gpu": 500.0 + s, "peak_memory_gib": 0.1}
        if s % 5 == 0:
            r["val_loss"] = 5.1 - 0.1 * s
        out.append(r)
    return out


def one_line_error(capsys, call) -> str:
    with pytest.raises(SystemExit) as e:
        call()
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


# ---------------------------------------------------------------------------------------------
# metrics.jsonl


def test_metrics_figures_have_curves_axes_and_legends():
    figs = plot.plot_metrics(records(), "run1")
    assert set(figs) == {"loss", "lr", "grad_norm", "throughput"}
    ax = figs["loss"].axes[0]
    assert legend_texts(ax) == ["train loss", "valid loss"]
    train, valid = ax.get_lines()
    assert list(train.get_xdata()) == list(range(1, 11)) and list(valid.get_xdata()) == [5, 10]
    assert ax.get_xlabel() == "step" and "nats/token" in ax.get_ylabel() and ax.get_title() == "loss — run1"
    for name, label in (("lr", "learning rate"), ("grad_norm", "gradient norm")):
        ax = figs[name].axes[0]
        assert legend_texts(ax) == [label] and len(ax.get_lines()) == 1 and ax.get_xlabel() == "step"
    ax = figs["throughput"].axes[0]
    assert legend_texts(ax) == ["all ranks", "per GPU"] and "tokens/s" in ax.get_ylabel()
    assert figs["loss"].axes[0].get_yscale() == "linear"
    assert plot.plot_metrics(records(), "run1", log_loss=True)["loss"].axes[0].get_yscale() == "log"


def test_a_runs_loss_mean_over_its_log_interval_is_a_curve_of_its_own():
    """metrics.jsonl's loss_avg (the mean of the step losses since the previous record) beside the logged step's."""
    rs = [{**r, "loss_avg": r["loss"] + 0.05} for r in records()]
    ax = plot.plot_metrics(rs)["loss"].axes[0]
    assert legend_texts(ax) == ["train loss", "train loss, mean since the last record", "valid loss"]
    assert list(ax.get_lines()[1].get_ydata()) == [r["loss_avg"] for r in rs]


def test_metrics_without_validation_or_per_gpu_rate_draw_fewer_curves():
    rs = [{"step": s, "loss": 3.0, "lr": 1e-3} for s in range(1, 4)]
    figs = plot.plot_metrics(rs)
    assert set(figs) == {"loss", "lr"}
    assert legend_texts(figs["loss"].axes[0]) == ["train loss"] and figs["loss"].axes[0].get_title() == "loss"
    one_gpu = [{"step": s, "loss": 3.0, "tokens_per_sec": 10.0 * s, "tokens_per_sec_per_gpu": 10.0 * s} for s in (1, 2)]
    assert legend_texts(plot.plot_metrics(one_gpu)["throughput"].axes[0]) == ["all ranks"]


def test_moe_runs_get_an_expert_load_figure_with_a_curve_per_layer():
    rs = [{"step": s, "loss": 3.0, "moe_load": [3.0 / s, 2.0]} for s in range(1, 5)]
    figs = plot.plot_metrics(rs)
    assert set(figs) == {"loss", "expert_load"}
    ax = figs["expert_load"].axes[0]
    assert legend_texts(ax) == ["MoE layer 1", "MoE layer 2", "uniform"]
    assert list(ax.get_lines()[0].get_ydata()) == [3.0, 1.5, 1.0, 0.75] and "per expert" in ax.get_ylabel()
    assert "expert_load" not in plot.plot_metrics(records())


def test_cli_writes_the_pngs(tmp_path, capsys):
    run = write_run(tmp_path / "run", records())
    assert plot.main([str(run), "--out", str(tmp_path / "out")]) == 0
    for name in ("loss", "lr", "grad_norm", "throughput"):
        assert (tmp_path / "out" / f"{name}.png").read_bytes()[:8] == PNG
    assert capsys.readouterr().out.count("wrote ") == 4
    plot.main([str(run)])  # default: RUN_DIR/plots
    assert (run / "plots" / "loss.png").is_file()


def test_a_torn_line_is_skipped_and_a_resumed_run_s_last_attempt_drawn(tmp_path, capsys):
    """Steps 1-6 logged, a crash tore step 7's line, the run resumed from its step-4 checkpoint and logged 5-10:
    the curve is steps 1-4 of the first attempt and 5-10 of the second, once each, and the torn line is named."""
    first, second = records(6), [{**r, "loss": 9.0} for r in records(10)[4:]]
    run = write_run(tmp_path / "run", first, extra='{"step": 7, "loss": 1.\n' + "".join(
        json.dumps(r) + "\n" for r in second))
    with open(run / "metrics.jsonl", "ab") as f:  # and a line of bytes that are not UTF-8 (a damaged block)
        f.write(b'{"step": 11, "loss": \xff\xfe\n')
    drawn = plot.load_metrics(run)
    assert [r["step"] for r in drawn] == list(range(1, 11)) and drawn[:4] == first[:4] and drawn[4:] == second
    assert "skipped 2 line(s) that are not JSON (torn by a crash?): line 7, 14" in capsys.readouterr().err
    train = plot.plot_metrics(drawn)["loss"].axes[0].get_lines()[0]
    assert list(train.get_xdata()) == list(range(1, 11)) and list(train.get_ydata())[4:] == [9.0] * 6
    assert plot.main([str(run)]) == 0


def test_a_run_s_metrics_file_or_a_dir_of_runs_names_its_run(tmp_path, capsys):
    """`megalm-plot RUN_DIR/metrics.jsonl` was refused as no directory, and `megalm-plot outputs/` (where a bare
    megalm-train writes DATE/TIME run dirs) found no metrics: the file's run, and the newest run of a dir of runs,
    named on stderr as megalm-generate names the checkpoint it resolved to."""
    older = write_run(tmp_path / "outputs" / "2026-12-05" / "10-00-00", records())
    newer = write_run(tmp_path / "outputs" / "2026-12-06" / "09-00-00", records())
    os.utime(older / "metrics.jsonl", (1, 1))
    assert plot.main([str(tmp_path / "outputs")]) == 0
    assert f"megalm-plot: plotting {newer}" in capsys.readouterr().err
    assert (newer / "plots" / "loss.png").is_file() and not (older / "plots").exists()
    assert plot.main([str(older / "metrics.jsonl")]) == 0
    assert (older / "plots" / "loss.png").is_file() and f"plotting {older}" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("mine")
    assert "is a file; pass the run dir" in one_line_error(capsys, lambda: plot.main([str(tmp_path / "notes.txt")]))


def test_cli_one_line_errors(tmp_path, capsys):
    err = one_line_error(capsys, lambda: plot.main([str(tmp_path / "nope")]))
    assert "nope" in err and "does not exist" in err
    (tmp_path / "empty_dir").mkdir()
    assert "metrics.jsonl not found" in one_line_error(capsys, lambda: plot.main([str(tmp_path / "empty_dir")]))
    write_run(tmp_path / "empty", [], extra="\n")
    assert "is empty" in one_line_error(capsys, lambda: plot.main([str(tmp_path / "empty")]))
    write_run(tmp_path / "torn", [], extra='{"step": 3, "loss": 1.\n')
    assert "is empty" in one_line_error(capsys, lambda: plot.main([str(tmp_path / "torn")]))
    write_run(tmp_path / "steps_only", [], extra='{"step": 1}\n{"step": 2}\n')  # it drew nothing and exited 0
    assert "has steps but no loss" in one_line_error(capsys, lambda: plot.main([str(tmp_path / "steps_only")]))
    write_run(tmp_path / "nostep", records(1), extra='{"loss": 1.0}\n')
    assert "line 2 is not a metrics record" in one_line_error(capsys, lambda: plot.main([str(tmp_path / "nostep")]))
    (tmp_path / "notes.txt").write_text("mine")
    good = write_run(tmp_path / "good", records())
    err = one_line_error(capsys, lambda: plot.main([str(good), "--out", str(tmp_path / "notes.txt" / "plots")]))
    assert err == f"error: Not a directory: {tmp_path / 'notes.txt' / 'plots'}; choose a path this user can write to"
    err = one_line_error(capsys, lambda: plot.main([str(good), "--out", str(tmp_path / "notes.txt")]))
    assert "is a file" in err and (tmp_path / "notes.txt").read_text() == "mine"


def test_charts_replace_only_charts_megalm_drew(tmp_path, capsys):
    """A re-run refreshes its own PNGs; any other file at an output path stays as it was, and then nothing of the
    run is written (all or none), with a one-line error; writes leave no partial file behind."""
    run = write_run(tmp_path / "run", records())
    out = tmp_path / "out"
    assert plot.main([str(run), "--out", str(out)]) == 0
    first = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    assert all(plot.written_here(out / name) for name in first)
    assert plot.main([str(run), "--out", str(out)]) == 0  # its own charts: replaced
    assert sorted(f.name for f in out.iterdir()) == sorted(first)  # no partial files left
    capsys.readouterr()

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "lr.png").write_bytes(PNG + b"a user's chart")
    (mine / "grad_norm.png").write_text("not even a PNG")
    err = one_line_error(capsys, lambda: plot.main([str(run), "--out", str(mine)]))
    assert "lr.png exists and is not a chart megalm drew" in err
    assert sorted(f.name for f in mine.iterdir()) == ["grad_norm.png", "lr.png"]  # loss.png not written either
    assert (mine / "lr.png").read_bytes() == PNG + b"a user's chart"
    assert (mine / "grad_norm.png").read_text() == "not even a PNG"

    from matplotlib.figure import Figure

    Figure().savefig(mine / "loss.png")  # a matplotlib PNG, not megalm's
    assert not plot.written_here(mine / "loss.png")
    schedule = ["schedule", "--pp", "2", "--microbatches", "2", "--out"]
    err = one_line_error(capsys, lambda: plot.main([*schedule, str(mine / "loss.png")]))
    assert "loss.png exists and is not a chart megalm drew" in err
    assert plot.main([*schedule, str(out / "loss.png")]) == 0  # a chart megalm drew: replaced


def test_a_file_that_appears_while_the_chart_is_drawn_is_kept(tmp_path, monkeypatch):
    """The check comes before the drawing; a file written at the path in between is not replaced either."""
    from matplotlib.figure import Figure

    target = tmp_path / "loss.png"
    draw = Figure.savefig

    def savefig_while_the_user_writes(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        target.write_text("written meanwhile")
        return draw(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig_while_the_user_writes)
    with pytest.raises(plot.PlotError, match="appeared while the chart was drawn"):
        plot.save_figure(plot.new_figure(1, 1), target)
    assert target.read_text() == "written meanwhile" and [f.name for f in tmp_path.iterdir()] == ["loss.png"]


def test_a_chart_is_written_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    """vfat, exFAT, SMB and FUSE object stores refuse os.link: no chart was written, and the error blamed write
    permission (an audit, 2026-12-04). The name is claimed with O_EXCL there; a file that appears meanwhile is kept."""
    import errno
    import os

    def no_links(src, dst):  # noqa: ANN001, ANN202
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    written = plot.save_figure(plot.new_figure(1, 1), tmp_path / "loss.png")
    assert written.read_bytes().startswith(b"\x89PNG") and [f.name for f in tmp_path.iterdir()] == ["loss.png"]
    (tmp_path / "users.png").write_text("theirs")
    from megalm.plot import figures

    with pytest.raises(FileExistsError):
        figures._place_new(written, tmp_path / "users.png")
    assert (tmp_path / "users.png").read_text() == "theirs"


def test_hdp_tools_refuse_to_replace_a_users_file_before_planning(tmp_path, capsys):
    hdp_sim = _load_tool("hdp_sim")
    lengths = tmp_path / "lengths.json"
    lengths.write_text("[100, 200]")
    (tmp_path / "hdp.png").write_text("mine")
    refused = "hdp.png exists and is not a chart megalm drew"
    with pytest.raises(SystemExit) as e:
        hdp_sim.main(["--ranks", "4", "--context", "8K", "--lengths", str(lengths), "--png-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and err.startswith("error: ") and refused in err and "static" not in out
    assert sorted(f.name for f in tmp_path.glob("*.png")) == ["hdp.png"]
    with pytest.raises(SystemExit) as e:
        _load_tool("hdp_plan").main(["--png", str(tmp_path / "hdp.png"), "parallel.hdp=true"])
    assert e.value.code == 2 and refused in capsys.readouterr().err
    assert (tmp_path / "hdp.png").read_text() == "mine"
    with pytest.raises(SystemExit):  # the ablation draws nothing: a --png-dir beside it is a mistake, said
        hdp_sim.main(["--ablation", "--png-dir", str(tmp_path)])
    assert "and prints a table; --png-dir would not be read: drop it" in capsys.readouterr().err


def test_committed_charts_are_marked_as_megalms():
    """The docs' PNGs are redrawn by their documented commands, which replace only charts megalm drew."""
    charts = sorted((ROOT / "docs").rglob("*.png"))
    assert charts and [c for c in charts if not plot.written_here(c)] == []


def test_missing_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", records(2))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    err = one_line_error(capsys, lambda: plot.main([str(run)]))
    assert err == f"error: {plot.INSTALL_HINT}"
    err = one_line_error(capsys, lambda: plot.main(["schedule", "--out", str(tmp_path / "s.png")]))
    assert err == f"error: {plot.INSTALL_HINT}"
    with pytest.raises(plot.PlotError, match="pip install 'megalm\\[plots\\]'"):
        plot.new_figure(1, 1)
    assert not (run / "plots").exists()
    hdp_sim = _load_tool("hdp_sim")
    lengths = tmp_path / "lengths.json"
    lengths.write_text("[100, 200]")
    with pytest.raises(SystemExit) as e:  # before simulating
        hdp_sim.main(["--ranks", "4", "--context", "8K", "--lengths", str(lengths), "--png-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and err.startswith("error: plotting needs matplotlib") and "static" not in out
    assert not list(tmp_path.glob("*.png"))
    with pytest.raises(SystemExit) as e:  # before composing the config
        _load_tool("hdp_plan").main(["--png", str(tmp_path / "plan.png"), "parallel.hdp=true"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: plotting needs matplotlib")


# ---------------------------------------------------------------------------------------------
# pipeline schedules


def test_schedule_timeline_bars_and_legend():
    p, m = 4, 8
    fig = plot.plot_schedule(with_comm(one_f_one_b(p, m)))
    ax = fig.axes[0]
    assert bars(ax) == {"F forward": p * m, "B backward (full)": p * m}
    labels = legend_texts(ax)
    assert labels[:2] == ["SEND activations", "RECV activations"] and "SEND gradients" in labels
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(p)]
    assert ax.get_ylabel() == "pipeline rank" and "time" in ax.get_xlabel()
    assert "makespan 33" in ax.get_title() and "bubble 27.3%" in ax.get_title()
    sends = next(c for c in ax.collections if c.get_label() == "SEND activations")
    assert len(sends.get_offsets()) == (p - 1) * m  # every rank but the last sends each micro-batch forward

    ax = plot.plot_schedule(zb_h1(p, m)).axes[0]
    assert bars(ax) == {"F forward": p * m, "B input-grad backward": p * m, "W weight-grad backward": p * m}
    assert not ax.collections  # no communication actions in the bare schedule

    ax = plot.plot_schedule(interleaved_1f1b(p, m, 2), 0.5, 0.5, 0.5).axes[0]
    assert bars(ax) == {f"{k}, chunk {c}": p * m for k in ("F forward", "B backward (full)") for c in (0, 1)}


def test_schedule_events_sit_on_the_compute_timeline():
    from megalm.parallel.pipeline.schedules import simulate_schedule

    sched = with_comm(one_f_one_b(2, 2))
    events = plot.schedule_events(sched, simulate_schedule(sched, 1, 1, 1).timeline)
    # 1F1B, p = 2, m = 2, F = 1, B = 2: rank 0 runs F0 [0, 1], F1 [1, 2], B0 [4, 6], B1 [7, 9];
    # rank 1 runs F0 [1, 2], B0 [2, 4], F1 [4, 5], B1 [5, 7]
    assert [(a.kind, a.micro_batch, t) for a, t in events[0]] == [("SEND_F", 0, 1.0), ("SEND_F", 1, 2.0),
                                                                  ("RECV_B", 0, 4.0), ("RECV_B", 1, 7.0)]
    assert [(a.kind, a.micro_batch, t) for a, t in events[1]] == [("RECV_F", 0, 1.0), ("SEND_B", 0, 4.0),
                                                                  ("RECV_F", 1, 4.0), ("SEND_B", 1, 7.0)]


def test_schedule_with_offload_marks_offload_and_reload():
    sched = plot.build_plotted_schedule("1f1b", 4, 8, offload=0.5, offload_policy="uniform")
    n_off = sum(a.kind == "OFFLOAD" for acts in sched.actions for a in acts)
    assert n_off > 0
    ax = plot.plot_schedule(sched).axes[0]
    counts = {c.get_label(): len(c.get_offsets()) for c in ax.collections}
    assert counts["OFFLOAD to host"] == n_off and counts["RELOAD from host"] == n_off
    assert {"OFFLOAD to host", "RELOAD from host"} <= set(legend_texts(ax))


@pytest.mark.parametrize("name, pp, m, vpp", [("1f1b", 2, 3, 1), ("1f1b", 4, 8, 1), ("zb", 3, 5, 1),
                                               ("interleaved", 2, 4, 2)])
@pytest.mark.parametrize("policy", ["lifespan", "uniform"])
def test_schedule_offloads_what_the_runtime_offloads(name, pp, m, vpp, policy):
    """The runtime picks what to offload on the action list with its SEND/RECV actions (where the lifespan policy's
    greedy peak cut sees them); the plot picked on the list without, and drew another choice (1f1b p=2 m=3: rank 0
    offloaded micro-batches 0, 1 where the runtime offloads 1, 2; 63 of 516 cases differed)."""
    from megalm.offload.policy import select_pipeline
    from megalm.parallel.pipeline.rendezvous import with_comm
    from megalm.parallel.pipeline.schedules import build_schedule, simulate_schedule

    run = with_comm(build_schedule(name, pp, m, vpp))
    expected = run.with_offload(select_pipeline(run, simulate_schedule(run).timeline, policy, 0.5)).actions
    assert plot.build_plotted_schedule(name, pp, m, vpp, offload=0.5, offload_policy=policy).actions == expected


def test_schedule_cli(tmp_path, capsys):
    out = tmp_path / "deep" / "zb.png"
    assert plot.main(["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "zb", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    err = one_line_error(capsys, lambda: plot.main(["schedule", "--schedule", "interleaved", "--pp", "4",
                                                    "--microbatches", "6", "--out", str(tmp_path / "x.png")]))
    assert "multiple of the number of pipeline stages" in err
    err = one_line_error(capsys, lambda: plot.main(["schedule", "--offload", "2", "--out", str(tmp_path / "y.png")]))
    assert "--offload 2 is a fraction" in err and not (tmp_path / "y.png").exists()
    # a PDF name got PNG bytes without a word (an audit, 2026-12-06)
    err = one_line_error(capsys, lambda: plot.main(["schedule", "--out", str(tmp_path / "s.pdf")]))
    assert err == f"error: {tmp_path / 's.pdf'}: megalm draws PNG charts; name the file *.png"
    assert not (tmp_path / "s.pdf").exists()


# ---------------------------------------------------------------------------------------------
# HDP plans


@pytest.fixture(scope="module")
def hdp_plans():
    cost = load_cost("7b")
    lengths = [120, 900, 2000, 3000, 9000, 20000, 30000, 500, 700, 6000, 4000, 8000] * 3
    ranks, capacity = 16, 8192
    plans = {"static": plan_static(lengths, ranks, capacity, 32768, cost),
             "hdp": plan_hdp(lengths, ranks, capacity, cost)}
    return {k: (plan, simulate(plan, cost)) for k, plan in plans.items()}


def polys(ax) -> dict[str, int]:
    return {c.get_label(): len(c.get_paths()) for c in ax.collections if c.get_label()}


def test_hdp_gantt_draws_every_micro_batch_of_the_shown_ranks(hdp_plans):
    plan, sim = hdp_plans["hdp"]
    fig = plot.plot_hdp_plan(plan, sim, title="hdp test")
    gantt, side = fig.axes[:2]
    single = sum(len(plan.micro_batches[k].ranks) == 1 for t in sim.timeline for *_, k in t)
    ringed = sum(len(plan.micro_batches[k].ranks) > 1 and bool(plan.micro_batches[k].seqs)
                 for t in sim.timeline for *_, k in t)
    counts = polys(gantt)
    assert counts["packed micro-batch"] == single and counts["ring micro-batch"] == ringed and ringed > 0
    assert fig.get_suptitle() == "hdp test"
    assert "time in the step" in gantt.get_xlabel() and gantt.get_ylabel() == "HDP rank (16 ranks)"
    assert "ring micro-batch (colour: ring size)" in legend_texts(gantt)
    assert bars(side) == {"compute": 16, "exposed comm": 16, "idle, fill/drain": 16}
    assert any(a.get_ylabel() == "ring size (ranks)" for a in fig.axes)  # the colour bar


def test_hdp_gantt_samples_rows_and_says_so(hdp_plans):
    plan, sim = hdp_plans["static"]
    fig = plot.plot_hdp_plan(plan, sim, title="static", max_rows=4)
    gantt, side = fig.axes[:2]
    assert plot.hdp_rows(16, 4) == [0, 4, 8, 12]
    assert fig.get_suptitle() == "static (4 of 16 ranks drawn)" and "every 4th of 16" in gantt.get_ylabel()
    assert bars(side)["compute"] == 4
    shown = sum(len(sim.timeline[r]) for r in (0, 4, 8, 12))
    counts = polys(gantt)
    assert counts["packed micro-batch"] + counts["ring micro-batch"] == shown


def test_hdp_balance_histogram(hdp_plans):
    fig = plot.plot_hdp_balance({k: s for k, (_, s) in hdp_plans.items()}, "balance test")
    ax = fig.axes[0]
    labels = legend_texts(ax)
    assert len(labels) == 2 and labels[0].startswith("static: step") and labels[1].startswith("hdp: step")
    assert ax.get_ylabel() == "ranks" and "busy time per rank" in ax.get_xlabel() and ax.get_title() == "balance test"
    assert len(ax.patches) == 2 and len(ax.get_lines()) == 2  # one outline and one step-time line per policy
    counts = sum(ax.patches[0].get_xy()[1::2, 1])  # a step histogram's outline visits each bin's top once
    assert counts == pytest.approx(16)


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hdp_sim_has_no_hand_written_png_writer():
    hdp_sim = _load_tool("hdp_sim")
    assert not any(hasattr(hdp_sim, name) for name in ("write_png", "draw_text", "FONT"))
    source = (ROOT / "tools" / "hdp_sim.py").read_text() + (ROOT / "tools" / "hdp_plan.py").read_text()
    assert "zlib" not in source and "import matplotlib" not in source  # drawing lives in megalm.plot
