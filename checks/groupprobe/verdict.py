"""`python -m checks.groupprobe.verdict RESULT --hosts "n1 n2"`: the job gate's answer from a plan
preflight's result, in the node check's words: one `launch4d-check HOST ok` or `launch4d-check HOST
FAIL why` line per allocated host, so the batch script excludes and requeues exactly as it does for a
node that fails its self-check.

A slow group blames the hosts in the most slow groups (GroupProbe.suspect_hosts). A probe that did
not measure at all (no result, or the worker's error) is the job's configuration, not a node's
fault: every host gets `FAIL missing: ...`, which the script turns into a failed job, not a requeue.
Without --hosts (a Kubernetes pod judging its gang) the hosts are the result's own, in node order.
Exit 0 when every host is ok, 1 when a group was slow, 3 when nothing was measured (a pod's init
container exits with it: the job's pod failure policy fails the job on 1, not on 3).
"""

from __future__ import annotations

import sys
from pathlib import Path

from launcher.formats.groupprobe import KIND_NAMES, GroupProbe, ProbeGroup


def describe(g: ProbeGroup) -> str:
    """One slow group in one line: which, where, how fast, what the plan assumed."""
    return (f"{KIND_NAMES[g.kind]} group {g.index}, {g.where()}: {g.op} {g.measured_busbw_gbs or 0:.3g} GB/s busbw "
            f"in {g.measured_s or 0:.3g} s; the plan assumed {g.assumed_s:.3g} s at {g.assumed_busbw_gbs:.3g} GB/s "
            f"(ratio {g.ratio or 0:.2g})")


def gang_hosts(probe: GroupProbe) -> list[str]:
    """The node names the ranks ran on, in the plan's node order (the plan's own names where none ran)."""
    by_node: dict[int, str] = dict(enumerate(probe.hosts))
    for g in probe.groups:
        by_node.update(zip(g.nodes, g.hosts))
    return [by_node.get(n, f"node{n}") for n in range(probe.nodes)]


def verdict(result: str | Path, hosts: list[str] | None, log_tail: str = "") -> list[str]:
    """The gate's lines, one per host (None: the result's own hosts)."""
    from launcher.errors import UserError

    why = None
    probe = None
    if not Path(result).is_file():
        why = f"no result ({log_tail.strip().splitlines()[-1] if log_tail.strip() else 'the probe wrote nothing'})"
    else:
        try:
            probe = GroupProbe.load(result)
        except UserError as exc:
            why = str(exc)
        if probe is not None and probe.error:
            why = probe.error
        elif probe is not None and not probe.measured:
            why = "some groups were not measured"
    if why is not None or probe is None:
        if hosts is None:
            hosts = [h for h in gang_hosts(probe) if h] if probe is not None else ["-"]
        return [f"launch4d-check {h} FAIL missing: plan preflight did not measure: {why}" for h in hosts]
    hosts = gang_hosts(probe) if hosts is None else hosts
    suspects = probe.suspect_hosts()
    lines = []
    for h in hosts:
        groups = suspects.get(h)
        if not groups:
            lines.append(f"launch4d-check {h} ok")
            continue
        worst = min(groups, key=lambda g: g.ratio or 0)
        more = f" (+{len(groups) - 1} more slow group(s))" if len(groups) > 1 else ""
        lines.append(f"launch4d-check {h} FAIL plan preflight: {describe(worst)}{more}")
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m checks.groupprobe.verdict")
    ap.add_argument("result", help="the worker's preflight-plan.json")
    ap.add_argument("--hosts", help="the allocated hosts, space- or comma-separated (default: the result's own)")
    ap.add_argument("--log", help="the probe's output (its last line explains a missing result)")
    ap.add_argument("--print-result", action="store_true",
                    help="also print the result as one line (a pod's log keeps it when its run dir goes)")
    args = ap.parse_args(argv)
    hosts = args.hosts.replace(",", " ").split() if args.hosts is not None else None
    tail = ""
    if args.log and Path(args.log).is_file():
        tail = Path(args.log).read_text(errors="replace")[-4000:]
    lines = verdict(args.result, hosts, tail)
    print("\n".join(lines))
    if args.print_result and Path(args.result).is_file():
        import json

        from checks.groupprobe.worker import RESULT_MARKER

        try:
            doc = json.loads(Path(args.result).read_text(errors="replace"))
            print(RESULT_MARKER + json.dumps(doc, separators=(",", ":")), flush=True)
        except ValueError:
            pass                  # the lines above already say the result is unreadable
    if all(ln.endswith(" ok") for ln in lines):
        return 0
    return 3 if any(" FAIL missing: " in ln for ln in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
