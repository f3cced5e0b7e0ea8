"""Which processes on this machine belong to a local job, read from /proc (Linux).

Why: a pid alone is not an identity. Once a job ends its pid is free, and `cancel local-<pid>` must
not signal whatever process group got it next; and torchrun starts every trainer in its own session,
so a process-group kill misses them. Every process of a local job carries one environment marker
(`LAUNCH4D_JOB=<token>`, inherited from the wrapper through torchrun to the trainers), and the
wrapper's start time (field 22 of /proc/PID/stat, clock ticks since boot) is recorded at launch: a
pid is the job's only while both still match.
"""

from __future__ import annotations

import os
import signal

MARKER = "LAUNCH4D_JOB"
_ENVIRON_MAX = 1 << 20  # a process environment is rarely more than a few KiB


def stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time in clock ticks) of a live pid, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read(4096).rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[19])


def start_time(pid: int) -> int | None:
    st = stat(pid)
    return st[2] if st else None


def environ(pid: int) -> dict[str, str]:
    """The environment a process started with ({} when unreadable: gone, or another user's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read(_ENVIRON_MAX)
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, val = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = val.decode(errors="replace")
    return out


def alive(pid: int) -> bool:
    st = stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def is_ours(pid: int, marker: tuple[str, str], started: int | None = None) -> bool:
    """pid is alive, started when we recorded (if we did) and carries our (NAME, value) marker."""
    st = stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    if started is not None and st[2] != started:
        return False
    name, value = marker
    return environ(pid).get(name) == value


def marked(marker: tuple[str, str]) -> list[int]:
    """Every live process (of this user) carrying the marker, whatever session or parent it has."""
    me = os.getpid()
    name, value = marker
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        if environ(pid).get(name) == value and alive(pid):
            out.append(pid)
    return sorted(out)


def children(pids: list[int], table: dict[int, int] | None = None) -> list[int]:
    """Direct children of any of `pids` (from a pid -> ppid table, read now when not given)."""
    if table is None:
        table = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (st := stat(int(entry))) is not None and st[0] not in ("Z", "X"):
                table[int(entry)] = st[1]
    parents = set(pids)
    return sorted(p for p, pp in table.items() if pp in parents)


def signal_all(pids: list[int], sig: int) -> list[int]:
    """Send sig to each pid; the ones that were still there."""
    hit = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            hit.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return hit


def kill_marked(marker: tuple[str, str]) -> list[int]:
    """SIGKILL every process carrying the marker (the sweep after a job's end or a forced stop)."""
    return signal_all(marked(marker), signal.SIGKILL)


def catches(pid: int, sig: int) -> bool:
    """pid has a handler installed for sig (SigCgt in /proc/PID/status): sending it will not kill it."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f.read(16384).splitlines():
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False
