"""diagnose on the real captured logs in ../shared/fixtures/nccl-logs: one test per file, asserting
the facts that file holds (versions, hosts, transports, the stalled rank, IB completion status), plus
the plan/bandwidth-map flags (TP across nodes, socket fallback, NIC not nearest).

Plans and bandwidth maps here are built by hand (what the planner / preflight would emit); the
logs themselves are never edited or invented.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from launcher.diagnose import diagnose
from launcher.diagnose.collect import build_report, read_sources
from launcher.formats.bwmap import BandwidthMap, NodeReport
from launcher.plan.model import Plan
from tests.conftest import shared_file
from tests.trainer_helpers import make_plan

pytestmark = pytest.mark.unit

LOGS = "nccl-logs"
F_SOCKET = "2node-8rank-nccl2.7.8-init-INFO-net-socket-fallback-p2p-shm-old-format.txt"
F_IB = "h100-roce-2node-16rank-nccl2.27.5-init-INFO-p2p-ipc-net-ib-gdrdma.txt"
F_IB_ERR12 = "nccl-warn-net-ib-completion-error12-old-format-azure.txt"
F_IB_PAIR = "nccl-warn-net-ib-completion-status5-status12-roce-pair.txt"
F_FLIGHT = "pytorch-flight-recorder-torchfrtrace-missing-rank.txt"
F_WATCHDOG = "pytorch-watchdog-timeout-600000ms-allreduce-full-torchrun-sigabrt.txt"
F_DESYNC = "pytorch-watchdog-timeout-desync-debug-2rank-8s.txt"


def diagnose_plan(tp: int = 1, dp: int = 1, pp: int = 1, cp: int = 1, gpus_per_node: int = 8,
                  hosts: list[str] | None = None) -> Plan:
    """The Plan a fully fixed `parallel` section gives (only the fields diagnose reads matter)."""
    gpn = min(gpus_per_node, tp * cp * pp * dp)
    plan = make_plan(tp=tp, cp=cp, pp=pp, dp=dp, zero=0, global_batch=dp, gpus_per_node=gpus_per_node,
                     forced=tp > gpn)
    return dataclasses.replace(plan, hosts=hosts, tp_node_local=tp <= gpn)


def save_plan(tmp_path: Path, plan: Plan) -> Path:
    p = tmp_path / "plan.json"
    plan.save(p)
    return p


def kinds(report) -> list[str]:
    return [f.kind for f in report.findings]


def only(report, kind):
    found = [f for f in report.findings if f.kind == kind]
    assert len(found) == 1, (kind, [(f.kind, f.message) for f in report.findings])
    return found[0]


# ---- NCCL init --------------------------------------------------------------------------

def test_nccl_278_socket_old_format():
    path = shared_file(LOGS, F_SOCKET)
    src = read_sources(path)
    init = src.init
    assert sorted(init.versions) == ["2.7.8+cuda10.1"]
    assert init.versions["2.7.8+cuda10.1"] == [f"{F_SOCKET}:7"]  # the bare "NCCL version" line
    (comm,) = init.comms.values()
    assert comm.nranks == 8 and comm.comm_id is None
    seats = {r: (i.host, i.pid, i.cuda_dev, i.bus_id) for r, i in comm.members.items()}
    assert seats == {0: ("tesla-105", 1475, 0, "18000"), 1: ("tesla-105", 1477, 1, "1a000"),
                     2: ("tesla-105", 1480, 2, "af000"), 3: ("tesla-105", 1481, 3, "b1000")}
    assert comm.transports() == {"NET/Socket": 8, "P2P/IPC": 8, "SHM": 4}
    assert comm.rings == {0: list(range(8)), 1: list(range(8))}
    assert comm.trees[1] == {0: "2/4/-1->1->0|0->1->2/4/-1", 1: "2/-1/-1->1->0|0->1->2/-1/-1"}
    sock = [c for c in comm.channels if c.net == "Socket"]
    assert {(c.src, c.dst, c.direction) for c in sock} >= {(3, 4, "send"), (7, 0, "receive"), (0, 5, "send")}
    assert all(c.nic == 0 and not c.gdr for c in sock)
    assert init.rank_hosts() == {0: "tesla-105", 1: "tesla-105", 2: "tesla-105", 3: "tesla-105"}

    report = build_report(src)
    # TCP with no sign that IB exists: a fact, not a problem (exit 0)
    assert not report.problem and report.stalled_ranks == []
    f = only(report, "socket_transport")
    assert f.severity == "info" and "NET/Socket" in f.message and "libibverbs" in f.message
    assert f"{F_SOCKET}:4" in f.evidence  # misc/ibvwrap.cc:63 NCCL WARN Failed to open libibverbs.so
    assert "nccl_warn" not in kinds(report)


def test_nccl_2275_ib_gdrdma_p2p_ipc():
    path = shared_file(LOGS, F_IB)
    src = read_sources(path)
    init = src.init
    assert sorted(init.versions) == ["2.27.5+cuda12.9"] and len(init.versions["2.27.5+cuda12.9"]) == 8
    (comm,) = init.comms.values()
    assert comm.key == comm.comm_id == "0xde4443395863ef4a"
    assert comm.nranks == 16 and comm.nnodes == 2 and sorted(comm.members) == list(range(8, 16))
    nine = comm.members[9]
    assert (nine.host, nine.pid, nine.cuda_dev, nine.nvml_dev, nine.bus_id) == \
        ("tpgds-aihub0008", 207008, 1, 1, "2a000")
    assert comm.complete == set(range(8, 16))
    assert comm.transports() == {"P2P/IPC": 240, "NET/IB/GDRDMA": 64}
    net = [c for c in comm.channels if c.kind == "NET"]
    assert {c.net for c in net} == {"IB"} and all(c.gdr for c in net)
    # every GPU k uses IB device k ("NET/IB/1/GDRDMA" on cudaDev 1)
    assert all(c.nic == comm.members[c.src if c.direction == "send" else c.dst].cuda_dev for c in net)
    assert init.ib_devices[("tpgds-aihub0008", 207008)] == [
        "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_11"]
    assert {n for n, _ in init.networks.values()} == {"IB"}
    assert comm.trees[8][0] == "9/-1/-1->8->0"
    report = build_report(src)
    assert not report.problem
    assert "socket_fallback" not in kinds(report) and "socket_transport" not in kinds(report)
    summary = report.nccl
    assert summary["versions"] == ["2.27.5+cuda12.9"]
    assert [r["rank"] for r in summary["ranks"]] == list(range(8, 16))
    assert summary["communicators"][0]["hosts"] == ["tpgds-aihub0008"]


def test_tp_group_over_network_is_flagged(tmp_path):
    """The SGLang job behind this log ran TP=16 on 2 nodes: its TP communicator uses NET/IB."""
    log = shared_file(LOGS, F_IB)
    plan = save_plan(tmp_path, diagnose_plan(tp=16, gpus_per_node=8))
    report = diagnose(log, plan_path=plan)
    f = only(report, "tp_across_nodes")
    assert f.severity == "warning" and f.ranks == list(range(16))
    assert "NET/IB/GDRDMA" in f.message and "2 nodes" in f.message
    assert any("via NET/IB" in _line(log, e) for e in f.evidence)
    assert report.problem and report.stalled_ranks == []


def test_dp_communicator_over_network_is_not_tp(tmp_path):
    """Same log under tp=8 x dp=2: the 16-rank communicator is the world, not a TP group."""
    log = shared_file(LOGS, F_IB)
    report = diagnose(log, plan_path=save_plan(tmp_path, diagnose_plan(tp=8, dp=2)))
    assert "tp_across_nodes" not in kinds(report) and not report.problem


def _bwmap_from_topo(tmp_path: Path, host: str, swap: tuple[str, str] | None = None) -> Path:
    """A bandwidth map whose gpu_nic is read off the same cluster's `nvidia-smi topo -m` capture
    (devopsrustem/slurmv4 3/12.sh, the log above is from 3/13.sh): GPU k is PIX to mlx5_{0,1,2,5,6,7,8,11}[k]."""
    text = shared_file("topo", "h100-sxm-8gpu-12nic-mlx5-1numa.txt").read_text()
    parse_topo = pytest.importorskip("checks.parsers.topo").parse_topo
    near = parse_topo(text).nearest_nic
    if swap:
        near[swap[0]] = swap[1]
    bw = BandwidthMap(nodes={host: NodeReport(host=host, gpus=8, gpu_nic=near)})
    p = tmp_path / "bwmap.json"
    bw.save(p)
    return p


def test_gpus_on_nearest_nic_pass(tmp_path):
    log = shared_file(LOGS, F_IB)
    report = diagnose(log, bwmap_path=_bwmap_from_topo(tmp_path, "tpgds-aihub0008"))
    assert "nic_not_nearest" not in kinds(report) and not report.problem


def test_gpu_on_far_nic_is_flagged(tmp_path):
    log = shared_file(LOGS, F_IB)
    bw = _bwmap_from_topo(tmp_path, "tpgds-aihub0008", swap=("GPU1", "mlx5_3"))
    report = diagnose(log, bwmap_path=bw)
    f = only(report, "nic_not_nearest")
    assert "GPU 1" in f.message and "mlx5_1" in f.message and "mlx5_3" in f.message
    assert f.hosts == ["tpgds-aihub0008"] and report.problem
    assert "NET/IB/1/GDRDMA" in _line(log, f.evidence[0])


def test_socket_fallback_where_ib_exists(tmp_path):
    """Two nodes' logs side by side: one uses IB, the other fell back to sockets -> flagged."""
    d = tmp_path / "logs"
    d.mkdir()
    shutil.copy(shared_file(LOGS, F_IB), d / "a.log")
    shutil.copy(shared_file(LOGS, F_SOCKET), d / "b.log")
    report = diagnose(d)
    f = only(report, "socket_fallback")
    assert f.severity == "warning" and f.hosts == ["tesla-105"] and "tpgds-aihub0008" in f.message
    assert "b.log:4" in f.evidence and report.problem
    assert "socket_transport" not in kinds(report)


def test_socket_fallback_from_bandwidth_map(tmp_path):
    """Socket log alone, but preflight saw mlx5 NICs on that host -> a fallback, not a choice."""
    bw = BandwidthMap(nodes={"tesla-105": NodeReport(host="tesla-105", gpus=4, gpu_nic={"GPU0": "mlx5_0"})})
    bw.save(tmp_path / "bw.json")
    report = diagnose(shared_file(LOGS, F_SOCKET), bwmap_path=tmp_path / "bw.json")
    assert only(report, "socket_fallback").hosts == ["tesla-105"]


# ---- failures ---------------------------------------------------------------------------

def test_ib_completion_error_old_wrapped_format():
    log = shared_file(LOGS, F_IB_ERR12)
    report = diagnose(log)
    f = only(report, "ib_completion_error")
    assert "status=12" in f.message and "IBV_WC_RETRY_EXC_ERR" in f.message
    assert "vendor err 129 (Recv)" in f.message  # read from the wrapped continuation line
    assert "peer 10.2.0.5" in f.message and f.hosts == ["node-2"]
    assert f.evidence == [f"{F_IB_ERR12}:1"]
    assert report.problem and report.verdict.startswith("IB completion error on node-2")


def test_ib_completion_status5_and_status12_pair():
    log = shared_file(LOGS, F_IB_PAIR)
    report = diagnose(log)
    ib = [f for f in report.findings if f.kind == "ib_completion_error"]
    assert len(ib) == 2
    # retry-exceeded (the cause) ranks above the flush (the consequence)
    assert "status=12" in ib[0].message and "mlx5_10" in ib[0].message and "10.46.70.22" in ib[0].message
    assert ib[0].hosts == ["atl1g3r1u16gpu"] and ib[0].evidence == [f"{F_IB_PAIR}:6"]
    assert "status=5" in ib[1].message and "IBV_WC_WR_FLUSH_ERR" in ib[1].message and "mlx5_9" in ib[1].message
    assert ib[1].hosts == ["atl1g3r4u9gpu"] and "vendor err 249" in ib[1].message
    assert "atl1g3r1u16gpu" in report.verdict and "status=12" in report.verdict


def test_flight_recorder_torchfrtrace_missing_rank():
    log = shared_file(LOGS, F_FLIGHT)
    report = diagnose(log)
    assert report.stalled_ranks == [1]
    f = report.findings[0]
    assert f.kind == "stalled_rank" and f.confidence == 3
    assert "#5" in f.message and "nccl:all_reduce" in f.message and "0:default_pg" in f.message
    assert "scheduled" in f.message and f.evidence == [f"{F_FLIGHT}:2"]


def test_watchdog_timeout_600s_single_rank_log():
    log = shared_file(LOGS, F_WATCHDOG)
    src = read_sources(log)
    wd = src.failures.watchdog
    assert list(wd) == [0]
    w = wd[0]
    assert (w.seq, w.op, w.timeout_ms, w.ran_ms, w.enqueued, w.completed) == \
        (20585, "ALLREDUCE", 600000, 600000, 20589, 20584)
    assert w.pg == "0(default_pg)" and w.evidence == f"{F_WATCHDOG}:1"
    host = "distributed-training.us-central1-a.c.lance-dev-ayush.internal"
    assert src.failures.exits[0]["host"] == host and src.failures.exits[0]["exitcode"].startswith("-6")
    report = build_report(src)
    # one rank's log cannot name the stalled peer: say so rather than guess
    assert report.stalled_ranks == []
    assert report.findings[0].kind == "collective_timeout" and report.findings[0].ranks == [0]
    assert "SeqNum=20585" in report.verdict and "other ranks" in report.verdict
    exit_f = only(report, "process_exit")
    assert "SIGABRT" in exit_f.message and host in exit_f.message


def test_watchdog_timeout_with_plan_names_missing_rank(tmp_path):
    """The same log with the job's plan (2 ranks): rank 1 never timed out, so it never got there."""
    log = shared_file(LOGS, F_WATCHDOG)
    plan = save_plan(tmp_path, diagnose_plan(dp=2, gpus_per_node=1, hosts=["node-a", "node-b"]))
    report = diagnose(log, plan_path=plan)
    assert report.stalled_ranks == [1] and report.stalled_hosts == {1: "node-b"}
    assert "never reported a watchdog timeout" in report.verdict


def test_flight_recorder_hint_names_the_current_variable():
    """PyTorch's own line names TORCH_NCCL_TRACE_BUFFER_SIZE, which torch >= 2.13 calls deprecated on every
    rank: the advice is TORCH_FR_BUFFER_SIZE (what launch4d itself exports)."""
    verdict = diagnose(shared_file(LOGS, F_WATCHDOG)).verdict
    assert "the flight recorder was off: set TORCH_FR_BUFFER_SIZE=2000" in verdict
    assert "set TORCH_NCCL_TRACE_BUFFER_SIZE" not in verdict


def test_watchdog_desync_report_names_lagging_rank():
    log = shared_file(LOGS, F_DESYNC)
    src = read_sources(log)
    assert src.failures.watchdog[0].seq == 2 and src.failures.watchdog[0].timeout_ms == 8000
    report = build_report(src)
    assert report.stalled_ranks == [1]
    top = report.findings[0]
    assert top.kind == "stalled_rank" and "never joined collective #3 (ALLREDUCE)" in top.message
    assert f"{F_DESYNC}:4" in top.evidence
    assert report.verdict.startswith("rank 1 stalled")


def test_whole_fixture_dir_ranks_explicit_stall_first():
    d = shared_file(LOGS, F_DESYNC).parent
    report = diagnose(d)
    assert report.stalled_ranks == [1]
    assert report.findings[0].kind == "stalled_rank" and report.findings[0].confidence == 3
    assert len(report.files) == 7
    assert any(f.kind == "ib_completion_error" for f in report.findings)


def _line(path: Path, evidence: str) -> str:
    name, _, n = evidence.rpartition(":")
    return path.read_text(errors="replace").splitlines()[int(n) - 1]


def test_evidence_points_at_the_lines():
    log = shared_file(LOGS, F_IB_PAIR)
    report = diagnose(log)
    for f in report.findings:
        for e in f.evidence:
            assert "NCCL WARN" in _line(log, e)
    json.dumps(report.to_dict())


def test_init_hang_from_log_cut_mid_init(tmp_path):
    """The real 2.27.5 log cut at line 745 (what a job hung in init leaves): ranks 9 and 14 printed
    Init START but not Init COMPLETE."""
    lines = shared_file(LOGS, F_IB).read_text().splitlines(keepends=True)
    cut = tmp_path / "node1.log"
    cut.write_text("".join(lines[:745]))
    report = diagnose(cut)
    f = report.findings[0]
    assert f.kind == "nccl_init_hang" and f.ranks == [9, 14] and f.hosts == ["tpgds-aihub0008"]
    assert "8, 10-13, 15 finished" in f.message and report.problem
    assert report.nccl["communicators"][0]["init_incomplete"] == [9, 14]
    # cut before any rank finished: nobody completed, ranks 0-7 (the other node) are not in the logs
    early = tmp_path / "early.log"
    early.write_text("".join(lines[:300]))
    f = diagnose(early).findings[0]
    assert f.kind == "nccl_init_hang" and f.ranks == list(range(8, 16)) and "ranks not in these logs: 0-7" in f.message
