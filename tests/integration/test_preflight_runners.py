"""Host lists, the probe script protocol, and the local / srun / Slurm-job / Kubernetes runners.

The local-backend test puts the replay tools (tests/replay) first on PATH: topo and nccl-tests are
real captures from ../shared/fixtures; gpu-query / nvlink / ibstat are CONSTRUCTED (none captured).
The Kubernetes runner is tested against a recorded-response stand-in for CoreV1Api (no API server
can run here); the Slurm job against the real Slurm of tests/services/slurm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from checks.hosts import HostsError, expand, from_allocation, from_file
from checks.orchestrate import PreflightOptions, multi_command, run_preflight
from checks.pairing import NcclOptions, first_round, ring_rounds, second_round
from checks.runners.base import probe_script, split_probe_output
from checks.runners.k8s import K8sRunner, render_pod
from checks.runners.local import LocalRunner
from checks.runners.slurm_job import SlurmJobError, SlurmJobOptions, render
from checks.runners.srun import SrunRunner
from launcher.backends.kubernetes import KubernetesBackend
from launcher.render import render_template
from launcher.transport import Completed
from tests.conftest import REPO, fixtures_dir, shared_file
from tests.replay import install
from tests.replay.constructed import gpu_query_csv, ibstat_text, nvlink_status
from tests.services.slurm import slurm_cluster  # noqa: F401  (session fixture; skips where Slurm is absent)

pytestmark = pytest.mark.integration


# ---- hosts ---------------------------------------------------------------------------------
def test_hostlist_expressions_files_and_allocation(tmp_path):
    assert expand("node[01-03,07],gpu-a1") == ["node01", "node02", "node03", "node07", "gpu-a1"]
    assert expand("n1,n1,n2") == ["n1", "n2"]
    with pytest.raises(HostsError, match="not a hostlist expression"):
        expand("node[01-")
    f = tmp_path / "hosts"
    f.write_text("# cluster\nnode01 slots=8\nnode[02-03]\n\nnode01\n")
    assert from_file(f) == ["node01", "node02", "node03"]
    with pytest.raises(HostsError, match="cannot read"):
        from_file(tmp_path / "missing")
    assert from_allocation({"SLURM_JOB_NODELIST": "gpu[7-8]"}) == ["gpu7", "gpu8"]
    with pytest.raises(HostsError, match="not inside a Slurm allocation"):
        from_allocation({})
    with pytest.raises(HostsError, match="is not a host name"):
        expand("bad;host")


# ---- rounds of pairs -------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9, 32, 33])
def test_pair_rounds_are_disjoint_and_constant_in_n(n):
    hosts = [f"h{i}" for i in range(n)]
    for rounds in (ring_rounds(hosts), [first_round(hosts)]):
        assert len(rounds) <= 3
        for rnd in rounds:
            used = [h for p in rnd for h in p]
            assert len(used) == len(set(used))  # disjoint: a node is in one pair per round
    if n >= 3:  # the fixed schedule gives every node two different partners
        partners: dict[str, set[str]] = {}
        for rnd in ring_rounds(hosts):
            for a, b in rnd:
                partners.setdefault(a, set()).add(b)
                partners.setdefault(b, set()).add(a)
        assert all(len(p) == 2 for p in partners.values()) and len(partners) == n


def test_second_round_repairs_suspects_with_good_nodes():
    hosts = ["a", "b", "c", "d", "e", "f"]
    first = first_round(hosts)
    assert second_round(hosts, first, set()) == []
    second = second_round(hosts, first, {("c", "d")})
    assert second == [("c", "a"), ("d", "b")]
    assert second_round(hosts[:5], first_round(hosts[:5]), set()) == [("e", "a")]  # the odd one out
    crossed = second_round(hosts[:4], first_round(hosts[:4]), {("a", "b"), ("c", "d")})
    assert crossed == [("a", "c"), ("b", "d")]


def test_multi_node_launch_commands(tmp_path):
    opts = NcclOptions(sizes=("1G", "4G"))
    mpi = multi_command(opts, LocalRunner(), ["n1", "n2"], 8)
    assert mpi == ("mpirun --allow-run-as-root -np 16 -H n1:8,n2:8 --bind-to none -x NCCL_DEBUG=INFO "
                   "all_reduce_perf -b 1G -e 4G -f 2 -g 1")
    srun = multi_command(opts, SrunRunner(), ["n1", "n2", "n3"], 4)
    assert srun.startswith("srun --mpi=pmix -N 3 -w 'n[1-3]' --ntasks-per-node=4 --gpus-per-node=4 "
                           "--export=ALL,NCCL_DEBUG=INFO all_reduce_perf")
    # the host list is one shell word even where the working folder holds a folder per host (n1/, n2/, n3/:
    # preflight's output layout), which an unquoted n[1-3] would glob to
    work = tmp_path / "out"
    for h in ("n1", "n2", "n3"):
        (work / h).mkdir(parents=True)
    argv = subprocess.run(["bash", "-c", f"printf '%s\\n' {srun}"], cwd=work, capture_output=True, text=True).stdout
    assert argv.splitlines()[4:6] == ["-w", "n[1-3]"]
    custom = NcclOptions(binary="/opt/nccl-tests/build/all_gather_perf", launcher="mpiexec -n {np} {cmd}")
    assert multi_command(custom, LocalRunner(), ["a", "b"], 2) == \
        "mpiexec -n 4 /opt/nccl-tests/build/all_gather_perf -b 512M -e 8G -f 2 -g 1"
    assert custom.collective == "all_gather"


# ---- the probe script protocol ----------------------------------------------------------------
def test_probe_script_runs_and_splits_with_rc_and_timeouts(tmp_path):
    from checks.probe import Probe

    probes = [Probe("topo", "topo.txt", "printf 'a\\nb'"), Probe("gpu-query", "g.csv", "echo err >&2; exit 3"),
              Probe("nvlink", "n.txt", "sleep 5"), Probe("ibstat", "i.txt", "echo ok")]
    script, marker = probe_script(probes, timeout=1)
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    out = split_probe_output(Completed(p.returncode, p.stdout, p.stderr, host="h", command="script"), probes, marker)
    assert out["topo"].stdout == "a\nb" and out["topo"].ok
    assert out["gpu-query"].rc == 3 and out["gpu-query"].stderr == "err"
    assert out["nvlink"].timed_out and not out["nvlink"].ok
    assert out["ibstat"].stdout == "ok\n" and out["ibstat"].ok
    dead = split_probe_output(Completed(host="h", command="script", error="connection refused"), probes, marker)
    assert all(r.error == "connection refused" for r in dead.values())


# ---- local backend (replay tools on PATH) -----------------------------------------------------
def replay_node(tmp_path: Path, **extra: str) -> Path:
    shared_file("topo", "h100-sxm-8gpu-12nic-mlx5-1numa.txt")
    node = tmp_path / "node"
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "gq.csv").write_text(gpu_query_csv())
    (tmp_path / "nv.txt").write_text(nvlink_status())
    (tmp_path / "ib.txt").write_text(ibstat_text())
    install(node, tmp_path, fixtures_dir(), TOPO="topo/h100-sxm-8gpu-12nic-mlx5-1numa.txt",
            GPU_QUERY=tmp_path / "gq.csv", NVLINK=tmp_path / "nv.txt", IBSTAT=tmp_path / "ib.txt",
            NCCL_NODE="nccl-tests/h100-1node-8gpu-5colls-v2.17.8.txt",
            NCCL_PAIR="nccl-tests/h100-a3mega-2node-16gpu-all_reduce_perf.txt", **extra)
    return node / "bin"


def test_local_backend_cli_end_to_end(tmp_path):
    bin_dir = replay_node(tmp_path)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    p = subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", "preflight", "--json",
                        "-o", str(tmp_path / "bw.json")], capture_output=True, text=True, cwd=REPO, env=env,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads(p.stdout)
    (host,) = d["nodes"]
    assert d["nodes"][host]["gpus"] == 8 and d["nodes"][host]["intra_busbw_gbs"] == 482.27
    assert d["pairs"] == [] and d["exclude"] == []
    assert "[nccl-node]" in p.stderr and f"[{host}] all_reduce_perf -b 512M -e 8G -f 2 -g 8" in d["commands"]


def test_python_m_checks_probe_then_import(tmp_path):
    bin_dir = replay_node(tmp_path)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "checks.probe", "--out", str(out), "--host", "gpu01", "--nccl"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    names = sorted(f.name for f in (out / "gpu01").iterdir())
    assert names == ["gpu-query.csv", "ibstat.txt", "nccl-node.txt", "nvlink.txt", "probe.json", "topo.txt", "xid.txt"]
    meta = json.loads((out / "gpu01" / "probe.json").read_text())
    assert meta["nccl-node"]["command"] == "all_reduce_perf -b 512M -e 8G -f 2 -g 8" and meta["topo"]["rc"] == 0
    p = subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", "preflight", "import",
                        str(out), "--json"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout)["nodes"]["gpu01"]["gpu_nic"]["GPU0"] == "mlx5_0"


def test_local_runner_refuses_other_hosts():
    r = LocalRunner().run("elsewhere", "true", 5)
    assert r.error and "this machine only" in r.error


# ---- srun ----------------------------------------------------------------------------------
def test_srun_step_command_and_refused_step(tmp_path):
    r = SrunRunner(srun=str(tmp_path / "srun"))
    assert r.step_command("n1", "nvidia-smi topo -m").endswith(
        "--nodes=1 --ntasks=1 --nodelist=n1 --overlap --quiet bash -c 'nvidia-smi topo -m'")
    # a stand-in srun that refuses like Slurm does for a node outside the allocation (CONSTRUCTED message)
    (tmp_path / "srun").write_text("#!/bin/sh\necho 'srun: error: Required node not available (down, drained or "
                                   "reserved)' >&2\nexit 1\n")
    (tmp_path / "srun").chmod(0o755)
    res = r.run("n9", "true", 5)
    assert res.error and "Required node not available" in res.error


# ---- Slurm batch job ---------------------------------------------------------------------------
def test_slurm_job_script_renders_and_is_valid_bash(tmp_path):
    s = render(["n1", "n2", "n3", "n4"], SlurmJobOptions(out_dir=str(tmp_path / "o"), partition="gpu",
                                                          gpus_per_node=8, nccl=NcclOptions(sizes=("1G", "2G"))),
               render_template)
    assert "#SBATCH --nodelist=n[1-4]" in s and "#SBATCH --partition=gpu" in s and "G=8" in s
    assert s.count("--mpi=pmix --export=ALL,NCCL_DEBUG=INFO -N 2") == 4 and s.count("wait") == 2  # 2 rounds of 2 disjoint pairs
    assert '"$OUT/pairs/"n1+n2.txt' in s and "-N 4" in s
    assert s.rstrip().endswith('-m checks "$OUT" -o "$OUT/bwmap.json"')
    subprocess.run(["bash", "-n"], input=s, text=True, check=True)
    with pytest.raises(SlurmJobError, match="cannot go on an #SBATCH line"):
        render(["n1"], SlurmJobOptions(out_dir="/tmp/a b"), render_template)
    evil = render(["n1", "n2"], SlurmJobOptions(out_dir="/tmp/o", nccl=NcclOptions(binary="x; rm -rf /")),
                  render_template)
    assert "'x; rm -rf /'" in evil


@pytest.mark.slow
def test_slurm_backend_runs_the_job_on_real_slurm(slurm_cluster, tmp_path):  # noqa: F811
    bin_dir = replay_node(tmp_path / "replay")
    out = tmp_path / "out"
    nodes = list(slurm_cluster.nodes)
    script = render(nodes, SlurmJobOptions(out_dir=str(out), python=sys.executable, mpi="none", gpus_per_node=2,
                                           nccl_timeout=60, time="00:05:00", partition=slurm_cluster.partition),
                    render_template)
    job = submit_preflight_job(script, out, bin_dir, len(nodes))
    state = _final_state(slurm_cluster, job, timeout=120)
    log = next(out.glob("slurm-*.out"), None)
    assert state == "COMPLETED", log.read_text() if log else state
    bw = json.loads((out / "bwmap.json").read_text())
    assert sorted(bw["nodes"]) == sorted(nodes)  # files filed under SLURMD_NODENAME
    assert all(n["gpus"] == 8 and n["intra_busbw_gbs"] == 482.27 for n in bw["nodes"].values())
    assert len(bw["pairs"]) == 1 and bw["pairs"][0]["busbw_gbs"] == 338.82  # the 2-node capture, rank 0 only


def submit_preflight_job(script: str, out: Path, bin_dir: Path, nodes: int) -> str:
    """The batch job as `launch preflight --backend slurm` submits it (through the Slurm backend), with
    the replayed tools first on the PATH the job inherits from sbatch."""
    from launcher.backends.slurm import SlurmBackend
    from launcher.formats.requests import BatchScript

    backend = SlurmBackend()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        mp.setenv("PYTHONPATH", str(REPO))
        mp.chdir(REPO)
        return backend.submit(backend.request(BatchScript("launch4d-preflight", str(out), "preflight.sbatch",
                                                          script, nodes))).id


def _final_state(cluster, job: str, timeout: float) -> str | None:
    """JobState from `scontrol show job` (squeue forgets finished jobs) once it is terminal."""
    import re
    import time

    deadline, state = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        out = cluster.run("scontrol", "show", "job", job, "-o", check=False).stdout
        m = re.search(r"JobState=(\S+)", out)
        state = m.group(1) if m else None
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(0.5)
    return state


# ---- Kubernetes ----------------------------------------------------------------------------
class LocalKubelet:
    """Stand-in for kubernetes.client.CoreV1Api: a created pod's command runs here, as a container would,
    and its log is stdout and stderr merged, as the API returns it. (No API server can run here.)"""

    def __init__(self, env: dict[str, str] | None = None):
        self.env = env
        self.created: list[Any] = []
        self.deleted: list[str] = []
        self.done: dict[str, Any] = {}

    def create_namespaced_pod(self, namespace, body):
        self.created.append(body)
        argv = body["spec"]["containers"][0]["command"]
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env)
        self.done[body["metadata"]["name"]] = (p.returncode, p.stdout)

    def read_namespaced_pod(self, name, namespace):
        rc, _ = self.done[name]
        cs = SimpleNamespace(state=SimpleNamespace(terminated=SimpleNamespace(exit_code=rc)))
        return SimpleNamespace(status=SimpleNamespace(phase="Succeeded" if rc == 0 else "Failed",
                                                      container_statuses=[cs]))

    def read_namespaced_pod_log(self, name, namespace):
        return self.done[name][1]

    def delete_namespaced_pod(self, name, namespace):
        self.deleted.append(name)


def test_k8s_pod_manifest():
    pod = render_pod(render_template, name="launch4d-preflight-x-1-gpu01", namespace="ml", node="gpu01", image="img:1",
                     command="nvidia-smi topo -m", run_id="x", gpus=8)
    assert pod["kind"] == "Pod" and pod["spec"]["nodeName"] == "gpu01" and pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["containers"][0]["command"] == ["bash", "-c", "nvidia-smi topo -m"]
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    with pytest.raises(ValueError, match="not a valid Kubernetes name"):
        render_pod(render_template, name="x", namespace="ml", node="Bad_Node", image="i", command="c", run_id="x")


def test_k8s_runner_splits_stderr_and_runs_probes(tmp_path):
    api = LocalKubelet()
    be = KubernetesBackend(core_api=api)
    submitted: list[Any] = []
    r = K8sRunner(be, namespace="ml", poll_s=0, on_submit=submitted.append, render=render_template).run(
        "gpu01", "echo out; echo err >&2; exit 4", 10)
    assert (r.stdout, r.stderr, r.rc) == ("out\n", "err", 4)
    assert api.deleted == [api.created[0]["metadata"]["name"]]
    # each pod is a submission through the Kubernetes backend: status, logs and cancel follow it
    (h,) = submitted
    assert (h.backend, h.id, h.extra["kind"], h.extra["namespace"]) == ("k8s", api.created[0]["metadata"]["name"],
                                                                         "Pod", "ml")
    st = be.describe(h)
    assert st is not None and (st.state, st.exit_code) == ("FAILED", 4)
    assert list(be.log_iter(h))[0] == "out"
    bin_dir = replay_node(tmp_path)
    api = LocalKubelet(env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    from checks.assemble import assemble

    res = run_preflight(K8sRunner(KubernetesBackend(core_api=api), poll_s=0, render=render_template), ["gpu01"],
                        PreflightOptions())
    bw = assemble(res)
    assert {c.check for c in bw.checks if c.status == "fail"} == set()
    assert bw.nodes["gpu01"].intra_busbw_gbs == 482.27 and bw.nodes["gpu01"].gpus == 8
    assert all(p["spec"]["nodeName"] == "gpu01" for p in api.created)


@pytest.mark.slow
def test_srun_backend_inside_a_real_allocation(slurm_cluster, tmp_path):  # noqa: F811
    """`launch preflight --slurm-allocation` in a batch job: per-node srun steps, then a pair through srun."""
    bin_dir = replay_node(tmp_path / "replay")
    out = tmp_path / "bw.json"
    cmd = (f"{sys.executable} -c 'from launcher.cli import main; main()' preflight --slurm-allocation "
           f"--launcher 'srun --mpi=none -N {{nnodes}} -w {{hostlist}} --ntasks-per-node=1 {{cmd}}' "
           f"--nccl-timeout 60 -o {out}")
    env = {**slurm_cluster.env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    p = subprocess.run(["sbatch", "--parsable", "-N", str(len(slurm_cluster.nodes)), "--exclusive",
                        f"--output={tmp_path}/job.out", "--wrap", cmd], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    state = _final_state(slurm_cluster, p.stdout.strip().split(";")[0], timeout=120)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert state in ("COMPLETED", "FAILED"), log  # FAILED would be exit 1: a failed check, shown in the log
    bw = json.loads(out.read_text())
    assert sorted(bw["nodes"]) == sorted(slurm_cluster.nodes), log
    assert [c for c in bw["checks"] if c["status"] == "fail"] == [], log
    assert [(p["a"], p["b"], p["busbw_gbs"], p["status"]) for p in bw["pairs"]] == [("n1", "n2", 338.82, "pass")], log
    assert any(c.startswith("[n1") and "srun --mpi=none -N 2" in c for c in bw["commands"])
