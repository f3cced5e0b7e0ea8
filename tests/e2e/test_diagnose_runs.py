"""diagnose on what real runs leave: heartbeat files (the run-dir contract), flight-recorder dumps
written by torch itself (gloo on CPU records them too), and the bundled trainer under torchrun with
one rank made to stall past the collective timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launcher.diagnose import diagnose
from launcher.diagnose.heartbeat import Heartbeats, parse_beat
from tests.conftest import REPO
from tests.job_helpers import tiny_plan
from tests.trainer_helpers import free_port

pytestmark = pytest.mark.e2e

PY = sys.executable


def beat(rank, step, phase, collectives, updated, host=None, last="all_reduce(grads)") -> str:
    return json.dumps({"rank": rank, "host": host or f"node{rank}", "pid": 100 + rank, "step": step,
                       "phase": phase, "last_collective": last, "collectives": collectives, "updated": updated})


def heartbeats(*beats: str) -> Heartbeats:
    hb = Heartbeats()
    for i, b in enumerate(beats):
        beat = parse_beat(b, f"heartbeat/rank{i}.json:1")
        assert beat is not None, b
        hb.add(beat)
    return hb


def test_heartbeat_lagging_rank_after_others_failed():
    hb = heartbeats(beat(0, 7, "error", 40, 1000.0), beat(1, 7, "error", 40, 1000.2),
                    beat(2, 7, "forward", 38, 940.0), beat(3, 7, "error", 40, 1000.1))
    (stall, info) = hb.findings(4, {})
    assert stall.kind == "stalled_rank" and stall.ranks == [2] and stall.hosts == ["node2"]
    assert "60s older" in stall.message and stall.evidence[0] == "heartbeat/rank2.json:1"
    assert info.severity == "info"


def test_heartbeat_file_stopped_updating_without_errors():
    """Nobody failed yet (long timeout), but one rank's file is minutes behind and its count lags."""
    hb = heartbeats(beat(0, 12, "backward", 90, 5000.0), beat(1, 11, "optimizer", 85, 4700.0))
    stall = hb.findings(2, {})[0]
    assert stall.ranks == [1] and "step 11" in stall.message


def test_heartbeat_snapshot_skew_is_not_a_stall():
    """Healthy ranks a few ms apart differ by a collective: facts only."""
    hb = heartbeats(beat(0, 3, "backward", 12, 100.0), beat(1, 3, "forward", 11, 99.99))
    assert [f.severity for f in hb.findings(2, {})] == ["info"]


def test_heartbeat_missing_rank_and_done():
    hb = heartbeats(beat(0, 1, "forward", 1, 10.0), beat(1, 1, "forward", 1, 10.0))
    stall = hb.findings(3, {})[0]
    assert stall.ranks == [2] and "never wrote a heartbeat" in stall.message
    done = heartbeats(beat(0, 9, "done", 50, 10.0), beat(1, 9, "done", 50, 11.0))
    assert all(f.severity == "info" for f in done.findings(2, {}))


FR_WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from datetime import timedelta
    flight = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    dist.barrier()
    if rank != 1:                       # rank 1 never issues the 5th collective
        dist.all_reduce(t, async_op=True)
    import torch._C._distributed_c10d as c10d
    with open(os.path.join(flight, f"rank_{rank}"), "wb") as fh:  # TORCH_NCCL_DEBUG_INFO_TEMP_FILE naming
        fh.write(c10d._dump_fr_trace())
    os._exit(0)
""")


@pytest.mark.slow
def test_real_flight_recorder_dumps_name_missing_rank(tmp_path):
    """Dumps written by torch's own flight recorder (gloo, 2 processes): rank 1 skipped collective #5."""
    pytest.importorskip("torch")
    flight = tmp_path / "logs" / "flight"
    flight.mkdir(parents=True)
    worker = tmp_path / "worker.py"
    worker.write_text(FR_WORKER)
    port = free_port()
    procs = []
    for r in range(2):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "TORCH_FR_BUFFER_SIZE": "64", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([PY, str(worker), str(flight)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(os.listdir(flight)) == ["rank_0", "rank_1"]
    report = diagnose(tmp_path / "logs")
    assert report.stalled_ranks == [1], report.to_dict()
    top = report.findings[0]
    assert top.kind == "stalled_rank" and "#5" in top.message and "all_reduce" in top.message
    assert "default_pg" in top.message
    assert set(top.evidence) == {"flight/rank_0:1", "flight/rank_1:1"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _reap_stalled_rank(proc: subprocess.Popen, hb_dir: Path, limit_s: float = 200) -> None:
    """Once rank 0 has failed and exited, SIGKILL the sleeping rank 1 (pid from its heartbeat) instead of
    waiting out torchrun's 30 s SIGTERM grace: the trainer turns SIGTERM into "checkpoint after this step",
    which a rank asleep before its collectives never reaches. What the logs and heartbeats hold is the same."""
    import signal
    import time

    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < limit_s:
        time.sleep(0.3)
        try:
            r0 = json.loads((hb_dir / "rank0.json").read_text())
            r1 = json.loads((hb_dir / "rank1.json").read_text())
        except (OSError, ValueError):
            continue
        if r0["phase"] == "error" and not _alive(r0["pid"]):
            time.sleep(1.0)  # let torchrun notice and send its SIGTERM first
            if _alive(r1["pid"]):
                os.kill(r1["pid"], signal.SIGKILL)
            return


@pytest.mark.slow
def test_trainer_stalled_rank_is_named_with_its_host(tmp_path):
    """torchrun + the bundled trainer on gloo; rank 1 sleeps before step 3's collectives, rank 0 times
    out after 3 s. diagnose on the run dir names rank 1 and its host."""
    pytest.importorskip("torch")
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    tiny_plan(run_dir, name="stall", steps=5, timeout_s=60)
    torchrun = Path(PY).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), "-m", "launcher.trainer", "--plan", str(run_dir / "plan.json"),
           "--run-dir", str(run_dir), "--inject-stall", "1:3", "--step-timeout-s", "3"]
    with open(run_dir / "logs" / "node0.log", "w") as log:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            _reap_stalled_rank(p, run_dir / "heartbeat")
            p.wait(timeout=240)
        finally:
            if p.poll() is None:
                p.kill()
    text = (run_dir / "logs" / "node0.log").read_text()
    assert p.returncode != 0, text
    assert (run_dir / "heartbeat" / "rank1.json").exists(), text
    host = json.loads((run_dir / "heartbeat" / "rank1.json").read_text())["host"]

    report = diagnose(run_dir)
    assert report.stalled_ranks == [1], (report.verdict, text[-3000:])
    assert report.stalled_hosts == {1: host}
    # each rank's watchdog dumped its stacks at half the 3 s step timeout: the verdict names the frame
    assert report.verdict.startswith(f"rank 1 on host {host} stuck in _stall_forever"), report.verdict
    kinds = [f.kind for f in report.findings]
    assert kinds[0] == "stalled_rank" and "gloo_timeout" in kinds
    assert any(e.startswith("logs/stacks/rank1.txt") for e in report.findings[0].evidence)
    beat_finding = next(f for f in report.findings if f.confidence == 2)
    assert beat_finding.ranks == [1] and any(e.startswith("heartbeat/rank1.json") for e in beat_finding.evidence)
    gloo = next(f for f in report.findings if f.kind == "gloo_timeout")
    assert gloo.ranks == [0] and any(e.startswith("logs/node0.log:") for e in gloo.evidence)

    # the CLI on the documented call, `launch diagnose <run_dir>/logs/`
    launch = REPO / ".venv" / "bin" / "launch"
    out = subprocess.run([str(launch) if launch.exists() else "launch", "diagnose", str(run_dir / "logs"),
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    d = json.loads(out.stdout)
    assert d["stalled_ranks"] == [1] and d["stalled_hosts"] == {"1": host}


def test_heartbeat_pipeline_stages_compared_within_stage():
    """pp=2: stage 1 issues fewer collectives per step than stage 0; only rank 3 lags inside its stage."""
    hb = heartbeats(beat(0, 5, "error", 30, 100.0), beat(1, 5, "error", 30, 100.0),
                    beat(2, 5, "error", 20, 100.0), beat(3, 5, "forward", 18, 80.0))
    role = {0: 0, 1: 0, 2: 1, 3: 1}
    stall = hb.findings(4, {}, role)[0]
    assert stall.kind == "stalled_rank" and stall.ranks == [3]
    assert hb.findings(4, {})[0].ranks == [2, 3]  # without the plan both stage-1 ranks look behind


def _dump(rank_status: tuple[int, int], seqs: list[int], ranks="[0, 1, 2]") -> dict:
    """A dump in the shape torch 2.13's _dump_fr_trace() writes (keys as in the real dumps above)."""
    enq, comp = rank_status
    return {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}},
            "pg_status": {"0": {"last_enqueued_collective": enq, "last_started_collective": -1,
                                "last_completed_collective": comp}},
            "entries": [{"process_group": ("0", "default_pg"), "collective_seq_id": s, "p2p_seq_id": 0,
                         "profiling_name": "nccl:all_reduce", "state": "completed" if s <= comp else "started",
                         "is_p2p": False} for s in seqs]}


def test_flight_dumps_everyone_entered_but_stuck_and_rank_without_dump():
    from launcher.diagnose.flight import Flight

    fl = Flight()
    for r in range(3):
        fl.add_dump(f"flight/rank_{r}", _dump((7, 6), list(range(1, 8))), f"flight/rank_{r}:1")
    (f,) = fl.findings({})
    assert f.kind == "flight_recorder" and "#7" in f.message and "stuck inside" in f.message
    fl = Flight()
    for r in (0, 2):
        fl.add_dump(f"flight/rank_{r}", _dump((7, 7), list(range(1, 8))), f"flight/rank_{r}:1")
    (f,) = fl.findings({1: "node1"})
    assert f.kind == "stalled_rank" and f.ranks == [1] and "left no flight-recorder dump" in f.message
    assert f.hosts == ["node1"] and f.confidence == 1
