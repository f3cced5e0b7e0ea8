"""How long `launch plan` takes as a whole process (interpreter start, imports, presets, search,
output), and how big its JSON is; plus the search alone and `launch --help`.

Targets (issue 10): llama3-405b on 16,384 GPUs in under 1 s for the whole process, human output,
`--json` and `-o` alike, with plan.json under 2 MB; `launch --help` under 0.3 s. Wall times are the
best of 3 runs (the machine is shared); CPU time (user + sys of the child) is shown beside them, and
the load average before and after (wall times on a loaded machine are not the tool's).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict

CASES = [
    ("llama3-8b", 1, 8192, 64),
    ("llama3-70b", 8, 8192, 512),
    ("llama3-405b", 128, 8192, 2048),
    ("gpt3-175b", 64, 2048, 1536),
    ("mixtral-8x7b", 8, 4096, 1024),
    ("llama3-405b", 2048, 8192, 2048),
]


def job(model: str, nodes: int, seq: int, gb: int) -> dict:
    return {"model": model, "train": {"seq_len": seq, "global_batch": gb},
            "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu": "h100-sxm"}}


def timed(argv: list[str], runs: int = 3) -> tuple[float, float, int]:
    """(best wall s, CPU s of that run, stdout bytes) of a child process."""
    best = (float("inf"), 0.0, 0)
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        out = subprocess.run(argv, capture_output=True, check=False).stdout
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        best = min(best, (wall, cpu, len(out)))
    return best


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def main() -> None:
    print(load())
    print(f"{'model':14} {'GPUs':>6} {'searched':>9} {'search s':>9}  best")
    for model, nodes, seq, gb in CASES:
        spec = spec_from_dict(job(model, nodes, seq, gb))
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            result = plan_job(spec)
            runs.append(time.perf_counter() - t0)
        b = result.best
        d = b.degrees
        print(f"{model:14} {nodes * 8:>6} {result.searched:>9} {min(runs):>9.3f}  tp={d['tp']} cp={d['cp']} "
              f"pp={d['pp']} dp={d['dp']} zero={b.zero_stage} {b.recompute} mb={b.micro_batch} "
              f"MFU {b.estimate['mfu']:.1%}")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "l405b-16k.yaml"
        path.write_text(yaml.safe_dump(job("llama3-405b", 2048, 8192, 2048)))
        launch = [sys.executable, "-m", "launcher.cli", "plan", str(path)]
        out = Path(tmp) / "plan.json"
        print("\n`launch plan` as a whole process, llama3-405b on 16,384 H100s (best of 3):")
        for label, extra in (("human", []), ("--json", ["--json"]), ("-o plan.json", ["-o", str(out)])):
            wall, cpu, size = timed(launch + extra)
            note = f"stdout {size / 1e6:.2f} MB" if label == "--json" else ""
            if label.startswith("-o"):
                note = f"plan.json {os.path.getsize(out) / 1e6:.2f} MB"
            print(f"  {label:14} {wall:6.3f} s wall  {cpu:6.3f} s CPU  {note}")
    wall, cpu, _ = timed([sys.executable, "-m", "launcher.cli", "--help"], runs=5)
    print(f"\n`launch --help` (python -m launcher.cli): best of 5 {wall:.3f} s wall, {cpu:.3f} s CPU")
    print(load())


if __name__ == "__main__":
    main()
