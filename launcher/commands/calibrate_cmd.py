"""`launch calibrate RUN_DIR...`: fit this cluster's time-model efficiency parameters to measured runs
and write the cluster profile later plans read (cluster.profile in the job file)."""

from __future__ import annotations

import statistics

import click

from launcher.commands import emit, json_option

DEFAULT_OUTPUT = "cluster-profile.json"


def render(prof, output: str) -> str:
    from launcher.plan.profile import PARAMS, fmt

    fitted = ", ".join(f"{k} {fmt(k, v)} (was {fmt(k, prof.base[k])})" for k, v in prof.params.items())
    lines = [f"calibrated on {len(prof.runs)} run(s) of {prof.gpu['name']} x {prof.gpus_per_node} per node: "
             f"fitted {fitted}"]
    for k, why in prof.not_fitted.items():
        lines.append(f"  not fitted: {k} ({PARAMS[k][0]}, kept {fmt(k, prof.base[k])}): {why}")
    lines.append(f"  {'layout':34} {'GPUs':>5} {'steps':>5} {'measured s':>11} {'before s':>9} {'error':>7} "
                 f"{'after s':>9} {'error':>7}")
    for r in prof.runs:
        lines.append(f"  {r['layout']:34} {r['world_size']:>5} {r['steps']:>5} {r['measured_step_s']:>11.4f} "
                     f"{r['predicted_before_s']:>9.4f} {r['error_before']:>+7.0%} {r['predicted_after_s']:>9.4f} "
                     f"{r['error_after']:>+7.0%}")
    med = [statistics.median(abs(r[k]) for r in prof.runs) for k in ("error_before", "error_after")]
    lines.append(f"  median |error|: {med[0]:.0%} before, {med[1]:.0%} after (measured: median step after "
                 "the first)")
    if prof.params.get("compute_efficiency", 0) > 1:
        lines.append(f"  note: a ceiling above 1 means this device outruns GPU preset {prof.gpu['name']!r}'s "
                     f"{prof.gpu['peak_tflops']} TFLOP/s at these GEMM sizes")
    lines.append(f"wrote {output}; plans use it with `cluster: {{profile: {output}}}` in the job file")
    return "\n".join(lines)


@click.command()
@click.argument("run_dirs", nargs=-1, required=True)
@click.option("-o", "--output", default=DEFAULT_OUTPUT, show_default=True, type=click.Path(dir_okay=False),
              help="Where to write the cluster profile.")
@json_option
def calibrate(run_dirs: tuple[str, ...], output: str, as_json: bool) -> None:
    """Fit this cluster's compute efficiency (and the bandwidth and latency the runs can identify) to the
    measured step times of RUN_DIR... (from `launch plan --benchmark`, `run` or `submit`), and write them
    as a cluster profile; name it in the job file (cluster.profile) and later plans predict with it."""
    from dataclasses import replace

    from launcher.formats.files import check_writable_target
    from launcher.plan.calibrate import calibrate as fit_runs

    check_writable_target(output, "cluster profile")
    prof = replace(fit_runs(list(run_dirs)), path=output)
    prof.save(output)
    emit({"output": output, **prof.to_dict()}, as_json, lambda: render(prof, output))
