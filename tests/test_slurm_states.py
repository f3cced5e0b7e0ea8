"""Slurm state handling without a cluster: every job state, squeue -> sacct -> job-log fallback,
sbatch's error lines, rank filtering of `srun --label` + torchrun-prefixed output.

The command outputs below follow the formats we ask for (`squeue -o '%i|%T|%r|%N|%M'`,
`sacct -P -o JobID,State,ExitCode,NodeList,Elapsed,Restarts`); the real-Slurm tests in
test_slurm_e2e.py exercise the same code against the real commands.
"""

from __future__ import annotations

import pytest

from launcher.backends import JobHandle
from launcher.backends.slurm import (
    SHORT_STATES,
    SLURM_STATES,
    SlurmBackend,
    filter_rank,
    normalize_state,
    sbatch_error,
    state_of,
)
from launcher.errors import UserError

ALL_STATES = ["BOOT_FAIL", "CANCELLED", "COMPLETED", "CONFIGURING", "COMPLETING", "DEADLINE", "FAILED",
              "NODE_FAIL", "OUT_OF_MEMORY", "PENDING", "PREEMPTED", "RUNNING", "RESV_DEL_HOLD", "REQUEUE_FED",
              "REQUEUE_HOLD", "REQUEUED", "RESIZING", "REVOKED", "SIGNALING", "SPECIAL_EXIT", "STAGE_OUT",
              "STOPPED", "SUSPENDED", "TIMEOUT"]


class FakeRunner:
    host = None

    def __init__(self, answers: dict[str, tuple[int, str, str]], files: dict[str, bytes] | None = None):
        self.answers, self.files, self.calls = answers, files or {}, []

    def run(self, argv, cwd=None, timeout=60):
        self.calls.append(argv)
        return self.answers.get(argv[0], (1, "", f"{argv[0]}: not answered"))

    def read_from(self, path, offset):
        data = self.files.get(path)
        return None if data is None else data[offset:]

    def close(self):
        pass


def handle(requeue: bool = True) -> JobHandle:
    return JobHandle("slurm", "42", "job", "/runs/job", extra={"requeue": requeue})


def backend(runner: FakeRunner) -> SlurmBackend:
    return SlurmBackend(runner_factory=lambda target: runner)


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


def test_sacct_when_squeue_forgot_the_job():
    r = FakeRunner({"squeue": (1, "", "slurm_load_jobs error: Invalid job id specified\n"),
                    "sacct": (0, "42|CANCELLED by 0|0:15|n[1-2]|00:00:07|0\n", "")})
    st = backend(r).status(handle())
    assert (st.state, st.slurm_state, st.source, st.exit_code, st.elapsed) == ("CANCELLED", "CANCELLED", "sacct",
                                                                               0, "00:00:07")
    assert st.done


def test_job_log_when_there_is_no_accounting():
    out = b"launch4d: job 42 restart 0\n0: [rank0]: step 1/2\nlaunch4d: step finished with exit code 3\n"
    r = FakeRunner({"squeue": (0, "", ""),
                    "sacct": (1, "", "sacct: error: Slurm accounting storage is disabled\n")},
                   {"/runs/job/logs/slurm-42.out": out})
    st = backend(r).status(handle())
    assert (st.state, st.exit_code, st.source) == ("FAILED", 3, "job log")
    assert "accounting storage is disabled" in st.detail
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


def test_cancel_refuses_a_finished_job():
    r = FakeRunner({"squeue": (0, "42|COMPLETED|None|n[1-2]|0:31\n", ""), "scontrol": (0, "", "")})
    with pytest.raises(UserError, match="already ended"):
        backend(r).cancel(handle())
    assert ["scancel", "42"] not in r.calls


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
        def run(self, argv, cwd=None, timeout=60):
            if argv[0] == "sacct":
                raise UserError("sacct not found on PATH")
            return super().run(argv, cwd, timeout)

    r = NoSacct({"squeue": (0, "", "")}, {"/runs/job/logs/slurm-42.out": b"launch4d: step finished with exit code 0\n"})
    st = backend(r).status(handle())
    assert (st.state, st.source) == ("SUCCEEDED", "job log") and "sacct not found" in st.detail
