"""`--backend slurm`: the whole preflight as one batch job, rendered from templates/slurm/preflight.sbatch.j2.

The job runs the node probes (`python -m checks.probe --level L`: at standard and long also the
level's single-node tools) on every node with srun, the pair rounds and the all-node run with
`srun --mpi`, at level long the pair tests (`python -m checks.slurm_pairs`: all_to_all_perf
and per-NIC ib_write_bw as srun steps), writes everything in the `import` layout under OUT, and
ends with `python -m checks OUT` (the BandwidthMap in OUT/bwmap.json). Rendered by
launcher.render's one environment (handed in by the command layer: checks does not import render),
whose `q` filter every user string goes through and whose `sbatch` filter every #SBATCH value does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from checks.hosts import compress
from checks.pairing import NcclOptions, ring_rounds
from checks.runners.base import Renderer
from launcher.errors import UserError

TEMPLATE = "slurm/preflight.sbatch.j2"  # rendered by launcher.render's one environment


class SlurmJobError(ValueError):
    """A value that cannot go into the batch script; the message names it."""


@dataclass
class SlurmJobOptions:
    out_dir: str
    partition: str | None = None
    account: str | None = None
    time: str = "00:30:00"
    python: str = "python3"
    gpus_per_node: int | None = None
    mpi: str = "pmix"
    probe_timeout: int = 120
    nccl_timeout: int = 900
    job_name: str = "launch4d-preflight"
    nccl: NcclOptions = field(default_factory=NcclOptions)
    level: str = "quick"  # standard/long: each node runs the level's tools; long adds the pair tests
    tool_timeouts: list[str] = field(default_factory=list)  # TOOL=SECONDS, as --tool-timeout takes them


def render(hosts: list[str], opts: SlurmJobOptions, render_template: Renderer) -> str:
    """The batch script, through `render_template`: launcher.render's one environment (its `q` and
    `sbatch` filters)."""
    try:
        return render_template(TEMPLATE, dict(hosts=hosts, nodelist=compress(hosts), o=opts, nccl=opts.nccl,
                                              rounds=ring_rounds(hosts) if opts.nccl.pairs else [],
                                              collective=opts.nccl.collective))
    except UserError as exc:
        raise SlurmJobError(str(exc)) from None
