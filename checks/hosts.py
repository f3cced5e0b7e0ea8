"""Which hosts to check: a Slurm hostlist expression, a file, a list, or the current allocation.

Expressions like `node[01-16,20]` are expanded by python-hostlist (the library Slurm users rely
on), not by hand. Errors are HostsError with one line naming the input and what is valid.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

HOST_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(:\d+)?$")


class HostsError(ValueError):
    """Host input that cannot be used; the message names it."""


def expand(expr: str) -> list[str]:
    """`node[01-03],gpu7` -> ['node01', 'node02', 'node03', 'gpu7'] (order kept, duplicates dropped)."""
    import hostlist

    try:
        hosts = hostlist.expand_hostlist(expr.strip())
    except hostlist.BadHostlist as exc:
        raise HostsError(f"--hosts {expr!r}: not a hostlist expression ({exc}); "
                         "valid: node01,node02 or node[01-16,20]") from None
    return dedupe(hosts, where=f"--hosts {expr!r}")


def dedupe(hosts: Iterable[str], where: str) -> list[str]:
    out: list[str] = []
    for h in hosts:
        h = h.strip()
        if not h:
            continue
        if not HOST_RE.match(h):
            raise HostsError(f"{where}: {h!r} is not a host name")
        if h not in out:
            out.append(h)
    if not out:
        raise HostsError(f"{where}: no hosts")
    return out


def from_file(path: str | Path) -> list[str]:
    """One host (or hostlist expression) per line; `#` comments and MPI `slots=` suffixes ignored."""
    from launcher.errors import UserError
    from launcher.formats.files import MiB, read_text

    p = Path(path)
    try:
        text = read_text(p, "host file", 16 * MiB)
    except UserError as exc:
        raise HostsError(f"--hostfile {exc}") from None
    hosts: list[str] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        token = line.split()[0]
        hosts.extend(expand(token) if "[" in token else [token])
    return dedupe(hosts, where=f"--hostfile {p}")


def from_allocation(env: dict[str, str] | None = None) -> list[str]:
    """The nodes of the Slurm job we are running in (SLURM_JOB_NODELIST)."""
    env = dict(os.environ if env is None else env)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise HostsError("--slurm-allocation: not inside a Slurm allocation (SLURM_JOB_NODELIST is unset); "
                         "run under salloc/sbatch or give --hosts")
    try:
        return expand(nodelist)
    except HostsError:
        p = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if p.returncode != 0:
            raise
        return dedupe(p.stdout.split(), where="SLURM_JOB_NODELIST")


def compress(hosts: list[str]) -> str:
    """The shortest hostlist expression for `hosts` (for sbatch --nodelist / srun -w)."""
    import hostlist

    return hostlist.collect_hostlist(hosts)
