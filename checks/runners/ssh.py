"""SSH fan-out: many hosts at once over launcher.transport's one SSH client, each with its own
connect and command timeouts. Host keys, jump hosts, OpenSSH config: see launcher/transport/ssh.py
(unknown hosts are refused unless `accept_new_hosts`; a changed key always is). One connection per
host is kept and reused across phases; a host that cannot be reached becomes that host's result.
"""

from __future__ import annotations

from checks.runners.base import Runner
from launcher.transport import OUTPUT_LIMIT, ConnectError, Transport


class SSHRunner(Runner):
    name = "ssh"

    def __init__(self, *, user: str | None = None, port: int | None = None, identity_file: str | None = None,
                 known_hosts: str | None = None, accept_new_hosts: bool = False, jump: str | None = None,
                 ssh_config: str | None = None, connect_timeout: float = 10.0, use_agent: bool = True,
                 output_limit: int = OUTPUT_LIMIT):
        from launcher.transport.ssh import SSHHosts, SSHOptions

        self.hosts = SSHHosts(SSHOptions(user=user, port=port, identity_file=identity_file, known_hosts=known_hosts,
                                         accept_new_hosts=accept_new_hosts, jump=jump, ssh_config=ssh_config,
                                         connect_timeout=connect_timeout, use_agent=use_agent))
        self.output_limit = output_limit

    def transport(self, host: str) -> Transport:
        return self.hosts.transport(host)  # connects on its first command (that raises ConnectError)

    def unreachable(self, host: str, exc: ConnectError) -> str:
        why = str(exc)
        return why + ". Add it to known_hosts or pass --accept-new-hosts" if exc.kind == "unknown-host-key" else why

    def close(self) -> None:
        self.hosts.close()
