"""tools/bench/zero_bubble_blocks.py: it times the ZB schedule's B and W on one device, eager and compiled, with the
compiled blocks whole (a row with graph breaks would time eager pieces), and says what its CPU rows are."""

from __future__ import annotations

from tests.conftest import TINY
from tools.bench import zero_bubble_blocks as bench


def test_it_times_whole_compiled_zero_bubble_blocks_beside_eager_ones(capsys):
    overrides = [o for o in TINY if o.startswith("model.")]
    report = bench.main([*overrides, "--iters", "1", "--warmup", "1", "--seqs", "2"])
    assert set(report["rows"]) == set(bench.ROWS) and report["backend"] == "aot_eager"
    assert all(row["ms"] > 0 for row in report["rows"].values())
    assert all(row["graph_breaks"] == 0 for row in report["rows"].values()), report
    out = capsys.readouterr().out
    assert "zb_compiled against zb_eager" in out and "its times are not a GPU's" in out
