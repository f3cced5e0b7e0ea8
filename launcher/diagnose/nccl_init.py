"""NCCL_DEBUG=INFO init lines: version, who runs where, communicators, rings/trees, transports.

Formats come from real logs (../shared/fixtures/nccl-logs): NCCL 2.27 prints
`ncclCommInitRank comm P rank R nranks N cudaDev D nvmlDev M busId B commId C - Init START`
and `Channel 06/0 : 7[7] -> 14[6] [receive] via NET/IB/6/GDRDMA` (peer bracket = nvmlDev);
NCCL 2.7 prints `comm P rank R nranks N cudaDev D busId B - Init COMPLETE` at the end of init
and `Channel 00 : 3[b1000] -> 4[18000] [send] via NET/Socket/0` (bracket = busId), with channel
lines on the init thread before it. Transport strings follow NCCL's transport/{p2p,shm,net}.cc:
`P2P/IPC`, `P2P/CUMEM`, `P2P/direct pointer` (+`/read`), `SHM/direct/direct` (old: `direct shared
memory`), `NET/<name>/<dev>[(proxy)][/GDRDMA][/Shared]`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# host:pid:tid [cudaDev] [file.cc:line ]NCCL LEVEL message; not anchored, so torchrun/srun
# prefixes ("[default0]:", "0: ") and NCCL_DEBUG_TIMESTAMP_FORMAT stamps are tolerated. The host
# starts where a run of host characters starts (the lookbehind): the host always ends at the run's
# end, so the match is the same, and a search is linear in the line instead of trying every
# position inside one long run (an 80 kB line of text containing "NCCL" took 53 s).
PREFIX_RE = re.compile(
    r"(?<![A-Za-z0-9_.\-])(?P<host>[A-Za-z0-9_.\-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] "
    r"(?:(?P<src>[\w./\-]+:\d+) )?NCCL (?P<level>INFO|WARN|TRACE|ERROR|ABORT) ?(?P<msg>.*)$")
VERSION_RE = re.compile(r"NCCL version (\d+\.\d+\.\d+[^\s]*)")
INIT_NEW_RE = re.compile(
    r"ncclCommInitRank(?:Config|Scalable)? comm (?P<ptr>0x[0-9a-f]+) rank (?P<rank>\d+) nranks (?P<nranks>\d+) "
    r"cudaDev (?P<cuda>\d+)(?: nvmlDev (?P<nvml>\d+))? busId (?P<bus>[0-9a-fA-F]+)"
    r"(?: commId (?P<cid>0x[0-9a-fA-F]+))?.*?- Init (?P<phase>START|COMPLETE)")
INIT_OLD_RE = re.compile(
    r"^comm (?P<ptr>0x[0-9a-f]+) rank (?P<rank>\d+) nranks (?P<nranks>\d+) cudaDev (?P<cuda>\d+)"
    r"(?: nvmlDev (?P<nvml>\d+))? busId (?P<bus>[0-9a-fA-F]+)(?: commId (?P<cid>0x[0-9a-fA-F]+))?"
    r".*?- Init (?P<phase>START|COMPLETE)")
NNODES_RE = re.compile(r"^comm (?P<ptr>0x[0-9a-f]+) rank (?P<rank>\d+) nRanks (?P<nranks>\d+) nNodes (?P<nnodes>\d+)")
CHANNEL_RE = re.compile(
    r"^Channel (?P<ch>\d+)(?:/(?P<conn>\d+))? : (?P<src>\d+)\[(?P<sdev>[0-9a-fA-F]+)\] -> "
    r"(?P<dst>\d+)\[(?P<ddev>[0-9a-fA-F]+)\](?: \[(?P<dir>send|receive)\])? via (?P<via>.+?)\s*$")
RING_RE = re.compile(r"^Channel (?P<ch>\d+)/(?P<n>\d+) :(?P<ranks>(?:\s+\d+)+)\s*$")
TREES_RE = re.compile(r"^Trees ")
TREE_ITEM_RE = re.compile(r"\[(\d+)\] (\S+)")
NET_RE = re.compile(r"^NET/(?P<net>.+?)/(?P<dev>\d+)(?:\((?P<proxy>\d+)\))?(?P<rest>.*)$")
USING_NET_RE = re.compile(r"^Using network (?P<net>.+?)\s*$")
IB_DEVS_RE = re.compile(r"^NET/IB ?: Using (?P<list>.*)$")
IB_DEV_ITEM_RE = re.compile(r"\[(\d+)\]([\w.\-]+):(\d+)/(\w+)")
MAX_NICS = 1024
#: Channels kept per communicator (distinct ones; all are counted): a long or looping log stays bounded.
MAX_CHANNELS = 8192
MAX_PENDING = 65536
MAX_EVIDENCE = 8


def _push(items: list, item: Any, cap: int = MAX_EVIDENCE) -> None:
    if len(items) < cap:
        items.append(item)


@dataclass
class RankInfo:
    """One process's seat in one communicator."""

    rank: int
    host: str
    pid: int
    cuda_dev: int
    nvml_dev: int | None
    bus_id: str
    evidence: str


@dataclass
class Channel:
    channel: int
    src: int
    dst: int
    direction: str | None
    via: str
    kind: str  # P2P | SHM | NET | NVLS | COLLNET | OTHER
    net: str | None
    nic: int | None
    gdr: bool
    host: str
    pid: int
    evidence: str
    proxy: int | None = None  # PXN: "NET/IB/1(9)" goes through rank 9's NIC on purpose

    @property
    def label(self) -> str:
        if self.kind == "NET":
            return f"NET/{self.net}" + ("/GDRDMA" if self.gdr else "")
        if self.kind == "P2P":
            return "P2P/" + self.via.split("/")[1] if "/" in self.via else self.via
        return self.kind


@dataclass
class Comm:
    key: str
    comm_id: str | None
    nranks: int
    members: dict[int, RankInfo] = field(default_factory=dict)
    channels: list[Channel] = field(default_factory=list)
    rings: dict[int, list[int]] = field(default_factory=dict)
    trees: dict[int, dict[int, str]] = field(default_factory=dict)
    nnodes: int | None = None
    complete: set[int] = field(default_factory=set)
    started: set[int] = field(default_factory=set)

    counts: dict[str, int] = field(default_factory=dict)  # every channel line, by transport label
    seen: set[tuple] = field(default_factory=set)

    def transports(self) -> dict[str, int]:
        return dict(self.counts)


@dataclass
class NcclInit:
    versions: dict[str, list[str]] = field(default_factory=dict)
    comms: dict[str, Comm] = field(default_factory=dict)
    networks: dict[tuple[str, int], tuple[str, str]] = field(default_factory=dict)  # proc -> (net, ev)
    ib_devices: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    ib_devices_ev: dict[str, str] = field(default_factory=dict)  # host -> evidence
    ib_unavailable: list[tuple[str, str]] = field(default_factory=list)  # (host, evidence)
    # parse state
    _current: dict[tuple[str, int], str] = field(default_factory=dict)
    _pending: dict[tuple[str, int, int], list[tuple[str, Any]]] = field(default_factory=dict)
    _pending_n: int = 0
    _pending_seen: dict[tuple[str, int, int], set[tuple]] = field(default_factory=dict)
    _ptr: dict[tuple[str, int, str], str] = field(default_factory=dict)
    _ordinal: dict[tuple[str, int, int], int] = field(default_factory=dict)

    # ---- parsing ---------------------------------------------------------------------
    def feed(self, line: str, evidence: str) -> None:
        """Take one log line (anything; non-NCCL lines are ignored)."""
        if "NCCL" not in line:
            return
        m = PREFIX_RE.search(line)
        if not m:
            v = VERSION_RE.search(line)
            if v:  # NCCL 2.7 prints a bare "NCCL version 2.7.8+cuda10.1"
                _push(self.versions.setdefault(v.group(1), []), evidence)
            return
        host, pid, tid = m["host"], int(m["pid"]), int(m["tid"])
        msg, level = m["msg"], m["level"]
        if level == "WARN":
            if "libibverbs" in msg or "NET/IB : No device found" in msg:
                _push(self.ib_unavailable, (host, evidence), 64)
            return
        if level != "INFO":
            return
        proc = (host, pid)
        if msg.startswith("NCCL version"):
            v = VERSION_RE.search(msg)
            if v:
                _push(self.versions.setdefault(v.group(1), []), evidence)
        elif msg.startswith("Channel "):
            c = CHANNEL_RE.match(msg)
            if c:
                self._route(proc, tid, ("channel", _channel(c, host, pid, evidence)))
                return
            r = RING_RE.match(msg)
            if r:
                self._route(proc, tid, ("ring", (int(r["ch"]), [int(x) for x in r["ranks"].split()])))
        elif TREES_RE.match(msg):
            self._route(proc, tid, ("trees", {int(a): b for a, b in TREE_ITEM_RE.findall(msg)}))
        elif "ncclCommInitRank" in msg or msg.startswith("comm 0x"):
            self._init_line(msg, host, pid, tid, evidence)
        elif msg.startswith("Using network"):
            u = USING_NET_RE.match(msg)
            if u:
                self.networks[proc] = (u["net"], evidence)
        elif msg.startswith("NET/IB") and "No device found" in msg:
            _push(self.ib_unavailable, (host, evidence), 64)
        elif msg.startswith("NET/IB"):
            d = IB_DEVS_RE.match(msg)
            if d:
                devs = [x for x in IB_DEV_ITEM_RE.findall(d["list"]) if int(x[0]) < MAX_NICS]
                if devs:
                    names = [""] * (max(int(i) for i, *_ in devs) + 1)
                    for i, name, _port, _link in devs:
                        names[int(i)] = name
                    self.ib_devices[proc] = names
                    self.ib_devices_ev.setdefault(host, evidence)
        elif msg.startswith("NCCL_IB_DISABLE set by environment to 1"):
            _push(self.ib_unavailable, (host, evidence), 64)

    def _init_line(self, msg: str, host: str, pid: int, tid: int, evidence: str) -> None:
        proc = (host, pid)
        n = NNODES_RE.match(msg)
        if n:
            key = self._ptr.get((host, pid, n["ptr"]))
            if key and key in self.comms:
                self.comms[key].nnodes = int(n["nnodes"])
            return
        m = INIT_NEW_RE.search(msg) or INIT_OLD_RE.match(msg)
        if not m:
            return
        nranks, rank = int(m["nranks"]), int(m["rank"])
        key = self._ptr.get((host, pid, m["ptr"]))
        if key is None:
            if m["cid"]:
                key = m["cid"]
            else:
                # NCCL < 2.1x prints no commId: same-size communicators are told apart by the
                # order each process created them (processes create PGs in the same order).
                o = self._ordinal.get((host, pid, nranks), 0)
                self._ordinal[(host, pid, nranks)] = o + 1
                key = f"nranks={nranks}#{o}"
            self._ptr[(host, pid, m["ptr"])] = key
        comm = self.comms.get(key)
        if comm is None:
            comm = self.comms[key] = Comm(key=key, comm_id=m["cid"], nranks=nranks)
        if rank not in comm.members:
            comm.members[rank] = RankInfo(rank=rank, host=host, pid=pid, cuda_dev=int(m["cuda"]),
                                          nvml_dev=int(m["nvml"]) if m["nvml"] else None,
                                          bus_id=m["bus"], evidence=evidence)
        if m["phase"] == "START":
            comm.started.add(rank)
            self._current[proc] = key
            return
        comm.complete.add(rank)
        # NCCL 2.7: channel/ring/tree lines come before "Init COMPLETE" on the same thread
        keys = [(host, pid, tid)] if (host, pid, tid) in self._pending else [
            k for k in self._pending if k[:2] == proc]
        for k in keys:
            items = self._pending.pop(k)
            self._pending_n -= len(items)
            self._pending_seen.pop(k, None)
            for item in items:
                self._attach(comm, rank, item)
        if self._current.get(proc) == key:
            del self._current[proc]

    def _route(self, proc: tuple[str, int], tid: int, item: tuple[str, Any]) -> None:
        key = self._current.get(proc)
        if key is not None and key in self.comms:
            comm = self.comms[key]
            rank = next((r for r, i in comm.members.items() if (i.host, i.pid) == proc), -1)
            self._attach(comm, rank, item)
        elif self._pending_n < MAX_PENDING:  # lines waiting for their Init COMPLETE; a log with none stays bounded
            what, data = item
            if what == "channel":
                seen = self._pending_seen.setdefault((proc[0], proc[1], tid), set())
                ident = (data.channel, data.src, data.dst, data.direction, data.via)
                if ident in seen:
                    return  # the same channel line again (no COMPLETE between): nothing new
                seen.add(ident)
            pending = self._pending.setdefault((proc[0], proc[1], tid), [])
            if len(pending) < MAX_CHANNELS:
                pending.append(item)
                self._pending_n += 1

    @staticmethod
    def _attach(comm: Comm, rank: int, item: tuple[str, Any]) -> None:
        what, data = item
        if what == "channel":
            comm.counts[data.label] = comm.counts.get(data.label, 0) + 1
            key = (data.channel, data.src, data.dst, data.direction, data.via)
            if key not in comm.seen and len(comm.channels) < MAX_CHANNELS:  # a repeated init adds no fact
                comm.seen.add(key)
                comm.channels.append(data)
        elif what == "ring":
            comm.rings.setdefault(data[0], data[1])
        elif what == "trees" and rank >= 0:
            comm.trees[rank] = data

    # ---- derived views ---------------------------------------------------------------
    def global_ranks(self) -> dict[tuple[str, int], int]:
        """(host, pid) -> global rank: the rank in the largest communicator the process joined."""
        best: dict[tuple[str, int], tuple[int, int]] = {}
        for comm in self.comms.values():
            for info in comm.members.values():
                p = (info.host, info.pid)
                if p not in best or comm.nranks > best[p][0]:
                    best[p] = (comm.nranks, info.rank)
        return {p: r for p, (_, r) in best.items()}

    def world_size(self) -> int | None:
        return max((c.nranks for c in self.comms.values()), default=None)

    def rank_hosts(self) -> dict[int, str]:
        procs = self.global_ranks()
        return {r: h for (h, _), r in procs.items()}

    @property
    def empty(self) -> bool:
        return not (self.versions or self.comms or self.networks)

    def summary(self) -> dict[str, Any]:
        procs = self.global_ranks()
        ranks = []
        for comm in sorted(self.comms.values(), key=lambda c: -c.nranks)[:1]:
            for r, i in sorted(comm.members.items()):
                ranks.append({"rank": r, "host": i.host, "pid": i.pid, "cuda_dev": i.cuda_dev,
                              "nvml_dev": i.nvml_dev, "bus_id": i.bus_id})
        comms = []
        for c in self.comms.values():
            comms.append({
                "key": c.key, "comm_id": c.comm_id, "nranks": c.nranks, "nnodes": c.nnodes,
                "ranks_seen": sorted(c.members),
                "global_ranks": sorted(procs[(i.host, i.pid)] for i in c.members.values()),
                "hosts": sorted({i.host for i in c.members.values()}),
                "transports": c.transports(),
                "rings": {str(k): v for k, v in sorted(c.rings.items())},
                "trees": {str(r): {str(k): v for k, v in t.items()} for r, t in sorted(c.trees.items())},
                "init_complete": sorted(c.complete),
                "init_incomplete": sorted(c.started - c.complete),
                "net_channels": [{"channel": ch.channel, "src": ch.src, "dst": ch.dst, "direction": ch.direction,
                                  "via": ch.via, "host": ch.host, "evidence": ch.evidence}
                                 for ch in c.channels if ch.kind == "NET"][:64],
            })
        return {
            "versions": sorted(self.versions),
            "ranks": ranks,
            "communicators": comms,
            "networks": sorted({n for n, _ in self.networks.values()}),
            "ib_devices": {h: d for (h, _), d in self.ib_devices.items()},
        }


def _channel(m: re.Match, host: str, pid: int, evidence: str) -> Channel:
    via = m["via"]
    kind, net, nic, gdr, proxy = "OTHER", None, None, False, None
    if via.startswith("P2P"):
        kind = "P2P"
    elif via.startswith("SHM") or "shared memory" in via:
        kind = "SHM"
    elif via.startswith("NVLS"):
        kind = "NVLS"
    elif via.upper().startswith("COLLNET"):
        kind = "COLLNET"
    else:
        n = NET_RE.match(via)
        if n:
            kind, net, nic, gdr = "NET", n["net"], int(n["dev"]), "GDRDMA" in n["rest"]
            proxy = int(n["proxy"]) if n["proxy"] else None
    return Channel(channel=int(m["ch"]), src=int(m["src"]), dst=int(m["dst"]), direction=m["dir"],
                   via=via, kind=kind, net=net, nic=nic, gdr=gdr, host=host, pid=pid, evidence=evidence,
                   proxy=proxy)
