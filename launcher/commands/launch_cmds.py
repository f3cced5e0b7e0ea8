"""`launch render|submit|status|logs|cancel`: turn a plan into a job on Slurm or Kubernetes, and follow it.

The commands are thin: plan (launcher.plan.planner), render (launcher.render), then one backend
(launcher.backends) that the command never looks inside. Submitted jobs are recorded in the
local job state file so status/logs/cancel work later, from another shell, by id or name.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any

import click

from launcher.commands import emit, json_option, progress
from launcher.commands.options import (
    BWMAP_OPTION,
    dry_run_option,
    options,
    plan_option,
    templates_option,
    tolerance_option,
)
from launcher.errors import UserError

BACKEND_OPTION = click.option("--backend", type=click.Choice(["slurm", "k8s"]), help="Default: the job file's backend.kind.")
preflight_plan_options = options(
    click.option("--preflight-plan", "preflight_plan", is_flag=True,
                 help="Gate the job on the plan's own communication groups: inside the allocation, before the "
                      "trainer, measure each TP/CP/PP/DP/EP group's collective (`launch preflight --plan`); a group "
                      "slower than the plan assumed leaves its node(s) out and the job requeues, as the node check "
                      "does (Slurm), or fails the job naming the group and node(s) (Kubernetes: an init container "
                      "of every pod). Measurements: RUN_DIR/preflight-plan.json (Kubernetes: also the init "
                      "container's log)."),
    tolerance_option("With --preflight-plan: how much below the plan's assumed bandwidth a group may measure."))
PLAN_OPTION = plan_option()


# --- shared steps ---------------------------------------------------------------------------
def _load(job_file: str, backend: str | None, preflight: str | None, plan_path: str | None = None):
    """Job file or plan.json (with --plan: checked against it) -> (Launch, backend kind)."""
    from launcher.commands.sources import load_launch

    job = load_launch(job_file, plan_path, preflight)
    kind = backend or job.spec.backend.kind
    if kind not in ("slurm", "k8s"):
        raise UserError(f"backend.kind is {kind!r}: give --backend slurm|k8s (or use `launch run` for this machine)")
    if job.from_plan:
        progress(f"launch: the plan in {job.from_plan}, as it is: {job.plan.world_size} ranks "
                 f"(tp={job.plan.tp} cp={job.plan.cp} pp={job.plan.pp} dp={job.plan.dp}), not re-planned")
    if not job.plan.fits:
        progress(f"warning: the fixed layout does not fit in GPU memory "
                 f"({job.plan.memory.get('per_gpu_gb', 0):.1f} GB per GPU); rendering it anyway")
    return job, kind


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _job(job: str):
    """The job's record, by id or name (launcher.formats.jobs.JobRecord: what the backends take)."""
    from launcher.backends.jobstate import lookup

    return lookup(job)


def _backend(kind: str):
    from launcher.backends import get_backend

    return get_backend(kind)


def _gate(kind: str, preflight_plan: bool, tolerance: float) -> float | None:
    """--preflight-plan's tolerance for the backend's rendering (None: no gate)."""
    if not preflight_plan:
        return None
    if kind not in ("slurm", "k8s"):
        raise UserError(f"--preflight-plan: the gate runs inside the job (backend slurm or k8s), not {kind}; "
                        "measure the plan's groups with `launch preflight --plan plan.json` first")
    return tolerance


# --- render ---------------------------------------------------------------------------------
@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@BACKEND_OPTION
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False),
              help="Write the script/manifest, plan.json and job.yaml here (it is the job's run dir).")
@BWMAP_OPTION
@PLAN_OPTION
@templates_option("Directory whose templates override ours, file by file.")
@click.option("--force", is_flag=True, help="With -o: overwrite files of another job in that directory.")
@preflight_plan_options
@json_option
def render(job_file: str, backend: str | None, out_dir: str | None, bwmap: str | None, plan_path: str | None,
           templates: str | None, force: bool, preflight_plan: bool, tolerance: float, as_json: bool) -> None:
    """Render the sbatch script or Kubernetes manifest (TrainJob or PyTorchJob; nothing is submitted) of
    JOB_FILE: a job file, planned now, or a plan.json from `launch plan -o`, rendered as it is.
    Same input, same bytes."""
    from launcher.formats import rundir
    from launcher.render.rendered import Rendered

    job, kind = _load(job_file, backend, bwmap, plan_path)
    spec, plan, text = job.spec, job.plan, job.text
    req = _backend(kind).dryrun(spec, plan, Path(out_dir).resolve() if out_dir else None, templates=templates,
                                exclude=job.exclude, node_order=job.node_order,
                                preflight_plan=_gate(kind, preflight_plan, tolerance))
    for line in req.warnings:
        progress(f"warning: {line}")
    written: list[str] = []
    if out_dir:
        files = {**req.files, rundir.JOB: text}
        written = [str(p) for p in Rendered(kind, req.run_dir, req.main or "", files).write(out_dir, force=force)]
    main_text = req.files[req.main or ""]
    emit({"backend": kind, "run_dir": req.run_dir, "main": req.main, "written": written,
          "files": req.files, "warnings": req.warnings, "command": req.command},
         as_json, lambda: main_text.rstrip("\n") + ("\n\n# wrote " + ", ".join(written) if written else ""))


# --- submit ---------------------------------------------------------------------------------
@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@BACKEND_OPTION
@BWMAP_OPTION
@PLAN_OPTION
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Default: <backend.log_dir>/<name>-<timestamp> (over SSH: under backend.slurm.remote_dir).")
@templates_option()
@dry_run_option("Print what would be submitted; submit nothing.")
@click.option("--verify", "verify_", is_flag=True,
              help="Trace the plan with the real trainer first (`launch verify`); submit nothing unless every role "
                   "builds and fits.")
@preflight_plan_options
@json_option
def submit(job_file: str, backend: str | None, bwmap: str | None, plan_path: str | None, run_dir: str | None,
           templates: str | None, dry_run: bool, verify_: bool, preflight_plan: bool, tolerance: float,
           as_json: bool) -> None:
    """Submit a job to Slurm (sbatch, here or over SSH) or Kubernetes (TrainJob or PyTorchJob). JOB_FILE
    is a job file, planned now, or a plan.json from `launch plan -o`, submitted as it is."""
    from launcher.backends.jobstate import check_state, record
    from launcher.formats.files import child_path

    job, kind = _load(job_file, backend, bwmap, plan_path)
    spec, plan, text = job.spec, job.plan, job.text
    if verify_:
        from launcher.commands.verify_cmd import verify_plan
        from launcher.verify import render

        rep = verify_plan(plan, as_json)
        if not rep.fits:
            emit({"submitted": False, "verify": rep.to_dict()}, as_json, lambda: render(rep) + "\nnot submitted")
            raise click.exceptions.Exit(1)
        progress(f"verify: every role builds and fits ({rep.seconds:.0f} s)")
    be = _backend(kind)
    rd = run_dir or str(child_path(Path(spec.backend.log_dir).expanduser(), f"{spec.name}-{_stamp()}", "name"))
    if not dry_run:
        check_state()  # a broken state file is found before anything is submitted
    req = be.dryrun(spec, plan, rd, templates=templates, job_text=text, exclude=job.exclude,
                    node_order=job.node_order, preflight_plan=_gate(kind, preflight_plan, tolerance))
    for line in req.warnings:
        progress(f"warning: {line}")
    if dry_run:
        emit({"id": "dry-run", "backend": kind, "name": req.name, "run_dir": req.run_dir, "dry_run": True,
              "host": req.host, "namespace": req.extra.get("namespace"), "request": req.text(),
              "command": req.command, "files": req.files}, as_json, req.text)
        return
    handle = be.submit(req)
    payload = {"id": handle.id, "backend": kind, "name": handle.name, "run_dir": handle.run_dir,
               "dry_run": False, "host": handle.host, "namespace": handle.namespace, "request": handle.request}
    try:
        record(handle)
    except UserError as exc:  # submitted all the same: say so, with the id
        progress(f"warning: job {handle.id} was submitted but not recorded ({exc}); "
                 "status/logs/cancel by name will not find it")
    where = f" on {payload['host']}" if payload["host"] else ""
    where += f" in namespace {payload['namespace']}" if payload["namespace"] else ""
    emit(payload, as_json, lambda: f"submitted {kind} job {handle.id} ({handle.name}){where}\n"
                                   f"run dir: {handle.run_dir}\n"
                                   f"follow:  launch status {handle.id} --wait; launch logs {handle.id} -f")


# --- status ---------------------------------------------------------------------------------
def _status_dict(rec, st) -> dict[str, Any]:
    d = st.to_dict() if hasattr(st, "to_dict") else {"state": st.state, "exit_code": st.exit_code,
                                                      "detail": st.detail}
    d.setdefault("done", st.done)
    return {"id": rec.id, "backend": rec.backend, "name": rec.name, "run_dir": rec.run_dir, **d}


def _status_line(d: dict[str, Any]) -> str:
    bits = [f"{d['id']} ({d['name']}, {d['backend']}): {d['state']}"]
    native = d.get("slurm_state") or d.get("condition")
    if native and native != d["state"]:
        bits.append(f"[{native}]")
    for key, label in (("nodes", "nodes"), ("elapsed", "elapsed"), ("restarts", "restarts"),
                       ("exit_code", "exit"), ("source", "from")):
        if d.get(key) not in (None, "", {}):
            bits.append(f"{label} {d[key]}")
    if d.get("pods"):
        bits.append("pods " + ", ".join(f"{k}={v}" for k, v in d["pods"].items()))
    if d.get("detail"):
        bits.append(f"— {d['detail']}")
    return " ".join(bits)


#: `status --wait --timeout N`: the job had not ended when the time ran out (as timeout(1) says).
WAIT_TIMEOUT_EXIT = 124


def _seconds(name: str, value: float | None, positive: bool) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise UserError(f"{name}: {value} is not a valid number of seconds (give a finite number "
                        f"{'greater than 0' if positive else '0 or more'})")


def _remember(rec, state: str) -> None:
    """The job's last known state, kept in its record for `launch jobs` when a scheduler is away."""
    from launcher.backends.jobstate import record

    if rec.extra.get("last_state") != state:
        rec.extra.update(last_state=state, last_seen=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        record(rec)


def _retry_note(exc, delay: float, tries: int) -> None:
    progress(f"warning: {exc}; retry {tries} in {delay:.0f} s")


@click.command()
@click.argument("job")
@click.option("--wait", is_flag=True, help="Poll until the job has ended (or --timeout).")
@click.option("--timeout", type=float, default=None,
              help=f"Seconds to wait at most with --wait; still running then: exit {WAIT_TIMEOUT_EXIT}.")
@click.option("--interval", type=float, default=2.0, show_default=True,
              help="Seconds before the first re-poll with --wait; then doubling up to --max-interval.")
@click.option("--max-interval", type=float, default=60.0, show_default=True, help="Longest gap between polls.")
@click.option("--retry-budget", type=float, default=120.0, show_default=True,
              help="Seconds of consecutive scheduler errors (controller away) tolerated before giving up.")
@json_option
def status(job: str, wait: bool, timeout: float | None, interval: float, max_interval: float, retry_budget: float,
           as_json: bool) -> None:
    """Show a submitted job's state (squeue, else sacct; PyTorchJob conditions and pods).

    With --wait: exit 0 when the job succeeded, 1 when it ended otherwise, 124 when --timeout ran out
    first (the job goes on). Polls back off from --interval to --max-interval; scheduler errors are
    retried for --retry-budget seconds, then exit 2."""
    from launcher.backends import wait as wait_for_job
    from launcher.backends import with_retries

    _seconds("--interval", interval, positive=True)
    _seconds("--max-interval", max_interval, positive=True)
    _seconds("--timeout", timeout, positive=False)
    _seconds("--retry-budget", retry_budget, positive=False)
    rec = _job(job)
    be = _backend(rec.backend)
    last: list[str | None] = [None]
    cap = max(max_interval, interval)

    def show(st) -> None:
        d = _status_dict(rec, st)
        if not as_json and d["state"] != last[0]:
            progress(_status_line(d))
        last[0] = d["state"]

    if wait:
        st = wait_for_job(be, rec, timeout, retry_budget, show, _retry_note, start=interval, cap=cap)
    else:
        st = with_retries(lambda: be.status(rec), retry_budget, _retry_note, start=interval, cap=cap)
    d = _status_dict(rec, st)
    _remember(rec, d["state"])
    timed_out = wait and not d["done"]
    if wait:
        d["timed_out"] = timed_out
    emit(d, as_json, lambda: _status_line(d) + (f" (still {d['state']} after --timeout {timeout:g} s)"
                                                 if timed_out else ""))
    if timed_out:
        raise SystemExit(WAIT_TIMEOUT_EXIT)
    if wait and d["state"] != "SUCCEEDED":
        raise SystemExit(1)


# --- logs -----------------------------------------------------------------------------------
#: torchrun's "[rank0]: " before the trainer's own logging prefix "[rank0] ": shown once.
DOUBLE_PREFIX = re.compile(r"^((?:\d+: )?\[rank(\d+)\]: )\[rank\2\] ")


def one_prefix(line: str) -> str:
    """A log line as a person reads it: one rank prefix, not torchrun's and the trainer's both."""
    return DOUBLE_PREFIX.sub(r"\1", line, count=1)


@click.command()
@click.argument("job")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends.")
@click.option("--rank", type=click.IntRange(min=0), default=None, help="Only this global rank's trainer lines.")
@click.option("--stream", type=click.Choice(["out", "err"]), default="out", show_default=True,
              help="Slurm: the job's stdout or stderr file (elsewhere the one log holds both).")
@click.option("--since", type=click.IntRange(0), default=None, metavar="N",
              help="Skip the first N lines (resume a follower: each --json line carries its number n).")
@json_option
def logs(job: str, follow: bool, rank: int | None, stream: str, since: int | None, as_json: bool) -> None:
    """Show (or follow) a submitted job's logs. With -f --json: one JSON object per line (NDJSON),
    as the lines come."""
    import json

    rec = _job(job)
    be = _backend(rec.backend)
    be.on_retry = _retry_note
    lines = be.log_iter(rec, rank=rank, follow=follow, since=since, stream=stream)
    if as_json and not follow:
        emit({"id": rec.id, "backend": rec.backend, "rank": rank, "lines": list(lines)}, True)
        return
    for n, line in enumerate(lines, start=since or 0):
        if as_json:
            click.echo(json.dumps({"id": rec.id, "backend": rec.backend, "rank": rank, "n": n, "line": line}))
        else:
            click.echo(one_prefix(line))


# --- cancel ---------------------------------------------------------------------------------
@click.command()
@click.argument("job")
@json_option
def cancel(job: str, as_json: bool) -> None:
    """Cancel a submitted job (scancel; delete the PyTorchJob and its ConfigMap). A job that has already
    ended is left alone and said so (exit 0)."""
    rec = _job(job)
    ended = not _backend(rec.backend).cancel(rec)  # False: nothing of the job was left (idempotent)
    emit({"id": rec.id, "backend": rec.backend, "name": rec.name, "cancelled": not ended, "already_ended": ended},
         as_json, lambda: (f"{rec.backend} job {rec.id} ({rec.name}) had already ended; nothing to cancel" if ended
                           else f"cancelled {rec.backend} job {rec.id} ({rec.name})"))


# --- jobs -----------------------------------------------------------------------------------
@click.command()
@json_option
def jobs(as_json: bool) -> None:
    """List the jobs launch4d submitted, with their state now (Slurm: one squeue per login host),
    or the last known one where the scheduler cannot answer."""
    from launcher.backends.jobstate import all_jobs

    recs = all_jobs()
    now: dict[tuple[str, str], Any] = {}
    errors: dict[str, str] = {}
    by_kind: dict[str, list] = {}
    for r in recs:
        by_kind.setdefault(r.backend, []).append(r)
    for kind, handles in by_kind.items():  # one question per backend (Slurm: one squeue per login host)
        try:
            now.update({(kind, k): v for k, v in _backend(kind).statuses(handles).items()})
        except UserError as exc:
            errors[kind] = str(exc)
    rows = []
    for r in recs:
        st = now.get((r.backend, r.id))
        if st is not None:
            d = _status_dict(r, st)
            _remember(r, d["state"])
            row = {**d, "current": True}
        else:
            row = {"id": r.id, "backend": r.backend, "name": r.name, "run_dir": r.run_dir,
                   "state": r.extra.get("last_state", "UNKNOWN"), "last_seen": r.extra.get("last_seen"),
                   "current": False, "detail": errors.get(r.backend, "")}
        row["submitted_at"] = r.submitted_at
        rows.append(row)

    def table() -> str:
        if not rows:
            return "no jobs recorded yet (launch submit records them)"
        lines = [f"{'ID':<12} {'NAME':<24} {'BACKEND':<8} {'STATE':<10} {'SUBMITTED':<25} RUN DIR"]
        for row in rows:
            state = row["state"] if row["current"] else f"{row['state']}?"
            lines.append(f"{row['id']:<12} {row['name']:<24} {row['backend']:<8} {state:<10} "
                         f"{row['submitted_at']:<25} {row['run_dir']}")
        for kind, msg in errors.items():
            lines.append(f"({kind}: {msg}; '?' marks the last known state)")
        return "\n".join(lines)

    emit({"jobs": rows, "errors": errors}, as_json, table)
