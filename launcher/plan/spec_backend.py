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


def listed(doc: str, factory=list):
    """A list or mapping field (empty by default) with its one-line meaning for the reference."""
    return field(default_factory=factory, metadata={"doc": doc})


@dataclass(frozen=True)
class NodeCheckSpec:
    """A quick self-check on every allocated node before torchrun starts. A node that fails is
    excluded from the job (ExcNodeList) and the job requeues, so a requeue never waits for it."""

    enabled: bool = bounded(True, doc="run the check at all")
    gpus: bool | None = bounded(None, doc="nvidia-smi lists the node's GPUs and answers (default: when the plan "
                                          "has GPUs)")
    xid: bool | None = bounded(None, doc="no new NVRM Xid in the kernel log since the last check (default: as gpus)")
    nics: bool = bounded(True, doc="the NICs the plan expects (its ranks' nic, from a bandwidth map) are up")
    command: str | None = bounded(None, doc="the site's own check, run on each node; a non-zero exit marks the "
                                            "node bad")
    timeout_s: int = bounded(120, 5, doc="seconds the whole check may take on a node")


#: Signals the checkpoint-and-requeue path may use. Not USR1 by default: NCCL 2.12.7 to 2.13.4
#: install their own SIGUSR1 handler (a proxy state dump) over the trainer's.
CheckpointSignal = Literal["USR2", "USR1", "URG", "XCPU", "HUP"]


@dataclass(frozen=True)
class SlurmSpec:
    partition: str | None = bounded(None, doc="sbatch --partition")
    account: str | None = bounded(None, doc="sbatch --account (the allocation charged)")
    qos: str | None = bounded(None, doc="sbatch --qos")
    time: str = bounded("01:00:00", doc="sbatch --time: the wall-clock limit (minutes, HH:MM:SS, D-HH:MM:SS ...)")
    cpus_per_task: int | None = bounded(None, 1, doc="sbatch --cpus-per-task (one task per node: the node's CPUs "
                                                     "for torchrun and its workers)")
    mem: str | None = bounded(None, doc="sbatch --mem per node (e.g. 0 for all of it, 512G)")
    exclusive: bool = bounded(True, doc="sbatch --exclusive: no other job shares the nodes")
    requeue: bool = bounded(True, doc="on preemption or time limit: checkpoint, then requeue (--requeue); false: "
                                      "--no-requeue")
    signal_seconds: int = bounded(120, 1, doc="seconds before the time limit Slurm sends checkpoint_signal "
                                              "(--signal=B:SIG@N)")
    switches: int | None = bounded(None, 1, doc="sbatch --switches: at most this many leaf switches for the job")
    exclude: list[str] = listed("nodes never to use (--exclude), beside those preflight found bad")
    nodelist: list[str] = listed("nodes the job must run on (--nodelist)")
    dependency: str | None = bounded(None, doc="sbatch --dependency (e.g. afterok:1234)")
    container_image: str | None = bounded(None, doc="an image every node runs the job in (pyxis or apptainer, "
                                                    "container_runtime)")
    container_mounts: list[str] = listed("binds into the container beside the run dir (src:dst)")
    login_host: str | None = bounded(None, doc="submit over SSH through this login node instead of here")
    login_user: str | None = bounded(None, doc="SSH user on the login node (default: yours)")
    login_port: int = bounded(22, 1, 65535, doc="SSH port of the login node")
    remote_dir: str | None = bounded(None, doc="where run dirs go on the login node's filesystem (relative: to its "
                                               "$HOME)")
    gres_gpus: bool = bounded(True, doc="ask Slurm for the GPUs (--gpus-per-node); false on clusters whose GPU "
                                        "nodes need no GPU request, and never asked for a CPU job (gpu: cpu)")
    python: str = bounded("python3", doc="the Python on the nodes that runs torchrun and the trainer")
    setup: list[str] = listed("shell lines the batch script runs first, as written (module load ..., source venv)")
    # SSH submission (login_host set): host keys are checked against known_hosts; an unknown
    # host is refused unless accept_unknown_host is true (its key is then added to known_hosts,
    # like OpenSSH's accept-new; a changed key is always refused). identity_file names a key file.
    identity_file: str | None = bounded(None, doc="SSH private key file for the login node")
    known_hosts: str | None = bounded(None, doc="known_hosts file the login node's key is checked against "
                                                "(default: ~/.ssh/known_hosts)")
    accept_unknown_host: bool = bounded(False, doc="accept and record an unknown login node's key (OpenSSH's "
                                                   "accept-new); a changed key is always refused")
    ssh_timeout_s: int = bounded(15, 1, doc="seconds to connect to the login node")
    master_port: int | None = bounded(None, 1024, 65535, doc="torchrun's rendezvous port on the first node "
                                                             "(default: 20000 + job id mod 20000)")
    checkpoint_signal: CheckpointSignal = bounded("USR2", doc="the signal that asks the trainer to checkpoint "
                                                              "before preemption or the time limit")
    switches_wait: str | None = bounded(None, doc="--switches=N@<this>: how long to wait for N leaf switches")
    reservation: str | None = bounded(None, doc="sbatch --reservation")
    constraint: str | None = bounded(None, doc="sbatch --constraint: node features (\"a100&ib\", "
                                               "\"[rack1|rack2]\")")
    gres: str | None = bounded(None, doc="extra generic resources beside the GPUs (--gres, e.g. nvme:1)")
    mail_user: str | None = bounded(None, doc="sbatch --mail-user")
    mail_type: str | None = bounded(None, doc="sbatch --mail-type (BEGIN, END, FAIL, REQUEUE, ALL, ...)")
    comment: str | None = bounded(None, doc="sbatch --comment")
    segment: int | None = bounded(None, 1, doc="sbatch --segment (topology/block: nodes per block segment)")
    extra: list[str] = listed("any other sbatch option, \"--flag=value\" or \"--flag\" (checked against "
                              "sbatch's own; those launch4d sets are refused)")
    container_runtime: Literal["pyxis", "apptainer", "none"] = bounded(
        "pyxis", doc="how container_image runs: pyxis (srun --container-image), apptainer (exec --nv) or none")
    apptainer: str = bounded("apptainer", doc="the apptainer (or singularity) command on the nodes")
    node_check: NodeCheckSpec = field(default_factory=NodeCheckSpec,
                                      metadata={"doc": "the self-check every node passes before torchrun starts"})


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
    namespace: str = bounded("default", doc="the namespace the job and its ConfigMap go in")
    image: str | None = bounded(None, doc="required: an image with launch4d[train] installed (see Containerfile)")
    runtime: str = bounded("torch-distributed", doc="TrainJob: the ClusterTrainingRuntime it refers to")
    max_restarts: int = bounded(0, 0, 1000, doc="TrainJob: whole-gang restarts (JobSet failurePolicy) before it fails")
    topology: K8sTopologySpec = field(default_factory=K8sTopologySpec,
                                      metadata={"doc": "Kueue topology-aware scheduling: the level the gang shares"})
    termination_grace_s: int = bounded(
        300, 30, 86400, doc="SIGTERM to kill on preemption or cancel: the trainer checkpoints in between")
    exclude_nodes: list[str] = listed("nodes kept out (nodeAffinity NotIn on the hostname), beside those "
                                      "preflight labelled failed")
    image_pull_secrets: list[str] = listed("Secrets the pods pull the image with (imagePullSecrets)")
    service_account: str | None = bounded(None, doc="the pods' serviceAccountName")
    scheduler_name: str | None = bounded(None, doc="the pods' schedulerName (a gang scheduler such as volcano)")
    queue: str | None = bounded(None, doc="Kueue LocalQueue: the job is created suspended and Kueue admits it")
    priority_class: str | None = bounded(None, doc="queued: Kueue's WorkloadPriorityClass (a label); not queued: "
                                                   "the pods' priorityClassName")
    node_selector: dict[str, str] = listed("node labels the pods must match (nodeSelector)", dict)
    tolerations: list[dict[str, str]] = listed("the pods' tolerations (key, operator, value, effect)")
    rdma_resource: str | None = bounded(None, doc="an extended resource each pod asks one of for RDMA "
                                                  "(e.g. rdma/ib)")
    cpu: str | None = bounded(None, doc="CPU each pod requests and is limited to (a quantity: 96, 500m)")
    memory: str | None = bounded(None, doc="memory each pod requests and is limited to (a quantity: 1600Gi)")
    shm_size: str = bounded("16Gi", doc="size of the in-memory /dev/shm (dataloader workers, NCCL)")
    clean_pod_policy: Literal["None", "All", "Running"] = bounded(
        "None", doc="PyTorchJob: which pods are deleted when the job ends")
    backoff_limit: int = bounded(3, 0, doc="PyTorchJob: pod restarts before the job fails")
    ttl_seconds_after_finished: int | None = bounded(None, 0, doc="PyTorchJob: delete the job this long after it "
                                                                  "ends")
    env_from_secrets: list[str] = listed("Secrets whose keys become the pods' environment (envFrom): credentials "
                                         "never go into the rendered file")
    restart_policy: Literal["OnFailure", "Never", "ExitCode", "Always"] = bounded(
        "OnFailure", doc="PyTorchJob: when a replica's pod restarts")
    pvc: str | None = bounded(None, doc="a PersistentVolumeClaim mounted at log_dir: run dirs (checkpoints, logs) "
                                        "outlive the pods")
    master_port: int = bounded(23456, 1024, 65535, doc="PyTorchJob: the rendezvous port the operator gives the "
                                                       "master")
    kubeconfig: str | None = bounded(None, doc="kubeconfig file (default: $KUBECONFIG or ~/.kube/config, else "
                                               "in-cluster)")
    context: str | None = bounded(None, doc="the kubeconfig context to use (default: its current one)")


@dataclass(frozen=True)
class BackendSpec:
    kind: Literal["local", "slurm", "k8s"] = bounded("local", doc="where `launch render|submit` sends the job")
    log_dir: str = bounded("runs", doc="run directories go under it (under Kubernetes: relative to /workspace)")
    slurm: SlurmSpec = field(default_factory=SlurmSpec, metadata={"doc": "Slurm settings (kind: slurm)"})
    k8s: K8sSpec = field(default_factory=K8sSpec, metadata={"doc": "Kubernetes settings (kind: k8s)"})
    env: dict[str, str] = listed("extra environment for the job's processes (names that run code are refused)",
                                 dict)

    def __post_init__(self) -> None:
        check_env(self.env)


@dataclass(frozen=True)
class DiagnosticsSpec:
    nccl_debug: Literal["VERSION", "WARN", "INFO", "TRACE", "off"] = bounded(
        "INFO", doc="NCCL_DEBUG, into <run dir>/logs/nccl/ (off: not set)")
    nccl_debug_subsys: str | None = bounded("INIT,NET", doc="NCCL_DEBUG_SUBSYS")
    flight_recorder: bool = bounded(True, doc="PyTorch's NCCL flight recorder, dumped on a timeout")
    flight_recorder_entries: int = bounded(2000, 1, doc="collectives the flight recorder keeps (TORCH_FR_BUFFER_SIZE)")
    init_timeout_s: int = bounded(600, 1, doc="seconds the process group may take to form")
    collective_timeout_s: int = bounded(600, 1, doc="seconds one collective may take before the watchdog fires")
    stall_dump_s: int = bounded(0, 0, doc="no progress this long: stacks into the run dir (0: half of "
                                          "collective_timeout_s)")
    socket_ifname: str | None = bounded(None, doc="NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME (default: "
                                                  "preflight's)")
    ib_hca: str | None = bounded(None, doc="NCCL_IB_HCA (default: the NICs nearest the job's GPUs, from preflight)")
