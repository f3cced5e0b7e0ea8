"""Render a Plan into an sbatch script or a PyTorchJob manifest (Jinja over templates/).

The user's `--templates DIR` is searched first, file by file, then the templates shipped in the
wheel. Values are shaped here, in Python, so templates stay declarative and the checks can be
tested: every user string that reaches a shell goes through `q` (launcher.formats.shell.quote: safe
in command position, always one line), every value on an #SBATCH line through `sbatch` (a strict
character set, the whole value), every Kubernetes name through `k8sname`
(RFC 1123), every YAML scalar through `yq` (JSON, which is YAML). Undefined variables are errors.
Nothing depends on the clock: the same input renders the same bytes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from launcher.errors import UserError
from launcher.formats import rundir
from launcher.formats.files import check_writable_target, make_dirs, read_text, remove_created, write_files
from launcher.formats.shell import quote as shell_quote
from launcher.formats.shell import sbatch_arg, sbatch_value
from launcher.plan.model import Plan
from launcher.plan.spec import JobSpec

PLAN_MOUNT = "/etc/launch4d"
RFC1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
RFC1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
# backend.slurm.extra: one long sbatch option, "--flag" or "--flag=value" (the whole string).
SBATCH_EXTRA = re.compile(r"--([a-z][a-z0-9-]*)(?:=(.*))?", re.S)
# Options the script itself sets (its rank logic, logs and requeue depend on them), with the
# job-file field to use where there is one.
SBATCH_MANAGED = {"job-name": "name", "nodes": "cluster.nodes", "ntasks-per-node": None, "ntasks": None,
                  "output": None, "error": None, "chdir": None, "open-mode": None,
                  "signal": "backend.slurm.checkpoint_signal / signal_seconds", "requeue": "backend.slurm.requeue",
                  "no-requeue": "backend.slurm.requeue", "gpus-per-node": "cluster.gpus_per_node",
                  "array": None, "wrap": None, "parsable": None}
SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}")
# Names that look like credentials are refused in backend.env: reference a Secret instead.
SECRET_WORDS = re.compile(r"(SECRET|PASSWORD|PASSWD|TOKEN|API_?KEY|CREDENTIAL|PRIVATE_KEY)", re.I)
# A PyTorchJob's pods are named <name>-worker-<i>; keep the name short enough for that.
K8S_NAME_MAX = 50


@dataclass
class Rendered:
    """What `launch render` writes into a run dir: file name -> text; `main` is the script/manifest."""

    backend: str
    run_dir: str
    main: str
    files: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def write(self, directory: str | Path, force: bool = False) -> list[Path]:
        """Write every file, all or nothing (staged, then renamed), into `directory` and create its
        logs/ for Slurm's output files. A directory holding another job's files is refused unless
        `force`; a failure removes the directories this call created."""
        d = Path(directory)
        if not force:
            self.check_target(d)
        for name in self.files:
            check_writable_target(d / name, "rendered file")
        created = make_dirs(d, "output directory")
        try:
            created += make_dirs(d / rundir.LOGS, "output directory")
            return write_files(d, {name: (text, 0o755 if name.endswith(".sbatch") else 0o644)
                                   for name, text in self.files.items()}, "rendered file")
        except BaseException:
            remove_created(created)
            raise

    def check_target(self, d: Path) -> None:
        """Refuse to overwrite another job's files: existing ones must belong to a plan of this name."""
        clash = sorted(n for n in self.files if (d / n).exists())
        if not clash:
            return
        mine = json.loads(self.files[rundir.PLAN]).get("name") if rundir.PLAN in self.files else None
        theirs = None
        if (d / rundir.PLAN).exists():
            try:
                theirs = json.loads(read_text(d / rundir.PLAN, "plan")).get("name")
            except (UserError, ValueError, AttributeError):
                theirs = None
        if mine is None or theirs != mine:
            raise UserError(f"-o {d}: already holds {', '.join(clash)} of "
                            f"{'another job (' + repr(theirs) + ')' if theirs else 'something else'}; "
                            "give another directory, or --force to overwrite")


# --- filters ---------------------------------------------------------------------------------


def check_k8s_name(value: Any, what: str = "name", limit: int = 63) -> str:
    s = str(value)
    if len(s) > limit or not RFC1123_LABEL.fullmatch(s):
        raise UserError(f"{what}: {s!r} is not a valid Kubernetes name (RFC 1123: lowercase letters, digits "
                        f"and '-', starting and ending with a letter or digit, at most {limit} characters)")
    return s


_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def yaml_scalar(value: Any) -> str:
    """JSON is YAML: any string, list or mapping renders safely on one line. Non-ASCII characters
    are escaped the YAML way (\\uXXXX, \\UXXXXXXXX): JSON's surrogate pairs for characters beyond
    the BMP would read back in YAML as two lone surrogates, and a raw U+2028 as a line break."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return _NON_ASCII.sub(lambda m: f"\\u{ord(m.group()):04x}" if ord(m.group()) <= 0xFFFF
                          else f"\\U{ord(m.group()):08x}", text)


@cache
def _package_dir() -> Path:
    import templates

    return Path(templates.__file__).resolve().parent


TEMPLATE_LIMIT = 1 << 20


def _bounded_loader(search: list[str]):
    """Templates found as jinja2's FileSystemLoader finds them, read through formats.read_text
    (bounded, UTF-8, a device or FIFO refused by name)."""
    import jinja2

    class Loader(jinja2.FileSystemLoader):
        def get_source(self, environment, template):
            for base in self.searchpath:
                path = Path(base, *jinja2.loaders.split_template_path(template))
                if os.path.lexists(path) and not path.is_dir():
                    if not path.is_file():
                        raise UserError(f"{path}: a template must be a regular file")
                    text = read_text(path, "template", TEMPLATE_LIMIT)
                    mtime = path.stat().st_mtime
                    return text, str(path), lambda p=path, m=mtime: p.exists() and p.stat().st_mtime == m
            raise jinja2.TemplateNotFound(template)

    return Loader(search)


def environment(user_dir: str | Path | None = None):
    import jinja2

    search = []
    if user_dir is not None:
        p = Path(user_dir)
        if not p.is_dir():
            raise UserError(f"--templates {user_dir}: not a directory")
        search.append(str(p))
    search.append(str(_package_dir()))
    env = jinja2.Environment(loader=_bounded_loader(search), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             autoescape=False)
    env.filters.update(q=shell_quote, sbatch=sbatch_value, sbatch_arg=sbatch_arg, k8sname=check_k8s_name,
                       yq=yaml_scalar)
    return env


def render_template(name: str, context: dict[str, Any], user_dir: str | Path | None = None) -> str:
    import jinja2

    env = environment(user_dir)
    try:
        return env.get_template(name).render(**context)
    except jinja2.TemplateNotFound:
        raise UserError(f"template {name} not found (searched {user_dir or ''} and the shipped templates)") from None
    except jinja2.UndefinedError as exc:
        raise UserError(f"template {name}: {exc.message}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"template {exc.filename or name}:{exc.lineno}: {exc.message}") from None


# --- shared context -------------------------------------------------------------------------
def measured_nccl_env(plan: Plan) -> dict[str, str]:
    """From preflight, through the plan: NCCL_IB_HCA restricted (exact match) to the NICs nearest
    the job's GPUs, so a storage or management port is never picked."""
    nics = sorted({r.nic for r in plan.ranks if getattr(r, "nic", None)})
    return {"NCCL_IB_HCA": "=" + ",".join(nics)} if nics else {}


def diagnostics_env(spec: JobSpec, run_dir: str, extra: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """NCCL / PyTorch observability variables from the job's `diagnostics` section; interface
    hints given in the job file win over measured ones (`extra`)."""
    d = spec.diagnostics
    env: list[tuple[str, str]] = []
    if d.nccl_debug != "off":
        env.append(("NCCL_DEBUG", d.nccl_debug))
        if d.nccl_debug_subsys:
            env.append(("NCCL_DEBUG_SUBSYS", d.nccl_debug_subsys))
        env.append(("NCCL_DEBUG_FILE", f"{run_dir}/{rundir.NCCL_LOGS}/%h.%p.log"))
    env.append(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"))
    if d.flight_recorder:
        # Both spellings: TORCH_FR_* on current PyTorch, TORCH_NCCL_* on older releases.
        env += [("TORCH_NCCL_TRACE_BUFFER_SIZE", str(d.flight_recorder_entries)),
                ("TORCH_FR_BUFFER_SIZE", str(d.flight_recorder_entries)),
                ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", f"{run_dir}/{rundir.FLIGHT}/rank_"),
                ("TORCH_FR_DUMP_TEMP_FILE", f"{run_dir}/{rundir.FLIGHT}/rank_")]
    # The init and collective timeouts go to the trainer's flags (trainer_args); the NCCL watchdog's
    # heartbeat monitor must not fire before the collective timeout does.
    env.append(("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(max(d.collective_timeout_s, 60))))
    measured = extra or {}
    ifname = d.socket_ifname or measured.get("NCCL_SOCKET_IFNAME")
    hca = d.ib_hca or measured.get("NCCL_IB_HCA")
    if ifname:
        env.append(("NCCL_SOCKET_IFNAME", ifname))
    if hca:
        env.append(("NCCL_IB_HCA", hca))
    return env


def trainer_args(spec: JobSpec, plan_path: str, run_dir: str) -> str:
    """The trainer's command-line arguments, shell-quoted."""
    d = spec.diagnostics
    return (f"--plan {shell_quote(plan_path)} --run-dir {shell_quote(run_dir)} --resume auto "
            f"--init-timeout-s {d.init_timeout_s} --step-timeout-s {d.collective_timeout_s}")


def user_env(spec: JobSpec) -> list[tuple[str, str]]:
    out = []
    for key, value in sorted(spec.backend.env.items()):
        if not ENV_NAME.fullmatch(key):
            raise UserError(f"backend.env.{key}: not a valid environment variable name")
        if SECRET_WORDS.search(key):
            raise UserError(f"backend.env.{key}: looks like a secret and would be written into the rendered "
                            "file; pass it from the submitting shell (Slurm exports it) or name a Kubernetes "
                            "Secret in backend.k8s.env_from_secrets")
        if "\x00" in str(value):
            raise UserError(f"backend.env.{key}: a NUL byte cannot be in an environment variable")
        out.append((key, value))
    return out


def gpu_lists(plan: Plan) -> list[str]:
    """Per node (in plan node order), the physical GPU indices in local-rank order."""
    by_node: dict[int, list[tuple[int, int]]] = {}
    for r in plan.ranks:
        by_node.setdefault(r.node, []).append((r.local_rank, r.gpu))
    return [",".join(str(g) for _, g in sorted(by_node[n])) for n in sorted(by_node)]


def _check_plan(spec: JobSpec, plan: Plan) -> None:
    if len(plan.ranks) != plan.world_size or plan.nodes * plan.gpus_per_node != plan.world_size:
        raise UserError(f"plan {plan.name}: {len(plan.ranks)} ranks for {plan.nodes} node(s) x "
                        f"{plan.gpus_per_node} GPU(s); re-run `launch plan`")
    if plan.hosts and len(plan.hosts) != plan.nodes:
        raise UserError(f"plan {plan.name}: {len(plan.hosts)} hosts for {plan.nodes} nodes")


def default_run_dir(spec: JobSpec, stamp: str) -> str:
    return str(Path(spec.backend.log_dir).expanduser().resolve() / f"{spec.name}-{stamp}")


# --- Slurm ------------------------------------------------------------------------------------
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
        if flag in SBATCH_MANAGED:
            field_hint = SBATCH_MANAGED[flag]
            raise UserError(f"{path}: --{flag} is set by launch4d itself"
                            + (f"; use {field_hint}" if field_hint else ""))
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
    return sorted({r.nic for r in plan.ranks if getattr(r, "nic", None)})


def slurm_context(spec: JobSpec, plan: Plan, run_dir: str, exclude: list[str] | None = None,
                  measured_env: dict[str, str] | None = None, node_order: list[str] | None = None
                  ) -> dict[str, Any]:
    _check_plan(spec, plan)
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
    return {
        "name": spec.name,
        "source_name": Path(spec.source).name if spec.source else spec.name,
        "nodes": plan.nodes,
        "nproc": plan.gpus_per_node,
        "gpus_per_node": plan.gpus_per_node if s.gres_gpus else None,
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
        "plan_path": f"{run_dir}/{rundir.PLAN}",
        "trainer_args": trainer_args(spec, f"{run_dir}/{rundir.PLAN}", run_dir),
        "python": s.python,
        "master_port": s.master_port,
        "grace_seconds": max(s.signal_seconds - 10, 5),
        "diag_env": diagnostics_env(spec, run_dir, {**measured_nccl_env(plan), **(measured_env or {})}),
        "user_env": user_env(spec),
    }


def bash_syntax_check(script: str, what: str = "sbatch script") -> None:
    try:
        proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return  # no bash here (a login shell elsewhere will check it); nothing else can
    if proc.returncode != 0:
        raise UserError(f"rendered {what} does not parse: {proc.stderr.strip().splitlines()[0]}")


def render_slurm(spec: JobSpec, plan: Plan, run_dir: str, templates: str | Path | None = None,
                 exclude: list[str] | None = None, measured_env: dict[str, str] | None = None,
                 node_order: list[str] | None = None) -> Rendered:
    """`node_order`: the BandwidthMap's host order (default: the plan's hosts); the batch script
    ranks the nodes it is given in this order."""
    ctx = slurm_context(spec, plan, run_dir, exclude, measured_env, node_order)
    script = render_template("slurm/train.sbatch.j2", ctx, templates)
    bash_syntax_check(script)
    return Rendered("slurm", run_dir, "train.sbatch",
                    {"train.sbatch": script, rundir.PLAN: plan.to_json() + "\n"})


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


# --- Kubernetes -------------------------------------------------------------------------------
def k8s_log_dir(spec: JobSpec) -> str:
    """backend.log_dir inside the pods: a relative one is taken under /workspace."""
    d = spec.backend.log_dir.rstrip("/") or "/"
    return d if d.startswith("/") else f"/workspace/{d}"


def shutdown_timeout(grace_s: int) -> int:
    """How long torchrun (the pod's PID 1) waits for its workers after the SIGTERM the kubelet sends
    on preemption or delete, before it SIGKILLs them: the pod's grace period less a margin for
    torchrun's own exit. torchrun's default, 30 s, would kill a trainer mid-checkpoint."""
    return max(grace_s - 15, 1)


def k8s_context(spec: JobSpec, plan: Plan, run_dir: str) -> dict[str, Any]:
    _check_plan(spec, plan)
    k = spec.backend.k8s
    name = check_k8s_name(spec.name, "name", K8S_NAME_MAX)
    check_k8s_name(k.namespace, "backend.k8s.namespace")
    for i, node in enumerate(k.exclude_nodes):
        if len(node) > 253 or not RFC1123_SUBDOMAIN.fullmatch(node):
            raise UserError(f"backend.k8s.exclude_nodes[{i}]: {node!r} is not a Kubernetes node name "
                            "(RFC 1123 subdomain: lowercase letters, digits, '-' and '.')")
    if k.topology.required and k.topology.preferred:
        raise UserError("backend.k8s.topology: set required or preferred, not both")
    if k.api == "trainjob":
        check_k8s_name(k.runtime, "backend.k8s.runtime", 253)
        if not name[0].isalpha():
            raise UserError(f"name: {name!r} must start with a letter for a TrainJob (RFC 1035 label)")
    for i, s in enumerate(k.image_pull_secrets):
        check_k8s_name(s, f"backend.k8s.image_pull_secrets[{i}]", 253)
    for i, s in enumerate(k.env_from_secrets):
        check_k8s_name(s, f"backend.k8s.env_from_secrets[{i}]", 253)
    g = plan.gpus_per_node
    resources: dict[str, str] = {"nvidia.com/gpu": str(g)}
    if k.rdma_resource:
        resources[k.rdma_resource] = "1"
    if k.cpu:
        resources["cpu"] = k.cpu
    if k.memory:
        resources["memory"] = k.memory
    plan_path = f"{PLAN_MOUNT}/{rundir.PLAN}"
    env = [("LAUNCH4D_RUN_DIR", run_dir), ("LAUNCH4D_PLAN", plan_path),
           ("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]: ")]
    env += diagnostics_env(spec, run_dir, measured_nccl_env(plan)) + user_env(spec)
    lists = gpu_lists(plan)
    if any(lst != ",".join(str(i) for i in range(g)) for lst in lists):
        env.append(("LAUNCH4D_GPU_LISTS", " ".join(lists)))
    q = shell_quote
    if k.api == "trainjob":     # Trainer's torch plugin sets PET_*; the head's hostname is stable
        from launcher.render_trainjob import DEFAULT_PORT, head_host

        rendezvous = [f"master_addr=${{PET_MASTER_ADDR:-{head_host(name)}}}",
                      f"master_port=${{PET_MASTER_PORT:-{DEFAULT_PORT}}}"]
    else:                       # the training operator sets MASTER_ADDR/PORT on every pod
        rendezvous = ['master_addr="$MASTER_ADDR"', 'master_port="$MASTER_PORT"']
    script = "\n".join([
        "set -euo pipefail",
        "mkdir -p " + " ".join(q(f"{run_dir}/{d}") for d in (rundir.NCCL_LOGS, rundir.FLIGHT, rundir.HEARTBEAT)),
        # PET_NODE_RANK: both operators set it; an Indexed Job's pod (TrainJob) also has its index.
        "node_rank=${PET_NODE_RANK:-${JOB_COMPLETION_INDEX:-${RANK:-0}}}",
        *rendezvous,
        "if [ -n \"${LAUNCH4D_GPU_LISTS:-}\" ]; then lists=( $LAUNCH4D_GPU_LISTS ); "
        "export CUDA_VISIBLE_DEVICES=${lists[$node_rank]}; fi",
        f"exec python -m torch.distributed.run --nnodes={plan.nodes} --nproc-per-node={g} "
        "--node-rank=\"$node_rank\" --rdzv-backend=static --master-addr=\"$master_addr\" "
        "--master-port=\"$master_port\" --max-restarts=0 --tee=3 "
        f"--shutdown-timeout={shutdown_timeout(k.termination_grace_s)} "
        f"-m launcher.trainer {trainer_args(spec, plan_path, run_dir)}",
    ])
    if not k.image:
        raise UserError("backend.k8s.image: required; give an image with launch4d[train] installed "
                        "(build one from the repository's Containerfile)")
    bash_syntax_check(script, "pod command")
    return {
        "name": name,
        "configmap_name": check_k8s_name(f"{name}-plan", "name"),
        "k": k,
        "nodes": plan.nodes,
        "nproc": g,
        "resources": resources,
        "env": env,
        "command": ["bash", "-c", script],
        "plan_mount": PLAN_MOUNT,
        "plan_json": plan.to_json() + "\n",
        "log_dir": k8s_log_dir(spec),
        "master_port": k.master_port,
    }


def image_warnings(image: str) -> list[str]:
    """A `latest` (or missing) tag names a different image tomorrow: reruns stop being reruns."""
    last = image.rsplit("/", 1)[-1]
    if "@" in last:
        return []
    tag = last.split(":", 1)[1] if ":" in last else "latest"
    return [f"backend.k8s.image {image}: tag `latest` moves; pin a version or digest"] if tag == "latest" else []


#: Fields only one job kind reads; set on the other they would be silently without effect.
K8S_ONLY = {"pytorchjob": ("clean_pod_policy", "backoff_limit", "ttl_seconds_after_finished", "restart_policy"),
            "trainjob": ("runtime", "max_restarts", "topology")}


def k8s_warnings(spec: JobSpec) -> list[str]:
    """Settings that do not do what they say: a restart budget whose restarts cannot resume (the run
    dir must outlive the pods), and fields of the other job kind."""
    k = spec.backend.k8s
    out = []
    if k.api == "trainjob" and k.max_restarts and not k.pvc:
        out.append(f"backend.k8s.max_restarts {k.max_restarts} without backend.k8s.pvc: the run dir is in the "
                   "pods, so a restarted gang starts again from step 0")
    default = type(k)()
    for api, names in K8S_ONLY.items():
        if api != k.api:
            out += [f"backend.k8s.{n}: only read with api: {api}; ignored for api: {k.api}" for n in names
                    if getattr(k, n) != getattr(default, n)]
    return out


def render_k8s(spec: JobSpec, plan: Plan, run_dir: str | None = None,
               templates: str | Path | None = None, exclude: list[str] | None = None) -> Rendered:
    """The plan's ConfigMap, then a TrainJob (with its TrainingRuntime when one is needed) or a
    PyTorchJob. `exclude`: bad nodes from a BandwidthMap, kept out like backend.k8s.exclude_nodes."""
    import dataclasses

    if exclude:
        k = spec.backend.k8s
        k = dataclasses.replace(k, exclude_nodes=sorted(set(k.exclude_nodes) | set(exclude)))
        spec = dataclasses.replace(spec, backend=dataclasses.replace(spec.backend, k8s=k))
    run_dir = run_dir or f"{k8s_log_dir(spec)}/{spec.name}"
    ctx = k8s_context(spec, plan, run_dir)
    configmap = render_template("k8s/configmap.yaml.j2", ctx, templates)
    if spec.backend.k8s.api == "trainjob":
        from launcher import render_trainjob

        job = render_trainjob.dump(render_trainjob.documents(ctx))
    else:
        job = render_template("k8s/pytorchjob.yaml.j2", ctx, templates)
    manifests = parse_manifests(configmap + "---\n" + job)
    check_manifests(manifests)
    return Rendered("k8s", run_dir, "manifest.yaml",
                    {"manifest.yaml": configmap + "---\n" + job, rundir.PLAN: plan.to_json() + "\n"},
                    warnings=image_warnings(spec.backend.k8s.image or "") + k8s_warnings(spec))


def parse_manifests(text: str) -> list[dict]:
    import yaml

    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise UserError(f"rendered manifest is not valid YAML: {exc}") from None
    return docs


def check_manifests(docs: list[dict]) -> None:
    """What the PyTorchJob CRD requires, and the pod templates through the kubernetes client's
    models (which reject unknown fields and wrong shapes as the API server would)."""
    kinds = [d.get("kind") for d in docs]
    if kinds[-1:] == ["TrainJob"]:
        return _check_trainjob(docs)
    if kinds != ["ConfigMap", "PyTorchJob"]:
        raise UserError(f"rendered manifest holds {kinds}; expected a ConfigMap then a PyTorchJob")
    job = docs[1]
    if job.get("apiVersion") != "kubeflow.org/v1":
        raise UserError(f"PyTorchJob apiVersion {job.get('apiVersion')!r}; expected kubeflow.org/v1")
    specs = (job.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    if "Master" not in specs or set(specs) - {"Master", "Worker"}:
        raise UserError(f"PyTorchJob replica types {sorted(specs)}; expected Master and optional Worker")
    if specs["Master"].get("replicas") != 1:
        raise UserError("PyTorchJob Master must have exactly 1 replica")
    for role, rs in specs.items():
        containers = rs["template"]["spec"]["containers"]
        if not any(c.get("name") == "pytorch" for c in containers):
            raise UserError(f"PyTorchJob {role}: no container named 'pytorch' (the operator requires it)")
        to_model(rs["template"], "V1PodTemplateSpec")
    to_model(docs[0], "V1ConfigMap")


def _check_trainjob(docs: list[dict]) -> None:
    """ConfigMap, optional TrainingRuntime, TrainJob; every pod template and patch through the
    kubernetes client's models."""
    kinds = [d.get("kind") for d in docs]
    if kinds not in (["ConfigMap", "TrainJob"], ["ConfigMap", "TrainingRuntime", "TrainJob"]):
        raise UserError(f"rendered manifest holds {kinds}; expected a ConfigMap, [a TrainingRuntime,] a TrainJob")
    to_model(docs[0], "V1ConfigMap")
    for doc in docs[1:]:
        spec = doc.get("spec") or {}
        jobsets = [p["trainingRuntimeSpec"]["template"]["spec"] for p in spec.get("runtimePatches") or []]
        if doc["kind"] == "TrainingRuntime":
            jobsets.append(spec["template"]["spec"])
        for js in jobsets:
            for rj in js.get("replicatedJobs") or []:
                to_model(rj["template"]["spec"]["template"], "V1PodTemplateSpec")


def to_model(obj: dict, kind: str) -> Any:
    """Deserialize through the kubernetes client's models (validates shapes and required fields)."""
    import inspect

    from kubernetes.client import ApiClient

    class _Resp:  # older clients deserialize a response object
        def __init__(self, data: str):
            self.data = data

    client = ApiClient()
    try:
        if "response_text" in inspect.signature(client.deserialize).parameters:
            return client.deserialize(json.dumps(obj), kind, "application/json")
        return client.deserialize(_Resp(json.dumps(obj)), kind)
    except (ValueError, TypeError) as exc:
        raise UserError(f"rendered {kind} is invalid: {exc}") from None
