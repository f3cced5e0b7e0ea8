"""`launch diagnose LOGDIR|JOB`: which rank stalled and why, from NCCL_DEBUG, watchdog, flight
recorder and heartbeat output. Exit 0 when nothing is wrong, 1 when a problem was found, 2 for bad
input."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from launcher.commands import emit, json_option


def _target(arg: str) -> tuple[Path, Path | None]:
    """A path as given, or a job id/name from the local job record (its run dir, else log dir)."""
    p = Path(arg)
    if p.exists():
        return p, None
    from launcher.backends import jobstate
    from launcher.errors import UserError
    from launcher.formats.rundir import RunDir

    if "/" in arg or arg.startswith("."):
        raise UserError(f"{arg}: no such file or directory (give a log dir, a log file or a job id)")

    job = jobstate.lookup(arg)  # UserError (exit 2) when unknown
    for d in (job.run_dir, job.log_dir):
        if d and Path(d).exists():
            plan = RunDir(job.run_dir).plan if job.run_dir else None
            return Path(d), plan if plan and plan.is_file() else None
    raise UserError(f"job {arg}: its run dir {job.run_dir} / log dir {job.log_dir} is not readable from here "
                    "(copy the logs over, or run diagnose where they are)")


def _human(report) -> str:
    lines = [f"verdict: {report.verdict}"]
    if report.stalled_ranks:
        who = ", ".join(f"{r} ({report.stalled_hosts[r]})" if r in report.stalled_hosts else str(r)
                        for r in report.stalled_ranks)
        lines.append(f"stalled rank(s): {who}")
    if report.findings:
        lines.append("findings, most likely cause first:")
    for i, f in enumerate(report.findings, 1):
        lines.append(f"{i:>2}. [{f.severity}] {f.kind}: {f.message}")
        ev = list(dict.fromkeys(f.evidence))
        if ev:
            more = f" (+{len(ev) - 4} more)" if len(ev) > 4 else ""
            lines.append("      evidence: " + ", ".join(ev[:4]) + more)
    nccl = report.nccl or {}
    if nccl.get("ranks"):
        lines.append("nccl ranks (host: rank[cudaDev/busId]):")
        by_host: dict[str, list[str]] = {}
        for r in nccl["ranks"]:
            by_host.setdefault(r["host"], []).append(f"{r['rank']}[{r['cuda_dev']}/{r['bus_id']}]")
        for host, seats in by_host.items():
            lines.append(f"  {host}: " + " ".join(seats[:32]) + (" ..." if len(seats) > 32 else ""))
    for c in nccl.get("communicators", [])[:8]:
        tr = ", ".join(f"{k} x{v}" for k, v in sorted(c["transports"].items())) or "no channel lines"
        lines.append(f"  communicator {c['key']}: {c['nranks']} ranks, {c.get('nnodes') or '?'} node(s); {tr}")
    lines.append(f"read {len(report.files)} file(s)")
    return "\n".join(lines)


@click.command("diagnose")
@click.argument("target", metavar="LOGDIR|JOB")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None,
              help="plan.json of the job (default: the run dir's plan.json); enables the TP-across-nodes check.")
@click.option("--bwmap", "bwmap_path", type=click.Path(dir_okay=False), default=None,
              help="Bandwidth map from `launch preflight`; enables the nearest-NIC check.")
@json_option
def diagnose(target: str, plan_path: str | None, bwmap_path: str | None, as_json: bool) -> None:
    """Explain a hang or failure: the stalled rank and its host, NCCL transports, TP across nodes.

    LOGDIR may hold any mix of files (NCCL_DEBUG_FILE output, torchrun/srun logs, flight-recorder
    dumps, heartbeat/ files); a single log pasted from a ticket works too (`-` reads it from stdin).
    JOB is a job id or name recorded by `launch submit`.
    """
    from launcher.diagnose import diagnose as run_diagnose

    if target == "-":  # a log pasted on stdin
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            pasted = Path(tmp) / "stdin.log"
            pasted.write_bytes(sys.stdin.buffer.read())
            report = run_diagnose(pasted, plan_path, bwmap_path)
    else:
        path, job_plan = _target(target)
        report = run_diagnose(path, plan_path or job_plan, bwmap_path)
    emit(report.to_dict(), as_json, lambda: _human(report))
    sys.exit(1 if report.problem else 0)
