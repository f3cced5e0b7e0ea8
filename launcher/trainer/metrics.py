"""Per-step metrics (metrics.jsonl + one readable line on rank 0) and per-rank heartbeat files.

Why both: metrics say how fast and how well a run trains; heartbeats say where each rank is, so
when a job hangs `launch diagnose` can name the rank that stopped and the collective it was in.
A heartbeat is one tiny JSON file per rank, replaced atomically (write a temp file, rename), so a
reader never sees half of one. Format (COMMON.md):
{"rank", "host", "pid", "step", "phase", "last_collective", "collectives", "updated"}, plus, once
a step has finished, "step_time_s", "busy_s" (medians over recent steps) and "timed_steps".

FLOPs per token come from the planner's time model (launcher.plan.costs.model_flops_per_token: 6·N
plus 12·L·h·s attention, logits included), so the trainer's MFU and the plan's estimate use one
formula. MFU is reported in percent of the plan's GPU peak (torchtitan's convention).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from launcher.formats import nofollow
from launcher.formats.rundir import RunDir
from launcher.plan.model import Plan
from launcher.plan.spec import ModelSpec

PHASES = ("init", "forward", "backward", "optimizer", "checkpoint", "done", "error")


def _sig(x: float, digits: int = 6) -> float:
    return float(f"{x:.{digits}g}")


def flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of the plan's model at this sequence length."""
    from launcher.plan.costs import model_flops_per_token

    return float(model_flops_per_token(model, seq_len))


def peak_memory_gb() -> tuple[float, str]:
    """Peak device memory (CUDA allocator) or, on CPU, this process's peak resident set."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 1e9, "cuda"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, "rss"


class MetricsLogger:
    """Rank 0 appends one JSON line per optimizer step to <run_dir>/metrics.jsonl; others do nothing."""

    def __init__(self, run_dir: str | Path, rank: int, plan: Plan, stream=None):
        self.rank = rank
        self.root = Path(run_dir)  # writes go through formats.nofollow: never through a link in the run dir
        self.path = RunDir(run_dir).metrics
        self.steps = plan.train.steps
        self.world = plan.world_size
        self.peak_tflops = plan.gpu.peak_tflops
        self.flops_per_token = flops_per_token(plan.model, plan.train.seq_len)
        self.stream = stream or sys.stdout
        self._trimmed = False
        if rank == 0:
            nofollow.make_dirs(self.root, self.path.parent)

    def _trim_from(self, step: int) -> None:
        """On the first step after a resume, drop lines of steps the restarted run will redo."""
        self._trimmed = True
        if not os.path.lexists(self.path):
            return
        kept = []
        for line in nofollow.read_text(self.root, self.path).splitlines():
            try:
                if json.loads(line)["step"] < step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by a crash
        nofollow.write_atomic(self.root, self.path, "".join(x + "\n" for x in kept))

    def record(self, step: int, loss: float, grad_norm: float, step_time_s: float, tokens: int,
               lr: float | None = None) -> dict:
        """The metrics of one step as a dict (what log_step writes)."""
        dt = max(step_time_s, 1e-9)
        tps = tokens / dt
        tflops = self.flops_per_token * tps / self.world / 1e12
        mem, mem_kind = peak_memory_gb()
        rec = {"step": int(step), "loss": float(loss), "grad_norm": float(grad_norm),
               "step_time_s": round(float(step_time_s), 6), "tokens": int(tokens),
               "tokens_per_s": round(tps, 3), "tokens_per_s_per_gpu": round(tps / self.world, 3),
               "tflops_per_gpu": _sig(tflops),
               "mfu": _sig(100 * tflops / self.peak_tflops) if self.peak_tflops else None,
               "peak_mem_gb": round(mem, 4), "mem_kind": mem_kind, "time": round(time.time(), 3)}
        if lr is not None:
            rec["lr"] = float(lr)
        return rec

    def log_step(self, step: int, loss: float, grad_norm: float, step_time_s: float, tokens: int,
                 lr: float | None = None) -> dict | None:
        if self.rank != 0:
            return None
        if not self._trimmed:
            self._trim_from(step)
        rec = self.record(step, loss, grad_norm, step_time_s, tokens, lr)
        with nofollow.open_append(self.root, self.path) as f:
            f.write(json.dumps(rec) + "\n")
        print(self.format(rec), file=self.stream, flush=True)
        return rec

    def format(self, rec: dict) -> str:
        total = f"/{self.steps}" if self.steps else ""
        mfu = f" | MFU {rec['mfu']:.2f}%" if rec.get("mfu") is not None else ""
        lr = f" | lr {rec['lr']:.3g}" if "lr" in rec else ""
        return (f"step {rec['step']}{total} | loss {rec['loss']:.4f} | grad {rec['grad_norm']:.3f}{lr} | "
                f"{rec['step_time_s']:.3f} s | {rec['tokens_per_s']:,.0f} tok/s | "
                f"{rec['tflops_per_gpu']:.3g} TFLOP/s/gpu{mfu} | mem {rec['peak_mem_gb']:.2f} GB")


class Heartbeat:
    """<run_dir>/heartbeat/rank<R>.json, rewritten atomically on every phase change."""

    def __init__(self, run_dir: str | Path, rank: int, host: str | None = None):
        import socket

        self.rank = rank
        self.host = host or socket.gethostname()
        self.pid = os.getpid()
        self.root = Path(run_dir)
        self.path = RunDir(run_dir).heartbeat_file(rank)
        nofollow.make_dirs(self.root, self.path.parent)
        self.collectives = 0
        self.last_collective: str | None = None
        self.step = 0
        self.times: list[tuple[float, float]] = []  # (step wall time, time waiting for peers), recent steps

    def beat(self, step: int, phase: str, last_collective: str | None = None,
             collectives: int | None = None) -> dict:
        """Record where this rank is. Each call naming a collective counts one more collective."""
        if phase not in PHASES:
            raise ValueError(f"heartbeat phase {phase!r} is not one of {', '.join(PHASES)}")
        if last_collective is not None:
            self.last_collective = last_collective
            self.collectives += 1
        if collectives is not None:
            self.collectives = int(collectives)
        self.step = int(step)
        rec = {"rank": self.rank, "host": self.host, "pid": self.pid, "step": self.step, "phase": phase,
               "last_collective": self.last_collective, "collectives": self.collectives,
               "updated": time.time()}
        if self.times:
            walls = sorted(t for t, _ in self.times)
            busy = sorted(t - w for t, w in self.times)
            rec.update(step_time_s=round(walls[len(walls) // 2], 6), busy_s=round(busy[len(busy) // 2], 6),
                       timed_steps=len(self.times))
        try:
            nofollow.write_atomic(self.root, self.path, json.dumps(rec) + "\n")
        except OSError:
            # A heartbeat is a diagnostic: on a full or failing disk the last one written stays, and
            # the error the trainer is reporting (e.g. a checkpoint's ENOSPC) is not masked by this one.
            pass
        return rec

    def timing(self, step_time_s: float, wait_s: float, window: int = 8) -> None:
        """One finished step: its wall time and the part spent waiting for peers. The heartbeat then
        carries the medians over the last `window` steps: step_time_s, and busy_s (wall minus waiting,
        this rank's own work), which is what names a straggler against the other ranks."""
        self.times = [*self.times[-(window - 1):], (float(step_time_s), min(float(wait_s), float(step_time_s)))]
