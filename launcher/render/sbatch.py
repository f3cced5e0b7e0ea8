"""Slurm: a Plan as an sbatch script (templates/slurm/train.sbatch.j2) and several plans as one job
array; the site's own sbatch options checked one by one, with the job-file field each came from."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from launcher.errors import UserError
from launcher.formats import rundir
from launcher.formats.shell import sbatch_value
from launcher.plan.entrypoint import EntrypointSpec
from launcher.plan.model import Plan
from launcher.plan.spec import JobSpec
from launcher.render import bash_syntax_check, render_template
from launcher.render.env import (
    diagnostics_env,
    entry_command,
    measured_nccl_env,
    plan_env,
    trainer_args,
    trainer_env_prefix,
    user_env,
)
from launcher.render.rendered import Rendered, check_rank_map, gpu_lists

CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
# backend.slurm.extra: one long sbatch option, "--flag" or "--flag=value" (the whole string).
SBATCH_EXTRA = re.compile(r"--([a-z][a-z0-9-]*)(?:=(.*))?", re.S)
# Options the script itself sets (its rank logic, logs and requeue depend on them), with the
# job-file field to use where there is one.
SBATCH_MANAGED = {"job-name": "name", "nodes": "cluster.nodes", "ntasks-per-node": None, "ntasks": None,
                  "output": None, "error": None, "chdir": None, "open-mode": None,
                  "signal": "backend.slurm.checkpoint_signal / signal_seconds", "requeue": "backend.slurm.requeue",
                  "no-requeue": "backend.slurm.requeue", "gpus-per-node": "cluster.gpus_per_node",
                  "array": None, "wrap": None, "parsable": None, "tasks-per-node": None, "workdir": None}
#: sbatch's long options (Slurm's src/common/slurm_opt.c: the common_options with an sbatch setter, Slurm
#: 25.x; "workdir": chdir's name before 17.11). sbatch reads them with getopt_long, which takes any
#: unambiguous prefix ("--arr=0-2" is --array): an option in backend.slurm.extra is matched the same way
#: before it is allowed. A name outside this list (a SPANK plugin's, such as pyxis' --container-image)
#: is passed on as written.
SBATCH_LONG_OPTIONS = frozenset((
    "account", "acctg-freq", "array", "autocomplete", "batch", "bb", "bbf", "begin", "chdir", "cluster",
    "cluster-constraint", "clusters", "comment", "consolidate-segments", "constraint", "container",
    "container-id", "context", "contiguous", "core-spec", "cores-per-socket", "cpu-freq", "cpus-per-gpu",
    "cpus-per-task", "deadline", "delay-boot", "dependency", "distribution", "error", "exclude", "exclusive",
    "export", "export-file", "external", "extra", "extra-node-info", "get-user-env", "gid", "gpu-bind",
    "gpu-freq", "gpus", "gpus-per-node", "gpus-per-socket", "gpus-per-task", "gres", "gres-flags", "help",
    "hint", "hold", "ignore-pbs", "input", "job-name", "kill-on-invalid-dep", "licenses", "mail-type",
    "mail-user", "mcs-label", "mem", "mem-bind", "mem-per-cpu", "mem-per-gpu", "mem-update", "mincpus",
    "network", "nice", "no-kill", "no-requeue", "nodefile", "nodelist", "nodes", "ntasks", "ntasks-per-core",
    "ntasks-per-gpu", "ntasks-per-node", "ntasks-per-socket", "ntasks-per-tres", "oom-kill-step", "open-mode",
    "output", "overcommit", "oversubscribe", "parsable", "partition", "prefer", "priority", "profile",
    "propagate", "qos", "quiet", "reboot", "requeue", "reservation", "resources", "resv-ports", "runtime",
    "segment", "signal", "sockets-per-node", "spread-job", "spread-segments", "stepmgr", "switches",
    "tasks-per-node", "test-only", "thread-spec", "threads-per-core", "time", "time-min", "tmp", "tres-bind",
    "tres-per-task", "uid", "usage", "use-min-nodes", "verbose", "version", "wait", "wait-all-nodes", "wckey",
    "wrap", "workdir"))
SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}")


def _check_sbatch_fields(spec: JobSpec) -> None:
    """Every job-file value bound for an #SBATCH line, checked with its dotted path in the error."""
    s = spec.backend.slurm
    fields: list[tuple[str, Any]] = [("name", spec.name)]
    fields += [(f"backend.slurm.{k}", getattr(s, k)) for k in ("partition", "account", "qos", "time", "mem",
                                                                "dependency", "switches_wait")]
    fields += [(f"backend.slurm.{k}[{i}]", v) for k in ("exclude", "nodelist") for i, v in enumerate(getattr(s, k))]
    for path, value in fields:
        if value is None:
            continue
        try:
            sbatch_value(value)
        except UserError as exc:
            raise UserError(f"{path}: {exc}") from None


def sbatch_candidates(flag: str) -> list[str]:
    """The sbatch options `--flag` may stand for, as getopt_long reads it: itself when it is one, else
    every option it is a prefix of (one: an abbreviation; several: ambiguous; none: not sbatch's own)."""
    if flag in SBATCH_LONG_OPTIONS:
        return [flag]
    return sorted(o for o in SBATCH_LONG_OPTIONS if o.startswith(flag))


def _check_extra_flag(flag: str, path: str) -> None:
    """Refuse an option launch4d sets itself, however it is abbreviated, and an ambiguous abbreviation."""
    cands = sbatch_candidates(flag)
    managed = [c for c in cands if c in SBATCH_MANAGED]
    if managed:
        full, hint = managed[0], SBATCH_MANAGED[managed[0]]
        what = (f"--{flag}" if flag == full else f"--{flag} (sbatch reads it as --{full})" if len(cands) == 1
                else f"--{flag} (an abbreviation sbatch may read as --{full})")
        raise UserError(f"{path}: {what} is set by launch4d itself" + (f"; use {hint}" if hint else ""))
    if len(cands) > 1:
        shown = ", ".join(f"--{c}" for c in cands[:6]) + (" ..." if len(cands) > 6 else "")
        raise UserError(f"{path}: --{flag} is ambiguous to sbatch ({shown}); write the option in full")


def site_options(spec: JobSpec) -> list[tuple[str, str | None, str]]:
    """The site's own sbatch options, in order: (flag, value or None, job-file path). First-class
    fields, then backend.slurm.extra, each checked to be one well-formed long option."""
    s = spec.backend.slurm
    out: list[tuple[str, str | None, str]] = []
    for fld, flag in (("reservation", "--reservation"), ("constraint", "--constraint"), ("gres", "--gres"),
                      ("mail_user", "--mail-user"), ("mail_type", "--mail-type"), ("comment", "--comment"),
                      ("segment", "--segment")):
        value = getattr(s, fld)
        if value is not None:
            out.append((flag, str(value), f"backend.slurm.{fld}"))
    for i, opt in enumerate(s.extra):
        path = f"backend.slurm.extra[{i}]"
        m = SBATCH_EXTRA.fullmatch(opt)
        if not m or CONTROL_CHARS.search(opt):
            raise UserError(f"{path}: {opt!r} is not one sbatch option; write it as \"--flag=value\" or "
                            "\"--flag\" (long form, no newlines or control characters)")
        flag = m.group(1)
        _check_extra_flag(flag, path)
        out.append((f"--{flag}", m.group(2), path))
    for _, value, path in out:
        if value is not None and CONTROL_CHARS.search(value):
            raise UserError(f"{path}: {value!r} holds a newline or control character")
    return out


def node_check(spec: JobSpec, plan: Plan) -> dict[str, Any]:
    """backend.slurm.node_check with its automatic parts resolved: GPU and Xid checks where the
    plan runs on GPUs, the NIC check where the plan names NICs."""
    c = spec.backend.slurm.node_check
    has_gpus = plan.gpu.name != "cpu"
    gpus = has_gpus if c.gpus is None else c.gpus
    out = {"gpus": gpus, "xid": gpus if c.xid is None else c.xid, "nics": c.nics and bool(plan_nics(plan)),
           "command": c.command, "timeout_s": c.timeout_s}
    out["enabled"] = c.enabled and any(out[k] for k in ("gpus", "xid", "nics", "command"))
    return out


def plan_nics(plan: Plan) -> list[str]:
    return sorted({r.nic for r in plan.ranks if r.nic})


def slurm_context(spec: JobSpec, plan: Plan, run_dir: str, exclude: list[str] | None = None,
                  measured_env: dict[str, str] | None = None, node_order: list[str] | None = None
                  ) -> dict[str, Any]:
    check_rank_map(plan)
    s = spec.backend.slurm
    _check_sbatch_fields(spec)
    if s.switches_wait is not None:
        if not s.switches:
            raise UserError("backend.slurm.switches_wait: set backend.slurm.switches too (--switches=N@wait)")
        if not SLURM_TIME.fullmatch(s.switches_wait):
            raise UserError(f"backend.slurm.switches_wait: {s.switches_wait!r} is not a Slurm time "
                            "(minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)")
    runtime = s.container_runtime if s.container_image else "none"
    if s.container_runtime == "apptainer" and not s.container_image:
        raise UserError("backend.slurm.container_runtime is apptainer: set backend.slurm.container_image "
                        "(a .sif file or docker://...)")
    excluded = sorted(set(s.exclude) | set(exclude or []))
    # Only the job author's explicit nodelist pins nodes; a plan's hosts (from a BandwidthMap) order
    # the ranks at start instead, so a requeue never waits for a node that just failed.
    nodelist = list(s.nodelist)
    clash = sorted(set(nodelist) & set(excluded))
    if clash:
        raise UserError(f"backend.slurm.nodelist: {', '.join(clash)} also excluded (preflight or backend.slurm.exclude)")
    order = [h for h in (node_order or plan.hosts or []) if h not in excluded]
    plan_path = f"{run_dir}/{rundir.PLAN}"
    args = trainer_args(spec, plan_path, run_dir)
    return {
        "name": spec.name,
        "source_name": Path(spec.source).name if spec.source else spec.name,
        "nodes": plan.nodes,
        "nproc": plan.gpus_per_node,
        # a CPU job (gpu: cpu) asks Slurm for no GPUs; backend.slurm.gres_gpus: false leaves them out on GPU nodes too
        "gpus_per_node": plan.gpus_per_node if s.gres_gpus and plan.gpu.name != "cpu" else None,
        "s": s,
        "sig": s.checkpoint_signal,
        "site_options": [(flag, value) for flag, value, _ in site_options(spec)],
        "exclude": excluded,
        "nodelist": nodelist,
        "node_order": order,
        "check": node_check(spec, plan),
        "check_nics": plan_nics(plan),
        "runtime": runtime,
        "binds": [run_dir, *s.container_mounts],
        "gpu_lists": gpu_lists(plan),
        "run_dir": run_dir,
        "node_dirs": (rundir.NCCL_LOGS, rundir.FLIGHT, rundir.HEARTBEAT),  # made on every node before torchrun
        "plan_path": plan_path,
        "trainer_args": args,
        "entry": entry_command(own_code_entry(spec, plan), args),
        "plan_env": [(k, v) for k, v in plan_env(plan, plan_path, run_dir)
                     if k not in ("LAUNCH4D_PLAN", "LAUNCH4D_RUN_DIR")],       # exported above them already
        "python": s.python,
        "master_port": s.master_port,
        "grace_seconds": max(s.signal_seconds - 10, 5),
        "diag_env": diagnostics_env(spec, run_dir, {**measured_nccl_env(plan), **(measured_env or {})}),
        "user_env": user_env(spec),
        "trainer_env": trainer_env_prefix(spec),
    }


def own_code_entry(spec: JobSpec, plan: Plan) -> EntrypointSpec | None:
    """train.entrypoint as the nodes see it. A relative script is taken from the directory `launch` runs
    in (on the cluster's shared filesystem, like sbatch's submit directory): the batch script itself runs
    in the run dir. Submitted over SSH the job starts on another machine, where a relative path means
    nothing: refused."""
    import dataclasses

    entry = plan.train.entrypoint
    if entry is None or entry.script is None or Path(entry.script).is_absolute():
        return entry
    if spec.backend.slurm.login_host:
        raise UserError(f"train.entrypoint.script: {entry.script!r} is relative, but the job is submitted over SSH "
                        f"(backend.slurm.login_host {spec.backend.slurm.login_host}); give its absolute path on "
                        "the cluster")
    return dataclasses.replace(entry, script=str(Path(entry.script).resolve()))


def render_slurm(spec: JobSpec, plan: Plan, run_dir: str, templates: str | Path | None = None,
                 exclude: list[str] | None = None, measured_env: dict[str, str] | None = None,
                 node_order: list[str] | None = None, preflight_plan: float | None = None) -> Rendered:
    """`node_order`: the BandwidthMap's host order (default: the plan's hosts); the batch script
    ranks the nodes it is given in this order. `preflight_plan`: a tolerance, to measure the plan's
    communication groups on the allocated nodes before the trainer (`launch submit --preflight-plan`)."""
    ctx = slurm_context(spec, plan, run_dir, exclude, measured_env, node_order)
    probe_files: dict[str, str] = {}
    ctx["probe"] = None
    if preflight_plan is not None:
        from launcher.render.groupprobe import probe_files as files_for

        ctx["probe"], probe_files = files_for(plan, preflight_plan, spec.diagnostics.init_timeout_s)
    script = render_template("slurm/train.sbatch.j2", ctx, templates)
    bash_syntax_check(script)
    return Rendered("slurm", run_dir, "train.sbatch",
                    {"train.sbatch": script, rundir.PLAN: plan.to_json() + "\n", **probe_files})


def render_slurm_array(spec: JobSpec, plans: list[Plan], base: str, task_dirs: list[str],
                       templates: str | Path | None = None, exclude: list[str] | None = None,
                       node_order: list[str] | None = None) -> tuple[str, list[Rendered]]:
    """One `--array` job of several plans of the same job (`launch plan --benchmark`): each task's
    own batch script and plan.json in its run dir, and the array script that runs task i's. The
    tasks must ask Slurm for the same resources (the array has one set of #SBATCH options)."""
    tasks = [render_slurm(spec, plan, d, templates, exclude, None, node_order) for plan, d in zip(plans, task_dirs)]
    keep = ("--chdir=", "--output=", "--error=")

    def directives(script: str) -> list[str]:
        return [ln for ln in script.splitlines() if ln.startswith("#SBATCH ") and not ln[8:].startswith(keep)]

    first = directives(tasks[0].files["train.sbatch"])
    for i, t in enumerate(tasks[1:], 1):
        if directives(t.files["train.sbatch"]) != first:
            raise UserError(f"plan {i} of the array asks Slurm for other resources than plan 0 "
                            "(nodes, GPUs per node); an array needs one shape")
    script = render_template("slurm/array.sbatch.j2", {"name": spec.name, "directives": first, "base": base,
                                                       "scripts": [f"{d}/train.sbatch" for d in task_dirs]},
                             templates)
    bash_syntax_check(script, "sbatch array script")
    return script, tasks
