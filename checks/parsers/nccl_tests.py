"""nccl-tests `*_perf` output (all_reduce, all_gather, reduce_scatter, alltoall, sendrecv, ...).

Three table generations are read: the old one (`error` column, no redop/root, `#   Rank  0 Pid`),
the pre-2.14 one (`#wrong`, `Group`) and >= 2.14 (`# nccl-tests version`, `# Collective test
starting/concluded`). A log may hold several tests one after another; `parse_nccl_tests_all`
returns each. Failure signals are collected, not raised: a non-zero #wrong (data corruption),
`# Out of bounds values : N FAILED`, `Test NCCL failure`, `.. host pid N: Test failure`, NCCL WARN
lines, and a missing `# Avg bus bandwidth` line (the run died or was killed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from checks.parsers.base import ParseError, strip_ansi

KIND = "nccl-tests"
NTHREAD_RE = re.compile(r"^#\s*nThread\s+(\d+)\s+nGpus\s+(\d+)\s+minBytes\s+(\d+)\s+maxBytes\s+(\d+)(.*)$")
RANK_RE = re.compile(r"^#\s+Rank\s+(\d+)\s+(?:Group\s+(\d+)\s+)?Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+(\d+)"
                     r"\s+\[([^\]]*)\]\s*(.*?)\s*$")
VERSION_RE = re.compile(r"^#\s*nccl-tests version\s+(\S+)")
STARTING_RE = re.compile(r"^#\s*Collective test starting:\s*(\w+?)(?:_perf)?\s*$")
CONCLUDED_RE = re.compile(r"^#\s*Collective test concluded:\s*(\w+?)(?:_perf)?\s*$")
RUNNING_RE = re.compile(r"(?:^|[\s/])(\w+?)_perf(?:\s|$)")
OOB_RE = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)\s+(OK|FAILED)\s*$")
AVG_RE = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(\S+)\s*$")
FAIL_RE = re.compile(r"Test NCCL failure\s+(\S+)\s+'(.*)'|Test failure\s+(\S+)|Test CUDA failure\s+(\S+)\s*(.*)")
WARN_RE = re.compile(r"NCCL WARN\s+(.*)$")
LAUNCHER_ERR_RE = re.compile(r"^(srun|slurmstepd|mpirun|prterun|orterun|mpiexec)\b.*\b(error|failed|abort)",
                             re.IGNORECASE)
VIA_RE = re.compile(r"\bvia (NET/[A-Za-z]+|P2P/[A-Za-z]+|SHM|direct shared memory|CollNet\w*)")
NETWORK_RE = re.compile(r"NCCL INFO Using network (\w+)")
NUM_RE = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


@dataclass
class NcclRank:
    rank: int
    host: str
    device: int
    pid: int
    group: int | None = None
    bus_id: str = ""
    gpu: str = ""


@dataclass
class NcclRow:
    size: int
    count: int
    type: str
    redop: str | None
    root: int | None
    time_oop: float
    algbw_oop: float
    busbw_oop: float
    wrong_oop: int | float | None
    time_ip: float | None
    algbw_ip: float | None
    busbw_ip: float | None
    wrong_ip: int | float | None
    error_oop: float | None = None  # old format: max error instead of a #wrong count
    error_ip: float | None = None


@dataclass
class NcclTestResult:
    collective: str | None = None
    version: str | None = None
    nthread: int | None = None
    ngpus: int | None = None
    min_bytes: int | None = None
    max_bytes: int | None = None
    ranks: list[NcclRank] = field(default_factory=list)
    rows: list[NcclRow] = field(default_factory=list)
    avg_busbw: float | None = None
    out_of_bounds: int | None = None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    other_lines: list[str] = field(default_factory=list)  # foreign lines (launcher/MPI chatter), kept
    transports: list[str] = field(default_factory=list)  # from NCCL_DEBUG=INFO: NET/IB, NET/Socket, P2P/IPC, SHM
    network: str | None = None  # "Using network IB|Socket|..."
    command: str | None = None

    @property
    def complete(self) -> bool:
        return self.avg_busbw is not None

    @property
    def hosts(self) -> list[str]:
        out: list[str] = []
        for r in self.ranks:
            if r.host not in out:
                out.append(r.host)
        return out

    @property
    def wrong_rows(self) -> list[NcclRow]:
        return [r for r in self.rows if (r.wrong_oop or 0) > 0 or (r.wrong_ip or 0) > 0]

    @property
    def busbw_at_max_size(self) -> float | None:
        """Bus bandwidth (out-of-place) at the largest size: what the link does when it is busy."""
        if not self.rows:
            return None
        return max(self.rows, key=lambda r: r.size).busbw_oop

    @property
    def peak_busbw(self) -> float | None:
        vals = [r.busbw_oop for r in self.rows] + [r.busbw_ip for r in self.rows if r.busbw_ip is not None]
        return max(vals) if vals else None

    @property
    def failed(self) -> bool:
        return bool(self.errors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "collective": self.collective,
            "version": self.version,
            "nthread": self.nthread,
            "ngpus": self.ngpus,
            "min_bytes": self.min_bytes,
            "max_bytes": self.max_bytes,
            "ranks": [vars(r) for r in self.ranks],
            "hosts": self.hosts,
            "rows": [vars(r) for r in self.rows],
            "avg_busbw": self.avg_busbw,
            "busbw_at_max_size": self.busbw_at_max_size,
            "peak_busbw": self.peak_busbw,
            "out_of_bounds": self.out_of_bounds,
            "complete": self.complete,
            "errors": self.errors,
            "warnings": self.warnings,
            "other_lines": self.other_lines,
            "transports": self.transports,
            "network": self.network,
        }


@dataclass
class NcclTestsFile:
    """Every test in one log; the JSON of `parse nccl-tests` puts the first at the top level."""

    tests: list[NcclTestResult]

    def to_dict(self) -> dict[str, Any]:
        first = self.tests[0].to_dict() if self.tests else {}
        return {**first, "tests": [t.to_dict() for t in self.tests]}


def _num(tok: str, kind: str, line_no: int, line: str, what: str) -> float:
    if not NUM_RE.match(tok):
        raise ParseError(KIND, f"{what} {tok!r} is not a number", line_no, line)
    return float(tok)


def _wrong(tok: str, line_no: int, line: str) -> int | float | None:
    if tok == "N/A":
        return None
    v = _num(tok, KIND, line_no, line, "#wrong")
    return int(v) if v.is_integer() else v


def _columns(line: str, line_no: int) -> list[str]:
    cols = line.lstrip("#").split()
    prefix = cols[:cols.index("time")] if "time" in cols else []
    tail = cols[len(prefix):]
    ok_prefix = prefix in (["size", "count", "type"], ["size", "count", "type", "redop"],
                           ["size", "count", "type", "redop", "root"], ["size", "count", "type", "root"])
    ok_tail = any(tail == ["time", "algbw", "busbw", w] * 2 for w in ("#wrong", "error"))
    if not (ok_prefix and ok_tail):
        raise ParseError(KIND, "unrecognised column header", line_no, line)
    return cols


def _row(cols: list[str], toks: list[str], line_no: int, line: str) -> NcclRow:
    if (len(toks) == len(cols) - 1 and "redop" in cols and len(toks) > 3
            and NUM_RE.match(toks[cols.index("redop")])):
        toks = toks[:cols.index("redop")] + ["N/A"] + toks[cols.index("redop"):]  # blank redop (old alltoall)
    if len(toks) != len(cols):
        raise ParseError(KIND, f"row has {len(toks)} fields, the header has {len(cols)} (truncated?)",
                         line_no, line)
    vals = dict()
    second = cols.index("time", cols.index("time") + 1)
    for i, (c, t) in enumerate(zip(cols, toks)):
        vals[(c, i >= second)] = t
    size = vals[("size", False)]
    count = vals[("count", False)]
    if not size.isdigit() or not count.isdigit():
        raise ParseError(KIND, "size and count must be integers", line_no, line)
    root = vals.get(("root", False))

    def f(name: str, ip: bool) -> float | None:
        t = vals.get((name, ip))
        if t is None or t == "N/A":
            return None
        return _num(t, KIND, line_no, line, name)

    wrong_col = "#wrong" if ("#wrong", False) in vals else None
    err_col = "error" if ("error", False) in vals else None
    if wrong_col is None and err_col is None:
        raise ParseError(KIND, "no #wrong or error column", line_no, line)
    time_oop, algbw_oop, busbw_oop = f("time", False), f("algbw", False), f("busbw", False)
    if time_oop is None or algbw_oop is None or busbw_oop is None:
        raise ParseError(KIND, "out-of-place time/algbw/busbw missing", line_no, line)
    return NcclRow(
        size=int(size), count=int(count), type=vals[("type", False)],
        redop=None if vals.get(("redop", False)) in (None, "N/A") else vals[("redop", False)],
        root=int(_num(root, KIND, line_no, line, "root")) if root is not None else None,
        time_oop=time_oop, algbw_oop=algbw_oop, busbw_oop=busbw_oop,
        wrong_oop=_wrong(vals[(wrong_col, False)], line_no, line) if wrong_col else None,
        time_ip=f("time", True), algbw_ip=f("algbw", True), busbw_ip=f("busbw", True),
        wrong_ip=_wrong(vals[(wrong_col, True)], line_no, line) if wrong_col else None,
        error_oop=f("error", False) if err_col else None,
        error_ip=f("error", True) if err_col else None,
    )


def _finish(t: NcclTestResult) -> None:
    wrong = t.wrong_rows
    if wrong:
        first = wrong[0]
        t.errors.insert(0, f"#wrong non-zero in {len(wrong)} of {len(t.rows)} rows (data corruption; "
                           f"first at {first.size} B: oop {first.wrong_oop}, ip {first.wrong_ip})")
    if t.out_of_bounds:
        t.errors.append(f"Out of bounds values: {t.out_of_bounds} FAILED")
    if not t.complete:
        t.errors.append("incomplete: no '# Avg bus bandwidth' line (the run died, hung or was killed)")


def parse_nccl_tests_all(text: str) -> list[NcclTestResult]:
    """Every test in the log, in order. Raises ParseError on malformed table rows."""
    lines = strip_ansi(text).splitlines()
    tests: list[NcclTestResult] = []
    pending: dict[str, Any] = {}  # version / collective / command seen before the next nThread line
    cur: NcclTestResult | None = None
    cols: list[str] | None = None
    orphan_errors: list[str] = []
    pending_info = NcclTestResult()  # NCCL INFO seen before the first table header (init comes first)
    for idx, raw in enumerate(lines):
        line_no = idx + 1
        line = raw.rstrip()
        s = line.strip()
        if not s:
            continue
        m = VERSION_RE.match(s)
        if m:
            pending["version"] = m.group(1)
            continue
        m = STARTING_RE.match(s)
        if m:
            pending["collective"] = m.group(1)
            continue
        if s.startswith("Running:") or s.startswith("+ ") or s.startswith("$ "):
            m = RUNNING_RE.search(s)
            if m:
                pending["collective"] = m.group(1)
                pending["command"] = s.split(":", 1)[-1].strip() if s.startswith("Running:") else s[2:]
            continue
        m = NTHREAD_RE.match(s)
        if m:
            if cur is not None:
                _finish(cur)
            cur = NcclTestResult(nthread=int(m.group(1)), ngpus=int(m.group(2)), min_bytes=int(m.group(3)),
                                 max_bytes=int(m.group(4)), **pending)
            cur.errors.extend(orphan_errors)
            cur.transports, cur.network = pending_info.transports, pending_info.network
            cur.other_lines, cur.warnings = pending_info.other_lines, pending_info.warnings
            pending_info = NcclTestResult()
            orphan_errors = []
            pending = {}
            tests.append(cur)
            cols = None
            continue
        m = CONCLUDED_RE.match(s)
        if m:
            if cur is not None and cur.collective is None:
                cur.collective = m.group(1)
            continue
        w = WARN_RE.search(s)
        if w:
            (cur if cur is not None else pending_info).warnings.append("NCCL WARN " + w.group(1).strip())
            continue
        fm = FAIL_RE.search(s)
        if fm:
            msg = s
            errors = cur.errors if cur else orphan_errors
            if msg not in errors:
                errors.append(msg)
            continue
        if "NCCL INFO" in s:
            into = cur if cur is not None else pending_info
            v = VIA_RE.search(s)
            if v and v.group(1) not in into.transports:
                into.transports.append(v.group(1))
            n = NETWORK_RE.search(s)
            if n:
                into.network = n.group(1)
            continue
        if s.startswith("#"):
            body = s.lstrip("#").strip()
            if cur is None:
                continue
            r = RANK_RE.match(s)
            if r:
                cur.ranks.append(NcclRank(rank=int(r.group(1)), group=int(r.group(2)) if r.group(2) else None,
                                          pid=int(r.group(3)), host=r.group(4), device=int(r.group(5)),
                                          bus_id=r.group(6), gpu=r.group(7)))
                continue
            if body.startswith("size"):
                cols = _columns(s, line_no)
                continue
            m = OOB_RE.match(s)
            if m:
                cur.out_of_bounds = int(m.group(1)) if m.group(2) == "FAILED" else 0
                if m.group(2) == "FAILED" and cur.out_of_bounds == 0:
                    cur.out_of_bounds = None
                continue
            m = AVG_RE.match(s)
            if m:
                cur.avg_busbw = _num(m.group(1), KIND, line_no, line, "Avg bus bandwidth")
                continue
            continue  # other comment lines: "Using devices", "(B)", "Reducing maxBytes", "out-of-place"
        toks = s.split()
        if toks[0].isdigit():
            if cur is None or cols is None:
                raise ParseError(KIND, "data row before the column header", line_no, line)
            cur.rows.append(_row(cols, toks, line_no, line))
            continue
        if re.match(r"^\S+:\d+:\d+ \[\d+\]", s):  # other NCCL debug lines (host:pid:tid [dev])
            continue
        if LAUNCHER_ERR_RE.match(s):
            (cur.errors if cur else orphan_errors).append(s)
            continue
        # a launcher's or MPI's own chatter interleaved with the table (stderr merged into the log):
        # kept for the record, not fatal; the table rows themselves are still checked strictly
        (cur if cur is not None else pending_info).other_lines.append(s[:200])
    if cur is not None:
        _finish(cur)
    if not tests:
        if orphan_errors:
            t = NcclTestResult(errors=orphan_errors, **pending)
            _finish(t)
            return [t]
        raise ParseError(KIND, "no '# nThread ... nGpus ...' header: not nccl-tests output", 1,
                         lines[0] if lines else "")
    return tests


def parse_nccl_tests(text: str, collective: str | None = None) -> NcclTestResult:
    """The test for `collective` (e.g. "all_reduce") in the log, else the first one."""
    tests = parse_nccl_tests_all(text)
    if collective:
        want = collective.removesuffix("_perf")
        for t in tests:
            if t.collective == want:
                return t
        unnamed = [t for t in tests if t.collective is None]
        if unnamed:
            unnamed[0].collective = want
            return unnamed[0]
        raise ParseError(KIND, f"no {want} test in the output (found: "
                               f"{', '.join(str(t.collective) for t in tests)})", 1, None)
    return tests[0]


def parse_nccl_tests_file(text: str) -> NcclTestsFile:
    return NcclTestsFile(tests=parse_nccl_tests_all(text))
