"""The dependency rules of docs/architecture.md (DESIGN.md's "Dependencies run one way"), enforced
over the source with ast, module by module, with no exceptions.

- LAYERS: each part of launch4d imports only the parts below it (any import counts: module level,
  inside a function, under TYPE_CHECKING): formats (+ errors) underneath everything; transport and
  plan on formats; render on plan; backends on render and transport; the trainer on plan; verify on
  the trainer; checks on transport and formats only; diagnose on formats and plan (it reads plan.json);
  the command layer (cli.py, __main__.py, commands/) on everything, and nothing on it;
- no two modules need each other, directly or round a loop, counting every import (function-level,
  TYPE_CHECKING and `main()` ones too): a package and its own modules are separate modules here;
- torch only in the trainer and verify at module level, nowhere in what `launch --help` and
  `launch plan` load; kubernetes/paramiko are imported inside the functions that use them.
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
COMMAND_LAYER = ("launcher.cli", "launcher.__main__", "launcher.commands")


@dataclass(frozen=True)
class Import:
    module: str      # the importing module
    name: str        # what it imports, resolved to an absolute dotted name
    top_level: bool  # runs on import (not inside a function, not under TYPE_CHECKING)
    line: int

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

    def visit(node: ast.AST, top: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            here = top and not isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(ch, ast.If) and "TYPE_CHECKING" in ast.unparse(ch.test):
                here = False
            if isinstance(ch, ast.Import):
                found.extend(Import(mod, a.name, here, ch.lineno) for a in ch.names)
            elif isinstance(ch, ast.ImportFrom):
                base = ch.module or ""
                if ch.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (ch.level - 1)]
                    base = ".".join(up + ([ch.module] if ch.module else []))
                # `from launcher import plan` imports the module launcher.plan; `from x import f` imports x
                for a in ch.names:
                    sub = f"{base}.{a.name}"
                    found.append(Import(mod, sub if sub in sources() else base, here, ch.lineno))
            visit(ch, here)

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


#: What each part of launch4d may import of the others (docs/architecture.md, DESIGN.md's arrows
#: followed down: backends reach plan through render, verify reaches plan through the trainer).
#: A part not named here is refused by test_every_module_is_in_a_layer.
FOUNDATION = ("launcher.formats", "launcher.errors")
LAYERS: dict[str, tuple[str, ...]] = {
    "launcher.errors": (),
    "launcher.formats": ("launcher.errors",),
    "launcher.transport": FOUNDATION,
    "launcher.plan": FOUNDATION,
    "launcher.render": ("launcher.plan", *FOUNDATION),
    "launcher.backends": ("launcher.render", "launcher.transport", "launcher.plan", *FOUNDATION),
    "launcher.trainer": ("launcher.plan", *FOUNDATION),
    "launcher.verify": ("launcher.trainer", "launcher.plan", *FOUNDATION),
    "launcher.diagnose": ("launcher.plan", *FOUNDATION),   # plan.json: Plan.load, layout's groups
    "checks": ("launcher.transport", *FOUNDATION),
    "launcher.commands": ("launcher", "checks"),           # the command layer: everything
    "launcher": (),                                        # the package's __init__: __version__
}


def layer_of(module: str) -> str | None:
    """The LAYERS entry a module belongs to (cli.py and __main__.py are the command layer)."""
    if within(module, *COMMAND_LAYER):
        return "launcher.commands"
    return max((k for k in LAYERS if within(module, k)), key=len, default=None)


def test_every_module_is_in_a_layer():
    """A new top-level package must be placed in LAYERS (and docs/architecture.md), not slip past it."""
    assert [m for m in sources() if layer_of(m) is None] == []


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_layer_imports_only_the_layers_below_it(layer):
    """Every import of launch4d code (module level, in a function or under TYPE_CHECKING) by a module of
    `layer` stays inside the layer or goes to one LAYERS allows it."""
    bad = [str(i) for i in all_imports()
           if layer_of(i.module) == layer and within(i.name, *PACKAGES)
           and layer_of(i.name) != layer and not within(i.name, *LAYERS[layer])]
    assert bad == []


def test_the_layer_check_finds_a_sideways_import():
    """The rule would pass vacuously if layer_of misplaced modules: checks -> render is refused,
    backends -> plan allowed, commands -> anything allowed."""
    assert layer_of("checks.runners.k8s") == "checks" and layer_of("launcher.cli") == "launcher.commands"
    assert not within(layer_of("launcher.render.env") or "", *LAYERS["checks"])
    assert within("launcher.plan.model", *LAYERS["launcher.backends"])
    assert within("checks.orchestrate", *LAYERS["launcher.commands"])
    assert not within("launcher.commands.plan_cmd", *LAYERS["launcher.plan"])


def test_torch_only_in_the_trainer_at_module_level():
    assert violations(not_under("launcher.trainer", "launcher.verify"), ("torch",), top_level_only=True) == []


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


def _resolve(name: str) -> str | None:
    """The repository module an imported name lives in (`checks.judges.finding.worst` -> checks.judges.finding)."""
    while name and name not in sources():
        name = name.rpartition(".")[0]
    return name or None


def import_cycles(imports: list[Import]) -> list[list[str]]:
    """Cycles between modules, counting every import: at module level, inside a function (a
    `python -m` entry point's `main()` included) and under TYPE_CHECKING, each a dependency. A package's
    __init__ is a module like the others: `import a.b` does not count as importing `a` (Python runs a's
    __init__ first, but the code of a.b does not depend on it)."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        target = _resolve(i.name)
        if target is not None and target != i.module:
            graph.setdefault(i.module, set()).add(target)
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
    """Module by module, through function-level and TYPE_CHECKING imports; a package and its own
    module are two modules; a one-way import is no cycle."""
    fake = [Import("checks.runners.k8s", "checks.runners.Runner", True, 1),       # submodule -> package
            Import("checks.runners", "checks.runners.k8s", False, 2),             # package -> it, in get_runner
            Import("checks.probe", "checks.levels", False, 3),                     # in probe's main()
            Import("checks.levels", "checks.parsed.parse_nccl_run", False, 4),     # in a function
            Import("checks.parsed", "checks.probe.PROBES", True, 5),
            Import("launcher.plan.capabilities", "launcher.plan.model.Plan", False, 6),  # TYPE_CHECKING
            Import("launcher.plan.model", "launcher.plan.layout", True, 7)]
    assert import_cycles(fake) == [["checks.levels", "checks.parsed", "checks.probe"],
                                   ["checks.runners", "checks.runners.k8s"]]


def test_no_import_cycles():
    """No two modules need each other, even through imports inside functions or under TYPE_CHECKING."""
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
