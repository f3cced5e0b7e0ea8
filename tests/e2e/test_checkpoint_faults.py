"""Checkpoints under faults, on real files: a corrupt newest checkpoint (a shard, the DCP metadata or
extra.pt overwritten) is named and the previous complete one is loaded; a full disk during a save
says "No space left on device", removes the partial copy and keeps `latest` on the previous one.
The full disk is a real one: a small tmpfs (mounting needs root; elsewhere the tests say so and skip)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher.trainer.checkpoint import Checkpointer, CheckpointError
from tests.conftest import EXAMPLES
from tests.integration.test_trainer_checkpoint import make_training, train_steps

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")]
LAUNCH = str(Path(sys.executable).with_name("launch"))


@pytest.fixture
def small_fs(tmp_path):
    """mount(size) -> a fresh tmpfs of that many bytes under tmp_path, unmounted afterwards."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("a real full disk needs a small tmpfs, and mounting one needs root")
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def saved_twice(run_dir: Path):
    model, opt, sched = make_training()
    ck = Checkpointer(run_dir, 1)
    states = {}
    for step in (1, 2):
        train_steps(model, opt, sched, 1, seed=step)
        ck.save(step, model, opt, sched, {"pos": step})
        states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return states


@pytest.mark.parametrize("how", ["overwritten", "cut in half"])
@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata", "extra.pt"])
def test_corrupt_latest_falls_back_to_the_previous_checkpoint(tmp_path, capsys, caplog, victim, how):
    """One line names the unreadable file and the checkpoint resumed instead; no traceback on the terminal
    or in the log (a half-truncated .metadata made DCP log two UnpicklingError tracebacks, issue 23)."""
    states = saved_twice(tmp_path)
    bad = tmp_path / "checkpoints" / "step-2" / victim
    if how == "overwritten":
        bad.write_bytes(b"not a checkpoint" * 4)
    else:
        with open(bad, "r+b") as f:
            f.truncate(bad.stat().st_size // 2)
    model, opt, sched = make_training(seed=7)
    ck = Checkpointer(tmp_path, 1)
    assert ck.load_latest(model, opt, sched) == (1, {"pos": 1})
    for k, v in model.state_dict().items():
        assert torch.equal(v, states[1][k]), k
    err = capsys.readouterr().err
    [line] = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
    assert line.startswith(f"warning: checkpoint {tmp_path / 'checkpoints' / 'step-2'} is unreadable ({bad}")
    assert line.endswith(f"resumed from the previous complete one, {tmp_path / 'checkpoints' / 'step-1'}")
    assert "Traceback" not in err and not [r for r in caplog.records if r.exc_info]
    # the next save of step 2 replaces the corrupt copy instead of pointing `latest` at it again
    train_steps(model, opt, sched, 1, seed=2)
    ck.save(2, model, opt, sched, {"pos": 2})
    again = Checkpointer(tmp_path, 1)
    assert again.load_latest(*make_training(seed=8)) == (2, {"pos": 2})


def test_dcp_tracebacks_become_one_line(tmp_path, caplog):
    """What DCP itself logs with a traceback while a checkpoint loads (its metadata fallback, through the
    root logger) is one line with the exception's last line."""
    import logging

    import torch.distributed.checkpoint as dcp

    from launcher.trainer.checkpoint import _dcp_tracebacks_as_lines

    (tmp_path / ".metadata").write_bytes(b"\x80\x04truncated")
    caplog.set_level(logging.WARNING)
    from torch.distributed.checkpoint.api import CheckpointException

    with _dcp_tracebacks_as_lines(), pytest.raises(CheckpointException):
        dcp.load({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path))
    fallback = [r for r in caplog.records if r.name == "root" and "metadata" in r.getMessage()]
    assert fallback and not [r for r in fallback if r.exc_info]
    assert "(UnpicklingError: " in fallback[0].getMessage()


def test_no_readable_checkpoint_is_one_error_naming_each(tmp_path):
    saved_twice(tmp_path)
    for step in (1, 2):
        (tmp_path / "checkpoints" / f"step-{step}" / "extra.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError) as info:
        Checkpointer(tmp_path, 1).load_latest(*make_training())
    msg = str(info.value)
    assert "no readable checkpoint" in msg and "step-2/extra.pt" in msg and "step-1/extra.pt" in msg
    assert "\n" not in msg


def test_full_disk_during_save_keeps_the_previous_checkpoint(small_fs):
    fs = small_fs(4 << 20)
    model, opt, sched = make_training()
    ck = Checkpointer(fs, 1)
    ck.save(1, model, opt, sched, {"pos": 1})
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
    (fs / "filler").write_bytes(b"\0" * (free - (64 << 10)))  # leave 64 KiB: less than one checkpoint
    train_steps(model, opt, sched, 1)
    with pytest.raises(CheckpointError) as info:
        ck.save(2, model, opt, sched, {"pos": 2})
    msg = str(info.value)
    assert "No space left on device" in msg and "step-2.tmp" in msg
    assert not (fs / "checkpoints" / "step-2.tmp").exists() and not (fs / "checkpoints" / "step-2").exists()
    assert (fs / "checkpoints" / "latest").read_text().strip() == "step-1"
    assert Checkpointer(fs, 1).load_latest(*make_training(seed=3)) == (1, {"pos": 1})
    (fs / "filler").unlink()
    ck.save(2, model, opt, sched, {"pos": 2})  # with room again, the same step saves
    assert (fs / "checkpoints" / "latest").read_text().strip() == "step-2"


def _tiny(tmp_path: Path) -> Path:
    job = tmp_path / "job.yaml"
    job.write_text((EXAMPLES / "tiny-cpu.yaml").read_text())
    return job


@pytest.mark.slow
def test_launch_run_full_disk_says_so(tmp_path, small_fs):
    """The real trainer under `launch run` with its run dir on a disk with room for one checkpoint:
    step 4's is written, step 8's hits ENOSPC; one line says so, exit 1, step 4 stays `latest`."""
    fs = small_fs(6 << 20)
    env = {**os.environ, "LAUNCH4D_STATE": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"}
    rd = fs / "run"
    r = subprocess.run([LAUNCH, "run", str(_tiny(tmp_path)), "--nproc", "2", "--run-dir", str(rd), "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "checkpoint step 8 failed: No space left on device" in r.stderr, r.stderr[-3000:]
    assert "SIGKILL" not in r.stderr and "Traceback" not in r.stderr
    assert (rd / "checkpoints" / "latest").read_text().strip() == "step-4"
    assert not (rd / "checkpoints" / "step-8.tmp").exists()
    st = subprocess.run([LAUNCH, "status", json.loads(r.stdout)["job_id"], "--json"], capture_output=True, text=True,
                        env=env, timeout=60)
    assert json.loads(st.stdout)["state"] == "FAILED"


@pytest.mark.slow
def test_launch_run_resumes_past_a_corrupt_latest(tmp_path):
    """A finished 8-step run whose step-8 shard is then cut short: `--resume auto` names the file,
    goes back to step 4 and trains 5..8 again (exit 0), rewriting step 8."""
    env = {**os.environ, "LAUNCH4D_STATE": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"}
    rd = tmp_path / "run"
    job = _tiny(tmp_path)
    first = subprocess.run([LAUNCH, "run", str(job), "--nproc", "2", "--run-dir", str(rd)], capture_output=True,
                           text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    shard = sorted((rd / "checkpoints" / "step-8").glob("*.distcp"))[0]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    r = subprocess.run([LAUNCH, "run", str(job), "--nproc", "2", "--run-dir", str(rd), "--resume", "auto"],
                       capture_output=True, text=True, env=env, timeout=300)
    log = (rd / "logs" / "node0.log").read_text()
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"checkpoint {rd.resolve() / 'checkpoints' / 'step-8'} is unreadable ({shard.resolve()}" in log, log[-3000:]
    assert "resumed from step 4" in log
    steps = [json.loads(x)["step"] for x in (rd / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    assert (rd / "checkpoints" / "latest").read_text().strip() == "step-8"
    assert shard.stat().st_size == size and "Traceback" not in log  # step 8 written anew, whole
