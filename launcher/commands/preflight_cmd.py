"""`launch preflight`: measure nodes and links, judge them, write the BandwidthMap.

    launch preflight --hosts node[01-16] -o bwmap.json     # SSH fan-out (default with --hosts)
    launch preflight --slurm-allocation                    # srun steps inside salloc/sbatch
    launch preflight --backend slurm --hosts node[01-16]   # one batch job; then `preflight import`
    launch preflight parse topo topo.txt --json            # what a parser makes of one output
    launch preflight import DIR -o bwmap.json              # outputs gathered by other means

Exit status: 0 when nothing failed (warnings allowed), 1 when a check failed, 2 for bad input.
Progress (per phase and host) goes to stderr; stdout carries the report or JSON only.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from launcher.commands import emit, json_option, progress, warn
from launcher.errors import UserError

BACKENDS = ["ssh", "local", "srun", "slurm", "k8s"]
JOB_TIME = {"quick": "00:30:00", "standard": "02:00:00", "long": "04:00:00"}  # the batch job's default --time
SCHEDULERS = ["slurm", "k8s"]


def _judge_config(thresholds: str | None, expected_gpus: int | None, min_intra: float | None,
                  min_inter: float | None) -> Any:
    from checks.judges.config import JudgeConfig, JudgeConfigError

    try:
        cfg = JudgeConfig.load(thresholds) if thresholds else JudgeConfig()
    except JudgeConfigError as exc:
        raise UserError(f"--thresholds {exc}") from None
    if expected_gpus is not None:
        cfg.expected_gpus = expected_gpus
    if min_intra is not None:
        cfg.min_intra_busbw_gbs = min_intra
    if min_inter is not None:
        cfg.min_inter_busbw_gbs = min_inter
    return cfg


def _drain(bw: Any, scheduler: str, do_apply: bool, as_json: bool, payload: dict[str, Any] | None = None) -> int:
    """Print (or with --apply run) the commands that take the failed nodes out of service."""
    from checks.drain import apply, plan_drain

    actions = plan_drain(bw, scheduler)
    out = payload if payload is not None else {}
    out["drain"] = {"scheduler": scheduler, "applied": do_apply,
                    "nodes": [{"node": a.node, "reason": a.reason, "commands": a.lines} for a in actions]}
    rc = 0
    lines = [ln for a in actions for ln in a.lines] or ["# no node failed: nothing to drain"]
    if do_apply:
        done = apply(actions)
        out["drain"]["results"] = [vars(d) for d in done]
        lines = [f"{d.command}  # " + ("ok" if d.rc == 0 else f"FAILED ({d.rc}): {d.output}") for d in done] or lines
        rc = 1 if any(d.rc != 0 for d in done) else 0
    if as_json:
        click.echo(json.dumps(out, indent=2, default=str))
    else:
        click.echo("\n".join(lines))
    return rc


def _drain_for(drain: bool, scheduler: str | None, do_apply: bool, default: str) -> str | None:
    """The scheduler to drain for, None without --drain; --apply/--scheduler alone are refused."""
    if not drain:
        if do_apply or scheduler:
            raise UserError("--apply and --scheduler go with --drain")
        return None
    return scheduler or default


def _finish(bw: Any, output: str | None, as_json: bool, exclude_failed: bool,
            drain: str | None = None, do_apply: bool = False) -> int:
    """Write the map, print the report (or the exclude list), and drain what failed when asked."""
    from checks.assemble import failed_checks
    from checks.hosts import compress
    from checks.report import render

    if output:
        try:
            bw.save(output)
        except OSError as exc:
            raise UserError(f"-o {output}: cannot write ({exc.strerror})") from None
        progress(f"bandwidth map written to {output}")
    if exclude_failed:
        # for `sbatch --exclude=$(launch preflight ... --exclude-failed)`: the list only, exit 0
        click.echo(compress(bw.exclude) if bw.exclude else "")
        return 0 if bw.healthy_hosts else 1
    rc = 1 if failed_checks(bw) else 0
    if drain:
        if not as_json:
            click.echo(render(bw))
        payload = bw.to_dict() if as_json else None
        return max(rc, _drain(bw, drain, do_apply, as_json, payload))
    emit(bw.to_dict(), as_json, lambda: render(bw))
    return rc


def threshold_options(f: Any) -> Any:
    for opt in reversed([
        click.option("--thresholds", type=click.Path(dir_okay=False),
                     help="YAML/JSON with per-GPU-model thresholds and judge settings."),
        click.option("--expected-gpus", type=click.IntRange(1), help="GPUs every node must have (default: "
                                                                     "the count most nodes have)."),
        click.option("--min-intra-busbw", type=click.FloatRange(0), help="Intra-node all_reduce busbw floor, GB/s."),
        click.option("--min-inter-busbw", type=click.FloatRange(0), help="Node-pair all_reduce busbw floor, GB/s."),
        click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the BandwidthMap JSON here."),
        click.option("--exclude-failed", is_flag=True, help="Print only the nodes to exclude (hostlist), exit 0."),
        click.option("--drain", is_flag=True, help="Also print the commands that take each failed node out of "
                     "service: Slurm `scontrol update ... state=drain reason=...`, or Kubernetes label and taint."),
        click.option("--scheduler", type=click.Choice(SCHEDULERS), help="With --drain: whose commands (default: "
                     "k8s with --backend k8s, else slurm)."),
        click.option("--apply", "do_apply", is_flag=True, help="With --drain: run those commands."),
    ]):
        f = opt(f)
    return f


@click.group(invoke_without_command=True)
@click.option("--hosts", "hosts_expr", help="Hosts as a list or Slurm hostlist: node[01-16,20].")
@click.option("--hostfile", type=click.Path(dir_okay=False), help="File with one host per line.")
@click.option("--slurm-allocation", is_flag=True, help="The nodes of the current Slurm allocation.")
@click.option("--backend", type=click.Choice(BACKENDS), help="How to reach the hosts (default: ssh with "
              "hosts, srun with --slurm-allocation, else local).")
@click.option("--user", help="SSH user.")
@click.option("--port", type=click.IntRange(1, 65535), help="SSH port.")
@click.option("--identity-file", "-i", type=click.Path(dir_okay=False), help="SSH private key.")
@click.option("--known-hosts", type=click.Path(dir_okay=False), help="known_hosts file (default ~/.ssh/known_hosts).")
@click.option("--accept-new-hosts", is_flag=True, help="Trust and record host keys seen for the first time.")
@click.option("--jump", help="Jump host (login node): [user@]host[:port].")
@click.option("--ssh-config", type=click.Path(dir_okay=False), help="OpenSSH config for host aliases.")
@click.option("--connect-timeout", type=click.FloatRange(0.1), default=10.0, show_default=True)
@click.option("--probe-timeout", type=click.FloatRange(1), default=60.0, show_default=True,
              help="Seconds per probe command.")
@click.option("--nccl-timeout", type=click.FloatRange(1), default=900.0, show_default=True,
              help="Seconds per nccl-tests run.")
@click.option("--workers", type=click.IntRange(1), default=64, show_default=True, help="Hosts handled at once.")
@click.option("--level", type=click.Choice(["quick", "standard", "long"]), default="quick", show_default=True,
              help="quick: probes + nccl-tests; standard: + dcgmi diag -r 2, nvbandwidth, nvlink -e around NCCL; "
                   "long: + dcgmi diag -r 3, all_to_all_perf, per-NIC ib_write_bw --use_cuda between pairs.")
@click.option("--tool-timeout", "tool_timeouts", multiple=True, metavar="TOOL=SECONDS",
              help="Timeout of one deeper tool (repeatable): dcgmi (default 900 at standard, 3600 at long), "
                   "nvbandwidth (900), nvlink (60), ib_write_bw (120), all_to_all_perf (--nccl-timeout). "
                   "A tool that runs past it is reported for its node, not waited for.")
@click.option("--no-nccl", is_flag=True, help="Only the node probes, no nccl-tests.")
@click.option("--no-pairs", is_flag=True, help="Skip the node-pair rounds.")
@click.option("--no-all", is_flag=True, help="Skip the all-node run.")
@click.option("--nccl-binary", default="all_reduce_perf", show_default=True)
@click.option("--sizes", default="512M,8G", show_default=True, help="nccl-tests -b,-e.")
@click.option("--nccl-args", default="", help="Extra nccl-tests arguments.")
@click.option("--launcher", "launcher_tpl", help="Multi-node launch template, e.g. 'mpirun -np {np} -H "
              "{hosts_slots} {cmd}' or 'srun --mpi=pmix -N {nnodes} -w {hostlist} ... {cmd}'.")
@click.option("--save-raw", type=click.Path(file_okay=False), help="Also keep every raw output here, in the "
              "`preflight import` layout (judge it again later with other thresholds).")
@click.option("--out-dir", type=click.Path(file_okay=False), help="slurm backend: where the job writes outputs.")
@click.option("--partition", help="slurm backend: partition.")
@click.option("--account", help="slurm backend: account.")
@click.option("--time", "time_limit", help="slurm backend: time limit (default: 00:30:00 quick, 02:00:00 "
              "standard, 04:00:00 long: dcgmi diag -r 3 alone can take an hour).")
@click.option("--gpus-per-node", type=click.IntRange(1), help="slurm/k8s backends: GPUs per node.")
@click.option("--mpi", "srun_mpi", default="pmix", show_default=True, help="slurm backend: srun --mpi plugin.")
@click.option("--dry-run", is_flag=True, help="Print what would run where (script, pod, batch job); "
              "connect to nothing, create nothing.")
@click.option("--namespace", default="default", show_default=True, help="k8s backend: namespace.")
@click.option("--image", default="nvcr.io/nvidia/pytorch:24.05-py3", show_default=True,
              help="k8s backend: image with nvidia-smi and nccl-tests.")
@click.option("--kube-context", help="k8s backend: kubeconfig context.")
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False),
              help="Measure this plan.json's own communication groups instead (TP, CP, PP neighbours, DP/ZeRO, EP: "
                   "each group's collective at the plan's message size) and compare them with what its time model "
                   "assumed; --backend local (default), ssh (--hosts: node i is host i), slurm (a batch job; waits) or "
                   "k8s (a one-off gang of pods; waits).")
@click.option("--tolerance", type=click.FloatRange(0, 1, max_open=True), default=0.3, show_default=True,
              help="With --plan: a group measuring below (1 - tolerance) x the assumed bandwidth fails (exit 1).")
@click.option("--iters", type=click.IntRange(1, 1000), default=5, show_default=True,
              help="With --plan: timed calls per group (the median counts), after 2 untimed ones.")
@click.option("--python", "node_python", default=None,
              help="With --plan --backend ssh|k8s: the Python on the nodes (in the image) that has launch4d[train] "
                   "(default: python3 over SSH, python in a pod).")
@click.option("--master-addr", help="With --plan --backend ssh: the address the nodes reach the first host at "
                                    "(default: the first host's name).")
@click.option("--master-port", type=click.IntRange(1024, 65535), default=29511, show_default=True,
              help="With --plan --backend ssh|k8s: the probe's rendezvous port on the first node.")
@threshold_options
@json_option
@click.pass_context
def preflight(ctx: click.Context, hosts_expr: str | None, hostfile: str | None, slurm_allocation: bool,
              backend: str | None, user: str | None, port: int | None, identity_file: str | None,
              known_hosts: str | None, accept_new_hosts: bool, jump: str | None, ssh_config: str | None,
              connect_timeout: float, probe_timeout: float, nccl_timeout: float, workers: int, level: str,
              tool_timeouts: tuple[str, ...], no_nccl: bool,
              no_pairs: bool, no_all: bool, nccl_binary: str, sizes: str, nccl_args: str, launcher_tpl: str | None,
              save_raw: str | None, out_dir: str | None, partition: str | None, account: str | None,
              time_limit: str | None,
              gpus_per_node: int | None, srun_mpi: str, dry_run: bool, namespace: str, image: str, kube_context: str | None,
              thresholds: str | None, expected_gpus: int | None, min_intra_busbw: float | None,
              min_inter_busbw: float | None, output: str | None, exclude_failed: bool, drain: bool,
              scheduler: str | None, do_apply: bool, as_json: bool, plan_file: str | None = None,
              tolerance: float = 0.3, iters: int = 5, node_python: str | None = None, master_addr: str | None = None,
              master_port: int = 29511) -> int | None:
    """Measure nodes and links (nvidia-smi topo, health, nccl-tests); write a bandwidth map. With --plan:
    measure the plan's own communication groups against what it assumed."""
    if ctx.invoked_subcommand is not None:
        return None
    if plan_file:
        return _plan_preflight(plan_file, hosts_expr, hostfile, backend, tolerance, iters, nccl_timeout, output,
                               as_json, dict(user=user, port=port, identity_file=identity_file,
                                             known_hosts=known_hosts, accept_new_hosts=accept_new_hosts, jump=jump,
                                             ssh_config=ssh_config, connect_timeout=connect_timeout,
                                             master_port=master_port, python=node_python or "python3",
                                             master_addr=master_addr),
                               dict(out_dir=out_dir, partition=partition, account=account, time=time_limit),
                               dict(namespace=_given(ctx, "namespace", namespace), image=_given(ctx, "image", image),
                                    context=kube_context, gpus=gpus_per_node, python=node_python or "python",
                                    master_port=master_port, dry_run=dry_run))
    from checks.hosts import HostsError, expand, from_allocation, from_file
    from checks.orchestrate import PreflightOptions, run_preflight
    from checks.pairing import NcclOptions

    given = [x for x in (hosts_expr, hostfile, slurm_allocation or None) if x]
    if len(given) > 1:
        raise UserError("give one of --hosts, --hostfile, --slurm-allocation")
    try:
        if hosts_expr:
            hosts = expand(hosts_expr)
        elif hostfile:
            hosts = from_file(hostfile)
        elif slurm_allocation:
            hosts = from_allocation()
        else:
            import os
            import socket
            # in a Slurm prolog the node is known by its Slurm name, which --drain must use
            hosts = [os.environ.get("SLURMD_NODENAME") or socket.gethostname()]
    except HostsError as exc:
        raise UserError(str(exc)) from None
    backend = backend or ("srun" if slurm_allocation else "ssh" if (hosts_expr or hostfile) else "local")
    drain_to = _drain_for(drain, scheduler, do_apply, "k8s" if backend == "k8s" else "slurm")
    lo_hi = [s.strip() for s in sizes.split(",")]
    if len(lo_hi) != 2 or not all(lo_hi):
        raise UserError(f"--sizes {sizes!r}: expected MIN,MAX such as 512M,8G")
    nccl = NcclOptions(enabled=not no_nccl, binary=nccl_binary, sizes=(lo_hi[0], lo_hi[1]), extra=nccl_args,
                       launcher=launcher_tpl, pairs=not no_pairs, all_nodes=not no_all)
    if launcher_tpl:
        try:
            launcher_tpl.format(np=1, hosts_slots="a:1", hostlist="a", nnodes=1, gpus=1, cmd="x")
        except (KeyError, IndexError, ValueError) as exc:
            raise UserError(f"--launcher: unknown placeholder {exc}; valid: {{np}} {{hosts_slots}} {{hostlist}} "
                            "{nnodes} {gpus} {cmd}") from None
    cfg = _judge_config(thresholds, expected_gpus, min_intra_busbw, min_inter_busbw)
    from checks.levels import parse_tool_timeouts

    try:
        timeouts = parse_tool_timeouts(tool_timeouts)
    except ValueError as exc:
        raise UserError(f"--tool-timeout {exc}") from None

    if backend == "slurm":
        return _slurm_job(hosts, nccl, out_dir, partition, account, time_limit or JOB_TIME[level], gpus_per_node,
                          srun_mpi, probe_timeout, nccl_timeout, dry_run, as_json, level,
                          [f"{k}={v:g}" for k, v in timeouts.items()])
    if dry_run:  # no connection, no pod, no process: what would run where
        return _dry_run(backend, hosts, probe_timeout, level, nccl, as_json, user=user, port=port, jump=jump,
                        namespace=namespace, image=image, gpus=gpus_per_node, context=kube_context)
    from checks.runners import get_runner

    if backend == "ssh":
        kwargs: dict[str, Any] = dict(user=user, port=port, identity_file=identity_file, known_hosts=known_hosts,
                                      accept_new_hosts=accept_new_hosts, jump=jump, ssh_config=ssh_config,
                                      connect_timeout=connect_timeout)
    elif backend == "k8s":
        from launcher.render import render_template

        kwargs = dict(kube=_k8s_backend(kube_context), render=render_template, namespace=namespace, image=image,
                      gpus=gpus_per_node, on_submit=_record_pod)
    else:
        kwargs = {}
    try:
        runner = get_runner(backend, **kwargs)
    except Exception as exc:  # noqa: BLE001 - e.g. no kubeconfig: one line, exit 2
        raise UserError(f"--backend {backend}: {type(exc).__name__}: {exc}") from None
    opts = PreflightOptions(probe_timeout=probe_timeout, nccl_timeout=nccl_timeout, workers=workers, nccl=nccl,
                            judge=cfg, level=level, tool_timeouts=timeouts)
    from checks.assemble import assemble
    from checks.folder import save_dir

    with runner:
        results = run_preflight(runner, hosts, opts, progress=progress)
    if save_raw:
        try:
            progress(f"raw outputs saved in {save_dir(results, save_raw)}")
        except OSError as exc:
            raise UserError(f"--save-raw {save_raw}: cannot write ({exc.strerror})") from None
    bw = assemble(results, cfg)
    return _finish(bw, output, as_json, exclude_failed, drain_to, do_apply)


def _given(ctx: click.Context, name: str, value: Any) -> Any:
    """The option's value when the user gave it, else None (with --plan, the plan's own setting wins
    over the node checks' default)."""
    from click.core import ParameterSource

    return None if ctx.get_parameter_source(name) == ParameterSource.DEFAULT else value


def _plan_preflight(plan_file: str, hosts_expr: str | None, hostfile: str | None, backend: str | None,
                    tolerance: float, iters: int, timeout_s: float, output: str | None, as_json: bool,
                    ssh: dict[str, Any], slurm: dict[str, Any], k8s: dict[str, Any]) -> int:
    """`preflight --plan` (launcher/commands/preflight_plan.py)."""
    from checks.hosts import HostsError, expand, from_file
    from launcher.commands import preflight_plan

    try:
        hosts = expand(hosts_expr) if hosts_expr else from_file(hostfile) if hostfile else None
    except HostsError as exc:
        raise UserError(str(exc)) from None
    return preflight_plan.run(plan_file, backend, hosts, tolerance, iters, timeout_s, output, as_json,
                              ssh=ssh, slurm=slurm, k8s=k8s)


def _k8s_backend(context: str | None) -> Any:
    """The Kubernetes backend preflight's pods are submitted through (credentials checked now)."""
    from launcher.backends import get_backend
    from launcher.backends.jobstate import check_state

    be = get_backend("k8s", context=context)
    try:
        be.check_access()
    except UserError as exc:
        raise UserError(f"--backend k8s: {exc}") from None
    check_state()
    return be


def _record_pod(handle: Any) -> None:
    """Record a preflight pod like a training job, so `launch status|logs|cancel <pod>` follow it."""
    from launcher.backends.jobstate import record

    try:
        record(handle)
    except UserError as exc:
        warn(f"warning: pod {handle.id} was submitted but not recorded ({exc})")


def _dry_run(backend: str, hosts: list[str], probe_timeout: float, level: str, nccl: Any, as_json: bool,
             **how: Any) -> int:
    """`preflight --dry-run` on the ssh, srun, local and k8s paths: each host's node-probe script and
    how it would reach the host (for k8s, the pod manifest), built without connecting, loading a
    kubeconfig, or creating anything."""
    import shlex

    from checks.probe import PROBES
    from checks.runners.base import probe_script

    script, _ = probe_script(PROBES, probe_timeout)
    steps: list[dict[str, Any]] = []
    for i, host in enumerate(hosts, 1):
        step: dict[str, Any] = {"host": host, "command": script}
        if backend == "ssh":
            step["via"] = (f"ssh {how['user'] + '@' if how['user'] else ''}{host}"
                           f"{':' + str(how['port']) if how['port'] else ''}"
                           f"{' via ' + how['jump'] if how['jump'] else ''}")
        elif backend == "srun":
            step["via"] = f"srun --nodes=1 --ntasks=1 --nodelist={shlex.quote(host)} --overlap bash -c SCRIPT"
        elif backend == "k8s":
            from checks.runners.k8s import render_pod
            from launcher.render import render_template

            try:
                step["pod"] = render_pod(render_template, name=f"launch4d-preflight-dryrun-{i}",
                                         namespace=how["namespace"], node=host, image=how["image"], command=script,
                                         run_id="dryrun", gpus=how["gpus"],
                                         deadline=int(probe_timeout) * len(PROBES) + 70)
            except ValueError as exc:
                raise UserError(f"--hosts: {exc}") from None
            step["via"] = (f"a pod on node {host} in namespace {how['namespace']}"
                           f"{' (context ' + how['context'] + ')' if how['context'] else ''}")
        else:
            step["via"] = "this machine"
        steps.append(step)
    then = [f"level {level}"]
    if nccl.enabled:
        then.append(f"{nccl.binary} per node" + (", then over node pairs" if nccl.pairs else "")
                    + (", then all nodes" if nccl.all_nodes else ""))

    def human() -> str:
        import yaml

        out = [f"# preflight --backend {backend} on {len(hosts)} host(s), {'; '.join(then)}; nothing run"]
        for st in steps:
            out.append(f"# {st['host']}: {st['via']}")
            if "pod" in st:
                out.append(yaml.safe_dump(st["pod"], sort_keys=False).rstrip())
        out.append("# node probes (the same script on every host):\n" + script.rstrip())
        return "\n".join(out)

    emit({"backend": backend, "dry_run": True, "level": level, "then": then, "hosts": steps}, as_json, human)
    return 0


def _slurm_job(hosts: list[str], nccl: Any, out_dir: str | None, partition: str | None, account: str | None,
               time_limit: str, gpus_per_node: int | None, srun_mpi: str, probe_timeout: float,
               nccl_timeout: float, dry_run: bool, as_json: bool, level: str, tool_timeouts: list[str]) -> int:
    from checks.folder import BWMAP_FILE
    from checks.runners.slurm_job import SlurmJobError, SlurmJobOptions, render
    from launcher.backends import get_backend
    from launcher.backends.jobstate import check_state, record
    from launcher.formats.requests import BatchScript
    from launcher.render import render_template

    out = Path(out_dir or f"preflight-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    opts = SlurmJobOptions(out_dir=str(out), partition=partition, account=account, time=time_limit,
                           python=sys.executable, gpus_per_node=gpus_per_node, mpi=srun_mpi,
                           probe_timeout=int(probe_timeout),
                           nccl_timeout=int(nccl_timeout), nccl=nccl, level=level, tool_timeouts=tool_timeouts)
    try:
        script = render(hosts, opts, render_template)
    except SlurmJobError as exc:
        raise UserError(f"--backend slurm: {exc}") from None
    # The job goes through the Slurm backend like a training job: recorded, so `launch status|logs|cancel
    # <id>` follow it.
    be = get_backend("slurm")
    req = be.request(BatchScript(opts.job_name, str(out), "preflight.sbatch", script, len(hosts)))
    if dry_run:
        emit({"script": script, "out_dir": str(out), "command": req.command}, as_json, lambda: script)
        return 0
    if out.exists():
        raise UserError(f"--out-dir: {out} already exists; give a new directory (the job writes its outputs there)")
    check_state()
    handle = be.submit(req)
    try:
        record(handle)
    except UserError as exc:
        warn(f"warning: job {handle.id} was submitted but not recorded ({exc})")
    job = handle.id
    progress(f"submitted preflight job {job}; follow: launch status {job} --wait; when it ends: "
             f"launch preflight import {out}")
    emit({"job_id": job, "out_dir": str(out), "script": str(out / "preflight.sbatch"),
          "bwmap": str(out / BWMAP_FILE)}, as_json,
         lambda: f"job {job}: outputs in {out}\nthen: launch preflight import {out} -o bwmap.json")
    return 0


def _human_parse(kind: str, obj: Any) -> str:
    if kind == "topo":
        lines = [f"{len(obj.gpus)} GPUs, {len(obj.nics)} NICs",
                 f"NVLink groups: {obj.nvlink_groups or 'none'}"]
        lines += [f"  {g}: nearest NIC {n}" for g, n in obj.nearest_nic.items()]
        return "\n".join(lines)
    if kind == "nccl-tests":
        out = []
        for t in obj.tests:
            out.append(f"{t.collective or 'unknown collective'}: {len(t.ranks)} ranks on {', '.join(t.hosts) or '?'}, "
                       f"{len(t.rows)} sizes, busbw at largest size {t.busbw_at_max_size}, avg {t.avg_busbw}")
            out += [f"  error: {e}" for e in t.errors] + [f"  warning: {w}" for w in t.warnings]
        return "\n".join(out)
    if kind == "gpu-query":
        return "\n".join(f"GPU{g.index}: {g.name}, driver {g.driver}, ECC uncorrected {g.ecc_uncorrected}, "
                         f"PCIe gen {g.pcie_gen}/{g.pcie_gen_max} x{g.pcie_width}/{g.pcie_width_max}" for g in obj.gpus)
    if kind == "nvlink":
        return "\n".join(f"GPU{g.index}: {g.active}/{len(g.links)} links active" for g in obj.gpus) or "no GPUs"
    if kind == "ibstat":
        return "\n".join(f"{p.ca}/{p.port}: {p.state} {p.physical_state} {p.rate_gbps:g} Gb/s {p.link_layer}"
                         for p in obj.ports)
    if kind == "xid":
        return "\n".join(f"line {e.line_no}: XID {e.code}{' (critical)' if e.critical else ''} on {e.pci}: "
                         f"{e.message}" for e in obj.events) or "no XID events"
    return str(obj)


def _human_findings(findings: list[Any]) -> str:
    return "\n".join(f"{f.status.upper():4} {f.component}: {f.check}: {f.message}"
                     + (f" [threshold {f.threshold}]" if f.threshold not in (None, "") else "")
                     + (f"\n     -> {f.remediation}" if f.remediation and f.status != "pass" else "")
                     for f in findings)


@preflight.command("parse")
@click.argument("kind", type=click.Choice(["topo", "nccl-tests", "gpu-query", "nvlink", "ibstat", "xid",
                                           "dcgm-diag", "nvbandwidth", "perftest", "nvlink-errors", "gpu-q"]))
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--node", default="", help="Node name to put in the findings (judged kinds).")
@click.option("--against", type=click.Path(dir_okay=False),
              help="nvlink-errors: an earlier read (counters rising between the two fail); perftest: the "
                   "host-memory run on the same link (a GPUDirect run far below it fails).")
@click.option("--link-rate", type=click.FloatRange(0, min_open=True), help="perftest: the NIC's link rate, Gb/s.")
@click.option("--model", help="nvbandwidth: GPU model whose published figure applies (default: from the output).")
@json_option
def parse_cmd(kind: str, file: str, node: str, against: str | None, link_rate: float | None, model: str | None,
              as_json: bool) -> int:
    """Show what the parser for KIND makes of one captured output FILE (and, for the deep-health kinds
    dcgm-diag, nvbandwidth, perftest, nvlink-errors, gpu-q, xid, what the judges conclude: exit 1 on a fail)."""
    from checks.parsers import JUDGED_KINDS, parser_for
    from checks.parsers.base import ParseError, to_jsonable
    from launcher.formats.files import read_text

    def load(path: str, what: str) -> Any:
        text = read_text(path, f"{kind} output", errors="replace")
        try:
            return parser_for(kind)(text)
        except ParseError as exc:
            raise UserError(f"{what}{path}: {exc}") from None

    if against and kind not in ("nvlink-errors", "perftest"):
        raise UserError(f"--against applies to nvlink-errors and perftest, not {kind}")
    obj = load(file, "")
    if kind not in JUDGED_KINDS:
        emit(to_jsonable(obj), as_json, lambda: _human_parse(kind, obj))
        return 0
    from checks.judges.finding import worst
    from checks.judges.kinds import judge_parsed

    other = load(against, "--against ") if against else None
    findings = judge_parsed(kind, obj, node=node, against=other, link_rate_gbps=link_rate, model=model)
    status = worst(findings)
    emit({"kind": kind, "file": file, "status": status, "parse": to_jsonable(obj),
          "findings": [f.to_dict() for f in findings]}, as_json,
         lambda: f"{kind} {file}: {status}\n{_human_findings(findings)}")
    return 1 if status == "fail" else 0


@preflight.command("import")
@click.argument("directory", type=click.Path(file_okay=False))
@threshold_options
@json_option
def import_cmd(directory: str, thresholds: str | None, expected_gpus: int | None, min_intra_busbw: float | None,
               min_inter_busbw: float | None, output: str | None, exclude_failed: bool, drain: bool,
               scheduler: str | None, do_apply: bool, as_json: bool) -> int:
    """Build the bandwidth map from outputs gathered elsewhere: DIR/<host>/{topo.txt,...}, DIR/pairs/*.txt."""
    from checks.assemble import assemble
    from checks.folder import load_dir

    drain_to = _drain_for(drain, scheduler, do_apply, "slurm")
    d = Path(directory)
    if not d.is_dir():
        raise UserError(f"{directory}: not a folder (expected DIR/<host>/topo.txt, gpu-query.csv, ...)")
    res = load_dir(d)
    if not res.hosts:
        raise UserError(f"{directory}: no host folders with probe outputs (topo.txt, gpu-query.csv, nvlink.txt, "
                        "ibstat.txt, xid.txt, nccl-node.txt)")
    cfg = _judge_config(thresholds, expected_gpus, min_intra_busbw, min_inter_busbw)
    return _finish(assemble(res, cfg), output, as_json, exclude_failed, drain_to, do_apply)


@preflight.command("drain")
@click.argument("bwmap", type=click.Path(dir_okay=False))
@click.option("--scheduler", type=click.Choice(SCHEDULERS), default="slurm", show_default=True)
@click.option("--apply", "do_apply", is_flag=True, help="Run the commands (default: print them).")
@json_option
def drain_cmd(bwmap: str, scheduler: str, do_apply: bool, as_json: bool) -> int:
    """Take the nodes a bandwidth map excludes out of service (Slurm drain, Kubernetes label+taint)."""
    from launcher.formats.bwmap import BandwidthMap, BandwidthMapError

    try:
        bw = BandwidthMap.load(bwmap)
    except BandwidthMapError as exc:
        raise UserError(str(exc)) from None
    return _drain(bw, scheduler, do_apply, as_json)
