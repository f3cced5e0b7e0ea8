"""What one trainer process runs: the typed Plan (read through the job file's own model), the
step count and the timeouts of this launch.

Why not a second typed copy of the plan: plan.json is loaded by `Plan.load` into the same
ModelSpec/TrainSpec/Layout the planner used, and `model.check_plan` rejects, before a
process group exists, what the trainer cannot run, with the plan field named.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from launcher.errors import UserError
from launcher.plan.model import Plan, check_plan
from launcher.plan.spec import ModelSpec, TrainSpec


@dataclass(frozen=True)
class TrainerConfig:
    plan: Plan
    init_timeout_s: float
    step_timeout_s: float

    @property
    def model(self) -> ModelSpec:
        return self.plan.model

    @property
    def train(self) -> TrainSpec:
        return self.plan.train


def config_from_plan(plan: Plan, steps: int | None = None, init_timeout_s: float | None = None,
                     step_timeout_s: float | None = None) -> TrainerConfig:
    """The plan as this launch runs it; UserError naming the plan field when the trainer cannot."""
    check_plan(plan)
    if steps is not None:       # what the metrics line shows as "step i/N"
        if steps < 1:
            raise UserError(f"--steps {steps}: must be >= 1")
        # tokens=None: a token budget would recompute steps and override the flag
        plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, steps=int(steps), tokens=None))
    diag = plan.diagnostics
    init_t = float(init_timeout_s if init_timeout_s is not None else diag.init_timeout_s)
    step_t = float(step_timeout_s if step_timeout_s is not None else diag.collective_timeout_s)
    if not (0 < init_t < float("inf") and 0 < step_t < float("inf")):
        raise UserError("timeouts must be positive (--init-timeout-s / --step-timeout-s)")
    return TrainerConfig(plan=plan, init_timeout_s=init_t, step_timeout_s=step_t)
