"""Inside a Slurm allocation: one `srun` step per host (run from the batch/login shell of the job).

`--overlap` lets the per-node steps run side by side with each other; multi-node nccl-tests use
`srun --mpi=...` from here (Runner.launcher = "srun"). A step that Slurm itself refuses (node down,
not in the allocation) is reported as that host's error.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from checks.probe import run_local
from checks.results import CommandResult
from checks.runners.base import Runner


class SrunRunner(Runner):
    name = "srun"
    launcher = "srun"

    def __init__(self, srun: str = "srun", extra_args: Sequence[str] = ()):
        self.srun = srun
        self.extra_args = list(extra_args)

    def step_command(self, host: str, command: str) -> str:
        args = [self.srun, "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap", "--quiet",
                *self.extra_args, "bash", "-c", command]
        return " ".join(shlex.quote(a) for a in args)

    def run(self, host: str, command: str, timeout: float) -> CommandResult:
        # `timeout` inside the step too, so a hung tool ends on the node, not only this srun
        inner = f"timeout -k 5 {max(1, int(timeout) + 2)} bash -c {shlex.quote(command)}"
        r = run_local(self.step_command(host, inner), timeout, host)
        r.command = command
        if r.rc not in (0, None) and not r.stdout.strip() and "srun: error" in r.stderr:
            r.error = "srun: " + r.stderr.strip().splitlines()[-1].split("error:", 1)[-1].strip()
        return r

    def run_multi(self, hosts: Sequence[str], command: str, timeout: float) -> CommandResult:
        return run_local(command, timeout, hosts[0])
