"""This machine only: the single-node preflight, and the runner tests use without SSH."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from checks.probe import run_local
from checks.results import CommandResult
from checks.runners.base import Runner


def local_names() -> set[str]:
    """This machine's names, and its Slurm node name when run by slurmd (a prolog)."""
    names = {"localhost", "127.0.0.1", socket.gethostname(), socket.gethostname().split(".")[0]}
    return names | ({os.environ["SLURMD_NODENAME"]} if os.environ.get("SLURMD_NODENAME") else set())


class LocalRunner(Runner):
    name = "local"

    def run(self, host: str, command: str, timeout: float) -> CommandResult:
        if host not in local_names():
            return CommandResult(host, command, error=f"the local backend runs on this machine only "
                                                      f"({socket.gethostname()}), not {host}")
        return run_local(command, timeout, host)

    def run_multi(self, hosts: Sequence[str], command: str, timeout: float) -> CommandResult:
        return run_local(command, timeout, hosts[0])
