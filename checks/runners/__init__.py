"""Runners: how a command reaches a host (this machine, SSH, srun, a Slurm job, a Kubernetes pod).

base.py holds the Runner interface (run, run_multi, run_probes) and the probe script; one module per
way of reaching a host; `get_runner` picks one by --backend name.
"""

from __future__ import annotations

from checks.runners.base import Runner


def get_runner(backend: str, **kwargs: object) -> Runner:
    """The runner for a --backend name."""
    if backend == "local":
        from checks.runners.local import LocalRunner
        return LocalRunner(**kwargs)
    if backend == "ssh":
        from checks.runners.ssh import SSHRunner
        return SSHRunner(**kwargs)  # type: ignore[arg-type]
    if backend == "srun":
        from checks.runners.srun import SrunRunner
        return SrunRunner(**kwargs)  # type: ignore[arg-type]
    if backend == "k8s":
        from checks.runners.k8s import K8sRunner
        return K8sRunner(**kwargs)  # type: ignore[arg-type]
    raise ValueError(f"unknown backend {backend!r}")
