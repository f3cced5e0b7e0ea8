"""`launch run JOB.yaml`: plan the job and run it on this machine under torchrun, following it.

The embedded default of the project: the same job file that goes to Slurm or Kubernetes runs here
(CPU/gloo without a GPU). Rank 0's lines stream to the terminal; everything is in
<run_dir>/logs/node0.log. Ctrl-C (or SIGTERM) asks the trainer to checkpoint and stop; a second one
kills it. The exit status is the job's: 0 done, 75 preempted (resume with --resume auto), else failed.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from launcher.commands import emit, json_option, progress, warn
from launcher.commands.follow import follow
from launcher.commands.local_job import check_devices, check_host_memory, start_job
from launcher.commands.options import dry_run_option, plan_option
from launcher.errors import UserError
from launcher.formats.rundir import read_metrics
from launcher.plan.entrypoint import NOT_VERIFIED


def checkpoint_source(path: str) -> Path:
    """--resume PATH: a run dir, its checkpoints/ dir, or one complete step-N dir (what the trainer takes)."""
    from launcher.formats.rundir import latest_checkpoint, resume_target

    p = Path(path).resolve()
    target = resume_target(p)
    if target is None or (target[1] is None and latest_checkpoint(target[0]) is None):
        raise UserError(f"--resume: {path} holds no complete checkpoint (give auto, never, a run dir, "
                        "its checkpoints/ dir or a checkpoints/step-N dir)")
    return p


@click.command("run")
@click.argument("job", type=click.Path(dir_okay=False))
@plan_option("run", "JOB", " JOB itself may be a plan.json.")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Run directory (default <log_dir>/<name>-<time>).")
@click.option("--nproc", type=int, help="Processes on this machine (overrides cluster.gpus_per_node).")
@click.option("--cpu", is_flag=True, help="Run a GPU plan here on CPU processes (gloo), where it has no GPUs.")
@click.option("--resume", default="never", show_default=True, metavar="auto|never|PATH",
              help="auto: continue from the run dir's latest complete checkpoint; PATH: start from another "
                   "run's checkpoint (a run dir or checkpoints/step-N; the layout may differ, DCP reshards).")
@dry_run_option("Print the plan and the command; start nothing, write nothing.")
@json_option
def run(job: str, plan_path: str | None, run_dir: str | None, nproc: int | None, cpu: bool, resume: str,
        dry_run: bool, as_json: bool) -> int:
    """Plan JOB (a job file; or run a plan.json as it is) and run it here with torchrun; exit with the
    job's status."""
    from launcher.backends import get_backend
    from launcher.commands.sources import load_launch

    if resume not in ("auto", "never"):
        resume = str(checkpoint_source(resume))
    launch = load_launch(job, plan_path, None, nproc, local=True)
    spec, plan, text = launch.spec, launch.plan, launch.text
    if spec.cluster.nodes != 1:
        raise UserError(f"cluster.nodes: `launch run` uses this machine only, but the job asks for "
                        f"{spec.cluster.nodes} nodes; use `launch submit` (slurm or k8s), or set cluster.nodes: 1")
    if launch.from_plan:
        progress(f"launch: the plan in {launch.from_plan}, as it is (tp={plan.tp} cp={plan.cp} pp={plan.pp} "
                 f"dp={plan.dp}, zero {plan.zero_stage}); not re-planned")
    entry = plan.train.entrypoint
    if entry is not None and entry.script is not None and not Path(entry.script).is_file():
        raise UserError(f"train.entrypoint.script: {entry.script}: no such file")
    if spec.train.data != "synthetic":  # a bad token file fails here, before anything is written
        from launcher.formats.tokens import check_token_file

        check_token_file(spec.train.data, spec.model.vocab, spec.train.seq_len)
    from launcher.backends import default_run_dir

    rd = Path(run_dir) if run_dir else default_run_dir(spec)
    backend = get_backend("local")  # `launch run` is this machine by definition
    if dry_run:
        req = backend.dryrun(spec, plan, rd, resume=resume, job_text=text)
        emit({"run_dir": req.run_dir, "plan": plan.to_dict(), "command": req.command, "request": req.to_dict()},
             as_json, lambda: _dry_run_yaml(plan, req))
        return 0
    from launcher.backends.jobstate import check_state

    device = check_devices(plan, as_json, cpu)
    if entry is None:  # the ledger is the bundled trainer's: own code's memory is its own
        check_host_memory(plan, device)
    check_state()  # a broken state file is found before anything starts
    handle = start_job(backend, spec, plan, rd, resume, text, cpu=device == "cpu" and plan.gpu.name != "cpu")
    progress(f"launch: {spec.name}: {plan.world_size} processes on {device} "
             f"(tp={plan.tp} cp={plan.cp} pp={plan.pp} dp={plan.dp}, zero {plan.zero_stage}, "
             f"micro_batch {plan.micro_batch} × grad_accum {plan.grad_accum}); run dir {handle.run_dir}"
             + (f"; running your own code: {entry.label} (the plan in LAUNCH4D_*; memory {NOT_VERIFIED})"
                if entry is not None else ""))
    t0 = time.time()
    quiet_s = float(spec.diagnostics.stall_dump_s or max(30.0, min(120.0, spec.diagnostics.collective_timeout_s / 2)))
    tails = follow(backend, handle, as_json, quiet_s, startup_s=spec.diagnostics.init_timeout_s / 2)
    status = backend.wait(handle)
    left = backend.sweep(handle)
    if left:
        warn(f"launch: {len(left)} process(es) of the job outlived torchrun; killed them "
                 f"(pid {', '.join(map(str, left))})")
    steps = read_metrics(handle.run_dir)
    code = status.exit_code if status.exit_code is not None else 1
    payload = {"run_dir": handle.run_dir, "exit_code": code, "state": status.state, "job_id": handle.id,
               "steps": steps[-1]["step"] if steps else 0, "final_loss": steps[-1]["loss"] if steps else None}
    if code != 0:
        _explain(handle, status, tails)
    progress(f"launch: {status.state} (exit {code}) after {time.time() - t0:.1f} s"
             + (f", {payload['steps']} steps" if steps or entry is None else "")
             + (f", final loss {payload['final_loss']:.4f}" if steps else "")
             + (f"; {status.detail}" if status.detail else ""))
    if as_json:
        emit(payload, True)
    return code


def _dry_run_yaml(plan, req) -> str:
    """What --dry-run shows a person: the layout, the run dir and the command, as YAML."""
    import dataclasses

    import yaml

    return yaml.safe_dump({"layout": dataclasses.asdict(plan.layout), "world_size": plan.world_size,
                           "run_dir": req.run_dir, "env": dict(sorted(req.env.items())),
                           "argv": list(req.extra["argv"])}, sort_keys=False, width=1 << 16).rstrip()


def _explain(handle, status, tails) -> None:
    """On failure, the last lines of the rank that failed first (torchrun's root cause)."""
    from launcher.backends.local import ROOT_CAUSE_RANK

    try:
        text = Path(handle.log_path).read_text(errors="replace")
    except OSError:
        text = ""
    m = ROOT_CAUSE_RANK.findall(text)
    rank = int(m[-1]) if m else None
    if rank is not None and rank != 0 and tails.get(rank):
        warn(f"launch: last lines of rank {rank} (first to fail):")
        for line in tails[rank]:
            warn(f"  {line}")
    warn(f"launch: full log: {handle.log_path}")
