"""Starting a job on this machine, shared by `launch run` and `launch plan --benchmark`: whether this
machine has what the plan needs (its GPUs, or the memory of its CPU ranks), the run dir created and locked
for the job's processes, and the job recorded for `launch status`."""

from __future__ import annotations

from pathlib import Path

from launcher.commands import progress, warn
from launcher.errors import UserError
from launcher.formats.rundir import LATEST, RunDir


def check_devices(plan, as_json: bool, cpu: bool = False) -> str:
    """'cuda' or 'cpu'. A GPU plan needs its GPUs here: without them one line says what the plan needs,
    what this machine has and how to run it on CPU anyway (`cpu`: --cpu, gloo processes)."""
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if plan.gpu.name != "cpu" and not cpu:
        if have == 0:
            raise UserError(f"cluster.gpu: the plan needs {plan.world_size} × {plan.gpu.name} GPUs but this machine "
                            f"has no GPU; pass --cpu to run its {plan.world_size} ranks as CPU processes (gloo), "
                            "or set cluster.gpu: cpu")
        if plan.world_size > have:
            raise UserError(f"cluster.gpus_per_node: the plan needs {plan.world_size} GPUs but this machine has "
                            f"{have}; set cluster.gpus_per_node or pass --nproc {have} (or --cpu)")
        return "cuda"
    if plan.gpu.name != "cpu":
        progress(f"launch: --cpu: running {plan.world_size} CPU processes with gloo "
                 f"(MFU is reported against {plan.gpu.name}'s peak)")
    return "cpu"


#: What one CPU rank needs beyond the ledger's tensors: the Python interpreter, torch and gloo.
CPU_RANK_OVERHEAD_GB = 0.5


def host_memory_gb() -> float | None:
    """MemAvailable of this machine (GB), or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(plan, device: str, available_gb: float | None = None) -> float:
    """On CPU every rank's tensors live in this machine's memory: the plan's per-rank need (its ledger,
    less the GPU runtime allowance, plus the process itself) times the ranks must fit in what is
    available, else one line instead of ranks killed by the kernel's OOM killer. The need, GB."""
    if device != "cpu":
        return 0.0
    m = plan.memory
    per_rank = max(0.0, float(m.get("per_gpu_gb", 0.0)) - float(m.get("runtime_gb", 0.0))) + CPU_RANK_OVERHEAD_GB
    need = per_rank * plan.world_size
    have = host_memory_gb() if available_gb is None else available_gb
    if have is not None and need > have:
        raise UserError(f"host memory: {plan.world_size} CPU ranks of {plan.model.preset} need about {need:.1f} GB "
                        f"({per_rank:.1f} GB each: the plan's {m.get('per_gpu_gb', 0.0):.1f} GB per GPU less the GPU "
                        f"runtime, plus {CPU_RANK_OVERHEAD_GB} GB a process) but this machine has {have:.1f} GB "
                        "available; run it where its GPUs are (launch submit), or a smaller model here")
    return need


def start_job(backend, spec, plan, rd: Path, resume: str, text: str | None, cpu: bool = False):
    """Create and lock the run dir, then start the job. The lock is passed to the job's processes,
    so a second `launch run` on this dir is refused for as long as any of them lives; a failure
    before the job starts removes the run dir this call created."""
    import shutil

    from launcher.backends import check_run_dir
    from launcher.formats.files import make_dirs
    from launcher.formats.rundir import RunDirLock

    check_run_dir(rd, plan)
    created = make_dirs(rd, "run directory")
    lock_existed = RunDir(rd).lock.exists()
    try:
        lock = RunDirLock(rd)
        try:
            if (RunDir(rd).checkpoints / LATEST).exists() and resume == "never":
                raise UserError(f"--run-dir: {rd} already has checkpoints; pass --resume auto to continue it, "
                                "or give a new run directory")
            for w in plan.warnings:
                warn(f"launch: plan warning: {w}")
            req = backend.dryrun(spec, plan, rd, resume=resume, job_text=text, keep_fds=(lock.fd,))
            if cpu:  # --cpu: a GPU plan on CPU processes even where GPUs are
                req.env.update(LAUNCH4D_DEVICE="cpu", CUDA_VISIBLE_DEVICES="")
            handle = backend.submit(req)
        except BaseException:
            if not lock_existed:
                RunDir(rd).lock.unlink(missing_ok=True)
            raise
        finally:
            lock.release()  # the job's processes hold it from here
    except BaseException:
        if created:
            shutil.rmtree(created[0], ignore_errors=True)
        raise
    record_job(handle)
    return handle


def record_job(handle) -> None:
    from launcher.backends.jobstate import record

    try:
        record(handle)
    except UserError as exc:  # started all the same: say so, and go on following it
        warn(f"launch: warning: job {handle.id} is running but was not recorded ({exc})")
