"""Preflight levels over real SSH (private sshd "nodes" on loopback, replay tools on each PATH).

The deeper levels' tools replay real captures from ../shared/fixtures: `dcgmi diag` (DCGM 3.3.9
tables, all-pass and Targeted Power failing on GPU 1), nvbandwidth (H100 v0.4), `nvidia-smi nvlink -e`,
all_to_all_perf (H100 single node and node pair) and `ib_write_bw --use_cuda` (a healthy 200G RoCE
GPUDirect run at 181 Gb/s, and the degraded T4 GPUDirect run at 10.5 Gb/s). gpu-query, nvlink -s and
ibstat are the CONSTRUCTED texts of tests/replay/constructed.py, as in test_preflight_ssh.py (2 ports
at 200 Gb/s keep the per-NIC runs few). One node at a time is faulty; preflight must name exactly
that node and component, and a node lacking a tool is "not measured", never failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from checks.assemble import assemble
from checks.folder import load_dir, save_dir
from checks.orchestrate import PreflightOptions, run_preflight
from checks.runners.ssh import SSHRunner
from tests.conftest import REPO, fixtures_dir, shared_file
from tests.replay import install
from tests.replay.constructed import gpu_query_csv, ibstat_text, nvlink_status
from tests.services.sshd import SshCluster, require_sshd

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NODES = ["node01", "node02", "node03", "node04"]
GOOD = dict(TOPO="topo/h100-sxm-8gpu-12nic-mlx5-1numa.txt",
            NCCL_NODE="nccl-tests/h100-1node-8gpu-5colls-v2.17.8.txt",
            NCCL_PAIR="nccl-tests/h100-a3mega-2node-16gpu-all_reduce_perf.txt",
            NCCL_ALL="nccl-tests/h100-10node-80gpu-5colls-v2.17.8.txt",
            DCGM="dcgm-diag/a10g-4gpu-sagemaker-g5.12xlarge-dcgm3.3.9-r3-all-pass.txt",
            NVBW="nvbandwidth/h100-80gb-8gpu-azure-ndv5-v0.4-d2d-memcpy-read-ce-371gbps.txt",
            NVLINK_ERR="nvlink/h100-nvlink-e-all-zero-DOC-EXAMPLE-anonymised-uuid-elided.txt",
            A2A_NODE="nccl-tests/h100-1node-8gpu-5colls-v2.17.8.txt",
            A2A_PAIR="nccl-tests/h100-pairwise-2node-1gpu-alltoall-sendrecv-v2.17.6.txt",
            RDMA="perftest/a40-openshift-roce-200g-ib_write_bw-use_cuda-dmabuf-16qp-D60-client-181gbps.txt")
DCGM_FAIL = "dcgm-diag/a10g-4gpu-sagemaker-g5.12xlarge-dcgm3.3.9-r3-targeted-power-FAIL-gpu1.txt"
RDMA_DEGRADED = "perftest/t4-roce-100g-ib_write_bw-use_cuda-client-10.5gbps-DEGRADED-vs-92.56-host-mem-pcie-ro-warning.txt"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_sshd()
    for v in (*GOOD.values(), DCGM_FAIL, RDMA_DEGRADED):
        shared_file(*v.split("/"))  # skips when the fixtures are absent
    root = tmp_path_factory.mktemp("sshl")
    with SshCluster(root, NODES) as c:
        c.write_known_hosts()
        files = root / "constructed"
        files.mkdir()
        for name, text in {"gq.csv": gpu_query_csv(), "nv.txt": nvlink_status(),
                           "ib.txt": ibstat_text(ports=2, rate=200)}.items():
            (files / name).write_text(text)
        c.files = files
        yield c


def configure(c: SshCluster, bad: str | None = None, **settings: str | None) -> None:
    for n in NODES:
        kw: dict[str, str | Path | None] = {**GOOD, "GPU_QUERY": c.files / "gq.csv", "NVLINK": c.files / "nv.txt",
                                            "IBSTAT": c.files / "ib.txt"}
        if n == bad:
            kw.update(settings)
        install(c.nodes[n].dir, c.root / "nodes", fixtures_dir(), **kw)


def preflight(c: SshCluster, level: str):
    with SSHRunner(ssh_config=str(c.ssh_config), known_hosts=str(c.known_hosts), connect_timeout=3) as r:
        res = run_preflight(r, NODES, PreflightOptions(probe_timeout=10, nccl_timeout=20, level=level))
    return res, assemble(res)


def not_passing(bw) -> dict[tuple[str, str], str]:
    return {(x.node, x.check): x.status for x in bw.checks if x.status != "pass"}


def test_standard_level_names_the_gpu_dcgm_failed_and_nothing_else(cluster):
    configure(cluster, bad="node03", DCGM=DCGM_FAIL)
    res, bw = preflight(cluster, "standard")
    assert not_passing(bw) == {("node03", "dcgm:Targeted Power"): "fail"}
    c = next(x for x in bw.checks if x.node == "node03" and x.status == "fail")
    assert c.message.startswith("GPU 1 Max power of 224.1 did not reach desired power minimum")
    assert bw.exclude == ["node03"] and bw.level == "standard"
    for h in NODES:
        assert {"dcgm-diag", "nvbandwidth", "nvlink-errors", "nvlink-errors-after"} <= set(res.probes[h])
        assert res.probes[h]["dcgm-diag"].command == "dcgmi diag -r 2"
    checks = {(x.node, x.check) for x in bw.checks}
    assert ("node01", "nvlink_errors") in checks and ("node01", "nvbandwidth:device_to_device_memcpy_read_ce") \
        in checks
    assert not any(r.kind.startswith("a2a") for r in res.nccl) and res.rdma == []   # long only


def test_a_node_without_dcgmi_or_nvbandwidth_is_not_measured_not_failed(cluster):
    configure(cluster, bad="node02", DCGM=None, NVBW=None)
    _, bw = preflight(cluster, "standard")
    assert not_passing(bw) == {("node02", "dcgm"): "warn", ("node02", "nvbandwidth"): "warn"}
    msgs = {x.check: x.message for x in bw.checks if x.node == "node02" and x.status == "warn"}
    assert msgs == {"dcgm": "not measured: dcgmi is not installed on this node",
                    "nvbandwidth": "not measured: nvbandwidth is not installed on this node"}
    assert bw.exclude == []


def test_long_level_finds_the_degraded_gpudirect_nic_and_records_all_to_all(cluster, tmp_path):
    configure(cluster, bad="node03", RDMA_BAD_NIC="mlx5_1", RDMA_BAD=RDMA_DEGRADED)
    res, bw = preflight(cluster, "long")
    assert not_passing(bw) == {("node03", "rdma:mlx5_1"): "fail"}, not_passing(bw)
    c = next(x for x in bw.checks if x.node == "node03" and x.status == "fail")
    assert c.value == 10.5 and c.threshold == 200
    assert bw.exclude == ["node03"] and bw.level == "long"
    assert all(r.result.command.startswith(f"ib_write_bw -d {r.nic} --use_cuda=") for r in res.rdma)
    # round 1 pairs neighbours; node03's pair is slow, so round 2 re-pairs both with good nodes:
    # node04 reaches line rate with node02 (cleared), node03 stays slow with node01 (named)
    assert sorted({(r.client, r.server) for r in res.rdma}) == [("node01", "node02"), ("node03", "node01"),
                                                                 ("node03", "node04"), ("node04", "node02")]
    assert bw.nodes["node04"].rdma_gbps == {"mlx5_0": 181.46, "mlx5_1": 181.46}
    assert bw.nodes["node03"].rdma_gbps["mlx5_0"] == 181.46
    assert bw.alltoall_intra_busbw_gbs is not None and bw.alltoall_inter_busbw_gbs == 13.51
    assert bw.nodes["node01"].alltoall_busbw_gbs == bw.alltoall_intra_busbw_gbs
    assert res.probes["node01"]["dcgm-diag"].command == "dcgmi diag -r 3"
    # the raw outputs saved and imported again give the same verdicts and figures
    again = assemble(load_dir(save_dir(res, tmp_path / "raw")))
    assert not_passing(again) == not_passing(bw) and again.level == "long"
    assert again.nodes["node04"].rdma_gbps == bw.nodes["node04"].rdma_gbps
    assert (again.alltoall_intra_busbw_gbs, again.alltoall_inter_busbw_gbs) == (bw.alltoall_intra_busbw_gbs,
                                                                                bw.alltoall_inter_busbw_gbs)


def test_cli_standard_level_drains_the_named_node_and_the_raw_outputs_judge_the_same(cluster, tmp_path):
    """`launch preflight --level standard --drain` over SSH prints the drain for exactly node03 with
    DCGM's verdict as the reason; `--save-raw` keeps the deeper outputs, and `preflight import` of
    that folder judges them to the same failed checks."""
    configure(cluster, bad="node03", DCGM=DCGM_FAIL)
    raw = tmp_path / "raw"
    p = subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", "preflight",
                        "--hosts", "node[01-04]", "--ssh-config", str(cluster.ssh_config), "--known-hosts",
                        str(cluster.known_hosts), "--connect-timeout", "3", "--nccl-timeout", "20",
                        "--level", "standard", "--save-raw", str(raw), "--drain", "--json"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 1, p.stderr
    d = json.loads(p.stdout)
    (node,) = d["drain"]["nodes"]
    assert node["node"] == "node03" and not d["drain"]["applied"]
    assert node["reason"].startswith("launch4d: dcgm:Targeted Power: GPU 1 Max power of 224.1 did not reach")
    assert node["commands"][0].startswith("scontrol update nodename=node03 state=drain reason='launch4d: dcgm:")
    for phase in ("[dcgm-diag] node03: exit status 226", "[nvbandwidth] node01: ok", "[nvlink-errors-after] node04"):
        assert phase in p.stderr
    assert (raw / "node03" / "dcgm-diag.txt").read_text() == shared_file(*DCGM_FAIL.split("/")).read_text()
    failed = {(c["node"], c["check"]) for c in d["checks"] if c["status"] == "fail"}
    p = subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", "preflight", "import",
                        str(raw), "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    again = json.loads(p.stdout)
    assert {(c["node"], c["check"]) for c in again["checks"] if c["status"] == "fail"} == failed == {
        ("node03", "dcgm:Targeted Power")}
    assert {c["check"] for c in again["checks"] if c["node"] == "node01"} >= {"dcgm", "nvlink_errors",
                                                                             "nvbandwidth:device_to_device_memcpy_read_ce"}


def test_a_deep_tool_past_its_timeout_is_named_for_its_node_not_waited_for(cluster, tmp_path):
    """node02's dcgmi sleeps 60 s before printing (the replay's DCGM_DELAY); with `dcgmi=3` it is
    stopped there and reported as node02's dcgm finding naming the tool and the timeout, while the
    other nodes' diag (and node02's other tools) are judged as usual."""
    from checks.levels import parse_tool_timeouts

    configure(cluster, bad="node02", DCGM_DELAY="60")
    with SSHRunner(ssh_config=str(cluster.ssh_config), known_hosts=str(cluster.known_hosts), connect_timeout=3) as r:
        res = run_preflight(r, NODES, PreflightOptions(probe_timeout=10, nccl_timeout=20, level="standard",
                                                       tool_timeouts=parse_tool_timeouts(["dcgmi=3"])))
    bw = assemble(res)
    assert not_passing(bw) == {("node02", "dcgm"): "warn"}
    c = next(x for x in bw.checks if (x.node, x.check) == ("node02", "dcgm"))
    assert c.message.startswith("not measured: dcgmi timed out after 3 s") and c.threshold == 3
    assert res.probes["node02"]["dcgm-diag"].timed_out and res.probes["node01"]["dcgm-diag"].ok
    assert res.tool_timeouts == {"dcgmi": 3, "nvbandwidth": 900, "nvlink": 60}
    again = assemble(load_dir(save_dir(res, tmp_path / "raw")))  # the saved folder keeps the limits
    assert [(x.node, x.check, x.message, x.threshold) for x in again.checks if x.status != "pass"] == [
        ("node02", "dcgm", c.message, 3)]
