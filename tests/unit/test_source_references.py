"""Notes cited in the code point where the notes are: the research notes are third-party-ish material in
../shared/notes (LAUNCH4D_SHARED), never in this repository, so a docstring that says `notes/x.md` sends a
reader to a file that is not there (issue 24). Every citation reads `../shared/notes/<name>.md`, and where
../shared is present the note exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO, absent, shared_dir

pytestmark = pytest.mark.unit

SEARCHED = ("launcher", "checks", "tests", "benchmarks", "docs", "templates")
THIS = Path(__file__).resolve()  # its own examples are not citations
CITED = re.compile(r"(?<![\w/.-])((?:\.\./shared/)?)notes/([\w.-]+\.md)")


def citations() -> list[tuple[str, str, str]]:
    """(file:line, prefix, note name) for every `notes/NAME.md` in the searched folders and README."""
    files = [REPO / "README.md", *(p for d in SEARCHED for p in sorted((REPO / d).rglob("*"))
                                   if p.suffix in (".py", ".md", ".j2") and p.is_file() and p != THIS)]
    out = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            out += [(f"{f.relative_to(REPO)}:{n}", m.group(1), m.group(2)) for m in CITED.finditer(line)]
    return out


def test_the_scan_finds_the_citations():
    assert any(where.startswith("checks/judges/") for where, _, _ in citations())
    bare, shared = CITED.search("(notes/preflight.md §3)"), CITED.search("see ../shared/notes/x.md")
    assert bare is not None and bare.group(1) == "" and shared is not None and shared.group(1) == "../shared/"


def test_notes_are_cited_under_shared():
    assert not (REPO / "notes").exists(), "notes belong in ../shared/notes, not in the repository"
    assert [where for where, prefix, _ in citations() if not prefix] == []


def test_every_cited_note_exists():
    notes = shared_dir() / "notes"
    if not notes.is_dir():
        absent(f"{notes} is absent (set LAUNCH4D_SHARED)")
    assert sorted({f"{where}: {name}" for where, _, name in citations() if not (notes / name).is_file()}) == []


TEST_CITED = re.compile(r"(?<![\w/.-])(tests/(?:[\w-]+/)*test_\w+\.py)")


def test_every_cited_test_file_exists():
    """A docstring or doc naming tests/<tier>/test_x.py names a file that is there (tests moved into tiers)."""
    files = [REPO / "README.md", *(p for d in SEARCHED for p in sorted((REPO / d).rglob("*"))
                                   if p.suffix in (".py", ".md", ".j2", ".toml") and p.is_file()), REPO / "pyproject.toml"]
    cited = {(f"{f.relative_to(REPO)}", m.group(1)) for f in files
             for m in TEST_CITED.finditer(f.read_text(encoding="utf-8", errors="replace")) if "test_x" not in m.group(1)}
    assert len(cited) > 50 and any(where.startswith("launcher/") for where, _ in cited)
    assert sorted(f"{where}: {name}" for where, name in cited if not (REPO / name).is_file()) == []
