"""The documented commands, checked in seconds for what the long test (tests/e2e/test_docs_commands.py, which runs
them all) would otherwise find only after minutes: each one is classified (a rule runs it, or it is a pattern), and
every training run's overrides parse in Hydra's grammar (an ellipsis or a stray word is no override: CI's stop 64
failed on `python -m megalm.train ...` in prose, 40 minutes into its long tests); and the variants, which
CI's run of the long test does not run (`variants`: an earlier command ran the same tool with the same flags), compose
into a config megalm's schema accepts, and a torchrun variant's layout passes validation at its world size."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

from tests.conftest import compose_config
from tests.docs_pages import DOCS, ROOT, prose
from tests.e2e.test_docs_commands import (
    INLINE_COMMAND,
    checked_without_running,
    documented_commands,
    hydra_overrides,
    is_pattern,
    runnable,
    variant_shape,
    variants,
)

HYDRA_VALUED_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp",
                      "--config-dir", "-cd", "--info", "-i"}


def training_overrides(argv: list[str]) -> list[str]:
    """The words after `-m megalm.train` (torchrun's included) that are neither Hydra's flags nor their values: Hydra
    reads each as an override."""
    if "megalm.train" not in argv:
        return []
    words = argv[argv.index("megalm.train") + 1:]
    return [w for i, w in enumerate(words)
            if not w.startswith("-") and (i == 0 or words[i - 1] not in HYDRA_VALUED_FLAGS)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_documented_command_has_a_rule_and_parses(doc: Path, tmp_path: Path):
    parser = OverridesParser.create()
    for command in documented_commands(doc):
        if is_pattern(command):
            continue
        spec = None if checked_without_running(command) else runnable(command, tmp_path)
        if spec is None:  # checked without running by the long test, or a set-up command
            continue
        overrides = training_overrides(spec[0])
        try:
            parser.parse_overrides(overrides)
        except Exception as err:  # hydra's OverrideParseException and the lexer's own
            pytest.fail(f"{doc.name}: `{command}`: its overrides do not parse ({type(err).__name__}): {err}")


def split_commands(text: str) -> list[str]:
    """Inline spans of prose that begin as a command but run over a line break: `documented_commands` reads spans
    within a line, so such a command would never run (a usage pattern, `is_pattern`, runs in none)."""
    spans = re.findall(r"`([^`]+)`", prose(text))  # backticks paired in order, as markdown pairs them
    return [span for span in spans if "\n" in span and re.match(INLINE_COMMAND, span)
            and not is_pattern(" ".join(span.split()))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_documented_command_is_split_over_two_lines(doc: Path):
    assert not split_commands(doc.read_text()), f"{doc.name}: put these commands on one line (or in a fenced block)"
    assert split_commands("a `python tools/bench/step_cost.py model=1.3b\n  seed=1` b")  # the check can fail


def test_the_check_fails_on_an_ellipsis():
    with pytest.raises(OverrideParseException):
        OverridesParser.create().parse_overrides(training_overrides(["python", "-m", "megalm.train", "..."]))


def nproc_per_node(words: list[str]) -> int:
    """torchrun's `--nproc-per-node N` (or `=N`, or its underscored spelling); 1, torchrun's default, without it."""
    for i, word in enumerate(words):
        flag, _, value = word.partition("=")
        if flag in ("--nproc-per-node", "--nproc_per_node"):
            return int(value or words[i + 1])
    return 1


@pytest.mark.parametrize("doc", [doc for doc in DOCS if doc.name in variants()], ids=lambda p: p.name)
def test_the_variants_ci_does_not_run_compose(doc: Path):
    from megalm.training.validation import validate_run

    for command in variants()[doc.name]:
        words = shlex.split(command)
        cfg = compose_config(*hydra_overrides(words), tiny=False)  # a bad key or value: ConfigError
        if words[0] == "torchrun":  # the layout at its world size, as each rank checks it first (ConfigError)
            validate_run(cfg, world_size=nproc_per_node(words))


def test_a_variant_is_an_earlier_command_s_tool_and_flags_with_other_overrides():
    shapes = {}
    for doc in DOCS:
        for command in documented_commands(doc):
            if (shape := variant_shape(command)) is not None:
                shapes.setdefault(shape, []).append((doc.name, command))
    later = {(doc, command) for doc, commands in variants().items() for command in commands}
    assert later == {run for runs in shapes.values() for run in runs[1:]}
    assert any("step_cost.py" in c and "precision=fp8_delayed" in c for _, c in later), \
        "a step-cost run at another precision is a variant of the first step-cost run"
    assert any(doc == "layouts.md" and "parallel.cp=4" in c for doc, c in later), "another layout of one estimate"
    first_256 = next(c for c in documented_commands(ROOT / "docs" / "benchmarks.md")
                     if c.startswith("megalm-estimate") and "--world 256" in c)
    assert ("benchmarks.md", first_256) not in later, "the first estimate of its shape runs in CI"
    sims = [variant_shape(f"python tools/hdp_sim.py --ranks 1024 --context {c} --lengths longtail --model 7b")
            for c in ("256K", "512K")]
    assert sims[0] != sims[1], "a flag's value is part of the shape"
    readme_torchruns = [c for c in documented_commands(ROOT / "README.md")
                        if c.startswith("torchrun --standalone --nproc-per-node 4 ")]
    assert ("README.md", readme_torchruns[0]) not in later, "the first four-rank training run runs in CI"
    assert {("README.md", c) for c in readme_torchruns[1:]} <= later, "other layouts on the same ranks are variants"
    named = next(c for c in documented_commands(ROOT / "docs" / "interop.md") if c.startswith("torchrun "))
    assert variant_shape(named) is None, "a run into a named directory, which a later command reads, is no variant"
    assert [nproc_per_node(shlex.split(f"torchrun {flags} -m megalm.train")) for flags in
            ("--standalone --nproc-per-node 4", "--nproc_per_node=2", "--standalone")] == [4, 2, 1]
