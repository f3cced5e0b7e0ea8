"""Run a preflight: probes and nccl-tests on every node at once, then node pairs, then all nodes.

Phase 1 (per host, all hosts concurrently): the node probes as one script, then nccl-tests over
all of that node's GPUs. Phase 2: inter-node pairs in rounds of disjoint pairs instead of N^2 runs:
round 1 pairs neighbours (h0,h1), (h2,h3), ...; only when a pair is slow or fails (or N is odd)
does a second round pair each node of a bad pair with a node from a good pair, which tells the bad
node from its partner. So 1 round on a healthy cluster, 2 (rarely 3) otherwise: constant in N.
`checks.pairing.ring_rounds` (every node meets two partners, 2-3 rounds) is the fixed schedule the Slurm batch
job uses, since it cannot adapt. Phase 3: one run over every node still healthy.
Multi-node runs go through mpirun (SSH: started on the pair's first host) or `srun --mpi`; the
binary, sizes and launcher templates are configurable and every command run is recorded.
"""

from __future__ import annotations

import shlex
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from checks import levels
from checks.hosts import compress
from checks.judges.config import JudgeConfig
from checks.judges.deep import rdma_checks
from checks.pairing import NcclOptions, first_round, second_round
from checks.parsed import parse_nccl_run
from checks.parsers.base import ParseError
from checks.parsers.gpu_query import parse_gpu_query
from checks.parsers.topo import parse_topo
from checks.probe import PROBES, Probe, nccl_command
from checks.results import NcclRun, PreflightResults
from checks.runners.base import Runner
from launcher.transport import Completed

# NCCL_DEBUG=INFO: the log then says which transport each channel used (NET/IB vs a NET/Socket fallback)
MPI_TEMPLATE = "mpirun --allow-run-as-root -np {np} -H {hosts_slots} --bind-to none -x NCCL_DEBUG=INFO {cmd}"
SRUN_TEMPLATE = ("srun --mpi=pmix -N {nnodes} -w {hostlist} --ntasks-per-node={gpus} --gpus-per-node={gpus} "
                 "--export=ALL,NCCL_DEBUG=INFO {cmd}")
Progress = Callable[[str], None]


@dataclass
class PreflightOptions:
    probe_timeout: float = 60.0
    nccl_timeout: float = 900.0
    workers: int = 64
    probes: Sequence[Probe] = PROBES
    nccl: NcclOptions = field(default_factory=NcclOptions)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    level: str = "quick"  # quick | standard | long (checks/levels.py)
    tool_timeouts: dict[str, float] = field(default_factory=dict)  # --tool-timeout: tool -> seconds


def suspect_pairs(runs: Sequence[NcclRun], judge: JudgeConfig, collective: str) -> set[tuple[str, str]]:
    """Pairs that failed, or whose busbw is under the threshold or well under the round's median."""
    bw: dict[tuple[str, str], float] = {}
    bad: set[tuple[str, str]] = set()
    for r in runs:
        key = (r.hosts[0], r.hosts[1])
        t, _ = parse_nccl_run(r.result, collective)
        if t is None or t.failed or not t.busbw_at_max_size:
            bad.add(key)
        else:
            bw[key] = t.busbw_at_max_size
    floor = judge.min_inter_busbw_gbs
    if bw:
        med = sorted(bw.values())[len(bw) // 2]
        for key, v in bw.items():
            if (floor is not None and v < floor) or (len(bw) >= 2 and v < judge.outlier_warn * med):
                bad.add(key)
    return bad


def multi_command(opts: NcclOptions, runner: Runner, hosts: Sequence[str], gpus: int) -> str:
    cmd = nccl_command(opts.binary, 1, opts.sizes, opts.extra)  # one process per GPU
    template = opts.launcher or (SRUN_TEMPLATE if runner.launcher == "srun" else MPI_TEMPLATE)
    # quoted: the command runs under a shell in the output folder, which holds one folder per host, so an
    # unquoted `-w n[1-2]` would glob to `-w n1 n2` there
    return template.format(np=gpus * len(hosts), hosts_slots=shlex.quote(",".join(f"{h}:{gpus}" for h in hosts)),
                           hostlist=shlex.quote(compress(list(hosts))), nnodes=len(hosts), gpus=gpus, cmd=cmd)


def gpu_count(probes: dict[str, Completed]) -> int | None:
    for kind, parse in (("gpu-query", lambda t: parse_gpu_query(t).count), ("topo", lambda t: parse_topo(t).gpu_count)):
        r = probes.get(kind)
        if r is not None and r.ok:
            try:
                return parse(r.stdout)
            except ParseError:
                continue
    return None


class _Pool(ThreadPoolExecutor):
    """A fan-out that, when the main thread leaves it with an exception (Ctrl-C, SIGTERM, a bug),
    cancels the work not yet started and does not wait for the work that is: a host that accepted
    the connection but never answers would hold Ctrl-C for as long as its timeouts run."""

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.shutdown(wait=exc_type is None, cancel_futures=exc_type is not None)


def _pool(workers: int, n: int) -> ThreadPoolExecutor:
    return _Pool(max_workers=max(1, min(workers, n)))


def run_preflight(runner: Runner, hosts: Sequence[str], options: PreflightOptions | None = None,
                  progress: Progress | None = None) -> PreflightResults:
    opts = options or PreflightOptions()
    say = progress or (lambda _m: None)
    res = PreflightResults(hosts=list(hosts), level=opts.level,
                           tool_timeouts=levels.effective_timeouts(opts.level, opts.nccl_timeout, opts.tool_timeouts))
    node_runs: dict[str, NcclRun] = {}
    a2a_runs: dict[str, NcclRun] = {}
    deep = levels.depth(opts.level)
    multi = opts.nccl.enabled and opts.nccl.pairs and runner.launcher is not None
    # Round 1 is pipelined: a pair starts as soon as both of its nodes passed their own run (the pair
    # touches only those two nodes, so it cannot disturb nodes still measuring themselves).
    first = first_round(hosts) if multi else []
    partner = {a: b for a, b in first} | {b: a for a, b in first}
    node_ok: dict[str, bool] = {}
    lock = threading.Lock()
    pair_pool = _pool(opts.workers, max(1, len(first)))
    round1: list[tuple[tuple[str, str], Future[NcclRun]]] = []

    def pair(ab: tuple[str, str]) -> NcclRun:
        g = min(res.gpus_per_node.get(ab[0], 1), res.gpus_per_node.get(ab[1], 1))
        cmd = multi_command(opts.nccl, runner, ab, g)
        r = runner.run_multi(list(ab), cmd, opts.nccl_timeout)
        say(f"[nccl-pairs] {ab[0]}<->{ab[1]}: " + ("ok" if r.ok else r.reason()) + f" ({r.seconds:.1f}s)")
        return NcclRun("pair", list(ab), opts.nccl.collective, r)

    def node_done(host: str, ok: bool) -> None:
        with lock:
            node_ok[host] = ok
            other = partner.get(host)
            if ok and other is not None and node_ok.get(other):
                ab = next(p for p in first if host in p)
                round1.append((ab, pair_pool.submit(pair, ab)))

    def node_phase(host: str) -> None:
        t0 = time.monotonic()
        probes = runner.run_probes(host, opts.probes, opts.probe_timeout)
        errors = {r.error for r in probes.values() if r.error}
        if errors and all(r.error for r in probes.values()):
            res.unreachable[host] = sorted(errors)[0]
            say(f"[probe] {host}: FAILED: {res.unreachable[host]}")
            return node_done(host, False)
        res.probes[host] = probes
        n = gpu_count(probes)
        if n:
            res.gpus_per_node[host] = n
        bad = [k for k, r in probes.items() if not r.ok]
        say(f"[probe] {host}: {n if n is not None else '?'} GPUs" + (f", failed: {', '.join(bad)}" if bad else "")
            + f" ({time.monotonic() - t0:.1f}s)")

        def step(s: levels.Step) -> None:
            r = probes[s.name] = runner.run(host, s.command, s.within(res.tool_timeouts))
            say(f"[{s.name}] {host}: " + ("ok" if r.ok else r.reason()) + f" ({r.seconds:.1f}s)")

        if deep and n:
            for s in levels.node_steps(opts.level):
                step(s)
        if opts.nccl.enabled and n:
            if deep:
                step(levels.NVLINK_BEFORE)
            cmd = nccl_command(opts.nccl.binary, n, opts.nccl.sizes, opts.nccl.extra)
            r = runner.run(host, cmd, opts.nccl_timeout)
            run = NcclRun("node", [host], opts.nccl.collective, r)
            node_runs[host] = run
            say(f"[nccl-node] {host}: " + ("ok" if r.ok else r.reason()) + f" ({r.seconds:.1f}s)")
            if deep:
                step(levels.NVLINK_AFTER)
            if deep >= 2:
                cmd = nccl_command(levels.A2A_BINARY, n, opts.nccl.sizes, opts.nccl.extra)
                a2a = runner.run(host, cmd, res.tool_timeouts[levels.A2A_BINARY])
                a2a_runs[host] = NcclRun("a2a-node", [host], "alltoall", a2a)
                say(f"[alltoall-node] {host}: " + ("ok" if a2a.ok else a2a.reason()) + f" ({a2a.seconds:.1f}s)")
            # pairs only among nodes whose own run worked: a node that hangs alone would hang its pairs
            t, _ = parse_nccl_run(r, opts.nccl.collective)
            return node_done(host, t is not None and not t.failed)
        return node_done(host, False)

    say(f"[probe] {len(hosts)} host(s): {compress(list(hosts))}")
    if first:
        say(f"[nccl-pairs] round 1: up to {len(first)} pair(s), each as soon as both nodes are done")
    try:
        with _pool(opts.workers, len(hosts)) as pool:
            list(pool.map(node_phase, hosts))
        runs = [f.result() for _, f in sorted(round1, key=lambda x: first.index(x[0]))]
    except BaseException:
        pair_pool.shutdown(wait=False, cancel_futures=True)
        runner.close()  # what the workers still wait on (connections, remote commands) ends now
        raise
    finally:
        pair_pool.shutdown()
    for p in opts.probes:
        ran = [h for h in hosts if h in res.probes]
        if ran:
            res.commands.append(f"[{compress(ran)}] {p.command}")
    for h in hosts:
        for runs_of in (node_runs, a2a_runs):
            if h in runs_of:
                res.nccl.append(runs_of[h])
                res.commands.append(f"[{h}] {runs_of[h].result.command}")
    if not opts.nccl.enabled:
        return res
    if runner.launcher is None:
        say(f"[nccl-pairs] skipped: the {runner.name} backend cannot start multi-node nccl-tests")
        return res
    ok_nodes = [h for h in hosts if node_ok.get(h)]

    def record(rs: list[NcclRun]) -> None:
        for run in rs:
            res.nccl.append(run)
            res.commands.append(f"[{run.hosts[0]}] {run.result.command}")

    def run_round(i: int, rnd: list[tuple[str, str]]) -> list[NcclRun]:
        say(f"[nccl-pairs] round {i}: {len(rnd)} pair(s)")
        with _pool(opts.workers, len(rnd)) as pool:
            rs = list(pool.map(pair, rnd))
        record(rs)
        return rs

    if multi and len(ok_nodes) >= 2:
        record(runs)
        done_first = [(r.hosts[0], r.hosts[1]) for r in runs]
        bad = suspect_pairs(runs, opts.judge, opts.nccl.collective)
        second = second_round(ok_nodes, done_first, bad)
        if second:
            runs = runs + run_round(2, second)
            covered = {h for r in runs for h in r.hosts}
            lone = [h for h in ok_nodes if h not in covered]  # an odd one out with no partner yet
            for j, h in enumerate(lone):
                run_round(3 + j, [(h, next(x for x in ok_nodes if x != h))])
    if deep >= 2 and len(ok_nodes) >= 2:
        long_pairs(runner, res, ok_nodes, opts, say)
    if opts.nccl.all_nodes and len(ok_nodes) > 2:
        from checks.assemble import assemble

        excluded = set(assemble(res, opts.judge).exclude)
        healthy = [h for h in ok_nodes if h not in excluded]
        if len(healthy) > 2:
            g = min(res.gpus_per_node.get(h, 1) for h in healthy)
            cmd = multi_command(opts.nccl, runner, healthy, g)
            say(f"[nccl-all] {len(healthy)} nodes")
            r = runner.run_multi(healthy, cmd, opts.nccl_timeout)
            say("[nccl-all] " + ("ok" if r.ok else r.reason()) + f" ({r.seconds:.1f}s)")
            res.nccl.append(NcclRun("all", healthy, opts.nccl.collective, r))
            res.commands.append(f"[{healthy[0]}] {cmd}")
    return res


def _pair_rounds(hosts: Sequence[str], run_round: Callable[[list[tuple[str, str]]], set[tuple[str, str]]]) -> None:
    """Round 1 pairs neighbours; round 2 re-pairs each node of a bad pair (and an odd one out) with a
    node from a good pair; `run_round` runs one round and returns its bad pairs."""
    first = first_round(hosts)
    bad = run_round(first)
    second = second_round(hosts, first, bad)
    if second:
        run_round(second)


def long_pairs(runner: Runner, res: PreflightResults, hosts: Sequence[str], opts: PreflightOptions,
               say: Progress) -> None:
    """Level long, between node pairs: all_to_all_perf on round 1's pairs, then per-NIC GPUDirect
    `ib_write_bw` in rounds of disjoint pairs (server on the second node, client on the first)."""
    a2a = NcclOptions(binary=levels.A2A_BINARY, sizes=opts.nccl.sizes, extra=opts.nccl.extra,
                      launcher=opts.nccl.launcher)
    pairs = first_round(hosts)
    if opts.nccl.enabled and runner.launcher is not None and pairs:
        def a2a_pair(ab: tuple[str, str]) -> NcclRun:
            g = min(res.gpus_per_node.get(ab[0], 1), res.gpus_per_node.get(ab[1], 1))
            cmd = multi_command(a2a, runner, ab, g)
            r = runner.run_multi(list(ab), cmd, res.tool_timeouts[levels.A2A_BINARY])
            say(f"[alltoall-pairs] {ab[0]}<->{ab[1]}: " + ("ok" if r.ok else r.reason()) + f" ({r.seconds:.1f}s)")
            return NcclRun("a2a-pair", list(ab), "alltoall", r)
        with _pool(opts.workers, len(pairs)) as pool:
            for run in pool.map(a2a_pair, pairs):
                res.nccl.append(run)
                res.commands.append(f"[{run.hosts[0]}] {run.result.command}")

    def nics(host: str) -> list[tuple[str, int | None, float | None]]:
        """(NIC, nearest GPU, link rate) for every active port of the node, from its ibstat and topology."""
        from checks.parsers.ibstat import parse_ibstat

        probes = res.probes.get(host, {})
        try:
            ib = parse_ibstat(probes["ibstat"].stdout) if "ibstat" in probes else None
        except ParseError:
            ib = None
        try:
            topo = parse_topo(probes["topo"].stdout) if "topo" in probes else None
        except ParseError:
            topo = None
        near = {nic: int(g.removeprefix("GPU")) for g, nic in reversed(list((topo.nearest_nic if topo else {}).items()))}
        ports = [p for ca in (ib.cas if ib else []) for p in ca.ports if p.active]
        return [(p.ca, near.get(p.ca, 0 if near or res.gpus_per_node.get(host) else None), p.rate_gbps)
                for p in ports]

    def rdma_pair(ab: tuple[str, str]) -> list[levels.RdmaRun]:
        a, b = ab
        out = []
        for i, (nic, gpu, rate) in enumerate(nics(a)):
            port = 18515 + i
            with ThreadPoolExecutor(max_workers=1) as one:
                limit = res.tool_timeouts["ib_write_bw"]
                server = one.submit(runner.run, b, levels.rdma_command(nic, gpu, port), limit)
                time.sleep(1.0)  # the server listens before the client connects
                client = runner.run(a, levels.rdma_command(nic, gpu, port, server=b), limit)
                srv = server.result()
            out.append(levels.RdmaRun(a, b, nic, gpu, rate, client, srv))
            res.commands.append(f"[{a}] {client.command}")
        fig = ", ".join(f"{r.nic} {'ok' if r.result.ok else r.result.reason()}" for r in out)
        say(f"[rdma] {a}->{b}: {fig or 'no active NIC'}")
        return out

    def rdma_round(rnd: list[tuple[str, str]]) -> set[tuple[str, str]]:
        with _pool(opts.workers, len(rnd)) as pool:
            runs = dict(zip(rnd, pool.map(rdma_pair, rnd)))
        bad = set()
        for ab, rs in runs.items():
            res.rdma.extend(rs)
            judged = rdma_checks(rs, res.tool_timeouts)
            if any(c.status != "pass" for c in judged):
                bad.add(ab)
        return bad

    _pair_rounds(list(hosts), rdma_round)
