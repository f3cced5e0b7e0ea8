"""`launch preflight --backend slurm` submits its batch job through the Slurm backend (the real test
Slurm of tests/services/slurm.py): the job is recorded like a training job, so `launch status` and
`launch cancel` (idempotent) take its id; its outputs go into --out-dir, which must be new."""

from __future__ import annotations

import json

import pytest

from tests.cli_helpers import invoke as launch
from tests.services.slurm import slurm_cluster  # noqa: F401  (session fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_preflight_job_is_a_recorded_submission(slurm_cluster, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LAUNCH4D_STATE", str(tmp_path / "state"))
    out = tmp_path / "out"
    hosts = ",".join(slurm_cluster.nodes)
    res = launch("preflight", "--backend", "slurm", "--hosts", hosts, "--partition", slurm_cluster.partition,
                 "--out-dir", out, "--time", "00:05:00", "--json")
    assert res.exit_code == 0, res.output
    job = json.loads(res.stdout)["job_id"]
    assert (out / "preflight.sbatch").exists() and not (out / "logs").exists()
    st = json.loads(launch("status", job, "--json").stdout)
    assert st["id"] == job and st["backend"] == "slurm" and st["state"] in ("PENDING", "RUNNING", "FAILED",
                                                                           "SUCCEEDED")
    first = json.loads(launch("cancel", job, "--json").stdout)
    assert first["cancelled"] is not first["already_ended"]
    slurm_cluster.wait_state(job, {"CANCELLED", "COMPLETED", "FAILED"})
    again = json.loads(launch("cancel", job, "--json").stdout)         # ended: said so, exit 0
    assert again == {**again, "cancelled": False, "already_ended": True}
    res = launch("preflight", "--backend", "slurm", "--hosts", hosts, "--out-dir", out)
    assert res.exit_code == 2 and "--out-dir" in res.output and "already exists" in res.output
