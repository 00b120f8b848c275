"""The package structure holds: no import cycle (type-only imports included), no upward import between layers, a
trainer that does not know which layout runs, and every repo path the docs and the docstrings cite exists
(process-wide state: test_process_state.py)."""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megalm"

# Lowest first. A module may import its own top-level package and any lower layer; siblings on one layer
# (precision and parallel) may not import each other.
LAYERS = [
    {"megalm", "megalm.errors", "megalm.config", "megalm.compat", "megalm.measure"},
    {"megalm.data"},
    {"megalm.model"},
    {"megalm.offload"},
    {"megalm.precision", "megalm.parallel"},
    {"megalm.training"},
    {"megalm.train", "megalm.generate", "megalm.interop", "megalm.plot", "megalm.estimate"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def unit_of(module: str) -> str:
    """The layer unit a megalm module belongs to: megalm.<package> (or the module itself at the top)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def layer_of(module: str) -> int:
    unit = unit_of(module)
    return next(i for i, units in enumerate(LAYERS) if unit in units)


def imports_of(module: str, type_only_too: bool = False) -> list[tuple[str, int]]:
    """(imported megalm module, line) for every import in `module`, at any depth (function-local too), but
    for those under `if TYPE_CHECKING:` unless `type_only_too`. `from a.b import c` counts as importing a.b.c
    when that is a module, else a.b."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                 for n in ast.walk(block)}  # annotations only: never imported at run time
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only and not type_only_too:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.startswith("megalm")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import: up from this module's package
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if not base.startswith("megalm"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in MODULES else base, node.lineno))
    return found


@functools.cache
def import_graph() -> dict[str, list[tuple[str, int]]]:
    """Every megalm module's imports: parsed when a test first asks (1.5 s), not by every pytest worker that collects
    this file."""
    return {module: imports_of(module) for module in MODULES}


def test_every_megalm_import_resolves_to_a_module():
    missing = [f"{m}:{line} imports {target}" for m, edges in import_graph().items() for target, line in edges
               if target not in MODULES]
    assert not missing, missing


def test_no_upward_import_between_layers():
    bad = []
    for module, edges in import_graph().items():
        for target, line in edges:
            if target not in MODULES or unit_of(target) == unit_of(module):
                continue
            if layer_of(target) > layer_of(module) or (layer_of(target) == layer_of(module) and layer_of(module)):
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {module} ({unit_of(module)}) imports "
                           f"{target} ({unit_of(target)})")
    assert not bad, "imports against the layers data -> model -> precision/parallel -> training -> CLI:\n" + \
        "\n".join(bad)


def find_cycle(graph: dict[str, list[tuple[str, int]]]) -> list[str] | None:
    """An import cycle of `graph` (module -> [(imported module, line)]), as the modules on it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target, _ in graph.get(module, []):
            if target not in MODULES or target == module:
                continue
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if state.get(target) is None:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[module] = 2
        return None

    for module in MODULES:
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_through_type_only_imports():
    """A cycle through `if TYPE_CHECKING:` imports runs, but says two modules are one: split what both need
    into a module of its own (as pipeline/actions.py holds what schedules.py and rendezvous.py share)."""
    cycle = find_cycle({module: imports_of(module, type_only_too=True) for module in MODULES})
    assert cycle is None, "import cycle (type-only imports included): " + " -> ".join(cycle)


def test_the_trainer_does_not_know_the_layout():
    """The trainer talks to the Parallelism object only (plus the mesh type and the step's share)."""
    allowed = {"megalm.parallel.parallelism", "megalm.parallel.dims", "megalm.parallel.microbatch"}
    used = {t for t, _ in import_graph()["megalm.training.trainer"] if t.startswith("megalm.parallel")}
    assert used <= allowed, f"the trainer imports parallel internals: {sorted(used - allowed)}"
    source = MODULES["megalm.training.trainer"].read_text()
    for word in ("hdp", "pipeline", "zero1", "sequence_parallel", "cp_rank", "pp_rank"):
        assert not re.search(rf"\b(if|elif)\b[^\n]*{word}", source), f"the trainer branches on {word}"
    assert len(source.splitlines()) <= 300


def test_parallel_subpackages_do_not_import_the_composition():
    """Each parallelism is readable alone: only the composition (parallelism.py) imports it, not the reverse."""
    bad = [f"{m} imports {t}" for m, edges in import_graph().items() for t, _ in edges
           if m.startswith("megalm.parallel.") and m != "megalm.parallel.parallelism"
           and t == "megalm.parallel.parallelism"]
    assert not bad, bad


# ------------------------------------------------------------------------------------------ cited paths

PATH = re.compile(r"(?<![\w/.-])((?:megalm|docs|tools|configs|scripts|tests|\.ci)/[\w./-]*\w|"
                  r"(?:parallel|precision|training|model|data)/[\w./-]*\.(?:py|md))")
DOTTED = re.compile(r"(?<![\w.])(megalm(?:\.\w+)+)")


def cited_texts() -> list[tuple[Path, str]]:
    """README and docs/, the READMEs under tools/, and the docstrings and comments of megalm/, tools/ and tests/."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "tools").rglob("*.md"))]
    texts = [(p, p.read_text()) for p in docs]
    sources = [*MODULES.values(), *sorted((ROOT / "tools").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]
    for path in sources:
        tree = ast.parse(path.read_text())
        texts += [(path, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)]
        texts += [(path, line) for line in path.read_text().splitlines() if line.strip().startswith("#")]
    return texts


def resolves(cited: str) -> bool:
    cited = cited.rstrip(".")
    if any(ch in cited for ch in "*{<") or "XXXX" in cited:
        return True  # a pattern, not a path
    return any((base / cited).exists() for base in (ROOT, PACKAGE))


def test_every_cited_repo_path_exists():
    missing = sorted({f"{where.relative_to(ROOT)}: {m}" for where, text in cited_texts()
                      for m in PATH.findall(text) if not resolves(m)})
    assert not missing, "repo paths cited in the docs or in docstrings that do not exist:\n" + "\n".join(missing)


def dotted_resolves(name: str) -> bool:
    """A dotted megalm name is a module, or an attribute of the longest module prefix it starts with."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        if module in MODULES:
            if end == len(parts):
                return True
            return hasattr(importlib.import_module(module), parts[end])
    return False


def test_every_cited_megalm_name_exists():
    missing = sorted({f"{where.relative_to(ROOT)}: {m}" for where, text in cited_texts()
                      for m in DOTTED.findall(text) if not dotted_resolves(m)})
    assert not missing, "megalm names cited in the docs or in docstrings that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_docstring_cites_a_file_outside_the_repo(module):
    text = MODULES[module].read_text()
    assert "DESIGN.md" not in text and "../shared" not in text and "/work/shared" not in text, module


def _test_imports(path: Path) -> set[str]:
    """The megalm modules a test file imports (a `from` import of a submodule counts the submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megalm"):
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                      for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("megalm")}
    return found


def test_the_extra_torch_legs_cover_every_module_that_goes_through_compat():
    """.ci/torch_leg_tests.txt (the unit subset the floor and GPU-image torch legs run) imports, directly or through
    at most two modules in between (a package's __init__ and its layer module), every megalm module that calls
    megalm.compat: an API that differs by torch version."""
    listed = [ROOT / line.strip().partition("::")[0]  # a file, or one test of it (file::test[id])
              for line in (ROOT / ".ci" / "torch_leg_tests.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert all(path.exists() for path in listed), [str(p) for p in listed if not p.exists()]
    reached = set()
    for path in listed:
        frontier = _test_imports(path)
        for _ in range(3):
            reached |= frontier
            frontier = {target for module in frontier for target, _ in import_graph().get(module, [])} - reached
    users = {module for module, edges in import_graph().items() if any(t == "megalm.compat" for t, _ in edges)}
    assert users, "nothing imports megalm.compat?"
    assert users <= reached, f"not reached by .ci/torch_leg_tests.txt: {sorted(users - reached)}"


def test_no_doc_or_code_speaks_of_issue_numbers():
    """Docs, docstrings and comments say what is measured, on what, and what is not yet: not which issue or session
    did it (a reader has neither)."""
    pattern = re.compile(r"\b(issue|issues) #?\d+|\(issue \d|\bsession that built", re.I)
    paths = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *PACKAGE.rglob("*.py"),
             *(ROOT / "tests").rglob("*.py"), *(ROOT / "tools").rglob("*.py"), *(ROOT / "configs").rglob("*.yaml")]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for path in paths if path != Path(__file__)
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


IMPORT_REGISTERS_NOTHING = """
import importlib, json, pkgutil
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks
from hydra.core.config_store import ConfigStore
import megalm
for info in pkgutil.walk_packages(megalm.__path__, "megalm."):
    importlib.import_module(info.name)
hooks = {name: len(getattr(owner, name)) for owner in (module_hooks, optimizer_hooks) for name in dir(owner)
         if name.startswith("_global") and name.endswith("hooks") and getattr(owner, name)}
print(json.dumps({"hooks": hooks, "config_store": sorted(ConfigStore.instance().repo)}))
"""


def test_importing_megalm_registers_nothing_globally():
    """Importing every megalm module installs no hook on all of torch (module or optimizer hooks) and registers
    nothing in Hydra's ConfigStore: the CLIs register their schema when they run."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", IMPORT_REGISTERS_NOTHING], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["hooks"] == {}, found["hooks"]
    assert "megalm_schema.yaml" not in found["config_store"], found["config_store"]


def test_architecture_doc_shows_the_protocols_as_they_are():
    """docs/architecture.md's block of the typed seams names each Protocol's members and implementers as the code
    has them: a renamed method or a new implementer shows up here."""
    import importlib
    import inspect
    from typing import Protocol

    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"## The seams, typed.*?```python\n(.*?)```", text, re.S).group(1)
    documented = dict(re.findall(r"class (\w+)\(Protocol\):\s+# (.+)", block))
    members = {name: set(re.findall(r"def (\w+)\(|^    (\w+):", body, re.M))
               for name, body in re.findall(r"class (\w+)\(Protocol\):.*?\n((?:    .*\n)+)", block)}
    protocols = {}
    for module in ("megalm.parallel.runner", "megalm.parallel.parallelism"):
        for name, cls in vars(importlib.import_module(module)).items():
            if inspect.isclass(cls) and Protocol in cls.__mro__[1:] and cls.__module__ == module:
                protocols[name] = cls
    assert set(documented) == set(protocols), (sorted(documented), sorted(protocols))
    for name, cls in protocols.items():
        own = {m for m in vars(cls) if not m.startswith("_")} | set(getattr(cls, "__annotations__", {}))
        doc_members = {a or b for a, b in members[name]}
        assert doc_members == own, (name, sorted(doc_members), sorted(own))
        for implementer in re.findall(r"[A-Z]\w+", documented[name]):
            classes = [getattr(module, implementer) for module in map(importlib.import_module, MODULES)
                       if module.__name__.startswith(("megalm.parallel", "megalm.precision"))
                       and not module.__name__.startswith("megalm.precision.kernels")
                       and inspect.isclass(getattr(module, implementer, None))]
            assert classes, f"{implementer} (documented as a {name}) is not a megalm class"
            methods = [m for m in own if callable(getattr(cls, m, None))]
            assert all(callable(getattr(classes[0], m, None)) for m in methods), (implementer, methods)


def test_long_cases_name_default_tests_that_the_torch_legs_do_not_run():
    """tests/long_cases.txt moves default-suite cases to the long run: each names a test function (and a
    parametrization id) that exists, and none is one the torch legs run (they run without the long tests, so it
    would silently leave them)."""
    from tests.conftest import long_cases

    legs = [line.strip() for line in (ROOT / ".ci" / "torch_leg_tests.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    for case in sorted(long_cases()):
        path, name = case.split("::")
        function, _, param = name.partition("[")
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {function}\(", source, re.M), f"{case}: no test {function} in {path}"
        assert not param or f'"{param[:-1]}"' in source or f"'{param[:-1]}'" in source, f"{case}: no id {param}"
        assert not {path, f"{path}::{function}", case} & set(legs), f"{case} is in .ci/torch_leg_tests.txt"


def test_the_long_tests_left_to_the_hand_name_long_tests(collected_tests):
    """.ci/long_tests_by_hand.txt (the long tests CI's run leaves out, for its hour) names, line by line, a node id or a
    prefix of one that selects at least one long test: a renamed test would otherwise run nowhere but by hand."""
    text = (ROOT / ".ci" / "long_tests_by_hand.txt").read_text()
    entries = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert entries
    files = sorted({entry.split("::")[0] for entry in entries})
    assert all((ROOT / f).is_file() for f in files), [f for f in files if not (ROOT / f).is_file()]
    def selects(entry: str, nodes: list[str]) -> bool:
        return any(node == entry or node.startswith((entry + "::", entry + "[")) for node in nodes)

    # this session's own collection first (the default run's reads every file: a pytest of its own took 25 s); what it
    # did not select (a run of a few node ids, `--lf`) is collected apart
    unmatched = [e for e in entries if not selects(e, [node for node, slow in collected_tests if slow])]
    if unmatched:
        collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow",
                                    "-p", "no:cacheprovider", *sorted({e.split("::")[0] for e in unmatched})],
                                   cwd=ROOT, capture_output=True, text=True, timeout=300).stdout.splitlines()
        for entry in unmatched:
            assert selects(entry, collected), f"{entry} selects no long test"


def test_no_pipefail_script_pipes_into_a_reader_that_quits_early():
    """Under `set -o pipefail` a writer killed by SIGPIPE is the pipeline's failure (exit 141): `head`, `grep -q`,
    `grep -m N` or `sed Nq` quits early, and whether the writer was still writing is a race. CI once failed that way
    after every test had passed. Read to the end instead (`sed -n '1,Np'`), or say `|| true`. Every shell file counts,
    since a sourced library (scripts/slurm/lib.sh) runs under its caller's pipefail."""
    scripts = [ROOT / ".ci" / "run", *ROOT.glob(".ci/*.sh"), *ROOT.glob("tools/**/*.sh"), *ROOT.glob("scripts/**/*.sh"),
               *ROOT.glob("scripts/**/*.sbatch")]
    quits_early = re.compile(r"\|\s*(head\b|grep\s+(-\w*[qm]|--quiet|--max-count)|sed\s+(-n\s+)?'?\d+q)")
    offenders = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
                 for path in scripts for n, line in enumerate(path.read_text().splitlines(), 1)
                 if quits_early.search(line) and not line.lstrip().startswith("#")
                 and not re.search(r"\|\|\s*(true|:)\b", line)]
    assert not offenders, "a pipe into a reader that quits early, under pipefail:\n" + "\n".join(offenders)
