"""`launch preflight`'s options, one typed group per concern: which hosts, how SSH reaches them,
what is measured, the Slurm batch job, the Kubernetes pods, `--plan`'s probe, and how the results
are judged and written. Each group reaches the command as one dataclass (launcher.commands.options)."""

from __future__ import annotations

from dataclasses import dataclass

import click

from launcher.commands.options import dry_run_option, group, options, tolerance_option

BACKENDS = ["ssh", "local", "srun", "slurm", "k8s"]
SCHEDULERS = ["slurm", "k8s"]


@dataclass(frozen=True)
class HostOptions:
    hosts_expr: str | None
    hostfile: str | None
    slurm_allocation: bool


HOSTS = group(HostOptions, "where",
              click.option("--hosts", "hosts_expr", help="Hosts as a list or Slurm hostlist: node[01-16,20]."),
              click.option("--hostfile", type=click.Path(dir_okay=False), help="File with one host per line."),
              click.option("--slurm-allocation", is_flag=True, help="The nodes of the current Slurm allocation."))
BACKEND = click.option("--backend", type=click.Choice(BACKENDS), help="How to reach the hosts (default: ssh with "
                       "hosts, srun with --slurm-allocation, else local).")


@dataclass(frozen=True)
class SSHOptions:
    """The SSH runner's own keywords (checks.runners.ssh.SSHRunner)."""

    user: str | None
    port: int | None
    identity_file: str | None
    known_hosts: str | None
    accept_new_hosts: bool
    jump: str | None
    ssh_config: str | None
    connect_timeout: float


SSH = group(SSHOptions, "ssh",
            click.option("--user", help="SSH user."),
            click.option("--port", type=click.IntRange(1, 65535), help="SSH port."),
            click.option("--identity-file", "-i", type=click.Path(dir_okay=False), help="SSH private key."),
            click.option("--known-hosts", type=click.Path(dir_okay=False),
                         help="known_hosts file (default ~/.ssh/known_hosts)."),
            click.option("--accept-new-hosts", is_flag=True, help="Trust and record host keys seen for the first time."),
            click.option("--jump", help="Jump host (login node): [user@]host[:port]."),
            click.option("--ssh-config", type=click.Path(dir_okay=False), help="OpenSSH config for host aliases."),
            click.option("--connect-timeout", type=click.FloatRange(0.1), default=10.0, show_default=True))


@dataclass(frozen=True)
class CheckOptions:
    """What the node checks measure and how long each may take."""

    probe_timeout: float
    nccl_timeout: float
    workers: int
    level: str
    tool_timeouts: tuple[str, ...]
    no_nccl: bool
    no_pairs: bool
    no_all: bool
    nccl_binary: str
    sizes: str
    nccl_args: str
    launcher_tpl: str | None
    save_raw: str | None


CHECKS = group(
    CheckOptions, "checks",
    click.option("--probe-timeout", type=click.FloatRange(1), default=60.0, show_default=True,
                 help="Seconds per probe command."),
    click.option("--nccl-timeout", type=click.FloatRange(1), default=900.0, show_default=True,
                 help="Seconds per nccl-tests run."),
    click.option("--workers", type=click.IntRange(1), default=64, show_default=True, help="Hosts handled at once."),
    click.option("--level", type=click.Choice(["quick", "standard", "long"]), default="quick", show_default=True,
                 help="quick: probes + nccl-tests; standard: + dcgmi diag -r 2, nvbandwidth, nvlink -e around NCCL; "
                      "long: + dcgmi diag -r 3, all_to_all_perf, per-NIC ib_write_bw --use_cuda between pairs."),
    click.option("--tool-timeout", "tool_timeouts", multiple=True, metavar="TOOL=SECONDS",
                 help="Timeout of one deeper tool (repeatable): dcgmi (default 900 at standard, 3600 at long), "
                      "nvbandwidth (900), nvlink (60), ib_write_bw (120), all_to_all_perf (--nccl-timeout). "
                      "A tool that runs past it is reported for its node, not waited for."),
    click.option("--no-nccl", is_flag=True, help="Only the node probes, no nccl-tests."),
    click.option("--no-pairs", is_flag=True, help="Skip the node-pair rounds."),
    click.option("--no-all", is_flag=True, help="Skip the all-node run."),
    click.option("--nccl-binary", default="all_reduce_perf", show_default=True),
    click.option("--sizes", default="512M,8G", show_default=True, help="nccl-tests -b,-e."),
    click.option("--nccl-args", default="", help="Extra nccl-tests arguments."),
    click.option("--launcher", "launcher_tpl", help="Multi-node launch template, e.g. 'mpirun -np {np} -H "
                 "{hosts_slots} {cmd}' or 'srun --mpi=pmix -N {nnodes} -w {hostlist} ... {cmd}'."),
    click.option("--save-raw", type=click.Path(file_okay=False), help="Also keep every raw output here, in the "
                 "`preflight import` layout (judge it again later with other thresholds)."))


@dataclass(frozen=True)
class SlurmJobOptions:
    """--backend slurm: the batch job (and preflight --plan's); gpus_per_node serves the pods too."""

    out_dir: str | None
    partition: str | None
    account: str | None
    time_limit: str | None
    gpus_per_node: int | None
    srun_mpi: str


SLURM_JOB = group(
    SlurmJobOptions, "slurm",
    click.option("--out-dir", type=click.Path(file_okay=False), help="slurm backend: where the job writes outputs."),
    click.option("--partition", help="slurm backend: partition."),
    click.option("--account", help="slurm backend: account."),
    click.option("--time", "time_limit", help="slurm backend: time limit (default: 00:30:00 quick, 02:00:00 "
                 "standard, 04:00:00 long: dcgmi diag -r 3 alone can take an hour)."),
    click.option("--gpus-per-node", type=click.IntRange(1), help="slurm/k8s backends: GPUs per node."),
    click.option("--mpi", "srun_mpi", default="pmix", show_default=True, help="slurm backend: srun --mpi plugin."))
DRY_RUN = dry_run_option("Print what would run where (script, pod, batch job); connect to nothing, create nothing.")


@dataclass(frozen=True)
class K8sOptions:
    namespace: str
    image: str
    kube_context: str | None


K8S = group(K8sOptions, "k8s",
            click.option("--namespace", default="default", show_default=True, help="k8s backend: namespace."),
            click.option("--image", default="nvcr.io/nvidia/pytorch:24.05-py3", show_default=True,
                         help="k8s backend: image with nvidia-smi and nccl-tests."),
            click.option("--kube-context", help="k8s backend: kubeconfig context."))


@dataclass(frozen=True)
class PlanProbeOptions:
    """--plan: measure the plan's own communication groups (launcher/commands/preflight_plan.py)."""

    plan_file: str | None
    tolerance: float
    iters: int
    node_python: str | None
    master_addr: str | None
    master_port: int


PLAN_PROBE = group(
    PlanProbeOptions, "probe",
    click.option("--plan", "plan_file", type=click.Path(dir_okay=False),
                 help="Measure this plan.json's own communication groups instead (TP, CP, PP neighbours, DP/ZeRO, EP: "
                      "each group's collective at the plan's message size) and compare them with what its time model "
                      "assumed; --backend local (default), ssh (--hosts: node i is host i), slurm (a batch job; waits) "
                      "or k8s (a one-off gang of pods; waits)."),
    tolerance_option("With --plan: a group measuring below (1 - tolerance) x the assumed bandwidth fails (exit 1)."),
    click.option("--iters", type=click.IntRange(1, 1000), default=5, show_default=True,
                 help="With --plan: timed calls per group (the median counts), after 2 untimed ones."),
    click.option("--python", "node_python", default=None,
                 help="With --plan --backend ssh|k8s: the Python on the nodes (in the image) that has launch4d[train] "
                      "(default: python3 over SSH, python in a pod)."),
    click.option("--master-addr", help="With --plan --backend ssh: the address the nodes reach the first host at "
                                       "(default: the first host's name)."),
    click.option("--master-port", type=click.IntRange(1024, 65535), default=29511, show_default=True,
                 help="With --plan --backend ssh|k8s: the probe's rendezvous port on the first node."))


@dataclass(frozen=True)
class JudgeOptions:
    """How the measurements are judged, written and acted on (preflight and preflight import)."""

    thresholds: str | None
    expected_gpus: int | None
    min_intra_busbw: float | None
    min_inter_busbw: float | None
    output: str | None
    exclude_failed: bool
    drain: bool
    scheduler: str | None
    do_apply: bool


JUDGE = group(
    JudgeOptions, "judge",
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
    click.option("--apply", "do_apply", is_flag=True, help="With --drain: run those commands."))

#: Every option of `launch preflight` itself, in --help's order.
PREFLIGHT = options(HOSTS, BACKEND, SSH, CHECKS, SLURM_JOB, DRY_RUN, K8S, PLAN_PROBE, JUDGE)
