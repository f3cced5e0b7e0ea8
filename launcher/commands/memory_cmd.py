"""`launch memory`: the memory ledger — the seed's worked examples, a job's ledger, or ad-hoc figures."""

from __future__ import annotations

import dataclasses
import math

import click

from launcher.commands import emit, json_option
from launcher.errors import UserError
from launcher.plan.ledger import (
    GIB,
    act_gb,
    bubble_ratio,
    bytes_per_param,
    in_flight_microbatches,
    layer_activation_bytes,
    per_gpu_state_gb,
    tp_bytes_per_step,
)

#: Korthikanti et al. 2022, Table 3 configurations (s=2048, b=1 except 22B b=4; v=3 for 175B/530B).
KORTHIKANTI = [("22B", 48, 6144, 64, 8, 1, 1, 4), ("175B", 96, 12288, 96, 8, 8, 3, 1),
               ("530B", 105, 20480, 128, 8, 35, 3, 1), ("1T", 128, 25600, 160, 8, 64, 1, 1)]


def korthikanti_fig1() -> list[dict]:
    """Fig. 1 memory per GPU (GiB): params + optimizer at 18 B/param over the 12·L·h² layer weights,
    activations of the first stage with TP only and with SP + selective recompute."""
    rows = []
    for name, L, h, a, t, p, v, b in KORTHIKANTI:
        held = in_flight_microbatches("interleaved-1f1b" if v > 1 else "1f1b", p, 10**6, v) * L / p
        rows.append({
            "model": name, "tp": t, "pp": p, "virtual_stages": v, "micro_batch": b,
            "params_optimizer_gib": round(12 * L * h * h / (t * p) * 18 / GIB, 2),
            "activations_tp_gib": round(layer_activation_bytes(2048, b, h, a, "none", tp=t, sequence_parallel=False)
                                        * held / GIB, 2),
            "activations_sp_selective_gib": round(layer_activation_bytes(2048, b, h, a, "selective", tp=t)
                                                  * held / GIB, 2),
        })
    return rows

SEED_MODELS = (7, 13, 70)
SEED_ACT = dict(s=4096, b=1, h=4096, a=32, layers=32)


def seed_tables(world: int = 8) -> dict:
    """Every table the seed prints, computed by the same functions the planner uses."""
    bpp = bytes_per_param()
    return {
        "bytes_per_param": {"params": bpp.param, "grads": bpp.grad, "optimizer": bpp.optimizer, "total": bpp.total},
        "state_gb": {n: per_gpu_state_gb(n, 1, 0) for n in SEED_MODELS},
        "zero_table": [{"stage": st, "world": world,
                        "gb": [round(per_gpu_state_gb(n, world, st), 1) for n in SEED_MODELS]} for st in range(4)],
        "activations": [{"mode": mode, "gb_per_sample": round(act_gb(mode=mode, **SEED_ACT), 2)}
                        for mode in ("none", "selective", "full")],
        "activation_config": SEED_ACT,
        "tp_bytes_per_step": tp_bytes_per_step(4096, 1, 4096, 32, tp=8),
        # the seed's reading of that figure: NVLink 4 (900 GB/s advertised) vs one 400 Gb/s IB port
        "tp_time_ms": {"nvlink_900gbs": tp_bytes_per_step(4096, 1, 4096, 32, tp=8) / 900e9 * 1e3,
                       "ib_50gbs": tp_bytes_per_step(4096, 1, 4096, 32, tp=8) / 50e9 * 1e3},
        # the seed quotes whole gigabytes here ("it's 416GB"): 4 × 104.15 = 416.6, truncated
        "activations_micro_batch_4_gb": int(4 * act_gb(mode="none", **SEED_ACT)),
        "zero1_floor_gb": {n: (bpp.param + bpp.grad) * n for n in SEED_MODELS},
        "korthikanti_fig1": korthikanti_fig1(),
        "bubble": [{"stages": 8, "micro_batches": m, "bubble": round(bubble_ratio(8, m), 4)} for m in (4, 8, 16, 32, 64)],
    }


def render_seed(t: dict) -> str:
    b = t["bytes_per_param"]
    out = [f"bytes per parameter (Adam, bf16): params {b['params']:g} + grads {b['grads']:g} + "
           f"optimizer {b['optimizer']:g} = {b['total']:g} B",
           "state memory, one GPU: " + ", ".join(f"{n}B -> {gb:.0f} GB" for n, gb in t["state_gb"].items()),
           "", "ZeRO stage, per-GPU state (GB) for 7B / 13B / 70B:"]
    out += [f"  stage {r['stage']}  world={r['world']}  7B/13B/70B -> {r['gb']} GB" for r in t["zero_table"]]
    c = t["activation_config"]
    out += ["", f"activations, s={c['s']} b={c['b']} h={c['h']} a={c['a']} L={c['layers']}:"]
    out += [f"  {r['mode']:10} {r['gb_per_sample']:7.2f} GB / sample" for r in t["activations"]]
    out.append(f"  micro-batch 4, nothing recomputed: {t['activations_micro_batch_4_gb']} GB")
    floor = t["zero1_floor_gb"]
    out.append("ZeRO 1 never drops below params+grads: " + ", ".join(f"{n}B -> {gb:g} GB" for n, gb in floor.items()))
    tm = t["tp_time_ms"]
    out += ["", f"TP bytes per step (s=4096, b=1, h=4096, L=32, tp=8): {t['tp_bytes_per_step'] / 1e9} GB/step",
            f"  over NVLink 900 GB/s: {tm['nvlink_900gbs']:.1f} ms; over one 400 Gb/s IB port (50 GB/s): "
            f"{tm['ib_50gbs']:.0f} ms", "",
            "pipeline bubble (p-1)/m:"]
    out += [f"  micro_batches={r['micro_batches']:3}  8-stage bubble {r['bubble']:.1%}" for r in t["bubble"]]
    out += ["", "Korthikanti et al. 2022, Fig. 1 (GiB per GPU, first pipeline stage):",
            f"  {'model':5} {'t':>2} {'p':>3} {'v':>2} {'params+opt':>11} {'act TP':>8} {'act SP+sel':>11}"]
    out += [f"  {r['model']:5} {r['tp']:>2} {r['pp']:>3} {r['virtual_stages']:>2} {r['params_optimizer_gib']:>11.2f} "
            f"{r['activations_tp_gib']:>8.2f} {r['activations_sp_selective_gib']:>11.2f}" for r in t["korthikanti_fig1"]]
    return "\n".join(out)


def adhoc(params: float, world: int, zero: int | None, optimizer: str, precision: str, grad_dtype: str,
          seq: int | None, batch: int, hidden: int | None, heads: int | None, layers: int | None,
          recompute: str | None, tp: int, cp: int) -> dict:
    bpp = bytes_per_param(optimizer, precision, grad_dtype)
    stages = [zero] if zero is not None else [0, 1, 2, 3]
    out: dict = {"params": params, "world": world, "bytes_per_param": bpp.total,
                 "state_gb": [{"stage": st, "gb": round(per_gpu_state_gb(params / 1e9, world, st, bpp), 3)} for st in stages]}
    if seq and hidden and heads and layers:
        modes = [recompute] if recompute else ["none", "selective", "full"]
        out["activations"] = [{"mode": m, "gb": round(layer_activation_bytes(seq, batch, hidden, heads, m, tp=tp, cp=cp)
                                                      * layers / 1e9, 3)} for m in modes]
    return out


def render_adhoc(d: dict) -> str:
    out = [f"{d['params']:.3g} parameters at {d['bytes_per_param']:g} B/param over {d['world']} GPUs:"]
    out += [f"  ZeRO {r['stage']}: {r['gb']:.2f} GB state per GPU" for r in d["state_gb"]]
    for r in d.get("activations", []):
        out.append(f"  activations ({r['mode']}): {r['gb']:.2f} GB per micro-batch")
    return "\n".join(out)


@click.command()
@click.argument("job", required=False, type=click.Path(dir_okay=False))
@click.option("--params", type=float, help="Parameter count (e.g. 7e9).")
@click.option("--world", type=click.IntRange(1), default=8, show_default=True, help="GPUs in the sharding group.")
@click.option("--zero", type=click.IntRange(0, 3), help="ZeRO stage (default: all four).")
@click.option("--optimizer", type=click.Choice(["adam", "sgd", "adam8bit"]), default="adam", show_default=True)
@click.option("--precision", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
@click.option("--grad-dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option("--seq", type=click.IntRange(1), help="Sequence length, for activations.")
@click.option("--batch", type=click.IntRange(1), default=1, show_default=True, help="Micro-batch.")
@click.option("--hidden", type=click.IntRange(1))
@click.option("--heads", type=click.IntRange(1))
@click.option("--layers", type=click.IntRange(1))
@click.option("--recompute", type=click.Choice(["none", "selective", "full"]))
@click.option("--tp", type=click.IntRange(1), default=1, show_default=True)
@click.option("--cp", type=click.IntRange(1), default=1, show_default=True)
@json_option
def memory(job, params, world, zero, optimizer, precision, grad_dtype, seq, batch, hidden, heads, layers,
           recompute, tp, cp, as_json) -> None:
    """Print the memory ledger.

    With no arguments: worked examples (ZeRO table, activation modes, TP bytes, bubble,
    Korthikanti et al.'s Fig. 1).
    With JOB: the ledger of the job's planned layout. With --params: state memory by ZeRO stage
    (and activations with --seq --hidden --heads --layers)."""
    if job:
        from launcher.plan.planner import plan_job
        from launcher.plan.spec import load_spec

        spec = load_spec(job)
        result = plan_job(spec, top=0)
        if result.best is None:
            emit({"fits": False, "memory": None}, as_json, lambda: "no layout fits")
            raise click.exceptions.Exit(1)
        p = result.best
        payload = {"plan": {"layout": dataclasses.asdict(p.layout)}, "memory": p.memory, "fits": p.fits}

        def human() -> str:
            from launcher.commands.plan_cmd import plan_line

            m = p.memory
            totals = ("per_gpu_gb", "capacity_gb", "limit_gb")
            rows = [(k[:-3], v) for k, v in m.items() if k.endswith("_gb") and k not in totals]
            return "\n".join([plan_line(p)] + [f"  {k:22} {v:9.2f} GB" for k, v in rows]
                             + [f"  {'total per GPU':22} {m['per_gpu_gb']:9.2f} GB of {m['limit_gb']:.1f} allowed "
                                f"({m['used_pct']:.0f}%; {m['capacity_gb']:.0f} GB less {m['headroom']:.0%} headroom)"])
        emit(payload, as_json, human)
        if not p.fits:
            raise click.exceptions.Exit(1)
        return
    if params is not None:
        if not (math.isfinite(params) and params > 0):
            raise UserError(f"--params: {params} is not a finite number > 0 (e.g. 7e9)")
        d = adhoc(params, world, zero, optimizer, precision, grad_dtype, seq, batch, hidden, heads, layers, recompute, tp, cp)
        emit(d, as_json, lambda: render_adhoc(d))
        return
    t = seed_tables()
    emit(t, as_json, lambda: render_seed(t))
