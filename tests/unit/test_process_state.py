"""No process-wide state in megalm: no module-level object mutated or rebound after import, no hook on all of
torch, no torch setting changed outside the places where the trainer applies its config at start; and importing
megalm registers nothing (test_structure.py's import test)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.unit.test_structure import MODULES, PACKAGE, ROOT

# Torch settings and handlers that hold for the whole process may change only where the trainer applies its
# config at start (and logs it), not behind the user's back from a library function or at import.
PROCESS_SETTINGS = re.compile(r"^(torch\.backends\.|torch\._dynamo\.config|torch\._inductor\.config)")
SETTING_CALLS = {"torch.set_num_threads", "torch.set_default_dtype", "torch.set_default_device",
                 "torch.use_deterministic_algorithms", "torch.set_float32_matmul_precision",
                 "warnings.filterwarnings", "warnings.simplefilter", "signal.signal", "torch._dynamo.reset",
                 "gc.disable", "gc.set_threshold", "gc.freeze"}
GLOBAL_TORCH_HOOK = re.compile(r"^register_(module|optimizer_step)_\w*hook$")  # torch's hooks on every module/optimizer
APPLIED_AT_START = {  # (file, function): where the trainer applies process-wide settings from its config
    ("megalm/training/trainer.py", "Trainer.__init__"): "trainer.num_threads",
    ("megalm/precision/__init__.py", "Precision.__init__"): "precision.tf32 on a GPU",
    ("megalm/training/preemption.py", "*"): "trainer.preempt_signals: handlers installed and restored by fit()",
    ("megalm/train.py", "requeue_on"): "megalm-train's process: trainer.preempt_signals requeue a run preempted "
                                       "before fit() (its entry point's own handlers, not a library's)",
    ("megalm/train.py", "stop_on_interrupt"): "megalm-train's process after Ctrl-C: SIGINT ignored while it exits "
                                              "(torchrun's own SIGINT to each worker printed a second traceback)",
    ("megalm/training/python_gc.py", "StepBoundaryGC.__enter__"): "trainer.gc_interval: Python's automatic "
                                                                  "collector off while fit() trains, on again after",
    ("megalm/parallel/hdp/planner.py", "_plan"): "the automatic collector off while one plan is searched, restored "
                                                 "in its `finally`",
    ("megalm/estimate/rank.py", "trace_compiled_blocks"): "megalm-estimate's trainer.compile=true: dynamo reset so "
                                                           "that each traced rank compiles afresh (docstring)",
}
# Module-level names a function may rebind, each with its reason.
GLOBAL_STATEMENTS = {
    ("megalm/data/preprocess.py", "_worker_tokenizer"): "a Pool worker's initializer: one per worker process",
    ("megalm/precision/kernels/mx_triton.py", "triton"): "the lazy import of an optional package",
    ("megalm/precision/kernels/mx_triton.py", "tl"): "the lazy import of an optional package",
    ("megalm/parallel/data_parallel/adamw_kernel.py", "tl"): "the lazy import of an optional package (the jitted "
                                                             "kernel refers to it as a global: the interpreter "
                                                             "does not see closures)",
    ("megalm/compat.py", "_varlen_form"): "a cache of the installed torch's varlen_attn form, like functools.cache's, "
                                          "that a compiled block reads without tracing its resolution (and logs)",
    ("megalm/compat.py", "inductor_force_strides"): "inductor's layout prim, loaded once when blocks are compiled (a "
                                                    "lazy import of torch._inductor) and read by their graphs",
}
# Module-level tables a function may write into, each with its reason: handles that name Python objects to custom
# ops, which take tensors and not objects; weak references, removed with their object, that change no behaviour.
HANDLE_TABLES = {
    ("megalm/model/handles.py", "_OBJECTS"): "a layer's recipe or weight-gradient sink, named to an opaque op by a "
                                             "CPU tensor",
    ("megalm/estimate/collectives.py", "_ACTIVE"): "the in-flight pricing a megalm-estimate step runs inside (entered "
                                                   "and left by `with`), which its patches of TP's Pending read: "
                                                   "module-level functions, since dynamo cannot trace a closure over "
                                                   "the pricing object",
}
MUTATING_METHODS = {"append", "extend", "insert", "pop", "popitem", "clear", "update", "add", "discard", "remove",
                    "setdefault", "note", "register", "__setitem__"}


class _StateVisitor(ast.NodeVisitor):
    """Collects, per module, process-wide changes made by functions: `global` rebinds, writes into module-level
    objects, global torch hooks, and process settings outside `APPLIED_AT_START` (a `warnings` filter inside
    `with warnings.catch_warnings()` is scoped, hence fine)."""

    def __init__(self, path: str, tree: ast.Module):
        self.path, self.found = path, []
        self.module_names = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                             for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                             if isinstance(t, ast.Name)}
        self.module_names |= {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                              and (node.module or "").startswith("megalm") for alias in node.names}
        self.scope: list[str] = []
        self.local_names: list[set[str]] = []
        self.scoped_warnings = 0

    def _where(self) -> str:
        return ".".join(self.scope) or "<module>"

    def _allowed_setting(self) -> bool:
        return (self.path, self._where()) in APPLIED_AT_START or (self.path, "*") in APPLIED_AT_START

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        args = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        assigned = {t.id for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.For, ast.With))
                    for t in ast.walk(n) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
        self.local_names.append(args | assigned)
        self.generic_visit(node)
        self.local_names.pop()
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_With(self, node: ast.With) -> None:
        scoped = any(ast.unparse(item.context_expr) == "warnings.catch_warnings()" for item in node.items)
        self.scoped_warnings += scoped
        self.generic_visit(node)
        self.scoped_warnings -= scoped

    def _module_object(self, node: ast.expr) -> str | None:
        """The module-level name `node` reads into (x[...], x.attr), unless a local shadows it."""
        while isinstance(node, (ast.Subscript, ast.Attribute)):
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.module_names and self.local_names \
                and node.id not in self.local_names[-1]:
            return node.id
        return None

    def _report(self, node: ast.AST, what: str) -> None:
        if (self.path, what.rpartition(" ")[2]) not in HANDLE_TABLES:
            self.found.append(f"{self.path}:{node.lineno} ({self._where()}): {what}")

    def visit_Global(self, node: ast.Global) -> None:
        for name in node.names:
            if (self.path, name) not in GLOBAL_STATEMENTS:
                self._report(node, f"`global {name}`: module state rebound after import")

    def _check_targets(self, node: ast.AST, targets: list[ast.expr]) -> None:
        for target in targets:
            text = ast.unparse(target)
            if PROCESS_SETTINGS.match(text) and not self._allowed_setting():
                self._report(node, f"sets {text}, a process-wide torch setting")
            elif not isinstance(target, ast.Name) and (name := self._module_object(target)):
                self._report(node, f"writes into module-level {name}")

    def visit_Assign(self, node: ast.Assign) -> None:
        self._check_targets(node, node.targets)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_targets(node, [node.target])
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = ast.unparse(node.func)
        last = func.rpartition(".")[2]
        if GLOBAL_TORCH_HOOK.match(last):
            self._report(node, f"{func}: a hook on all of torch")
        elif func in SETTING_CALLS and not self._allowed_setting() and not (
                func.startswith("warnings.") and self.scoped_warnings):
            self._report(node, f"{func}(...): a process-wide setting")
        elif func == "setattr" and node.args and PROCESS_SETTINGS.match(ast.unparse(node.args[0])) \
                and not self._allowed_setting():
            self._report(node, f"setattr on {ast.unparse(node.args[0])}, a process-wide torch setting")
        elif isinstance(node.func, ast.Attribute) and last in MUTATING_METHODS and self.local_names \
                and (name := self._module_object(node.func.value)):
            self._report(node, f"{func}(...) mutates module-level {name}")
        self.generic_visit(node)


def process_wide_changes(path: Path, source: str | None = None) -> list[str]:
    relative = str(path.relative_to(ROOT))
    tree = ast.parse(source if source is not None else path.read_text())
    visitor = _StateVisitor(relative, tree)
    visitor.visit(tree)
    return visitor.found


def test_no_function_changes_process_wide_state():
    """No megalm function rebinds or mutates module-level objects, installs a hook on all of torch, or changes a
    process-wide torch setting outside the places where the trainer applies its config at start."""
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in process_wide_changes(path)]
    assert not found, "process-wide state:\n" + "\n".join(found)


@pytest.mark.parametrize("source, what", [
    ("_SEEN = {}\ndef f(k):\n    _SEEN[k] = 1\n", "writes into module-level _SEEN"),
    ("_SEEN = []\ndef f(k):\n    _SEEN.append(k)\n", "mutates module-level _SEEN"),
    ("PROGRESS = P()\ndef f():\n    PROGRESS.note(step=1)\n", "mutates module-level PROGRESS"),
    ("from megalm.parallel.progress import PROGRESS\ndef f():\n    PROGRESS.note(step=1)\n",
     "mutates module-level PROGRESS"),
    ("_n = 0\ndef f():\n    global _n\n    _n += 1\n", "`global _n`"),
    ("from torch.optim.optimizer import register_optimizer_step_post_hook as r\n"
     "def f():\n    register_optimizer_step_post_hook(print)\n", "a hook on all of torch"),
    ("import torch\ndef f():\n    torch.nn.modules.module.register_module_forward_hook(print)\n",
     "a hook on all of torch"),
    ("import torch\ndef f():\n    torch._dynamo.config.recompile_limit = 64\n", "process-wide torch setting"),
    ("import torch\ndef f():\n    setattr(torch._dynamo.config, 'recompile_limit', 64)\n", "torch setting"),
    ("import torch\ndef f():\n    torch.set_float32_matmul_precision('high')\n", "a process-wide setting"),
    ("import warnings\nwarnings.filterwarnings('ignore')\n", "a process-wide setting"),
])
def test_the_state_check_catches(source, what):
    """The check above fails on each kind of process-wide change (and passes the scoped and local forms)."""
    found = process_wide_changes(PACKAGE / "probe.py", source)
    assert len(found) == 1 and what in found[0], found


@pytest.mark.parametrize("source", [
    "_SEEN = {}\ndef f(_SEEN):\n    _SEEN[1] = 2\n",  # a parameter shadows it
    "RECIPES = {}\ndef f():\n    return RECIPES['x']\n",  # read only
    "import warnings\ndef f():\n    with warnings.catch_warnings():\n        warnings.filterwarnings('ignore')\n",
    "def f(optimizer):\n    optimizer.register_step_post_hook(print)\n",  # a hook on one optimizer
])
def test_the_state_check_passes_local_and_scoped_changes(source):
    assert process_wide_changes(PACKAGE / "probe.py", source) == []


def test_module_level_megalm_objects_hold_no_state():
    """A module-level instance of a megalm class is stateless or a frozen dataclass: a mutable one (a progress
    record, a registry) would be shared by every trainer, mesh and test in the process."""
    import dataclasses
    import enum
    import importlib
    import inspect

    found = []
    for module in MODULES:
        if module.startswith("megalm.precision.kernels"):
            continue  # triton kernels: imported only where triton is
        for name, value in vars(importlib.import_module(module)).items():
            kind = type(value)
            if (inspect.ismodule(value) or inspect.isclass(value) or inspect.isroutine(value)
                    or not kind.__module__.startswith("megalm") or isinstance(value, enum.Enum)):
                continue
            frozen = dataclasses.is_dataclass(value) and kind.__dataclass_params__.frozen
            if not frozen and (getattr(value, "__dict__", None) or getattr(kind, "__slots__", ())):
                found.append(f"{module}.{name}: a {kind.__name__} with state")
    assert not found, found
