"""Tokens/s of the bundled trainer, through `launch run` exactly as a user runs it.

CPU (always): the tiny model on every layout issue 3's parity tests cover (gloo, one thread per
process; on a small box the processes share the cores, so the figures compare layouts' overheads,
not hardware). GPU (when CUDA is present, or --gpu): a ~1B Llama (preset llama3-1b, bf16) on one
GPU, its tokens/s and MFU beside torchtitan's published 1-D figures.

    python benchmarks/trainer_throughput.py [--steps 6] [--only NAME ...] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from launcher.formats.rundir import RunDir, read_metrics

REPO = Path(__file__).resolve().parent.parent
LAUNCH = str(Path(sys.executable).with_name("launch"))

# name, processes, parallel section (train.global_batch 8 sequences of 64 tokens throughout)
CPU_LAYOUTS = [
    ("dp8 zero3", 8, dict(tp=1, cp=1, pp=1, dp=8, zero=3, micro_batch=1)),
    ("tp2 x dp4", 8, dict(tp=2, cp=1, pp=1, dp=4, zero=3, micro_batch=1)),
    ("pp2(1f1b) x tp2 x dp2", 8, dict(tp=2, cp=1, pp=2, dp=2, zero=1, micro_batch=1, schedule="1f1b")),
    ("cp2 x tp2 x dp2", 8, dict(tp=2, cp=2, pp=1, dp=2, zero=3, micro_batch=1)),
    ("pp2(interleaved v2) x cp2 x tp2", 8, dict(tp=2, cp=2, pp=2, dp=1, zero=1, micro_batch=1,
                                                schedule="interleaved-1f1b", virtual_stages=2)),
    ("dp2 grad_accum2", 2, dict(tp=1, cp=1, pp=1, dp=2, zero=3, micro_batch=2)),
    ("dp4 grad_accum1", 4, dict(tp=1, cp=1, pp=1, dp=4, zero=3, micro_batch=2)),
    ("dp2 recompute none", 2, dict(tp=1, cp=1, pp=1, dp=2, zero=3, micro_batch=4, recompute="none")),
    ("dp2 recompute selective", 2, dict(tp=1, cp=1, pp=1, dp=2, zero=3, micro_batch=4, recompute="selective")),
    ("dp2 recompute full", 2, dict(tp=1, cp=1, pp=1, dp=2, zero=3, micro_batch=4, recompute="full")),
]

# torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (../shared/notes/trainers.md §1.13): Llama 3 8B,
# 1-D FSDP on 8 H100, no Float8: 33-39% MFU; 5,762 tokens/s per GPU.
TORCHTITAN_MFU = "33-39% (Llama 3 8B, FSDP, 8xH100, bf16)"


def job(name: str, procs: int, parallel: dict, steps: int, model="tiny", gpu="cpu", seq_len=64,
        global_batch=8, precision="fp32") -> dict:
    return {
        "name": name.replace(" ", "-").replace("(", "").replace(")", ""),
        "model": model,
        "train": {"seq_len": seq_len, "global_batch": global_batch, "steps": steps, "lr": 1e-3,
                  "precision": precision,
                  "seed": 1234, "data": "synthetic", "checkpoint_every": 0},
        "cluster": {"nodes": 1, "gpus_per_node": procs, "gpu": gpu},
        "parallel": {"recompute": "none", **parallel},
        "diagnostics": {"nccl_debug": "off", "init_timeout_s": 300, "collective_timeout_s": 300},
    }


def run(spec: dict, workdir: Path) -> dict:
    """`launch run` the job; tokens/s as the median over steps after the first (warm-up)."""
    path = workdir / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    run_dir = workdir / spec["name"]
    env = {**os.environ, "LAUNCH4D_STATE": str(workdir / "state"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([LAUNCH, "run", str(path), "--run-dir", str(run_dir), "--json"],
                       capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        tail = "\n".join(r.stderr.splitlines()[-8:])
        return {"error": f"exit {r.returncode}: {tail}"}
    recs = read_metrics(run_dir)
    later = recs[1:] or recs
    plan = json.loads(RunDir(run_dir).plan.read_text())
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
            "step_time_s": statistics.median(r["step_time_s"] for r in later),
            "mfu": statistics.median(r["mfu"] for r in later if r.get("mfu") is not None),
            "tflops_per_gpu": statistics.median(r["tflops_per_gpu"] for r in later),
            "peak_mem_gb": max(r["peak_mem_gb"] for r in recs),
            "final_loss": recs[-1]["loss"], "grad_accum": plan["layout"]["grad_accum"], "steps": len(recs)}


def cpu_bench(steps: int, only: list[str] | None, workdir: Path) -> None:
    print(f"tiny model ({os.cpu_count()} CPU cores, gloo, fp32), global batch 8 × 64 tokens, "
          f"{steps} steps, median after step 1")
    print(f"{'layout':34} {'procs':>5} {'ga':>3} {'tokens/s':>10} {'step s':>8} {'final loss':>10}")
    for name, procs, parallel in CPU_LAYOUTS:
        if only and not any(o in name for o in only):
            continue
        res = run(job(name, procs, parallel, steps), workdir)
        if "error" in res:
            print(f"{name:34} {procs:>5}   FAILED {res['error']}")
            continue
        print(f"{name:34} {procs:>5} {res['grad_accum']:>3} {res['tokens_per_s']:>10,.0f} "
              f"{res['step_time_s']:>8.3f} {res['final_loss']:>10.4f}", flush=True)


def gpu_bench(steps: int, workdir: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        print("\nGPU: no CUDA device here; the ~1B single-GPU figure needs a GPU machine (--gpu there)")
        return
    name = torch.cuda.get_device_name(0)
    preset = "h200" if "H200" in name else "h100-sxm" if "H100" in name else "a100-80gb" if "A100" in name else None
    if preset is None:
        print(f"\nGPU: {name} has no preset peak here; skipped")
        return
    spec = job("llama3-1b-1gpu", 1, dict(tp=1, cp=1, pp=1, dp=1, zero=0, micro_batch=4, recompute="none"), steps,
               model="llama3-1b", gpu=preset, seq_len=2048, global_batch=8, precision="bf16")
    res = run(spec, workdir)
    print(f"\nGPU: {name} ({preset} peak), llama3-1b, bf16, seq 2048, global batch 8")
    if "error" in res:
        print(f"  FAILED {res['error']}")
        return
    print(f"  tokens/s {res['tokens_per_s']:,.0f}  TFLOP/s {res['tflops_per_gpu']:.1f}  MFU {res['mfu']:.1f}%  "
          f"peak mem {res['peak_mem_gb']:.1f} GB  (torchtitan published MFU: {TORCHTITAN_MFU})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", nargs="*", help="run only layouts whose name contains one of these")
    ap.add_argument("--gpu", action="store_true", help="only the single-GPU ~1B figure")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="launch4d-bench-"))
    try:
        if not args.gpu:
            cpu_bench(args.steps, args.only, workdir)
        gpu_bench(max(args.steps, 10), workdir)
    finally:
        if args.keep:
            print(f"run directories: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
