"""`launch preflight --dry-run` on every path says what would run where and touches nothing: no SSH
connection (a listening socket on loopback sees none), no kubeconfig loaded and no pod created (there
is no kubeconfig here: a real run fails for it, the dry run does not), no process on the host."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from tests.cli_helpers import launch
from tests.conftest import REPO

pytestmark = pytest.mark.unit


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`launch preflight ARGS` as a user's shell runs it."""
    return launch("preflight", *args, env=env, cwd=REPO, timeout=120)


def test_ssh_dry_run_connects_to_nothing():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        srv.settimeout(0.5)
        port = srv.getsockname()[1]
        p = cli("--hosts", "127.0.0.1", "--backend", "ssh", "--user", "bob", "--port", str(port), "--dry-run",
                "--json")
        assert p.returncode == 0, p.stderr
        with pytest.raises(socket.timeout):
            srv.accept()                                   # nobody knocked
    out = json.loads(p.stdout)
    (host,) = out["hosts"]
    assert out["dry_run"] and host["via"] == f"ssh bob@127.0.0.1:{port}"
    assert "nvidia-smi topo -m" in host["command"]


def test_k8s_dry_run_renders_the_pods_without_a_cluster(tmp_path):
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none"), "HOME": str(tmp_path)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    p = cli("--hosts", "gpu[01-02]", "--backend", "k8s", "--namespace", "ops", "--dry-run", "--json", env=env)
    assert p.returncode == 0, p.stderr
    pods = [h["pod"] for h in json.loads(p.stdout)["hosts"]]
    assert [(d["kind"], d["spec"]["nodeName"], d["metadata"]["namespace"]) for d in pods] == [
        ("Pod", "gpu01", "ops"), ("Pod", "gpu02", "ops")]
    real = cli("--hosts", "gpu01", "--backend", "k8s", env=env)    # without --dry-run it needs the cluster
    assert real.returncode == 2 and real.stderr.startswith("error: --backend k8s")


def test_local_dry_run_runs_nothing(tmp_path):
    out = tmp_path / "bw.json"
    p = cli("--dry-run", "--json", "-o", str(out))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["hosts"][0]["via"] == "this machine" and not out.exists()
