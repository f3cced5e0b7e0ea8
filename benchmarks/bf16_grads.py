"""Where gradients accumulate: bf16 (the seed's 2 B/param) or an fp32 buffer (Megatron's main_grad, 4 B),
measured as loss curves of the lean trainer against the fp32 reference.

The bundled trainer's bf16 runs on a CPU too when the engine is told to (what `launch verify` does), so
this runs here: the tiny preset in one process, `--steps` optimizer steps of `--accum` micro-batches each
(the accumulation is where bf16 loses bits: every micro-batch's gradient is added into a bf16 sum), from
the same seed and data, three ways: fp32 throughout (the reference), bf16 weights with bf16 gradients,
bf16 weights with fp32 gradients. Prints each curve's largest and final relative difference from the
reference over the steps and the mean over the last quarter.

    python benchmarks/bf16_grads.py [--steps 200] [--accum 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(steps: int, accum: int, precision: str, grad_dtype: str, port: int) -> list[float]:
    import torch
    import torch.distributed as dist

    from launcher.trainer.config import config_from_plan
    from launcher.trainer.data import TokenSource
    from launcher.trainer.engine import Engine
    from launcher.trainer.mesh import build_mesh
    from tests.trainer_helpers import make_plan

    torch.manual_seed(0)
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        plan = make_plan(steps=steps, global_batch=accum, micro_batch=1, grad_accum=accum, zero=1,
                         precision=precision, grad_dtype=grad_dtype, lr=1e-3, warmup_steps=10, seq_len=64)
        cfg = config_from_plan(plan)
        mesh = build_mesh(cfg, torch.device("cpu"))
        eng = Engine(cfg, mesh, bf16=precision == "bf16")
        data = TokenSource(plan, 0, 1)
        return [eng.train_step(data.next_batch(), lambda *a, **k: None)[0] for _ in range(steps)]
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--accum", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.trainer_helpers import free_port

    ref = run(a.steps, a.accum, "fp32", "bf16", free_port())
    out = {"steps": a.steps, "micro_batches": a.accum, "reference_first_last": [ref[0], ref[-1]], "runs": {}}
    for grad_dtype in ("bf16", "fp32"):
        got = run(a.steps, a.accum, "bf16", grad_dtype, free_port())
        rel = [abs(x - y) / abs(y) for x, y in zip(got, ref)]
        tail = rel[-max(1, len(rel) // 4):]
        out["runs"][f"bf16 weights, {grad_dtype} grads"] = {
            "max_rel": max(rel), "final_rel": rel[-1], "last_quarter_mean_rel": sum(tail) / len(tail),
            "final_loss": got[-1]}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"tiny preset, {a.steps} steps x {a.accum} micro-batches; fp32 reference loss "
          f"{ref[0]:.4f} -> {ref[-1]:.4f}")
    print(f"{'run':28} {'max |rel|':>10} {'final':>10} {'last 1/4 mean':>14} {'final loss':>11}")
    for name, r in out["runs"].items():
        print(f"{name:28} {r['max_rel']:10.2e} {r['final_rel']:10.2e} {r['last_quarter_mean_rel']:14.2e} "
              f"{r['final_loss']:11.4f}")


if __name__ == "__main__":
    main()
