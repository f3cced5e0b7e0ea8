"""Keeping bad nodes out: `launch preflight ... --drain [--apply]` and `launch preflight drain BWMAP`.

The failing node comes from a real capture (a kernel log with Xid 79, "fallen off the bus") judged
by `preflight import`; the drain is applied to the real test Slurm (tests/services/slurm.py) and a
submitted job must then land on the other node. The printed commands are checked by letting bash
read them back into arguments.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from checks.drain import REASON_MAX, plan_drain
from launcher.formats.bwmap import BandwidthMap, CheckResult, NodeReport
from tests.cli_helpers import launch as run_launch
from tests.conftest import EXAMPLES, REPO, shared_file
from tests.services.slurm import slurm_cluster  # noqa: F401  (session fixture)

pytestmark = pytest.mark.e2e

XID79 = ("xid", "akash-provider-gpu-xid79-fallen-off-bus-dmesg-T-crash-dump-multiline.txt")


def launch(*args: object) -> tuple[int, str]:
    """The real `launch` entry point (its exit status is the command's), stdout and stderr together."""
    p = run_launch(*args, cwd=REPO, timeout=900)
    return p.returncode, p.stdout + p.stderr


def faulty_map(tmp_path: Path) -> Path:
    """`preflight import` of two nodes: n1's kernel log clean, n2's the real Xid 79 capture."""
    d = tmp_path / "raw"
    for h in ("n1", "n2"):
        (d / h).mkdir(parents=True)
    (d / "n1" / "xid.txt").write_text("")
    shutil.copy(shared_file(*XID79), d / "n2" / "xid.txt")
    out = tmp_path / "bw.json"
    p = subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", "preflight", "import", str(d),
                        "-o", str(out), "--drain", "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 1, p.stderr                         # a check failed
    data = json.loads(p.stdout)
    assert data["exclude"] == ["n2"]
    assert [n["node"] for n in data["drain"]["nodes"]] == ["n2"] and not data["drain"]["applied"]
    return out


def bash_words(line: str) -> list[str]:
    """The arguments bash makes of a printed command line (the command word replaced by printf)."""
    cmd, rest = line.split(" ", 1)
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {rest}"], capture_output=True, text=True, check=True)
    return [cmd, *out.stdout.split("\0")[:-1]]


def test_the_printed_drain_is_exactly_what_apply_runs_even_for_a_hostile_reason():
    msg = "12.5 GB/s < 100 GB/s; $(touch /tmp/pwned) `id` 'quoted' \"dq\"\nsecond line\\"
    bw = BandwidthMap(nodes={"n 1": NodeReport(host="n 1")}, exclude=["n 1"],
                      checks=[CheckResult("n 1", "nccl_node", "fail", 12.5, 100.0, msg),
                              CheckResult("n 1", "ecc", "fail", 3, 0, ""),
                              CheckResult("n 1", "ib", "pass", 8, 400, "")])
    for scheduler in ("slurm", "k8s"):
        (action,) = plan_drain(bw, scheduler)
        assert action.reason.startswith("launch4d: nccl_node: 12.5 GB/s < 100 GB/s; $(touch")
        assert action.reason.endswith("(+1 more)") and "\n" not in action.reason
        for argv, line in zip(action.argv, action.lines, strict=True):
            assert "\n" not in line
            assert bash_words(line) == argv
    slurm = plan_drain(bw, "slurm")[0].argv[0]
    assert slurm[:4] == ["scontrol", "update", "nodename=n 1", "state=drain"]
    long = BandwidthMap(exclude=["a"], checks=[CheckResult("a", "xid", "fail", None, None, "x" * 1000)])
    assert len(plan_drain(long)[0].reason) <= REASON_MAX


def test_drain_needs_a_valid_map_and_apply_needs_drain(tmp_path):
    bad = tmp_path / "bw.json"
    bad.write_text('{"version": 99}')
    rc, out = launch("preflight", "drain", bad)
    assert rc == 2 and "version 99 is not supported" in out
    rc, out = launch("preflight", "import", tmp_path, "--apply")
    assert rc == 2 and "--apply and --scheduler go with --drain" in out
    rc, out = launch("preflight", "--hosts", "a", "--backend", "slurm", "--level", "long", "--dry-run",
                     "--tool-timeout", "dcgmi=7200")
    assert rc == 0 and "--level long --tool-timeout 'dcgmi=7200'" in out and "#SBATCH --time=04:00:00" in out


@pytest.mark.slow
def test_a_failed_node_is_drained_on_slurm_and_the_next_job_avoids_it(slurm_cluster, tmp_path,  # noqa: F811
                                                                     monkeypatch):
    monkeypatch.setenv("LAUNCH4D_STATE", str(tmp_path / "state"))
    bw = faulty_map(tmp_path)
    reason = BandwidthMap.load(bw).checks
    rc, out = launch("preflight", "drain", bw, "--apply", "--json")
    try:
        assert rc == 0, out
        res = json.loads(out[out.index("{"):])["drain"]["results"]
        assert [(r["node"], r["rc"]) for r in res] == [("n2", 0)]
        shown = slurm_cluster.run("scontrol", "show", "node", "n2").stdout
        assert "DRAIN" in shown
        want = next(c.message for c in reason if c.node == "n2" and c.status == "fail")
        assert f"Reason=launch4d: xid: {want} [root@" in shown
        why = slurm_cluster.run("sinfo", "-h", "-R", "-N", "-o", "%N|%E").stdout.strip().splitlines()
        assert f"n2|launch4d: xid: {want}" in why

        # a one-node job now lands on n1 although n2 is idle
        d = yaml.safe_load((EXAMPLES / "tiny-slurm.yaml").read_text())
        d["name"] = "drain-avoid"
        d["cluster"]["nodes"] = 1
        d["train"].update(steps=1, checkpoint_every=0)
        d["backend"]["log_dir"] = str(tmp_path / "runs")
        d["backend"]["slurm"]["python"] = sys.executable
        d["diagnostics"]["init_timeout_s"] = 300
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump(d))
        rc, out = launch("submit", job, "--json")
        assert rc == 0, out
        jid = json.loads(out[out.index("{"):])["id"]
        rc, out = launch("status", jid, "--wait", "--timeout", "600", "--interval", "1", "--max-interval", "5",
                         "--json")
        assert json.loads(out[out.index("{"):])["slurm_state"] == "COMPLETED", out
        shown = slurm_cluster.run("scontrol", "show", "job", jid).stdout
        assert re.search(r"(?m)^\s+NodeList=n1$", shown), shown
    finally:
        slurm_cluster.run("scontrol", "update", "nodename=n2", "state=resume", check=False)


def test_a_version_1_map_still_loads_and_drains(tmp_path):
    """Maps written before the levels (version 1, no all-to-all or RDMA fields) stay usable."""
    old = {"version": 1, "nodes": {"n2": {"host": "n2", "gpus": 8, "status": "fail"}}, "exclude": ["n2"],
           "checks": [{"node": "n2", "check": "ecc", "status": "fail", "value": 7, "threshold": 0, "message": ""}]}
    f = tmp_path / "old.json"
    f.write_text(json.dumps(old))
    bw = BandwidthMap.load(f)
    assert bw.alltoall_inter_busbw_gbs is None and bw.nodes["n2"].rdma_gbps == {} and bw.level == "quick"
    rc, out = launch("preflight", "drain", f)
    assert rc == 0 and out.strip() == "scontrol update nodename=n2 state=drain reason='launch4d: ecc: 7 (threshold 0)'"


@pytest.mark.slow
def test_the_example_prolog_drains_its_own_node_on_a_failed_quick_check(slurm_cluster, tmp_path):  # noqa: F811
    """examples/slurm-prolog.sh run as slurmd would run it (SLURMD_NODENAME set) on a "node" whose tools
    are the replay tools: n1 healthy exits 0 and stays in service; n2, whose kernel log is the real
    Xid 79 capture, is drained by launch4d with the reason and exits 1 (Slurm then requeues the job)."""
    from tests.conftest import fixtures_dir
    from tests.replay import install
    from tests.replay.constructed import gpu_query_csv, ibstat_text, nvlink_status

    for name, text in {"gq.csv": gpu_query_csv(), "nv.txt": nvlink_status(), "ib.txt": ibstat_text()}.items():
        (tmp_path / name).write_text(text)
    wrapper = tmp_path / "launch"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'from launcher.cli import main; main()' \"$@\"\n")
    wrapper.chmod(0o755)

    def prolog(node: str, **bad: str) -> tuple[int, str]:
        d = tmp_path / node
        install(d, tmp_path, fixtures_dir(), TOPO="topo/h100-sxm-8gpu-12nic-mlx5-1numa.txt",
                GPU_QUERY=tmp_path / "gq.csv", NVLINK=tmp_path / "nv.txt", IBSTAT=tmp_path / "ib.txt", **bad)
        log = tmp_path / f"{node}.log"
        env = {**slurm_cluster.env, "PATH": f"{d / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
               "SLURMD_NODENAME": node, "SLURM_JOB_ID": "42", "LAUNCH4D": str(wrapper),
               "LAUNCH4D_PROLOG_LOG": str(log)}
        p = subprocess.run(["bash", str(EXAMPLES / "slurm-prolog.sh")], env=env,
                           capture_output=True, text=True, timeout=300)
        return p.returncode, log.read_text()

    try:
        rc, log = prolog("n1")
        assert rc == 0, log
        assert "node n1 job 42: exit 0" in log and "no node failed: nothing to drain" in log
        assert "DRAIN" not in slurm_cluster.run("scontrol", "show", "node", "n1").stdout
        rc, log = prolog("n2", DMESG="/".join(XID79))
        assert rc == 1, log
        assert "node n2 job 42: exit 1" in log and "FAIL  n2" in log
        shown = slurm_cluster.run("scontrol", "show", "node", "n2").stdout
        assert "DRAIN" in shown and "Reason=launch4d: xid: " in shown
    finally:
        slurm_cluster.run("scontrol", "update", "nodename=n1,n2", "state=resume", check=False)
