"""What rendering a job produces (file name -> text, written all or nothing), and the plan checks
and per-node GPU lists both the Slurm and the Kubernetes renderings start from."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.errors import UserError
from launcher.formats import rundir
from launcher.formats.files import check_writable_target, make_dirs, read_text, remove_created, write_files

if TYPE_CHECKING:
    from launcher.plan.model import Plan


@dataclass
class Rendered:
    """What `launch render` writes into a run dir: file name -> text; `main` is the script/manifest."""

    backend: str
    run_dir: str
    main: str
    files: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def write(self, directory: str | Path, force: bool = False) -> list[Path]:
        """Write every file, all or nothing (staged, then renamed), into `directory` and create its
        logs/ for Slurm's output files. A directory holding another job's files is refused unless
        `force`; a failure removes the directories this call created."""
        d = Path(directory)
        if not force:
            self.check_target(d)
        for name in self.files:
            check_writable_target(d / name, "rendered file")
        created = make_dirs(d, "output directory")
        try:
            created += make_dirs(d / rundir.LOGS, "output directory")
            return write_files(d, {name: (text, 0o755 if name.endswith(".sbatch") else 0o644)
                                   for name, text in self.files.items()}, "rendered file")
        except BaseException:
            remove_created(created)
            raise

    def check_target(self, d: Path) -> None:
        """Refuse to overwrite another job's files: existing ones must belong to a plan of this name."""
        clash = sorted(n for n in self.files if (d / n).exists())
        if not clash:
            return
        mine = json.loads(self.files[rundir.PLAN]).get("name") if rundir.PLAN in self.files else None
        theirs = None
        if (d / rundir.PLAN).exists():
            try:
                theirs = json.loads(read_text(d / rundir.PLAN, "plan")).get("name")
            except (UserError, ValueError, AttributeError):
                theirs = None
        if mine is None or theirs != mine:
            raise UserError(f"-o {d}: already holds {', '.join(clash)} of "
                            f"{'another job (' + repr(theirs) + ')' if theirs else 'something else'}; "
                            "give another directory, or --force to overwrite")


def gpu_lists(plan: Plan) -> list[str]:
    """Per node (in plan node order), the physical GPU indices in local-rank order."""
    by_node: dict[int, list[tuple[int, int]]] = {}
    for r in plan.ranks:
        by_node.setdefault(r.node, []).append((r.local_rank, r.gpu))
    return [",".join(str(g) for _, g in sorted(by_node[n])) for n in sorted(by_node)]


def check_rank_map(plan: Plan) -> None:
    """The plan's rank map and hosts cover its nodes (a hand-edited plan.json is refused before rendering)."""
    if len(plan.ranks) != plan.world_size or plan.nodes * plan.gpus_per_node != plan.world_size:
        raise UserError(f"plan {plan.name}: {len(plan.ranks)} ranks for {plan.nodes} node(s) x "
                        f"{plan.gpus_per_node} GPU(s); re-run `launch plan`")
    if plan.hosts and len(plan.hosts) != plan.nodes:
        raise UserError(f"plan {plan.name}: {len(plan.hosts)} hosts for {plan.nodes} nodes")
