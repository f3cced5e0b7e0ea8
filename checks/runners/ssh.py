"""SSH fan-out: many hosts at once over launcher.transport's one SSH client, each with its own
connect and command timeouts. Host keys, jump hosts, OpenSSH config: see launcher/transport/ssh.py
(unknown hosts are refused unless `accept_new_hosts`; a changed key always is). One connection per
host is kept and reused across phases; a host that cannot be reached becomes that host's result.
"""

from __future__ import annotations

from checks.results import OUTPUT_LIMIT, CommandResult, over_limit
from checks.runners.base import Runner
from launcher.transport import ConnectError


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
        self.output_limit = output_limit  # bytes kept of a command's stdout / stderr each

    def run(self, host: str, command: str, timeout: float) -> CommandResult:
        try:
            c = self.hosts.transport(host).run(command, timeout=timeout, limit=self.output_limit)
        except ConnectError as exc:
            why = str(exc)
            if exc.kind == "unknown-host-key":
                why += ". Add it to known_hosts or pass --accept-new-hosts"
            return CommandResult(host, command, error=why)
        return CommandResult(host, command, c.stdout, c.stderr, c.rc, timed_out=c.timed_out,
                             error=over_limit(self.output_limit) if c.flooded else None, seconds=c.seconds)

    def close(self) -> None:
        self.hosts.close()
