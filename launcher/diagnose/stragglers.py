"""Stragglers: ranks that are slow, not stalled. Every rank's heartbeat carries the median of its
recent steps' own work (`busy_s`: step time minus the time it waited for its peers in the
synchronisations the trainer times, trainer.engine.timed_sync). In a synchronous job every rank's
step takes as long as the slowest one's; what differs is who waits: a straggler's peers wait for it,
so its busy time stands out against the median of the others.

Limits, said plainly: the trainer times the step-start sync (a late batch, a host-side stall) and,
under ZeRO 0/1, the sync before the gradient all-reduce (a slow device). Under FSDP (ZeRO 2/3), TP
or PP the ranks also wait inside collectives that are not timed, so a slow device there shows as
every rank slow, not as one straggler.
"""

from __future__ import annotations

import statistics
from typing import Any

from launcher.diagnose.findings import WARNING, Finding

#: slower than the others' median by this factor, and by at least MIN_EXCESS_S / MIN_EXCESS_FRAC of a step
FACTOR = 1.3
MIN_EXCESS_S = 0.02
MIN_EXCESS_FRAC = 0.05


def stragglers(beats: dict[int, Any]) -> list[tuple[int, float, float]]:
    """(rank, its busy_s, median busy_s of the other ranks) for each straggler, slowest first."""
    # a rank that has since failed keeps the timings of its last good steps: they still count
    timed = {r: b for r, b in beats.items() if getattr(b, "busy_s", None) is not None}
    if len(timed) < 2:
        return []
    out = []
    for r, b in timed.items():
        others = statistics.median(o.busy_s for q, o in timed.items() if q != r)
        step = b.step_time_s or b.busy_s
        if b.busy_s > FACTOR * others and b.busy_s - others > max(MIN_EXCESS_S, MIN_EXCESS_FRAC * step):
            out.append((r, b.busy_s, others))
    return sorted(out, key=lambda x: -x[1])


def describe(found: list[tuple[int, float, float]], beats: dict[int, Any], hosts: dict[int, str]) -> str:
    """One line: the slow ranks with their hosts, and whole hosts when all their ranks are slow."""
    def host(r: int) -> str:
        return hosts.get(r) or getattr(beats.get(r), "host", "?") or "?"

    parts = [f"rank {r} on host {host(r)}: {busy:.3g} s of its own work per step against a median of "
             f"{others:.3g} s for the other ranks" for r, busy, others in found[:8]]
    slow = {r for r, _, _ in found}
    by_host: dict[str, list[int]] = {}
    for r in beats:
        by_host.setdefault(host(r), []).append(r)
    whole = sorted(h for h, rs in by_host.items() if h != "?" and len(by_host) > 1 and set(rs) <= slow)
    text = "; ".join(parts) + (f" (+{len(found) - 8} more)" if len(found) > 8 else "")
    if whole:
        text = f"host {', '.join(whole)} is slow (all its ranks): " + text
    return text


def findings(beats: dict[int, Any], hosts: dict[int, str]) -> list[Finding]:
    found = stragglers(beats)
    if not found:
        return []
    ranks = [r for r, _, _ in found]
    return [Finding("straggler", WARNING, "straggler: " + describe(found, beats, hosts),
                    [beats[r].evidence for r in ranks], ranks=ranks,
                    hosts=sorted({hosts.get(r) or beats[r].host for r in ranks}))]
