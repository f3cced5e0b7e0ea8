"""`launch preflight`: measure nodes and links, judge them, write the BandwidthMap.

    launch preflight --hosts node[01-16] -o bwmap.json     # SSH fan-out (default with --hosts)
    launch preflight --slurm-allocation                    # srun steps inside salloc/sbatch
    launch preflight --backend slurm --hosts node[01-16]   # one batch job; then `preflight import`
    launch preflight parse topo topo.txt --json            # what a parser makes of one output
    launch preflight import DIR -o bwmap.json              # outputs gathered by other means

The options come in typed groups (launcher/commands/preflight_opts.py) and the hosts are reached
through the one way --backend names (launcher/commands/preflight_reach.py).
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
from launcher.commands.preflight_opts import (
    JUDGE,
    PREFLIGHT,
    SCHEDULERS,
    CheckOptions,
    HostOptions,
    JudgeOptions,
    K8sOptions,
    PlanProbeOptions,
    SlurmJobOptions,
    SSHOptions,
)
from launcher.commands.preflight_reach import Reach, reach
from launcher.errors import UserError

JOB_TIME = {"quick": "00:30:00", "standard": "02:00:00", "long": "04:00:00"}  # the batch job's default --time


def _judge_config(judge: JudgeOptions) -> Any:
    from checks.judges.config import JudgeConfig, JudgeConfigError

    try:
        cfg = JudgeConfig.load(judge.thresholds) if judge.thresholds else JudgeConfig()
    except JudgeConfigError as exc:
        raise UserError(f"--thresholds {exc}") from None
    if judge.expected_gpus is not None:
        cfg.expected_gpus = judge.expected_gpus
    if judge.min_intra_busbw is not None:
        cfg.min_intra_busbw_gbs = judge.min_intra_busbw
    if judge.min_inter_busbw is not None:
        cfg.min_inter_busbw_gbs = judge.min_inter_busbw
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


def _drain_for(judge: JudgeOptions, default: str) -> str | None:
    """The scheduler to drain for, None without --drain; --apply/--scheduler alone are refused."""
    if not judge.drain:
        if judge.do_apply or judge.scheduler:
            raise UserError("--apply and --scheduler go with --drain")
        return None
    return judge.scheduler or default


def _finish(bw: Any, judge: JudgeOptions, as_json: bool, drain: str | None = None) -> int:
    """Write the map, print the report (or the exclude list), and drain what failed when asked."""
    from checks.assemble import failed_checks
    from checks.hosts import compress
    from checks.report import render

    if judge.output:
        try:
            bw.save(judge.output)
        except OSError as exc:
            raise UserError(f"-o {judge.output}: cannot write ({exc.strerror})") from None
        progress(f"bandwidth map written to {judge.output}")
    if judge.exclude_failed:
        # for `sbatch --exclude=$(launch preflight ... --exclude-failed)`: the list only, exit 0
        click.echo(compress(bw.exclude) if bw.exclude else "")
        return 0 if bw.healthy_hosts else 1
    rc = 1 if failed_checks(bw) else 0
    if drain:
        if not as_json:
            click.echo(render(bw))
        payload = bw.to_dict() if as_json else None
        return max(rc, _drain(bw, drain, judge.do_apply, as_json, payload))
    emit(bw.to_dict(), as_json, lambda: render(bw))
    return rc


def _hosts(where: HostOptions) -> list[str]:
    """The hosts to check: --hosts, --hostfile, the Slurm allocation, else this machine."""
    from checks.hosts import HostsError, expand, from_allocation, from_file

    given = [x for x in (where.hosts_expr, where.hostfile, where.slurm_allocation or None) if x]
    if len(given) > 1:
        raise UserError("give one of --hosts, --hostfile, --slurm-allocation")
    try:
        if where.hosts_expr:
            return expand(where.hosts_expr)
        if where.hostfile:
            return from_file(where.hostfile)
        if where.slurm_allocation:
            return from_allocation()
    except HostsError as exc:
        raise UserError(str(exc)) from None
    import os
    import socket
    # in a Slurm prolog the node is known by its Slurm name, which --drain must use
    return [os.environ.get("SLURMD_NODENAME") or socket.gethostname()]


def _nccl(checks: CheckOptions) -> Any:
    """The nccl-tests runs asked for (--sizes and --launcher checked)."""
    from checks.pairing import NcclOptions

    lo_hi = [s.strip() for s in checks.sizes.split(",")]
    if len(lo_hi) != 2 or not all(lo_hi):
        raise UserError(f"--sizes {checks.sizes!r}: expected MIN,MAX such as 512M,8G")
    tpl = checks.launcher_tpl
    if tpl:
        try:
            tpl.format(np=1, hosts_slots="a:1", hostlist="a", nnodes=1, gpus=1, cmd="x")
        except (KeyError, IndexError, ValueError) as exc:
            raise UserError(f"--launcher: unknown placeholder {exc}; valid: {{np}} {{hosts_slots}} {{hostlist}} "
                            "{nnodes} {gpus} {cmd}") from None
    return NcclOptions(enabled=not checks.no_nccl, binary=checks.nccl_binary, sizes=(lo_hi[0], lo_hi[1]),
                       extra=checks.nccl_args, launcher=tpl, pairs=not checks.no_pairs, all_nodes=not checks.no_all)


@click.group(invoke_without_command=True)
@PREFLIGHT
@json_option
@click.pass_context
def preflight(ctx: click.Context, where: HostOptions, backend: str | None, ssh: SSHOptions, checks: CheckOptions,
              slurm: SlurmJobOptions, dry_run: bool, k8s: K8sOptions, probe: PlanProbeOptions, judge: JudgeOptions,
              as_json: bool) -> int | None:
    """Measure nodes and links (nvidia-smi topo, health, nccl-tests); write a bandwidth map. With --plan:
    measure the plan's own communication groups against what it assumed."""
    if ctx.invoked_subcommand is not None:
        return None
    if probe.plan_file:
        return _plan_preflight(ctx, where, backend, ssh, checks, slurm, dry_run, k8s, probe, judge.output, as_json)
    hosts = _hosts(where)
    backend = backend or ("srun" if where.slurm_allocation else "ssh" if (where.hosts_expr or where.hostfile)
                          else "local")
    way = None if backend == "slurm" else reach(backend, ssh, k8s, slurm.gpus_per_node)
    drain_to = _drain_for(judge, way.scheduler if way else "slurm")
    nccl = _nccl(checks)
    cfg = _judge_config(judge)
    from checks.levels import parse_tool_timeouts

    try:
        timeouts = parse_tool_timeouts(checks.tool_timeouts)
    except ValueError as exc:
        raise UserError(f"--tool-timeout {exc}") from None
    if way is None:
        return _slurm_job(hosts, nccl, slurm, checks, dry_run, as_json, [f"{k}={v:g}" for k, v in timeouts.items()])
    if dry_run:  # no connection, no pod, no process: what would run where
        return _dry_run(way, hosts, checks, nccl, as_json)
    from checks.assemble import assemble
    from checks.folder import save_dir
    from checks.orchestrate import PreflightOptions, run_preflight

    opts = PreflightOptions(probe_timeout=checks.probe_timeout, nccl_timeout=checks.nccl_timeout,
                            workers=checks.workers, nccl=nccl, judge=cfg, level=checks.level, tool_timeouts=timeouts)
    with way.runner() as runner:
        results = run_preflight(runner, hosts, opts, progress=progress)
    if checks.save_raw:
        try:
            progress(f"raw outputs saved in {save_dir(results, checks.save_raw)}")
        except OSError as exc:
            raise UserError(f"--save-raw {checks.save_raw}: cannot write ({exc.strerror})") from None
    return _finish(assemble(results, cfg), judge, as_json, drain_to)


def _plan_preflight(ctx: click.Context, where: HostOptions, backend: str | None, ssh: SSHOptions,
                    checks: CheckOptions, slurm: SlurmJobOptions, dry_run: bool, k8s: K8sOptions,
                    probe: PlanProbeOptions, output: str | None, as_json: bool) -> int:
    """`preflight --plan` (launcher/commands/preflight_plan.py). --namespace and --image count only when
    given: otherwise the plan's own backend.k8s settings win over the node checks' defaults."""
    from click.core import ParameterSource

    from checks.hosts import HostsError, expand, from_file
    from launcher.commands import preflight_plan

    def given(name: str, value: str) -> str | None:
        return None if ctx.get_parameter_source(name) == ParameterSource.DEFAULT else value

    try:
        hosts = (expand(where.hosts_expr) if where.hosts_expr else from_file(where.hostfile) if where.hostfile
                 else None)
    except HostsError as exc:
        raise UserError(str(exc)) from None
    pods = preflight_plan.PlanPods(given("namespace", k8s.namespace), given("image", k8s.image), k8s.kube_context,
                                   slurm.gpus_per_node, dry_run)
    return preflight_plan.run(plan_file=str(probe.plan_file), backend=backend, hosts=hosts, probe=probe,
                              timeout_s=checks.nccl_timeout, output=output, as_json=as_json, ssh=ssh, slurm=slurm,
                              k8s=pods)


def _dry_run(way: Reach, hosts: list[str], checks: CheckOptions, nccl: Any, as_json: bool) -> int:
    """`preflight --dry-run` on the ssh, srun, local and k8s paths: each host's node-probe script and
    how it would reach the host (for k8s, the pod manifest), built without connecting, loading a
    kubeconfig, or creating anything."""
    from checks.probe import PROBES
    from checks.runners.base import probe_script

    script, _ = probe_script(PROBES, checks.probe_timeout)
    deadline = int(checks.probe_timeout) * len(PROBES) + 70
    steps: list[dict[str, Any]] = []
    for i, host in enumerate(hosts, 1):
        step = way.step(i, host, script, deadline)
        steps.append({"host": host, "command": script, **({"pod": step["pod"]} if "pod" in step else {}),
                      "via": step["via"]})
    then = [f"level {checks.level}"]
    if nccl.enabled:
        then.append(f"{nccl.binary} per node" + (", then over node pairs" if nccl.pairs else "")
                    + (", then all nodes" if nccl.all_nodes else ""))

    def human() -> str:
        import yaml

        out = [f"# preflight --backend {way.name} on {len(hosts)} host(s), {'; '.join(then)}; nothing run"]
        for st in steps:
            out.append(f"# {st['host']}: {st['via']}")
            if "pod" in st:
                out.append(yaml.safe_dump(st["pod"], sort_keys=False).rstrip())
        out.append("# node probes (the same script on every host):\n" + script.rstrip())
        return "\n".join(out)

    emit({"backend": way.name, "dry_run": True, "level": checks.level, "then": then, "hosts": steps}, as_json, human)
    return 0


def _slurm_job(hosts: list[str], nccl: Any, slurm: SlurmJobOptions, checks: CheckOptions, dry_run: bool,
               as_json: bool, tool_timeouts: list[str]) -> int:
    """--backend slurm: the whole preflight as one batch job through the Slurm backend, recorded, so
    `launch status|logs|cancel <id>` follow it; `preflight import` judges what it wrote."""
    from checks.folder import BWMAP_FILE
    from checks.runners.slurm_job import SlurmJobError, render
    from checks.runners.slurm_job import SlurmJobOptions as BatchOptions
    from launcher.backends import get_backend
    from launcher.backends.jobstate import check_state, record
    from launcher.formats.requests import BatchScript
    from launcher.render import render_template

    out = Path(slurm.out_dir or f"preflight-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    opts = BatchOptions(out_dir=str(out), partition=slurm.partition, account=slurm.account,
                        time=slurm.time_limit or JOB_TIME[checks.level], python=sys.executable,
                        gpus_per_node=slurm.gpus_per_node, mpi=slurm.srun_mpi, probe_timeout=int(checks.probe_timeout),
                        nccl_timeout=int(checks.nccl_timeout), nccl=nccl, level=checks.level,
                        tool_timeouts=tool_timeouts)
    try:
        script = render(hosts, opts, render_template)
    except SlurmJobError as exc:
        raise UserError(f"--backend slurm: {exc}") from None
    be = get_backend("slurm")
    req = be.request(BatchScript(opts.job_name, str(out), "preflight.sbatch", script, len(hosts)))
    if dry_run:
        emit({"script": script, "out_dir": str(out), "command": req.command}, as_json, lambda: script)
        return 0
    if out.exists():
        raise UserError(f"--out-dir: {out} already exists; give a new directory (the job writes its outputs there)")
    check_state()
    job = be.submit(req)
    try:
        record(job)
    except UserError as exc:
        warn(f"warning: job {job.id} was submitted but not recorded ({exc})")
    progress(f"submitted preflight job {job.id}; follow: launch status {job.id} --wait; when it ends: "
             f"launch preflight import {out}")
    emit({"job_id": job.id, "out_dir": str(out), "script": str(out / "preflight.sbatch"),
          "bwmap": str(out / BWMAP_FILE)}, as_json,
         lambda: f"job {job.id}: outputs in {out}\nthen: launch preflight import {out} -o bwmap.json")
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
@JUDGE
@json_option
def import_cmd(directory: str, judge: JudgeOptions, as_json: bool) -> int:
    """Build the bandwidth map from outputs gathered elsewhere: DIR/<host>/{topo.txt,...}, DIR/pairs/*.txt."""
    from checks.assemble import assemble
    from checks.folder import load_dir

    drain_to = _drain_for(judge, "slurm")
    d = Path(directory)
    if not d.is_dir():
        raise UserError(f"{directory}: not a folder (expected DIR/<host>/topo.txt, gpu-query.csv, ...)")
    res = load_dir(d)
    if not res.hosts:
        raise UserError(f"{directory}: no host folders with probe outputs (topo.txt, gpu-query.csv, nvlink.txt, "
                        "ibstat.txt, xid.txt, nccl-node.txt)")
    return _finish(assemble(res, _judge_config(judge)), judge, as_json, drain_to)


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
