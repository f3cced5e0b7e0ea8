"""What a real gloo run allocates on this CPU, per rank, for comparison with `launch verify`.

Why malloc: the CPU has no allocator statistics like CUDA's max_memory_allocated, and RSS counts
pages the allocator keeps after a free. glibc's mallinfo2() counts the bytes in use right now
(small blocks and mmap'd large ones), which on this machine is every tensor storage torch holds
plus the interpreter's small objects. A dispatch mode reads it after every op of the measured
step, so the peak is what the real run held between two ops — independent of torch's memory
tracker, which verify uses.
"""

from __future__ import annotations

import ctypes
import gc
import json
import traceback
from datetime import timedelta
from pathlib import Path

from launcher.plan import Plan


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_in_use() -> int:
    """Bytes malloc has handed out and not taken back (heap blocks in use + mmap'd blocks)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return int(m.uordblks + m.hblkhd)


def measure_rank(rank: int, nprocs: int, jobs: list[dict], workdir: str, port: int) -> None:
    """torch.multiprocessing.spawn target: for each job {name, plan}, build the trainer's Engine for
    this rank (gloo, CPU), run one step (optimizer state, pipeline buffers), then a second step with
    malloc read after every op. Writes <workdir>/<name>.rank<R>.json: {"peak": bytes in use at the
    step's peak minus before the model was built} or {"error"}."""
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

    torch.set_num_threads(1)
    base = dist.TCPStore("127.0.0.1", port, nprocs, is_master=rank == 0, timeout=timedelta(seconds=300))
    for job in jobs:
        plan = Plan.from_dict(job["plan"])
        if rank >= plan.world_size:
            continue
        dist.init_process_group("gloo", store=dist.PrefixStore(job["name"], base), rank=rank,
                                world_size=plan.world_size, timeout=timedelta(seconds=300))
        try:
            cfg = config_from_plan(plan)
            mesh = build_mesh(cfg, torch.device("cpu"))
            p = cfg.parallel
            g = torch.Generator().manual_seed(1)
            batch = torch.randint(0, cfg.model.vocab, (p.micro_batch * p.grad_accum, cfg.train.seq_len + 1),
                                  generator=g)
            dist.barrier()
            gc.collect()
            before = malloc_in_use()
            eng = Engine(cfg, mesh)
            eng.step(batch, lambda *a, **k: None)
            gc.collect()
            with PeakMalloc() as pk:
                eng.step(batch, lambda *a, **k: None)
            out = {"peak": pk.peak - before}
        except Exception as exc:  # noqa: BLE001 - reported to the test through the file
            out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        dist.barrier()
        dist.destroy_process_group()
        Path(workdir, f"{job['name']}.rank{rank}.json").write_text(json.dumps(out))
        eng = None
        gc.collect()
