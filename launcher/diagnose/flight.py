"""Flight recorder: per process group, the first collective not completed by every rank, and who
is missing from it.

Two inputs. (1) torchfrtrace's text report (fixture pytorch-flight-recorder-torchfrtrace-missing-rank:
`Not all ranks joining collective 5 at entry 4` / `missing ranks: {1}`; newer torch prints `Not all
ranks joining collective, sequence number: N`, see torch/distributed/flight_recorder/components).
(2) The raw per-rank dumps PyTorch writes to TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank> (pickle) or
`_dump_fr_trace_json` (JSON): {"version", "pg_config", "pg_status", "entries": [{"process_group":
(name, desc), "collective_seq_id", "profiling_name", "state", ...}]}. Pickles are read with an
unpickler that refuses every global, so a dump can only yield plain data.
"""

from __future__ import annotations

import ast
import io
import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from launcher.diagnose.findings import ERROR, Finding, fmt_ranks

JOIN_RE = re.compile(r"Not all ranks joining collective(?:,? sequence number:)? (?P<seq>\d+)(?: at entry (?P<entry>\d+))?")
FIELD_RE = re.compile(r"^\s*(group info|collective|missing ranks|expected ranks|collective state|world size)"
                      r":\s*(.*?)\s*$")
DUMP_RANK_RE = re.compile(r"(\d+)(?:\.json|\.pkl)?$")


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D102 - refuse code in data
        raise pickle.UnpicklingError(f"refusing global {module}.{name} in a flight-recorder dump")


def load_dump(data: bytes) -> dict[str, Any] | None:
    """A raw flight-recorder dump (pickle or JSON), or None when these bytes are not one."""
    obj: Any = None
    try:
        if data[:1] == b"\x80":
            obj = _NoGlobals(io.BytesIO(data)).load()
        elif data.lstrip()[:1] == b"{":
            obj = json.loads(data.decode("utf-8", "replace"))
    except Exception:  # noqa: BLE001 - any malformed dump is simply "not a dump"
        return None
    if isinstance(obj, dict) and isinstance(obj.get("entries"), list) and "pg_config" in obj:
        return obj
    return None


@dataclass
class TextReport:
    seq: int
    evidence: str
    group: str = ""
    collective: str = ""
    missing: list[int] = field(default_factory=list)
    state: str = ""


@dataclass
class Flight:
    reports: list[TextReport] = field(default_factory=list)
    dumps: dict[int, tuple[dict[str, Any], str]] = field(default_factory=dict)  # rank -> (dump, evidence)
    _cur: TextReport | None = None

    def feed(self, line: str, evidence: str) -> None:
        if "Not all ranks joining" in line:
            m = JOIN_RE.search(line)
            if m:
                self._cur = TextReport(seq=int(m["seq"]), evidence=evidence)
                self.reports.append(self._cur)
            return
        if self._cur is None:
            return
        f = FIELD_RE.match(line)
        if not f:
            return
        key, val = f.group(1), f.group(2)
        if key == "group info":
            self._cur.group = val
        elif key == "collective":
            self._cur.collective = val
        elif key == "missing ranks":
            self._cur.missing = [int(x) for x in re.findall(r"\d+", val)]
        elif key == "collective state":
            self._cur.state = val
            self._cur = None

    def add_dump(self, path: str, dump: dict[str, Any], evidence: str) -> None:
        m = DUMP_RANK_RE.search(PurePath(path).name)
        if m:
            self.dumps[int(m.group(1))] = (_clean(dump), evidence)

    # ---- conclusions -----------------------------------------------------------------
    def world_ranks(self) -> set[int]:
        ranks: set[int] = set(self.dumps)
        for dump, _ in self.dumps.values():
            for cfg in (dump.get("pg_config") or {}).values():
                ranks |= set(_rank_list(cfg.get("ranks") if isinstance(cfg, dict) else None))
        return ranks

    def findings(self, hosts: dict[int, str]) -> list[Finding]:
        out = []
        for r in self.reports:
            what = f"collective #{r.seq}" + (f" {r.collective}" if r.collective else "") + \
                   (f" in process group {r.group}" if r.group else "")
            state = f" (state: {r.state})" if r.state else ""
            if r.missing:
                out.append(Finding("stalled_rank", ERROR,
                                   f"rank {fmt_ranks(r.missing, hosts)} never joined {what}{state} "
                                   "(flight recorder)", [r.evidence], ranks=r.missing,
                                   hosts=[hosts[x] for x in r.missing if x in hosts], confidence=3))
            else:
                out.append(Finding("flight_recorder", ERROR, f"not all ranks joined {what}{state}", [r.evidence]))
        out += self._dump_findings(hosts)
        return out

    def _dump_findings(self, hosts: dict[int, str]) -> list[Finding]:
        out = []
        for pg, info in sorted(self._per_pg().items()):
            expected, enq, comp, ops, evs = info["expected"], info["enq"], info["comp"], info["ops"], info["evs"]
            if not enq:
                continue
            top, low = max(enq.values()), min(enq.values())
            if low < top:
                # some rank never entered a collective the others entered: the first such one names it
                # (completion marks can lag behind in a dump; entries are what a rank really issued)
                first = low + 1
            elif comp and any(comp.get(r, 0) < top for r in enq):
                first = min(comp.get(r, 0) for r in enq) + 1
            else:
                absent = sorted(expected - set(enq))
                if absent:
                    out.append(Finding("stalled_rank", ERROR,
                                       f"process group {pg}: rank {fmt_ranks(absent, hosts)} left no flight-recorder "
                                       f"dump while rank {fmt_ranks(sorted(enq), hosts)} did: it died or hung before "
                                       "dumping (flight recorder dumps)", evs, ranks=absent,
                                       hosts=[hosts[x] for x in absent if x in hosts], confidence=1))
                continue
            op = ops.get(first, "?")
            missing = sorted(r for r in enq if enq[r] < first)
            no_dump = sorted(r for r in expected if r not in enq)
            if missing:
                note = f" (no dump from rank {fmt_ranks(no_dump, hosts)})" if no_dump else ""
                out.append(Finding("stalled_rank", ERROR,
                                   f"process group {pg}: collective #{first} {op} was never reached by rank "
                                   f"{fmt_ranks(missing, hosts)}; the others entered it and waited{note} "
                                   "(flight recorder dumps)", evs, ranks=missing,
                                   hosts=[hosts[x] for x in missing if x in hosts], confidence=3))
            else:
                out.append(Finding("flight_recorder", ERROR,
                                   f"process group {pg}: every rank "
                                   + (f"with a dump (none from {fmt_ranks(no_dump, hosts)}) " if no_dump else "")
                                   + f"entered collective #{first} {op} but it did not complete - stuck inside the "
                                   "collective (network or GPU), not a missing rank",
                                   evs, ranks=sorted(expected)))
        return out

    def _per_pg(self) -> dict[str, dict[str, Any]]:
        """pg -> expected ranks, per-rank last enqueued / completed seq, seq -> op, evidence."""
        pgs: dict[str, dict[str, Any]] = {}
        for rank, (dump, ev) in sorted(self.dumps.items()):
            cfg = dump.get("pg_config") or {}
            status = dump.get("pg_status") or {}
            for e in dump.get("entries") or []:
                if not isinstance(e, dict) or e.get("is_p2p"):
                    continue
                name, desc = e["process_group"]
                key = str(desc or name)
                info = pgs.setdefault(key, {"expected": set(), "enq": {}, "comp": {}, "ops": {}, "evs": [],
                                            "name": str(name)})
                seq = e["collective_seq_id"]
                info["enq"][rank] = max(info["enq"].get(rank, 0), seq)
                info["ops"].setdefault(seq, str(e.get("profiling_name", "?")))
                if e.get("state") == "completed":
                    info["comp"][rank] = max(info["comp"].get(rank, 0), seq)
                info["expected"] |= set(_rank_list(_cfg_for(cfg, str(name), str(desc)).get("ranks")))
                if ev not in info["evs"]:
                    info["evs"].append(ev)
            for info in pgs.values():
                st = status.get(info["name"]) if isinstance(status, dict) else None
                if isinstance(st, dict) and rank in info["enq"]:
                    lc = st.get("last_completed_collective")
                    if isinstance(lc, int) and lc >= 0:
                        info["comp"][rank] = max(info["comp"].get(rank, 0), lc)
                    le = st.get("last_enqueued_collective")
                    if isinstance(le, int) and le >= 0:
                        info["enq"][rank] = max(info["enq"][rank], le)
        for info in pgs.values():
            if not info["expected"]:
                info["expected"] = set(self.dumps)
        return pgs


def _clean(dump: dict[str, Any]) -> dict[str, Any]:
    """Keep only well-formed parts of a dump (a truncated or foreign file must not break the analysis)."""
    cfg = dump.get("pg_config")
    status = dump.get("pg_status")
    entries = []
    for e in dump.get("entries") or []:
        if not isinstance(e, dict):
            continue
        pg = e.get("process_group")
        seq = e.get("collective_seq_id")
        if not isinstance(pg, (list, tuple)) or not pg or isinstance(seq, bool) or not isinstance(seq, int):
            continue
        entries.append({**e, "process_group": (str(pg[0]), str(pg[1]) if len(pg) > 1 else "")})
    return {"entries": entries, "pg_config": cfg if isinstance(cfg, dict) else {},
            "pg_status": status if isinstance(status, dict) else {}, "version": dump.get("version")}


def _cfg_for(cfg: dict[str, Any], name: str, desc: str) -> dict[str, Any]:
    if not isinstance(cfg, dict):
        return {}
    if isinstance(cfg.get(name), dict):
        return cfg[name]
    for v in cfg.values():
        if isinstance(v, dict) and (v.get("desc") == desc or v.get("name") == name):
            return v
    return {}


def _rank_list(value: Any) -> list[int]:
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return [int(x) for x in re.findall(r"\d+", value)]
    if isinstance(value, (list, tuple, set)):
        return [int(x) for x in value if isinstance(x, int) or (isinstance(x, str) and x.isdigit())]
    return []
