"""Pure parsers for the outputs of the tools preflight runs (one module per tool).

Each parser takes the text a tool printed and returns a dataclass; input it cannot make sense of
raises ParseError naming the line, never another exception, so a garbled probe output becomes a
failed check with a reason instead of a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from checks.parsers.base import drop_elisions, whole_lines

#: kinds whose parser reads a "..." line itself (dcgm-diag: a fragment; nvlink / nvlink-errors: links cut)
NOTES_ELISIONS = ("dcgm-diag", "nvlink", "nvlink-errors")


def parser_for(kind: str) -> Callable[[str], Any]:
    """The parser for a KIND as the CLI names it (see KINDS)."""
    from checks.parsers import (
        dcgm_diag,
        gpu_q,
        gpu_query,
        ibstat,
        nccl_tests,
        nvbandwidth,
        nvlink,
        nvlink_errors,
        perftest,
        topo,
        xid,
    )

    table: dict[str, Callable[[str], Any]] = {
        "topo": topo.parse_topo,
        "nccl-tests": nccl_tests.parse_nccl_tests_file,
        "gpu-query": gpu_query.parse_gpu_query,
        "nvlink": nvlink.parse_nvlink_status,
        "ibstat": ibstat.parse_ibstat,
        "xid": xid.parse_xid,
        "dcgm-diag": dcgm_diag.parse_dcgm_diag,
        "nvbandwidth": nvbandwidth.parse_nvbandwidth,
        "perftest": perftest.parse_perftest,
        "nvlink-errors": nvlink_errors.parse_nvlink_errors,
        "gpu-q": gpu_q.parse_gpu_q,
    }
    parse = table[kind]
    keep = kind in NOTES_ELISIONS
    return lambda text: parse(drop_elisions(whole_lines(text), keep))


KINDS = ("topo", "nccl-tests", "gpu-query", "nvlink", "ibstat", "xid", "dcgm-diag", "nvbandwidth", "perftest",
         "nvlink-errors", "gpu-q")
#: kinds whose `preflight parse` output carries the judges' findings beside the parse
JUDGED_KINDS = ("dcgm-diag", "nvbandwidth", "perftest", "nvlink-errors", "gpu-q", "xid")
