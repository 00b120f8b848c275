"""The documented commands, checked in seconds for what the long test (tests/e2e/test_docs_commands.py, which runs
them all) would otherwise find only after minutes: each one is classified (a rule runs it, or it is a pattern), and
every training run's overrides parse in Hydra's grammar (an ellipsis or a stray word is no override: CI's stop 64
failed on `python -m megalm.train ...` in prose, 40 minutes into its long tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

from tests.docs_pages import DOCS
from tests.e2e.test_docs_commands import checked_without_running, documented_commands, is_pattern, runnable

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


def test_the_check_fails_on_an_ellipsis():
    with pytest.raises(OverrideParseException):
        OverridesParser.create().parse_overrides(training_overrides(["python", "-m", "megalm.train", "..."]))
