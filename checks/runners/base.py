"""The Runner interface and the node-probe script every runner sends (one round trip per host).

A Runner is a fan-out over launcher.transport: `transport(host)` says how one host is reached
(this machine, an SSH connection, an srun step started from here), and `run(host, command, timeout)`
and `run_multi(hosts, command, timeout)` (a command spanning several hosts, e.g. mpirun or srun of
nccl-tests) come back as the transport's one result type, Completed, with `host` and `command`
filled in. They never raise for a host's failure: an unreachable or hanging host becomes a result
with `error` set, so the other hosts finish. `run_probes` runs the node probes as one shell script
with markers (one round trip per host instead of one per probe).
"""

from __future__ import annotations

import secrets
import shlex
from collections.abc import Callable, Sequence
from typing import Any

from checks.probe import Probe
from launcher.transport import OUTPUT_LIMIT, Completed, ConnectError, Transport, TransportError, over_limit

#: How checks renders a template (name, values -> text): launcher.render.render_template, handed in by
#: the command layer, since checks does not import launcher.render (the preflight pod, the batch script).
Renderer = Callable[[str, dict[str, Any]], str]


class Runner:
    """How commands reach a host: a Transport per host (local, SSH, an srun step); subclasses say
    which transport and how a command is wrapped for it."""

    name = "base"
    launcher: str | None = "mpirun"  # how multi-host nccl-tests are started: mpirun | srun | None (cannot)
    output_limit = OUTPUT_LIMIT      # bytes kept of a command's stdout / stderr each

    def transport(self, host: str) -> Transport:
        """The transport `host`'s commands go through; raises ConnectError when it cannot be reached.
        (A runner that reaches hosts otherwise, the k8s one through pods, overrides `run` instead.)"""
        raise TransportError(f"{host}: the {self.name} runner has no transport")

    def wrap(self, host: str, command: str, timeout: float) -> str:
        """The command line the transport runs for `command` (an srun step wraps it)."""
        return command

    def unreachable(self, host: str, exc: ConnectError) -> str:
        """Why `host` could not run anything, in one line."""
        return str(exc)

    def finish(self, res: Completed) -> Completed:
        """The transport's result as this runner reports it (a flood becomes the host's error)."""
        if res.flooded:
            res.error = over_limit(self.output_limit)
        return res

    def run_on(self, transport: Transport, host: str, command: str, timeout: float) -> Completed:
        try:
            res = transport.run(self.wrap(host, command, timeout), timeout=timeout, limit=self.output_limit)
        except ConnectError as exc:
            return Completed(host=host, command=command, error=self.unreachable(host, exc))
        res.host, res.command = host, command
        return self.finish(res)

    def run(self, host: str, command: str, timeout: float) -> Completed:
        """Run `command` on `host`; failures come back as a Completed, not an exception."""
        try:
            transport = self.transport(host)
        except ConnectError as exc:
            return Completed(host=host, command=command, error=self.unreachable(host, exc))
        return self.run_on(transport, host, command, timeout)

    def run_multi(self, hosts: Sequence[str], command: str, timeout: float) -> Completed:
        """A command that spans `hosts` (mpirun on the first of them by default)."""
        return self.run(hosts[0], command, timeout)

    def run_probes(self, host: str, probes: Sequence[Probe], timeout: float) -> dict[str, Completed]:
        script, marker = probe_script(probes, timeout)
        total = timeout * len(probes) + 10
        res = self.run(host, script, total)
        return split_probe_output(res, probes, marker)

    def close(self) -> None:  # noqa: B027 - optional hook: runners holding connections override it
        """Release connections (SSH clients); most runners hold none."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def probe_script(probes: Sequence[Probe], timeout: float) -> tuple[str, str]:
    """A bash script running each probe under `timeout`, its output between marker lines."""
    marker = "__launch4d_" + secrets.token_hex(6) + "__"
    t = max(1, int(timeout))
    parts = [f"M={marker}"]
    for p in probes:
        parts.append(
            f'echo "$M BEGIN {p.name}"; echo "$M BEGIN {p.name}" >&2; '
            f"timeout -k 2 {t} sh -c {shlex.quote(p.command)}; rc=$?; "
            f'echo; echo "$M END {p.name} $rc"; echo "$M END {p.name}" >&2'
        )
    return "\n".join(parts) + "\n", marker


def _section(text: str, marker: str, name: str) -> tuple[str | None, int | None]:
    begin = f"{marker} BEGIN {name}\n"
    b = text.find(begin)
    if b < 0:
        return None, None
    start = b + len(begin)
    end_tag = f"\n{marker} END {name}"
    e = text.find(end_tag, start)
    if e < 0:
        return text[start:], None
    rest = text[e + len(end_tag):].split("\n", 1)[0].strip()
    rc = int(rest) if rest.lstrip("-").isdigit() else None
    return text[start:e], rc


def split_probe_output(res: Completed, probes: Sequence[Probe], marker: str) -> dict[str, Completed]:
    out: dict[str, Completed] = {}
    for p in probes:
        stdout, rc = _section(res.stdout, marker, p.name)
        stderr, _ = _section(res.stderr.replace(f"{marker} END {p.name}\n", f"\n{marker} END {p.name}\n"),
                             marker, p.name)
        r = Completed(rc, stdout or "", (stderr or "").strip("\n"), seconds=res.seconds, host=res.host,
                      command=p.command)
        if res.error:
            r.error = res.error
        elif rc == 124 or (rc is None and (res.timed_out or stdout is not None)):
            r.timed_out = True
        elif rc is None:
            r.error = res.reason() if not res.ok else "no output from the probe script"
        out[p.name] = r
    return out
