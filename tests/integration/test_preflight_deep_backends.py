"""The standard and long levels through the srun runner (real test Slurm) and the Kubernetes-pod runner.

The replay tools serve the same real captures as test_preflight_levels.py (DCGM 3.3.9 all-pass and
Targeted Power failing on GPU 1, nvbandwidth H100, `nvlink -e`, all_to_all_perf, ib_write_bw
GPUDirect); gpu-query, nvlink -s and ibstat are CONSTRUCTED (tests/replay/constructed.py). Each node
has its own replay folder: the Slurm nodes share this machine and the submitter's PATH, so a
dispatcher on PATH runs the replay of the node a step landed on ($SLURMD_NODENAME); the pod
stand-in gives each pod the PATH of the node it is pinned to. One node is faulty; preflight must name
exactly that node and component.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checks.assemble import assemble
from checks.folder import load_dir, save_dir
from checks.orchestrate import PreflightOptions, run_preflight
from checks.runners.k8s import K8sRunner
from launcher.backends.kubernetes import KubernetesBackend
from launcher.render import render_template
from tests.conftest import REPO, fixtures_dir, shared_file
from tests.integration.test_preflight_levels import DCGM_FAIL, GOOD
from tests.integration.test_preflight_runners import LocalKubelet, _final_state, submit_preflight_job
from tests.replay import install, install_dispatch
from tests.replay.constructed import gpu_query_csv, ibstat_text, nvlink_status
from tests.services.slurm import slurm_cluster  # noqa: F401  (session fixture; skips where Slurm is absent)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NVLINK_E = GOOD["NVLINK_ERR"]


def replay_cluster(root: Path, nodes: list[str], bad: str | None = None, **settings: str | Path | None) -> Path:
    """root/<node>/ replay folders (the good captures everywhere, `settings` on `bad`); returns root."""
    for v in (*GOOD.values(), DCGM_FAIL):
        shared_file(*v.split("/"))  # skips when the fixtures are absent
    files = root / "constructed"
    files.mkdir(parents=True, exist_ok=True)
    for name, text in {"gq.csv": gpu_query_csv(), "nv.txt": nvlink_status(),
                       "ib.txt": ibstat_text(ports=2, rate=200)}.items():
        (files / name).write_text(text)
    for n in nodes:
        kw: dict[str, str | Path | None] = dict(GOOD, GPU_QUERY=files / "gq.csv", NVLINK=files / "nv.txt",
                                                IBSTAT=files / "ib.txt")
        if n == bad:
            kw.update(settings)
        install(root / n, root, fixtures_dir(), **kw)
    return root


def rising_nvlink_read(tmp: Path) -> Path:
    """A second `nvidia-smi nvlink -e` read of the real capture with only counter values changed
    (no real capture with non-zero counters exists; ../shared/fixtures/SOURCES.md says so):
    GPU 0 link 1's CRC Errors 0 -> 12, every other line as captured."""
    text = shared_file(*NVLINK_E.split("/")).read_text()
    assert text.count("Link 1: CRC Errors: 0") == 1
    out = tmp / "nvlink-e-after-derived.txt"
    out.write_text(text.replace("Link 1: CRC Errors: 0", "Link 1: CRC Errors: 12"))
    return out


def not_passing(checks) -> dict[tuple[str, str], str]:
    return {(c["node"], c["check"]): c["status"] for c in checks if c["status"] != "pass"}


# ---- srun: `launch preflight --slurm-allocation --level ...` inside a batch job on the real test Slurm ----------
def srun_preflight(cluster, tmp_path: Path, level: str, bad: str, **settings: str | Path | None) -> tuple[dict, Path]:
    nodes = list(cluster.nodes)
    root = replay_cluster(tmp_path / "nodes", nodes, bad, **settings)
    bin_dir = install_dispatch(tmp_path / "dispatch", root)
    out, raw = tmp_path / "bw.json", tmp_path / "raw"
    cmd = (f"{sys.executable} -c 'from launcher.cli import main; main()' preflight --slurm-allocation "
           f"--launcher 'srun --mpi=none -N {{nnodes}} -w {{hostlist}} --ntasks-per-node=1 {{cmd}}' "
           f"--nccl-timeout 60 --level {level} --save-raw {raw} -o {out}")
    env = {**cluster.env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    p = subprocess.run(["sbatch", "--parsable", "-N", str(len(nodes)), "--exclusive", f"--output={tmp_path}/job.out",
                        "--wrap", cmd], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    state = _final_state(cluster, p.stdout.strip().split(";")[0], timeout=180)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert state == "FAILED", log  # exit 1: a check failed (the faulty node's)
    assert out.exists(), log
    return json.loads(out.read_text()), raw


def test_srun_standard_level_names_the_node_and_gpu_dcgm_failed(slurm_cluster, tmp_path):  # noqa: F811
    n1, n2 = slurm_cluster.nodes
    bw, raw = srun_preflight(slurm_cluster, tmp_path, "standard", n2, DCGM=DCGM_FAIL)
    assert not_passing(bw["checks"]) == {(n2, "dcgm:Targeted Power"): "fail"}
    c = next(x for x in bw["checks"] if x["status"] == "fail")
    assert c["message"].startswith("GPU 1 Max power of 224.1 did not reach desired power minimum")
    assert bw["exclude"] == [n2] and bw["level"] == "standard"
    for n in (n1, n2):
        meta = json.loads((raw / n / "probe.json").read_text())
        assert meta["dcgm-diag"]["command"] == "dcgmi diag -r 2"
        assert {"nvbandwidth", "nvlink-errors", "nvlink-errors-after"} <= set(meta)
    assert {(x["node"], x["check"]) for x in bw["checks"]} >= {(n1, "nvlink_errors"), (n1, "dcgm"),
                                                               (n1, "nvbandwidth:device_to_device_memcpy_read_ce")}


def test_srun_long_level_runs_r3_alltoall_and_per_nic_rdma(slurm_cluster, tmp_path):  # noqa: F811
    """Only n2's `dcgmi diag -r 3` fails (its -r 2 passes, so the fail shows the long level ran -r 3);
    all_to_all_perf per node and for the pair, and per-NIC ib_write_bw between the two nodes, are
    run as srun steps and recorded in the map."""
    n1, n2 = slurm_cluster.nodes
    bw, raw = srun_preflight(slurm_cluster, tmp_path, "long", n2, DCGM_R3=DCGM_FAIL)
    assert not_passing(bw["checks"]) == {(n2, "dcgm:Targeted Power"): "fail"}
    assert bw["exclude"] == [n2] and bw["level"] == "long"
    assert json.loads((raw / n2 / "probe.json").read_text())["dcgm-diag"]["command"] == "dcgmi diag -r 3"
    assert {bw["nodes"][n]["rdma_gbps"]["mlx5_0"] for n in (n1, n2)} == {181.46}
    assert set(bw["nodes"][n1]["rdma_gbps"]) == {"mlx5_0", "mlx5_1"}
    # the excluded node's figures stay out of the map: the only pair has n2, so no inter-node figure
    assert bw["alltoall_intra_busbw_gbs"] == bw["nodes"][n1]["alltoall_busbw_gbs"] is not None
    assert bw["alltoall_inter_busbw_gbs"] is None and bw["nodes"][n2]["alltoall_busbw_gbs"] is None
    assert "13.51" in (raw / "alltoall-pairs" / f"{n1}+{n2}.txt").read_text()  # the pair ran through srun
    assert (raw / n2 / "alltoall-node.txt").read_text().strip()
    assert any(c.startswith(f"[{n1}] ib_write_bw -d mlx5_1 --use_cuda=") and c.endswith(f" {n2}")
               for c in bw["commands"])


# ---- Kubernetes: one pod per command, pinned to its node (recorded-response stand-in for the API) ----------
class NodeKubelet(LocalKubelet):
    """LocalKubelet whose pods run with the PATH of the node they are pinned to (spec.nodeName)."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def create_namespaced_pod(self, namespace, body):
        self.created.append(body)
        node = body["spec"]["nodeName"]
        env = {**os.environ, "PATH": f"{self.root / node / 'bin'}:{os.environ['PATH']}"}
        p = subprocess.run(body["spec"]["containers"][0]["command"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env)
        self.done[body["metadata"]["name"]] = (p.returncode, p.stdout)


K8S_NODES = ["gpu-a", "gpu-b", "gpu-c"]


def k8s_preflight(tmp_path: Path, level: str, bad: str, **settings: str | Path | None):
    api = NodeKubelet(replay_cluster(tmp_path / "nodes", K8S_NODES, bad, **settings))
    res = run_preflight(K8sRunner(KubernetesBackend(core_api=api), poll_s=0, render=render_template), K8S_NODES,
                        PreflightOptions(probe_timeout=10, nccl_timeout=20, level=level))
    bw = assemble(res)
    return res, bw, api


def test_k8s_standard_level_names_the_nvlink_whose_counters_rose(tmp_path):
    """gpu-b's second `nvlink -e` read (after its NCCL test) has GPU 0 link 1's CRC counter at 12
    where the first read had 0: that node's nvlink_errors check fails naming the GPU and link."""
    res, bw, api = k8s_preflight(tmp_path, "standard", "gpu-b", NVLINK_ERR_AFTER=rising_nvlink_read(tmp_path))
    checks = [vars(c) for c in bw.checks]
    assert not_passing(checks) == {("gpu-b", "nvlink_errors"): "fail"}
    c = next(x for x in bw.checks if x.status == "fail")
    assert c.message.startswith("GPU 0 link 1: CRC Errors rose from 0 to 12 between two reads") and c.value == 12
    assert bw.exclude == ["gpu-b"] and bw.level == "standard"
    for h in K8S_NODES:
        assert res.probes[h]["dcgm-diag"].command == "dcgmi diag -r 2"
        assert res.probes[h]["nvlink-errors"].ok and res.probes[h]["nvlink-errors-after"].ok
    pods = [(p["spec"]["nodeName"], p["spec"]["containers"][0]["command"][2]) for p in api.created]
    assert all(any(n == h and "dcgmi diag -r 2" in cmd for n, cmd in pods) for h in K8S_NODES)
    assert len(api.deleted) == len(api.created)
    # saved and imported again, the two reads are still compared per node: the same verdict
    again = assemble(load_dir(save_dir(res, tmp_path / "raw")))
    assert {(x.node, x.check, x.status, x.message) for x in again.checks if x.status != "pass"} == {
        (c.node, c.check, c.status, c.message)}


def test_k8s_long_level_names_the_gpu_dcgm_r3_failed_and_records_alltoall(tmp_path):
    """The pod runner cannot start multi-node jobs, so the long level adds `dcgmi diag -r 3` and
    all_to_all_perf per node (the pair runs and per-NIC RDMA are skipped, and said to be)."""
    res, bw, _ = k8s_preflight(tmp_path, "long", "gpu-c", DCGM_R3=DCGM_FAIL)
    checks = [vars(c) for c in bw.checks]
    assert not_passing(checks) == {("gpu-c", "dcgm:Targeted Power"): "fail"}
    assert bw.exclude == ["gpu-c"] and bw.level == "long"
    assert all(res.probes[h]["dcgm-diag"].command == "dcgmi diag -r 3" for h in K8S_NODES)
    assert sorted(r.hosts[0] for r in res.nccl if r.kind == "a2a-node") == K8S_NODES
    assert bw.nodes["gpu-a"].alltoall_busbw_gbs is not None and bw.alltoall_intra_busbw_gbs is not None
    assert res.rdma == [] and not any(r.kind in ("pair", "a2a-pair") for r in res.nccl)


# ---- the Slurm batch job (`launch preflight --backend slurm`) at standard and long, on the real test Slurm ----
def batch_preflight(cluster, tmp_path: Path, level: str, bad: str, tool_timeouts: tuple[str, ...] = (),
                    end: str = "FAILED", **settings: str | Path | None) -> tuple[dict, Path]:
    """Run the rendered job with `bad`'s replay `settings`; `end`: FAILED when checks.assemble, the job's
    last step, exits 1 for a failed check, COMPLETED when nothing failed."""
    from checks.runners.slurm_job import SlurmJobOptions, render

    nodes = list(cluster.nodes)
    root = replay_cluster(tmp_path / "nodes", nodes, bad, **settings)
    bin_dir = install_dispatch(tmp_path / "dispatch", root)
    out = tmp_path / "out"
    script = render(nodes, SlurmJobOptions(out_dir=str(out), python=sys.executable, mpi="none", gpus_per_node=2,
                                           nccl_timeout=60, time="00:05:00", partition=cluster.partition,
                                           level=level, tool_timeouts=list(tool_timeouts)), render_template)
    state = _final_state(cluster, submit_preflight_job(script, out, bin_dir, len(nodes)), timeout=180)
    log = next(out.glob("slurm-*.out"), None)
    assert state == end, log.read_text() if log else state
    assert (out / "bwmap.json").exists(), log.read_text() if log else ""
    return json.loads((out / "bwmap.json").read_text()), out


def test_slurm_job_standard_level_runs_the_tools_on_each_node_and_names_the_faults(slurm_cluster, tmp_path):  # noqa: F811
    """n2's DCGM diag fails on GPU 1; n1's dcgmi hangs (sleeps 60 s) past `--tool-timeout dcgmi=3`:
    a named warning for n1 with the limit, not a stuck job."""
    n1, n2 = slurm_cluster.nodes
    bw, out = batch_preflight(slurm_cluster, tmp_path, "standard", n2, ("dcgmi=3",), DCGM=DCGM_FAIL)
    assert not_passing(bw["checks"]) == {(n2, "dcgm:Targeted Power"): "fail"}
    bw, out = batch_preflight(slurm_cluster, tmp_path / "again", "standard", n1, ("dcgmi=3",), "COMPLETED",
                              DCGM_DELAY="60")
    assert not_passing(bw["checks"]) == {(n1, "dcgm"): "warn"}
    c = next(x for x in bw["checks"] if x["status"] != "pass")
    assert c["message"].startswith("not measured: dcgmi timed out after 3 s") and c["threshold"] == 3
    for n in (n1, n2):
        meta = json.loads((out / n / "probe.json").read_text())
        assert meta["dcgm-diag"]["command"] == "dcgmi diag -r 2"
        assert {"nvbandwidth", "nvlink-errors", "nvlink-errors-after"} <= set(meta)
    assert bw["level"] == "standard" and not (out / "rdma").exists()


def test_slurm_job_long_level_runs_pair_tests_as_srun_steps(slurm_cluster, tmp_path):  # noqa: F811
    n1, n2 = slurm_cluster.nodes
    bw, out = batch_preflight(slurm_cluster, tmp_path, "long", n2, DCGM_R3=DCGM_FAIL)
    assert not_passing(bw["checks"]) == {(n2, "dcgm:Targeted Power"): "fail"}
    assert bw["exclude"] == [n2] and bw["level"] == "long"
    assert json.loads((out / n2 / "probe.json").read_text())["dcgm-diag"]["command"] == "dcgmi diag -r 3"
    assert {bw["nodes"][n]["rdma_gbps"]["mlx5_0"] for n in (n1, n2)} == {181.46}
    runs = json.loads((out / "rdma" / "runs.json").read_text())
    assert {(r["client"], r["server"], r["nic"]) for r in runs} == {(n1, n2, "mlx5_0"), (n1, n2, "mlx5_1")}
    assert all(r["command"].startswith(f"ib_write_bw -d {r['nic']} --use_cuda=") for r in runs)
    assert "13.51" in (out / "alltoall-pairs" / f"{n1}+{n2}.txt").read_text()
    assert bw["alltoall_intra_busbw_gbs"] == bw["nodes"][n1]["alltoall_busbw_gbs"] is not None
