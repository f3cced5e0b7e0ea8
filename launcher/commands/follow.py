"""Following a job on this machine to its end (`launch run`): rank 0's lines on the terminal, every rank's
last lines kept for the failure report, Ctrl-C turned into a checkpointing stop, and when rank 0 goes
quiet, where each rank is (heartbeats, stack dumps) and which pipeline stage lags."""

from __future__ import annotations

import collections
import re
import signal
import sys
import time
from pathlib import Path

from launcher.commands import progress, warn
from launcher.errors import UserError
from launcher.formats.rundir import RunDir

LOG_LEVEL_LINE = re.compile(r"^[EW]\d{4} ")


def _beats(run_dir: Path):
    from launcher.diagnose.heartbeat import Heartbeats, parse_beat

    hb = Heartbeats()
    for path in RunDir(run_dir).heartbeat_files():
        try:
            beat = parse_beat(path.read_text(), str(path))
        except (OSError, UnicodeDecodeError):
            continue
        if beat is not None:
            hb.add(beat)
    return hb


def stall_report(run_dir: Path, world: int | None) -> str:
    """Where each rank is: from stack dumps when there are live ones (the frame each rank is in), else from
    the heartbeat files (launcher.diagnose's reading of both)."""
    from launcher.diagnose.findings import ERROR

    hb = _beats(run_dir)
    stuck = stack_report(run_dir, world, hb)
    if stuck:
        return stuck
    role = _pp_stage_of_ranks(run_dir)
    findings = hb.findings(world, {}, role)
    if not findings:
        return "no heartbeat files yet (the ranks have not started their first phase)"
    errors = [f for f in findings if f.severity == ERROR]
    if errors:
        return errors[0].message
    # Everyone is waiting (no file is stale next to another): the suspect is the rank that issued
    # fewer collectives than the others of its pipeline stage.
    beats = hb.beats
    top: dict = {}
    for r, b in beats.items():
        top[role.get(r)] = max(top.get(role.get(r), (0, 0)), (b.step, b.collectives))
    behind = sorted(r for r, b in beats.items() if b.phase != "done" and (b.step, b.collectives) < top[role.get(r)])
    lead = "; ".join(f"rank {r} is behind its peers at step {beats[r].step} after {beats[r].collectives} "
                     f"collectives (last {beats[r].last_collective})" for r in behind)
    return (lead + "; " if lead else "") + findings[-1].message


def stack_report(run_dir: Path, world: int | None, hb=None) -> str | None:
    """The stack dumps' verdict ("rank R on host H stuck in FRAME ..."), or None without live dumps."""
    from launcher.diagnose.stacks import Stacks

    stacks = Stacks()
    for path in RunDir(run_dir).stack_files():
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                for n, line in enumerate(fh, 1):
                    stacks.feed(line.rstrip("\n"), f"{path.name}:{n}", path.name)
        except OSError:
            continue
    hb = hb if hb is not None else _beats(run_dir)
    found = stacks.findings(world, {}, hb.beats)
    top = next((f for f in found if f.kind == "stalled_rank"), None) or next(
        (f for f in found if f.severity != "info"), None)
    return top.message.removesuffix(" (stack dumps)") if top else None


def straggler_report(run_dir: Path) -> tuple[tuple[int, ...], str]:
    """(the straggling ranks, one line naming them with their hosts); ((), "") when there are none."""
    from launcher.diagnose.stragglers import describe, stragglers

    beats = _beats(run_dir).beats
    found = stragglers(beats)
    return tuple(r for r, _, _ in found), (describe(found, beats, {}) if found else "")


def _pp_stage_of_ranks(run_dir: Path) -> dict[int, int]:
    from launcher.plan.model import Plan

    try:
        plan = Plan.load(RunDir(run_dir).plan)
    except UserError:
        return {}
    return {r.rank: r.coords.get("pp", 0) for r in plan.ranks}


class StallWatch:
    """While the job runs: when rank 0 has printed nothing for `quiet_s`, ask every rank for its stacks
    (`dump`, the backend's py-spy/SIGQUIT) and say where every rank is."""

    def __init__(self, run_dir: Path, world: int | None, quiet_s: float, dump=None, startup_s: float = 0.0):
        import threading

        self.run_dir, self.world, self.quiet_s, self.dump = run_dir, world, quiet_s, dump
        self.startup_s = max(quiet_s, startup_s)  # before the first step: start-up is slow, not hung
        self.stepping = False
        self.last = time.time()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(min(5.0, self.quiet_s / 4)):
            quiet = time.time() - self.last
            if quiet >= (self.quiet_s if self.stepping else self.startup_s):
                where = ""
                if self.dump is not None:
                    asked = self.dump(f"no output from rank 0 for {quiet:.0f} s (launch run)")
                    if asked:
                        self.stop.wait(3.0)  # faulthandler/py-spy write within milliseconds; allow a loaded box
                        where = f"; stacks in {RunDir(self.run_dir).stacks}"
                warn(f"launch: no output from rank 0 for {quiet:.0f} s; "
                         f"{stall_report(self.run_dir, self.world)}{where}; more: launch diagnose {self.run_dir}")
                self.last = time.time()


def follow(backend, handle, as_json: bool, quiet_s: float = 120.0,
           startup_s: float = 0.0) -> dict[int, collections.deque]:
    """Stream rank 0 (and torchrun's warnings) until the job ends; keep each rank's last lines;
    report where the ranks are when rank 0 goes quiet for `quiet_s`."""
    from launcher.backends import rank_of

    watch = StallWatch(Path(handle.run_dir), int(handle.extra.get("world", 0)) or None, quiet_s,
                       dump=lambda reason: backend.dump_stacks(handle, reason), startup_s=startup_s)
    watch.thread.start()
    slow: dict = {"said": None}

    tails: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=30))
    out = sys.stderr if as_json else sys.stdout
    stops = {"n": 0}

    def on_signal(signum, frame):
        stops["n"] += 1
        if stops["n"] == 1:
            progress("launch: stopping the job (the trainer checkpoints, then exits); again to kill it")
            backend.cancel(handle)
        else:
            progress("launch: killing the job")
            backend.cancel(handle, force=True)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for line in backend.log_iter(handle, follow=True):
            rank, text = rank_of(line)
            if rank is not None:
                tails[rank].append(text)
                if rank == 0:
                    watch.last = time.time()
                    print(text, file=out, flush=True)
                    if text.startswith("step "):
                        watch.stepping = True
                        ranks, said = straggler_report(Path(handle.run_dir))
                        if ranks and ranks != slow["said"]:  # said once per new set of slow ranks
                            warn(f"launch: straggler: {said}")
                        slow["said"] = ranks
            elif LOG_LEVEL_LINE.match(line):
                tails[-1].append(line)
                print(line, file=sys.stderr, flush=True)
    finally:
        watch.stop.set()
        for s, h in old.items():
            signal.signal(s, h)
    return tails
