"""What the NCCL init lines say about placement: transports in use, socket fallback where IB
exists, TP communicators whose channels go over the network, and GPUs not on their nearest NIC.

The plan's TP groups come from launcher.plan.layout.groups(plan.degrees, plan.mesh_order, "tp"); a
communicator is a TP communicator when the global ranks of its members (each process's rank in the
largest communicator it joined) fall inside one TP group and in no same-sized group of another
dimension. Nearest NICs come from a BandwidthMap's nodes[host].gpu_nic (GPU index -> NIC name).
"""

from __future__ import annotations

import re
from typing import Any

from launcher.diagnose.findings import ERROR, INFO, WARNING, Finding
from launcher.diagnose.nccl_init import Comm, NcclInit


def init_findings(init: NcclInit, plan: Any = None, bwmap: Any = None) -> list[Finding]:
    if init.empty:
        return []
    out = [_summary(init)]
    out += _init_incomplete(init)
    out += _socket(init, bwmap)
    if plan is not None:
        out += _tp_over_net(init, plan)
    if bwmap is not None:
        out += _nic_not_nearest(init, bwmap)
    return out


def _summary(init: NcclInit) -> Finding:
    procs = init.global_ranks()
    hosts = sorted({h for h, _ in procs})
    world = init.world_size()
    transports: dict[str, int] = {}
    for c in init.comms.values():
        for k, v in c.transports().items():
            transports[k] = transports.get(k, 0) + v
    ver = ", ".join(sorted(init.versions)) or "version not logged"
    parts = [f"NCCL {ver}"]
    if procs:
        parts.append(f"{len(procs)} rank(s) logged on {', '.join(hosts)}" + (f" of {world}" if world else ""))
    if init.comms:
        parts.append(f"{len(init.comms)} communicator(s)")
    if transports:
        parts.append("channels " + ", ".join(f"{k} x{v}" for k, v in sorted(transports.items())))
    nets = sorted({n for n, _ in init.networks.values()})
    if nets:
        parts.append("network " + "/".join(nets))
    ev = [e for evs in init.versions.values() for e in evs[:1]] + [
        c.members[min(c.members)].evidence for c in init.comms.values() if c.members]
    return Finding("nccl_init", INFO, "; ".join(parts), ev[:6], hosts=hosts)


def _init_incomplete(init: NcclInit) -> list[Finding]:
    """ncclCommInitRank ... Init START with no Init COMPLETE: ranks stuck creating a communicator."""
    out = []
    for comm in init.comms.values():
        stuck = sorted(comm.started - comm.complete)
        if not stuck:
            continue
        hosts = sorted({comm.members[r].host for r in stuck})
        unseen = sorted(set(range(comm.nranks)) - set(comm.members)) if comm.nranks <= 4096 else []
        msg = (f"NCCL init of communicator {comm.key} ({comm.nranks} ranks) started but never completed on rank "
               f"{', '.join(map(str, stuck))} ({', '.join(hosts)})")
        if not comm.complete:
            msg += ": no rank finished init, so a peer never joined or cannot be reached (bootstrap/network)"
            if unseen:
                msg += f"; ranks not in these logs: {_span(unseen)}"
        else:
            msg += f" while rank {_span(sorted(comm.complete))} finished: those ranks hang in connection setup"
        out.append(Finding("nccl_init_hang", ERROR, msg, [comm.members[r].evidence for r in stuck][:6],
                           ranks=stuck, hosts=hosts))
    return out


def _span(ranks: list[int]) -> str:
    """[0,1,2,3,7] -> '0-3, 7'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(f"{start}-{r}" if r > start else str(r))
            start = None
    return ", ".join(parts)


def _ib_hosts(init: NcclInit, bwmap: Any) -> set[str]:
    hosts = {h for (h, _), devs in init.ib_devices.items() if any(devs)}
    hosts |= {h for (h, _), (net, _) in init.networks.items() if net == "IB"}
    for c in init.comms.values():
        hosts |= {ch.host for ch in c.channels if ch.kind == "NET" and ch.net == "IB"}
    if bwmap is not None:
        for h, node in getattr(bwmap, "nodes", {}).items():
            if any(re.match(r"(mlx\d|ib|bnxt_re|irdma|rocep|efa)", str(n)) for n in (node.gpu_nic or {}).values()):
                hosts.add(h)
    return hosts


def _socket(init: NcclInit, bwmap: Any) -> list[Finding]:
    sock_hosts: dict[str, str] = {}
    for (h, _), (net, ev) in init.networks.items():
        if net == "Socket":
            sock_hosts.setdefault(h, ev)
    for c in init.comms.values():
        for ch in c.channels:
            if ch.kind == "NET" and ch.net == "Socket":
                sock_hosts.setdefault(ch.host, ch.evidence)
    if not sock_hosts:
        return []
    ib = _ib_hosts(init, bwmap)
    evs = list(sock_hosts.values())
    missing_lib = [ev for h, ev in init.ib_unavailable if h in sock_hosts]
    why = " NCCL could not use IB there (libibverbs failed to load or no IB device)." if missing_lib else ""
    if ib:
        return [Finding("socket_fallback", WARNING,
                        f"NCCL fell back to TCP sockets (NET/Socket) on {', '.join(sorted(sock_hosts))} although "
                        f"InfiniBand/RoCE is in use on {', '.join(sorted(ib))}.{why} Inter-node collectives run "
                        "an order of magnitude slower; check NCCL_IB_DISABLE, NCCL_IB_HCA, rdma-core in the image",
                        evs + missing_lib[:2], hosts=sorted(sock_hosts))]
    return [Finding("socket_transport", INFO,
                    f"inter-node traffic uses TCP sockets (NET/Socket) on {', '.join(sorted(sock_hosts))}.{why} "
                    "If these nodes have InfiniBand/RoCE NICs, install rdma-core (libibverbs) so NCCL can use them",
                    evs + missing_lib[:2], hosts=sorted(sock_hosts))]


def _comm_global(init: NcclInit, comm: Comm) -> set[int]:
    procs = init.global_ranks()
    return {procs[(i.host, i.pid)] for i in comm.members.values() if (i.host, i.pid) in procs}


def _tp_over_net(init: NcclInit, plan: Any) -> list[Finding]:
    from launcher.plan import layout

    tp = plan.degrees.get("tp", 1)
    if tp <= 1:
        return []
    tp_groups = [set(g) for g in layout.groups(plan.degrees, plan.mesh_order, "tp")]
    others = [set(g) for d in plan.mesh_order if d != "tp" and plan.degrees.get(d, 1) == tp
              for g in layout.groups(plan.degrees, plan.mesh_order, d)]
    out = []
    for comm in init.comms.values():
        if comm.nranks != tp:
            continue
        members = _comm_global(init, comm)
        if not members:
            continue
        group = next((g for g in tp_groups if members <= g), None)
        if group is None or (members != group and any(members <= g for g in others)):
            continue
        net = [c for c in comm.channels if c.kind == "NET"]
        hosts = sorted({i.host for i in comm.members.values()})
        if not net and len(hosts) < 2 and (comm.nnodes or 1) < 2:
            continue
        labels = sorted({c.label for c in net})
        g = sorted(group)
        span = f"{comm.nnodes} nodes" if comm.nnodes and comm.nnodes > 1 else ", ".join(hosts)
        out.append(Finding(
            "tp_across_nodes", WARNING,
            f"TP group ranks {g[0]}-{g[-1]} (communicator {comm.key}, {comm.nranks} ranks) spans {span}: "
            + (f"{len(net)} of its channels go over {', '.join(labels)}. " if net else "")
            + "Tensor parallelism across nodes runs every layer's all-reduce over the network "
            "(~10x slower than NVLink); keep tp <= GPUs per node",
            [c.evidence for c in net[:4]] + [i.evidence for i in list(comm.members.values())[:2]],
            ranks=g, hosts=hosts))
    return out


def _nearest(bwmap: Any, host: str) -> dict[int, str] | None:
    nodes = getattr(bwmap, "nodes", {}) or {}
    node = nodes.get(host) or next((n for h, n in nodes.items() if h.split(".")[0] == host.split(".")[0]), None)
    if node is None or not node.gpu_nic:
        return None
    out = {}
    for k, v in node.gpu_nic.items():
        m = re.search(r"(\d+)$", str(k))
        if m and v and not re.fullmatch(r"NIC\d+", str(v)):
            out[int(m.group(1))] = str(v).split(":")[0]
    return out


def _nic_not_nearest(init: NcclInit, bwmap: Any) -> list[Finding]:
    used: dict[tuple[str, int], dict[str, str]] = {}  # (host, gpu) -> nic name -> evidence
    for comm in init.comms.values():
        seats = {r: i for r, i in comm.members.items()}
        for ch in comm.channels:
            if ch.kind != "NET" or ch.nic is None or ch.proxy is not None:
                continue  # PXN channels use another GPU's NIC by design
            me = ch.src if ch.direction == "send" else ch.dst
            info = seats.get(me)
            if info is None or (info.host, info.pid) != (ch.host, ch.pid):
                continue
            names = init.ib_devices.get((ch.host, ch.pid)) if ch.net == "IB" else None
            if not names or ch.nic >= len(names):
                continue
            gpu = info.nvml_dev if info.nvml_dev is not None else info.cuda_dev
            used.setdefault((ch.host, gpu), {}).setdefault(names[ch.nic], ch.evidence)
    out = []
    for (host, gpu), nics in sorted(used.items()):
        near = _nearest(bwmap, host)
        if not near or gpu not in near:
            continue
        want = near[gpu]
        wrong = {n: ev for n, ev in nics.items() if n != want}
        if wrong:
            out.append(Finding(
                "nic_not_nearest", WARNING,
                f"{host} GPU {gpu} sends over {', '.join(sorted(wrong))} but its nearest NIC is {want} "
                "(bandwidth map): traffic crosses PCIe/CPU; check NCCL_IB_HCA ordering and NCCL_CROSS_NIC",
                list(wrong.values())[:3], hosts=[host]))
    return out
