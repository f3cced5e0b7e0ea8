"""Other machines over SSH (paramiko, imported when the first connection is made): the one SSH
client of launch4d, for preflight's fan-out over many nodes and for Slurm's login node alike.

Host keys, one policy: keys are checked against known_hosts (the file given, and the user's own);
an unknown host is refused unless the caller opts in with `accept_new_hosts` (its key is then
appended to the known_hosts file, like OpenSSH's `StrictHostKeyChecking=accept-new`); a changed
key is always refused. A jump host (a login node) is reached first and the nodes through
`direct-tcpip` channels on it. Keys come from the given identity file, the agent or ~/.ssh; host
aliases, ports, users and ProxyJump from an OpenSSH config file when there is one. One connection
per host is kept and reused. No SFTP: files go through the session's stdin/stdout (some sites
disable the SFTP subsystem).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.formats.shell import quote
from launcher.transport import (
    CHUNK_LIMIT,
    OUTPUT_LIMIT,
    Command,
    Completed,
    ConnectError,
    Transport,
    TransportError,
)
from launcher.transport.lines import LineSplitter


@dataclass
class SSHOptions:
    """How to reach hosts; what the OpenSSH config says fills in what is not given here."""

    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    known_hosts: str | None = None       # default ~/.ssh/known_hosts (read in either case)
    accept_new_hosts: bool = False       # opt-in: trust and record an unknown host's key
    jump: str | None = None              # [user@]host[:port]
    ssh_config: str | None = None        # default ~/.ssh/config, when it exists
    connect_timeout: float = 10.0
    use_agent: bool = True


@dataclass
class Target:
    alias: str
    hostname: str
    port: int = 22
    user: str | None = None
    identity_files: tuple[str, ...] = field(default_factory=tuple)
    proxy_jump: str | None = None

    @property
    def where(self) -> str:
        return f"{self.hostname}:{self.port}"


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


def remote_command(command: Command, cwd: str | None = None, timeout: float | None = None) -> str:
    """The line the remote shell runs: argv quoted, `cd` first, and under coreutils' `timeout` so a
    hung command does not outlive the session (its rc 124 reads as timed out)."""
    line = command if isinstance(command, str) else " ".join(quote(a) for a in command)
    if cwd:
        line = f"cd {quote(cwd)} && {line}"
    if timeout is None:
        return f"bash -c {quote(line)}"
    return f"timeout -k 5 {max(1, int(timeout) + 2)} bash -c {quote(line)}"


class SSHHosts:
    """Connections to any number of hosts under one SSHOptions: one cached client per host, one
    host-key policy, one jump connection. Thread-safe (preflight connects to many hosts at once)."""

    def __init__(self, options: SSHOptions | None = None):
        import logging

        import paramiko  # lazy: `launch --help` must not pay for it

        # paramiko logs a traceback for every failed handshake; the reason is reported per host instead
        logging.getLogger("paramiko").addHandler(logging.NullHandler())
        self._paramiko = paramiko
        self.options = o = options or SSHOptions()
        default_known = Path.home() / ".ssh" / "known_hosts"
        self.known_hosts = Path(o.known_hosts).expanduser() if o.known_hosts else default_known
        self._extra_known = [default_known] if o.known_hosts and default_known.exists() else []
        self._config = None
        cfg = Path(o.ssh_config).expanduser() if o.ssh_config else Path.home() / ".ssh" / "config"
        if cfg.exists():
            self._config = paramiko.SSHConfig.from_path(str(cfg))
        self._clients: dict[str, Any] = {}
        self._connecting: set[Any] = set()  # clients whose handshake is under way
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._kh_lock = threading.Lock()
        self._jump_client: Any = None
        self._policy = self._make_policy()

    def transport(self, alias: str) -> SSHTransport:
        """A Transport to one host over these connections (connects on first use)."""
        return SSHTransport(self, alias)

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
        if self.options.port:
            t.port = self.options.port
        if port:
            t.port = port
        if self.options.user:
            t.user = self.options.user
        return t

    def _make_policy(self) -> Any:
        """The one MissingHostKeyPolicy (and its exception class) every connection shares."""
        paramiko = self._paramiko
        hosts = self

        class UnknownHostKey(paramiko.SSHException):  # type: ignore[name-defined]  # paramiko is loaded lazily
            pass

        class Policy(paramiko.MissingHostKeyPolicy):  # type: ignore[name-defined]
            def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
                if not hosts.options.accept_new_hosts:
                    raise UnknownHostKey(hostname)
                client.get_host_keys().add(hostname, key.get_name(), key)
                with hosts._kh_lock:
                    hosts.known_hosts.parent.mkdir(parents=True, exist_ok=True)
                    with open(hosts.known_hosts, "a") as fh:
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
        o = self.options
        keys = ([os.path.expanduser(o.identity_file)] if o.identity_file
                else [os.path.expanduser(f) for f in t.identity_files])
        return dict(username=t.user or os.environ.get("USER") or None, key_filename=keys or None,
                    allow_agent=o.use_agent, look_for_keys=not keys, timeout=o.connect_timeout,
                    banner_timeout=o.connect_timeout, auth_timeout=o.connect_timeout)

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
                except Exception as exc:  # noqa: BLE001 - becomes the reason, never a traceback
                    c.close()
                    err = self._error(exc, t)
                    raise ConnectError(f"jump host {spec}: {err}", err.kind) from None
                self._jump_client = c
            return self._jump_client.get_transport()

    def _error(self, exc: BaseException, t: Target) -> ConnectError:
        """A failed connection as one line and its kind."""
        paramiko = self._paramiko
        where, secs = t.where, self.options.connect_timeout
        if isinstance(exc, ConnectError):
            return exc
        if isinstance(exc, self._unknown_exc):
            return ConnectError(f"unknown host key for {where} (not in {self.known_hosts}); refusing",
                                "unknown-host-key")
        if isinstance(exc, paramiko.BadHostKeyException):
            return ConnectError(f"host key for {where} does not match known_hosts: refusing (possible "
                                "man-in-the-middle)", "changed-host-key")
        if isinstance(exc, paramiko.AuthenticationException):
            return ConnectError(f"authentication failed for {t.user or os.environ.get('USER')}@{where} ({exc})",
                                "auth")
        if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
            return ConnectError(f"cannot connect to {where}: connection refused", "unreachable")
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return ConnectError(f"cannot connect to {where}: timed out after {secs:.0f}s", "timeout")
        if isinstance(exc, paramiko.SSHException) and ("banner" in str(exc).lower()
                                                       or "no existing session" in str(exc).lower()):
            return ConnectError(f"{where} accepted the connection but sent no SSH banner / handshake within "
                                f"{secs:.0f}s (hung host?)", "timeout")
        if isinstance(exc, socket.gaierror):
            return ConnectError(f"cannot resolve {t.hostname}", "unreachable")
        if isinstance(exc, OSError):
            return ConnectError(f"cannot connect to {where}: {exc.strerror or exc}", "unreachable")
        return ConnectError(f"cannot connect to {where}: {type(exc).__name__}: {exc}", "ssh")

    def connect(self, alias: str) -> Any:
        """The (cached) paramiko SSHClient for a host; raises ConnectError with a one-line reason."""
        with self._lock:
            lock = self._locks.setdefault(alias, threading.Lock())
        with lock:
            if alias in self._clients:
                return self._clients[alias]
            t = self.target(alias)
            client = self._new_client()
            with self._lock:
                self._connecting.add(client)   # close() ends a handshake a hung host never answers
            try:
                sock = None
                jump = self.options.jump or t.proxy_jump
                if jump:
                    sock = self._jump_transport(jump).open_channel(
                        "direct-tcpip", (t.hostname, t.port), ("127.0.0.1", 0),
                        timeout=self.options.connect_timeout)
                client.connect(t.hostname, t.port, sock=sock, **self._connect_kwargs(t))
            except Exception as exc:  # noqa: BLE001 - every failure becomes a reason, never a traceback
                client.close()
                raise self._error(exc, t) from None
            finally:
                with self._lock:
                    self._connecting.discard(client)
            self._clients[alias] = client
            return client

    def forget(self, alias: str) -> None:
        """Drop a host's connection (it broke); the next command reconnects."""
        with self._lock:
            client = self._clients.pop(alias, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        with self._lock:
            for c in [*self._clients.values(), *self._connecting]:
                c.close()
            self._clients.clear()
            self._connecting.clear()
            if self._jump_client is not None:
                self._jump_client.close()
                self._jump_client = None


class SSHTransport(Transport):
    """One host over SSHHosts' connection to it. Closing it closes the connections only when it
    opened them itself (`connect()` below); a fan-out closes its SSHHosts once, at the end."""

    def __init__(self, hosts: SSHHosts, alias: str, *, owns_hosts: bool = False):
        self.hosts = hosts
        self.host = alias
        self._owns = owns_hosts

    def _session(self) -> Any:
        client = self.hosts.connect(self.host)  # type: ignore[arg-type]
        try:
            return client.get_transport().open_session(timeout=self.hosts.options.connect_timeout)
        except Exception as exc:  # noqa: BLE001 - a dropped connection: reconnect next time
            self.hosts.forget(self.host)  # type: ignore[arg-type]
            raise ConnectError(f"ssh session to {self.host} failed: {type(exc).__name__}: {exc}",
                               "unreachable") from None

    def exec(self, line: str, timeout: float, stdin: bytes | None = None,
             limit: int = OUTPUT_LIMIT) -> tuple[int | None, bytes, bytes, bool, bool, float]:
        """Run a remote command line as given: (rc, stdout, stderr, timed out, flooded, seconds)."""
        start = time.monotonic()
        chan = self._session()
        try:
            chan.exec_command(line)
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
        except Exception as exc:  # noqa: BLE001
            chan.close()
            self.hosts.forget(self.host)  # type: ignore[arg-type]
            raise ConnectError(f"ssh session to {self.host} failed: {type(exc).__name__}: {exc}",
                               "unreachable") from None
        out, err = bytearray(), bytearray()
        deadline = start + timeout
        timed_out = flooded = False
        while not flooded:
            while chan.recv_ready() and not flooded:
                out += chan.recv(65536)
                flooded = len(out) > limit
            while chan.recv_stderr_ready() and not flooded:
                err += chan.recv_stderr(65536)
                flooded = len(err) > limit
            if flooded or (chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready()):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            select.select([chan], [], [], min(left, 0.05))
        rc = None if (timed_out or flooded) else chan.recv_exit_status()
        chan.close()  # a flooding command ends with the channel (and the node-side `timeout` at the latest)
        return rc, bytes(out[:limit]), bytes(err[:limit]), timed_out, flooded, time.monotonic() - start

    def run(self, command: Command, *, timeout: float = 60, cwd: str | None = None,
            stdin: bytes | None = None, limit: int = OUTPUT_LIMIT) -> Completed:
        logging.getLogger(__name__).debug("run on %s: %s", self.host, command)
        rc, out, err, timed_out, flooded, secs = self.exec(remote_command(command, cwd, timeout), timeout,
                                                           stdin, limit)
        if rc == 124:  # the node-side `timeout` fired
            rc, timed_out = None, True
        return Completed(rc, out.decode(errors="replace"), err.decode(errors="replace"), timed_out, flooded, secs)

    def stream(self, command: Command, *, timeout: float | None = None, cwd: str | None = None) -> Iterator[str]:
        chan = self._session()
        split = LineSplitter()
        deadline = time.monotonic() + timeout if timeout else None
        try:
            chan.exec_command(remote_command(command, cwd, timeout))
            chan.shutdown_write()
            while deadline is None or time.monotonic() < deadline:
                if chan.recv_ready():
                    chunk = chan.recv(65536)
                    if not chunk:
                        break
                    yield from split.feed(chunk)
                    continue
                if chan.exit_status_ready() and not chan.recv_ready():
                    break
                select.select([chan], [], [], 0.2)
            last = split.rest()
            if last is not None:
                yield last
        finally:
            chan.close()

    def _check(self, what: str, line: str, stdin: bytes | None = None, timeout: float = 60) -> bytes:
        rc, out, err, timed_out, _, _ = self.exec(remote_command(line, None, timeout), timeout, stdin)
        if rc != 0:
            why = "timed out" if timed_out or rc == 124 else err.decode(errors="replace").strip() or f"exit {rc}"
            raise TransportError(f"{what} on {self.host}: {why}")
        return out

    def put(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        body = data.encode() if isinstance(data, str) else data
        self._check(f"cannot write {path}",
                    f't=$(mktemp {quote(path)}.XXXXXX) && {{ cat > "$t" && chmod {mode:o} "$t" && '
                    f'mv -f "$t" {quote(path)} || {{ rm -f "$t"; exit 1; }}; }}', body)

    def get(self, path: str, offset: int = 0, limit: int = CHUNK_LIMIT) -> bytes | None:
        p = quote(path)
        rc, out, _, _, _, _ = self.exec(remote_command(f"test -f {p} && tail -c +{offset + 1} {p} | head -c {limit}",
                                                       None, 60), 60, None, limit + 1)
        return out if rc == 0 else None

    def exists(self, path: str) -> bool:
        return self.run(["test", "-e", path]).rc == 0

    def makedirs(self, path: str) -> None:
        self._check(f"cannot create {path}", f"mkdir -p {quote(path)}")

    def remove_tree(self, path: str) -> None:
        self.run(["rm", "-rf", "--", path])

    def home(self) -> str:
        return self._check("cannot read $HOME", 'printf %s "$HOME"').decode(errors="replace").strip()

    def which(self, name: str) -> bool:
        return self.run(f"command -v {quote(name)}").rc == 0

    def close(self) -> None:
        if self._owns:
            self.hosts.close()


def connect(host: str, options: SSHOptions | None = None) -> SSHTransport:
    """A Transport to one host with its own connection, made now (ConnectError if it cannot be)."""
    hosts = SSHHosts(options)
    try:
        hosts.connect(host)
    except ConnectError:
        hosts.close()
        raise
    return SSHTransport(hosts, host, owns_hosts=True)
