"""Private sshd instances on loopback: each one a "node" with its own host key and PATH.

Usage (as a context manager; pytest fixtures wrap it):

    from tests.services.sshd import SshCluster, sshd_available

    with SshCluster(tmp_path, ["node01", "node02"]) as c:
        c.nodes["node01"].port          # its loopback port
        c.nodes["node01"].bin_dir       # prepended to PATH for every session on that node
        c.ssh_config                    # OpenSSH config mapping node01 -> 127.0.0.1:<port>, key, user
        c.known_hosts                   # known_hosts with every node's host key (write_known_hosts())
        c.client_key                    # private key authorised on every node
        c.user                          # the login user (the current user)

Or as the `ssh_cluster` pytest fixture (one node named "node01", known_hosts already written):

    from tests.services.sshd import ssh_cluster  # noqa: F401

    def test_x(ssh_cluster):
        node = ssh_cluster.nodes["node01"]       # 127.0.0.1:node.port as root, key ssh_cluster.client_key

Each node is one `/usr/sbin/sshd -D` process (own port, host key, PidFile) with
`SetEnv PATH=<bin_dir>:/usr/bin:/bin` and `SetEnv REPLAY_NODE=<name>`, so replay executables put in
bin_dir shadow real tools on that node only. Nothing system-wide is touched except `mkdir
/run/sshd` (sshd's privilege-separation directory). `sshd_available()` says whether this machine
can run it (tests skip with that reason otherwise).
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.job_helpers import free_port

SSHD = "/usr/sbin/sshd"


def sshd_available() -> str | None:
    """None when a private sshd can run here, else the reason it cannot."""
    if not Path(SSHD).exists():
        return f"{SSHD} is absent (apt-get install openssh-server)"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen is absent"
    if os.geteuid() != 0:
        return "a private sshd needs root here (UsePAM no, privilege separation)"
    return None


def require_sshd() -> None:
    """Skip where a private sshd cannot run here; under CI (which installs it: .ci/setup-services.sh) fail."""
    from tests.conftest import absent

    why = sshd_available()
    if why:
        absent(why)


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


@dataclass
class SshNode:
    name: str
    dir: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def bin_dir(self) -> Path:
        return self.dir / "bin"

    @property
    def host_key_pub(self) -> str:
        return (self.dir / "hostkey.pub").read_text().split()[:2]  # type: ignore[return-value]


class SshCluster:
    def __init__(self, root: Path, names: list[str], env: dict[str, str] | None = None):
        self.root = Path(root)
        self.names = list(names)
        self.env = dict(env or {})
        self.nodes: dict[str, SshNode] = {}
        self.user = getpass.getuser()
        self.client_key = self.root / "client_key"
        self.ssh_config = self.root / "ssh_config"
        self.known_hosts = self.root / "known_hosts"
        self.files = self.root / "files"   # where a test writes the replayed tools' outputs the nodes read

    def __enter__(self) -> SshCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        keygen(self.client_key)
        auth = self.root / "authorized_keys"
        auth.write_text((self.root / "client_key.pub").read_text())
        cfg_lines = []
        for name in self.names:
            d = self.root / "nodes" / name
            (d / "bin").mkdir(parents=True, exist_ok=True)
            keygen(d / "hostkey")
            node = SshNode(name=name, dir=d, port=free_port(), env=dict(self.env))
            # SHLVL=1: bash started by sshd then skips ~/.bashrc (slow `pyenv init` on this machine), so a
            # session costs what a bare node's would; PATH puts this node's replay tools first.
            env = {"PATH": f"{node.bin_dir}:/usr/local/bin:/usr/bin:/bin", "REPLAY_NODE": name, "SHLVL": "1",
                   **self.env}
            setenv = " ".join(f'"{k}={v}"' for k, v in env.items())
            (d / "sshd_config").write_text(
                f"Port {node.port}\nListenAddress 127.0.0.1\nHostKey {d / 'hostkey'}\n"
                f"AuthorizedKeysFile {auth}\nPidFile {d / 'sshd.pid'}\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nStrictModes no\nUsePAM no\nPermitRootLogin yes\n"
                f"MaxSessions 64\nMaxStartups 200\nSetEnv {setenv}\nLogLevel ERROR\n")
            node.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")],
                                         stdout=subprocess.DEVNULL, stderr=open(d / "sshd.log", "w"))
            self.nodes[name] = node
            cfg_lines += [f"Host {name}", "  HostName 127.0.0.1", f"  Port {node.port}", f"  User {self.user}",
                          f"  IdentityFile {self.client_key}", ""]
        self.ssh_config.write_text("\n".join(cfg_lines))
        self.known_hosts.write_text("")
        self._wait_listening()

    def _wait_listening(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        for node in self.nodes.values():
            while True:
                if node.proc is not None and node.proc.poll() is not None:
                    raise RuntimeError(f"sshd for {node.name} exited: {(node.dir / 'sshd.log').read_text()}")
                try:
                    with socket.create_connection(("127.0.0.1", node.port), timeout=0.5):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"sshd for {node.name} is not listening on {node.port}") from None
                    time.sleep(0.05)

    def write_known_hosts(self, names: list[str] | None = None) -> Path:
        """known_hosts trusting `names` (default: every node), as `[127.0.0.1]:port type key`."""
        lines = []
        for name in names if names is not None else self.names:
            node = self.nodes[name]
            ktype, key = (node.dir / "hostkey.pub").read_text().split()[:2]
            lines.append(f"[127.0.0.1]:{node.port} {ktype} {key}")
        self.known_hosts.write_text("\n".join(lines) + "\n")
        return self.known_hosts

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
                try:
                    node.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait()


@pytest.fixture
def ssh_cluster(tmp_path):
    """One sshd "node" (node01) on loopback, its host key in ssh_cluster.known_hosts; skips where impossible."""
    require_sshd()
    with SshCluster(tmp_path / "sshd", ["node01"]) as c:
        c.write_known_hosts()
        yield c
