"""What a real gloo run allocates on this CPU, per rank, for comparison with `launch verify`.

Measured without torch's memory tracker (which verify uses), in two parts:
- at the start of the measured (second) step: every live tensor storage in the process, found
  by walking the garbage collector's objects (parameters, optimizer state, buffers, the batch,
  the pipeline's receive buffers, ...);
- during the step: what malloc hands out on top of that. The CPU has no allocator statistics like
  CUDA's max_memory_allocated, and RSS counts pages the allocator keeps after a free; glibc's
  mallinfo2() counts the bytes in use right now. A dispatch mode reads it after every op.
Python's own caches grown in the first step (DTensor's sharding cache, ...) are then not counted,
as they are not on a GPU.
"""

from __future__ import annotations

import ctypes
import gc
import json
import traceback
from pathlib import Path

from tests.trainer_helpers import job_groups


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_in_use() -> int:
    """Bytes malloc has handed out and not taken back (heap blocks in use + mmap'd blocks)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return int(m.uordblks + m.hblkhd)


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the process holds (DTensors: their shards)."""
    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not hasattr(obj, "_local_tensor") and obj.device.type == "cpu":
            st = obj.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def measure_rank(rank: int, nprocs: int, jobs: list[dict], workdir: str, port: int) -> None:
    """torch.multiprocessing.spawn target: for each job {name, plan}, build the trainer's Engine for
    this rank (gloo, CPU), run one step (optimizer state, pipeline buffers), then a second step with
    malloc read after every op. Writes <workdir>/<name>.rank<R>.json: {"peak": live tensor bytes at
    the step's start + the most malloc held above its level then} or {"error"}."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from launcher.trainer.config import config_from_plan
    from launcher.trainer.engine import Engine
    from launcher.trainer.mesh import build_mesh

    class PeakMalloc(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, malloc_in_use())
            return out

    eng: Engine | None = None
    for job, plan in job_groups(rank, nprocs, jobs, port):
        try:
            cfg = config_from_plan(plan)
            mesh = build_mesh(cfg, torch.device("cpu"))
            p = cfg.plan
            g = torch.Generator().manual_seed(1)
            batch = torch.randint(0, cfg.model.vocab, (p.micro_batch * p.grad_accum, cfg.train.seq_len + 1),
                                  generator=g)
            eng = Engine(cfg, mesh)
            eng.step(batch, lambda *a, **k: None)
            gc.collect()
            live = live_tensor_bytes()
            start = malloc_in_use()
            with PeakMalloc() as pk:
                eng.step(batch, lambda *a, **k: None)
            out = {"peak": live + max(0, pk.peak - start), "live": live}
        except Exception as exc:  # noqa: BLE001 - reported to the test through the file
            out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        dist.barrier()
        Path(workdir, f"{job['name']}.rank{rank}.json").write_text(json.dumps(out))
        eng = None
        gc.collect()
