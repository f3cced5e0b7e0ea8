"""Preflight over real SSH: private sshd "nodes" on loopback, each with replay tools on its PATH.

Each node's nvidia-smi / all_reduce_perf / mpirun / ibstat / dmesg replay prints outputs chosen by
its replay.env: real captures from ../shared/fixtures (topo, nccl-tests, ibstat, kernel logs) read at
run time, and CONSTRUCTED gpu-query / nvlink text (no real capture of an 8-GPU H100 `--query-gpu` with
every field the probe asks for, nor of H100 `nvlink -s`, exists there).
One node at a time gets a bad output; preflight must name exactly that node and that check.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from checks.assemble import assemble
from checks.orchestrate import PreflightOptions, run_preflight
from checks.pairing import NcclOptions
from checks.runners.ssh import SSHRunner
from tests.conftest import REPO, fixtures_dir, shared_file
from tests.replay import install
from tests.replay.constructed import gpu_query_csv, nvlink_status
from tests.services.sshd import SshCluster, require_sshd

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NODES = ["node01", "node02", "node03", "node04"]
GOOD = dict(TOPO="topo/h100-sxm-8gpu-12nic-mlx5-1numa.txt",
            NCCL_NODE="nccl-tests/h100-1node-8gpu-5colls-v2.17.8.txt",
            NCCL_PAIR="nccl-tests/h100-a3mega-2node-16gpu-all_reduce_perf.txt",
            NCCL_ALL="nccl-tests/h100-10node-80gpu-5colls-v2.17.8.txt",
            # real: 8 IB rails + 4 Ethernet ports, 3 of them switched off (unused, must not be flagged)
            IBSTAT="ibstat/8x-cx7-ib-ndr400-plus-cx6dx-eth-3-ports-down-disabled.txt")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_sshd()
    shared_file("topo", "h100-sxm-8gpu-12nic-mlx5-1numa.txt")  # skips when the fixtures are absent
    root = tmp_path_factory.mktemp("sshc")
    with SshCluster(root, NODES) as c:
        c.write_known_hosts()
        files = root / "constructed"
        files.mkdir()
        for name, text in {"gq.csv": gpu_query_csv(), "nv.txt": nvlink_status(),
                           "gq-ecc.csv": gpu_query_csv(overrides={4: {"ecc.errors.uncorrected.volatile.total": "7"}}),
                           "gq-7.csv": gpu_query_csv(n=7)}.items():
            (files / name).write_text(text)
        c.files = files
        yield c


def configure(c: SshCluster, bad: str | None = None, **settings: str) -> None:
    for n in NODES:
        kw: dict[str, str | Path | None] = {**GOOD, "GPU_QUERY": c.files / "gq.csv", "NVLINK": c.files / "nv.txt"}
        if n == bad:
            kw.update({k: (c.files / v if v.endswith((".csv", ".txt")) and "/" not in v else v)
                       for k, v in settings.items()})
        install(c.nodes[n].dir, c.root / "nodes", fixtures_dir(), **kw)


def runner(c: SshCluster, **kw) -> SSHRunner:
    return SSHRunner(ssh_config=str(c.ssh_config), known_hosts=str(c.known_hosts), connect_timeout=3, **kw)


def preflight(c: SshCluster, hosts=NODES, nccl_timeout: float = 20, **kw):
    with runner(c, **kw) as r:
        res = run_preflight(r, hosts, PreflightOptions(probe_timeout=10, nccl_timeout=nccl_timeout))
    return res, assemble(res)


def failing(bw) -> set[tuple[str, str]]:
    return {(x.node, x.check) for x in bw.checks if x.status == "fail"}


def test_healthy_cluster_all_phases(cluster):
    configure(cluster)
    res, bw = preflight(cluster)
    assert failing(bw) == set() and bw.exclude == []
    assert [r.hosts for r in res.nccl if r.kind == "pair"] == [["node01", "node02"], ["node03", "node04"]]
    assert [r.kind for r in res.nccl].count("all") == 1
    assert bw.intra_node_busbw_gbs == 482.27 and bw.inter_node_busbw_gbs == 338.82
    assert bw.all_nodes_busbw_gbs == 320.54
    assert "[node01] mpirun --allow-run-as-root -np 16 -H node01:8,node02:8 --bind-to none -x NCCL_DEBUG=INFO " \
           "all_reduce_perf -b 512M -e 8G -f 2 -g 1" in bw.commands
    assert "[node[01-04]] nvidia-smi topo -m" in bw.commands
    assert bw.nodes["node02"].gpu_nic["GPU0"] == "mlx5_0"


@pytest.mark.parametrize("settings,check", [
    ({"NCCL_PAIR_OVERRIDE": "nccl-tests/a100-oci-bm-gpu4.8-2node-16gpu-all_reduce_perf-10G-single-size.txt"},
     "nccl_inter"),                                                                   # a slow link
    ({"GPU_QUERY": "gq-ecc.csv"}, "ecc"),                                             # ECC errors
    ({"GPU_QUERY": "gq-7.csv"}, "gpu_count"),                                         # a missing GPU
    ({"NCCL_NODE": "nccl-tests/rtx3090-2node-1gpu-all_reduce_perf-WRONG-nonzero-108-FAILED.txt"}, "nccl_node"),
    ({"NCCL_HANG": "1"}, "nccl_node"),                                                # a hang
    ({"DMESG": "xid/akash-provider-gpu-xid79-fallen-off-bus-dmesg-T-crash-dump-multiline.txt"}, "xid"),
    ({"DMESG": "xid/pci-10de-26b5-fallen-off-bus-multiline-NO-xid-drv570.158.01-dmesg.txt"}, "xid"),  # no Xid line
])
def test_one_bad_node_is_named_with_its_check(cluster, settings, check):
    configure(cluster, bad="node03", **settings)
    res, bw = preflight(cluster, nccl_timeout=3 if "NCCL_HANG" in settings else 20)
    assert {n for n, _ in failing(bw)} == {"node03"}, [x for x in bw.checks if x.status != "pass"]
    assert ("node03", check) in failing(bw)
    assert bw.exclude == ["node03"]
    if check == "nccl_inter":  # round 1 found (node03, node04) slow; round 2 re-paired both with good nodes
        assert [r.hosts for r in res.nccl if r.kind == "pair"][2:] == [["node03", "node01"], ["node04", "node02"]]
    if "NCCL_HANG" in settings:
        c = next(x for x in bw.checks if x.node == "node03" and x.check == "nccl_node")
        assert "timed out" in c.message
        assert all("node03" not in r.hosts for r in res.nccl if r.kind != "node")  # kept out of pairs


def test_unknown_host_key_is_refused_unless_accepted(cluster, tmp_path):
    configure(cluster)
    kh = tmp_path / "known_hosts"
    full = cluster.known_hosts.read_text().splitlines()
    port2 = cluster.nodes["node02"].port
    kh.write_text("\n".join(ln for ln in full if f":{port2} " not in ln) + "\n")
    with SSHRunner(ssh_config=str(cluster.ssh_config), known_hosts=str(kh), connect_timeout=3) as r:
        res = run_preflight(r, NODES, PreflightOptions(nccl=NcclOptions(enabled=False)))
    bw = assemble(res)
    assert failing(bw) == {("node02", "reachable")}
    assert "unknown host key" in res.unreachable["node02"]
    with SSHRunner(ssh_config=str(cluster.ssh_config), known_hosts=str(kh), connect_timeout=3,
                   accept_new_hosts=True) as r:
        res = run_preflight(r, NODES, PreflightOptions(nccl=NcclOptions(enabled=False)))
    assert res.unreachable == {}
    assert f"[127.0.0.1]:{port2} ssh-ed25519" in kh.read_text()


def test_changed_host_key_is_refused_even_with_accept_new(cluster, tmp_path):
    configure(cluster)
    kh = tmp_path / "known_hosts"
    other = (cluster.nodes["node01"].dir / "hostkey.pub").read_text().split()[:2]
    lines = [ln for ln in cluster.known_hosts.read_text().splitlines() if f":{cluster.nodes['node02'].port} " not in ln]
    lines.append(f"[127.0.0.1]:{cluster.nodes['node02'].port} {other[0]} {other[1]}")
    kh.write_text("\n".join(lines) + "\n")
    with SSHRunner(ssh_config=str(cluster.ssh_config), known_hosts=str(kh), connect_timeout=3,
                   accept_new_hosts=True) as r:
        res = r.run("node02", "true", 5)
    assert res.error and "does not match known_hosts" in res.error


@pytest.fixture
def dead_hosts(cluster, tmp_path):
    """node05: nothing listening; node06: accepts TCP and never speaks (a hung host)."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    cfg = tmp_path / "ssh_config"
    cfg.write_text(cluster.ssh_config.read_text() + f"\nHost node05\n  HostName 127.0.0.1\n  Port {closed_port}\n"
                   f"\nHost node06\n  HostName 127.0.0.1\n  Port {silent.getsockname()[1]}\n")
    yield cfg
    stop.set()
    t.join()
    for s in held:
        s.close()
    silent.close()


def test_unreachable_and_hanging_hosts_fail_and_the_rest_finish(cluster, dead_hosts):
    configure(cluster)
    hosts = NODES + ["node05", "node06"]
    with SSHRunner(ssh_config=str(dead_hosts), known_hosts=str(cluster.known_hosts), connect_timeout=2) as r:
        res = run_preflight(r, hosts, PreflightOptions(probe_timeout=10, nccl_timeout=20))
    bw = assemble(res)
    assert failing(bw) == {("node05", "reachable"), ("node06", "reachable")}
    assert "connection refused" in res.unreachable["node05"]
    assert "no SSH banner" in res.unreachable["node06"] or "timed out" in res.unreachable["node06"]
    assert sorted(h for h in hosts if bw.nodes[h].status != "fail") == NODES
    assert bw.inter_node_busbw_gbs == 338.82


def test_jump_host_is_used(cluster, dead_hosts):
    configure(cluster)
    with runner(cluster, jump="node01") as r:
        assert r.run("node03", "echo $REPLAY_NODE", 5).stdout.strip() == "node03"
    with SSHRunner(ssh_config=str(dead_hosts), known_hosts=str(cluster.known_hosts), connect_timeout=2,
                   jump="node05") as r:
        res = r.run("node03", "true", 5)
    assert res.error and res.error.startswith("jump host node05:")


def test_cli_end_to_end_names_the_bad_node(cluster, tmp_path):
    configure(cluster, bad="node04", GPU_QUERY="gq-ecc.csv")
    out = tmp_path / "bwmap.json"
    p = subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", "preflight",
                        "--hosts", "node[01-04]", "--ssh-config", str(cluster.ssh_config), "--known-hosts",
                        str(cluster.known_hosts), "--connect-timeout", "3", "--nccl-timeout", "20", "-o", str(out),
                        "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 1, p.stderr
    d = json.loads(p.stdout)
    assert d["exclude"] == ["node04"]
    assert {(c["node"], c["check"]) for c in d["checks"] if c["status"] == "fail"} == {("node04", "ecc")}
    for phase in ("[probe] node01:", "[nccl-node] node04:", "[nccl-pairs] round 1: up to 2 pair(s)", "[nccl-all] 3 nodes"):
        assert phase in p.stderr
    assert json.loads(Path(out).read_text())["exclude"] == ["node04"]


def test_refused_authentication_is_that_hosts_reason(cluster, tmp_path):
    from tests.services.sshd import keygen

    configure(cluster)
    keygen(tmp_path / "stranger")
    with SSHRunner(ssh_config=str(cluster.ssh_config), known_hosts=str(cluster.known_hosts), connect_timeout=3,
                   identity_file=str(tmp_path / "stranger"), use_agent=False) as r:
        res = run_preflight(r, NODES[:2], PreflightOptions(nccl=NcclOptions(enabled=False)))
    assert set(res.unreachable) == {"node01", "node02"}
    assert all("authentication failed" in why for why in res.unreachable.values())


def test_saved_raw_outputs_import_to_the_same_map(cluster, dead_hosts, tmp_path):
    from checks.folder import load_dir, save_dir

    configure(cluster, bad="node02", NCCL_PAIR_OVERRIDE="nccl-tests/"
              "a100-oci-bm-gpu4.8-2node-16gpu-all_reduce_perf-10G-single-size.txt")
    with SSHRunner(ssh_config=str(dead_hosts), known_hosts=str(cluster.known_hosts), connect_timeout=2) as r:
        res = run_preflight(r, NODES + ["node05"], PreflightOptions(probe_timeout=10, nccl_timeout=20))
    live = assemble(res)
    again = assemble(load_dir(save_dir(res, tmp_path / "raw")))
    assert live.exclude == ["node02", "node05"] and sorted(again.exclude) == live.exclude
    assert failing(again) == failing(live) == {("node02", "nccl_inter"), ("node05", "reachable")}
    assert (again.intra_node_busbw_gbs, again.inter_node_busbw_gbs) == (live.intra_node_busbw_gbs,
                                                                       live.inter_node_busbw_gbs)
    assert sorted((p.a, p.b, p.busbw_gbs) for p in again.pairs) == sorted((p.a, p.b, p.busbw_gbs) for p in live.pairs)


def test_flooding_command_is_stopped_at_the_output_limit(cluster):
    """A node whose tool floods its output (`yes` here): reading stops at the limit, the result says why,
    and the connection serves the next command."""
    configure(cluster)
    with runner(cluster, output_limit=1 << 20) as r:
        res = r.run(NODES[0], "yes", 60)
        after = r.run(NODES[0], "echo fine", 10)
    assert not res.ok and "output larger than 1 MiB" in res.reason() and len(res.stdout) == 1 << 20
    assert after.ok and after.stdout.strip() == "fine"
