"""The trainer's per-rank heartbeat files (<run_dir>/heartbeat/rank<R>.json, format in the run-dir
contract): the rank whose step / collective count lags, or whose file stopped updating while the
others went on, is the stalled one. Works without NCCL (gloo on CPU) and without any log line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from launcher.diagnose.findings import ERROR, INFO, Finding, fmt_ranks

KEYS = {"rank", "step", "phase", "updated"}
# A lagging rank whose file is at least this much older than the newest one is not a snapshot
# artefact (ranks rewrite on every phase change, several times a second while healthy).
STALE_S = 5.0


@dataclass
class Beat:
    rank: int
    host: str
    pid: int | None
    step: int
    phase: str
    last_collective: str | None
    collectives: int
    updated: float
    evidence: str
    step_time_s: float | None = None   # medians over the rank's recent steps (trainer.metrics.Heartbeat.timing)
    busy_s: float | None = None        # step time minus time spent waiting for peers


def parse_beat(text: str, evidence: str) -> Beat | None:
    """One heartbeat file, or None when the text is not one."""
    try:
        d: Any = json.loads(text)
    except ValueError:
        return None
    if not isinstance(d, dict) or not KEYS <= set(d):
        return None
    # NaN/Infinity parse as JSON numbers: a beat without a real time, rank or step says nothing
    if not all(isinstance(d[k], (int, float)) and not isinstance(d[k], bool) and math.isfinite(d[k]) and d[k] >= 0
               for k in ("rank", "step", "updated")):
        return None
    try:
        return Beat(rank=int(d["rank"]), host=str(d.get("host") or "?"),
                    pid=int(d["pid"]) if isinstance(d.get("pid"), int) else None,
                    step=int(d["step"]), phase=str(d["phase"]),
                    last_collective=d.get("last_collective") if isinstance(d.get("last_collective"), str) else None,
                    collectives=int(d.get("collectives") or 0), updated=float(d["updated"]), evidence=evidence,
                    step_time_s=_seconds(d.get("step_time_s")), busy_s=_seconds(d.get("busy_s")))
    except (TypeError, ValueError, OverflowError):
        return None


def _seconds(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 1e7:
        return float(v)
    return None


@dataclass
class Heartbeats:
    beats: dict[int, Beat] = field(default_factory=dict)

    def add(self, beat: Beat) -> None:
        old = self.beats.get(beat.rank)
        if old is None or beat.updated >= old.updated:
            self.beats[beat.rank] = beat

    def hosts(self) -> dict[int, str]:
        return {r: b.host for r, b in self.beats.items() if b.host != "?"}

    def findings(self, world: int | None, hosts: dict[int, str],
                 role: dict[int, Any] | None = None) -> list[Finding]:
        """`role` groups ranks that issue the same collectives per step (the plan's pipeline stage):
        collective counts are compared only inside a group, steps across all ranks."""
        if not self.beats:
            return []
        beats = self.beats
        hosts = {**hosts, **self.hosts()}
        evs = [b.evidence for _, b in sorted(beats.items())]
        out: list[Finding] = []
        done = all(b.phase == "done" for b in beats.values())
        errored = sorted(r for r, b in beats.items() if b.phase == "error")
        newest = max(b.updated for b in beats.values())
        role = role or {}
        top_step = max(b.step for b in beats.values())
        top_coll: dict[Any, int] = {}
        for r, b in beats.items():
            if b.step == top_step:
                top_coll[role.get(r)] = max(top_coll.get(role.get(r), 0), b.collectives)
        lead = (top_step, max(top_coll.values()))
        lagging = sorted(r for r, b in beats.items() if b.phase != "done" and (
            b.step < top_step or b.collectives < top_coll.get(role.get(r), b.collectives)))
        stale = [r for r in lagging if newest - beats[r].updated >= STALE_S]
        missing = sorted(set(range(world)) - set(beats)) if world else []
        table = "; ".join(f"rank {r}@{b.host}: step {b.step} {b.phase}, {b.collectives} collectives"
                          + (f" (last {b.last_collective})" if b.last_collective else "")
                          + (f", {newest - b.updated:.0f}s behind newest" if newest - b.updated >= 1 else "")
                          for r, b in sorted(beats.items()))
        if lagging and (errored or stale):
            detail = "; ".join(
                f"rank {r} at step {beats[r].step} phase {beats[r].phase} after {beats[r].collectives} collectives"
                + (f" of {top_coll[role.get(r)]}" if role.get(r) in top_coll else "")
                + (f" (last {beats[r].last_collective})" if beats[r].last_collective else "")
                + f", heartbeat {newest - beats[r].updated:.0f}s older than the newest" for r in lagging)
            out.append(Finding("stalled_rank", ERROR,
                               f"rank {fmt_ranks(lagging, hosts)} stopped while the others went on to step "
                               f"{lead[0]} ({detail})"
                               + (f"; rank {fmt_ranks(errored, hosts)} then failed waiting" if errored else "")
                               + " (heartbeat)",
                               [beats[r].evidence for r in lagging] + [beats[r].evidence for r in errored],
                               ranks=lagging, hosts=[hosts[r] for r in lagging if r in hosts], confidence=2))
        elif missing and not done:
            out.append(Finding("stalled_rank", ERROR,
                               f"rank {fmt_ranks(missing, hosts)} never wrote a heartbeat (of {world} ranks): it "
                               "did not start or died before its first phase", evs, ranks=missing, confidence=2))
        elif errored:
            out.append(Finding("heartbeat", ERROR,
                               f"rank {fmt_ranks(errored, hosts)} ended in phase error with no rank behind the "
                               "others", [beats[r].evidence for r in errored], ranks=errored))
        out.append(Finding("heartbeat", INFO, f"heartbeats: {table}", evs))
        return out
