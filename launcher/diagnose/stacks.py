"""Stack dumps taken while a job hung (logs/stacks/rank<R>.txt, written by the trainer's watchdog or
on SIGQUIT through faulthandler, or by `py-spy dump` from `launch run`): which rank is stuck outside
every collective, in which frame, while the others wait inside one.

Formats, as the tools print them: faulthandler (`Current thread 0x... (most recent call first):` /
`Thread 0x...`, then `  File "PATH", line N in FUNC`), and py-spy's `dump` (`Thread 123 (idle):
"MainThread"`, then `    FUNC (PATH:LINE)`). Each dump opens with our header line
`# launch4d stack dump: rank R host H pid P at TIME: REASON`; without one the rank comes from the
file name. A rank's newest dump counts; one taken before the rank's latest heartbeat is history.
"""

from __future__ import annotations

import calendar
import re
import time
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from launcher.diagnose.findings import ERROR, INFO, WARNING, Finding
from launcher.formats import rundir

HEADER_RE = re.compile(r"^# launch4d stack dump: rank (?P<rank>\d+) host (?P<host>\S+) pid (?P<pid>\d+) "
                       r"at (?P<at>\S+): (?P<reason>.*)$")
FH_THREAD_RE = re.compile(r"^(?P<current>Current thread|Thread) (?P<id>0x[0-9a-fA-F]+) \(most recent call first\):")
FH_FRAME_RE = re.compile(r'^\s+File "(?P<path>.*)", line (?P<line>\d+) in (?P<func>\S+)')
SPY_THREAD_RE = re.compile(r'^Thread (?P<id>(?:0x)?[0-9a-fA-F]+)(?: \((?P<state>[^)]*)\))?(?:: "(?P<name>[^"]*)")?\s*$')
SPY_FRAME_RE = re.compile(r"^\s{4}(?P<func>\S.*?) \((?P<path>[^():]+):(?P<line>\d+)\)\s*$")
FILE_RANK_RE = re.compile(r"rank[_\-]?(\d+)", re.I)
MAX_FRAMES = 256
MAX_THREADS = 256
COLLECTIVE_PATH = "torch/distributed/"


@dataclass
class Frame:
    func: str
    path: str
    line: int

    def short(self) -> str:
        return f"{self.func} ({short_path(self.path)}:{self.line})"


@dataclass
class Thread:
    ident: str
    name: str = ""
    frames: list[Frame] = field(default_factory=list)  # innermost first

    @property
    def is_main(self) -> bool:
        return self.name == "MainThread" or any(f.func == "_run_module_as_main" or f.func == "<module>"
                                                for f in self.frames[-3:])


@dataclass
class Dump:
    rank: int
    host: str
    at: float | None
    reason: str
    evidence: str
    threads: list[Thread] = field(default_factory=list)

    def main(self) -> Thread | None:
        return next((t for t in self.threads if t.is_main), None)


def short_path(path: str) -> str:
    """launcher/trainer/engine.py, torch/distributed/distributed_c10d.py, else the file name."""
    p = path.replace("\\", "/")
    for root in ("launcher/", "torch/", "checks/"):
        i = p.rfind("/" + root)
        if i >= 0:
            return p[i + 1:]
        if p.startswith(root):
            return p
    return PurePath(p).name


def where(thread: Thread) -> tuple[bool, str]:
    """(waiting inside a collective?, "FRAME [from OUR FRAME]") for a thread's innermost frames."""
    if not thread.frames:
        return False, "no Python frame (native code)"
    inner = thread.frames[0]
    waiting = any(COLLECTIVE_PATH in f.path.replace("\\", "/") for f in thread.frames[:6])
    ours = next((f for f in thread.frames if "launcher/" in f.path.replace("\\", "/")), None)
    text = inner.short()
    if ours is not None and ours is not inner:
        text += f" from {ours.short()}"
    return waiting, text


@dataclass
class Stacks:
    dumps: dict[int, Dump] = field(default_factory=dict)
    _cur: Dump | None = None
    _thread: Thread | None = None
    _file: str = ""

    def feed(self, line: str, evidence: str, path: str) -> None:
        if path != self._file:
            self._close()
            self._file = path
        if line.startswith(rundir.STACK_HEADER):
            m = HEADER_RE.match(line)
            if m:
                self._close()
                self._cur = Dump(int(m["rank"]), m["host"], _when(m["at"]), m["reason"], evidence)
            return
        t = FH_THREAD_RE.match(line) or (SPY_THREAD_RE.match(line) if line.startswith("Thread ") else None)
        if t:
            if self._cur is None:
                r = FILE_RANK_RE.search(PurePath(path).name)
                if r is None:
                    return
                self._cur = Dump(int(r.group(1)), "?", None, "", evidence)
            if len(self._cur.threads) < MAX_THREADS:
                self._thread = Thread(t["id"], (t.groupdict().get("name") or ""))
                self._cur.threads.append(self._thread)
            return
        if self._thread is None or len(self._thread.frames) >= MAX_FRAMES:
            return
        f = FH_FRAME_RE.match(line) or SPY_FRAME_RE.match(line)
        if f:
            self._thread.frames.append(Frame(f["func"], f["path"], int(f["line"])))

    def _close(self) -> None:
        d = self._cur
        if d is not None and d.threads:
            old = self.dumps.get(d.rank)
            if old is None or (d.at or 0) >= (old.at or 0):
                self.dumps[d.rank] = d
        self._cur, self._thread = None, None

    def hosts(self) -> dict[int, str]:
        self._close()
        return {r: d.host for r, d in self.dumps.items() if d.host != "?"}

    def findings(self, world: int | None, hosts: dict[int, str], beats: dict[int, Any] | None = None) -> list[Finding]:
        """Stuck (outside every collective) vs waiting (inside one), from each rank's newest live dump."""
        self._close()
        if not self.dumps:
            return []
        beats = beats or {}
        live: dict[int, tuple[bool, str, Dump]] = {}
        history = []
        for r, d in sorted(self.dumps.items()):
            b = beats.get(r)
            if b is not None and (b.phase == "done" or (b.phase != "error" and d.at is not None
                                                         and b.updated > d.at + 2)):
                history.append(r)  # the rank moved on after this dump
                continue
            main = d.main()
            if main is None:
                continue
            in_collective, text = where(main)
            live[r] = (in_collective, text, d)
        out: list[Finding] = []
        if history and not live:
            out.append(Finding("stacks", INFO, f"stack dumps of rank {_ranks(history)} predate their ranks' "
                               "latest heartbeats (the job moved on after them)",
                               [self.dumps[r].evidence for r in history]))
            return out

        def who(r: int) -> str:
            h = hosts.get(r) or live[r][2].host
            return f"rank {r} on host {h}" if h and h != "?" else f"rank {r}"

        stuck = [r for r, (w, _, _) in live.items() if not w]
        waiting = [r for r, (w, _, _) in live.items() if w]
        missing = sorted(set(range(world)) - set(self.dumps)) if world else []
        evs = [live[r][2].evidence for r in sorted(live)]
        waits = "; ".join(f"rank {r} waits in {live[r][1]}" for r in waiting[:8]) + \
            (f" (+{len(waiting) - 8} more)" if len(waiting) > 8 else "")
        if stuck and waiting:
            first = stuck[0]
            msg = f"{who(first)} stuck in {live[first][1]}, outside any collective"
            for r in stuck[1:4]:
                msg += f"; {who(r)} stuck in {live[r][1]}"
            out.append(Finding("stalled_rank", ERROR, f"{msg}, while {waits} (stack dumps)", evs, ranks=stuck,
                               hosts=[hosts.get(r) or live[r][2].host for r in stuck], confidence=4))
        elif waiting and missing:
            out.append(Finding("stalled_rank", ERROR,
                               f"rank {_ranks(missing)} left no stack dump while every rank that did waits in a "
                               f"collective ({waits}) (stack dumps)", evs, ranks=missing, confidence=1))
        elif waiting:
            out.append(Finding("stacks", WARNING, f"every rank waits in a collective: {waits}; the hang is below "
                               "Python (network, a GPU, or ranks calling different collectives: see the flight "
                               "recorder)", evs, ranks=waiting))
        summary = "; ".join(f"rank {r} {'waits in' if w else 'is in'} {text} [{d.reason}]"
                            for r, (w, text, d) in sorted(live.items()))
        if summary:
            out.append(Finding("stacks", INFO, summary, evs))
        return out


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _when(stamp: str) -> float | None:
    """The header's UTC time (ISO 8601, Z) as epoch seconds, comparable with a heartbeat's `updated`."""
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None
