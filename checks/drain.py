"""Keep bad nodes out: the scheduler commands that take a failed node out of service, with why.

Slurm: `scontrol update nodename=N state=drain reason="launch4d: <check>: <figure>"` — a drained
node finishes what runs on it and takes no new job, and `sinfo -R` shows the reason to the admin
(who returns it with `state=resume`). Kubernetes: a `launch4d.io/health=fail` label (what a job's
node affinity can select against), a NoSchedule taint of the same key (what keeps every other pod
off too) and the reason as an annotation (a label value cannot hold it). Commands are printed by
default; `apply` runs them. Every value reaches the printed line through launcher.formats.shell.quote,
and `apply` passes argv lists, never a shell string.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from launcher.formats.bwmap import BandwidthMap, CheckResult
from launcher.formats.health import HEALTH_KEY, REASON_KEY
from launcher.formats.shell import quote

REASON_MAX = 200  # sinfo -R shows the reason in a column; a long one helps nobody
SCHEDULERS = ("slurm", "k8s")
_KEY = re.compile(r"[A-Za-z][A-Za-z0-9./_-]*=")


@dataclass
class DrainAction:
    node: str
    reason: str
    argv: list[list[str]]  # the commands, as argument lists

    @property
    def lines(self) -> list[str]:
        return [" ".join(_word(a) for a in cmd) for cmd in self.argv]


def _word(arg: str) -> str:
    """`key=value` with the value quoted (`reason='...'`, as an admin would type it), else the quoted arg."""
    m = _KEY.match(arg)
    return m.group(0) + quote(arg[m.end():]) if m else quote(arg)


def figure(c: CheckResult) -> str:
    """What the check measured, in one line: its message, else value against threshold."""
    text = c.message.strip() if c.message else ""
    if not text and c.value is not None:
        text = f"{c.value}" + (f" (threshold {c.threshold})" if c.threshold is not None else "")
    return " ".join(text.split()) or "failed"


def reason_for(failed: Sequence[CheckResult]) -> str:
    """`launch4d: <check>: <figure>` for the first failed check, `(+N more)` for the rest."""
    first = failed[0]
    more = f" (+{len(failed) - 1} more)" if len(failed) > 1 else ""
    head = f"launch4d: {first.check}: "
    body = figure(first)
    room = REASON_MAX - len(head) - len(more)
    if len(body) > room:
        body = body[:room - 3].rstrip() + "..."
    return head + body + more


def slurm_argv(node: str, reason: str) -> list[list[str]]:
    return [["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"]]


def k8s_argv(node: str, reason: str) -> list[list[str]]:
    return [["kubectl", "label", "node", node, f"{HEALTH_KEY}=fail", "--overwrite"],
            ["kubectl", "annotate", "node", node, f"{REASON_KEY}={reason}", "--overwrite"],
            ["kubectl", "taint", "node", node, f"{HEALTH_KEY}=fail:NoSchedule", "--overwrite"]]


def plan_drain(bw: BandwidthMap, scheduler: str = "slurm") -> list[DrainAction]:
    """One action per node the map excludes (a node with a failed check), in the map's order."""
    build = slurm_argv if scheduler == "slurm" else k8s_argv
    out = []
    for node in bw.exclude:
        failed = [c for c in bw.checks if c.node == node and c.status == "fail"]
        reason = reason_for(failed) if failed else "launch4d: excluded by preflight"
        out.append(DrainAction(node, reason, build(node, reason)))
    return out


@dataclass
class Applied:
    node: str
    command: str
    rc: int | None
    output: str


def apply(actions: Sequence[DrainAction], timeout: float = 30.0) -> list[Applied]:
    """Run every command; a scheduler that refuses one is reported, the others still run."""
    done = []
    for a in actions:
        for argv, line in zip(a.argv, a.lines, strict=True):
            try:
                p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
                done.append(Applied(a.node, line, p.returncode, (p.stderr or p.stdout).strip()[-500:]))
            except (OSError, subprocess.TimeoutExpired) as exc:
                done.append(Applied(a.node, line, None, f"{type(exc).__name__}: {exc}"))
    return done
