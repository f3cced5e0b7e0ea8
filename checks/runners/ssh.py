"""SSH fan-out with paramiko: many hosts at once, each with its own connect and command timeouts.

Safe by default: host keys are checked against known_hosts (the user's and any file given); an
unknown host is refused unless `accept_new_hosts` (then its key is appended, like OpenSSH's
`StrictHostKeyChecking=accept-new`); a changed key is always refused. A jump host (a login node)
is reached first and the nodes through `direct-tcpip` channels on it. Keys come from the given
identity file, the agent or ~/.ssh. Host aliases, ports and users are read from an OpenSSH config
file when there is one. One connection per host is kept and reused across phases.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checks.results import OUTPUT_LIMIT, CommandResult, over_limit
from checks.runners import Runner


@dataclass
class Target:
    alias: str
    hostname: str
    port: int = 22
    user: str | None = None
    identity_files: tuple[str, ...] = ()
    proxy_jump: str | None = None


def parse_jump(spec: str) -> tuple[str | None, str, int | None]:
    """`user@host:port` -> (user, host, port)."""
    user = None
    if "@" in spec:
        user, spec = spec.split("@", 1)
    port = None
    if spec.count(":") == 1:
        spec, p = spec.split(":")
        port = int(p)
    return user, spec, port


class SSHRunner(Runner):
    name = "ssh"

    def __init__(self, *, user: str | None = None, port: int | None = None, identity_file: str | None = None,
                 known_hosts: str | None = None, accept_new_hosts: bool = False, jump: str | None = None,
                 ssh_config: str | None = None, connect_timeout: float = 10.0, use_agent: bool = True,
                 output_limit: int = OUTPUT_LIMIT):
        import logging

        import paramiko  # lazy: `launch --help` must not pay for it

        # paramiko logs a traceback for every failed handshake; the reason is reported per host instead
        logging.getLogger("paramiko").addHandler(logging.NullHandler())

        self._paramiko = paramiko
        self.user = user
        self.port = port
        self.identity_file = identity_file
        self.accept_new_hosts = accept_new_hosts
        self.jump = jump
        self.connect_timeout = connect_timeout
        self.use_agent = use_agent
        self.output_limit = output_limit  # bytes kept of a command's stdout / stderr each
        default_known = Path.home() / ".ssh" / "known_hosts"
        self.known_hosts = Path(known_hosts) if known_hosts else default_known
        self._extra_known = [default_known] if known_hosts and default_known.exists() else []
        self._config = None
        cfg = Path(ssh_config) if ssh_config else Path.home() / ".ssh" / "config"
        if cfg.exists():
            self._config = paramiko.SSHConfig.from_path(str(cfg))
        self._clients: dict[str, Any] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._kh_lock = threading.Lock()
        self._jump_client: Any = None
        self._policy = self._make_policy()

    # ---- connections -------------------------------------------------------------------------
    def target(self, alias: str) -> Target:
        name, port = alias, None
        if alias.count(":") == 1:
            name, p = alias.split(":")
            port = int(p)
        t = Target(alias=alias, hostname=name)
        if self._config is not None:
            c = self._config.lookup(name)
            t.hostname = c.get("hostname", name)
            if "port" in c:
                t.port = int(c["port"])
            t.user = c.get("user")
            t.identity_files = tuple(c.get("identityfile", []))
            t.proxy_jump = c.get("proxyjump")
        if self.port:
            t.port = self.port
        if port:
            t.port = port
        if self.user:
            t.user = self.user
        return t

    def _make_policy(self) -> Any:
        """One MissingHostKeyPolicy (and its exception class) shared by every connection."""
        paramiko = self._paramiko
        runner = self

        class UnknownHostKey(paramiko.SSHException):
            pass

        class Policy(paramiko.MissingHostKeyPolicy):
            def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
                if not runner.accept_new_hosts:
                    raise UnknownHostKey(hostname)
                client.get_host_keys().add(hostname, key.get_name(), key)
                with runner._kh_lock:
                    runner.known_hosts.parent.mkdir(parents=True, exist_ok=True)
                    with open(runner.known_hosts, "a") as fh:
                        fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")

        self._unknown_exc = UnknownHostKey
        return Policy()

    def _new_client(self) -> Any:
        client = self._paramiko.SSHClient()
        for f in self._extra_known:
            client.load_host_keys(str(f))
        if self.known_hosts.exists():
            client.load_host_keys(str(self.known_hosts))
        client.set_missing_host_key_policy(self._policy)
        return client

    def _connect_kwargs(self, t: Target) -> dict[str, Any]:
        keys = [self.identity_file] if self.identity_file else [os.path.expanduser(f) for f in t.identity_files]
        return dict(username=t.user or os.environ.get("USER") or None, key_filename=keys or None,
                    allow_agent=self.use_agent, look_for_keys=not keys, timeout=self.connect_timeout,
                    banner_timeout=self.connect_timeout, auth_timeout=self.connect_timeout)

    def _jump_transport(self, spec: str) -> Any:
        with self._lock:
            if self._jump_client is None:
                user, host, port = parse_jump(spec)
                t = self.target(host)
                if port:
                    t.port = port
                if user:
                    t.user = user
                c = self._new_client()
                try:
                    c.connect(t.hostname, t.port, **self._connect_kwargs(t))
                except Exception as exc:  # noqa: BLE001 - reported per host below
                    raise ConnectionError(f"jump host {spec}: {self._describe(exc, t)}") from None
                self._jump_client = c
            return self._jump_client.get_transport()

    def _describe(self, exc: BaseException, t: Target) -> str:
        paramiko = self._paramiko
        where = f"{t.hostname}:{t.port}"
        if isinstance(exc, self._unknown_exc):
            return (f"unknown host key for {where} (not in {self.known_hosts}); refusing. "
                    "Add it to known_hosts or pass --accept-new-hosts")
        if isinstance(exc, paramiko.BadHostKeyException):
            return f"host key for {where} does not match known_hosts: refusing (possible man-in-the-middle)"
        if isinstance(exc, paramiko.AuthenticationException):
            return f"authentication failed for {t.user or os.environ.get('USER')}@{where} ({exc})"
        if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
            return f"cannot connect to {where}: connection refused"
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return f"cannot connect to {where}: timed out after {self.connect_timeout:.0f}s"
        if isinstance(exc, paramiko.SSHException) and ("banner" in str(exc).lower()
                                                       or "no existing session" in str(exc).lower()):
            return (f"{where} accepted the connection but sent no SSH banner / handshake within "
                    f"{self.connect_timeout:.0f}s (hung host?)")
        if isinstance(exc, socket.gaierror):
            return f"cannot resolve {t.hostname}"
        if isinstance(exc, ConnectionError):
            return str(exc)
        return f"cannot connect to {where}: {type(exc).__name__}: {exc}"

    def connect(self, alias: str) -> Any:
        """The (cached) SSHClient for a host; raises ConnectionError with a one-line reason."""
        with self._lock:
            lock = self._locks.setdefault(alias, threading.Lock())
        with lock:
            if alias in self._clients:
                return self._clients[alias]
            t = self.target(alias)
            client = self._new_client()
            try:
                sock = None
                jump = self.jump or t.proxy_jump
                if jump:
                    sock = self._jump_transport(jump).open_channel(
                        "direct-tcpip", (t.hostname, t.port), ("127.0.0.1", 0), timeout=self.connect_timeout)
                client.connect(t.hostname, t.port, sock=sock, **self._connect_kwargs(t))
            except Exception as exc:  # noqa: BLE001 - every failure becomes a reason, never a traceback
                client.close()
                raise ConnectionError(self._describe(exc, t)) from None
            self._clients[alias] = client
            return client

    # ---- commands ----------------------------------------------------------------------------
    def run(self, host: str, command: str, timeout: float) -> CommandResult:
        start = time.monotonic()
        try:
            client = self.connect(host)
        except ConnectionError as exc:
            return CommandResult(host, command, error=str(exc), seconds=time.monotonic() - start)
        # `timeout` on the node too, so a hung command does not outlive the session
        remote = f"timeout -k 5 {max(1, int(timeout) + 2)} bash -c {_quote(command)}"
        try:
            chan = client.get_transport().open_session(timeout=self.connect_timeout)
            chan.exec_command(remote)
        except Exception as exc:  # noqa: BLE001
            with self._lock:
                self._clients.pop(host, None)
            return CommandResult(host, command, error=f"ssh session failed: {type(exc).__name__}: {exc}",
                                 seconds=time.monotonic() - start)
        out, err = bytearray(), bytearray()
        deadline = start + timeout
        timed_out = flooded = False
        while not flooded:
            while chan.recv_ready() and not flooded:
                out += chan.recv(65536)
                flooded = len(out) > self.output_limit
            while chan.recv_stderr_ready() and not flooded:
                err += chan.recv_stderr(65536)
                flooded = len(err) > self.output_limit
            if flooded or (chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready()):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            select.select([chan], [], [], min(left, 0.05))
        rc = None if (timed_out or flooded) else chan.recv_exit_status()
        chan.close()  # a flooding command ends with the channel (and the node-side `timeout` at the latest)
        res = CommandResult(host, command, bytes(out[:self.output_limit]).decode(errors="replace"),
                            bytes(err[:self.output_limit]).decode(errors="replace"), rc, timed_out=timed_out,
                            error=over_limit(self.output_limit) if flooded else None,
                            seconds=time.monotonic() - start)
        if rc == 124:  # the node-side `timeout` fired
            res.timed_out = True
        return res

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
            if self._jump_client is not None:
                self._jump_client.close()
                self._jump_client = None


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)
