"""The seed's ZeRO table as the bundled trainer allocates it: `launch verify`'s full-size trace of a 6.7B
SwiGLU model (32 layers, hidden 4096, vocab 32000, ffn 11008) on 8 GPUs, seq 4096, one micro-batch, full
recompute, train.grad_dtype bf16 (the seed's 2 B gradients), at ZeRO 0, 1, 2 and 3.

Prints, per stage, the traced peak's bytes outside activations (parameters, gradients, optimizer state,
temporaries, communication buffers: what the seed's state table counts, plus what the step needs beside
it) against the seed's per_gpu_state_gb for the model's own parameter count, each category, and the
ledger's total beside the trace's (benchmarks/ledger_vs_trace.py's bound: what it misses).

    python benchmarks/seed_table_traced.py [--layers 32] [--json]

tests/integration/test_seed_table_traced.py asserts the same at the full depth (~1 min of CPU a stage).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launcher.plan.ledger import param_counts, per_gpu_state_gb  # noqa: E402
from launcher.plan.spec import spec_from_dict  # noqa: E402

MODEL = {"layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000, "ffn_hidden": 11008, "mlp": "swiglu"}
OUTSIDE = ("params", "grads", "optimizer", "temporaries", "comm_buffers")


def job(zero: int, layers: int, vocab: int = MODEL["vocab"]) -> dict:
    return {"name": f"seed-z{zero}", "model": {**MODEL, "layers": layers, "vocab": vocab},
            "train": {"seq_len": 4096, "global_batch": 8, "grad_dtype": "bf16", "compile": False},
            "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-sxm", "memory_headroom": 0.0},
            "parallel": {"tp": 1, "cp": 1, "pp": 1, "dp": 8, "zero": zero, "recompute": "full", "micro_batch": 1}}


def row(zero: int, layers: int, vocab: int = MODEL["vocab"]) -> dict:
    """One ZeRO stage: traced categories at the peak, the bytes outside activations, the seed's state, and the
    ledger against the trace (ledger_vs_trace.compare's row: its misses)."""
    from benchmarks.ledger_vs_trace import compare

    seed_job = job(zero, layers, vocab)
    spec = spec_from_dict(seed_job)
    res = compare(f"seed z{zero}", seed_job)[0]
    if "traced_gb" not in res:
        return {"zero": zero, "error": res.get("error")}
    cats = res["traced"]
    seed = per_gpu_state_gb(param_counts(spec.model).total / 1e9, 8, zero)
    outside = sum(cats[c] for c in OUTSIDE)
    return {"zero": zero, "traced_peak_gb": res["traced_gb"], "outside_activations_gb": outside, "seed_gb": seed,
            "ratio": outside / seed, "categories_gb": cats, "ledger_gb": res["ledger_gb"],
            "ledger_phase": res["ledger_phase"], "ledger_misses": res["misses"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [row(z, a.layers) for z in (0, 1, 2, 3)]
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"6.7B-class SwiGLU ({a.layers} layers) on 8 GPUs, seq 4096, full recompute, grad_dtype bf16")
    print(f"{'ZeRO':>4} {'seed GB':>8} {'traced':>8} {'ratio':>6}   params  grads  optim  temps  comm  (activations)"
          f"   peak: traced / ledger GB")
    for r in rows:
        if "error" in r:
            print(f"{r['zero']:>4} failed: {r['error']}")
            continue
        c = r["categories_gb"]
        print(f"{r['zero']:>4} {r['seed_gb']:8.1f} {r['outside_activations_gb']:8.1f} {r['ratio']:6.2f}   "
              f"{c['params']:6.1f} {c['grads']:6.1f} {c['optimizer']:6.1f} {c['temporaries']:6.1f} "
              f"{c['comm_buffers']:5.1f}  ({c['activations']:.2f})   {r['traced_peak_gb']:.2f} / {r['ledger_gb']:.2f} "
              f"({r['ledger_phase']}){'  MISS ' + '; '.join(r['ledger_misses']) if r['ledger_misses'] else ''}")


if __name__ == "__main__":
    main()
