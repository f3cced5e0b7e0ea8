"""How long the planner's exhaustive search takes, and how fast `launch --help` starts.

Targets (issue 2): llama3-405b on 16,384 GPUs in under 1 s; `launch --help` under 0.3 s.
"""

from __future__ import annotations

import subprocess
import sys
import time

from launcher.planner import plan_job
from launcher.spec import spec_from_dict

CASES = [
    ("llama3-8b", 1, 8192, 64),
    ("llama3-70b", 8, 8192, 512),
    ("llama3-405b", 128, 8192, 2048),
    ("gpt3-175b", 64, 2048, 1536),
    ("mixtral-8x7b", 8, 4096, 1024),
    ("llama3-405b", 2048, 8192, 2048),
]


def main() -> None:
    print(f"{'model':14} {'GPUs':>6} {'searched':>9} {'seconds':>8}  best")
    for model, nodes, seq, gb in CASES:
        spec = spec_from_dict({"model": model, "train": {"seq_len": seq, "global_batch": gb},
                               "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu": "h100-sxm"}})
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            result = plan_job(spec)
            runs.append(time.perf_counter() - t0)
        b = result.best
        d = b.degrees
        print(f"{model:14} {nodes * 8:>6} {result.searched:>9} {min(runs):>8.3f}  tp={d['tp']} cp={d['cp']} "
              f"pp={d['pp']} dp={d['dp']} zero={b.zero_stage} {b.recompute} mb={b.micro_batch} "
              f"MFU {b.estimate['mfu']:.1%}")
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "launcher.cli", "--help"], check=True, capture_output=True)
        runs.append(time.perf_counter() - t0)
    print(f"\n`launch --help` (python -m launcher.cli): best of 5 {min(runs):.3f} s")


if __name__ == "__main__":
    main()
