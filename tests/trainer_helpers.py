"""Helpers for the trainer's real-process tests: hand-built Plans and a spawn worker that runs
several layouts in one set of processes (each layout gets its own gloo group of its own size).

Why: spawning 8 Python processes that import torch costs more than the tiny model's training,
so one group of workers runs every layout in sequence and writes the losses to a JSON file, and the
group is kept between calls (WorkerPool); its workers are forked from a server that imported torch
and the trainer once (an import in each worker cost ~3.5 s of CPU, 28 s at each start of 8).
"""

from __future__ import annotations

import json
import math
import os
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

from launcher.plan import layout, presets
from launcher.plan.model import Layout, Plan
from launcher.plan.schema import load_dataclass
from launcher.plan.spec import TrainSpec, resolve_gpu, resolve_model
from launcher.plan.spec_backend import DiagnosticsSpec
from tests.job_helpers import free_port


def make_plan(tp: int = 1, cp: int = 1, pp: int = 1, dp: int = 1, *, ep: int = 1, zero: int = 3, recompute: str = "none",
              micro_batch: int = 1, grad_accum: int | None = None, global_batch: int = 8,
              schedule: str | None = None, virtual_stages: int = 1, stage_layers: list[int] | None = None,
              seq_len: int = 32, steps: int = 5, mesh_order=("pp", "dp", "cp", "tp"), gpus_per_node: int = 8,
              model: str = "tiny", model_over: dict | None = None, forced: bool = False,
              cp_attention: str = "all-gather", dp_shard: int | None = None, **train_over) -> Plan:
    """A Plan for the given layout (what the planner would emit for a fully fixed `parallel`)."""
    degrees = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep}
    world = tp * cp * pp * dp
    if grad_accum is None:
        grad_accum = global_batch // (micro_batch * dp)
    n_stages = pp * virtual_stages
    m = dict(presets.MODELS[model], preset=model, **(model_over or {}))
    if stage_layers is None:
        base, extra = divmod(m["layers"], n_stages)
        stage_layers = [base + (1 if i < extra else 0) for i in range(n_stages)]
    train = dict(seq_len=seq_len, global_batch=global_batch, steps=steps, optimizer="adam", precision="fp32",
                 lr=3e-3, warmup_steps=2, weight_decay=0.01, grad_clip=1.0, seed=1234,
                 data="synthetic", loss_chunk=16, checkpoint_every=0)
    train.update(train_over)
    gpn = min(gpus_per_node, world)
    lay = Layout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, zero=zero, recompute=recompute, micro_batch=micro_batch,
                 grad_accum=grad_accum, schedule=schedule or ("none" if pp == 1 else "1f1b"),
                 virtual_stages=virtual_stages, cp_attention=cp_attention, dp_shard=dp_shard)
    return Plan(name="t", world_size=world, nodes=max(1, world // gpn), gpus_per_node=gpn, layout=lay,
                mesh_order=list(mesh_order), ranks=layout.placements(degrees, mesh_order, gpn),
                stage_layers=stage_layers, fits=True, memory={}, estimate={}, bandwidth={}, warnings=[],
                model=resolve_model(m), train=load_dataclass(TrainSpec, train, "train"),
                gpu=resolve_gpu("cpu"),
                diagnostics=DiagnosticsSpec(init_timeout_s=120, collective_timeout_s=120), forced=forced)


def job_losses(results: dict[str, dict], name: str, steps: int) -> list[float]:
    """Job `name`'s losses in spawn_layouts' results, checked first: the job ran (else its error and
    traceback are the message), and it logged `steps` losses, every one finite."""
    r = results[name]
    assert "losses" in r, f"{name} failed: {r.get('error')}\n{r.get('trace', '')}"
    assert len(r["losses"]) == steps and all(math.isfinite(x) for x in r["losses"])
    return r["losses"]


def job_groups(rank: int, nprocs: int, jobs: list[dict], port: int) -> Iterator[tuple[dict, Plan]]:
    """The spawned worker's prologue, one place for every real-process test: one CPU thread, one TCP
    store for the whole run (FileStore is slow with the many keys mesh creation writes), and for each
    job {name, plan} this rank takes part in (rank < its world size) a gloo group of the job's own size
    under the job's own key prefix; yields (job, plan) inside the group and destroys it after."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    base = dist.TCPStore("127.0.0.1", port, nprocs, is_master=rank == 0, timeout=timedelta(seconds=300))
    for job in jobs:
        plan = Plan.from_dict(job["plan"])
        if rank >= plan.world_size:
            continue
        dist.init_process_group("gloo", store=dist.PrefixStore(job["name"], base), rank=rank,
                                world_size=plan.world_size, timeout=timedelta(seconds=300))
        try:
            yield job, plan
        finally:
            dist.destroy_process_group()


def run_layouts(rank: int, nprocs: int, jobs: list[dict], workdir: str, port: int) -> None:
    """torch.multiprocessing.spawn target: run each job {name, plan(dict), env?, resume?, tied_check?,
    optim_bytes?, memory?} on ranks < its world size. `resume` is a checkpoint path relative to workdir
    (resume from it); `tied_check` compares the two copies of a tied embedding split over pipeline
    stages at the end; `optim_bytes` records every rank's optimizer-state bytes after the last step;
    `memory` records every rank's peak of allocated tensor bytes (out["peak_bytes"], by rank).

    Writes <workdir>/<name>.json (rank 0: {"losses": [...], "grad_norms": [...]} or {"error": "..."}).
    """
    import logging

    import torch
    import torch.distributed as dist

    from launcher.trainer.config import config_from_plan
    from launcher.trainer.engine import train

    logging.basicConfig(level=logging.WARNING)
    for job, plan in job_groups(rank, nprocs, jobs, port):
        name = job["name"]
        os.environ["RANK"] = str(rank)
        for k, v in job.get("env", {}).items():
            os.environ[k] = v
        out: dict
        try:
            cfg = config_from_plan(plan)
            engines = _capture_engines() if job.get("tied_check") or job.get("optim_bytes") else []
            resume = str(Path(workdir) / job["resume"]) if job.get("resume") else "never"
            with allocation_peak(job.get("memory", False)) as peak:
                losses = train(cfg, Path(workdir) / name, resume=resume, device=torch.device("cpu"),
                               handle_signals=False)
            out = {"losses": losses}
            if job.get("memory"):
                peaks: list = [None] * dist.get_world_size()
                dist.all_gather_object(peaks, peak[0])
                out["peak_bytes"] = peaks
            if job.get("tied_check"):
                out["tied_max_diff"] = tied_copies_max_diff(engines[-1])
            if job.get("optim_bytes"):
                out["optim_bytes"] = optimizer_bytes_per_rank(engines[-1])
            if rank == 0:
                from launcher.formats.rundir import read_metrics

                out["grad_norms"] = [m["grad_norm"] for m in read_metrics(Path(workdir) / name)]
        except Exception as exc:  # noqa: BLE001 - reported to the test through the file
            out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        finally:
            for k in job.get("env", {}):
                os.environ.pop(k, None)
        clear_dtensor_caches()
        if rank == 0:
            (Path(workdir) / f"{name}.json").write_text(json.dumps(out))


class allocation_peak:
    """Peak of the bytes torch's CPU allocator holds while the block runs, from the profiler's memory
    events (allocations and frees, in order, with their addresses). `with allocation_peak(True) as p:` -> p[0].

    Why by address: the profiler records only the threads it runs on, so a tensor freed on one of
    gloo's threads (an async collective's buffer released there) has no free event; summing the
    events counted it live for the rest of the run, and the peak varied ~15% between runs of the same
    file with thread timing. Each free is matched to its allocation, and an allocation at an address
    still held proves the block there was freed unseen (the allocator reused it)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.result = [0]

    def __enter__(self) -> list:
        if self.enabled:
            import torch

            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        return self.result

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        self.prof.__exit__(*exc)
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            self.prof.export_chrome_trace(f.name)
            trace = json.loads(Path(f.name).read_text())
        events = sorted((e["ts"], e["args"]["Bytes"], e["args"]["Addr"]) for e in trace["traceEvents"]
                        if e.get("name") == "[memory]")
        live: dict[int, int] = {}       # address -> bytes of the block allocated there
        cur = peak = 0
        for _, nbytes, addr in events:
            if nbytes > 0:
                cur += nbytes - live.pop(addr, 0)
                live[addr] = nbytes
            elif addr in live:
                cur -= live.pop(addr)
            peak = max(peak, cur)
        self.result[0] = peak


def _capture_engines() -> list:
    """Record the Engine that train() builds (so a test can inspect its parameters afterwards)."""
    from launcher.trainer import engine as eng_mod

    seen: list = []
    orig = eng_mod.Engine.__post_init__

    def post_init(self) -> None:
        eng_mod.Engine.__post_init__ = orig  # type: ignore[method-assign]  # the patch undone
        orig(self)
        seen.append(self)

    eng_mod.Engine.__post_init__ = post_init  # type: ignore[method-assign]  # undone by its first call
    return seen


def optimizer_bytes_per_rank(eng) -> list[int]:
    """Every rank's optimizer-state bytes (local shards), by global rank. Collective over the world."""
    import torch
    import torch.distributed as dist

    def local(v):
        return v._local_tensor if hasattr(v, "_local_tensor") else v

    mine = sum(local(v).numel() * local(v).element_size() for st in eng.optimizer.state.values()
               for v in st.values() if torch.is_tensor(v))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def tied_copies_max_diff(eng) -> float | None:
    """Largest |embedding - head copy| over every embedding group's local shards (same on all ranks;
    None when no rank holds a copy). Collective over the whole world."""
    import torch.distributed as dist

    mine = None
    if eng.tied:
        w = eng.tied[0]
        local = w._local_tensor if hasattr(w, "_local_tensor") else w
        c = eng.mesh.coords
        mine = ((c["dp"], c["cp"], c["tp"]), "head" if eng.parts[-1].tied_head_copy else "emb",
                local.detach().cpu().clone())
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    pairs: dict = {}
    for x in every:
        if x is not None:
            pairs.setdefault(x[0], {})[x[1]] = x[2]
    if not pairs:
        return None
    worst = 0.0
    for k, d in pairs.items():
        assert set(d) == {"emb", "head"}, f"embedding group {k} lacks a copy: {sorted(d)}"
        worst = max(worst, float((d["emb"] - d["head"]).abs().max()))
    return worst


def clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions keyed by meshes that compare equal across process groups;
    a second layout in the same process would reuse the destroyed groups' names without this."""
    import torch
    from torch.distributed.tensor import DTensor, _redistribute

    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    prop._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:     # the C++ dispatch fast path keeps its own cache
        clear_native()


def spawn_layouts(jobs: list[dict], workdir: str | Path, nprocs: int | None = None) -> dict[str, dict]:
    """Run the jobs on ranks 0..nprocs-1 of the session's worker pool (see spawn); {name: result}."""
    nprocs = nprocs or max(Plan.from_dict(j["plan"]).world_size for j in jobs)
    spawn(run_layouts, (nprocs, jobs, str(workdir), free_port()), nprocs)
    out = {}
    for j in jobs:
        f = Path(workdir) / f"{j['name']}.json"
        out[j["name"]] = json.loads(f.read_text()) if f.exists() else {"error": "no result written"}
    return out


def spawn(fn, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs) on the session's worker pool: fn(rank, *args) on
    ranks 0..nprocs-1, a module-level function; raises if any rank raised (its traceback) or died."""
    global _POOL
    if _POOL is None:
        _POOL = WorkerPool()
    _POOL.run(fn, args, nprocs)


class WorkerPool:
    """Spawned processes kept between calls fn(rank, *args): worker r is rank r of every call on more
    than r ranks. What a call sets up it tears down (run_layouts: each batch its own TCP store, each job
    its own gloo group, env and DTensor caches restored), so a call sees what a fresh spawn would, less
    the start-up. A worker that raises or dies ends the pool (the call's test fails with its traceback).

    Not free to keep: gloo's event-loop threads outlive their destroyed groups (a few per job), and each
    wakes now and then, so a worker is retired once it holds MAX_THREADS threads, and the whole pool
    IDLE_S seconds after its last call (the next call starts what it needs)."""

    IDLE_S = 45.0
    MAX_THREADS = 80

    def __init__(self) -> None:
        import atexit
        import multiprocessing as mp
        import threading

        # forked from a server that imported torch and the trainer once (launcher.verify.worker does the
        # same): a worker starts in milliseconds, not the ~3.5 s of CPU a fresh import of them costs, 8 times
        # at each pool start on 2 cores. The server is the process's one forkserver (verify's too): whichever
        # starts it first sets its preload, and either imports torch and the trainer.
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(list(PRELOAD))
        self.results = self.ctx.Queue()
        self.workers: list = []          # (process, inbox) by rank; None: retired, restarted when needed
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None
        atexit.register(self.close)

    def run(self, fn, args: tuple, nprocs: int) -> None:
        import threading

        with self.lock:
            if self.timer:
                self.timer.cancel()
            try:
                self._run(fn, args, nprocs)
            except BaseException:
                self._close()
                raise
            for r, w in enumerate(self.workers):
                if w and _threads(w[0].pid) > self.MAX_THREADS:
                    self._retire(r)
            self.timer = threading.Timer(self.IDLE_S, self.close)
            self.timer.daemon = True
            self.timer.start()

    def _run(self, fn, args: tuple, nprocs: int) -> None:
        import queue

        self.workers += [None] * (nprocs - len(self.workers))
        for r in range(nprocs):
            if self.workers[r] is None or not self.workers[r][0].is_alive():
                inbox = self.ctx.Queue()
                proc = self.ctx.Process(target=_serve, args=(r, inbox, self.results), daemon=True)
                proc.start()
                self.workers[r] = (proc, inbox)
        for _, inbox in self.workers[:nprocs]:
            inbox.put((fn, args))
        pending, errors = set(range(nprocs)), {}
        while pending:
            try:
                rank, err = self.results.get(timeout=5)
            except queue.Empty:
                dead = sorted(r for r in pending if not self.workers[r][0].is_alive())
                if dead:
                    codes = [self.workers[r][0].exitcode for r in dead]
                    raise RuntimeError(f"trainer worker rank(s) {dead} died (exit codes {codes})") from None
                continue
            pending.discard(rank)
            if err:
                errors[rank] = err
        if errors:
            rank = min(errors)
            raise RuntimeError(f"trainer worker rank {rank} failed:\n{errors[rank]}")

    def _retire(self, rank: int) -> None:
        proc, inbox = self.workers[rank]
        if proc.is_alive():
            inbox.put(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        self.workers[rank] = None

    def _close(self) -> None:
        for w in self.workers:
            if w and w[0].is_alive():
                w[1].put(None)
        for r, w in enumerate(self.workers):
            if w:
                self._retire(r)
        self.workers = []
        self.results = self.ctx.Queue()      # nothing a stopped call still sent reaches the next one

    def close(self) -> None:
        with self.lock:
            self._close()


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


_POOL: WorkerPool | None = None
#: what the fork server imports once for every worker (run_layouts' imports)
PRELOAD = ("launcher.trainer.engine", "launcher.trainer.config", "tests.trainer_helpers")


def _serve(rank: int, inbox, results) -> None:
    """A pool worker: run each call (fn, args) as fn(rank, *args), report, wait for the next; ends on
    None, or when the test process is gone (killed: nothing else would end it)."""
    import multiprocessing as mp
    import queue

    parent = mp.parent_process()
    while True:
        try:
            call = inbox.get(timeout=5)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if call is None:
            return
        fn, args = call
        try:
            fn(rank, *args)
            results.put((rank, None))
        except BaseException:  # noqa: BLE001 - the test process raises it
            results.put((rank, traceback.format_exc()))
            return
