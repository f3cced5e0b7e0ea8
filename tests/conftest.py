"""Shared test fixtures: where third-party captured outputs live, and the repo's paths.

Captured outputs of real tools and published schemas are read from ../shared (or the folder
named by LAUNCH4D_SHARED); they are never copied into this repository. Tests that need them
skip with a reason where they are absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def shared_dir() -> Path:
    return Path(os.environ.get("LAUNCH4D_SHARED", REPO.parent / "shared")).resolve()


def fixtures_dir() -> Path:
    return Path(os.environ.get("LAUNCH4D_FIXTURES", shared_dir() / "fixtures")).resolve()


def shared_file(*parts: str) -> Path:
    """A file under ../shared/fixtures; skip the test with a reason where it is absent."""
    p = fixtures_dir().joinpath(*parts)
    if not p.exists():
        pytest.skip(f"third-party fixture {p} is absent (set LAUNCH4D_FIXTURES to its folder)")
    return p


def spec_file(*parts: str) -> Path:
    """A published schema under ../shared/specs; skip where absent."""
    p = shared_dir().joinpath("specs", *parts)
    if not p.exists():
        pytest.skip(f"published schema {p} is absent (set LAUNCH4D_SHARED)")
    return p


@pytest.fixture
def repo() -> Path:
    return REPO
