"""Which nccl-tests runs a preflight makes, as plain data: the options of a run, and the schedules of
node pairs (disjoint pairs per round, so a round costs one run's time whatever the node count).

`first_round` + `second_round` are the adaptive schedule orchestrate uses; `ring_rounds` is the fixed
one the Slurm batch job uses (it cannot adapt). Runners and orchestrate both import this; it imports
neither, so there is no cycle between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class NcclOptions:
    enabled: bool = True
    binary: str = "all_reduce_perf"
    sizes: tuple[str, str] = ("512M", "8G")
    extra: str = ""
    launcher: str | None = None  # a template with {np} {hosts_slots} {hostlist} {nnodes} {gpus} {cmd}
    pairs: bool = True
    all_nodes: bool = True

    @property
    def collective(self) -> str:
        return self.binary.rsplit("/", 1)[-1].removesuffix("_perf")


def ring_rounds(hosts: Sequence[str]) -> list[list[tuple[str, str]]]:
    """Rounds of disjoint pairs covering the ring h0-h1-...-h(n-1)-h0 (2 rounds, 3 when n is odd)."""
    n = len(hosts)
    if n < 2:
        return []
    if n == 2:
        return [[(hosts[0], hosts[1])]]
    edges = [(hosts[i], hosts[(i + 1) % n]) for i in range(n)]
    rounds = [edges[0:n - (n % 2):2], edges[1:n - (n % 2):2]]
    if n % 2:
        rounds.append([edges[n - 1]])
    return [r for r in rounds if r]


def first_round(hosts: Sequence[str]) -> list[tuple[str, str]]:
    """Neighbours paired: (h0,h1), (h2,h3), ...; with an odd count the last host waits for round 2."""
    return [(hosts[i], hosts[i + 1]) for i in range(0, len(hosts) - 1, 2)]


def second_round(hosts: Sequence[str], first: Sequence[tuple[str, str]],
                 bad: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """Each node of a bad pair (and an odd one out) meets a node from a good pair, pairs disjoint."""
    paired = {h for p in first for h in p}
    waiting = [h for p in first if p in bad for h in p] + [h for h in hosts if h not in paired]
    if not waiting:
        return []
    good = [h for p in first if p not in bad for h in p]
    out: list[tuple[str, str]] = []
    left: list[str] = []
    for h in waiting:
        if good:
            out.append((h, good.pop(0)))
        else:
            left.append(h)
    done = set(first)
    while len(left) >= 2:  # no good partner left: cross the suspects, avoiding pairs already run
        a = left.pop(0)
        b = next((x for x in left if (a, x) not in done and (x, a) not in done), left[0])
        left.remove(b)
        out.append((a, b))
    return out
