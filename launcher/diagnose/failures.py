"""Failure lines: NCCL WARN, IB completion errors, PyTorch NCCL errors, watchdog timeouts, the
desync report, gloo timeouts, monitoredBarrier and torchrun's failure summary.

Texts are matched as the tools print them: NCCL WARN and IB completion lines from the real logs in
../shared/fixtures/nccl-logs (new `status=12 ... hca mlx5_10` and old `with error 12, opcode 0, len`
wrapped onto the next line); the watchdog and desync report from the same fixtures and PyTorch's
TraceUtils.h (`[R] joined but didn't finish collective #N`, `ranks [R] are the lagging ranks ...`);
gloo texts as torch 2.13 prints them (captured here on CPU: `Timed out waiting 3000ms for recv
operation to complete`, `Rank 1 failed to pass monitoredBarrier in 2000 ms`, `Connection closed by
peer [127.0.0.1]:55445`); `NCCL error in: <file>:<line>, <reason>, NCCL version X` is PyTorch's
DistBackendError text (no fixture; as printed in public logs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePath

from launcher.diagnose.findings import ERROR, INFO, WARNING, Finding, fmt_ranks
from launcher.diagnose.nccl_init import PREFIX_RE

TORCHRUN_RANK_RE = re.compile(r"\[rank(\d+)\]:?")
FILE_RANK_RE = re.compile(r"(?:^|[^A-Za-z0-9])rank[_\-]?(\d+)(?=$|[._\-])", re.I)
IB_NEW_RE = re.compile(
    r"Got completion from peer (?P<peer>[^\s<]+)<(?P<port>\d+)> with status=(?P<status>\d+)"
    r"(?: opcode=(?P<opcode>\d+))?(?: len=(?P<len>\d+))?(?: vendor err (?P<verr>\d+)(?: \((?P<dir>\w+)\))?)?"
    r"(?:.*?\bhca (?P<hca>\S+))?")
IB_OLD_RE = re.compile(
    r"Got completion from peer (?P<peer>[^\s<]+)<(?P<port>\d+)> with error (?P<status>\d+)"
    r"(?:, opcode (?P<opcode>\d+))?(?:, len(?: (?P<len>\d+))?)?(?:,? vendor err (?P<verr>\d+)(?: \((?P<dir>\w+)\))?)?")
VENDOR_CONT_RE = re.compile(r"^\s*(?:\d+,\s*)?vendor err (?P<verr>\d+)(?: \((?P<dir>\w+)\))?")
WATCHDOG_RE = re.compile(
    r"\[Rank (?P<rank>\d+)\]\s+Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d+), "
    r"OpType=(?P<op>\w+)(?!\w)(?P<rest>.*?)\) ran for (?P<ran>\d+) milliseconds")
TIMEOUT_MS_RE = re.compile(r"Timeout\(ms\)=(\d+)")
PG_STATUS_RE = re.compile(
    r"\[PG ID (?P<pgid>\d+) PG GUID (?P<guid>[^\]]*?) Rank (?P<rank>\d+)\]\s+failure detected by watchdog at "
    r"work sequence id: (?P<seq>\d+) PG status: last enqueued work: (?P<enq>\d+), last completed work: (?P<comp>\d+)")
DESYNC_TIMEOUT_RE = re.compile(r"\[(?P<rank>\d+)\] Timeout at collective: (?P<op>\w+), #(?P<seq>\d+)")
DESYNC_JOINED_RE = re.compile(r"\[(?P<ranks>[\d,\s]+)\] joined but didn't finish collective #(?P<seq>\d+)")
DESYNC_LAG_RE = re.compile(
    r"\[(?P<ranks>[\d,\s]+)\] finished collective #(?P<seq>\d+), but didn't join collective #(?P<next>\d+)")
DESYNC_NEVER_RE = re.compile(r"ranks \[(?P<ranks>[\d,\s]+)\] are the lagging ranks that caused this timeout")
NCCL_ERROR_RE = re.compile(r"NCCL error in: (?P<loc>[^,]+),\s*(?P<reason>[^,]*?)(?:,\s*NCCL version (?P<ver>\S+))?\s*$")
NCCL_ERRNAME_RE = re.compile(r"\b(?P<name>nccl[A-Z]\w*Error): (?P<text>.*)$")
GLOO_TIMEOUT_RE = re.compile(r"Timed out waiting (?P<ms>\d+)ms for (?P<op>recv|send) operation to complete")
MONITORED_RE = re.compile(r"Ranks? (?P<ranks>[\d,\s]+?) failed to pass monitoredBarrier in (?P<ms>\d+) ms")
PEER_CLOSED_RE = re.compile(r"[Cc]onnection (?:closed|reset) by peer(?: \[(?P<peer>[^\]]+)\]:\d+)?")
SUMMARY_BLOCK_RE = re.compile(r"^\s*\[(\d+)\]:\s*$")
SUMMARY_FIELD_RE = re.compile(r"^\s*(host|rank|exitcode|traceback)\s*:\s*(.*?)\s*$")

# ibv_wc_status (rdma-core verbs.h): the ones NCCL users meet, and what they usually mean.
IBV_WC_STATUS = {
    5: ("IBV_WC_WR_FLUSH_ERR", "work request flushed: the queue pair was already in error (a consequence of "
        "an earlier error, usually on the peer)"),
    10: ("IBV_WC_REM_ACCESS_ERR", "remote access error"),
    12: ("IBV_WC_RETRY_EXC_ERR", "transport retry counter exceeded: the peer did not answer (link down, "
         "cable/switch port, routing or GID/RoCE config between the two hosts)"),
    13: ("IBV_WC_RNR_RETRY_EXC_ERR", "receiver-not-ready retries exceeded: the peer stopped posting receives"),
    4: ("IBV_WC_LOC_PROT_ERR", "local protection error (memory registration)"),
    2: ("IBV_WC_LOC_QP_OP_ERR", "local QP operation error"),
    1: ("IBV_WC_LOC_LEN_ERR", "local length error"),
    8: ("IBV_WC_LOC_ACCESS_ERR", "local access error"),
    20: ("IBV_WC_RESP_TIMEOUT_ERR", "response timeout"),
}


#: Bounds on what a huge or looping log can make us keep: evidence per message, distinct messages.
MAX_EVIDENCE = 8
MAX_ITEMS = 2000


def _push(items: list, item: object, cap: int = MAX_EVIDENCE) -> None:
    if len(items) < cap:
        items.append(item)


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


@dataclass
class IbError:
    host: str
    dev: int
    peer: str
    status: int
    vendor_err: int | None
    direction: str | None
    hca: str | None
    evidence: str


@dataclass
class WatchdogTimeout:
    rank: int
    seq: int
    op: str
    timeout_ms: int | None
    ran_ms: int
    evidence: str
    enqueued: int | None = None
    completed: int | None = None
    pg: str | None = None


@dataclass
class Failures:
    ib_errors: list[IbError] = field(default_factory=list)
    warns: dict[str, list[str]] = field(default_factory=dict)  # message -> evidence
    warn_hosts: dict[str, set[str]] = field(default_factory=dict)
    nccl_errors: dict[str, list[str]] = field(default_factory=dict)
    nccl_error_ranks: dict[str, set[int]] = field(default_factory=dict)
    watchdog: dict[int, WatchdogTimeout] = field(default_factory=dict)
    desync: list[tuple[str, list[int], int, str]] = field(default_factory=list)  # (kind, ranks, seq, ev)
    desync_timeouts: dict[int, tuple[str, int, str]] = field(default_factory=dict)
    gloo_timeouts: dict[int | None, list[str]] = field(default_factory=dict)
    gloo_timeout_ms: int | None = None
    monitored: list[tuple[list[int], int, str]] = field(default_factory=list)
    peer_closed: dict[int | None, list[str]] = field(default_factory=dict)
    exits: dict[int, dict[str, str]] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    fr_disabled: str | None = None
    warn_counts: dict[str, int] = field(default_factory=dict)
    _ib_seen: set[tuple] = field(default_factory=set)
    _pending_ib: IbError | None = None
    _pending_nccl: tuple[str, str, int | None] | None = None
    _block: dict[str, str] | None = None
    _section: str = ""

    def feed(self, line: str, evidence: str, path: str) -> None:  # noqa: C901 - one dispatch table
        if self._pending_ib is not None:
            c = VENDOR_CONT_RE.match(line)
            if c and self._pending_ib.vendor_err is None:
                self._pending_ib.vendor_err = int(c["verr"])
                self._pending_ib.direction = c["dir"]
            self._pending_ib = None
        if self._pending_nccl is not None:
            key_ev, loc, rank = self._pending_nccl
            self._pending_nccl = None
            text = TORCHRUN_RANK_RE.sub("", line).strip()
            if text and not text.startswith("nccl"):
                self._add_nccl_error(f"{loc}, {text}", key_ev, rank)
                return
        self._summary(line, evidence)
        rank = self._line_rank(line, path)
        if "NCCL" in line:
            m = PREFIX_RE.search(line)
            if m and m["level"] == "WARN":
                self._warn(m, evidence)
                return
            if "NCCL error in:" in line:
                e = NCCL_ERROR_RE.search(line)
                if e:
                    if e["reason"]:
                        self._add_nccl_error(f"{e['loc'].strip()}, {e['reason']}", evidence, rank)
                    else:
                        self._pending_nccl = (evidence, e["loc"].strip(), rank)
                return
        if "Watchdog caught" in line:
            w = WATCHDOG_RE.search(line)
            if w:
                r = rank if rank is not None else int(w["rank"])
                if r not in self.watchdog:
                    t = TIMEOUT_MS_RE.search(w["rest"])
                    self.watchdog[r] = WatchdogTimeout(
                        rank=r, seq=int(w["seq"]), op=w["op"], timeout_ms=int(t.group(1)) if t else None,
                        ran_ms=int(w["ran"]), evidence=evidence)
            return
        if "FlightRecorder is disabled" in line:
            self.fr_disabled = evidence
            return
        if "failure detected by watchdog" in line:
            p = PG_STATUS_RE.search(line)
            if p:
                r = rank if rank is not None else int(p["rank"])
                wd = self.watchdog.get(r)
                if wd is not None and wd.enqueued is None:
                    wd.enqueued, wd.completed, wd.pg = int(p["enq"]), int(p["comp"]), p["guid"]
            return
        if "collective #" in line or "Timeout at collective" in line or "lagging ranks" in line:
            self._desync(line, evidence)
            return
        if "Timed out waiting" in line:
            g = GLOO_TIMEOUT_RE.search(line)
            if g:
                _push(self.gloo_timeouts.setdefault(rank, []), evidence)
                self.gloo_timeout_ms = int(g["ms"])
        if "monitoredBarrier" in line:
            mb = MONITORED_RE.search(line)
            if mb:
                _push(self.monitored, (_ints(mb["ranks"]), int(mb["ms"]), evidence), MAX_ITEMS)
            return
        if "by peer" in line:
            pc = PEER_CLOSED_RE.search(line)
            if pc:
                _push(self.peer_closed.setdefault(rank, []), evidence)

    # ---- pieces ----------------------------------------------------------------------
    @staticmethod
    def _line_rank(line: str, path: str) -> int | None:
        m = TORCHRUN_RANK_RE.search(line)
        if m:
            return int(m.group(1))
        f = FILE_RANK_RE.search(PurePath(path).name)
        return int(f.group(1)) if f else None

    def _warn(self, m: re.Match, evidence: str) -> None:
        msg = m["msg"].strip()
        ib = IB_NEW_RE.search(msg) or IB_OLD_RE.search(msg)
        if ib and "Got completion" in msg:
            err = IbError(host=m["host"], dev=int(m["dev"]), peer=ib["peer"], status=int(ib["status"]),
                          vendor_err=int(ib["verr"]) if ib["verr"] else None, direction=ib["dir"],
                          hca=ib.groupdict().get("hca"), evidence=evidence)
            seen = (err.host, err.dev, err.peer, err.status, err.hca)
            if seen in self._ib_seen or len(self.ib_errors) >= MAX_ITEMS:
                return  # the same error again (a log repeats it per retry): once is evidence enough
            self._ib_seen.add(seen)
            self.ib_errors.append(err)
            if err.vendor_err is None:
                self._pending_ib = err
            return
        if "libibverbs" in msg:
            return  # reported with the transport (socket fallback), not as a failure
        key = re.sub(r"<\d+>", "<port>", msg)
        if key not in self.warns and len(self.warns) >= MAX_ITEMS:
            return
        _push(self.warns.setdefault(key, []), evidence)
        self.warn_counts[key] = self.warn_counts.get(key, 0) + 1
        hosts = self.warn_hosts.setdefault(key, set())
        if len(hosts) < MAX_ITEMS:
            hosts.add(m["host"])

    def _add_nccl_error(self, text: str, evidence: str, rank: int | None) -> None:
        if text not in self.nccl_errors and len(self.nccl_errors) >= MAX_ITEMS:
            return
        _push(self.nccl_errors.setdefault(text, []), evidence)
        if rank is not None:
            self.nccl_error_ranks.setdefault(text, set()).add(rank)

    def _desync(self, line: str, evidence: str) -> None:
        t = DESYNC_TIMEOUT_RE.search(line)
        if t:
            self.desync_timeouts.setdefault(int(t["rank"]), (t["op"], int(t["seq"]), evidence))
            return
        j = DESYNC_JOINED_RE.search(line)
        if j:
            _push(self.desync, ("joined_not_finished", _ints(j["ranks"]), int(j["seq"]), evidence), MAX_ITEMS)
            return
        lag = DESYNC_LAG_RE.search(line)
        if lag:
            _push(self.desync, ("not_joined", _ints(lag["ranks"]), int(lag["next"]), evidence), MAX_ITEMS)
            return
        n = DESYNC_NEVER_RE.search(line)
        if n:
            _push(self.desync, ("never_joined", _ints(n["ranks"]), 0, evidence), MAX_ITEMS)

    def _summary(self, line: str, evidence: str) -> None:
        """torchrun's ChildFailedError table: rank -> host, exit code, signal."""
        s = line.strip()
        if s.startswith("Root Cause"):
            self._section = "root"
        elif s.startswith("Failures:"):
            self._section = "failures"
        b = SUMMARY_BLOCK_RE.match(line)
        if b:
            self._block = {"section": self._section, "evidence": evidence}
            return
        if self._block is None:
            return
        f = SUMMARY_FIELD_RE.match(line)
        if not f:
            if s.startswith("=") or s.startswith("-"):
                self._block = None
            return
        self._block[f.group(1)] = f.group(2)
        if f.group(1) == "traceback" and "rank" in self._block:
            r = _ints(self._block["rank"])
            if r:
                self.exits[r[0]] = dict(self._block)
                if self._block.get("host"):
                    self.hosts[r[0]] = self._block["host"]
            self._block = None

    # ---- conclusions -----------------------------------------------------------------
    def findings(self, world: int | None, hosts: dict[int, str]) -> list[Finding]:
        out: list[Finding] = []
        out += self._ib_findings()
        out += self._desync_findings(hosts)
        out += self._watchdog_findings(world, hosts)
        out += self._gloo_findings(world, hosts)
        for text, ev in self.nccl_errors.items():
            ranks = sorted(self.nccl_error_ranks.get(text, ()))
            who = f" on rank {fmt_ranks(ranks, hosts)}" if ranks else ""
            out.append(Finding("nccl_error", ERROR, f"NCCL error{who}: {text}", ev[:5], ranks=ranks))
        for msg, ev in self.warns.items():
            hs = sorted(self.warn_hosts.get(msg, ()))
            out.append(Finding("nccl_warn", WARNING, f"NCCL WARN on {', '.join(hs)} "
                               f"({self.warn_counts.get(msg, len(ev))}x): {msg}",
                               ev[:5], hosts=hs))
        for r, b in sorted(self.exits.items()):
            code = b.get("exitcode", "?")
            tb = b.get("traceback", "")
            sev = INFO if b.get("section") != "root" else WARNING
            out.append(Finding("process_exit", sev,
                               f"torchrun: rank {r} on {b.get('host', '?')} exited with {code}"
                               + (f" ({tb})" if tb and "To enable traceback" not in tb else "")
                               + (" - first observed failure" if b.get("section") == "root" else ""),
                               [b["evidence"]], ranks=[r], hosts=[b["host"]] if b.get("host") else []))
        return out

    def _ib_findings(self) -> list[Finding]:
        out = []
        # primary errors (retry exceeded etc.) before flushes, which are consequences
        for e in sorted(self.ib_errors, key=lambda e: (e.status == 5, e.host)):
            name, meaning = IBV_WC_STATUS.get(e.status, (f"status {e.status}", "IB work completion error"))
            where = f"{e.host} GPU {e.dev}" + (f" via {e.hca}" if e.hca else "")
            vend = f", vendor err {e.vendor_err}" + (f" ({e.direction})" if e.direction else "") \
                if e.vendor_err is not None else ""
            f = Finding("ib_completion_error", ERROR,
                        f"IB completion error on {where} from peer {e.peer}: status={e.status} {name}{vend} - "
                        f"{meaning}", [e.evidence], hosts=[e.host])
            f.confidence = 0 if e.status == 5 else 5
            out.append(f)
        return out

    def _desync_findings(self, hosts: dict[int, str]) -> list[Finding]:
        out = []
        timeouts = self.desync_timeouts
        for kind, ranks, seq, ev in self.desync:
            evs = [ev] + [t[2] for t in timeouts.values()]
            op = next((t[0] for t in timeouts.values() if t[1] == seq), None)
            what = f"collective #{seq}" + (f" ({op})" if op else "")
            if kind == "not_joined":
                msg = f"finished collective #{seq - 1} but never joined {what}; the other ranks timed out in it"
            elif kind == "joined_not_finished":
                msg = f"joined {what} but never finished it (stuck inside the collective: GPU or network)"
            else:
                msg = "never joined any collective (dead, or stuck before the first collective)"
            out.append(Finding("stalled_rank", ERROR, f"rank {fmt_ranks(ranks, hosts)} {msg} "
                               "(PyTorch desync report)", evs, ranks=ranks,
                               hosts=[hosts[r] for r in ranks if r in hosts], confidence=3))
        return out

    def _watchdog_findings(self, world: int | None, hosts: dict[int, str]) -> list[Finding]:
        if not self.watchdog:
            return []
        out = []
        wd = self.watchdog
        reporters = sorted(wd)
        parts = []
        for r in reporters:
            w = wd[r]
            s = f"rank {fmt_ranks([r], hosts)}: SeqNum={w.seq} {w.op}"
            if w.enqueued is not None:
                s += f" (last enqueued {w.enqueued}, last completed {w.completed})"
            parts.append(s)
        tmo = next((w.timeout_ms for w in wd.values() if w.timeout_ms), None)
        msg = (f"NCCL watchdog timeout after {tmo} ms" if tmo else "NCCL watchdog timeout") + ": " + "; ".join(parts)
        out.append(Finding("collective_timeout", ERROR, msg, [wd[r].evidence for r in reporters], ranks=reporters))
        seqs = {wd[r].seq for r in reporters}
        by_pg: dict[str | None, list[int]] = {}
        for r in reporters:  # sequence numbers count per process group: compare within one
            by_pg.setdefault(wd[r].pg, []).append(r)
        for pg_ranks in by_pg.values():
            pg_seqs = {wd[r].seq for r in pg_ranks}
            if len(pg_seqs) < 2:
                continue
            low = min(pg_seqs)
            lag = [r for r in pg_ranks if wd[r].seq == low]
            out.append(Finding("stalled_rank", ERROR,
                               f"rank {fmt_ranks(lag, hosts)} timed out at SeqNum={low} while others had "
                               f"completed it and moved on to SeqNum={max(pg_seqs)}: it lags",
                               [wd[r].evidence for r in pg_ranks], ranks=lag,
                               hosts=[hosts[r] for r in lag if r in hosts], confidence=1))
        if world and len(by_pg) == 1:
            missing = [r for r in range(world) if r not in wd]
            if missing and len(missing) < world:
                seq = min(seqs)
                out.append(Finding("stalled_rank", ERROR,
                                   f"rank {fmt_ranks(missing, hosts)} never reported a watchdog timeout while "
                                   f"{len(reporters)} of {world} ranks timed out waiting in SeqNum={seq} "
                                   f"{wd[reporters[0]].op}: it never reached that collective",
                                   [wd[r].evidence for r in reporters], ranks=missing,
                                   hosts=[hosts[r] for r in missing if r in hosts], confidence=1))
        return out

    def _gloo_findings(self, world: int | None, hosts: dict[int, str]) -> list[Finding]:
        out = []
        for ranks, ms, ev in self.monitored:
            out.append(Finding("stalled_rank", ERROR,
                               f"rank {fmt_ranks(ranks, hosts)} failed to pass monitoredBarrier in {ms} ms",
                               [ev], ranks=ranks, hosts=[hosts[r] for r in ranks if r in hosts], confidence=3))
        if self.gloo_timeouts:
            waiters = sorted(r for r in self.gloo_timeouts if r is not None)
            evs = [e for v in self.gloo_timeouts.values() for e in v[:2]]
            who = f"rank {fmt_ranks(waiters, hosts)}" if waiters else "a rank"
            out.append(Finding("gloo_timeout", ERROR,
                               f"gloo timeout: {who} waited {self.gloo_timeout_ms} ms for a peer in a collective",
                               evs[:6], ranks=waiters))
            if world and waiters:
                missing = [r for r in range(world) if r not in self.gloo_timeouts]
                if missing and len(missing) < world:
                    out.append(Finding("stalled_rank", ERROR,
                                       f"rank {fmt_ranks(missing, hosts)} did not time out while "
                                       f"{len(waiters)} of {world} ranks timed out waiting for a peer",
                                       evs[:6], ranks=missing, hosts=[hosts[r] for r in missing if r in hosts],
                                       confidence=1))
        if self.peer_closed:
            ranks = sorted(r for r in self.peer_closed if r is not None)
            evs = [e for v in self.peer_closed.values() for e in v[:2]]
            out.append(Finding("peer_closed", WARNING,
                               "connection closed by peer" + (f" (seen by rank {fmt_ranks(ranks, hosts)})" if ranks
                                                              else "") + ": a peer process exited or crashed",
                               evs[:6], ranks=ranks))
        return out
