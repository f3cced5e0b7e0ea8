"""Live hangs and stragglers with real processes (gloo on CPU): while a rank hangs, every rank's
Python stack lands in the run dir (the trainer's own watchdog, or `launch run` asking with SIGQUIT),
and `launch diagnose` names "rank R on host H stuck in <frame>"; a rank made slow is named a
straggler in `launch run`'s progress and by diagnose. No process is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launcher.backends import procs
from launcher.backends.local import LocalBackend
from launcher.diagnose import diagnose
from launcher.diagnose.heartbeat import Beat
from launcher.diagnose.stacks import Stacks
from launcher.diagnose.stragglers import stragglers
from launcher.formats.jobs import JobRecord
from tests.conftest import EXAMPLES, REPO
from tests.job_helpers import assert_nothing_left, reaped, recorded_marker, tiny_plan, wait_until

pytestmark = pytest.mark.e2e

LAUNCH = str(Path(sys.executable).with_name("launch"))


def beat(rank: int, busy: float, host: str = "h", phase: str = "forward") -> Beat:
    return Beat(rank=rank, host=host, pid=1, step=5, phase=phase, last_collective=None, collectives=9,
                updated=100.0, evidence=f"heartbeat/rank{rank}.json:1", step_time_s=1.0, busy_s=busy)


def test_straggler_rule_against_the_others_median():
    even = {r: beat(r, 0.30 + 0.01 * r) for r in range(8)}
    assert stragglers(even) == []
    one = {**even, 5: beat(5, 0.9)}
    assert [r for r, _, _ in stragglers(one)] == [5]
    assert [r for r, _, _ in stragglers({0: beat(0, 0.1), 1: beat(1, 0.6)})] == [1]  # two ranks suffice
    assert stragglers({0: beat(0, 0.100), 1: beat(1, 0.110)}) == []                  # noise, not a straggler
    assert stragglers({0: beat(0, 0.1)}) == []


def test_stacks_parser_reads_faulthandler_and_py_spy_dumps():
    fh = textwrap.dedent('''\
        # launch4d stack dump: rank 1 host node7 pid 42 at 2026-11-30T10:00:00Z: no progress for 60 s (watchdog)
        Current thread 0x00007f4ceb8146c0 (most recent call first):
          File "/x/launcher/trainer/stalls.py", line 89 in dump
          File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

        Thread 0x00007f8d7a48fb80 (most recent call first):
          File "/x/launcher/trainer/engine.py", line 251 in _stall_forever
          File "/x/launcher/trainer/engine.py", line 306 in train
          File "<frozen runpy>", line 198 in _run_module_as_main
        ''')
    spy = textwrap.dedent('''\
        # launch4d stack dump: rank 0 host node3 pid 41 at 2026-11-30T10:00:01Z: no output (launch run)
        Process 41: python -u -m launcher.trainer --plan plan.json
        Python v3.11.7 (/usr/bin/python3.11)

        Thread 41 (idle): "MainThread"
            all_reduce (torch/distributed/distributed_c10d.py:3252)
            wrapper (torch/distributed/c10d_logger.py:83)
            timed_sync (launcher/trainer/engine.py:199)
            train (launcher/trainer/engine.py:312)
        ''')
    st = Stacks()
    for name, text in (("stacks/rank1.txt", fh), ("stacks/rank0.txt", spy)):
        for n, line in enumerate(text.splitlines(), 1):
            st.feed(line, f"{name}:{n}", name)
    top = st.findings(2, {})[0]
    assert top.kind == "stalled_rank" and top.ranks == [1] and top.confidence == 4
    assert top.message.startswith("rank 1 on host node7 stuck in _stall_forever (launcher/trainer/engine.py:251)")
    assert "rank 0 waits in all_reduce (torch/distributed/distributed_c10d.py:3252) from timed_sync" in top.message
    # a dump the rank has since moved past is history, not a stall
    later = Beat(rank=1, host="node7", pid=42, step=9, phase="forward", last_collective=None, collectives=30,
                 updated=1_900_000_000.0, evidence="hb")
    assert all(f.kind != "stalled_rank" for f in st.findings(2, {}, {1: later}))


def sleeper(tmp_path: Path) -> subprocess.Popen:
    """A real process set up as a trainer is: StallWatchdog registered, a heartbeat naming its pid."""
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from launcher.trainer.stalls import StallWatchdog
        w = StallWatchdog({str(tmp_path)!r}, 3, "hostA", after_s=0)
        os.makedirs({str(tmp_path / 'heartbeat')!r}, exist_ok=True)
        beat = json.dumps({{"rank": 3, "host": "hostA", "pid": os.getpid(), "step": 1, "phase": "forward",
                           "updated": time.time()}})
        def waiting_for_godot():
            with open({str(tmp_path / 'heartbeat' / '.rank3.tmp')!r}, "w") as f:
                f.write(beat)
            os.replace({str(tmp_path / 'heartbeat' / '.rank3.tmp')!r}, {str(tmp_path / 'heartbeat' / 'rank3.json')!r})
            time.sleep(120)  # the heartbeat exists only once this function runs: a dump finds it here
        waiting_for_godot()
    """))
    return subprocess.Popen([sys.executable, str(script)], env={**os.environ, procs.MARKER: "dumps"},
                            start_new_session=True)


def read_stacks(text: str) -> Stacks:
    st = Stacks()
    for n, line in enumerate(text.splitlines(), 1):
        st.feed(line, f"rank3.txt:{n}", "rank3.txt")
    return st


def test_launch_asks_a_live_process_for_its_stack_with_sigquit(tmp_path):
    """The backend's dump_stacks on a real process that registered the trainer's StallWatchdog: the
    signal reaches faulthandler, which writes the stack under our header; a stranger is not signalled."""
    proc = sleeper(tmp_path)
    try:
        assert wait_until(lambda: (tmp_path / "heartbeat" / "rank3.json").exists()
                          and procs.catches(proc.pid, signal.SIGQUIT), 60)
        h = JobRecord("local", f"local-{proc.pid}", "t", str(tmp_path), None, extra={"pid": proc.pid,
                                                                                      "marker": "dumps"})
        stranger = JobRecord("local", "x", "t", str(tmp_path), None, extra={"pid": proc.pid, "marker": "other"})
        assert LocalBackend().dump_stacks(stranger, "test", py_spy="") == []
        assert LocalBackend().dump_stacks(h, "asked by a test", py_spy="") == [3]  # the signal path
        out = tmp_path / "logs" / "stacks" / "rank3.txt"
        assert wait_until(lambda: "waiting_for_godot" in out.read_text(), 20), out.read_text()
        assert proc.poll() is None  # a dump does not stop anything
        text = out.read_text()
        assert "# launch4d stack dump: rank 3 host hostA" in text and "asked by a test" in text
        info = read_stacks(text).findings(None, {})[-1]
        assert "rank 3 is in waiting_for_godot" in info.message
    finally:
        proc.kill()
        proc.wait()


def test_launch_does_not_write_a_stack_request_through_a_planted_link(tmp_path):
    """logs/stacks/rank3.txt turned into a link while the job runs: `launch run`'s stack request for that
    rank writes nothing through it and signals nothing (issue 23; the trainer stops at the link itself)."""
    proc = sleeper(tmp_path)
    try:
        assert wait_until(lambda: (tmp_path / "heartbeat" / "rank3.json").exists()
                          and procs.catches(proc.pid, signal.SIGQUIT), 60)
        victim = tmp_path / "victim.txt"
        victim.write_text("precious\n")
        out = tmp_path / "logs" / "stacks" / "rank3.txt"
        out.unlink()
        out.symlink_to(victim)
        h = JobRecord("local", f"local-{proc.pid}", "t", str(tmp_path), None, extra={"pid": proc.pid,
                                                                                      "marker": "dumps"})
        assert LocalBackend().dump_stacks(h, "asked by a test", py_spy="") == []
        assert victim.read_text() == "precious\n" and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_launch_uses_py_spy_where_installed(tmp_path):
    """py-spy (a test dependency) dumps the same process from outside; the parser reads its format."""
    from launcher.backends.local import find_py_spy

    spy = find_py_spy()
    if spy is None:
        pytest.skip("py-spy is not installed (pip install py-spy; it is in the [test] extra)")
    proc = sleeper(tmp_path)
    try:
        assert wait_until(lambda: (tmp_path / "heartbeat" / "rank3.json").exists(), 60)
        h = JobRecord("local", f"local-{proc.pid}", "t", str(tmp_path), None, extra={"pid": proc.pid,
                                                                                      "marker": "dumps"})
        assert LocalBackend().dump_stacks(h, "asked by py-spy", py_spy=spy) == [3]
        text = (tmp_path / "logs" / "stacks" / "rank3.txt").read_text()
        if f"Process {proc.pid}:" not in text:  # dump_stacks fell back to the signal
            pytest.skip("py-spy could not attach here (ptrace not permitted)")
        assert "waiting_for_godot (" in text and "asked by py-spy" in text
        info = read_stacks(text).findings(None, {})[-1]
        assert "rank 3 is in waiting_for_godot" in info.message
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_stalled_trainer_dumps_its_stacks_and_diagnose_names_the_frame(tmp_path):
    """torchrun + the trainer: rank 1 stops before step 3; after 2 s without progress every rank's
    watchdog writes its stacks; diagnose says rank 1 on its host is stuck in _stall_forever."""
    rd = tmp_path / "run"
    plan = tiny_plan(rd)
    token = "stall-dumps"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           "-m", "launcher.trainer", "--plan", str(plan), "--run-dir", str(rd), "--inject-stall", "1:3",
           "--stall-dump-s", "2", "--step-timeout-s", "90"]
    log = open(tmp_path / "node0.log", "wb")
    agent = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "OMP_NUM_THREADS": "1", procs.MARKER: token,
                                  "TORCH_FR_BUFFER_SIZE": "200"})
    try:
        stacks = [rd / "logs" / "stacks" / f"rank{r}.txt" for r in (0, 1)]
        assert wait_until(lambda: all(p.exists() and "in train" in p.read_text() for p in stacks), 180), \
            (tmp_path / "node0.log").read_text()[-3000:]
        assert (rd / "logs" / "flight" / "rank_0").exists()  # the flight recorder, dumped beside the stacks
        # asked from outside with the dump signal, the real trainers (checkpoint handlers installed) write
        # their stacks again and go on: the dump signal is not a checkpoint signal
        h = JobRecord("local", f"local-{agent.pid}", "t", str(rd), None, extra={"pid": agent.pid, "marker": token})
        assert sorted(LocalBackend().dump_stacks(h, "asked by the test", py_spy="")) == [0, 1]
        assert wait_until(lambda: all(p.read_text().count("in train") >= 2 for p in stacks), 30)
        assert all("asked by the test" in p.read_text() for p in stacks)
        assert len([q for q in procs.marked((procs.MARKER, token)) if q != agent.pid]) >= 2  # still running
        assert not (rd / "checkpoints" / "latest").exists()
        assert "# nccl ras: skipped" in stacks[0].read_text()
        host = json.loads((rd / "heartbeat" / "rank1.json").read_text())["host"]
        report = diagnose(rd)
        assert report.verdict.startswith(f"rank 1 on host {host} stuck in _stall_forever "
                                         "(launcher/trainer/engine.py:"), report.verdict
        assert report.stalled_ranks == [1]
        out = subprocess.run([LAUNCH, "diagnose", str(rd / "logs"), "--json"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 1 and json.loads(out.stdout)["verdict"].startswith(f"rank 1 on host {host} stuck")
    finally:
        agent.kill()
        agent.wait()
        log.close()
        assert_nothing_left((procs.MARKER, token))


@pytest.mark.slow
def test_launch_run_names_a_straggler_then_the_stalled_rank(tmp_path):
    """`launch run` of the tiny job with rank 1 slowed by 1 s a step and stopping before step 6
    (both through the job file's backend.env): the progress names rank 1 a straggler, then, once rank 0
    has been quiet for stall_dump_s, where each rank is stuck; two Ctrl-C leave nothing running."""
    env = {**os.environ, "LAUNCH4D_STATE": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"}
    job = tmp_path / "job.yaml"
    text = (EXAMPLES / "tiny-cpu.yaml").read_text()
    text = text.replace("  log_dir: runs\n", "  log_dir: runs\n  env:\n    LAUNCH4D_INJECT_SLOW: \"1:1.0\"\n"
                                             "    LAUNCH4D_INJECT_STALL: \"1:6\"\n")
    text = text.replace("  collective_timeout_s: 120\n", "  collective_timeout_s: 120\n  stall_dump_s: 4\n")
    job.write_text(text)
    rd = tmp_path / "rd"
    run = subprocess.Popen([LAUNCH, "run", str(job), "--nproc", "2", "--run-dir", str(rd)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    err_lines: list[str] = []
    with reaped(run) as markers:
        import threading

        stderr = run.stderr
        assert stderr is not None
        reader = threading.Thread(target=lambda: err_lines.extend(stderr), daemon=True)
        reader.start()
        assert wait_until(lambda: any("stuck in _stall_forever" in ln for ln in err_lines), 240), "".join(err_lines)
        markers.append(marker := recorded_marker(tmp_path / "state"))
        run.send_signal(signal.SIGINT)
        time.sleep(0.5)
        run.send_signal(signal.SIGINT)
        run.wait(timeout=120)
        reader.join(timeout=10)
        err = "".join(err_lines)
        slow = [ln for ln in err_lines if ln.startswith("launch: straggler: rank 1 on host")]
        assert slow, err
        stuck = next(ln for ln in err_lines if "stuck in _stall_forever" in ln)
        assert "rank 1 on host" in stuck and "launch diagnose" in stuck
        assert_nothing_left(marker)
        report = diagnose(rd)
        assert report.verdict.startswith("rank 1 on host") and " stuck in _stall_forever" in report.verdict
        assert any(f.kind == "straggler" and f.ranks == [1] for f in report.findings), report.to_dict()
