"""`launch preflight` input errors: one line naming the flag or file, exit 2, nothing written."""

from __future__ import annotations

import subprocess

import pytest

from tests.cli_helpers import launch
from tests.conftest import REPO

pytestmark = pytest.mark.unit


def cli(*args: str) -> subprocess.CompletedProcess:
    """`launch preflight ARGS` as a user's shell runs it."""
    return launch("preflight", *args, cwd=REPO, timeout=60)


@pytest.mark.parametrize("args,needle", [
    (["--hosts", "node[01-"], "--hosts 'node[01-': not a hostlist expression"),
    (["--hosts", "a", "--hostfile", "f"], "give one of --hosts, --hostfile, --slurm-allocation"),
    (["--hostfile", "/nonexistent/hosts"], "--hostfile /nonexistent/hosts: cannot read"),
    (["--hosts", "a", "--sizes", "8G"], "--sizes '8G': expected MIN,MAX"),
    (["--hosts", "a", "--launcher", "mpirun {bogus} {cmd}"], "--launcher: unknown placeholder 'bogus'"),
    (["--hosts", "a", "--thresholds", "/nonexistent.yaml"], "--thresholds /nonexistent.yaml: cannot read"),
    (["--hosts", "a", "--backend", "slurm", "--out-dir", "/tmp/a b", "--dry-run"], "cannot go on an #SBATCH line"),
    (["parse", "topo", "/nonexistent.txt"], "/nonexistent.txt: cannot read"),
    (["--hosts", "a", "--tool-timeout", "dcgm=60"], "--tool-timeout 'dcgm=60': expected TOOL=SECONDS with "
                                                    "SECONDS > 0 and TOOL one of dcgmi, nvbandwidth"),
    (["--hosts", "a", "--tool-timeout", "dcgmi=0"], "--tool-timeout 'dcgmi=0': expected TOOL=SECONDS"),
    (["--hosts", "a", "--tool-timeout", "nvbandwidth"], "--tool-timeout 'nvbandwidth': expected TOOL=SECONDS"),
])
def test_bad_input_is_one_line_exit_2(args, needle, tmp_path):
    out = tmp_path / "bw.json"
    p = cli(*args, "-o", str(out)) if args[0] != "parse" else cli(*args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith("error: ") and needle in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_thresholds_file_with_unknown_key(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("intra: 400\n")
    (tmp_path / "run" / "n1").mkdir(parents=True)
    (tmp_path / "run" / "n1" / "topo.txt").write_text("")
    p = cli("import", str(tmp_path / "run"), "--thresholds", str(f))
    assert p.returncode == 2 and "unknown key 'intra'" in p.stderr
    p = cli("import", str(tmp_path))  # a folder without host folders
    assert p.returncode == 2 and "no host folders" in p.stderr


def test_help_lists_backends_and_subcommands():
    p = cli("--help")
    assert p.returncode == 0
    assert "[ssh|local|srun|slurm|k8s]" in p.stdout and "parse" in p.stdout and "import" in p.stdout
