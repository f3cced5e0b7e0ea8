"""Run a preflight: probes and nccl-tests on every node at once, then node pairs, then all nodes.

Phase 1 (per host, all hosts concurrently): the node probes as one script, then nccl-tests over
all of that node's GPUs. Phase 2: inter-node pairs in rounds of disjoint pairs along a ring (2
rounds for an even count, 3 for odd: every node meets two different partners, so a slow node can
be told from a slow partner) instead of N^2 runs. Phase 3: one run over every node still healthy.
Multi-node runs go through mpirun (SSH: started on the pair's first host) or `srun --mpi`; the
binary, sizes and launcher templates are configurable and every command run is recorded.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from checks.hosts import compress
from checks.judges import JudgeConfig
from checks.parsers import ParseError
from checks.parsers.gpu_query import parse_gpu_query
from checks.parsers.topo import parse_topo
from checks.probe import PROBES, Probe, nccl_command
from checks.results import CommandResult, NcclRun, PreflightResults
from checks.runners import Runner

MPI_TEMPLATE = "mpirun --allow-run-as-root -np {np} -H {hosts_slots} --bind-to none -x NCCL_DEBUG=WARN {cmd}"
SRUN_TEMPLATE = "srun --mpi=pmix -N {nnodes} -w {hostlist} --ntasks-per-node={gpus} --gpus-per-node={gpus} {cmd}"
Progress = Callable[[str], None]


@dataclass
class NcclOptions:
    enabled: bool = True
    binary: str = "all_reduce_perf"
    sizes: tuple[str, str] = ("512M", "8G")
    extra: str = ""
    launcher: str | None = None  # a template with {np} {hosts_slots} {hostlist} {nnodes} {gpus} {cmd}
    pairs: bool = True
    all_nodes: bool = True

    @property
    def collective(self) -> str:
        return self.binary.rsplit("/", 1)[-1].removesuffix("_perf")


@dataclass
class PreflightOptions:
    probe_timeout: float = 60.0
    nccl_timeout: float = 900.0
    workers: int = 64
    probes: Sequence[Probe] = PROBES
    nccl: NcclOptions = field(default_factory=NcclOptions)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


def ring_rounds(hosts: Sequence[str]) -> list[list[tuple[str, str]]]:
    """Rounds of disjoint pairs covering the ring h0-h1-...-h(n-1)-h0 (2 rounds, 3 when n is odd)."""
    n = len(hosts)
    if n < 2:
        return []
    if n == 2:
        return [[(hosts[0], hosts[1])]]
    edges = [(hosts[i], hosts[(i + 1) % n]) for i in range(n)]
    rounds = [edges[0:n - (n % 2):2], edges[1:n - (n % 2):2]]
    if n % 2:
        rounds.append([edges[n - 1]])
    return [r for r in rounds if r]


def multi_command(opts: NcclOptions, runner: Runner, hosts: Sequence[str], gpus: int) -> str:
    cmd = nccl_command(opts.binary, 1, opts.sizes, opts.extra)  # one process per GPU
    template = opts.launcher or (SRUN_TEMPLATE if runner.launcher == "srun" else MPI_TEMPLATE)
    return template.format(np=gpus * len(hosts), hosts_slots=",".join(f"{h}:{gpus}" for h in hosts),
                           hostlist=compress(list(hosts)), nnodes=len(hosts), gpus=gpus, cmd=cmd)


def gpu_count(probes: dict[str, CommandResult]) -> int | None:
    for kind, parse in (("gpu-query", lambda t: parse_gpu_query(t).count), ("topo", lambda t: parse_topo(t).gpu_count)):
        r = probes.get(kind)
        if r is not None and r.ok:
            try:
                return parse(r.stdout)
            except ParseError:
                continue
    return None


def _pool(workers: int, n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, min(workers, n)))


def run_preflight(runner: Runner, hosts: Sequence[str], options: PreflightOptions | None = None,
                  progress: Progress | None = None) -> PreflightResults:
    opts = options or PreflightOptions()
    say = progress or (lambda _m: None)
    res = PreflightResults(hosts=list(hosts))
    node_runs: dict[str, NcclRun] = {}

    def node_phase(host: str) -> None:
        t0 = time.monotonic()
        probes = runner.run_probes(host, opts.probes, opts.probe_timeout)
        errors = {r.error for r in probes.values() if r.error}
        if errors and all(r.error for r in probes.values()):
            res.unreachable[host] = sorted(errors)[0]
            say(f"[probe] {host}: FAILED: {res.unreachable[host]}")
            return
        res.probes[host] = probes
        n = gpu_count(probes)
        if n:
            res.gpus_per_node[host] = n
        bad = [k for k, r in probes.items() if not r.ok]
        say(f"[probe] {host}: {n if n is not None else '?'} GPUs" + (f", failed: {', '.join(bad)}" if bad else "")
            + f" ({time.monotonic() - t0:.1f}s)")
        if opts.nccl.enabled and n:
            cmd = nccl_command(opts.nccl.binary, n, opts.nccl.sizes, opts.nccl.extra)
            r = runner.run(host, cmd, opts.nccl_timeout)
            node_runs[host] = NcclRun("node", [host], opts.nccl.collective, r)
            say(f"[nccl-node] {host}: " + ("ok" if r.ok else r.reason()) + f" ({r.seconds:.1f}s)")

    say(f"[probe] {len(hosts)} host(s): {compress(list(hosts))}")
    with _pool(opts.workers, len(hosts)) as pool:
        list(pool.map(node_phase, hosts))
    for p in opts.probes:
        ran = [h for h in hosts if h in res.probes]
        if ran:
            res.commands.append(f"[{compress(ran)}] {p.command}")
    for h in hosts:
        if h in node_runs:
            res.nccl.append(node_runs[h])
            res.commands.append(f"[{h}] {node_runs[h].result.command}")

    if not opts.nccl.enabled:
        return res
    if runner.launcher is None:
        say(f"[nccl-pairs] skipped: the {runner.name} backend cannot start multi-node nccl-tests")
        return res
    # pairs only among nodes whose own run worked: a node that hangs alone would hang its pairs too
    from checks.assemble import parse_nccl_run

    ok_nodes = [h for h in hosts if h in node_runs
                and (lambda t: t[0] is not None and not t[0].failed)(parse_nccl_run(node_runs[h].result,
                                                                                    opts.nccl.collective))]
    if opts.nccl.pairs and len(ok_nodes) >= 2:
        rounds = ring_rounds(ok_nodes)
        for i, rnd in enumerate(rounds, 1):
            say(f"[nccl-pairs] round {i}/{len(rounds)}: {len(rnd)} pair(s)")

            def pair(ab: tuple[str, str]) -> NcclRun:
                g = min(res.gpus_per_node.get(ab[0], 1), res.gpus_per_node.get(ab[1], 1))
                cmd = multi_command(opts.nccl, runner, ab, g)
                r = runner.run_multi(list(ab), cmd, opts.nccl_timeout)
                say(f"[nccl-pairs] {ab[0]}<->{ab[1]}: " + ("ok" if r.ok else r.reason()) + f" ({r.seconds:.1f}s)")
                return NcclRun("pair", list(ab), opts.nccl.collective, r)

            with _pool(opts.workers, len(rnd)) as pool:
                for run in pool.map(pair, rnd):
                    res.nccl.append(run)
                    res.commands.append(f"[{run.hosts[0]}] {run.result.command}")
    if opts.nccl.all_nodes and len(ok_nodes) > 2:
        from checks.assemble import assemble

        healthy = [h for h in ok_nodes if h not in set(assemble(res, opts.judge).exclude)]
        if len(healthy) > 2:
            g = min(res.gpus_per_node.get(h, 1) for h in healthy)
            cmd = multi_command(opts.nccl, runner, healthy, g)
            say(f"[nccl-all] {len(healthy)} nodes")
            r = runner.run_multi(healthy, cmd, opts.nccl_timeout)
            say("[nccl-all] " + ("ok" if r.ok else r.reason()) + f" ({r.seconds:.1f}s)")
            res.nccl.append(NcclRun("all", healthy, opts.nccl.collective, r))
            res.commands.append(f"[{healthy[0]}] {cmd}")
    return res


def quote_hosts(hosts: Sequence[str]) -> str:
    return " ".join(shlex.quote(h) for h in hosts)
