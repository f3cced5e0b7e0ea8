"""A real multi-node Slurm on this one machine, for the launcher's integration tests.

Debian's slurm-wlm: munge, one slurmctld, and one slurmd per node name on distinct ports
(`slurmd -N NAME`), each slurmd with its own spool/pid/log files through `%n`. Every node has two
fake GPUs (gres.conf `File=` pointing at plain files), so `#SBATCH --gpus-per-node=2` is
accepted. Each slurmd runs in its own UTS namespace where the kernel allows it, so the tasks
of node n1 see hostname `n1`, which lets a test check which "node" each rank ran on. Nothing in
/etc/slurm is touched: commands find this cluster through $SLURM_CONF. Recipe:
../shared/notes/testbed.md.

`slurm_cluster` is a session-scoped pytest fixture; it skips with a reason where slurm-wlm or
munge is not installed or we are not root (install them with `bash .ci/setup-services.sh`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

NODE_NAMES = ("n1", "n2")
GPUS_PER_NODE = 2
CPUS_PER_NODE = 2
PARTITION = "debug"


def _free_ports(n: int) -> list[int]:
    """n distinct free ports: all n sockets are held open while choosing, or the kernel may hand
    the same just-closed port out twice (slurmctld and a slurmd then collide on it)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}")
                                       if os.access(p, os.X_OK)), None)


def _tool(name: str) -> str:
    """The path of a tool that missing_reason() found."""
    path = _which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed")
    return path


def missing_reason() -> str | None:
    for tool in ("slurmctld", "slurmd", "sbatch", "munged", "munge"):
        if not _which(tool):
            return f"{tool} is not installed (run `bash .ci/setup-services.sh` as root: apt slurm-wlm munge)"
    if os.geteuid() != 0:
        return "a private Slurm needs root (SlurmUser=root, slurmd runs as root)"
    return None


def _uts_namespaces_work() -> bool:
    if not _which("unshare"):
        return False
    try:
        out = subprocess.run(["unshare", "--uts", "sh", "-c", "hostname launch4d-probe && hostname"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == "launch4d-probe"


@dataclass
class SlurmCluster:
    root: Path
    nodes: tuple[str, ...] = NODE_NAMES
    partition: str = PARTITION
    separate_hostnames: bool = False
    procs: list[subprocess.Popen] = field(default_factory=list)
    munged_pid: int | None = None

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(args), capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    # --- setup ------------------------------------------------------------------------------
    def write_config(self) -> None:
        host = socket.gethostname()
        gpu_dir = self.root / "fakegpu"
        gpu_dir.mkdir(parents=True, exist_ok=True)
        for i in range(GPUS_PER_NODE):
            (gpu_dir / f"fakegpu{i}").touch()
        (self.root / "state").mkdir(exist_ok=True)
        ctl_port, *node_ports = _free_ports(1 + len(self.nodes))
        lines = [
            "ClusterName=launch4d",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctl_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "GresTypes=gpu",
            "SchedulerType=sched/backfill",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "KillWait=5",
            "MinJobAge=600",
            "MessageTimeout=20",
            "SlurmdTimeout=120",
            f"StateSaveLocation={self.root}/state",
            f"SlurmctldPidFile={self.root}/slurmctld.pid",
            f"SlurmctldLogFile={self.root}/slurmctld.log",
            f"SlurmdSpoolDir={self.root}/slurmd.%n",
            f"SlurmdPidFile={self.root}/slurmd.%n.pid",
            f"SlurmdLogFile={self.root}/slurmd.%n.log",
        ]
        for name, port in zip(self.nodes, node_ports, strict=True):
            lines.append(f"NodeName={name} NodeHostname={name if self.separate_hostnames else host} "
                         f"NodeAddr=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} RealMemory=4000 "
                         f"Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=NO")
        self.conf.write_text("\n".join(lines) + "\n")
        (self.root / "gres.conf").write_text(
            f"NodeName={','.join(self.nodes)} Name=gpu File={gpu_dir}/fakegpu[0-{GPUS_PER_NODE - 1}]\n")

    def _start_munge(self) -> None:
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return  # a munged is already answering; share it
        key = Path("/etc/munge/munge.key")
        key.parent.mkdir(parents=True, exist_ok=True)
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        for d in ("/etc/munge", "/var/log/munge", "/run/munge", "/var/lib/munge"):
            Path(d).mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        subprocess.run(["runuser", "-u", "munge", "--", _tool("munged")], check=True, timeout=30)
        for _ in range(50):
            if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
                pid_file = Path("/run/munge/munged.pid")
                if pid_file.exists():
                    self.munged_pid = int(pid_file.read_text().split()[0])
                return
            time.sleep(0.1)
        raise RuntimeError("munged did not start (munge -n | unmunge fails)")

    def start(self) -> None:
        self.separate_hostnames = _uts_namespaces_work()
        self.write_config()
        self._start_munge()
        log = open(self.root / "daemons.out", "ab")
        self.procs.append(subprocess.Popen([_tool("slurmctld"), "-D", "-f", str(self.conf)],
                                           env=self.env, stdout=log, stderr=log))
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, 30, "slurmctld")
        for name in self.nodes:
            cmd = [_tool("slurmd"), "-D", "-N", name, "-f", str(self.conf)]
            if self.separate_hostnames:
                cmd = ["unshare", "--uts", "sh", "-c", f'hostname {name} && exec "$@"', "sh", *cmd]
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=log))
        self._wait(self._nodes_idle, 60, "slurmd nodes idle")

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split("\n")
        states = dict(line.split() for line in out if line.strip())
        if any(s.rstrip("*") in ("down", "inval", "drain", "drng") for s in states.values()):
            self.run("scontrol", "update", f"nodename={','.join(self.nodes)}", "state=resume", check=False)
        return len(states) == len(self.nodes) and all(s == "idle" for s in states.values())

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{what}: a daemon exited ({p.args!r}); see {self.root}")
            time.sleep(0.3)
        raise RuntimeError(f"{what}: not ready after {timeout:.0f}s; logs in {self.root}")

    # --- helpers for tests ------------------------------------------------------------------
    def job_state(self, job_id: str) -> str | None:
        out = self.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T", check=False)
        return out.stdout.strip() or None

    def start_requeued_now(self, job_id: str) -> str | None:
        """Let a requeued, pending job start now instead of after Slurm's hold; returns its state.

        Slurm holds a requeued job for the credential lifetime (BeginTime) so that its previous run
        is gone from the nodes before it starts again: forced to start in the very second it was
        requeued, it was seen to end FAILED (exit 1, run time 0) without running a line. So the hold
        is lifted only once two seconds have passed since the requeue (the job's SubmitTime) and
        every node is idle again (the previous run's steps and epilog done).
        """
        fields = dict(kv.split("=", 1) for kv in self.run("scontrol", "-o", "show", "job", job_id,
                                                          check=False).stdout.split() if "=" in kv)
        state = fields.get("JobState")
        if state == "PENDING":
            try:
                requeued = datetime.strptime(fields.get("SubmitTime", ""), "%Y-%m-%dT%H:%M:%S").timestamp()
            except ValueError:
                requeued = time.time()
            if time.time() >= requeued + 2 and self._nodes_idle():
                self.run("scontrol", "update", f"jobid={job_id}", "StartTime=now", check=False)
        return state

    def wait_state(self, job_id: str, states: set[str], timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} is {state}, not {states} after {timeout:.0f}s")

    def stop_controller(self) -> None:
        """Stop slurmctld only (the slurmds and running jobs carry on), as an outage would."""
        ctl = self.procs[0]
        self.run("scontrol", "shutdown", "slurmctld", check=False)
        try:
            ctl.wait(timeout=30)
        except subprocess.TimeoutExpired:
            ctl.kill()
            ctl.wait()

    def impatient_client_conf(self, message_timeout_s: int = 5) -> Path:
        """A copy of slurm.conf for client commands only, with a shorter MessageTimeout: while slurmctld
        is down, squeue/scontrol/sinfo retry the connection for MessageTimeout - 1 s (19 s each at the
        daemons' 20, 38 s for scontrol), which an outage test would otherwise spend in every poll. The
        daemons keep 20 (a loaded machine's RPCs between them)."""
        path = self.root / f"client-{message_timeout_s}s.conf"
        path.write_text(re.sub(r"(?m)^MessageTimeout=\d+$", f"MessageTimeout={message_timeout_s}",
                               self.conf.read_text()))
        return path

    def start_controller(self) -> None:
        """Start slurmctld again (no-op while it runs); jobs come back from StateSaveLocation."""
        if self.procs[0].poll() is None:
            return
        log = open(self.root / "daemons.out", "ab")
        self.procs[0] = subprocess.Popen([_tool("slurmctld"), "-D", "-f", str(self.conf)], env=self.env,
                                         stdout=log, stderr=log)
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, 60, "slurmctld again")

    def cancel_all(self) -> None:
        self.run("scancel", "--full", "-u", "root", check=False)

    def stop(self) -> None:
        self.run("scontrol", "shutdown", check=False)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        # munged is shared by every Slurm on this machine (other test sessions may run their own):
        # the session that started it stops it only when no other slurmctld still needs it.
        others = subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 0
        if self.munged_pid and not others:
            try:
                os.kill(self.munged_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="launch4d-slurm-"))
    root.chmod(0o755)
    cluster = SlurmCluster(root=root)
    old = os.environ.get("SLURM_CONF")
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        cluster.cancel_all()
        cluster.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        shutil.rmtree(root, ignore_errors=True)
