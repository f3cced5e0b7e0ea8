"""`--backend slurm`: the whole preflight as one batch job, rendered from templates/slurm/preflight.sbatch.j2.

The job runs the node probes (`python -m checks.probe --level L`: at standard and long also the
level's single-node tools) on every node with srun, the pair rounds and the all-node run with
`srun --mpi`, at level long the pair tests (`python -m checks.slurm_pairs`: all_to_all_perf
and per-NIC ib_write_bw as srun steps), writes everything in the `import` layout under OUT, and
ends with `python -m checks OUT` (the BandwidthMap in OUT/bwmap.json). Rendered with
jinja2 directly; checks imports only launch4d's torch-free formats (launcher.formats), whose one
quoting function every user string goes through.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from checks.hosts import compress
from checks.pairing import NcclOptions, ring_rounds
from launcher.errors import UserError
from launcher.formats.shell import quote
from launcher.formats.shell import sbatch_value as formats_sbatch_value

TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "slurm" / "preflight.sbatch.j2"


class SlurmJobError(ValueError):
    """A value that cannot go into the batch script; the message names it."""


def sbatch_value(value: object) -> str:
    """#SBATCH lines are not shell: sbatch reads them itself, so only plain values may go there."""
    try:
        return formats_sbatch_value(value)
    except UserError as exc:
        raise SlurmJobError(str(exc)) from None


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


def render(hosts: list[str], opts: SlurmJobOptions, template: Path | None = None) -> str:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str((template or TEMPLATE).parent)),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["q"] = quote
    env.filters["sbatch"] = sbatch_value
    tpl = env.get_template((template or TEMPLATE).name)
    return tpl.render(hosts=hosts, nodelist=compress(hosts), rounds=ring_rounds(hosts) if opts.nccl.pairs else [],
                      o=opts, nccl=opts.nccl, collective=opts.nccl.collective)


def submit(script: str, out_dir: Path, sbatch: str = "sbatch", env: dict[str, str] | None = None) -> str:
    """Write the script next to its outputs and sbatch it; returns the job id."""
    from launcher.formats.files import atomic_write, make_dirs

    make_dirs(out_dir, "preflight output directory")
    path = atomic_write(out_dir / "preflight.sbatch", script, "preflight script", 0o755)
    p = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"sbatch failed: {(p.stderr or p.stdout).strip()}")
    m = re.match(r"^(\d+)", p.stdout.strip())
    if not m:
        raise RuntimeError(f"sbatch printed no job id: {p.stdout.strip()!r}")
    return m.group(1)
