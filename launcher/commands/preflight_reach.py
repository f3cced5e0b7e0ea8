"""How `launch preflight` reaches the hosts, one small class per --backend that runs the node checks
from here (local, ssh, srun, k8s): the runner it fans out over (checks.runners), what a dry run says
of each host, and whose commands --drain prints by default. `reach(name, ...)` is the factory; the
command never branches on the backend's name. (--backend slurm submits the checks as one batch job
instead: launcher.commands.preflight_cmd._slurm_job.)
"""

from __future__ import annotations

import shlex
from typing import Any

from launcher.commands import warn
from launcher.commands.preflight_opts import K8sOptions, SSHOptions
from launcher.errors import UserError


class Reach:
    """One way to the hosts; as it is, this machine (--backend local): no options, no connection."""

    name = "local"
    scheduler = "slurm"      # --drain's default

    def runner(self) -> Any:
        """The checks.runners Runner (a context manager: connections closed at the end)."""
        from checks.runners import get_runner

        kwargs = self.runner_options()   # what fails here (no credentials) says its own line
        try:
            return get_runner(self.name, **kwargs)
        except Exception as exc:  # noqa: BLE001 - e.g. no kubeconfig: one line, exit 2
            raise UserError(f"--backend {self.name}: {type(exc).__name__}: {exc}") from None

    def runner_options(self) -> dict[str, Any]:
        return {}

    def step(self, i: int, host: str, script: str, deadline: int) -> dict[str, Any]:
        """--dry-run: how `host` (the i-th, from 1) would get the probe script; nothing reached."""
        return {"via": "this machine"}


class SSHReach(Reach):
    name = "ssh"

    def __init__(self, ssh: SSHOptions):
        self.ssh = ssh

    def runner_options(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self.ssh)

    def step(self, i: int, host: str, script: str, deadline: int) -> dict[str, Any]:
        s = self.ssh
        return {"via": f"ssh {s.user + '@' if s.user else ''}{host}{':' + str(s.port) if s.port else ''}"
                       f"{' via ' + s.jump if s.jump else ''}"}


class SrunReach(Reach):
    name = "srun"

    def step(self, i: int, host: str, script: str, deadline: int) -> dict[str, Any]:
        return {"via": f"srun --nodes=1 --ntasks=1 --nodelist={shlex.quote(host)} --overlap bash -c SCRIPT"}


class K8sReach(Reach):
    """One pod per host, submitted through the Kubernetes backend and recorded like a job."""

    name = "k8s"
    scheduler = "k8s"

    def __init__(self, k8s: K8sOptions, gpus: int | None):
        self.k8s, self.gpus = k8s, gpus

    def runner_options(self) -> dict[str, Any]:
        from launcher.render import render_template

        return dict(kube=k8s_backend(self.k8s.kube_context), render=render_template, namespace=self.k8s.namespace,
                    image=self.k8s.image, gpus=self.gpus, on_submit=record_pod)

    def step(self, i: int, host: str, script: str, deadline: int) -> dict[str, Any]:
        from checks.runners.k8s import render_pod
        from launcher.render import render_template

        k = self.k8s
        try:
            pod = render_pod(render_template, name=f"launch4d-preflight-dryrun-{i}", namespace=k.namespace, node=host,
                             image=k.image, command=script, run_id="dryrun", gpus=self.gpus, deadline=deadline)
        except ValueError as exc:
            raise UserError(f"--hosts: {exc}") from None
        return {"pod": pod, "via": f"a pod on node {host} in namespace {k.namespace}"
                                   f"{' (context ' + k.kube_context + ')' if k.kube_context else ''}"}


def reach(name: str, ssh: SSHOptions, k8s: K8sOptions, gpus: int | None) -> Reach:
    """The way to the hosts for a --backend that runs the checks from here."""
    ways = {"local": Reach, "srun": SrunReach, "ssh": lambda: SSHReach(ssh), "k8s": lambda: K8sReach(k8s, gpus)}
    return ways[name]()


def k8s_backend(context: str | None) -> Any:
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


def record_pod(job: Any) -> None:
    """Record a preflight pod like a training job, so `launch status|logs|cancel <pod>` follow it."""
    from launcher.backends.jobstate import record

    try:
        record(job)
    except UserError as exc:
        warn(f"warning: pod {job.id} was submitted but not recorded ({exc})")
