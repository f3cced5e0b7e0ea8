"""A figure against a threshold (`at_least`) or against its peers (`outliers`, `mode`)."""

from __future__ import annotations

import statistics
from typing import Any

from checks.judges.finding import Finding, verdict


def at_least(node: str, check: str, value: float, minimum: float | None, margin: float, unit: str = "GB/s",
             source: str = "") -> Finding:
    """value >= minimum passes; within `margin` above it warns; below fails."""
    if minimum is None:
        return verdict(node, check, "pass", value, None, f"{value:.1f} {unit} (no threshold set)")
    src = f" ({source})" if source else ""
    if value < minimum:
        return verdict(node, check, "fail", value, minimum, f"{value:.1f} {unit} is below {minimum:g} {unit}{src}")
    if value < minimum * (1 + margin):
        return verdict(node, check, "warn", value, minimum,
                       f"{value:.1f} {unit} is within {margin:.0%} of the {minimum:g} {unit} threshold{src}")
    return verdict(node, check, "pass", value, minimum, f"{value:.1f} {unit} >= {minimum:g} {unit}{src}")


def outliers(values: dict[str, float], fail_frac: float, warn_frac: float) -> dict[str, tuple[str, float, str]]:
    """Values well below the median of their peers: {key: (status, median, message)}; needs >= 3 values."""
    if len(values) < 3:
        return {}
    med = statistics.median(values.values())
    out: dict[str, tuple[str, float, str]] = {}
    if med <= 0:
        return out
    for k, v in values.items():
        frac = v / med
        if frac < fail_frac:
            out[k] = ("fail", med, f"outlier: {v:.1f} is {1 - frac:.0%} below the median {med:.1f}")
        elif frac < warn_frac:
            out[k] = ("warn", med, f"{v:.1f} is {1 - frac:.0%} below the median {med:.1f}")
    return out


def mode(values: list[Any]) -> Any:
    """The most common value (ties: the first seen)."""
    if not values:
        return None
    counts: dict[Any, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return max(counts, key=lambda v: counts[v])

