"""InfiniBand/RoCE ports of one node judged from ibstat alone (`launch preflight parse ibstat`): missing
adapters, ports down, degraded rates."""

from __future__ import annotations

from checks.judges.finding import Finding
from checks.parsers.ibstat import IbStatus


def judge_ibstat(ib: IbStatus, node: str = "", rate_gbps: float | None = None) -> list[Finding]:
    """Missing adapters and down IB ports fail; Ethernet ports switched off (Disabled) are unused, not flagged."""
    out: list[Finding] = []
    for ca in ib.missing:
        out.append(Finding(node, ca, "ib", "fail", "missing", "present", f"{ca} vanished while ibstat listed "
                           "the adapters", "check `dmesg | grep mlx5` and the PCIe device; reload mlx5_core or "
                           "reboot; replace the adapter if it recurs", "ibstat"))
    unused = {(p.ca, p.port) for p in ib.unused_ethernet}
    best = max((p.rate_gbps or 0 for p in ib.ports if p.active and (p.link_layer or "") == "InfiniBand"), default=0)
    for p in ib.ports:
        name = f"{p.ca}/{p.port}"
        if (p.ca, p.port) in unused:
            continue
        if not p.active:
            ib_port = (p.link_layer or "InfiniBand") == "InfiniBand"
            out.append(Finding(node, name, "ib", "fail" if ib_port else "warn", f"{p.state}/{p.physical_state}",
                               "Active/LinkUp", f"{name} ({p.link_layer}) is {p.state}/{p.physical_state}"
                               + ("" if ib_port else ": an Ethernet port that is down but not disabled (a RoCE "
                                  "rail with a fault, or an unused port; compare with the other nodes)"),
                               "check cable and switch port; `ibportstate` / reseat; replace the cable",
                               "ibstat"))
            continue
        want = rate_gbps or (best if (p.link_layer or "") == "InfiniBand" else None)
        if want and p.rate_gbps is not None and p.rate_gbps < want:
            out.append(Finding(node, name, "ib", "fail", p.rate_gbps, want, f"{name} at {p.rate_gbps:g} Gb/s",
                               "a degraded link width/speed: reseat or replace the cable", "fastest IB port"))
    return out or [Finding(node, "node", "ib", "pass", len([p for p in ib.ports if p.active]), None,
                           f"{len([p for p in ib.ports if p.active])} ports active"
                           + (f"; {len(unused)} unused Ethernet ports disabled" if unused else ""), "", "ibstat")]


