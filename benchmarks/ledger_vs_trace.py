"""The planning ledger beside `launch verify`'s trace of the real trainer, per rank role and category.

For every layout of a matrix (model shapes tiny … llama3-405b, dense / GQA / MoE, ZeRO 0-3,
recompute none/selective/full, pp 1/2/4 with gpipe / 1F1B / interleaved 1F1B, cp 1/2, tp 1/2/8),
the plan is traced at its full world size (launcher.verify.trace_plan: fake process group,
FakeTensorMode, torch's memory tracker) and each pipeline rank's traced peak and categories are
printed beside launcher.plan.ledger.rank_memory for that rank, with the difference.

    python benchmarks/ledger_vs_trace.py              # the whole matrix (slow: large models trace for minutes)
    python benchmarks/ledger_vs_trace.py --quick      # the small shapes only
    python benchmarks/ledger_vs_trace.py --json

Both sides file a tensor by what it is: autocast's bf16 weight casts and FSDP's gathered parameters are
parameters, FSDP's unsharded gradients accumulated under PP are gradients, a block recomputed in
backward (full recompute) is a temporary, as torch's tracker sees it made in backward.
The summary gives, per role, the worst category's difference (of its traced value, or of the total
where the category is under 3 % of it: tests/test_ledger_vs_trace.py's bound).
"""

from __future__ import annotations

import argparse
import json
import time

from launcher.plan.ledger import GB, rank_memory
from launcher.plan.planner import plan_job
from launcher.plan.spec import spec_from_dict

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "comm_buffers")
TINY_MOE = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 96, "vocab": 256,
            "experts": 4, "experts_per_token": 2}
MHA = {"layers": 8, "hidden": 256, "heads": 8, "kv_heads": 8, "ffn_hidden": 1024, "vocab": 1024, "mlp": "gelu"}


def case(model, nodes: int, gpn: int, seq: int, gb: int, precision: str = "bf16", **parallel) -> dict:
    return {"model": model, "train": {"seq_len": seq, "global_batch": gb, "precision": precision},
            "cluster": {"nodes": nodes, "gpus_per_node": gpn, "gpu": "h100-sxm"}, "parallel": parallel}


#: (name, job) — small shapes first: they trace in seconds and make the test's matrix
QUICK = [
    ("tiny dp8 z0 none", case("tiny", 1, 8, 256, 16, tp=1, cp=1, pp=1, zero=0, recompute="none", micro_batch=2)),
    ("tiny dp8 z1 selective", case("tiny", 1, 8, 256, 16, tp=1, cp=1, pp=1, zero=1, recompute="selective",
                                   micro_batch=2)),
    ("tiny dp8 z2 none", case("tiny", 1, 8, 256, 16, tp=1, cp=1, pp=1, zero=2, recompute="none", micro_batch=2)),
    ("tiny dp8 z3 full", case("tiny", 1, 8, 256, 16, tp=1, cp=1, pp=1, zero=3, recompute="full", micro_batch=2)),
    ("tiny tp2 dp4 z3", case("tiny", 1, 8, 256, 16, tp=2, cp=1, pp=1, zero=3, recompute="none", micro_batch=2)),
    ("tiny cp2 dp4 z1", case("tiny", 1, 8, 256, 16, tp=1, cp=2, pp=1, zero=1, recompute="none", micro_batch=2)),
    ("tiny pp2 1f1b z2", case("tiny", 1, 8, 256, 32, tp=1, cp=1, pp=2, zero=2, recompute="none", micro_batch=2,
                              schedule="1f1b")),
    ("tiny pp2 gpipe z0", case("tiny", 1, 8, 256, 32, tp=1, cp=1, pp=2, zero=0, recompute="none", micro_batch=2,
                               schedule="gpipe")),
    ("tiny pp2 interleaved z3", case("tiny", 1, 8, 256, 16, tp=1, cp=1, pp=2, zero=3, recompute="none",
                                     micro_batch=1, schedule="interleaved-1f1b", virtual_stages=2)),
    ("tiny pp4 1f1b z1", case("tiny", 1, 8, 256, 16, tp=1, cp=1, pp=4, zero=1, recompute="selective",
                              micro_batch=2, schedule="1f1b")),
    ("mha-gelu tp2 pp2 z3", case(MHA, 1, 8, 512, 16, tp=2, cp=1, pp=2, zero=3, recompute="selective",
                                 micro_batch=1, schedule="1f1b")),
    ("moe ep2 dp8 z2", case(TINY_MOE, 1, 8, 256, 16, tp=1, cp=1, pp=1, ep=2, zero=2, recompute="none",
                            micro_batch=2)),
    ("moe ep4 dp8 z0", case(TINY_MOE, 1, 8, 256, 16, tp=1, cp=1, pp=1, ep=4, zero=0, recompute="full",
                            micro_batch=2)),
]
LARGE = [
    ("llama3-1b dp8 z1", case("llama3-1b", 1, 8, 4096, 32, tp=1, cp=1, pp=1, zero=1, recompute="none", micro_batch=1)),
    ("llama3-8b dp8 z3", case("llama3-8b", 1, 8, 8192, 64, tp=1, cp=1, pp=1, zero=3, recompute="none", micro_batch=1)),
    ("llama3-8b tp2 pp2 z2", case("llama3-8b", 1, 8, 8192, 64, tp=2, cp=1, pp=2, zero=2, recompute="selective",
                                  micro_batch=1, schedule="1f1b")),
    ("llama3-8b cp2 z1 full", case("llama3-8b", 1, 8, 8192, 64, tp=1, cp=2, pp=1, zero=1, recompute="full",
                                   micro_batch=1)),
    ("llama3-70b tp8 pp4 z3", case("llama3-70b", 64, 8, 8192, 512, tp=8, cp=1, pp=4, zero=3, recompute="full",
                                   micro_batch=1, schedule="interleaved-1f1b", virtual_stages=5)),
    ("mixtral ep8 z3", case("mixtral-8x7b", 8, 8, 4096, 256, tp=1, cp=1, pp=1, ep=8, zero=3, recompute="full",
                            micro_batch=1)),
    ("llama3-405b tp8 pp8 cp2", case("llama3-405b", 128, 8, 8192, 512, tp=8, cp=2, pp=8, zero=3, recompute="full",
                                     micro_batch=1, schedule="1f1b")),
]


def compare(name: str, job: dict) -> list[dict]:
    """One row per traced role: the traced peak and categories beside the ledger's (GB)."""
    from launcher.verify import trace_plan

    spec = spec_from_dict(job)
    plan = plan_job(spec, top=0).best
    t0 = time.perf_counter()
    report = trace_plan(plan)
    seconds = time.perf_counter() - t0
    lay = plan.layout
    rows = []
    for res in report.roles:
        led = rank_memory(spec.model, spec.train, spec.gpu, lay, res.role.pp_rank)
        row = {"layout": name, "role": res.role.name, "status": res.status, "seconds": round(seconds, 1),
               "ledger_gb": round(led.total / GB, 6), "ledger_phase": led.phase,
               "ledger": {c: round(getattr(led, c) / GB, 6) for c in CATEGORIES}}
        if res.peak_gb is not None:
            row["traced_gb"] = round(res.peak_gb, 6)
            row["traced"] = {c: round(res.categories_gb.get(c, 0.0), 6) for c in CATEGORIES}
            row["difference"] = round(led.total / GB / res.peak_gb - 1, 4)
            row["worst_category"] = max(
                ((c, (row["ledger"][c] - row["traced"][c]) / max(row["traced"][c], 0.03 * res.peak_gb))
                 for c in CATEGORIES), key=lambda x: abs(x[1]))
        else:
            row["error"] = res.error
        rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    out = [f"{'layout':26} {'role':28} {'traced GB':>10} {'ledger GB':>10} {'diff':>6}  {'worst category':>14}"
           f"   categories traced/ledger (MB)"]
    for r in rows:
        if "traced_gb" not in r:
            out.append(f"{r['layout']:26} {r['role']:28} {r['status']}: {r.get('error')}")
            continue
        cats = "  ".join(f"{c[:5]} {r['traced'][c] * 1e3:.4g}/{r['ledger'][c] * 1e3:.4g}" for c in CATEGORIES)
        worst, wdiff = r["worst_category"]
        out.append(f"{r['layout']:26} {r['role']:28} {r['traced_gb']:>10.3f} {r['ledger_gb']:>10.3f} "
                   f"{r['difference']:>+6.1%}  {worst[:5]} {wdiff:>+6.1%}   {cats}")
    diffs = [abs(r["difference"]) for r in rows if "difference" in r]
    if diffs:
        worst = max(abs(r["worst_category"][1]) for r in rows if "difference" in r)
        out.append(f"\n{len(diffs)} roles: mean |difference| {sum(diffs) / len(diffs):.1%}, max {max(diffs):.1%}; "
                   f"worst category {worst:.1%}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small shapes only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for name, job in QUICK + ([] if args.quick else LARGE):
        new = compare(name, job)
        rows += new
        if not args.json:
            print("\n".join(render(new).splitlines()[1:len(new) + 1]), flush=True)
    print(json.dumps(rows, indent=1) if args.json else "\n" + render(rows))


if __name__ == "__main__":
    main()
