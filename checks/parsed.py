"""Parsed probe outputs: which parser reads which probe's output, each output parsed once.

A preflight judges the same outputs several times (orchestrate between its phases, the deeper levels,
then assemble), so a parse is remembered per Completed (by identity, forgotten with the result),
never stored on the result itself. `node_data` gathers one node's parsed probes with the probe-level
problems (a tool that failed or printed what its parser cannot read) as the node's verdicts on those
checks (checks/judges/finding.py); `parse_output` reads any other output once (the deeper levels').
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from checks.judges.finding import Finding, verdict
from checks.parsers.base import ParseError
from checks.parsers.gpu_query import GpuQuery, parse_gpu_query
from checks.parsers.ibstat import IbStatus, parse_ibstat
from checks.parsers.nccl_tests import NcclTestResult, parse_nccl_tests, parse_nccl_tests_all
from checks.parsers.nvlink import NvlinkStatus, parse_nvlink_status
from checks.parsers.topo import Topology, parse_topo
from checks.parsers.xid import XidLog, parse_xid
from checks.probe import PROBES
from launcher.transport import Completed


class _Memo:
    """Parsed outputs by the Completed they came from: kept while the result lives."""

    def __init__(self) -> None:
        self._by_result: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()  # orchestrate judges from several threads

    def get(self, res: Completed, key: str, parse: Callable[[], Any]) -> Any:
        with self._lock:
            slot = self._by_result.get(id(res))
            if slot is None:
                slot = self._by_result[id(res)] = {}
                weakref.finalize(res, self._by_result.pop, id(res), None)
            if key in slot:
                return slot[key]
        value = parse()
        with self._lock:
            return slot.setdefault(key, value)


_MEMO = _Memo()


@dataclass
class NodeData:
    host: str
    topo: Topology | None = None
    gpu: GpuQuery | None = None
    nvlink: NvlinkStatus | None = None
    ib: IbStatus | None = None
    xid: XidLog | None = None
    nccl: NcclTestResult | None = None
    problems: dict[str, Finding] = field(default_factory=dict)  # probe-level failures by check

    @property
    def gpu_count(self) -> int | None:
        if self.gpu is not None:
            return self.gpu.count
        return self.topo.gpu_count if self.topo is not None else None

    @property
    def model(self) -> str | None:
        if self.gpu is not None and self.gpu.gpus:
            return self.gpu.gpus[0].name
        if self.nccl is not None and self.nccl.ranks:
            return self.nccl.ranks[0].gpu or None
        return None


PROBE_CHECK = {"topo": "topology", "gpu-query": "gpu_count", "nvlink": "nvlink", "ibstat": "ib", "xid": "xid"}
PARSERS = {"topo": parse_topo, "gpu-query": parse_gpu_query, "nvlink": parse_nvlink_status,
           "ibstat": parse_ibstat, "xid": parse_xid}
ATTR = {"topo": "topo", "gpu-query": "gpu", "nvlink": "nvlink", "ibstat": "ib", "xid": "xid"}


def parse_nccl_run(res: Completed, collective: str) -> tuple[NcclTestResult | None, str | None]:
    """The parsed test, or None and why not (died, hung, unparseable)."""
    return _MEMO.get(res, "nccl:" + collective, lambda: _parse_nccl_run(res, collective))


def _parse_nccl_run(res: Completed, collective: str) -> tuple[NcclTestResult | None, str | None]:
    if res.error:
        return None, res.error
    try:
        t = parse_nccl_tests(res.stdout, collective)
    except ParseError as exc:
        why = res.reason() if not res.ok else f"unparseable output: {exc}"
        return None, why
    if res.timed_out:
        t.errors.append(f"timed out after {res.seconds:.0f}s")
    elif res.rc not in (0, None):
        t.errors.append(f"exit status {res.rc}")
    return t, None


def parse_output(res: Completed, parse: Callable[[str], Any]) -> Any:
    """What `parse` reads in the command's stdout, or the ParseError it raised; parsed once per result."""
    def run() -> Any:
        try:
            return parse(res.stdout)
        except ParseError as exc:
            return exc

    return _MEMO.get(res, "output:" + getattr(parse, "__name__", repr(parse)), run)


def node_data(host: str, probes: dict[str, Completed]) -> NodeData:
    nd = NodeData(host)
    files = {p.name: p.file for p in PROBES}
    for kind in PARSERS:
        if kind not in probes:  # no output at all (an imported folder without that file): not measured,
            check = PROBE_CHECK[kind]  # which is no fault of the node
            nd.problems[check] = verdict(host, check, "warn", None, None,
                                         f"not measured (no {files.get(kind, kind)} for this node)")
    for kind, res in probes.items():
        if kind not in PARSERS:
            continue
        check = PROBE_CHECK[kind]
        if kind == "ibstat" and not res.ok and not res.stdout.strip():
            nd.problems[check] = verdict(host, check, "warn", None, None,
                                         f"ibstat/ibv_devinfo gave nothing ({res.reason()}); no InfiniBand?")
            continue
        if kind == "xid" and not res.ok and not res.stdout.strip():
            # no permission to read the kernel log is not a node fault, but nothing was checked either
            nd.problems[check] = verdict(host, check, "warn", None, None,
                                         f"XIDs not checked: {res.reason()}")
            continue
        if not res.ok:
            nd.problems[check] = verdict(host, check, "fail", None, None,
                                         f"`{res.command.split(' 2>')[0][:60]}` failed: {res.reason()}")
            continue
        parsed = parse_output(res, PARSERS[kind])
        if isinstance(parsed, ParseError):
            nd.problems[check] = verdict(host, check, "fail", None, None, f"unparseable output: {parsed}")
        else:
            setattr(nd, ATTR[kind], parsed)
    return nd


def hosts_in(text: str) -> list[str]:
    """The hosts an nccl-tests output ran on (its `# Rank ... on <host>` lines); [] if unreadable."""
    try:
        tests = parse_nccl_tests_all(text)
    except ParseError:
        return []
    return tests[0].hosts if tests else []
