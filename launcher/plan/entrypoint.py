"""`train.entrypoint`: the user's own training code, launched under the plan instead of the bundled trainer.

Why a section of its own: the launch (torchrun with the plan's rank order and static rendezvous, the
diagnostics environment, the run dir) is the same for any code; only the program torchrun starts
differs. What the plan decided reaches that program through the environment
(launcher.render.env.plan_env), and the planner's memory figures stay the bundled trainer's
ledger, which `launch verify` cannot check against foreign code ("not verified: own code").
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from launcher.errors import SpecError
from launcher.plan.schema import bounded, show

MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
BUNDLED = "launcher.trainer"
#: What the plan's memory verdict says when the job runs its own code.
NOT_VERIFIED = "not verified: own code"


@dataclass(frozen=True)
class EntrypointSpec:
    """Your own training code instead of the bundled trainer: torchrun starts `script` (a Python file)
    or `module` (python -m) with `args`, with the plan's ranks and the plan in the environment."""

    script: str | None = bounded(None, doc="a Python file torchrun runs on every rank (relative: to the directory "
                                           "`launch` runs in; under Kubernetes, to the image's working directory)")
    module: str | None = bounded(None, doc="a Python module torchrun runs as `python -m MODULE` (not with script)")
    args: list[str] = dataclasses.field(default_factory=list,
                                        metadata={"doc": "arguments after the script or module, passed as written"})

    def __post_init__(self) -> None:
        where = "train.entrypoint"
        if (self.script is None) == (self.module is None):
            raise SpecError(where, "give script (a Python file) or module (a module name), "
                                   + ("not both" if self.script is not None else "one of them"))
        if self.script is not None:
            if not self.script.strip():
                raise SpecError(f"{where}.script", "is empty; give the path of a Python file")
            if self.script.startswith("-"):
                raise SpecError(f"{where}.script", f"{show(self.script)} starts with '-', which torchrun would read "
                                                   "as an option; write it as ./" + self.script)
        if self.module is not None:
            if not MODULE_NAME.fullmatch(self.module):
                raise SpecError(f"{where}.module", f"{show(self.module)} is not a Python module name "
                                                   "(dotted identifiers, e.g. mypkg.train)")
            if self.module == BUNDLED or self.module.startswith(BUNDLED + "."):
                raise SpecError(f"{where}.module", f"{self.module} is the bundled trainer; leave train.entrypoint "
                                                   "out to run it")

    @property
    def argv(self) -> list[str]:
        """What follows torchrun's own options: the script or `-m module`, then the arguments."""
        head = [self.script] if self.script is not None else ["-m", str(self.module)]
        return head + list(self.args)

    @property
    def label(self) -> str:
        return self.script if self.script is not None else f"-m {self.module}"
