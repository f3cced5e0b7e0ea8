"""DESIGN.md's dependency rules ("Dependencies run one way"), enforced over the source with ast.

The folders read as the pipeline: checks/ (measure) -> launcher/plan (decide) -> render, backends
(run) -> trainer; diagnose (explain); commands/ + cli.py on top; formats (+ transport) underneath.

- the trainer imports launcher.plan and launcher.formats only (and errors);
- checks imports launcher.formats only, the torch-free launcher.transport and the render
  environment (launcher.render itself; never launcher's commands, backends or plan); those stand on
  formats alone;
- the backends never import the trainer (a job runs it in other processes);
- the CLI never imports torch: no command module does at module level, `launch --help` and
  `launch plan` never load it (only `launch run` and `launch verify` do, inside the command that
  counts GPUs or traces the trainer); nothing outside the trainer and launcher/verify imports torch at
  module level; kubernetes/paramiko are imported inside the functions that use them;
- nothing below the commands imports them, and no two modules (or subpackages) import each other.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.unit

PACKAGES = ("launcher", "checks")
HEAVY = ("torch", "kubernetes", "paramiko")
# what the trainer may use from the rest of launch4d: the plan and the torch-free formats
TRAINER_MAY_USE = ("launcher.plan", "launcher.formats", "launcher.errors")
COMMAND_LAYER = ("launcher.cli", "launcher.__main__", "launcher.commands")


@dataclass(frozen=True)
class Import:
    module: str      # the importing module
    name: str        # what it imports, resolved to an absolute dotted name
    top_level: bool  # runs on import (not inside a function, not under TYPE_CHECKING)
    line: int
    entry_point: bool = False  # inside the module's `main()`: what `python -m module` runs, the CLI's wiring

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.name}" + ("" if self.top_level else " (in a function)")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def sources() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _imports(path: Path) -> list[Import]:
    mod = module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, top: bool, entry: bool = False) -> None:
        for ch in ast.iter_child_nodes(node):
            here = top and not isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(ch, ast.If) and "TYPE_CHECKING" in ast.unparse(ch.test):
                here = False
            inside = entry or (top and isinstance(ch, ast.FunctionDef) and ch.name == "main")
            if isinstance(ch, ast.Import):
                found.extend(Import(mod, a.name, here, ch.lineno, inside) for a in ch.names)
            elif isinstance(ch, ast.ImportFrom):
                base = ch.module or ""
                if ch.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (ch.level - 1)]
                    base = ".".join(up + ([ch.module] if ch.module else []))
                # `from launcher import plan` imports the module launcher.plan; `from x import f` imports x
                for a in ch.names:
                    sub = f"{base}.{a.name}"
                    found.append(Import(mod, sub if sub in sources() else base, here, ch.lineno, inside))
            visit(ch, here, inside)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


@cache
def all_imports() -> list[Import]:
    return [i for p in sources().values() for i in _imports(p)]


def within(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(importers: Callable[[str], bool], imported: tuple[str, ...], *, top_level_only: bool,
               allowed: tuple[str, ...] = ()) -> list[str]:
    """Imports by modules that `importers` accepts of anything under `imported`, except under `allowed`."""
    return [str(i) for i in all_imports()
            if importers(i.module) and within(i.name, *imported) and not within(i.name, *allowed)
            and (i.top_level or not top_level_only)]


def under(*prefixes: str) -> Callable[[str], bool]:
    return lambda m: within(m, *prefixes)


def not_under(*prefixes: str) -> Callable[[str], bool]:
    return lambda m: not within(m, *prefixes)


def test_the_scan_sees_the_code():
    """The rules below would pass vacuously on an empty scan: it must find the imports we know exist."""
    imps = {(i.module, i.name, i.top_level) for i in all_imports()}
    assert ("launcher.trainer.model", "torch", True) in imps
    assert any(m.startswith("launcher.commands") and n == "launcher.plan.model" for m, n, _ in imps)
    assert len(sources()) > 50


#: the torch-free layer under both checks and launcher: file formats, and how commands reach a machine
BASE_LAYER = ("launcher.formats", "launcher.transport", "launcher.errors")


#: launcher.render itself (the package, not its plan-bound sbatch/k8s modules): the one Jinja
#: environment, which preflight's batch script and pods render through too
RENDER_ENV = "launcher.render"


def test_checks_never_imports_launcher_commands_or_backends():
    """checks may use the base layer and the render environment (exactly launcher.render), nothing else."""
    assert [str(i) for i in all_imports() if within(i.module, "checks") and within(i.name, "launcher")
            and not within(i.name, *BASE_LAYER) and i.name != RENDER_ENV] == []


def test_the_render_environment_stands_on_formats_only():
    """checks renders through launcher.render's environment: that module must not pull in the plan."""
    assert [str(i) for i in all_imports() if i.module == RENDER_ENV and within(i.name, "launcher", "checks")
            and not within(i.name, *BASE_LAYER)] == []


def test_the_transport_stands_on_formats_only():
    """checks and the backends both run commands through launcher.transport: it must not pull either in."""
    assert violations(under("launcher.transport", "launcher.formats"), ("launcher", "checks"), top_level_only=False,
                      allowed=BASE_LAYER) == []


def test_torch_only_in_the_trainer_at_module_level():
    assert violations(not_under("launcher.trainer", "launcher.verify"), ("torch",), top_level_only=True) == []


def test_trainer_imports_only_plan_and_formats():
    assert violations(under("launcher.trainer"), ("launcher", "checks"), top_level_only=False,
                      allowed=("launcher.trainer",) + TRAINER_MAY_USE) == []


def test_nothing_below_the_commands_imports_them():
    assert violations(not_under(*COMMAND_LAYER), COMMAND_LAYER, top_level_only=False) == []


def test_backends_never_import_the_trainer():
    assert violations(under("launcher.backends"), ("launcher.trainer", "launcher.verify"), top_level_only=False) == []


def test_commands_import_the_trainer_only_inside_functions():
    assert violations(under(*COMMAND_LAYER), ("launcher.trainer",), top_level_only=True) == []


def test_kubernetes_and_paramiko_imported_where_used():
    assert violations(under(*PACKAGES), ("kubernetes", "paramiko"), top_level_only=True) == []


def _closure(start: str) -> set[str]:
    """Every name imported when `start` is imported: module-level imports, followed through the repo
    (a module's parent packages included)."""
    by_module: dict[str, list[Import]] = {}
    for i in all_imports():
        if i.top_level:
            by_module.setdefault(i.module, []).append(i)
    seen: set[str] = set()
    todo = [start]
    while todo:
        m = todo.pop()
        parts = m.split(".")
        for k in range(1, len(parts) + 1):
            p = ".".join(parts[:k])
            if p not in seen:
                seen.add(p)
                todo.extend(i.name for i in by_module.get(p, []))
    return seen


@pytest.mark.parametrize("module", sorted(m for m in sources() if within(m, *COMMAND_LAYER)))
def test_the_cli_never_imports_heavy_packages(module):
    """Importing the CLI or any command module does not import torch, kubernetes or paramiko."""
    heavy = sorted(n for n in _closure(module) if within(n, *HEAVY))
    assert heavy == [], f"{module} imports {heavy} at module level (through its imports)"


@pytest.mark.parametrize("argv", [["--help"], ["plan", "examples/tiny-cpu.yaml", "--json"]])
def test_launch_starts_without_heavy_packages(argv):
    """The real process: `launch --help` and `launch plan` never load torch, kubernetes or paramiko."""
    code = ("import sys\nfrom launcher.cli import main\nsys.argv = ['launch'] + sys.argv[1:]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "HEAVY []" in p.stderr, p.stderr


def _unit(module: str) -> str:
    """What a cycle is judged between: a subpackage as a whole (checks.runners, launcher.plan: a package
    and its own modules may refer to each other), otherwise the module itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 else module


def _resolve(name: str) -> str | None:
    """The repository module an imported name lives in (`checks.judges.worst` -> checks.judges)."""
    while name and name not in sources():
        name = name.rpartition(".")[0]
    return name or None


def import_cycles(imports: list[Import]) -> list[list[str]]:
    """Cycles between units, counting every import (a function-level import is a dependency too) but
    those of a `main()`: a `python -m` entry point wires the package together, as the CLI does."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.entry_point:
            continue
        target = _resolve(i.name)
        if target is not None and _unit(target) != _unit(i.module):
            graph.setdefault(_unit(i.module), set()).add(_unit(target))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                cycles.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_cycle_check_finds_a_cycle():
    fake = [Import("checks.runners.slurm_job", "checks.orchestrate.ring_rounds", True, 1),
            Import("checks.orchestrate", "checks.runners.Runner", True, 2),
            Import("checks.assemble", "checks.levels", True, 3),
            Import("checks.levels", "checks.assemble", False, 4, entry_point=True)]
    assert import_cycles(fake) == [["checks.orchestrate", "checks.runners"]]


def test_no_import_cycles():
    """No two modules (or subpackages) need each other, even through imports inside functions."""
    assert import_cycles(all_imports()) == []


def test_python_m_launcher_is_launch():
    p = subprocess.run([sys.executable, "-m", "launcher", "plan", "examples/tiny-cpu.yaml", "--json"],
                       capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["best"]["world_size"] == 4
    bad = subprocess.run([sys.executable, "-m", "launcher", "plan", "no-such.yaml"], capture_output=True,
                         text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
