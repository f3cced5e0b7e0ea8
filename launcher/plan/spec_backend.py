"""Job-file sections `backend` and `diagnostics`: where and how the job is launched and observed.

Kept apart from spec.py because they only matter to the renderer and the backends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from launcher.errors import SpecError
from launcher.plan.schema import bounded, show

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: backend.env names that make a shell, the dynamic loader or an interpreter run code of the value's
#: choosing in every process that inherits them, launch4d's own scripts first (the sbatch script, the
#: local run's wrapper, the pods' command): refused, with what each one does.
ENV_RUNS_CODE: dict[str, str] = {
    **dict.fromkeys(("BASH_ENV", "ENV"), "makes every non-interactive shell source the file it names"),
    **dict.fromkeys(("PROMPT_COMMAND", "PS0", "PS1", "PS2", "PS3", "PS4"),
                    "is a command (or a prompt expanded like one) that the shell runs"),
    **dict.fromkeys(("SHELLOPTS", "BASHOPTS", "BASH_XTRACEFD", "IFS", "CDPATH", "GLOBIGNORE", "EXECIGNORE",
                     "BASH_LOADABLES_PATH", "BASH_COMPAT"), "changes how every bash script runs"),
    **dict.fromkeys(("LD_PRELOAD", "LD_AUDIT", "GLIBC_TUNABLES"),
                    "makes the dynamic loader run code in every program that starts"),
    **dict.fromkeys(("PYTHONSTARTUP", "PYTHONINSPECT", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONEXECUTABLE",
                     "PERL5OPT", "PERL5LIB", "PERLLIB", "RUBYOPT", "RUBYLIB", "NODE_OPTIONS",
                     "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS"),
                    "makes an interpreter run or load code of its choosing"),
}
#: Allowed on purpose (a container's or a site's own libraries and modules): they reach the trainer's
#: command only (`NAME=value python -m torch.distributed.run ...`), never launch4d's own shells.
ENV_TRAINER_ONLY = ("LD_LIBRARY_PATH", "PATH", "PYTHONPATH")


def env_problem(key: str) -> str | None:
    """Why backend.env may not set `key`, or None."""
    if key.startswith("BASH_FUNC_"):
        why: str | None = "defines a bash function every bash script imports"
    elif not ENV_NAME.fullmatch(key):
        return "not a valid environment variable name (letters, digits and '_', not starting with a digit)"
    elif key in ENV_TRAINER_ONLY:
        return None
    else:
        why = ENV_RUNS_CODE.get(key)
    if why is None and key.startswith("LD_"):
        why = "changes how the dynamic loader starts every program"
    if why:
        return (f"{why}; backend.env may not set it (put setup steps in backend.slurm.setup or the image; "
                f"{', '.join(ENV_TRAINER_ONLY)} are passed to the trainer only)")
    return None


def check_env(env: dict[str, str]) -> None:
    for key, value in env.items():
        why = env_problem(key)
        if why:
            raise SpecError(f"backend.env.{key if ENV_NAME.fullmatch(key.rstrip('%')) else show(key)}", why)
        if "\x00" in value:
            raise SpecError(f"backend.env.{key}", "a NUL byte cannot be in an environment variable")


def split_env(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """backend.env as (exported to every process of the job, given to the trainer's command only)."""
    return ({k: v for k, v in env.items() if k not in ENV_TRAINER_ONLY},
            {k: v for k, v in env.items() if k in ENV_TRAINER_ONLY})


@dataclass(frozen=True)
class NodeCheckSpec:
    """A quick self-check on every allocated node before torchrun starts. A node that fails is
    excluded from the job (ExcNodeList) and the job requeues, so a requeue never waits for it."""

    enabled: bool = True
    gpus: bool | None = None        # nvidia-smi lists the node's GPUs and answers; None: when the plan has GPUs
    xid: bool | None = None         # no new NVRM Xid in the kernel log since the last check; None: as gpus
    nics: bool = True               # the NICs the plan expects (plan ranks' nic) are up
    command: str | None = None      # the site's own check, run on each node; non-zero exit = bad node
    timeout_s: int = bounded(120, 5)


#: Signals the checkpoint-and-requeue path may use. Not USR1 by default: NCCL 2.12.7 to 2.13.4
#: install their own SIGUSR1 handler (a proxy state dump) over the trainer's.
CheckpointSignal = Literal["USR2", "USR1", "URG", "XCPU", "HUP"]


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
    # host is refused unless accept_unknown_host is true (its key is then added to known_hosts,
    # like OpenSSH's accept-new; a changed key is always refused). identity_file names a key file.
    identity_file: str | None = None
    known_hosts: str | None = None
    accept_unknown_host: bool = False
    ssh_timeout_s: int = bounded(15, 1)
    master_port: int | None = bounded(None, 1024, 65535)
    checkpoint_signal: CheckpointSignal = "USR2"
    switches_wait: str | None = None    # --switches=N@<this>: how long to wait for N leaf switches
    reservation: str | None = None
    constraint: str | None = None       # --constraint (features: "a100&ib", "[rack1|rack2]")
    gres: str | None = None             # extra generic resources beside the GPUs ("nvme:1")
    mail_user: str | None = None
    mail_type: str | None = None        # BEGIN,END,FAIL,REQUEUE,ALL,...
    comment: str | None = None
    segment: int | None = bounded(None, 1)  # --segment (topology/block: nodes per block segment)
    extra: list[str] = field(default_factory=list)  # any other sbatch option: "--flag=value" or "--flag"
    container_runtime: Literal["pyxis", "apptainer", "none"] = "pyxis"
    apptainer: str = "apptainer"        # the apptainer (or singularity) command on the nodes
    node_check: NodeCheckSpec = field(default_factory=NodeCheckSpec)


@dataclass(frozen=True)
class K8sTopologySpec:
    """Kueue topology-aware scheduling: the node label of a level (rack, block) the whole gang must
    (`required`) or should (`preferred`) fit in. At most one of the two."""

    required: str | None = bounded(None, doc="node label of the level every pod must share (Kueue TAS)")
    preferred: str | None = bounded(None, doc="node label of the level the pods should share (Kueue TAS)")


@dataclass(frozen=True)
class K8sSpec:
    api: Literal["trainjob", "pytorchjob"] = bounded(
        "trainjob", doc="trainjob: Kubeflow Trainer v2 TrainJob (JobSet); pytorchjob: kubeflow.org/v1 PyTorchJob")
    namespace: str = "default"
    image: str | None = bounded(None, doc="required: an image with launch4d[train] installed (see Containerfile)")
    runtime: str = bounded("torch-distributed", doc="TrainJob: the ClusterTrainingRuntime it refers to")
    max_restarts: int = bounded(0, 0, 1000, doc="TrainJob: whole-gang restarts (JobSet failurePolicy) before it fails")
    topology: K8sTopologySpec = field(default_factory=K8sTopologySpec)
    termination_grace_s: int = bounded(
        300, 30, 86400, doc="SIGTERM to kill on preemption or cancel: the trainer checkpoints in between")
    exclude_nodes: list[str] = field(default_factory=list)  # kept out: nodeAffinity NotIn on the hostname
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

    def __post_init__(self) -> None:
        check_env(self.env)


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
