"""Walk whatever a job left (a run dir, its logs/, or one log pasted from a ticket), feed every line
to the parsers, and assemble the report. Evidence is `file:line`, file relative to what was given.

Recognised by content, not by name: NCCL_DEBUG lines anywhere (per-rank NCCL_DEBUG_FILE files or
mixed into torchrun/srun output), PyTorch watchdog/desync/gloo/torchrun text, torchfrtrace reports,
raw flight-recorder dumps (pickle/JSON), heartbeat JSON files and plan.json.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from launcher.diagnose.failures import Failures
from launcher.diagnose.findings import INFO, WARNING, Finding, Report, fmt_ranks, rank_findings, stalled_from
from launcher.diagnose.flight import Flight, load_dump
from launcher.diagnose.heartbeat import KEYS as HEARTBEAT_KEYS
from launcher.diagnose.heartbeat import Heartbeats, parse_beat
from launcher.diagnose.nccl_init import NcclInit
from launcher.diagnose.stacks import Stacks
from launcher.diagnose.stragglers import findings as straggler_findings
from launcher.diagnose.topology import init_findings
from launcher.errors import UserError
from launcher.formats import groupprobe, rundir

ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# What log collectors put before each line: kubectl logs --timestamps (RFC 3339, nanoseconds), and a
# bracketed date-time ("[2026-05-01 12:00:01,123]", "[2026-05-01T12:00:01.5Z]").
STAMP_RE = re.compile(r"(?:\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)? "
                      r"|\[\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?(?: [A-Z]{3,5})?\] ?)")
#: A line longer than this is parsed on its first MAX_LINE_CHARS characters (the rest is read and
#: dropped in pieces): no log line that says something is longer, and a line of any length is streamed.
MAX_LINE_CHARS = 64 << 10
#: Compressed logs (logrotate's .gz, .bz2, .xz), by their magic bytes; read as the text they hold, at
#: most MAX_TEXT_BYTES of it.
COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "lzma"))
SKIP_DIRS = {rundir.CHECKPOINTS, ".git", "__pycache__", "node_modules"}
MAX_TEXT_BYTES = 1 << 30  # a 1 GiB log is read (streamed); larger ones are skipped and said so
MAX_DUMP_BYTES = 256 << 20
MAX_JSON_BYTES = 16 << 20
MAX_WORLD = 1 << 17


@dataclass
class Sources:
    """Everything the parsers accumulated, plus what the walk found on the side."""

    init: NcclInit = field(default_factory=NcclInit)
    failures: Failures = field(default_factory=Failures)
    flight: Flight = field(default_factory=Flight)
    beats: Heartbeats = field(default_factory=Heartbeats)
    stacks: Stacks = field(default_factory=Stacks)
    plan_paths: list[Path] = field(default_factory=list)
    probes: list[tuple[Any, str]] = field(default_factory=list)  # (GroupProbe, evidence): plan preflights
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)  # evidence that could not be read (also in skipped)


def input_files(target: Path) -> tuple[Path, list[Path]]:
    """(root for relative names, files to read). A dir named logs/ brings its run dir's
    heartbeat/ and plan.json along, since `launch diagnose out/logs/` is the documented call."""
    if not target.exists():
        raise UserError(f"{target}: no such file or directory (give a log dir, a log file or a job id)")
    if target.is_file():
        return target.parent, [target]
    if not target.is_dir():  # a FIFO would block, a device never end
        raise UserError(f"{target}: not a regular file or a directory (give a log dir, a log file, - for "
                        "stdin, or a job id)")
    roots = [target]
    root = target
    parent = rundir.RunDir(target.parent)
    if target.name == rundir.LOGS and (parent.heartbeat.is_dir() or parent.plan.is_file()):
        root = target.parent
        if parent.heartbeat.is_dir():
            roots.append(parent.heartbeat)
    files: list[Path] = []
    for r in roots:
        for dirpath, dirnames, filenames in os.walk(r):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            files += [Path(dirpath) / f for f in sorted(filenames)]
    if root != target and rundir.RunDir(root).plan.is_file():
        files.append(rundir.RunDir(root).plan)
    if root != target and rundir.RunDir(root).preflight_plan.is_file():
        files.append(rundir.RunDir(root).preflight_plan)
    return root, files


@dataclass(frozen=True)
class LastRun:
    """The last of several local runs in one run dir (a resume reuses it): where its part of the node log
    starts, and when it started (what an earlier run left is older)."""

    log: Path
    line: int                 # the last run's header line in `log` (1-based); earlier lines are older runs'
    runs: int
    started: float            # epoch seconds of the header's local time


def last_local_run(root: Path, files: list[Path]) -> LastRun | None:
    """Found from the headers the local backend writes into node0.log before each submission; None when
    the run dir saw one run (or is not a local one)."""
    import time

    log = rundir.RunDir(root).node_log()
    if log not in files:
        return None
    line, runs, stamp = 0, 0, ""
    try:
        with open(log, encoding="utf-8", errors="replace") as fh:
            for n, text in enumerate(fh, 1):
                if text.startswith(rundir.LOCAL_RUN_HEADER):
                    line, runs, stamp = n, runs + 1, text[len(rundir.LOCAL_RUN_HEADER):].split(": ", 1)[0]
    except OSError:
        return None
    if runs < 2:
        return None
    try:
        started = time.mktime(time.strptime(stamp.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        started = 0.0
    return LastRun(log, line, runs, started)


def read_sources(target: Path) -> Sources:
    root, files = input_files(target)
    src = Sources()
    last = last_local_run(root, files)
    for path in files:
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        try:
            if last is not None and path == last.log:
                src.skipped.append(f"{rel} lines 1-{last.line - 1} (the {last.runs - 1} earlier run(s) in this "
                                   "run dir; the last run is diagnosed)")
            elif last is not None and last.started and path.stat().st_mtime < last.started - 1:
                src.skipped.append(f"{rel} (an earlier run's, in this run dir)")
                continue
            _read_one(path, rel, src, last.line if last is not None and path == last.log else 0)
        except OSError as exc:
            src.unread.append(f"{rel} ({exc.strerror or exc})")
    src.skipped += src.unread
    return src


def _read_one(path: Path, rel: str, src: Sources, first_line: int = 0) -> None:
    """`first_line`: lines before it are not fed (an earlier run's, in a reused run dir's node log)."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the walk, a device never end
        if not stat.S_ISDIR(st.st_mode):
            src.unread.append(f"{rel} (not a regular file)")
        return
    size = st.st_size
    with open(path, "rb") as fh:
        head = fh.read(4096)
    if not head:
        return
    codec = next((name for magic, name in COMPRESSED if head.startswith(magic)), None)
    if codec is not None:
        _read_compressed(path, rel, src, codec)
        return
    encoding = _utf16(head)
    binary = encoding is None and (b"\x00" in head or head[:1] == b"\x80")
    if binary or (head.lstrip()[:1] == b"{" and size <= MAX_JSON_BYTES):
        if _read_structured(path, rel, src, size, binary):
            return
        if binary:
            src.skipped.append(f"{rel} (binary)")
            return
    if size > MAX_TEXT_BYTES:
        src.unread.append(f"{rel} (larger than {MAX_TEXT_BYTES >> 20} MiB)")
        return
    src.files.append(rel)
    with open(path, encoding=encoding or "utf-8", errors="replace", newline=None) as fh:
        _feed_lines(fh, rel, src, first_line)


def _utf16(head: bytes) -> str | None:
    """"utf-16" for text that starts with a UTF-16 byte-order mark or looks like it (ASCII with every
    other byte NUL), else None."""
    if head[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return "utf-16"
    even, odd = head[0:256:2], head[1:256:2]
    if len(head) >= 8 and odd.count(0) == len(odd) and even.count(0) == 0:
        return "utf-16-le"
    if len(head) >= 8 and even.count(0) == len(even) and odd.count(0) == 0:
        return "utf-16-be"
    return None


def _feed_lines(fh: IO[str], rel: str, src: Sources, first_line: int = 0) -> None:
    """Every line to the parsers, as the job printed it: ANSI colours and a collector's timestamp
    prefix taken off, a line longer than MAX_LINE_CHARS cut there (and the rest read and dropped).
    Lines before `first_line` are counted (evidence keeps its line numbers) but not parsed."""
    init, failures, flight, stacks = src.init, src.failures, src.flight, src.stacks
    n = 0
    while True:
        line = fh.readline(MAX_LINE_CHARS)
        if not line:
            return
        n += 1
        if line.endswith("\n"):
            line = line[:-1]
        elif len(line) >= MAX_LINE_CHARS:
            while (rest := fh.readline(MAX_LINE_CHARS)) and not rest.endswith("\n"):
                pass
        if n < first_line:
            continue
        if "\x1b" in line:
            line = ANSI_RE.sub("", line)
        if line[:1].isdigit() or line[:1] == "[":
            m = STAMP_RE.match(line)
            if m:
                line = line[m.end():]
        ev = f"{rel}:{n}"
        init.feed(line, ev)
        failures.feed(line, ev, rel)
        flight.feed(line, ev)
        stacks.feed(line, ev, rel)


class _Capped(io.RawIOBase):
    """At most `limit` bytes of a stream (a decompressed log: a small file may expand to terabytes)."""

    def __init__(self, raw: IO[bytes], limit: int):
        self.raw, self.left, self.capped = raw, limit, False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self.left <= 0:
            self.capped = self.capped or bool(self.raw.read(1))
            return 0
        data = self.raw.read(min(len(b), self.left, 1 << 20))
        b[:len(data)] = data
        self.left -= len(data)
        return len(data)


def _read_compressed(path: Path, rel: str, src: Sources, codec: str) -> None:
    """A rotated, compressed log: the text it holds, fed like any other log's (UTF-8 or UTF-16)."""
    import bz2
    import gzip
    import lzma

    opener: Callable[..., IO[bytes]] = {"gzip": gzip.open, "bz2": bz2.open, "lzma": lzma.open}[codec]  # type: ignore[assignment]
    try:
        with opener(path, "rb") as raw:
            head = raw.read(4096)
        encoding = _utf16(head) if head else None
        if not head or (encoding is None and b"\x00" in head):
            src.skipped.append(f"{rel} ({codec}: " + ("empty)" if not head else "binary)"))
            return
        src.files.append(rel)
        with opener(path, "rb") as raw:
            capped = _Capped(raw, MAX_TEXT_BYTES)
            text = io.TextIOWrapper(io.BufferedReader(capped), encoding=encoding or "utf-8", errors="replace",
                                    newline=None)
            _feed_lines(text, rel, src)
        if capped.capped:
            src.unread.append(f"{rel} (more than {MAX_TEXT_BYTES >> 20} MiB once decompressed; read that much)")
    except (EOFError, OSError, lzma.LZMAError, ValueError) as exc:
        src.unread.append(f"{rel} ({codec} data ends early or is damaged: {exc}; read what came before)")


def _read_structured(path: Path, rel: str, src: Sources, size: int, binary: bool) -> bool:
    """JSON or pickle files: heartbeat, flight-recorder dump, plan.json. True when consumed."""
    if size > (MAX_DUMP_BYTES if binary else MAX_JSON_BYTES):
        return False
    data = path.read_bytes()
    ev = f"{rel}:1"
    dump = load_dump(data)
    if dump is not None:
        src.flight.add_dump(rel, dump, ev)
        src.files.append(rel)
        return True
    if binary:
        return False
    text = data.decode("utf-8", "replace")
    beat = parse_beat(text, ev)
    if beat is not None:
        src.beats.add(beat)
        src.files.append(rel)
        return True
    try:
        obj: Any = json.loads(text)
    except ValueError:
        return False
    if isinstance(obj, dict) and HEARTBEAT_KEYS <= set(obj):
        src.skipped.append(f"{rel} (a heartbeat without a finite rank, step or time)")
        return True
    if isinstance(obj, dict) and {"degrees", "ranks", "mesh_order"} <= set(obj):
        src.plan_paths.append(path)
        src.files.append(rel)
        return True
    if isinstance(obj, dict) and obj.get("kind") == groupprobe.KIND:
        try:
            src.probes.append((groupprobe.GroupProbe.from_dict(obj, rel), ev))
            src.files.append(rel)
        except UserError as exc:
            src.skipped.append(f"{rel} ({exc})")
        return True
    return False


def probe_findings(probes: list[tuple[Any, str]]) -> list[Finding]:
    """What the job's plan preflight measured before it started: each group slower than the plan assumed
    (a warning naming its ranks, hosts and link), or that every group was within the tolerance."""
    out: list[Finding] = []
    for probe, ev in probes:
        if probe.error:
            out.append(Finding("plan_preflight", WARNING, f"the plan preflight did not measure: {probe.error}", [ev]))
            continue
        slow = sorted(probe.slow_groups(), key=lambda g: g.ratio or 0)
        for g in slow:
            out.append(Finding(
                "plan_preflight", WARNING,
                f"plan preflight: {groupprobe.KIND_NAMES[g.kind]} group {g.index}, {g.where(probe.hosts)}: {g.op} "
                f"at {g.ratio or 0:.2f}x the bandwidth the plan assumed ({g.measured_busbw_gbs or 0:.3g} vs "
                f"{g.assumed_busbw_gbs:.3g} GB/s busbw)", [ev], ranks=list(g.ranks), hosts=sorted(set(g.hosts))))
        if not slow and probe.measured:
            step = (f"; step {probe.measured_step_s:.3g} s with the measured figures, {probe.predicted_step_s:.3g} s "
                    "as assumed" if probe.measured_step_s else "")
            out.append(Finding("plan_preflight", INFO, f"plan preflight: all {len(probe.groups)} communication "
                               f"groups within {probe.tolerance:.0%} of what the plan assumed{step}", [ev]))
    return out


def build_report(src: Sources, plan: Any = None, bwmap: Any = None) -> Report:
    world = None
    if plan is not None:
        world = plan.world_size
    world = world or src.init.world_size() or (max(src.flight.world_ranks()) + 1 if src.flight.world_ranks()
                                               else None)
    if world is not None and not 0 < world <= MAX_WORLD:
        world = None  # a garbled number, not a job size
    hosts: dict[int, str] = {}
    if plan is not None and plan.hosts:
        for rp in plan.ranks:
            if 0 <= rp.node < len(plan.hosts):
                hosts[rp.rank] = plan.hosts[rp.node]
    hosts.update(src.init.rank_hosts())
    hosts.update(src.failures.hosts)
    hosts.update(src.beats.hosts())
    hosts.update(src.stacks.hosts())

    findings: list[Finding] = []
    findings += init_findings(src.init, plan, bwmap)
    findings += src.failures.findings(world, hosts)
    findings += src.flight.findings(hosts)
    role = {rp.rank: rp.coords.get("pp", 0) for rp in plan.ranks} if plan is not None else None
    findings += src.beats.findings(world, hosts, role)
    findings += src.stacks.findings(world, hosts, src.beats.beats)
    findings += straggler_findings(src.beats.beats, hosts)
    findings += probe_findings(src.probes)
    if src.unread:
        n = len(src.unread)
        findings.append(Finding("unreadable", WARNING, f"could not read {n} file(s): {', '.join(src.unread[:5])}"
                                + (f" (+{n - 5} more)" if n > 5 else "") + "; the answer may be in them",
                                [u.split(" (")[0] for u in src.unread[:8]]))
    findings = rank_findings(findings)
    stalled = stalled_from(findings)
    stalled_hosts = {r: hosts[r] for r in stalled if r in hosts}
    return Report(verdict=_verdict(findings, stalled, stalled_hosts, src), stalled_ranks=stalled,
                  stalled_hosts=stalled_hosts, findings=findings, nccl=src.init.summary(), files=src.files,
                  skipped=src.skipped)


def _verdict(findings: list[Finding], stalled: list[int], hosts: dict[int, str], src: Sources) -> str:
    problems = [f for f in findings if f.severity in ("error", "warning")]
    if not problems:
        if not src.files:
            return "nothing recognisable found"
        facts = [f.message for f in findings[:1]]
        return "no problem found" + (f": {facts[0]}" if facts else f" in {len(src.files)} file(s)")
    if stalled:
        word = "rank" if len(stalled) == 1 else "ranks"
        stall = [f for f in problems if f.kind == "stalled_rank"]
        top = stall[0]
        sources = sorted({_source(f) for f in stall if set(f.ranks) & set(stalled)})
        who = fmt_ranks(stalled, hosts)
        msg = top.message
        for lead in (f"rank {who} ", f"rank {fmt_ranks(stalled)} "):
            if msg.startswith(lead):
                msg = msg[len(lead):]
                break
        head = top.message.removesuffix(" (stack dumps)") if " stuck in " in top.message else \
            f"{word} {who} stalled - {msg}"
        if len(sources) > 1:
            head += f" [agreed by: {', '.join(sources)}]"
        other = next((f for f in problems if f.kind not in ("stalled_rank", "collective_timeout", "gloo_timeout",
                                                               "heartbeat", "peer_closed", "process_exit")), None)
        return head + (f" | also: {other.message}" if other else "")
    top = problems[0]
    if top.kind in ("collective_timeout", "gloo_timeout"):
        hint = (" (the flight recorder was off: set TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1, "
                "or TORCH_NCCL_DESYNC_DEBUG=1, next time; TORCH_NCCL_TRACE_BUFFER_SIZE, which the log names, is its "
                "deprecated name)" if src.failures.fr_disabled else "")
        return (top.message + " | the stalled rank is one that never reached this collective; add the other "
                "ranks' logs, the heartbeat/ files or flight-recorder dumps to name it" + hint)
    return top.message


def _source(f: Finding) -> str:
    m = re.search(r"\(([^()]*)\)\s*$", f.message)
    if f.confidence == 2:
        return "heartbeat"
    if m and m.group(1) in ("PyTorch desync report", "flight recorder", "flight recorder dumps", "stack dumps"):
        return m.group(1)
    if "monitoredBarrier" in f.message:
        return "monitoredBarrier"
    return "timeouts"
