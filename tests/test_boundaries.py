"""Package boundaries: which package of runner may import what (the package map of the design).

Static checks read every ``import`` with :mod:`ast` (relative imports resolved, imports inside
functions and under ``if TYPE_CHECKING:`` told apart); the run-time check imports the
torch-free modules in a fresh interpreter and looks at ``sys.modules``. Every rule is also run
on a small fake tree that crosses it, so each check is shown to fail when it should.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ANYWHERE = "anywhere"  # every import, also inside functions and under TYPE_CHECKING
RUN_TIME = "run time"  # every import that can execute: all but those under TYPE_CHECKING
IMPORT_TIME = "import time"  # imports executed when the module is imported: module level, not TYPE_CHECKING


@dataclass(frozen=True)
class Import:
    """One imported module name, where it is imported, and when it runs."""

    module: str
    line: int
    type_checking: bool
    in_function: bool


@dataclass(frozen=True)
class Rule:
    """Files matching ``files`` (minus ``exclude``) must not import ``forbidden`` (or a submodule) in ``scope``."""

    name: str
    files: tuple[str, ...]
    forbidden: tuple[str, ...]
    scope: str
    why: str
    exclude: tuple[str, ...] = ()


RULES = (
    Rule(
        "spec",
        ("runner/spec/**/*.py",),
        ("torch", "mlflow"),
        RUN_TIME,
        "runner.spec imports neither torch nor mlflow (runner validate answers on any laptop)",
    ),
    Rule(
        "cli",
        ("runner/cli.py", "runner/__init__.py", "runner/__main__.py"),
        ("torch", "mlflow"),
        IMPORT_TIME,
        "the command line imports neither torch nor mlflow when it starts",
    ),
    Rule(
        "core-tools",
        ("runner/**/*.py",),
        ("runner.tools",),
        ANYWHERE,
        "nothing in the core imports runner.tools (the command line alone starts the tools)",
        exclude=("runner/tools/", "runner/cli.py"),
    ),
    Rule(
        "cli-tools",
        ("runner/cli.py",),
        ("runner.tools",),
        IMPORT_TIME,
        "the command line imports a tool only inside the command that runs it",
    ),
    Rule(
        "mlflow",
        ("runner/**/*.py",),
        ("mlflow",),
        ANYWHERE,
        "only runner.tracking imports mlflow",
        exclude=("runner/tracking/",),
    ),
    Rule(
        "training",
        ("runner/training/**/*.py",),
        ("runner.tracking", "mlflow"),
        RUN_TIME,
        "runner.training logs through the Tracker it is given (type-only imports under TYPE_CHECKING are allowed)",
    ),
    Rule(
        "environment",
        ("runner/devices/environment.py",),
        ("runner", "torch"),
        ANYWHERE,
        "runner.devices.environment is a torch-free leaf that imports nothing else of runner",
    ),
)
RULES_BY_NAME = {rule.name: rule for rule in RULES}

# Modules a fresh interpreter imports without loading torch or mlflow.
LIGHT_MODULES = ("runner.cli", "runner.spec.loading", "runner.devices.environment")
HEAVY_MODULES = ("torch", "mlflow")


def module_name(path: Path, root: Path) -> str:
    """``runner/spec/loading.py`` -> ``runner.spec.loading``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportVisitor(ast.NodeVisitor):
    """Collect every import of one module with its context."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[Import] = []
        self._type_checking = 0
        self._functions = 0

    def _add(self, name: str, node: ast.stmt | ast.expr) -> None:
        self.found.append(Import(name, node.lineno, self._type_checking > 0, self._functions > 0))

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._type_checking += 1
        for child in node.body:
            self.visit(child)
        self._type_checking -= 1
        for child in node.orelse:
            self.visit(child)

    def _visit_function(self, node: ast.AST) -> None:
        self._functions += 1
        self.generic_visit(node)
        self._functions -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".") if self.package else []
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, node.module] if node.module else parts)
        else:
            base = node.module or ""
        self._add(base, node)
        for alias in node.names:
            if alias.name != "*":
                self._add(f"{base}.{alias.name}", node)  # `from runner import tools` imports runner.tools

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        arg = node.args[0] if node.args else None
        if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            self._add(arg.value, node)
        self.generic_visit(node)


def imports_of(path: Path, root: Path) -> list[Import]:
    """Every module imported by the file at ``path`` (relative imports made absolute)."""
    visitor = _ImportVisitor(module_name(path, root), path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return visitor.found


def files_of(rule: Rule, root: Path) -> list[Path]:
    """The files a rule checks under ``root``."""
    found = {p for pattern in rule.files for p in root.glob(pattern) if p.is_file()}
    kept = [p for p in found if not any(p.relative_to(root).as_posix().startswith(e) for e in rule.exclude)]
    return sorted(kept)


def _in_scope(imp: Import, scope: str) -> bool:
    if scope == ANYWHERE:
        return True
    if scope == RUN_TIME:
        return not imp.type_checking
    return not imp.type_checking and not imp.in_function


def _is_forbidden(module: str, forbidden: tuple[str, ...]) -> str | None:
    return next((f for f in forbidden if module == f or module.startswith(f + ".")), None)


def violations(rule: Rule, root: Path) -> list[str]:
    """``file:line: imports X (why)`` for every import that crosses ``rule`` under ``root``."""
    out = []
    for path in files_of(rule, root):
        seen = set()
        for imp in imports_of(path, root):
            hit = _is_forbidden(imp.module, rule.forbidden)
            if hit and _in_scope(imp, rule.scope) and (imp.line, hit) not in seen:
                seen.add((imp.line, hit))
                out.append(f"{path.relative_to(root).as_posix()}:{imp.line}: imports {imp.module} ({rule.why})")
    return out


def heavy_modules_loaded(modules: tuple[str, ...], root: Path) -> list[str]:
    """Which of torch and mlflow a fresh interpreter holds after importing ``modules`` from ``root``."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}: importlib.import_module(name)\n"
        f"print(json.dumps([m for m in {list(HEAVY_MODULES)!r} if m in sys.modules]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the real tree


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_no_package_boundary_is_crossed(rule: Rule) -> None:
    assert files_of(rule, ROOT), f"rule {rule.name} checks no file: its patterns are stale"
    assert violations(rule, ROOT) == []


def test_cli_and_spec_import_neither_torch_nor_mlflow_at_run_time() -> None:
    spec_modules = tuple(module_name(p, ROOT) for p in sorted((ROOT / "runner" / "spec").glob("*.py")))
    assert "runner.spec.loading" in spec_modules
    assert heavy_modules_loaded((*LIGHT_MODULES, *spec_modules), ROOT) == []


# --------------------------------------------------------------------------- each check can fail

CROSSINGS = [
    ("spec", "runner/spec/schema.py", "import torch\n"),
    ("spec", "runner/spec/loading.py", "def dump():\n    from mlflow import tracking\n"),
    ("cli", "runner/cli.py", "import mlflow.tracking\n"),
    ("cli", "runner/__init__.py", "try:\n    import torch\nexcept ImportError:\n    pass\n"),
    ("core-tools", "runner/launch/driver.py", "from runner.tools import sweep\n"),
    ("core-tools", "runner/plan.py", "def plan():\n    import runner.tools.bench\n"),
    ("core-tools", "runner/training/loop.py", "from ..tools.sweep import run_sweep\n"),
    ("cli-tools", "runner/cli.py", "from runner.tools.sweep import run_sweep\n"),
    ("mlflow", "runner/strategies/distributed.py", "import mlflow.pytorch\n"),
    ("mlflow", "runner/tools/bench.py", "def record():\n    from mlflow.tracking import MlflowClient\n"),
    ("mlflow", "runner/launch/worker.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mlflow\n"),
    ("mlflow", "runner/devices/inventory.py", "import importlib\nm = importlib.import_module('mlflow')\n"),
    ("training", "runner/training/loop.py", "from runner.tracking.trackers import Tracker\n"),
    ("training", "runner/training/setup.py", "def run():\n    from ..tracking import runs\n"),
    ("training", "runner/training/checkpoint.py", "class A:\n    import mlflow\n"),
    ("environment", "runner/devices/environment.py", "from runner.errors import UsageError\n"),
    ("environment", "runner/devices/environment.py", "from . import driver\n"),
    ("environment", "runner/devices/environment.py", "def f():\n    import torch.distributed\n"),
]


def _write(root: Path, rel: str, source: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


@pytest.mark.parametrize(("rule_name", "rel", "source"), CROSSINGS)
def test_a_crossed_boundary_is_reported(tmp_path: Path, rule_name: str, rel: str, source: str) -> None:
    _write(tmp_path, rel, "import os\n" + source)
    found = violations(RULES_BY_NAME[rule_name], tmp_path)
    assert len(found) == 1, found
    assert found[0].startswith(f"{rel}:") and RULES_BY_NAME[rule_name].why in found[0]


ALLOWED = [
    (
        "spec",
        "runner/spec/schema.py",
        "import pydantic\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
    ),
    ("cli", "runner/cli.py", "def main():\n    import torch\n"),
    ("core-tools", "runner/cli.py", "def sweep():\n    from runner.tools.sweep import run_sweep\n"),
    ("cli-tools", "runner/cli.py", "def sweep():\n    from runner.tools.sweep import run_sweep\n"),
    ("core-tools", "runner/tools/sweep.py", "from runner.tools.sweep_space import expand\n"),
    ("mlflow", "runner/tracking/runs.py", "import mlflow\nfrom mlflow.tracking import MlflowClient\n"),
    ("mlflow", "runner/tools/sweep_space.py", "from runner.tracking import runs\n"),
    (
        "training",
        "runner/training/loop.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runner.tracking.trackers import Tracker\n",
    ),
    ("training", "runner/training/loop.py", "import torch\nfrom runner.strategies.base import Strategy\n"),
    ("environment", "runner/devices/environment.py", "import os\nfrom dataclasses import dataclass\n"),
]


@pytest.mark.parametrize(("rule_name", "rel", "source"), ALLOWED)
def test_an_allowed_import_is_not_reported(tmp_path: Path, rule_name: str, rel: str, source: str) -> None:
    _write(tmp_path, rel, source)
    assert violations(RULES_BY_NAME[rule_name], tmp_path) == []


@pytest.mark.parametrize(
    ("heavy", "files"),
    [
        ("torch", {"runner/cli.py": "import runner.helper\n", "runner/helper.py": "import torch\n"}),
        (
            "mlflow",
            {"runner/spec/loading.py": "from runner.spec import schema\n", "runner/spec/schema.py": "import mlflow\n"},
        ),
    ],
)
def test_the_run_time_check_sees_an_indirect_heavy_import(tmp_path: Path, heavy: str, files: dict[str, str]) -> None:
    for rel in ("runner/__init__.py", "runner/spec/__init__.py", "runner/launch/__init__.py"):
        _write(tmp_path, rel, "")
    _write(tmp_path, "runner/cli.py", "")
    _write(tmp_path, "runner/spec/loading.py", "")
    _write(tmp_path, "runner/devices/environment.py", "")
    for rel, source in files.items():
        _write(tmp_path, rel, source)
    _write(tmp_path, f"{heavy}.py", "")  # a stand-in, so the check needs neither library
    assert heavy_modules_loaded(LIGHT_MODULES, tmp_path) == [heavy]
