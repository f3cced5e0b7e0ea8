"""Inside a Slurm allocation: one `srun` step per host (run from the batch/login shell of the job).

`--overlap` lets the per-node steps run side by side with each other; multi-node nccl-tests use
`srun --mpi=...` from here (Runner.launcher = "srun"). A step that Slurm itself refuses (node down,
not in the allocation) is reported as that host's error. Every step starts on this machine, so
the transport is this machine's for every host; the host is chosen by the step's --nodelist.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from checks.runners.base import Runner
from launcher.transport import Completed, Transport
from launcher.transport.local import LocalTransport


class SrunRunner(Runner):
    name = "srun"
    launcher = "srun"

    def __init__(self, srun: str = "srun", extra_args: Sequence[str] = ()):
        self.srun = srun
        self.extra_args = list(extra_args)
        self.here = LocalTransport()

    def transport(self, host: str) -> Transport:
        return self.here

    def step_command(self, host: str, command: str) -> str:
        args = [self.srun, "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap", "--quiet",
                *self.extra_args, "bash", "-c", command]
        return " ".join(shlex.quote(a) for a in args)

    def wrap(self, host: str, command: str, timeout: float) -> str:
        # `timeout` inside the step too, so a hung tool ends on the node, not only this srun
        inner = f"timeout -k 5 {max(1, int(timeout) + 2)} bash -c {shlex.quote(command)}"
        return self.step_command(host, inner)

    def finish(self, res: Completed) -> Completed:
        res = super().finish(res)
        if res.rc not in (0, None) and not res.stdout.strip() and "srun: error" in res.stderr:
            res.error = "srun: " + res.stderr.strip().splitlines()[-1].split("error:", 1)[-1].strip()
        return res

    def run_multi(self, hosts: Sequence[str], command: str, timeout: float) -> Completed:
        # the multi-node command is an srun --mpi line already: run it here as it is
        res = self.here.run(command, timeout=timeout, limit=self.output_limit)
        res.host, res.command = hosts[0], command
        return Runner.finish(self, res)
