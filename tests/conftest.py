"""Shared test fixtures: where third-party captured outputs live, and the repo's paths.

Captured outputs of real tools and published schemas are read from ../shared (or the folder
named by LAUNCH4D_SHARED); they are never copied into this repository. Tests that need them
skip with a reason where they are absent, except under CI (CI=true, or LAUNCH4D_REQUIRE=all),
where an absent fixture or schema fails the test: a green CI run has run every test.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import NoReturn

import pytest

# One CPU thread per torch process (trainer workers already set it): the tests' tensors are tiny, and
# a second OpenMP thread only spins, on a 2-core machine that the multi-process tests need whole.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def shared_dir() -> Path:
    return Path(os.environ.get("LAUNCH4D_SHARED", REPO.parent / "shared")).resolve()


def fixtures_dir() -> Path:
    return Path(os.environ.get("LAUNCH4D_FIXTURES", shared_dir() / "fixtures")).resolve()


def data_required() -> bool:
    """Under CI every third-party fixture and schema must be present: their absence fails, not skips."""
    return os.environ.get("CI", "").lower() in ("true", "1") or os.environ.get("LAUNCH4D_REQUIRE") == "all"


def absent(why: str) -> NoReturn:
    """Third-party data a test needs is missing: skip, or fail under CI (see data_required)."""
    if data_required():
        pytest.fail(f"{why}; CI requires it (CI=true / LAUNCH4D_REQUIRE=all)", pytrace=False)
    pytest.skip(why)


def shared_file(*parts: str) -> Path:
    """A file under ../shared/fixtures; skip (fail under CI) where it is absent."""
    p = fixtures_dir().joinpath(*parts)
    if not p.exists():
        absent(f"third-party fixture {p} is absent (set LAUNCH4D_FIXTURES to its folder)")
    return p


def spec_file(*parts: str) -> Path:
    """A published schema under ../shared/specs; skip (fail under CI) where absent."""
    p = shared_dir().joinpath("specs", *parts)
    if not p.exists():
        absent(f"published schema {p} is absent (set LAUNCH4D_SHARED)")
    return p


def shared_texts(folder: str, pattern: str = "*.txt") -> list[str]:
    """The texts of every fixture in one folder under ../shared/fixtures; [] where it is absent."""
    d = fixtures_dir() / folder
    return [p.read_text(errors="replace") for p in sorted(d.glob(pattern))] if d.is_dir() else []


@pytest.fixture
def repo() -> Path:
    return REPO


KINDS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test is of exactly one kind, the folder it lives in (tests/unit, tests/integration, tests/e2e),
    and says so with a module-level `pytestmark = pytest.mark.<kind>`, so `-m unit` and the rest select the
    whole suite between them and a test cannot sit in one tier while claiming another."""
    wrong = set()
    for item in items:
        module = item.nodeid.split("::")[0]
        folder = module.split("/")[1] if module.count("/") >= 2 else None
        marks = [k for k in KINDS if item.get_closest_marker(k) is not None]
        if marks != [folder]:
            wrong.add(f"{module} (marked {'+'.join(marks) or 'nothing'})")
    if wrong:
        raise pytest.UsageError("each test module lives in tests/<kind>/ and carries pytestmark = pytest.mark.<kind> "
                                f"({'|'.join(KINDS)}): {', '.join(sorted(wrong))}")


#: modules that name this session fixture share one pytest-xdist worker (one test Slurm, not one per worker)
SHARED_SERVICE = "slurm_cluster"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`make test` runs `-n 2 --dist loadfile`: each module whole on one worker, so a module-scoped
    fixture (the parity layouts, the traced matrix) is built once, not once per worker; and every
    module of the test Slurm on the same worker, which starts one cluster, not two."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class ModulesAndSlurm(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "slurm" if _names_shared_service(module) else module

    return ModulesAndSlurm(config, log)


@functools.cache
def _names_shared_service(module: str) -> bool:
    try:
        return SHARED_SERVICE in (REPO / module).read_text()
    except OSError:
        return False
