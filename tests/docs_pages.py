"""The pages a user reads (README.md and docs/*.md) and their prose, for the tests that check them: the documented
commands run (tests/e2e/test_docs_commands.py) and the links resolve (tests/unit/test_docs_links.py)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """A page without its fenced code blocks (a `# comment` there is no heading, a `](x)` no link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
