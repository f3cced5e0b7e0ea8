"""Tests cannot pass by skipping: under CI an absent third-party fixture or schema fails the test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.unit

PROBE = '''
from tests.conftest import shared_file, spec_file, shared_texts, absent

def test_fixture():
    shared_file("topo", "h100-sxm-8gpu-12nic-mlx5-1numa.txt")

def test_schema():
    spec_file("jobset.x-k8s.io_jobsets.yaml")

def test_folder():
    if not shared_texts("nccl-tests"):
        absent("no nccl-tests captures")
'''


def _run(tmp_path, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(PROBE)
    empty = tmp_path / "empty-shared"
    empty.mkdir(exist_ok=True)
    e = {k: v for k, v in os.environ.items() if k not in ("CI", "LAUNCH4D_REQUIRE", "LAUNCH4D_FIXTURES")}
    e.update(LAUNCH4D_SHARED=str(empty), PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
                          capture_output=True, text=True, cwd=tmp_path, env=e, timeout=120)


def test_absent_shared_data_skips_outside_ci(tmp_path):
    p = _run(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "3 skipped" in p.stdout and "empty-shared" in p.stdout


def test_absent_shared_data_fails_under_ci(tmp_path):
    for env in ({"CI": "true"}, {"LAUNCH4D_REQUIRE": "all"}):
        p = _run(tmp_path, **env)
        assert p.returncode == 1, p.stdout + p.stderr
        assert "3 failed" in p.stdout and "skipped" not in p.stdout
        assert "CI requires it" in p.stdout


def test_present_shared_data_passes_under_ci(tmp_path):
    """The real ../shared, where present, satisfies CI (this test itself needs it, so it is held to the same rule)."""
    from tests.conftest import shared_dir, shared_file

    shared_file("topo", "h100-sxm-8gpu-12nic-mlx5-1numa.txt")
    (tmp_path / "test_probe.py").write_text(PROBE)
    e = {k: v for k, v in os.environ.items() if k not in ("LAUNCH4D_FIXTURES",)}
    e.update(CI="true", LAUNCH4D_SHARED=str(shared_dir()), PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        str(tmp_path / "test_probe.py")],
                       capture_output=True, text=True, cwd=tmp_path, env=e, timeout=120)
    assert p.returncode == 0 and "3 passed" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("folder, mark, ok", [("unit", "unit", True), ("unit", "integration", False),
                                              ("e2e", None, False), (None, "unit", False)])
def test_a_test_module_lives_in_the_folder_of_its_kind(tmp_path, folder, mark, ok):
    """tests/conftest.py refuses a module whose pytestmark is not its folder (or that has none, or no tier)."""
    d = tmp_path / "tests" / folder if folder else tmp_path / "tests"
    d.mkdir(parents=True)
    (d / "test_a.py").write_text("import pytest\n" + (f"pytestmark = pytest.mark.{mark}\n" if mark else "")
                                 + "def test_a():\n    pass\n")
    e = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                        "--rootdir", str(tmp_path), str(d / "test_a.py")],
                       capture_output=True, text=True, cwd=tmp_path, env=e, timeout=120)
    if ok:
        assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout + p.stderr
    else:
        assert p.returncode == 4 and "lives in tests/<kind>/" in p.stderr, p.stdout + p.stderr
