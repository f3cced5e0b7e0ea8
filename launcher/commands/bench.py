"""`launch plan --benchmark K`: run the planner's top K plans for a few steps on the user's own
machines through the ordinary launch path, read their measured step times from metrics.jsonl and
re-rank them by measurement.

Why: the time model is calibrated on published runs of other clusters (benchmarks/calibrate_costs.py
states its error); a few steps on the real cluster settle a choice the model calls a tie. Each plan
runs in its own run directory <base>/<rank>-<layout>/ with train.steps = the benchmark's steps and
no checkpoints; the first step (start-up, allocator warm-up) is not counted.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import UserError, sigterm_as_interrupt


@dataclass
class Measured:
    """One benchmarked plan: what the model predicted and what the run measured."""

    index: int                     # its place in the planner's order (0 = the planner's choice)
    layout: str
    run_dir: str
    predicted_step_s: float
    measured_step_s: float | None
    tokens_per_s: float | None
    peak_mem_gb: float | None
    exit_code: int
    steps: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.measured_step_s is not None

    @property
    def error(self) -> float | None:
        """predicted / measured − 1, for a run that measured its steps."""
        if self.exit_code != 0 or self.measured_step_s is None:
            return None
        return self.predicted_step_s / self.measured_step_s - 1

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        err = self.error
        if err is not None:
            d["error"] = round(err, 4)
        return d


def describe(plan) -> str:
    from launcher.plan.calibrate import layout_name

    return layout_name(plan)


def bench_spec(spec, steps: int):
    """The job as benchmarked: `steps` optimizer steps, no checkpoints."""
    return dataclasses.replace(spec, train=dataclasses.replace(spec.train, steps=steps, checkpoint_every=0))


def measure(run_dir: Path) -> tuple[float | None, float | None, float | None, int]:
    """(median step time, median tokens/s, peak memory GB, steps logged) from metrics.jsonl, the
    first step left out (start-up) when there are more."""
    from launcher.formats.rundir import read_metrics

    recs = read_metrics(run_dir)
    timed = recs[1:] if len(recs) > 1 else recs
    if not timed:
        return None, None, None, 0
    return (statistics.median(r["step_time_s"] for r in timed), statistics.median(r["tokens_per_s"] for r in timed),
            max(r.get("peak_mem_gb", 0.0) for r in recs), len(recs))


def run_benchmark(spec, plans: list, base: Path, job_text: str | None, as_json: bool,
                  timeout_s: float | None = None) -> list[Measured]:
    """Run each plan in turn through the job's backend (local: torchrun here) and measure it."""
    from launcher.backends import get_backend
    from launcher.commands import progress
    from launcher.commands.local_job import check_devices, check_host_memory, start_job

    if spec.backend.kind == "slurm":
        return run_benchmark_slurm(spec, plans, base, job_text, timeout_s)
    if spec.backend.kind != "local":
        raise UserError(f"backend.kind: {spec.backend.kind!r} cannot wait for a job here; "
                        "--benchmark runs with kind local or slurm")
    backend = get_backend("local")
    out = []
    for i, plan in enumerate(plans):
        name = describe(plan)
        rd = base / f"{i}-{name}"
        if spec.backend.kind == "local":  # a GPU plan on this machine's CPUs: measured all the same
            check_host_memory(plan, check_devices(plan, as_json, cpu=True))
        progress(f"launch: benchmark {i + 1}/{len(plans)}: {name}, {spec.train.steps} steps, run dir {rd}")
        t0 = time.time()
        handle = start_job(backend, spec, plan, rd, "never", job_text)
        try:
            with sigterm_as_interrupt():
                status = backend.wait(handle, timeout=timeout_s)
        except BaseException:           # Ctrl-C or SIGTERM of `launch plan --benchmark`: nothing left running
            backend.cancel(handle, force=True)
            backend.sweep(handle)
            raise
        if not status.done:
            backend.cancel(handle, force=True)
            status = backend.wait(handle)
        backend.sweep(handle)
        step_s, tps, mem, n = measure(Path(handle.run_dir))
        code = status.exit_code if status.exit_code is not None else 1
        out.append(Measured(i, name, handle.run_dir, plan.estimate["step_time_s"], step_s, tps, mem, code, n))
        progress(f"launch: benchmark {name}: {status.state} after {time.time() - t0:.1f} s"
                 + (f", {step_s:.4f} s/step measured vs {plan.estimate['step_time_s']:.4f} s predicted"
                    if step_s is not None else ""))
    return out


def run_benchmark_slurm(spec, plans: list, base: Path, job_text: str | None,
                        timeout_s: float | None = None) -> list[Measured]:
    """All the plans as one Slurm job array (one submission; Slurm runs the tasks as nodes free up),
    task i in <base>/<i>-<layout>, then measured as above. The tasks are recorded, so
    `launch status|logs <job>_<i>` follow each one."""
    from launcher.backends import JobArray, get_backend, wait
    from launcher.backends.jobstate import record
    from launcher.commands import progress

    if spec.backend.slurm.login_host:
        raise UserError("--benchmark with backend.slurm.login_host: the runs' metrics would stay on the "
                        "cluster's filesystem; run `launch plan --benchmark` on the login node")
    backend = get_backend("slurm")
    names = [f"{i}-{describe(p)}" for i, p in enumerate(plans)]
    array = backend.submit(backend.request(JobArray(spec, plans, base, names, job_text=job_text)))
    handles = backend.tasks(array)
    for h in handles:
        record(h)
    progress(f"launch: benchmark: Slurm job array {array.id}, {len(plans)} tasks "
             f"({', '.join(h.id for h in handles)}), run dirs under {base}")
    out = []
    for i, (plan, h) in enumerate(zip(plans, handles)):
        t0 = time.time()
        try:
            with sigterm_as_interrupt():
                status = wait(backend, h, timeout_s, cap=15.0)
        except BaseException:           # interrupted: the array's remaining tasks are cancelled too
            for rest in handles[i:]:
                backend.cancel(rest)
            raise
        if not status.done:
            backend.cancel(h)
            status = wait(backend, h, cap=15.0)
        step_s, tps, mem, n = measure(Path(h.run_dir))
        code = 0 if status.state == "SUCCEEDED" else (status.exit_code or 1)
        out.append(Measured(i, names[i].split("-", 1)[1], h.run_dir, plan.estimate["step_time_s"], step_s, tps, mem,
                            code, n))
        progress(f"launch: benchmark {h.id} {names[i]}: {status.state} after {time.time() - t0:.1f} s"
                 + (f", {step_s:.4f} s/step measured vs {plan.estimate['step_time_s']:.4f} s predicted"
                    if step_s is not None else ""))
    return out


def by_measurement(results: list[Measured]) -> list[Measured]:
    """Fastest measured first; plans that failed or logged nothing last, in the planner's order."""
    return sorted(results, key=lambda m: (not m.ok, m.measured_step_s if m.ok else 0.0, m.index))


def render(results: list[Measured]) -> str:
    lines = ["benchmark (median step time after the first step; error = predicted / measured - 1):",
             f"  {'#':>2} {'layout':40} {'predicted s':>12} {'measured s':>11} {'error':>7} {'tok/s':>10} "
             f"{'peak GB':>8}  status"]
    for m in by_measurement(results):
        err = m.error
        if err is not None:
            lines.append(f"  {m.index:>2} {m.layout:40} {m.predicted_step_s:>12.4f} {m.measured_step_s:>11.4f} "
                         f"{err:>+7.0%} {m.tokens_per_s:>10,.0f} {m.peak_mem_gb:>8.2f}  ok")
        else:
            lines.append(f"  {m.index:>2} {m.layout:40} {m.predicted_step_s:>12.4f} {'-':>11} {'-':>7} {'-':>10} "
                         f"{'-':>8}  exit {m.exit_code}, {m.steps} steps logged ({m.run_dir})")
    best = by_measurement(results)[0]
    if best.ok:
        lines.append(f"measured fastest: #{best.index} {best.layout}"
                     + (" (the planner's choice)" if best.index == 0 else " (not the planner's choice)"))
        done = [m.run_dir for m in results if m.ok and m.steps > 1]
        lines.append(f"fit this cluster's efficiency to these runs: launch calibrate {' '.join(done)}")
    return "\n".join(lines)
