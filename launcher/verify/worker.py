"""Run each role's trace in its own process: a fresh fake world per rank, several at once.

Why processes: the fake process group is a process-wide singleton and torch keeps per-world
state (group names, mesh caches) that a second world in the same process trips over; and the
CPUs trace two roles at once where one process would trace one. Why a fork server: it imports
torch and the trainer once and forks every worker from that clean process (no threads, no
process group), so a worker starts in milliseconds, not in the seconds an import of torch takes
on a loaded machine. Results come back as plain
dicts of ints and strings (an exception's cause chain does not survive pickling, so each error is
turned into its one line in the worker).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import resource
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed

from launcher.errors import sigterm_as_interrupt
from launcher.plan.model import Plan


def one_line(exc: BaseException) -> str:
    """An exception as the one line a user reads: its first line, and its root cause's."""
    def line(e: BaseException) -> str:
        first = next((t.strip() for t in str(e).strip().splitlines() if t.strip()), "")
        return f"{type(e).__name__}: {first}" if first else type(e).__name__

    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    return line(exc) if root is exc else f"{line(exc)} <- {line(root)}"


def run_one(plan: Plan, rank: int, bf16: bool, counts: list[int] | None,
            variants: list[tuple[int, Plan]] | None = None, replay: list[int] | None = None) -> dict:
    """Build `rank` of the full plan (its state from local shard shapes), then trace one step per
    micro-batch count of each (layers, plan) variant (default: the plan itself), all in one fake
    world. `replay`: the pp ranks whose peaks are replayed from this trace's actions at the plan's
    micro-batch count (interleaved 1F1B: replay.replay_peak), in "derived" of each trace.
    Returns {"state", "traces": [{"layers", "steps"}]} when traced; {"state", "error"} when it
    builds but a step cannot be traced; {"error"} when the plan does not build at this rank."""
    import logging

    import torch

    from launcher.trainer.config import config_from_plan
    from launcher.verify import memtrace
    from launcher.verify.fakeworld import fake_world, real_device_meshes

    logging.getLogger("launcher.trainer").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    out: dict = {}
    with fake_world(rank, plan.world_size), real_device_meshes():
        try:
            out["state"] = memtrace.build_state(config_from_plan(plan), bf16)
        except Exception as exc:  # noqa: BLE001 - the plan does not build at this rank
            out = {"error": f"rank {rank}: {one_line(exc)}"}
        if counts and "state" in out:
            try:
                traces = []
                for layers, vplan in variants or [(0, plan)]:
                    cfg = config_from_plan(vplan)
                    again = (plan.grad_accum, replay) if replay else None
                    steps = [memtrace.trace_step(cfg, bf16, m, again)[0] for m in counts]
                    traces.append({"layers": layers, "steps": [{**s.categories, "total": s.peak} for s in steps],
                                   "per_micro_batch": steps[-1].per_micro_batch,
                                   "derived": {d["pp_rank"]: d for d in steps[-1].segments}})
                out["traces"] = traces
            except Exception as exc:  # noqa: BLE001 - the step could not be traced: the state stands
                out["error"] = one_line(exc)
    out["seconds"] = time.perf_counter() - t0
    own = resource.getrusage(resource.RUSAGE_SELF)         # a forked worker's own, from its fork on
    out["cpu_seconds"] = own.ru_utime + own.ru_stime
    return out


def run_roles(plan: Plan, trace_jobs: list[tuple[int, list[int], list[tuple[int, Plan]] | None, list[int] | None]],
              build_ranks: list[int], bf16: bool, workers: int | None = None,
              progress: Callable[[str], None] | None = None) -> dict[int, dict]:
    """run_one for every (rank, micro-batch counts, layer variants, replayed pp ranks) and every rank only built, each
    in a fresh process; {rank: outcome}."""
    jobs = list(trace_jobs) + [(r, None, None, None) for r in build_ranks]
    n = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["launcher.verify.memtrace", "launcher.trainer.config"])
    out: dict[int, dict] = {}
    pool = ProcessPoolExecutor(max_workers=n, mp_context=ctx, max_tasks_per_child=1)
    try:
        with sigterm_as_interrupt():
            _collect(pool, plan, jobs, bf16, out, progress)
    except BaseException:            # Ctrl-C or SIGTERM of `launch verify`: no tracing process left behind
        _kill_pool(pool)
        raise
    pool.shutdown()
    return out


def _kill_pool(pool: ProcessPoolExecutor) -> None:
    """SIGKILL the pool's workers and the forkserver that forks them (each would trace on at full CPU)."""
    import signal
    from multiprocessing import forkserver

    procs = list(getattr(pool, "_processes", {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        with contextlib.suppress(Exception):
            p.kill()
    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if server:
        with contextlib.suppress(OSError):
            os.kill(server, signal.SIGKILL)


def _collect(pool: ProcessPoolExecutor, plan: Plan, jobs: list, bf16: bool, out: dict[int, dict],
             progress: Callable[[str], None] | None) -> None:
    """Submit every job, then gather each outcome as it finishes (progress per rank)."""
    futures = {pool.submit(run_one, plan, r, bf16, c, v, rp): (r, c) for r, c, v, rp in jobs}
    for fut in as_completed(futures):
        rank, c = futures[fut]
        try:
            out[rank] = fut.result()
        except Exception as exc:  # noqa: BLE001 - the worker died (e.g. out of host memory)
            out[rank] = {"error": f"rank {rank}: the tracing process failed: {one_line(exc)}", "seconds": 0.0,
                         "cpu_seconds": 0.0}
        if progress:
            what = "traced" if "traces" in out[rank] else ("built" if c is None and "error" not in out[rank]
                                                        else "not traced")
            progress(f"verify: rank {rank} {what} ({out[rank]['seconds']:.1f} s)")
