"""The secret-name rule: an environment variable whose name looks like a credential.

Such a name is refused in a job file's backend.env (it would be written into the rendered sbatch
script or manifest: render/env.py) and left out of the environment the trainer logs (trainer/mesh.py).
"""

from __future__ import annotations

import re

SECRET_WORDS = re.compile(r"(SECRET|PASSWORD|PASSWD|TOKEN|API_?KEY|CREDENTIAL|PRIVATE_KEY)", re.I)


def looks_secret(name: str) -> bool:
    """True when `name` (an environment variable's) contains one of SECRET_WORDS, in any case."""
    return SECRET_WORDS.search(name) is not None
