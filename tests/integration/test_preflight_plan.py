"""`launch preflight --plan` on this machine: the tiny CPU plan's groups measured by real torch.distributed
(gloo, 4 processes), compared with what the plan assumed; one rank's all-gather slowed (a delay injected
into that process's torch.distributed, through a sitecustomize the test puts on PYTHONPATH) makes its
TP group slow, and the report names that group, its ranks, host and link, and no other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.plan.model import Plan
from tests.conftest import EXAMPLES, REPO

pytestmark = pytest.mark.integration

#: Installed into the worker processes: rank L4D_SLOW_RANK sleeps L4D_SLOW_S before every all-gather.
SLOW_SITE = textwrap.dedent("""
    import os
    if os.environ.get("L4D_SLOW_RANK") is not None and os.environ.get("RANK") == os.environ["L4D_SLOW_RANK"]:
        import time
        import torch.distributed as dist
        _all_gather = dist.all_gather_into_tensor
        def _slow(*args, **kwargs):
            time.sleep(float(os.environ["L4D_SLOW_S"]))
            return _all_gather(*args, **kwargs)
        dist.all_gather_into_tensor = _slow
""")


@pytest.fixture(scope="module")
def modest_plan(tmp_path_factory) -> Path:
    """The tiny CPU plan, its assumed bandwidths set to 0.5 MB/s: what gloo on a loaded 2-core box
    reaches many times over, while a collective delayed by 0.5 s does not."""
    d = tmp_path_factory.mktemp("plan")
    out = d / "plan.json"
    res = CliRunner().invoke(cli, ["plan", str(EXAMPLES / "tiny-cpu.yaml"), "-o", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    data["bandwidth"].update(intra_gbs=5e-4, net_per_gpu_gbs=5e-4, source="test: a slow cluster")
    out.write_text(json.dumps(data))
    Plan.load(out)
    return out


def preflight(plan: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real `launch preflight --plan` process (its exit status as a shell sees it)."""
    return subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", "preflight", "--plan",
                           str(plan), "--iters", "3", *extra], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, timeout=300)


def test_the_tiny_plan_measured_locally_is_within_what_it_assumed(modest_plan, tmp_path):
    out = tmp_path / "measured.json"
    res = preflight(modest_plan, "--json", "-o", str(out))
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["ok"] and rep["backend"] == "gloo" and rep["slow"] == []
    assert [r["kind"] for r in rep["by_kind"]] == ["tp", "dp"]          # tp2 x dp2, ZeRO 3
    assert {(g["kind"], tuple(g["ranks"])) for g in rep["groups"]} == {("tp", (0, 1)), ("tp", (2, 3)),
                                                                        ("dp", (0, 2)), ("dp", (1, 3))}
    for g in rep["groups"]:
        assert g["measured_s"] > 0 and len(g["samples_s"]) == 3 and g["ratio"] > 1
        assert g["measured_busbw_gbs"] > g["assumed_busbw_gbs"] and len(g["hosts"]) == 2
    # faster than assumed: the recomputed step is shorter than the plan's
    assert 0 < rep["measured_step_s"] < rep["predicted_step_s"]
    saved = json.loads(out.read_text())
    assert saved["kind"] == "launch4d-plan-preflight" and len(saved["groups"]) == 4


def test_a_slowed_group_is_found_and_named(modest_plan, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_SITE)
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "L4D_SLOW_RANK": "3", "L4D_SLOW_S": "0.5"}
    res = preflight(modest_plan, env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    text = res.stdout
    assert "1 group(s) slower than the plan assumed by more than 30%:" in text
    slow_line = next(ln for ln in text.splitlines() if ln.startswith("  TP group 1, "))
    assert "ranks 2,3 on " in slow_line and "(intra-node): all_gather" in slow_line
    assert "TP group 0, " not in text.split("slower than the plan assumed")[1]     # rank 3's group only
    res = preflight(modest_plan, "--json", env=env)
    assert res.returncode == 1, res.stderr
    rep = json.loads(res.stdout)
    assert [(s["kind"], s["ranks"]) for s in rep["slow"]] == [("tp", [2, 3])]
    tp1 = next(g for g in rep["groups"] if g["kind"] == "tp" and g["index"] == 1)
    assert tp1["measured_s"] >= 0.5 and tp1["ratio"] < 0.7
    # the slow TP group makes the recomputed step longer than planned
    assert rep["measured_step_s"] > rep["predicted_step_s"]


def test_bad_input_is_one_line_and_exit_2(modest_plan, tmp_path):
    for args, word in ((["--plan", str(tmp_path / "none.json")], "cannot read plan"),
                       (["--backend", "srun"], "--backend srun: with --plan, one of local, ssh, slurm, k8s"),
                       (["--backend", "ssh", "--hosts", "a,b,c"], "--hosts: 3 host(s)"),
                       (["--tolerance", "1.5"], "--tolerance")):
        res = preflight(modest_plan, *args)
        assert res.returncode == 2, (args, res.stderr)
        errors = [ln for ln in res.stderr.splitlines() if ln.lower().startswith("error")]
        assert len(errors) == 1 and word in errors[0] and "Traceback" not in res.stderr
