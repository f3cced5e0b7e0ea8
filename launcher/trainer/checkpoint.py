"""Checkpoint and resume with torch.distributed.checkpoint (DCP), safe against crashes mid-save,
plus the preemption signal handlers (Slurm sends the checkpoint signal, SIGUSR2 by default, or
SIGTERM before it kills a job).

Why this shape:
- Model and optimizer go through DCP's `get_model_state_dict` / `get_optimizer_state_dict`, so
  FSDP2/TP DTensor shards are written by the rank that holds them, and a checkpoint can be loaded
  into another layout (DCP reshards on load). Pipeline stages work the same way: each rank offers
  only its stage's keys, which must be the full model's names (layers kept in a ModuleDict with
  their global indices, as torchtitan does); DCP merges all ranks' keys into one checkpoint. A rank
  holding several model parts (virtual stages) passes a list; they are merged under their names.
- Step, LR scheduler and data position are small plain dicts, written by rank 0 as `extra.pt`.
- A checkpoint is written into `checkpoints/step-<N>.tmp`, renamed to `step-<N>` once complete,
  and only then `checkpoints/latest` (holding the directory name) is replaced atomically. A crash
  at any moment leaves `latest` naming the previous complete checkpoint; leftover `.tmp` dirs are
  ignored and cleared by the next save.
- Preemption: the handlers only set a flag; the train loop calls `stop_requested()` (a tiny MAX
  all-reduce, so every rank agrees on the same step), saves with force=True and exits with
  PREEMPT_EXIT_CODE (75, EX_TEMPFAIL: "try again"), which the launchers map to requeue.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from launcher.errors import RunError
from launcher.formats import nofollow
from launcher.formats.exitcodes import PREEMPT_EXIT_CODE
from launcher.formats.rundir import CHECKPOINT_EXTRA as EXTRA
from launcher.formats.rundir import LATEST, RunDir, checkpoint_step, complete_checkpoints, latest_checkpoint
from launcher.formats.rundir import is_complete_checkpoint as is_complete

__all__ = ["PREEMPT_EXIT_CODE", "CheckpointError", "Checkpointer", "is_complete", "merge_parts"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _broadcast(obj: Any) -> Any:
    """Rank 0's value on every rank (one shared decision, even without a coherent shared disk)."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _as_list(x: Any) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def merge_parts(model: nn.Module | Sequence[nn.Module]) -> nn.Module:
    """One module whose parameter names are the parts' own names (a rank's pipeline chunks).

    Children with the same name (e.g. two chunks' `layers` ModuleDicts) are merged key by key;
    a key present in two parts is an error, since two chunks cannot own the same layer.
    """
    parts = _as_list(model)
    if len(parts) == 1:
        return parts[0]
    merged = nn.Module()
    for part in parts:
        for name, child in part.named_children():
            if name not in merged._modules:
                if isinstance(child, nn.ModuleDict):
                    merged.add_module(name, nn.ModuleDict(dict(child.items())))
                else:
                    merged.add_module(name, child)
                continue
            have = merged._modules[name]
            if not (isinstance(have, nn.ModuleDict) and isinstance(child, nn.ModuleDict)):
                raise ValueError(f"model parts both own {name!r}; pipeline chunks must hold disjoint modules")
            for key, sub in child.items():
                if key in have:
                    raise ValueError(f"model parts both own {name}.{key}")
                have[key] = sub
        for name, p in part.named_parameters(recurse=False):
            merged.register_parameter(name, p)
        for name, b in part.named_buffers(recurse=False):
            merged.register_buffer(name, b, persistent=name not in part._non_persistent_buffers_set)
    return merged


def _tied_aliases(model: nn.Module | Sequence[nn.Module]) -> dict[str, str]:
    """Checkpoint names for parameters saved under another name: the last pipeline stage's copy of
    a tied embedding is written and read as `tok_embeddings.weight` (the copies are identical, DCP
    writes the key once), so tied checkpoints have the same keys whatever the pp degree."""
    if any(getattr(m, "tied_head_copy", False) for m in _as_list(model)):
        return {"output.weight": "tok_embeddings.weight"}
    return {}


def _rename(state: dict, aliases: dict[str, str], reverse: bool = False) -> dict:
    """Model keys `name`, flattened optimizer keys `state.name.x` / `param_groups.name.x`, renamed."""
    if not aliases:
        return state
    pairs = [(b, a) if reverse else (a, b) for a, b in aliases.items()]
    out = {}
    for key, val in state.items():
        for src, dst in pairs:
            if key == src:
                key = dst
                break
            head, _, rest = key.partition(".")
            if head in ("state", "param_groups") and rest.startswith(src + "."):
                key = f"{head}.{dst}{rest[len(src):]}"
                break
        out[key] = val
    return out


def _optim_options():
    """Optimizer state keyed per parameter name, hyperparameters included ("param_groups.<fqn>.lr").

    Unflattened, param_groups is one list object that DCP dedups across ranks: pipeline stages
    (different parameters per rank) would all load rank 0's groups and lose their own.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _lean(optims: list):
    """The trainer's MixedPrecisionOptimizer (ZeRO 0/1: flat fp32 masters beside bf16 weights), if that is it."""
    return next((o for o in optims if hasattr(o, "checkpoint_state")), None)


def _state_dict(module: nn.Module, optims: list, aliases: dict[str, str]) -> dict:
    """What DCP saves or loads into: the model's and the optimizer's entries under torch's keys. The
    lean optimizer offers its fp32 masters as the model entries (the bf16 weights follow from them)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    lean = _lean(optims)
    if lean is not None:
        model, optim = lean.checkpoint_state(aliases)
        return {"model": model, "optim": optim}
    return {"model": _rename(get_model_state_dict(module), aliases),
            "optim": _rename(get_optimizer_state_dict(module, optims, options=_optim_options()), aliases)
            if _has_params(optims) else {}}


def _has_params(optims: list) -> bool:
    """False for a ZeRO 1 rank that owns no parameter: it has no optimizer state to save or load
    (torch's get_optimizer_state_dict refuses an empty optimizer)."""
    return _lean(optims) is not None or any(g["params"] for o in optims for g in o.param_groups)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoint_signal() -> signal.Signals:
    """The signal that asks for a checkpoint-and-exit ($LAUNCH4D_CHECKPOINT_SIGNAL, default USR2)."""
    name = os.environ.get("LAUNCH4D_CHECKPOINT_SIGNAL", "USR2").upper().removeprefix("SIG")
    try:
        return signal.Signals["SIG" + name]
    except KeyError:
        raise ValueError(f"LAUNCH4D_CHECKPOINT_SIGNAL={name!r} is not a signal name") from None


class Checkpointer:
    """Saves every `every` steps (0 = only when forced) under <run_dir>/checkpoints; resumes from latest."""

    def __init__(self, run_dir: str | Path, every: int, keep: int | None = None):
        self.root = Path(run_dir)  # every write below it goes through formats.nofollow: never through a link
        self.dir = RunDir(run_dir).checkpoints
        self.every = int(every)
        self.keep = keep
        self.preempt_requested = False
        self.preempt_signal: int | None = None
        self.last_saved: int | None = None  # the directory is created by the first save
        self.fallback = True  # load_latest may go back to an older complete checkpoint
        self.unreadable: set[str] = set()  # found corrupt by load_latest: a save replaces, never reuses

    # --- preemption ----------------------------------------------------------------------------
    def install_signal_handlers(self, signals: Sequence[int] | None = None) -> None:
        """SIGTERM and the checkpoint signal only set a flag; the loop checkpoints at the end of the
        step and exits. The checkpoint signal is $LAUNCH4D_CHECKPOINT_SIGNAL (the batch script sets
        it from backend.slurm.checkpoint_signal), default USR2: NCCL 2.12.7-2.13.4 install their own
        SIGUSR1 handler over ours."""
        if signals is None:
            signals = (signal.SIGTERM, checkpoint_signal())

        def handler(signum: int, frame: Any) -> None:
            if not self.preempt_requested:
                print(f"rank {_rank()}: got {signal.Signals(signum).name}; will checkpoint after this step "
                      f"and exit {PREEMPT_EXIT_CODE}", file=sys.stderr, flush=True)
            self.preempt_requested = True
            self.preempt_signal = signum

        for sig in signals:
            signal.signal(sig, handler)

    def stop_requested(self, device: torch.device | str | None = None) -> bool:
        """True on every rank when any rank got a preemption signal. Collective: call on all ranks."""
        if not _distributed():
            return self.preempt_requested
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) \
                else torch.device("cpu")
        flag = torch.tensor([1 if self.preempt_requested else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self.preempt_requested = True
        return self.preempt_requested

    # --- save ----------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def maybe_save(self, step: int, model: nn.Module | Sequence[nn.Module], optimizer: Any, scheduler: Any,
                   data_state: dict | None, force: bool = False) -> bool:
        """Save when `step` is a multiple of `every` (or forced). Collective: call on all ranks."""
        if not (force or self.due(step)):
            return False
        if self.last_saved == step:
            return True
        self.save(step, model, optimizer, scheduler, data_state)
        return True

    def save(self, step: int, model: nn.Module | Sequence[nn.Module], optimizer: Any, scheduler: Any,
             data_state: dict | None) -> Path:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        final = self.dir / f"step-{step}"
        tmp = self.dir / f"step-{step}.tmp"
        t0 = time.time()
        if _broadcast(is_complete(final) and str(final) not in self.unreadable if _rank() == 0 else None):
            # Same step already saved (a preempted run re-saving right after resume): just point at it.
            if _rank() == 0:
                self._write_latest(final.name)
            _barrier()
            self.last_saved = step
            return final
        if _rank() == 0:
            nofollow.make_dirs(self.root, self.dir)
            with contextlib.suppress(OSError):
                nofollow.remove_tree(self.root, tmp)  # a leftover, or a link planted at its name
            nofollow.make_dirs(self.root, tmp)
        _barrier()
        module = merge_parts(model)
        aliases = _tied_aliases(model)
        state = _state_dict(module, _as_list(optimizer), aliases)
        failed: BaseException | None = None
        try:
            dcp.save(state, checkpoint_id=str(tmp))
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP gathers every rank's error
            failed = exc
        if _rank() == 0 and failed is None:
            try:
                self._finish(step, tmp, final, scheduler, data_state, t0)
            except Exception as exc:  # noqa: BLE001 - torch.save reports a full disk as RuntimeError
                failed = exc
        # one decision for all ranks: a rank-0-only failure must not leave the others in a barrier
        why = _broadcast(_why(failed, self.dir) if _rank() == 0 and failed is not None else None)
        if why is None and failed is not None:
            why = _why(failed, self.dir)
        if why is not None:
            if _rank() == 0:
                with contextlib.suppress(OSError):
                    nofollow.remove_tree(self.root, tmp)  # frees the space the partial copy took
            raise CheckpointError(f"checkpoint step {step} failed: {why} (writing {tmp}; removed the partial "
                                  f"copy; {self.dir / LATEST} still names the last complete checkpoint)") from failed
        self.last_saved = step
        return final

    def _finish(self, step: int, tmp: Path, final: Path, scheduler: Any, data_state: dict | None,
                t0: float) -> None:
        """Rank 0: the small extras, then publish and prune."""
        scheds = _as_list(scheduler)
        extra = {"step": int(step), "data": data_state,
                 "scheduler": [s.state_dict() for s in scheds] if isinstance(scheduler, (list, tuple))
                 else (scheds[0].state_dict() if scheds else None),
                 "world_size": dist.get_world_size() if _distributed() else 1,
                 "saved_at": time.time()}
        with os.fdopen(nofollow.open_fd(self.root, tmp / EXTRA, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
            torch.save(extra, f)
            f.flush()
            os.fsync(f.fileno())
        self._publish(tmp, final)
        self._prune()
        print(f"checkpoint step {step} -> {final} ({time.time() - t0:.2f} s)", flush=True)

    def _publish(self, tmp: Path, final: Path) -> None:
        """Make a fully written checkpoint visible: rename the dir, then repoint `latest`."""
        _fsync_dir(tmp)
        if os.path.lexists(final):  # an incomplete leftover of that name (complete ones return earlier), or a link
            nofollow.remove_tree(self.root, final)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        self._write_latest(final.name)

    def _write_latest(self, name: str) -> None:
        nofollow.write_atomic(self.root, self.dir / LATEST, name + "\n", durable=True)

    def _prune(self) -> None:
        if not self.keep:
            return
        done = complete_checkpoints(self.dir)
        for old in done[: max(0, len(done) - self.keep)]:
            with contextlib.suppress(OSError):
                nofollow.remove_tree(self.root, old)

    # --- load ----------------------------------------------------------------------------------
    def latest_dir(self) -> Path | None:
        """The checkpoint `latest` names if complete; else the newest complete one (with a warning)."""
        return latest_checkpoint(self.dir)

    def candidates(self) -> list[Path]:
        """Checkpoints to try, in order: the one `latest` names, then (with `fallback`) the older
        complete ones, newest first."""
        first = self.latest_dir()
        if first is None:
            return []
        if not self.fallback:
            return [first]
        older = [p for p in reversed(complete_checkpoints(self.dir)) if checkpoint_step(p) < checkpoint_step(first)]
        return [first, *older]

    def load_latest(self, model: nn.Module | Sequence[nn.Module], optimizer: Any,
                    scheduler: Any) -> tuple[int, dict | None] | None:
        """Restore model/optimizer/scheduler in place; (step, data_state), or None with nothing to resume.

        A checkpoint that fails to load (a corrupt shard, metadata or extra.pt) is named and the previous
        complete one is tried; all ranks agree on each outcome. None readable: CheckpointError."""
        from torch.distributed.checkpoint.api import CheckpointException

        found = _broadcast([str(p) for p in self.candidates()] if _rank() == 0 else None)
        bad: list[str] = []
        result: tuple[int, dict | None] = (0, None)
        for path in map(Path, found):
            err = None
            try:
                with _dcp_tracebacks_as_lines():
                    result = self._load(path, model, optimizer, scheduler)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported, then the next one
                err = _why_load(exc, path)
            err = _any_error(err)
            if err is None:
                if bad and _rank() == 0:  # one line: what was unreadable, and where the run resumed instead
                    skipped = "; ".join(f"checkpoint {b}" for b in bad)
                    print(f"warning: {skipped}; resumed from the previous complete one, {path}", file=sys.stderr,
                          flush=True)
                return result
            bad.append(f"{path} is unreadable ({err})")
            self.unreadable.add(str(path))
        if bad:
            raise CheckpointError(f"no readable checkpoint in {self.dir}: {'; '.join(bad)}")
        return None

    def _load(self, path: Path, model: nn.Module | Sequence[nn.Module], optimizer: Any,
              scheduler: Any) -> tuple[int, dict | None]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        module = merge_parts(model)
        optims = _as_list(optimizer)
        opts = _optim_options()
        aliases = _tied_aliases(model)
        with_optim = _has_params(optims)
        try:  # the small file first: cheap to find corrupt
            extra = torch.load(path / EXTRA, weights_only=True)
            int(extra["step"])
        except Exception as exc:  # noqa: BLE001 - any unreadable extras: this checkpoint is bad
            raise CheckpointError(f"{path / EXTRA}: not a readable checkpoint file ({type(exc).__name__})") from exc
        try:  # DCP's own read of an unreadable .metadata logs two tracebacks before it gives up
            FileSystemReader(str(path)).read_metadata()
        except Exception as exc:  # noqa: BLE001 - truncated, overwritten, unreadable: this checkpoint is bad
            raise CheckpointError(f"{path / '.metadata'}: not readable ({type(exc).__name__}: {_last_line(exc)})") \
                from exc
        state = _state_dict(module, optims, aliases)
        dcp.load(state, checkpoint_id=str(path))
        lean = _lean(optims)
        if lean is not None:
            lean.after_load(state["optim"], aliases)
        else:
            set_model_state_dict(module, _rename(state["model"], aliases, reverse=True))
            if with_optim:
                set_optimizer_state_dict(module, optims, _rename(state["optim"], aliases, reverse=True),
                                         options=opts)
        scheds = _as_list(scheduler)
        if scheds and extra.get("scheduler") is not None:
            saved = extra["scheduler"] if isinstance(scheduler, (list, tuple)) else [extra["scheduler"]]
            for s, sd in zip(scheds, saved):
                s.load_state_dict(sd)
        self.last_saved = int(extra["step"])
        return int(extra["step"]), extra.get("data")


class _OneLine(logging.Filter):
    """torch.distributed.checkpoint logs through the root logger with exc_info (state_dict_loader's metadata
    fallback): the trainer's log gets the message and the exception's last line, not its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and "torch/distributed/checkpoint" in record.pathname.replace(os.sep, "/"):
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({type(exc).__name__}: {_last_line(exc) if exc else ''})"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


@contextlib.contextmanager
def _dcp_tracebacks_as_lines():
    root, one = logging.getLogger(), _OneLine()
    root.addFilter(one)
    try:
        yield
    finally:
        root.removeFilter(one)


def _any_error(err: str | None) -> str | None:
    """The first rank's error, on every rank (None when all loaded). Collective."""
    if not _distributed():
        return err
    errs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    return next((e for e in errs if e), None)


def _why_load(exc: BaseException, path: Path) -> str:
    """Which file of the checkpoint failed, and how, in one line."""
    if isinstance(exc, CheckpointError):
        return str(exc)
    text = str(exc)
    if filename := getattr(exc, "filename", None):
        where = str(filename)
    elif ".metadata" in text:
        where = str(path / ".metadata")
    else:
        where = _short_shard(path) or str(path)
    return f"{where}: {_last_line(exc)}"


def _short_shard(path: Path) -> str | None:
    """A shard file shorter than the metadata says it is (truncated or overwritten), named with its sizes."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data or {}
        need: dict[str, int] = {}
        for info in storage.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    except Exception:  # noqa: BLE001 - unreadable metadata is reported as such elsewhere
        return None
    for name, size in sorted(need.items()):
        try:
            have = (path / name).stat().st_size
        except OSError:
            return f"{path / name} (missing)"
        if have < size:
            return f"{path / name} ({have} bytes; the metadata needs {size})"
    return None


def _last_line(exc: BaseException) -> str:
    tail = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return (tail[-1] if tail else type(exc).__name__)[:300]


class CheckpointError(RunError):
    """A checkpoint could not be written or read; the message names the file and the reason."""


def _why(exc: BaseException, where: Path) -> str:
    """One line for a failed checkpoint write: "No space left on device" whenever that is the cause
    (DCP wraps each rank's OSError; torch.save turns it into a RuntimeError), else the first line."""
    seen: list[BaseException] = []
    todo: list[Any] = [exc]
    while todo and len(seen) < 64:
        e = todo.pop()
        if isinstance(e, tuple):
            todo.extend(x for x in e if isinstance(x, (BaseException, tuple)))
            continue
        if not isinstance(e, BaseException) or e in seen:
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return os.strerror(errno.ENOSPC)
        todo += [e.__cause__, e.__context__, *getattr(e, "failures", {}).values()]
    text = " ".join(str(e) for e in seen)
    try:
        full = os.statvfs(where).f_bavail == 0
    except OSError:
        full = False
    if os.strerror(errno.ENOSPC) in text or full:
        return os.strerror(errno.ENOSPC)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return first[:300]


