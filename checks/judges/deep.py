"""The deeper levels judged (standard, long): each tool's output parsed once (checks/parsed.py) and judged
per GPU, link or NIC, then folded to one verdict per (node, check) naming them; the all-to-all runs.

A tool a node lacks (the shell's exit status 127: command not found) is "not measured", a warning,
never a failure: a site without DCGM can still run `--level standard`. An output the parser cannot
read is a warning too: a node is drained on a judge's verdict, not on a format surprise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from checks.judges.dcgm import judge_dcgm_diag
from checks.judges.finding import Finding, fold, verdict
from checks.judges.nvbandwidth import judge_nvbandwidth
from checks.judges.nvlink import judge_nvlink_errors
from checks.judges.perftest import judge_perftest
from checks.levels import A2A_BINARY, RdmaRun, tool_of
from checks.parsed import parse_nccl_run, parse_output
from checks.parsers.base import ParseError
from checks.parsers.dcgm_diag import parse_dcgm_diag
from checks.parsers.nvbandwidth import parse_nvbandwidth
from checks.parsers.nvlink_errors import parse_nvlink_errors
from checks.parsers.perftest import parse_perftest
from checks.results import PreflightResults
from launcher.transport import Completed

NOT_FOUND_RC = 127  # what a shell returns for a command it cannot find


def _not_measured(host: str, check: str, res: Completed,
                  timeouts: Mapping[str, float] = {}) -> Finding | None:  # noqa: B006 - read only
    if res.rc == NOT_FOUND_RC and not res.stdout.strip():
        tool = (res.command.split() or ["the tool"])[0]
        return verdict(host, check, "warn", None, None, f"not measured: {tool} is not installed on this node")
    if res.timed_out:
        tool = tool_of(res.command)
        limit = timeouts.get(tool) or round(res.seconds)
        return verdict(host, check, "warn", None, limit,
                       f"not measured: {tool} timed out after {limit:g} s -> a longer --tool-timeout "
                       f"{tool}=SECONDS if the tool is slow here; if it hangs at a generous timeout, "
                       "check the node")
    if res.error:
        return verdict(host, check, "warn", None, None, f"not measured: {res.reason()}")
    return None


def _judged(host: str, check: str, res: Completed, parse: Callable[[str], Any],
            judge: Callable[[Any], list[Finding]], timeouts: Mapping[str, float]) -> list[Finding]:
    gone = _not_measured(host, check, res, timeouts)
    if gone is not None:
        return [gone]
    parsed = parse_output(res, parse)
    if isinstance(parsed, ParseError):
        return [verdict(host, check, "warn", None, None, f"not judged: unparseable output: {parsed}")]
    return fold(judge(parsed))


def deep_checks(results: PreflightResults) -> list[Finding]:
    """The standard and long levels' checks, for every node that ran them."""
    out: list[Finding] = []
    for host, probes in results.probes.items():
        if "dcgm-diag" in probes:
            out += _judged(host, "dcgm", probes["dcgm-diag"], parse_dcgm_diag,
                           partial(judge_dcgm_diag, node=host), results.tool_timeouts)
        if "nvbandwidth" in probes:
            out += _judged(host, "nvbandwidth", probes["nvbandwidth"], parse_nvbandwidth,
                           partial(judge_nvbandwidth, node=host), results.tool_timeouts)
        if "nvlink-errors-after" in probes:
            before = probes.get("nvlink-errors")
            prior = parse_output(before, parse_nvlink_errors) if before is not None and before.ok else None
            prior = None if isinstance(prior, ParseError) else prior
            judged = _judged(host, "nvlink_errors", probes["nvlink-errors-after"], parse_nvlink_errors,
                             partial(judge_nvlink_errors, before=prior, node=host),
                             results.tool_timeouts)
            for c in judged:  # the judge says "nvlink"; the quick level's `nvlink -s` check has that name
                c.check = "nvlink_errors" if c.check == "nvlink" else c.check
            out += judged
    out += rdma_checks(results.rdma, results.tool_timeouts)
    out += a2a_checks(results)
    return out


def rdma_checks(runs: Sequence[RdmaRun], timeouts: Mapping[str, float] = {}) -> list[Finding]:  # noqa: B006
    """Per (node, NIC), the best figure over the pairs it ran in: a NIC that reaches line rate with
    some partner is sound; one slow with every partner (round 2 re-pairs suspects with good nodes) is not."""
    best: dict[tuple[str, str], tuple[float, RdmaRun, Any]] = {}
    failed: dict[tuple[str, str], RdmaRun] = {}
    for r in runs:
        parsed = parse_output(r.result, parse_perftest) if r.result.ok else None
        bw = parsed.bw_avg_gbps if parsed is not None and not isinstance(parsed, ParseError) else None
        for host in (r.client, r.server):
            key = (host, r.nic)
            if bw is None:
                failed.setdefault(key, r)
            elif key not in best or bw > best[key][0]:
                best[key] = (bw, r, parsed)
    out: list[Finding] = []
    for (host, nic), (_bw, r, parsed) in best.items():
        fs = judge_perftest(parsed, host, link_rate_gbps=r.link_gbps)
        for f in fs:
            f.component = nic  # the NIC asked for (a capture's Device line may name another)
        out += [verdict(c.node, f"rdma:{nic}", c.status, c.figure, c.threshold,
                        f"{c.message} (best of its pairs; GPU {r.gpu})") for c in fold(fs)]
    for (host, nic), r in failed.items():
        if (host, nic) in best:
            continue
        gone = _not_measured(host, f"rdma:{nic}", r.result, timeouts)
        out.append(gone or verdict(host, f"rdma:{nic}", "warn", None, None,
                                   f"ib_write_bw with {r.server if host == r.client else r.client} gave no "
                                   f"figure: {r.result.reason() if not r.result.ok else 'unparseable'}"))
    return out


def a2a_checks(results: PreflightResults) -> list[Finding]:
    """all_to_all_perf per node and per pair: a run that failed fails; otherwise the figure is recorded."""
    out = []
    for run in results.nccl:
        if run.kind not in ("a2a-node", "a2a-pair"):
            continue
        check = "alltoall_node" if run.kind == "a2a-node" else "alltoall_inter"
        if run.result.rc == NOT_FOUND_RC and not run.result.stdout.strip():
            out += [verdict(h, check, "warn", None, None, f"not measured: {A2A_BINARY} is not installed")
                    for h in run.hosts]
            continue
        t, why = parse_nccl_run(run.result, "alltoall")
        where = "+".join(run.hosts)
        if t is None or t.failed:
            out += [verdict(h, check, "fail", None, None, f"{where}: {why or '; '.join(t.errors[:3] if t else [])}")
                    for h in run.hosts]
        else:
            out += [verdict(h, check, "pass", t.busbw_at_max_size, None,
                            f"{where}: all-to-all busbw {t.busbw_at_max_size} GB/s") for h in run.hosts]
    return out
