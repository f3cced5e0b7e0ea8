"""CLI of the trainer, started by torchrun on every node (RANK/WORLD_SIZE/LOCAL_RANK from its env).

Backend: NCCL when CUDA is available, else gloo. The init timeout is passed to
init_process_group (and, after mesh creation, to every subgroup) so a missing or stalled rank
ends the job with an error on gloo as well as NCCL instead of hanging.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta

from launcher.errors import RunError, UserError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m launcher.trainer", description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="plan.json written by `launch plan`")
    ap.add_argument("--run-dir", required=True, help="metrics.jsonl, heartbeat/, checkpoints/ go here")
    ap.add_argument("--resume", default="auto", help="auto | never | PATH (run dir or checkpoints/step-N)")
    ap.add_argument("--steps", type=int, default=None, help="override plan.train.steps")
    ap.add_argument("--inject-stall", default=os.environ.get("LAUNCH4D_INJECT_STALL"), metavar="RANK:STEP",
                    help="fault injection: RANK sleeps forever before step STEP (1-based, as logged); "
                         "default $LAUNCH4D_INJECT_STALL")
    ap.add_argument("--inject-slow", default=os.environ.get("LAUNCH4D_INJECT_SLOW"), metavar="RANK:SECONDS",
                    help="fault injection: RANK sleeps SECONDS at the start of every step (a straggler); "
                         "default $LAUNCH4D_INJECT_SLOW")
    ap.add_argument("--stall-dump-s", type=float, default=None,
                    help="seconds without progress before this rank dumps its stacks (default "
                         "plan.diagnostics.stall_dump_s, else half the collective timeout; 0: never)")
    ap.add_argument("--init-timeout-s", type=float, default=None,
                    help="rendezvous/first-step timeout (default plan.diagnostics.init_timeout_s)")
    ap.add_argument("--step-timeout-s", type=float, default=None,
                    help="collective timeout after the first step (default plan.diagnostics.collective_timeout_s)")
    return ap.parse_args(argv)


def parse_stall(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        rank, step = value.split(":")
        return int(rank), int(step)
    except ValueError:
        raise UserError(f"--inject-stall {value!r}: expected RANK:STEP, e.g. 3:2") from None


def die_with_parent() -> None:
    """Under torchrun: SIGKILL this trainer when torchrun's agent dies (PR_SET_PDEATHSIG), so a killed
    agent leaves no trainer training on as an orphan; torchrun starts each trainer in its own session,
    out of reach of a process-group kill. Linux only; elsewhere a no-op."""
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the agent died before the request took effect
        os._exit(128 + int(signal.SIGKILL))


def main(argv: list[str] | None = None) -> int:
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s")
    try:
        import torch
        import torch.distributed as dist

        from launcher.plan.model import Plan
        from launcher.trainer.config import config_from_plan
        from launcher.trainer.engine import default_device, train
        from launcher.trainer.mesh import hostname
        from launcher.trainer.stalls import StallWatchdog, parse_rank_seconds, stall_after_s

        stall = parse_stall(args.inject_stall)
        slow = parse_rank_seconds("--inject-slow", args.inject_slow)
        cfg = config_from_plan(Plan.load(args.plan), steps=args.steps, init_timeout_s=args.init_timeout_s,
                               step_timeout_s=args.step_timeout_s)
        # SIGQUIT dumps stacks from here on; the watchdog dumps them itself when progress stops
        watchdog = StallWatchdog(args.run_dir, rank, hostname(),
                                 stall_after_s(cfg.plan.diagnostics.stall_dump_s, cfg.step_timeout_s, args.stall_dump_s),
                                 local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        watchdog.start()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != cfg.plan.world_size:
            raise UserError(f"{args.plan}: the plan is for {cfg.plan.world_size} ranks but WORLD_SIZE is {world}")
        if args.resume not in ("auto", "never") and not os.path.exists(args.resume):
            raise UserError(f"--resume {args.resume}: no such path (use auto, never or a checkpoint path)")
        device = default_device()
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "MASTER_ADDR" not in os.environ:       # a plain single-process run, no torchrun
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29511")
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.init_timeout_s),
                                device_id=device if device.type == "cuda" else None)
        try:
            train(cfg, args.run_dir, resume=args.resume, inject_stall=stall, device=device, inject_slow=slow,
                  watchdog=watchdog)
        finally:
            watchdog.close()
            if dist.is_initialized():
                dist.destroy_process_group()
        del torch
        return 0
    except UserError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except RunError as exc:  # a full disk, no readable checkpoint: one line says it all
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


def exit_now(code: int) -> None:
    """Exit with `code`. A failed rank leaves at once (os._exit after flushing): interpreter teardown with a
    collective library's threads still joinable (gloo's after a peer's error) can end in std::terminate, and
    the rank's exit 1 became SIGABRT's 134."""
    if code == 0:
        sys.exit(0)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
