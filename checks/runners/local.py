"""This machine only: the single-node preflight, and the runner tests use without SSH."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from checks.runners.base import Runner
from launcher.transport import Completed, ConnectError, Transport
from launcher.transport.local import LocalTransport


def local_names() -> set[str]:
    """This machine's names, and its Slurm node name when run by slurmd (a prolog)."""
    names = {"localhost", "127.0.0.1", socket.gethostname(), socket.gethostname().split(".")[0]}
    return names | ({os.environ["SLURMD_NODENAME"]} if os.environ.get("SLURMD_NODENAME") else set())


class LocalRunner(Runner):
    name = "local"

    def __init__(self) -> None:
        self.here = LocalTransport()

    def transport(self, host: str) -> Transport:
        if host not in local_names():
            raise ConnectError(f"the local backend runs on this machine only ({socket.gethostname()}), not {host}",
                               "unreachable")
        return self.here

    def run_multi(self, hosts: Sequence[str], command: str, timeout: float) -> Completed:
        return self.run_on(self.here, hosts[0], command, timeout)
