"""Slurm state handling without a cluster: every job state, squeue -> sacct -> job-log fallback,
sbatch's error lines, rank filtering of `srun --label` + torchrun-prefixed output.

The command outputs below follow the formats we ask for (`squeue -o '%i|%T|%r|%N|%M'`,
`sacct -P -o JobID,State,ExitCode,NodeList,Elapsed,Restarts`); the real-Slurm tests in
test_slurm_e2e.py exercise the same code against the real commands.
"""

from __future__ import annotations

from typing import cast

import pytest

from launcher.backends import JobStatus, filter_rank
from launcher.backends.slurm import SlurmBackend
from launcher.backends.slurm_login import SSHTarget, sbatch_error
from launcher.backends.slurm_status import (
    _SACCT_FIELDS,
    SHORT_STATES,
    SLURM_STATES,
    SlurmJobStatus,
    normalize_state,
    state_of,
)
from launcher.errors import UserError
from launcher.formats.jobs import JobRecord
from launcher.transport import CHUNK_LIMIT, Completed, Transport

pytestmark = pytest.mark.unit

ALL_STATES = ["BOOT_FAIL", "CANCELLED", "COMPLETED", "CONFIGURING", "COMPLETING", "DEADLINE", "FAILED",
              "NODE_FAIL", "OUT_OF_MEMORY", "PENDING", "PREEMPTED", "RUNNING", "RESV_DEL_HOLD", "REQUEUE_FED",
              "REQUEUE_HOLD", "REQUEUED", "RESIZING", "REVOKED", "SIGNALING", "SPECIAL_EXIT", "STAGE_OUT",
              "STOPPED", "SUSPENDED", "TIMEOUT"]


class FakeRunner:
    """A Transport with recorded Slurm answers: by "command subcommand" first (e.g. "sacct
    --helpformat"), then by command."""

    host = None

    def __init__(self, answers: dict[str, tuple[int, str, str]], files: dict[str, bytes] | None = None):
        self.answers, self.files = answers, files or {}
        self.calls: list[list[str]] = []

    def run(self, argv, cwd=None, timeout=60, **_):
        return Completed(*self.reply(argv))

    def reply(self, argv) -> tuple[int, str, str]:
        self.calls.append(argv)
        answer = self.answers.get(" ".join(argv[:2]), self.answers.get(argv[0]))
        return answer if answer is not None else (1, "", f"{argv[0]}: not answered")

    def get(self, path, offset=0, limit=CHUNK_LIMIT):
        data = self.files.get(path)
        return None if data is None else data[offset:offset + limit]

    def close(self):
        pass


@pytest.fixture(autouse=True)
def _fresh_sacct_probe():
    _SACCT_FIELDS.clear()
    yield
    _SACCT_FIELDS.clear()


def handle(requeue: bool = True) -> JobRecord:
    return JobRecord("slurm", "42", "job", "/runs/job", extra={"requeue": requeue})


def backend(runner: FakeRunner) -> SlurmBackend:
    """The backend over a recorded transport (duck-typed: only what the backend calls is answered)."""
    return SlurmBackend(transport_factory=lambda target: cast(Transport, runner))


def slurm_state(st: JobStatus) -> str:
    assert isinstance(st, SlurmJobStatus), st
    return st.slurm_state


def test_every_slurm_state_is_mapped():
    assert sorted(SLURM_STATES) == sorted(ALL_STATES)
    assert all(state_of(s) != "UNKNOWN" for s in ALL_STATES)
    assert set(SHORT_STATES.values()) == set(ALL_STATES)


@pytest.mark.parametrize("raw,state", [("CANCELLED by 0", "CANCELLED"), ("CANCELLED+", "CANCELLED"),
                                       ("CD", "COMPLETED"), ("PR", "PREEMPTED"), ("RQ", "REQUEUED"),
                                       ("OOM", "OUT_OF_MEMORY"), ("", "UNKNOWN"), ("WEIRD", "UNKNOWN")])
def test_normalize_state(raw, state):
    assert normalize_state(raw) == state


def test_squeue_answers_first():
    r = FakeRunner({"squeue": (0, "42|PENDING|BeginTime||0:00\n", ""),
                    "scontrol": (0, "JobId=42 JobName=job\n   Requeue=1 Restarts=1 BatchFlag=1\n", "")})
    st = backend(r).status(handle())
    assert (st.state, st.slurm_state, st.source, st.detail, st.restarts) == ("PENDING", "PENDING", "squeue",
                                                                             "BeginTime", 1)
    assert not st.done and ["sacct"] not in [c[:1] for c in r.calls]


@pytest.mark.parametrize("requeue,done", [(True, False), (False, True)])
def test_preempted_is_final_only_without_requeue(requeue, done):
    r = FakeRunner({"squeue": (0, "42|PREEMPTED|None|n[1-2]|1:02\n", ""), "scontrol": (1, "", "")})
    st = backend(r).status(handle(requeue))
    assert st.state == "PREEMPTED" and st.done is done and st.nodes == "n[1-2]"


# `sacct --helpformat` lists field names; only its whitespace-separated words are used, so these
# answers give just the words. The real sacct is asked in test_slurm_e2e.py.
def test_sacct_when_squeue_forgot_the_job():
    r = FakeRunner({"squeue": (1, "", "slurm_load_jobs error: Invalid job id specified\n"),
                    "sacct --helpformat": (0, "JobID State ExitCode NodeList Elapsed Restarts\n", ""),
                    "sacct": (0, "42|CANCELLED by 0|0:15|n[1-2]|00:00:07|0\n", "")})
    st = backend(r).status(handle())
    assert (st.state, st.slurm_state, st.source, st.exit_code, st.elapsed) == ("CANCELLED", "CANCELLED", "sacct",
                                                                               0, "00:00:07")
    assert st.done


def test_sacct_is_asked_only_for_fields_it_has():
    """Slurm 22.05's sacct has no Restarts: asking for it makes sacct refuse the whole query."""
    r = FakeRunner({"squeue": (0, "", ""),
                    "sacct --helpformat": (0, "Account JobID State ExitCode NodeList Elapsed\n", ""),
                    "sacct": (0, "42|COMPLETED|0:0|n1|00:00:03\n", "")})
    st = backend(r).status(handle())
    assert (st.state, st.source, st.restarts) == ("SUCCEEDED", "sacct", None)
    query = next(c for c in r.calls if c[0] == "sacct" and "-o" in c)
    assert query[query.index("-o") + 1] == "JobID,State,ExitCode,NodeList,Elapsed"
    backend(r).status(handle())
    assert sum(c[:2] == ["sacct", "--helpformat"] for c in r.calls) == 1     # probed once


def test_job_log_when_there_is_no_accounting():
    out = b"launch4d: job 42 restart 0\n0: [rank0]: step 1/2\nlaunch4d: step finished with exit code 3\n"
    r = FakeRunner({"squeue": (0, "", ""),
                    "sacct": (1, "", "sacct: error: Slurm accounting storage is disabled\n")},
                   {"/runs/job/logs/slurm-42.out": out})
    st = backend(r).status(handle())
    assert (st.state, st.exit_code, st.source) == ("FAILED", 3, "job log")
    assert "no Slurm accounting here (Slurm accounting storage is disabled)" in st.detail
    assert [c for c in r.calls if c[0] == "sacct"] == [["sacct", "--helpformat"]]   # asked once, then not
    r.files["/runs/job/logs/slurm-42.out"] = out + b"launch4d: requeueing job 42\n"
    assert backend(r).status(handle()).state == "UNKNOWN"      # requeued after that: not final
    r.files["/runs/job/logs/slurm-42.err"] = b"slurmstepd-n1: error: *** JOB 42 ON n1 CANCELLED AT 2026 ***\n"
    assert backend(r).status(handle()).state == "CANCELLED"


def test_sbatch_error_is_one_line():
    assert sbatch_error("sbatch: error: invalid partition specified: nope\n") == "invalid partition specified: nope"
    two = "sbatch: error: Batch job submission failed: Invalid account\nsbatch: error: x\n"
    assert sbatch_error(two) == "Batch job submission failed: Invalid account; x"
    assert sbatch_error("weird\n") == "weird"


def test_filter_rank():
    assert filter_rank("1: [rank3]: step 1/2 | loss 1", 3) == "step 1/2 | loss 1"
    assert filter_rank("1: [rank3]: step 1/2", 2) is None
    assert filter_rank("[rank12]:x", 12) == "x"
    assert filter_rank("launch4d: job 1", 0) is None
    assert filter_rank("launch4d: job 1", None) == "launch4d: job 1"


def test_cancel_is_idempotent():
    r = FakeRunner({"squeue": (0, "42|COMPLETED|None|n[1-2]|0:31\n", ""), "scontrol": (0, "", "")})
    assert backend(r).cancel(handle()) is False
    assert ["scancel", "42"] not in r.calls
    # ended between our look and scancel's: still no error
    r = FakeRunner({"squeue": (0, "42|RUNNING|None|n1|0:31\n", ""), "scontrol": (0, "", ""),
                    "scancel": (1, "", "scancel: error: Kill job error on job id 42: Job/step already completing "
                                       "or completed\n")})
    assert backend(r).cancel(handle()) is False


def test_logs_follow_stops_when_the_job_ends():
    path = "/runs/job/logs/slurm-42.out"
    r = FakeRunner({"squeue": (0, "42|COMPLETED|None|n1|0:10\n", ""), "scontrol": (0, "", "")},
                   {path: b"0: [rank0]: step 1/1\n0: [rank1]: hi\nlast-no-newline"})
    lines = list(backend(r).logs(handle(), follow=True, poll_s=0.01))
    assert lines == ["0: [rank0]: step 1/1", "0: [rank1]: hi", "last-no-newline"]
    assert list(backend(r).logs(handle(), rank=1)) == ["hi"]
    r.files.clear()
    with pytest.raises(UserError, match="no log yet"):
        list(backend(r).logs(handle()))


def test_missing_sacct_binary_falls_back_to_the_log():
    class NoSacct(FakeRunner):
        def reply(self, argv):
            if argv[0] == "sacct":
                raise UserError("sacct not found on PATH")
            return super().reply(argv)

    r = NoSacct({"squeue": (0, "", "")}, {"/runs/job/logs/slurm-42.out": b"launch4d: step finished with exit code 0\n"})
    st = backend(r).status(handle())
    assert (st.state, st.source) == ("SUCCEEDED", "job log") and "sacct not found" in st.detail


# --- a controller that is away for a while -----------------------------------------------------
DOWN = (1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n")


class FlakyRunner(FakeRunner):
    """squeue fails like a stopped slurmctld for the first `fails` calls, then answers."""

    def __init__(self, fails: int, answer: str, **kw):
        super().__init__({"squeue": (0, answer, ""), "scontrol": (0, "", "")}, **kw)
        self.fails = fails

    def reply(self, argv):
        if argv[0] == "squeue" and self.fails > 0:
            self.fails -= 1
            self.calls.append(argv)
            return DOWN
        return super().reply(argv)


class FakeClock:
    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s

    def __call__(self) -> float:
        return self.now


def test_wait_rides_out_a_controller_outage_with_backoff():
    from launcher.backends import wait

    r = FlakyRunner(3, "42|COMPLETED|None|n1|0:10\n")
    clock, notes = FakeClock(), []
    st = wait(backend(r), handle(), budget_s=120, on_retry=lambda e, d, n: notes.append((str(e), d, n)),
              sleep=clock.sleep, clock=clock)
    assert slurm_state(st) == "COMPLETED"
    assert [(d, n) for _, d, n in notes] == [(2.0, 1), (4.0, 2), (8.0, 3)]
    assert "Slurm controller not answering (Unable to contact slurm controller (connect failure))" in notes[0][0]


def test_wait_gives_up_after_the_stated_budget():
    from launcher.backends import wait

    r = FlakyRunner(10**6, "")
    clock = FakeClock()
    with pytest.raises(UserError, match=r"still failing after \d+ tries over 30 s \(retry budget 30 s\)"):
        wait(backend(r), handle(), budget_s=30, sleep=clock.sleep, clock=clock)
    assert clock.now == 30 and clock.sleeps[:3] == [2.0, 4.0, 8.0]


def test_wait_polls_with_backoff_while_the_job_runs():
    from launcher.backends import wait

    class Runs(FakeRunner):
        def __init__(self, clock):
            super().__init__({"scontrol": (0, "", "")})
            self.clock = clock

        def reply(self, argv):
            if argv[0] == "squeue":
                self.calls.append(argv)
                state = "RUNNING" if self.clock() < 600 else "COMPLETED"
                return 0, f"42|{state}|None|n1|0:10\n", ""
            return super().reply(argv)

    clock = FakeClock()
    r = Runs(clock)
    st = wait(backend(r), handle(), sleep=clock.sleep, clock=clock)
    assert slurm_state(st) == "COMPLETED"
    assert clock.sleeps[:6] == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0] and max(clock.sleeps) == 60.0
    assert len([c for c in r.calls if c[0] == "squeue"]) < 20          # not 300 polls at 2 s


def test_wait_keeps_one_transport_for_every_poll():
    """`status --wait` over SSH logs in once, not at every poll: wait() looks through one
    backend.watching(), which opens the login node's transport at the first look and closes it at the end."""
    from launcher.backends import wait

    class Counted(FlakyRunner):
        closed = 0

        def close(self):
            Counted.closed += 1

    r, opened = Counted(2, "42|COMPLETED|None|n1|0:10\n"), []

    def factory(target: SSHTarget | None) -> Transport:
        opened.append(target)
        return cast(Transport, r)

    be = SlurmBackend(transport_factory=factory)
    clock = FakeClock()
    st = wait(be, handle(), sleep=clock.sleep, clock=clock)
    assert slurm_state(st) == "COMPLETED" and len([c for c in r.calls if c[0] == "squeue"]) == 3
    assert len(opened) == 1 and Counted.closed == 1


def test_logs_follow_asks_the_scheduler_rarely_when_idle(monkeypatch):
    """An idle log is read every poll; squeue is asked at 2, 4, 8 ... s of idleness, not each poll."""
    import launcher.backends.tail as tail_mod  # the one tail loop of Slurm and local logs

    clock = FakeClock()
    monkeypatch.setattr(tail_mod.time, "monotonic", clock)
    monkeypatch.setattr(tail_mod.time, "sleep", clock.sleep)
    path = "/runs/job/logs/slurm-42.out"

    class Idle(FakeRunner):
        def reply(self, argv):
            if argv[0] == "squeue":
                self.calls.append(argv)
                if clock() < 300:
                    return (0, "42|RUNNING|None|n1|0:10\n", "") if clock() < 20 or clock() > 60 else DOWN
                return 0, "42|COMPLETED|None|n1|0:10\n", ""
            return super().reply(argv)

    r = Idle({"scontrol": (0, "", "")}, {path: b"0: [rank0]: step 1/9\n"})
    notes = []
    lines = list(backend(r).logs(handle(), follow=True, poll_s=1.0,
                                 on_retry=lambda e, d, n: notes.append(n)))
    assert lines == ["0: [rank0]: step 1/9"]
    squeue = [c for c in r.calls if c[0] == "squeue"]
    assert 300 <= clock() < 400 and len(squeue) < 15                  # ~300 reads of the file, few queries
    assert notes                                                        # the outage was noticed and survived


def test_a_waiting_job_names_the_nodes_its_check_left_out():
    """`scontrol show job` lines as Slurm 22.05 prints them; the reason comes from the node check's log."""
    r = FakeRunner({"squeue": (0, "42|PENDING|BadConstraints||0:00\n", ""),
                    "scontrol": (0, "JobId=42 JobName=job\n   Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:0\n"
                                    "   ReqNodeList=(null) ExcNodeList=bad0,n2\n", "")},
                   {"/runs/job/logs/nodecheck.log": b"2026-11-30T15:00:00Z job 42 restart 0: n2 left out: "
                                                    b"nvidia-smi: Unable to determine the device handle\n"})
    st = backend(r).status(handle())
    assert st.detail == ("BadConstraints; left out n2 (node check: nvidia-smi: Unable to determine the device "
                         "handle)")
    assert st.restarts == 1 and not st.done


def test_a_job_its_node_check_failed_says_which_check_on_which_node():
    """The batch script ended the job (exit 3) instead of requeueing it to pend for ever (issue 23):
    `launch status` says why, from the job's own output, with sacct and without it."""
    out = (b"launch4d: job 42 restart 0 nodes n[1-2] master n1:20042\n"
           b"launch4d: node check: n1 left out: missing: nvidia-smi is not installed on the node\n"
           b"launch4d: node check: n2 left out: missing: nvidia-smi is not installed on the node\n"
           b"launch4d: node check: nvidia-smi is not installed on the node on every allocated node (n1 n2): a "
           b"configuration error, not a node fault; not requeueing\n"
           b"launch4d: step finished with exit code 3\n")
    files = {"/runs/job/logs/slurm-42.out": out}
    r = FakeRunner({"squeue": (0, "", ""), "sacct --helpformat": (0, "JobID State ExitCode NodeList Elapsed\n", ""),
                    "sacct": (0, "42|FAILED|3:0|n[1-2]|00:00:09\n", "")}, files)
    st = backend(r).status(handle())
    assert (st.state, st.exit_code) == ("FAILED", 3)
    assert st.detail.startswith("node check: n1 left out: missing: nvidia-smi is not installed on the node; "
                                "node check: n2 left out") and "a configuration error, not a node fault" in st.detail
    _SACCT_FIELDS.clear()
    r = FakeRunner({"squeue": (0, "", ""), "sacct --helpformat": (1, "", "sacct: command not found")}, files)
    st = backend(r).status(handle())
    assert st.exit_code == 3 and "every allocated node (n1 n2)" in st.detail and "not in squeue" in st.detail


def test_a_job_a_planted_link_stopped_says_which_link():
    """The batch script stops at a link planted in its run dir or at its own output (exit 3, said on its
    stderr): `launch status` names the link (issue 23)."""
    files = {"/runs/job/logs/slurm-42.out": b"launch4d: step finished with exit code 3\n",
             "/runs/job/logs/slurm-42.err": b"launch4d: the job's output was a symbolic link (/runs/job/logs/"
                                            b"slurm-42.out -> /home/u/.bashrc); replaced by a file of its own; "
                                            b"not starting\n"}
    _SACCT_FIELDS.clear()
    r = FakeRunner({"squeue": (0, "", ""), "sacct --helpformat": (0, "JobID State ExitCode NodeList Elapsed\n", ""),
                    "sacct": (0, "42|FAILED|3:0|n1|00:00:01\n", "")}, files)
    st = backend(r).status(handle())
    assert (st.state, st.exit_code) == ("FAILED", 3)
    assert "slurm-42.out -> /home/u/.bashrc" in st.detail and st.detail.startswith("the job's output was a symbolic")
