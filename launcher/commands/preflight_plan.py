"""`launch preflight --plan plan.json`: measure the collectives the plan will spend, on the nodes it
was given, and compare each group with what the plan's time model assumed.

    launch preflight --plan plan.json                          # every rank on this machine (gloo / NCCL)
    launch preflight --plan plan.json --backend ssh --hosts n[1-2]   # one torchrun per node over SSH
    launch preflight --plan plan.json --backend slurm          # a batch job on the plan's node count; waits
    launch preflight --plan plan.json --backend k8s            # a one-off gang of pods (Kubernetes API); waits

Every group of the plan (launcher/plan/commgroups.py) runs its collective at the plan's message size,
all groups of one kind at once (checks/groupprobe). The report gives per kind and per group the
measured bus bandwidth, the model's, their ratio, and the step time recomputed with the measured
figures. Exit 0 when every group is within --tolerance of the plan's assumption, 1 when one is slower
(named with its ranks, hosts and link) or nothing could be measured, 2 for bad input.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from launcher.commands import emit, progress
from launcher.commands.preflight_opts import PlanProbeOptions, SlurmJobOptions, SSHOptions
from launcher.errors import UserError
from launcher.formats.groupprobe import KIND_NAMES, GroupProbe

GANG_POLL_S = 2.0   # seconds between looks at the gang's pods


@dataclass(frozen=True)
class PlanPods:
    """--backend k8s: what the command line says of the gang; None where the plan's backend.k8s decides."""

    namespace: str | None
    image: str | None
    context: str | None
    gpus: int | None
    dry_run: bool


@dataclass(frozen=True)
class How:
    """What preflight's option groups say of reaching the nodes."""

    probe: PlanProbeOptions
    ssh: SSHOptions
    slurm: SlurmJobOptions
    k8s: PlanPods
    as_json: bool


#: The measurement, once everything it needs was checked: (result, log), or None (a dry run printed).
Measure = Callable[[], "tuple[GroupProbe, str] | None"]


class Here:
    """Every rank on this machine (gloo / NCCL)."""

    def hosts(self, plan: Any, hosts: list[str] | None) -> list[str] | None:
        """The hosts node i of the plan runs on (refused where they do not fit the plan)."""
        if hosts:
            raise UserError("--hosts goes with --backend ssh (or slurm's allocation); local runs every rank here")
        return None

    def start(self, plan: Any, spec: GroupProbe, hosts: list[str] | None, timeout_s: float, how: How) -> Measure:
        """What is checked before anything is said (credentials), and the measurement to run then."""
        from checks.groupprobe.launch import run_local

        def measure() -> tuple[GroupProbe, str]:
            with tempfile.TemporaryDirectory(prefix="launch4d-groupprobe-") as tmp:
                return run_local(spec, Path(tmp), timeout_s)
        return measure


class OverSSH(Here):
    """One torchrun per node over SSH: node i of the plan is host i."""

    def hosts(self, plan: Any, hosts: list[str] | None) -> list[str] | None:
        hosts = hosts or plan.hosts
        if not hosts:
            raise UserError("--backend ssh: give --hosts (the plan names no hosts): node i of the plan is host i")
        if len(hosts) != plan.nodes:
            raise UserError(f"--hosts: {len(hosts)} host(s) for a plan of {plan.nodes} node(s)")
        return hosts

    def start(self, plan: Any, spec: GroupProbe, hosts: list[str] | None, timeout_s: float, how: How) -> Measure:
        return lambda: _over_ssh(spec, hosts or [], timeout_s, how.ssh, how.probe)


class SlurmJob(Here):
    """A batch job of the plan's node count; waits for it."""

    def hosts(self, plan: Any, hosts: list[str] | None) -> list[str] | None:
        return hosts

    def start(self, plan: Any, spec: GroupProbe, hosts: list[str] | None, timeout_s: float, how: How) -> Measure:
        return lambda: _slurm_job(plan, spec, timeout_s, how.slurm)


class Gang(Here):
    """A one-off gang of pods through the Kubernetes API; waits for it (--hosts pins pod i to node i)."""

    def hosts(self, plan: Any, hosts: list[str] | None) -> list[str] | None:
        if hosts and len(hosts) != plan.nodes:
            raise UserError(f"--hosts: {len(hosts)} Kubernetes node(s) for a plan of {plan.nodes} node(s)")
        return hosts

    def start(self, plan: Any, spec: GroupProbe, hosts: list[str] | None, timeout_s: float, how: How) -> Measure:
        kube = None if how.k8s.dry_run else _k8s_backend(plan, how.k8s)   # no cluster: one line, exit 2
        return lambda: _k8s_gang(plan, spec, hosts, timeout_s, how.k8s, how.probe, how.as_json, kube)


WAYS: dict[str, Here] = {"local": Here(), "ssh": OverSSH(), "slurm": SlurmJob(), "k8s": Gang()}


def run(plan_file: str, backend: str | None, hosts: list[str] | None, probe: PlanProbeOptions, timeout_s: float,
        output: str | None, as_json: bool, ssh: SSHOptions, slurm: SlurmJobOptions, k8s: PlanPods) -> int:
    from launcher.plan.commgroups import probe_spec, with_measured_step
    from launcher.plan.model import Plan

    plan = Plan.load(plan_file)
    backend = backend or ("ssh" if hosts else "local")
    if backend not in WAYS:
        raise UserError(f"--backend {backend}: with --plan, one of {', '.join(WAYS)}")
    way = WAYS[backend]
    hosts = way.hosts(plan, hosts)
    spec = probe_spec(plan, tolerance=probe.tolerance, iters=probe.iters, hosts=hosts)
    if not spec.groups:
        raise UserError(f"{plan_file}: the plan communicates over no group of more than one rank "
                        f"(tp=cp=pp=dp=1): nothing to measure")
    measure = way.start(plan, spec, hosts, timeout_s, How(probe, ssh, slurm, k8s, as_json))
    progress(f"preflight --plan: {len(spec.groups)} group(s) of {', '.join(KIND_NAMES[k] for k in spec.kinds())} "
             f"over {plan.world_size} rank(s) ({backend})")
    got = measure()
    if got is None:      # --dry-run: the gang was printed, nothing created
        return 0
    result, log = got
    result = with_measured_step(plan, replace(result, tolerance=probe.tolerance))
    if output:
        result.save(output)
        progress(f"measurements written to {output}")
    emit(report_dict(result), as_json, lambda: render(result))
    if result.error or not result.measured:
        progress(f"preflight --plan: nothing measured: {result.error or 'some groups were not timed'}")
        if log.strip():
            progress("\n".join(log.strip().splitlines()[-15:]))
        return 1
    return 1 if result.slow_groups() else 0


def _over_ssh(spec: GroupProbe, hosts: list[str], timeout_s: float, ssh: SSHOptions,
              probe: PlanProbeOptions) -> tuple[GroupProbe, str]:
    from checks.groupprobe.launch import run_nodes
    from checks.runners import get_runner

    port, python, master = probe.master_port, probe.node_python or "python3", probe.master_addr
    try:
        runner = get_runner("ssh", **asdict(ssh))
    except Exception as exc:  # noqa: BLE001 - one line, exit 2
        raise UserError(f"--backend ssh: {type(exc).__name__}: {exc}") from None
    try:
        with runner:
            return run_nodes(spec, runner, hosts, timeout_s, port, python=python, master=master)
    except ValueError as exc:
        raise UserError(f"--plan: {exc}") from None


def _slurm_job(plan: Any, spec: GroupProbe, timeout_s: float, o: SlurmJobOptions) -> tuple[GroupProbe, str]:
    """A batch job of the plan's node count that runs only the probe (the gate's own shell function),
    followed like any job until it ends; then its result."""
    from datetime import datetime

    from launcher.backends import get_backend, wait
    from launcher.backends.jobstate import check_state, record
    from launcher.formats import rundir
    from launcher.render import bash_syntax_check, render_template
    from launcher.render.rendered import gpu_lists

    out = Path(o.out_dir or f"preflight-plan-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    if out.exists():
        raise UserError(f"--out-dir: {out} already exists; give a new directory (the job writes its outputs there)")
    s = plan.backend.slurm if plan.backend is not None else None
    probe = {"spec": rundir.PREFLIGHT_PLAN_SPEC, "result": rundir.PREFLIGHT_PLAN, "log": rundir.PREFLIGHT_PLAN_LOG,
             "timeout_s": int(timeout_s), "tolerance": spec.tolerance, "groups": len(spec.groups)}
    env = sorted((plan.backend.env if plan.backend is not None else {}).items())
    ctx = {"name": plan.name, "job_name": f"{plan.name}-preflight-plan"[:63], "nodes": plan.nodes,
           "nproc": plan.gpus_per_node, "time": o.time_limit or "00:30:00",
           "partition": o.partition or (s.partition if s else None),
           "account": o.account or (s.account if s else None),
           "gpus_per_node": plan.gpus_per_node if plan.gpu.name != "cpu" else None, "run_dir": str(out),
           "env": env, "node_order": list(plan.hosts or []), "master_port": s.master_port if s else None,
           "gpu_lists": gpu_lists(plan), "python": sys.executable, "trainer_env": "",
           "probe": probe}
    script = render_template("slurm/preflight-plan.sbatch.j2", ctx)
    bash_syntax_check(script, "plan preflight batch script")
    be = get_backend("slurm")
    import json

    from launcher.formats.requests import BatchScript

    req = be.request(BatchScript(ctx["job_name"], str(out), "preflight-plan.sbatch", script, plan.nodes,
                                 {rundir.PREFLIGHT_PLAN_SPEC: json.dumps(spec.to_dict(), indent=1) + "\n"}))
    check_state()
    handle = be.submit(req)
    try:
        record(handle)
    except UserError as exc:
        progress(f"warning: job {handle.id} was submitted but not recorded ({exc})")
    progress(f"preflight --plan: Slurm job {handle.id} (outputs in {out}); waiting for it to end")
    wait(be, handle, timeout=timeout_s + 600)
    log = "\n".join(p.read_text(errors="replace") for p in sorted(out.glob("slurm-*.out")))
    plog = out / rundir.PREFLIGHT_PLAN_LOG
    if plog.is_file():
        log += "\n" + plog.read_text(errors="replace")
    res = out / rundir.PREFLIGHT_PLAN
    if not res.is_file():
        from checks.groupprobe.launch import failure

        return replace(spec, error=f"job {handle.id}: {failure(log)}"), log
    return GroupProbe.load(res), log


def _k8s_backend(plan: Any, o: PlanPods) -> Any:
    """The Kubernetes backend the gang goes through, its credentials loaded now (the plan's kubeconfig
    and context, --kube-context first)."""
    from launcher.backends import get_backend
    from launcher.backends.jobstate import check_state

    k = plan.backend.k8s if plan.backend is not None else None
    be = get_backend("k8s", kubeconfig=k.kubeconfig if k is not None else None,
                     context=o.context or (k.context if k is not None else None))
    be.check_access()
    check_state()
    return be


def _k8s_gang(plan: Any, spec: GroupProbe, hosts: list[str] | None, timeout_s: float, o: PlanPods,
              probe: PlanProbeOptions, as_json: bool, be: Any) -> tuple[GroupProbe, str] | None:
    """A one-off gang through the Kubernetes API: a headless Service and one pod per node of the plan,
    pod i running node i's torchrun of the probe (the spec inlined, as over SSH) with pod 0 as the static
    rendezvous; followed until every pod ends, then node 0's log holds the result. The pods and the
    Service are deleted at the end. Image, namespace, pull secrets, node selector and tolerations are the
    plan's backend.k8s where it has them (--image / --namespace when given win); --hosts pins pod i to
    Kubernetes node i. None with --dry-run (the manifests printed, nothing created)."""
    import secrets
    import time

    from checks.groupprobe.launch import failure, node_command
    from checks.groupprobe.worker import RESULT_MARKER
    from launcher.render.groupprobe import gang_documents

    k = plan.backend.k8s if plan.backend is not None else None
    image = o.image or (k.image if k is not None else None)
    if not image:
        raise UserError("--image: give an image with launch4d[train] installed (the plan names none in "
                        "backend.k8s.image)")
    ns = o.namespace or (k.namespace if k is not None else "default")
    name = f"launch4d-pp-{secrets.token_hex(4)}"
    port = probe.master_port
    master = f"{name}-0.{name}"
    try:
        commands = [node_command(spec, i, master, port, probe.node_python or "python", timeout_s, None)
                    for i in range(plan.nodes)]
    except ValueError as exc:
        raise UserError(f"--plan: {exc}") from None
    gpus = plan.gpus_per_node if plan.gpu.name != "cpu" else None
    docs = gang_documents(name=name, namespace=ns, image=image, commands=commands, gpus=o.gpus or gpus,
                          nodes=hosts, node_selector=k.node_selector if k is not None else None,
                          tolerations=[dict(t) for t in k.tolerations] if k is not None else None,
                          pull_secrets=list(k.image_pull_secrets) if k is not None else None,
                          service_account=k.service_account if k is not None else None,
                          deadline_s=int(timeout_s) + 600)
    from launcher.render.k8s import to_model

    to_model(docs[0], "V1Service")
    for pod in docs[1:]:
        to_model(pod, "V1Pod")
    if o.dry_run:
        import yaml

        text = "---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs)
        emit({"dry_run": True, "namespace": ns, "documents": docs}, as_json, lambda: text.rstrip("\n"))
        return None
    from launcher.backends.jobstate import record
    from launcher.formats.requests import Manifests

    handle = be.submit(be.request(Manifests(docs, gpus_per_node=plan.gpus_per_node)))
    try:
        record(handle)
    except UserError as exc:
        progress(f"warning: gang {name} was created but not recorded ({exc})")
    progress(f"preflight --plan: gang {name} ({plan.nodes} pod(s) in namespace {ns}); waiting for it to end")
    try:
        deadline = time.monotonic() + timeout_s + 600
        st = be.describe(handle)
        while st is not None and not st.done and time.monotonic() < deadline:
            time.sleep(GANG_POLL_S)
            st = be.describe(handle)
        log = "\n".join(be.log_iter(handle))
    finally:
        be.cancel(handle)
    doc = next((ln[len(RESULT_MARKER):] for ln in log.splitlines() if ln.startswith(RESULT_MARKER)), None)
    if doc is None:
        why = "still running at the deadline" if st is not None and not st.done else failure(log)
        return replace(spec, error=f"pod {name}-0: {why}"), log
    import json

    try:
        return GroupProbe.from_dict(json.loads(doc), f"pod {name}-0's result"), log
    except (ValueError, UserError) as exc:
        return replace(spec, error=f"pod {name}-0: unreadable result ({exc})"), log


# --- the report -----------------------------------------------------------------------------
def by_kind(probe: GroupProbe) -> list[dict[str, Any]]:
    """One row per group kind: its collective, message, the model's busbw, the worst and median measured."""
    import statistics

    rows = []
    for kind in probe.kinds():
        groups = probe.of(kind)
        timed = [g for g in groups if g.measured_s]
        worst = min(timed, key=lambda g: g.ratio or 0) if timed else None
        rows.append({"kind": kind, "name": KIND_NAMES[kind], "groups": len(groups), "op": groups[0].op,
                     "nbytes": groups[0].nbytes, "assumed_busbw_gbs": groups[0].assumed_busbw_gbs,
                     "assumed_s": groups[0].assumed_s,
                     "measured_busbw_gbs_worst": worst.measured_busbw_gbs if worst else None,
                     "measured_busbw_gbs_median": statistics.median(g.measured_busbw_gbs or 0 for g in timed)
                     if timed else None,
                     "ratio_worst": worst.ratio if worst else None, "worst_group": worst.index if worst else None,
                     "slow_groups": sum(g.slow(probe.tolerance) for g in groups)})
    return rows


def report_dict(probe: GroupProbe) -> dict[str, Any]:
    from checks.groupprobe.verdict import describe

    d = probe.to_dict()
    d["by_kind"] = by_kind(probe)
    d["slow"] = [{"kind": g.kind, "index": g.index, "ranks": g.ranks, "hosts": g.hosts, "link": g.link,
                  "ratio": g.ratio, "message": describe(g)} for g in probe.slow_groups()]
    d["ok"] = probe.measured and not probe.error and not d["slow"]
    return d


def _size(n: float) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.0f} B"


def _gbs(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g} GB/s"


def render(probe: GroupProbe, per_kind: int = 8) -> str:
    """The human report: a table per kind, each kind's groups (slowest first), the step time, the verdict."""
    from checks.groupprobe.verdict import describe

    tol = probe.tolerance
    head = (f"plan preflight of {probe.plan}: {probe.world_size} ranks on {probe.nodes} node(s), "
            f"{probe.backend or '?'}, median of {probe.iters} call(s) per group, tolerance {tol:.0%}")
    lines = [head, ""]
    rows = by_kind(probe)
    lines.append(f"{'kind':<14} {'groups':>6}  {'collective':<14} {'message':>9}  {'assumed':>12}  "
                 f"{'measured (worst)':>16}  {'ratio':>6}")
    for r in rows:
        flag = "  SLOW" if r["slow_groups"] else ""
        ratio = "-" if r["ratio_worst"] is None else f"{r['ratio_worst']:.2g}"
        lines.append(f"{r['name']:<14} {r['groups']:>6}  {r['op']:<14} {_size(r['nbytes']):>9}  "
                     f"{_gbs(r['assumed_busbw_gbs']):>12}  {_gbs(r['measured_busbw_gbs_worst']):>16}  {ratio:>6}{flag}")
    for kind in probe.kinds():
        groups = sorted(probe.of(kind), key=lambda g: g.ratio if g.ratio is not None else 1e9)
        lines.append(f"\n{KIND_NAMES[kind]} groups ({len(groups)}):")
        for g in groups[:per_kind]:
            flag = "  SLOW" if g.slow(tol) else ""
            ratio = "-" if g.ratio is None else f"{g.ratio:.2g}"
            t = "-" if g.measured_s is None else f"{g.measured_s * 1e3:.3g} ms"
            lines.append(f"  {g.index:>4}  {g.where(probe.hosts):<44} {t:>10}  {_gbs(g.measured_busbw_gbs):>12}  "
                         f"ratio {ratio}{flag}")
        if len(groups) > per_kind:
            lines.append(f"  ... {len(groups) - per_kind} more (--json lists every group)")
    if probe.measured_step_s is not None:
        change = probe.measured_step_s / probe.predicted_step_s - 1 if probe.predicted_step_s else 0.0
        lines.append(f"\nstep time (the plan's time model): {probe.predicted_step_s:.4g} s at the assumed bandwidths, "
                     f"{probe.measured_step_s:.4g} s at the measured ones ({change:+.0%})")
    slow = probe.slow_groups()
    if probe.error:
        lines.append(f"\nnot measured: {probe.error}")
    elif slow:
        lines.append(f"\n{len(slow)} group(s) slower than the plan assumed by more than {tol:.0%}:")
        lines += [f"  {describe(g)}" for g in sorted(slow, key=lambda g: g.ratio or 0)[:20]]
        suspects = probe.suspect_hosts()
        if suspects:
            lines.append(f"suspect host(s): {', '.join(suspects)}")
    else:
        lines.append(f"\nevery group within {tol:.0%} of what the plan assumed")
    return "\n".join(lines)
