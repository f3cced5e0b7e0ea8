"""launcher.formats: bounded reads, writes that never go through or over a symlink or device, paths
proven inside their parent, and the run dir's lock held by the job's own processes (issue 14 items
3, 6, 8, 10's FIFO, 14)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.errors import UserError
from launcher.formats.files import (
    atomic_write,
    child_path,
    make_dirs,
    read_bytes,
    read_text,
    remove_created,
    write_files,
)
from launcher.formats.rundir import LOCK, RunDirLock
from tests.conftest import EXAMPLES

pytestmark = pytest.mark.unit


def test_read_is_bounded_and_refuses_devices_and_directories(tmp_path):
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    with pytest.raises(UserError, match="101 bytes; the limit is 100"):
        read_bytes(big, "thing", limit=100)
    with pytest.raises(UserError, match="character device"):
        read_bytes("/dev/zero", "thing")
    with pytest.raises(UserError, match="directory"):
        read_bytes(tmp_path, "thing")
    (tmp_path / "bin").write_bytes(b"ok\xff")
    with pytest.raises(UserError, match=r"not UTF-8 text \(byte 2\)"):
        read_text(tmp_path / "bin", "thing")


def test_a_pipe_is_read_once_and_a_fifo_without_writer_does_not_hang(tmp_path):
    r, w = os.pipe()
    os.write(w, b"name: x\n")
    os.close(w)
    assert read_text(f"/dev/fd/{r}", "job file") == "name: x\n"
    os.close(r)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert read_bytes(fifo, "job file") == b""
    # a pipe that keeps giving is cut at the limit, not read until memory runs out
    proc = subprocess.Popen(["yes"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        with pytest.raises(UserError, match="larger than the limit of 1,000"):
            read_bytes(f"/proc/self/fd/{proc.stdout.fileno()}", "job file", limit=1000)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_atomic_write_never_through_or_over_a_symlink_device_or_directory(tmp_path):
    target = tmp_path / "target"
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(UserError, match="symbolic link"):
        atomic_write(link, "x", "plan")
    assert not target.exists() and link.is_symlink()
    with pytest.raises(UserError, match="character device"):
        atomic_write("/dev/null", "x", "plan")
    (tmp_path / "d").mkdir()
    with pytest.raises(UserError, match="directory"):
        atomic_write(tmp_path / "d", "x", "plan")
    p = atomic_write(tmp_path / "f", "one", "plan", 0o600)
    atomic_write(p, "two", "plan")
    assert p.read_text() == "two" and sorted(x.name for x in tmp_path.iterdir()) == ["d", "f", "link"]


def test_write_files_is_all_or_nothing(tmp_path):
    (tmp_path / "b.txt").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "a.txt").write_text("old")
    with pytest.raises(UserError, match="b.txt"):
        write_files(tmp_path, {"a.txt": ("new", 0o644), "b.txt": ("new", 0o644)})
    assert (tmp_path / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]  # no .tmp left


def test_make_dirs_reports_what_it_created_and_refuses_a_file_on_the_way(tmp_path):
    created = make_dirs(tmp_path / "a" / "b" / "c")
    assert created == [tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    remove_created(created)
    assert not (tmp_path / "a").exists()
    (tmp_path / "f").write_text("")
    with pytest.raises(UserError, match="exists and is not a directory"):
        make_dirs(tmp_path / "f" / "x")


@pytest.mark.parametrize("name", ["../x", "../../../../tmp/x", "a/b", "..", ".", "", "x\0y"])
def test_child_path_keeps_a_name_inside_its_parent(tmp_path, name):
    with pytest.raises(UserError, match="name"):
        child_path(tmp_path, name, "name")


def test_child_path_refuses_a_symlink_out(tmp_path):
    (tmp_path / "out").symlink_to("/tmp")
    with pytest.raises(UserError, match="resolves outside"):
        child_path(tmp_path, "out", "name")
    assert child_path(tmp_path, "job-20260101-000000", "name") == tmp_path / "job-20260101-000000"


def test_run_dir_lock_lives_as_long_as_the_process_holding_it(tmp_path):
    """Issue 14 item 6: the lock is passed to the job's processes; while any lives, a second
    `launch run` on the dir is refused (exit 2, one line, nothing written) and started nothing."""
    rd = tmp_path / "rd"
    rd.mkdir()
    lock = RunDirLock(rd)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             pass_fds=(lock.fd,))
    lock.release()  # the child holds it now, as the job's processes do
    try:
        with pytest.raises(UserError, match="in use by another run"):
            RunDirLock(rd)
        before = sorted(p.name for p in rd.iterdir())
        res = CliRunner().invoke(cli, ["run", str(EXAMPLES / "tiny-cpu.yaml"), "--run-dir", str(rd),
                                       "--resume", "auto"], env={"LAUNCH4D_STATE": str(tmp_path / "state")})
        assert res.exit_code == 2 and "in use by another run" in res.stderr, res.output
        assert sorted(p.name for p in rd.iterdir()) == before == [LOCK]
    finally:
        child.communicate(b"")
    RunDirLock(rd).release()  # free again once the job's last process has gone


@pytest.mark.parametrize("command", [["render", "{job}", "--backend", "slurm", "-o", "{out}"],
                                     ["run", "{job}", "--dry-run", "--json"]])
def test_a_job_file_given_as_a_pipe_is_read_once(tmp_path, command):
    """Issue 14 item 8: `<(cat job.yaml)` was read twice (a 0-byte job.yaml copy, or a traceback)."""
    text = (EXAMPLES / "tiny-slurm.yaml" if command[0] == "render" else EXAMPLES / "tiny-cpu.yaml").read_text()
    r, w = os.pipe()
    os.write(w, text.encode())
    os.close(w)
    try:
        args = [a.format(job=f"/dev/fd/{r}", out=tmp_path / "out") for a in command]
        res = CliRunner().invoke(cli, args, env={"LAUNCH4D_STATE": str(tmp_path / "state")})
    finally:
        os.close(r)
    assert res.exit_code == 0, res.output + res.stderr
    if command[0] == "render":
        assert (tmp_path / "out" / "job.yaml").read_text() == text
