"""`launch preflight --plan --backend ssh` over real SSH: two private sshd "nodes" on loopback
(tests/services/sshd.py), one torchrun per node started through the SSH runner with the spec inlined in
the command and the static rendezvous the job uses (node i of the plan is host i), gloo between them.
The tiny 2-node CPU plan (examples/tiny-k8s.yaml's: tp2 x dp2) with its assumed bandwidths set to 0.5 MB/s,
which gloo here reaches many times over; then rank 3's all-gathers delayed by 0.5 s in its own process
(a sitecustomize on node02's sessions' PYTHONPATH, set by that sshd), and the report names TP group 1
on node02 and no other group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from tests.conftest import EXAMPLES, REPO
from tests.integration.test_preflight_plan import SLOW_SITE
from tests.services.sshd import SshCluster, require_sshd

pytestmark = [pytest.mark.integration, pytest.mark.slow]
HOSTS = ["node01", "node02"]


@pytest.fixture(scope="module")
def plan2(tmp_path_factory) -> Path:
    """The tiny 2-node CPU plan, assumed bandwidths 0.5 MB/s (a slow cluster)."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    res = CliRunner().invoke(cli, ["plan", str(EXAMPLES / "tiny-k8s.yaml"), "-o", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    data["bandwidth"].update(intra_gbs=5e-4, net_per_gpu_gbs=5e-4, source="test: a slow cluster")
    out.write_text(json.dumps(data))
    return out


def cluster(root: Path, env: dict[str, str] | None = None) -> SshCluster:
    require_sshd()
    c = SshCluster(root, HOSTS, env=env)
    c.start()
    c.write_known_hosts()
    return c


def preflight_ssh(c: SshCluster, plan: Path, *extra: str) -> subprocess.CompletedProcess:
    """The real command: node01 and node02 are ssh_config aliases of 127.0.0.1 (the rendezvous address)."""
    return subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", "preflight", "--plan",
                           str(plan), "--backend", "ssh", "--hosts", ",".join(HOSTS), "--ssh-config", str(c.ssh_config),
                           "--known-hosts", str(c.known_hosts), "--python", sys.executable, "--master-addr",
                           "127.0.0.1", "--iters", "3", *extra], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)


def test_every_group_is_measured_on_the_hosts_the_plan_names(plan2, tmp_path):
    c = cluster(tmp_path / "sshd")
    try:
        out = tmp_path / "measured.json"
        res = preflight_ssh(c, plan2, "--json", "-o", str(out))
    finally:
        c.stop()
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rep = json.loads(res.stdout)
    assert rep["ok"] and rep["backend"] == "gloo" and rep["slow"] == []
    where = {(g["kind"], tuple(g["ranks"])): tuple(g["hosts"]) for g in rep["groups"]}
    assert where == {("tp", (0, 1)): ("node01", "node01"), ("tp", (2, 3)): ("node02", "node02"),
                     ("dp", (0, 2)): ("node01", "node02"), ("dp", (1, 3)): ("node01", "node02")}
    assert all(g["measured_s"] > 0 and len(g["samples_s"]) == 3 for g in rep["groups"])
    assert json.loads(out.read_text())["hosts"] == HOSTS


def test_a_slowed_group_on_one_host_is_named(plan2, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_SITE)
    c = cluster(tmp_path / "sshd", env={"PYTHONPATH": f"{site}:{REPO}", "L4D_SLOW_RANK": "3", "L4D_SLOW_S": "0.5"})
    try:
        res = preflight_ssh(c, plan2)
    finally:
        c.stop()
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    slow = res.stdout.split("slower than the plan assumed by more than 30%:")[1]
    assert [ln.strip().split(":")[0] for ln in slow.splitlines() if " group " in ln] == [
        "TP group 1, ranks 2,3 on node02 (intra-node)"]
    assert "suspect host(s): node02" in res.stdout

