"""What tests of the planner share: the plan it chose and a refusal, each asserted present.

PlanResult.best is None when nothing fits; a test that expects a plan fails here with what the planner
rejected, not later on an attribute of None (and mypy knows the plan is there).
"""

from __future__ import annotations

from launcher.plan.model import Plan
from launcher.plan.planner import PlanResult


def chosen(result: PlanResult) -> Plan:
    """result.best, which the test expects to exist."""
    assert result.best is not None, f"no plan chosen; rejected: {result.rejected}"
    return result.best


def refused(problem: str | None) -> str:
    """A capability check's reason for refusing, which the test expects (None: it was allowed)."""
    assert problem is not None, "allowed where a refusal was expected"
    return problem
