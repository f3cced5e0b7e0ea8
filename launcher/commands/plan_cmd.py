"""`launch plan`: choose the layout for a job and show why."""

from __future__ import annotations

import click

from launcher.commands import json_option
from launcher.errors import UserError
from launcher.plan.model import Plan


def _gb(x: float) -> str:
    return f"{x:.1f}"


def plan_line(p: Plan) -> str:
    d = p.degrees
    sched = p.schedule + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else "")
    hybrid = f" over dp_shard={p.dp_shard}·cp, {p.dp_replicas} replicas (HSDP)" if p.dp_replicas > 1 else ""
    return (f"tp={d['tp']} cp={d['cp']} pp={d['pp']} dp={d['dp']} ep={d['ep']} | ZeRO {p.zero_stage}{hybrid} | "
            f"recompute {p.recompute} | micro-batch {p.micro_batch} × {p.grad_accum} accum | schedule {sched}"
            + (" | compiled blocks" if p.layout.compile else ""))


def render_plan(p: Plan, title: str = "best") -> str:
    from launcher.plan.layout import rank_map_table

    m, e = p.memory, p.estimate
    lines = [
        f"{title}: {plan_line(p)}",
        f"  memory per GPU: {_gb(m['per_gpu_gb'])} / {_gb(m['limit_gb'])} GB = {m['used_pct']:.0f}% of the limit "
        f"({m['capacity_gb']:.0f} GB less {m['headroom']:.0%} headroom; {memory_source(p)})"
        f"{'' if p.fits else '  (DOES NOT FIT)'}",
        f"    = params {_gb(m['params_gb'])} + grads {_gb(m['grads_gb'])} + optimizer {_gb(m['optimizer_gb'])}"
        f" + activations {_gb(m['activations_gb'])} + temporaries {_gb(m['temporaries_gb'])}"
        f" + comm buffers {_gb(m['comm_buffers_gb'])} + runtime {_gb(m['runtime_gb'])}"
        f"  [{m['worst_stage']} stage, {m['peak_phase']}]",
        f"  estimate: step {e['step_time_s']:.3f} s | {e['tokens_per_s']:,.0f} tokens/s | "
        f"{e['tflops_per_gpu']:.0f} TFLOP/s per GPU | MFU {e['mfu']:.1%} | HFU {e['hfu']:.1%}",
        f"            compute {e['compute_s']:.3f} s, TP {e['tp_comm_s']:.3f} s, CP {e['cp_comm_s']:.3f} s, "
        f"EP {e['ep_comm_s']:.3f} s, bubble {e['bubble_s']:.3f} s ({e['bubble_fraction']:.1%}), "
        f"DP exposed {e['dp_exposed_s']:.3f} of {e['dp_comm_s']:.3f} s, efficiency {e['efficiency']:.0%}",
    ]
    if p.cp > 1:
        lines.insert(1, "  context parallelism: " + ("all-to-all (DeepSpeed-Ulysses: q, k, v and the output exchanged "
                                                    f"for {p.model.heads // (p.tp * p.cp)} heads of the whole sequence "
                                                    "per GPU)" if p.cp_attention == "all-to-all" else
                                                    "all-gather (keys and values of the whole sequence, head/tail "
                                                    "chunks)"))
    if p.hosts:
        lines.append(f"  hosts: {', '.join(p.hosts[:8])}{' ...' if len(p.hosts) > 8 else ''}")
    for w in p.warnings:
        lines.append(f"  warning: {w}")
    lines.append("  rank map (cell = coordinates " + "".join(d[0] for d in p.mesh_order) + "):")
    lines.extend("    " + row for row in rank_map_table(p.ranks, p.mesh_order, p.gpus_per_node).splitlines())
    return "\n".join(lines)


def memory_source(p: Plan) -> str:
    """Where the memory figure comes from: the bundled trainer's ledger, its trace, or (own code) neither
    verified: the ledger prices the bundled trainer, and verify cannot trace foreign code."""
    from launcher.plan.entrypoint import NOT_VERIFIED

    if p.train.entrypoint is not None:
        return f"the bundled trainer's ledger; {NOT_VERIFIED} ({p.train.entrypoint.label})"
    return "traced" if p.memory_traced else "ledger"


def budget_line(b: dict, source: str) -> str:
    from launcher.plan.costs import duration

    cost = f", {b['cost']:,.0f} at {b['price_per_gpu_hour']:g} per GPU-hour" if b.get("cost") is not None else \
        " (set cluster.price_per_gpu_hour for the cost)"
    n = b["tokens"]
    tokens = next(f"{n / d:.3g}{u}" for d, u in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1, "")) if n >= d or d == 1)
    return (f"time to train: {b['steps']:,} steps ({tokens} tokens, from {source}) in "
            f"{duration(b['wall_time_s'])} wall, {b['gpu_hours']:,.0f} GPU-hours{cost}")


def params_text(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def model_line(summary: dict) -> str:
    """'30.53 B parameters, 3.35 B active per token' (active: a mixture of experts)."""
    if not summary:
        return ""
    active = f", {params_text(summary['active_params'])} active per token" if "active_params" in summary else ""
    return f"{params_text(summary['params'])} parameters{active}"


def render_result(spec, result) -> str:
    c = spec.cluster
    params = model_line(getattr(result, "model", {}))
    out = [f"{spec.name}: {spec.model.preset}{f' ({params})' if params else ''} on {c.nodes} × {c.gpus_per_node} "
           f"{spec.gpu.name} ({c.world_size} GPUs), seq {spec.train.seq_len}, global batch {spec.train.global_batch}",
           f"bandwidth: {result.bandwidth.source} (intra {result.bandwidth.intra_gbs:.0f} GB/s, "
           f"inter {result.bandwidth.net_per_gpu_gbs:.1f} GB/s per GPU, ratio {result.bandwidth.ratio:.1f}×)"]
    out += [f"note: {n}" for n in spec.notes]
    if result.calibration:
        out.append(result.calibration["line"])
    out.append("")
    if result.best is None:
        from launcher.plan.explain import nothing_fits_text

        out.append(f"no layout fits: {nothing_fits_text(spec, result)}.")
    else:
        out.append(render_plan(result.best))
    if result.budget:
        out += ["", budget_line(result.budget["best"], result.budget["source"])]
    if result.choice.get("line"):
        out += ["", f"why: {result.choice['line']}"]
    priced = spec.cluster.price_per_gpu_hour is not None
    if result.alternatives and result.best is not None:
        from launcher.plan.costs import duration
        from launcher.plan.explain import uncertainty_text

        unc = plan_uncertainty(result)
        out += ["", f"alternatives (predicted step against the best; the model's cross-validated error is "
                    f"±{unc['cv_error']:.0%}):",
                f"  {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>5} {'ep':>3} {'zero':>4} {'recompute':>9} {'mb':>3} "
                f"{'accum':>5} {'schedule':>18} {'mem GB':>7} {'mem %':>6} {'step s':>8} {'vs best':>8} {'MFU':>6} "
                f"{'to train':>10}" + (f" {'cost':>12}" if priced else "")]
        budgets = result.budget.get("alternatives") or [{}] * len(result.alternatives)
        for a, b, u in zip(result.alternatives, budgets, unc["alternatives"]):
            d = a.degrees
            vs = f"{u['predicted_diff']:+.1%}" + ("*" if u["within_error"] else " ")
            sched = a.schedule + (f" v={a.virtual_stages}" if a.virtual_stages > 1 else "")
            zero = f"{a.zero_stage}" + (f"h{a.dp_shard}" if a.dp_replicas > 1 else "")    # h: hybrid, dp_shard
            out.append(f"  {d['tp']:>3} {d['cp']:>3} {d['pp']:>3} {d['dp']:>5} {d['ep']:>3} {zero:>4} "
                       f"{a.recompute:>9} {a.micro_batch:>3} {a.grad_accum:>5} {sched:>18} "
                       f"{a.memory['per_gpu_gb']:>7.1f} {a.memory['used_pct']:>5.0f}% {a.estimate['step_time_s']:>8.3f} "
                       f"{vs:>8} {a.estimate['mfu']:>6.1%} {duration(b.get('wall_time_s', 0.0)):>10}"
                       + (f" {b['cost']:>12,.0f}" if priced else ""))
        out += ["  (* within the model's error of the best)", uncertainty_text(unc)]
    rej = ", ".join(f"{k}: {v}" for k, v in sorted(result.rejected.items(), key=lambda kv: -kv[1]))
    out += ["", f"searched {result.searched} layouts; rejected — {rej or 'none'}"]
    return "\n".join(out)


def plan_uncertainty(result) -> dict:
    """The alternatives' predicted differences from the best plan against the cross-validated error."""
    from launcher.plan.explain import uncertainty

    return uncertainty(result.best.estimate["step_time_s"], [a.estimate["step_time_s"] for a in result.alternatives])


def previous_plan_warnings(previous: Plan, best: Plan) -> list[str]:
    """A layout change that changes the global batch is a hyperparameter change: say so."""
    old_gb = previous.micro_batch * previous.grad_accum * previous.dp
    new_gb = best.micro_batch * best.grad_accum * best.dp
    out = []
    if old_gb != new_gb or previous.train.seq_len != best.train.seq_len:
        out.append(f"global batch changed from {old_gb} × {previous.train.seq_len} to {new_gb} × "
                   f"{best.train.seq_len} tokens against {previous.name}'s plan: a hyperparameter change — "
                   "re-tune the learning rate")
    if previous.degrees != best.degrees:
        out.append(f"degrees changed from {previous.degrees} to {best.degrees}: run a short job and check the loss "
                   "curve overlaps the previous one (the same batch split differently must give the same loss; "
                   "if it does not, the new layout computes a different gradient)")
    return out


#: What `launch plan --hf config.json` plans without a job file (printed with the plan).
HF_DEFAULTS = {"train": {"seq_len": 4096, "global_batch": 512}, "cluster": {"nodes": 1, "gpus_per_node": 8}}


def hf_spec(job: str | None, hf: str):
    """The job file with its model replaced by the HuggingFace config `hf` (a path from here), or, without a
    job file, that model under HF_DEFAULTS."""
    from pathlib import Path

    from launcher.formats.files import JOB_FILE_LIMIT, read_text
    from launcher.plan.spec import parse_yaml, spec_from_dict

    config = str(Path(hf).resolve())
    if job is None:
        name = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in Path(hf).stem)[:63] or "job"
        import dataclasses

        spec = spec_from_dict({"name": name.lstrip("._-") or "job", "model": config, **HF_DEFAULTS})
        return dataclasses.replace(spec, notes=spec.notes + (
            "no job file: seq_len 4096, global batch 512 on 1 node × 8 h100-sxm; write one with "
            f"`model: {hf}` to choose them",))
    data = parse_yaml(read_text(job, "job file", JOB_FILE_LIMIT), job)
    if not isinstance(data, dict):
        return spec_from_dict(data, source=job)         # its own one-line error
    return spec_from_dict({**data, "model": config}, source=job)


@click.command()
@click.argument("job", type=click.Path(dir_okay=False), required=False)
@click.option("--hf", type=click.Path(dir_okay=False),
              help="A HuggingFace config.json to plan (replaces the job file's model; without JOB: seq 4096, "
                   "global batch 512 on one node of 8 h100-sxm).")
@click.option("--bwmap", type=click.Path(dir_okay=False), help="A BandwidthMap from `launch preflight` (overrides cluster.bwmap).")
@click.option("--top", default=5, show_default=True, type=click.IntRange(0, 100), help="Alternatives to show.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the best plan here (plan.json).")
@click.option("--previous", type=click.Path(dir_okay=False), help="A previous plan.json to compare against.")
@click.option("--benchmark", "bench_k", type=click.IntRange(1, 20), metavar="K",
              help="Run the top K plans for a few steps through the job's backend (local: torchrun here), "
                   "measure them and pick by measurement (-o then writes the measured fastest).")
@click.option("--benchmark-steps", default=4, show_default=True, type=click.IntRange(2, 1000),
              help="Optimizer steps per benchmarked plan (the first is not timed).")
@click.option("--benchmark-dir", type=click.Path(file_okay=False),
              help="Where the benchmark runs go (default <backend.log_dir>/<name>-bench-<time>).")
@click.option("--verify", "verify_", is_flag=True,
              help="Also trace the chosen plan with the real trainer (`launch verify`); exit 1 if a role does not fit.")
@json_option
def plan(job: str | None, hf: str | None, bwmap: str | None, top: int, output: str | None, previous: str | None,
         bench_k: int | None, benchmark_steps: int, benchmark_dir: str | None, verify_: bool, as_json: bool) -> None:
    """Choose TP/CP/PP/DP (+EP), ZeRO stage, recompute and micro-batch for JOB.

    Exit 0 with a plan that fits; 1 when the (fixed) layout does not fit or nothing fits (or, with
    --benchmark, when no benchmarked plan ran)."""
    from launcher.plan.planner import load_bwmap, plan_job

    if hf is not None and bench_k:
        raise UserError("--hf with --benchmark: the benchmark launches a job file; write `model: <config.json>` "
                        "in one instead")
    if hf is not None:
        spec, text = hf_spec(job, hf), None
    elif job is None:
        raise UserError("launch plan: give a job file (JOB), or a HuggingFace config with --hf")
    elif bench_k:
        from launcher.plan.spec import load_spec

        if load_spec(job).train.entrypoint is not None:
            raise UserError("--benchmark: measures the bundled trainer's steps, but train.entrypoint runs your own "
                            "code, which launch4d cannot time; leave --benchmark out (or benchmark the layouts "
                            "without train.entrypoint)")
        from launcher.commands.sources import load_job

        spec, text = load_job(job, None)
    else:
        from launcher.plan.spec import load_spec

        spec, text = load_spec(job), None
    bw, bw_name = load_bwmap(spec, bwmap)
    prev = Plan.load(previous) if previous else None
    result = plan_job(spec, bw, top=max(top, (bench_k or 1) - 1), bwmap_name=bw_name, ranks_for=bench_k or 1)
    chosen = result.best
    measured = None
    if bench_k and chosen is not None and chosen.fits:
        measured, chosen = _benchmark(spec, result, bw, bw_name, bench_k, benchmark_steps, benchmark_dir, text, as_json)
    if prev is not None and chosen is not None:
        chosen.warnings.extend(previous_plan_warnings(prev, chosen))
    if output and chosen is None:
        raise UserError(f"{job}: no layout fits, so no plan was written to {output}")
    rep = None
    if verify_ and chosen is not None and chosen.train.entrypoint is not None:
        from launcher.commands import warn
        from launcher.commands.verify_cmd import own_code_line

        warn(own_code_line(chosen))
    elif verify_ and chosen is not None:
        from launcher.commands.verify_cmd import verify_plan

        rep = verify_plan(chosen, as_json)
        chosen.memory_traced = rep.builds and all(r.status == "traced" for r in rep.roles)
    if output and chosen is not None:  # None raised above
        chosen.save(output)
    if as_json:
        payload = result.to_dict()
        if result.best is not None:
            payload["uncertainty"] = plan_uncertainty(result)
        if chosen is not None:
            payload["memory_verdict"] = memory_source(chosen)
        if rep is not None:
            payload["verify"] = rep.to_dict()
        if measured is not None:
            from launcher.commands.bench import by_measurement

            payload["benchmark"] = [m.to_dict() for m in measured]
            payload["chosen_by_measurement"] = by_measurement(measured)[0].index
        from launcher.plan.model import plan_json

        click.echo(plan_json(payload))
    else:                                  # no dict of every rank record for a table that shows 8 rows
        click.echo(render_result(spec, result))
        if measured is not None:
            from launcher.commands import bench

            click.echo("\n" + bench.render(measured))
        if rep is not None:
            from launcher.verify import render

            click.echo("\n" + render(rep))
    if chosen is None or not chosen.fits or (measured is not None and not any(m.ok for m in measured)) \
            or (rep is not None and not rep.fits):
        raise click.exceptions.Exit(1)


def _benchmark(spec, result, bw, bw_name, k, steps, base, text, as_json):
    """Run the top k plans (of the same search, at `steps` steps) and return the measurements and
    the full-length plan the measurement picks."""
    from pathlib import Path

    from launcher.backends import default_run_dir
    from launcher.commands import bench
    from launcher.plan.planner import plan_job

    short = plan_job(bench.bench_spec(spec, steps), bw, top=k - 1, bwmap_name=bw_name, ranks_for=k)
    plans = [short.best] + short.alternatives
    full = [result.best] + result.alternatives
    where = Path(base) if base else default_run_dir(spec).with_name(default_run_dir(spec).name.replace(
        spec.name, f"{spec.name}-bench", 1))
    measured = bench.run_benchmark(bench.bench_spec(spec, steps), plans[:k], where, text, as_json)
    pick = bench.by_measurement(measured)[0]
    return measured, (full[pick.index] if pick.ok else result.best)
