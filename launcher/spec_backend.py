"""Job-file sections `backend` and `diagnostics`: where and how the job is launched and observed.

Kept apart from spec.py because they only matter to the renderer and the backends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from launcher.schema import bounded


@dataclass(frozen=True)
class SlurmSpec:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "01:00:00"
    cpus_per_task: int | None = bounded(None, 1)
    mem: str | None = None
    exclusive: bool = True
    requeue: bool = True
    signal_seconds: int = bounded(120, 1)
    switches: int | None = bounded(None, 1)
    exclude: list[str] = field(default_factory=list)
    nodelist: list[str] = field(default_factory=list)
    dependency: str | None = None
    container_image: str | None = None
    container_mounts: list[str] = field(default_factory=list)
    login_host: str | None = None
    login_user: str | None = None
    login_port: int = bounded(22, 1, 65535)
    remote_dir: str | None = None
    gres_gpus: bool = True
    python: str = "python3"
    setup: list[str] = field(default_factory=list)
    # SSH submission (login_host set): host keys are checked against known_hosts; an unknown
    # host is refused unless accept_unknown_host is true. identity_file names a key file.
    identity_file: str | None = None
    known_hosts: str | None = None
    accept_unknown_host: bool = False
    ssh_timeout_s: int = bounded(15, 1)
    master_port: int | None = bounded(None, 1024, 65535)


@dataclass(frozen=True)
class K8sSpec:
    namespace: str = "default"
    image: str = "pytorch/pytorch:latest"
    image_pull_secrets: list[str] = field(default_factory=list)
    service_account: str | None = None
    scheduler_name: str | None = None
    queue: str | None = None
    priority_class: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, str]] = field(default_factory=list)
    rdma_resource: str | None = None
    cpu: str | None = None
    memory: str | None = None
    shm_size: str = "16Gi"
    clean_pod_policy: Literal["None", "All", "Running"] = "None"
    backoff_limit: int = bounded(3, 0)
    ttl_seconds_after_finished: int | None = bounded(None, 0)
    env_from_secrets: list[str] = field(default_factory=list)
    restart_policy: Literal["OnFailure", "Never", "ExitCode", "Always"] = "OnFailure"
    pvc: str | None = None
    master_port: int = bounded(23456, 1024, 65535)
    kubeconfig: str | None = None
    context: str | None = None


@dataclass(frozen=True)
class BackendSpec:
    kind: Literal["local", "slurm", "k8s"] = "local"
    log_dir: str = "runs"
    slurm: SlurmSpec = field(default_factory=SlurmSpec)
    k8s: K8sSpec = field(default_factory=K8sSpec)
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DiagnosticsSpec:
    nccl_debug: Literal["VERSION", "WARN", "INFO", "TRACE", "off"] = "INFO"
    nccl_debug_subsys: str | None = "INIT,NET"
    flight_recorder: bool = True
    flight_recorder_entries: int = bounded(2000, 1)
    init_timeout_s: int = bounded(600, 1)
    collective_timeout_s: int = bounded(600, 1)
    stall_dump_s: int = bounded(0, 0)  # no progress this long: stacks into the run dir (0: half the above)
    socket_ifname: str | None = None
    ib_hca: str | None = None
    heartbeat: bool = True
