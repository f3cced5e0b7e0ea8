"""One job record (launcher.formats.jobs.JobRecord): what a backend's submit returns is what the state
file keeps and what a later shell's status/logs/cancel get back, the state file's entries as before."""

from __future__ import annotations

import json

import pytest

from launcher.backends import jobstate
from launcher.formats.jobs import STATE_KEYS, JobRecord

pytestmark = pytest.mark.unit


def test_a_submitted_record_comes_back_from_the_state_file_as_the_backends_take_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCH4D_STATE", str(tmp_path))
    job = JobRecord("slurm", "42", "train", "/runs/train", log_path="/runs/train/logs/slurm-42.out",
                    request="cd /runs/train && sbatch --parsable train.sbatch\n\n#!/bin/bash",
                    log_dir="/runs/train/logs", extra={"host": "login1", "remote_dir": "/home/u/runs/train",
                                                       "ssh": {"host": "login1"}, "requeue": True})
    jobstate.record(job)
    entry = json.loads(jobstate.state_file().read_text())["jobs"][0]
    assert set(entry) == STATE_KEYS                     # the file's entry has the keys it always had
    assert (entry["host"], entry["remote_dir"], entry["namespace"]) == ("login1", "/home/u/runs/train", None)
    assert entry["extra"]["log_path"] == job.log_path and "request" not in entry
    back = jobstate.lookup("train")
    assert (back.backend, back.id, back.run_dir, back.log_path, back.log_dir, back.submitted_at) == (
        "slurm", "42", "/runs/train", job.log_path, "/runs/train/logs", job.submitted_at)
    assert back.extra["ssh"] == {"host": "login1"} and back.host == "login1" and back.request is None


def test_an_entry_written_before_the_one_record_still_reads():
    """An older entry's namespace stood beside extra only; the Kubernetes backend reads it from extra."""
    rec = JobRecord.from_state({"id": "tiny", "backend": "k8s", "name": "tiny", "run_dir": "/r", "log_dir": "/r/logs",
                                "submitted_at": "2026-11-29T09:00:00", "host": None, "remote_dir": None,
                                "namespace": "team-a", "extra": {"kind": "PyTorchJob"}})
    assert rec.namespace == "team-a" and rec.extra == {"kind": "PyTorchJob", "namespace": "team-a"}
    assert rec.log_path is None and rec.to_state()["namespace"] == "team-a"
