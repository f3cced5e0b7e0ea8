"""`python -m checks.groupprobe.worker SPEC -o RESULT`: one rank of the plan's group probe (under torchrun).

Every rank reads the same spec (launcher/formats/groupprobe.py), joins the world with torch.distributed
(NCCL when it has a GPU, gloo otherwise), and then, kind by kind (TP, CP, EP, PP neighbours, DP/ZeRO)
and phase by phase, creates that phase's groups and runs each group's collective at its message size:
every group of the phase at the same time, as the real step runs them, `warmup` untimed calls then
`iters` timed ones, each started together behind a world barrier. A call's time on one rank is from
the barrier's end to the collective's completion (on GPUs: synchronised); a group's time for a call is
its slowest member's, and its figure the median over the calls. Every rank gathers every rank's times
and host name; rank 0 (with --every-node: each node's local rank 0, the copy a pod judges itself by)
writes the spec back with the measurements filled in.

Exit 0 when it measured (judging is the reader's: the gate, `launch preflight --plan`), 1 when it could
not (the error is in the result file when rank 0 got that far, and on stderr).
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

from launcher.formats.groupprobe import GroupProbe, ProbeGroup

#: Printed by rank 0 before the result document when the result goes to stdout (`-o -`, over SSH).
RESULT_MARKER = "launch4d-groupprobe-result "


def host_name() -> str:
    """The node's name as the scheduler knows it (the gate compares it with the allocation)."""
    return os.environ.get("LAUNCH4D_NODE_NAME") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def phases(probe: GroupProbe) -> list[list[ProbeGroup]]:
    """The groups that run at the same time, in probe order: one list per (kind, phase)."""
    out: list[list[ProbeGroup]] = []
    for kind in probe.kinds():
        groups = probe.of(kind)
        for ph in sorted({g.phase for g in groups}):
            out.append([g for g in groups if g.phase == ph])
    return out


class _Call:
    """One group's collective on this rank, with its buffers allocated once."""

    def __init__(self, g: ProbeGroup, rank: int, pg: Any, device: Any):
        import torch

        self.g, self.pg, self.device = g, pg, device
        n = g.nbytes // 4
        self.me = g.ranks.index(rank)
        self.a = torch.ones(n, dtype=torch.float32, device=device)
        self.b = torch.empty(n if g.op in ("all_to_all", "send_recv") else n // g.size,
                             dtype=torch.float32, device=device)

    def __call__(self) -> None:
        import torch.distributed as dist

        op, a, b, pg = self.g.op, self.a, self.b, self.pg
        if op == "all_gather":
            dist.all_gather_into_tensor(a, b, group=pg)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(b, a, group=pg)
        elif op == "all_reduce":
            dist.all_reduce(a, group=pg)
        elif op == "all_to_all":
            dist.all_to_all_single(b, a, group=pg)
        else:   # send_recv: both neighbours send and receive at once (activations one way, gradients back)
            peer = self.g.ranks[1 - self.me]
            for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer, pg),
                                               dist.P2POp(dist.irecv, b, peer, pg)]):
                req.wait()


def run(probe: GroupProbe, timeout_s: float) -> GroupProbe:
    """This rank's part; returns the probe with every group measured (the same on every rank)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != probe.world_size:
            raise RuntimeError(f"the probe was started with {world} ranks; the plan has {probe.world_size}")

        def barrier() -> None:
            dist.barrier(device_ids=[local]) if cuda else dist.barrier()

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        mine: dict[tuple[str, int], list[float]] = {}      # (kind, index) -> this rank's call times
        for groups in phases(probe):
            pgs = [dist.new_group(g.ranks) for g in groups]   # every rank creates every group, in order
            here = [(g, pg) for g, pg in zip(groups, pgs) if rank in g.ranks]
            call = _Call(here[0][0], rank, here[0][1], device) if here else None
            times: list[float] = []
            for i in range(probe.warmup + probe.iters):
                barrier()
                sync()
                t0 = time.perf_counter()
                if call is not None:
                    call()
                    sync()
                if i >= probe.warmup:
                    times.append(time.perf_counter() - t0)
            if call is not None:
                mine[(call.g.kind, call.g.index)] = times
            barrier()
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (host_name(), mine))
    finally:
        dist.destroy_process_group()
    hosts = [h for h, _ in everyone]   # every rank holds every rank's times: each can write the result
    groups = []
    for g in probe.groups:
        per_rank = [everyone[r][1].get((g.kind, g.index), []) for r in g.ranks]
        calls = [max(ts) for ts in zip(*per_rank)]
        groups.append(replace(g, samples_s=[float(f"{t:.6g}") for t in calls],
                              measured_s=statistics.median(calls) if calls else None,
                              hosts=[hosts[r] for r in g.ranks]))
    return replace(probe, groups=groups, backend=backend)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from launcher.errors import UserError

    ap = argparse.ArgumentParser(prog="python -m checks.groupprobe.worker")
    ap.add_argument("spec", help="preflight-plan.json with the groups (launch preflight --plan writes it)")
    ap.add_argument("-o", "--output", default="-", help="where rank 0 writes the result (- : stdout)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may take")
    ap.add_argument("--every-node", action="store_true",
                    help="each node's local rank 0 writes the result too (a pod's own copy, for its own verdict)")
    args = ap.parse_args(argv)
    try:
        probe = GroupProbe.load(args.spec)
    except UserError as exc:
        print(f"groupprobe: {exc}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    writes = rank == 0 or (args.every_node and os.environ.get("LOCAL_RANK", "0") == "0")
    try:
        result = run(probe, args.timeout)
    except Exception as exc:  # noqa: BLE001 - one line for the reader; the result says it too
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"groupprobe: rank {rank} on {host_name()}: {why}", file=sys.stderr)
        if writes:
            _write(replace(probe, error=f"rank {rank} on {host_name()}: {why}"), args.output)
        return 1
    if writes:
        _write(result, args.output)
    return 0


def _write(probe: GroupProbe, output: str) -> None:
    if output == "-":
        import json

        print(RESULT_MARKER + json.dumps(probe.to_dict(), separators=(",", ":")), flush=True)
    else:
        probe.save(output)


if __name__ == "__main__":
    sys.exit(main())
