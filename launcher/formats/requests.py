"""Kinds of job that are not a planned training job, as plain data: what preflight (checks, the
command layer) makes and a backend runs through its one interface (Backend.request -> Request ->
submit), so no caller reaches past that interface to a backend's own methods. They live here
because checks builds them and may not import the backends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BatchScript:
    """A batch script made elsewhere (preflight's), run as one job: submitted, followed and cancelled
    like any. It writes its own output into `run_dir` (no logs/ folder there)."""

    name: str
    run_dir: str
    script_name: str
    script: str
    nodes: int
    files: dict[str, str] = field(default_factory=dict)   # more files beside the script (a group spec)


@dataclass
class Manifests:
    """Kubernetes objects made elsewhere: one Pod (preflight's node checks), or a headless Service then
    its pods (a gang: `launch preflight --plan --backend k8s`), created, followed and deleted as one job."""

    docs: list[dict[str, Any]]
    run_dir: str = ""
    gpus_per_node: int = 1
