"""Every relative link in README.md and docs/*.md reaches a file of the repository, and every `#anchor` a heading of
the page it names (GitHub's slugs: lower case, punctuation dropped, spaces to hyphens, a repeated heading's slug
numbered -1, -2, ...). A renamed heading or a moved file breaks the links to it silently otherwise; the docs'
commands are run by tests/e2e/test_docs_commands.py."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from tests.docs_pages import DOCS, ROOT, prose

LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of `page`."""
    seen: Counter[str] = Counter()
    out = set()
    for heading in re.findall(r"^#{1,6} (.*)$", prose(page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return out


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {_name(linked)}")
    return broken


def test_every_relative_link_of_the_docs_resolves():
    broken = {_name(page): b for page in DOCS if (b := broken_links(page))}
    assert not broken, broken


def test_a_renamed_heading_and_a_missing_file_are_caught(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Its part\n\n## Its part\n\n"
                    "See [the part](#its-part-1) and [the other](#its-other).\n"
                    "```bash\n# not a heading\n[nor](a-link.md)\n```\n[a file](missing.md), [the web](https://x.org)\n")
    assert anchors(page) == {"title", "its-part", "its-part-1"}
    assert broken_links(page) == ["#its-other: no heading with that anchor in page.md", "missing.md: no such file"]


def _presets_after(text: str, lead: str) -> set[str]:
    """The backticked names in the sentence or table cell that starts with `lead`."""
    start = text.index(lead)
    end = min(i for i in (text.find(". ", start), text.find(" | ", start + len(lead) + 1)) if i > 0)
    return set(re.findall(r"`([\w.]+)`", text[start:end]))


def test_the_model_presets_the_docs_list_are_configs_model():
    """README's list of model presets and the guide's `model` row name exactly the files of configs/model/: a new
    preset, or one removed, shows up here (both lists had fallen behind)."""
    presets = {p.stem for p in (ROOT / "configs" / "model").glob("*.yaml")}
    readme = (ROOT / "README.md").read_text()
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert _presets_after(readme, "Model presets (`configs/model/`):") - {"configs"} == presets
    row = next(line for line in guide.splitlines() if line.startswith("| `model` |"))
    assert set(re.findall(r"`([\w.]+)`", row.split(" | ")[1])) == presets


def test_the_readme_layout_names_every_package_and_page():
    """README's Layout block names each megalm sub-package and each page of docs/ (it had lost config/, estimate/,
    measure/ and two pages)."""
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    packages = {p.name for p in (ROOT / "megalm").iterdir() if (p / "__init__.py").is_file()}
    packages |= {p.name for p in (ROOT / "megalm" / "parallel").iterdir() if (p / "__init__.py").is_file()}
    missing = sorted(name for name in packages if f"{name}/" not in layout)
    missing += sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name not in layout)
    assert not missing, f"README's Layout does not name: {missing}"
