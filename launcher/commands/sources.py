"""What `launch render|submit|run|verify` launch: a job file (planned now), a plan.json (launched as
it is: its layout, rank map and stage split, never re-planned), or a job file with `--plan plan.json`
(the plan, after checking that it was made for this job: same model, cluster and train sections).

One artefact from plan to launch: `launch plan job.yaml -o plan.json` (or `--benchmark K -o`: the
measured pick) writes what these commands take."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import UserError
from launcher.plan.model import Plan
from launcher.plan.spec import JobSpec


@dataclass
class Launch:
    """A job to launch: its spec, the plan that runs, the job file's text for the run dir's copy,
    and where its nodes come from (a bandwidth map's exclusions and healthy-node order)."""

    spec: JobSpec
    plan: Plan
    text: str
    from_plan: str | None = None          # the plan.json launched, if one was given
    exclude: list[str] | None = None
    node_order: list[str] | None = None


def load_job(job: str, nproc: int | None) -> tuple[JobSpec, str]:
    """A job file as `launch run` (and `plan --benchmark`) runs it on this machine: the validated spec
    (with --nproc applied, a relative train.data and entrypoint script made absolute) and the text."""
    from launcher.plan.spec import load_spec_text, parse_yaml, spec_from_dict

    spec, text = load_spec_text(job)  # read once; validates the file as written, with its own messages
    data = parse_yaml(text, job)  # the same YAML 1.2 reading as the validation's
    changed = []
    if nproc is not None:
        if nproc < 1:
            raise UserError(f"--nproc: {nproc} must be at least 1")
        cluster = data.setdefault("cluster", {}) or {}
        data["cluster"] = {**cluster, "gpus_per_node": nproc}
        changed.append(f"cluster.gpus_per_node={nproc}")
    train = data.get("train") or {}
    path = train.get("data")
    if isinstance(path, str) and path != "synthetic" and not Path(path).is_absolute():
        train = data["train"] = {**train, "data": str(Path(path).resolve())}
        changed.append(f"train.data={train['data']}")
    entry = train.get("entrypoint")
    script = entry.get("script") if isinstance(entry, dict) else None
    if isinstance(entry, dict) and isinstance(script, str) and script and not script.startswith("-") \
            and not Path(script).is_absolute():
        data["train"] = {**train, "entrypoint": {**entry, "script": str(Path(script).resolve())}}
        changed.append(f"train.entrypoint.script={data['train']['entrypoint']['script']}")
    if changed:
        spec = spec_from_dict(data, source=job)
        text = f"# launch run overrides: {', '.join(changed)}\n" + text
    return spec, text


def is_plan_file(path: str | Path) -> bool:
    """A plan.json as `launch plan -o` writes it (a JSON object with world_size and layout)."""
    p = Path(path)
    if p.suffix != ".json" or not p.is_file():
        return False
    try:
        with open(p, encoding="utf-8") as fh:
            head = fh.read(1 << 16)          # world_size and layout come before the rank map
        data = json.loads(head) if len(head) < 1 << 16 else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if data is None:                          # a large plan: its keys are in the first lines all the same
        return '"world_size"' in head and '"layout"' in head
    return isinstance(data, dict) and "world_size" in data and "layout" in data


def spec_from_plan(plan: Plan, source: str | None = None) -> JobSpec:
    """The job a plan.json describes: its sections, with `parallel` fixed to the plan's layout. A plan
    written before plans carried the cluster and backend sections gets the defaults for those."""
    from launcher.errors import SpecError
    from launcher.plan.spec import ClusterSpec, ParallelSpec
    from launcher.plan.spec_backend import BackendSpec

    lay = plan.layout
    if lay.world != plan.world_size:
        raise SpecError("plan.world_size", f"{plan.world_size} but the layout's tp·cp·pp·dp is {lay.world}")
    if plan.nodes * plan.gpus_per_node != plan.world_size:
        raise SpecError("plan.world_size", f"{plan.world_size} but nodes × gpus_per_node is "
                                           f"{plan.nodes} × {plan.gpus_per_node}")
    if sum(plan.stage_layers) != plan.model.layers or len(plan.stage_layers) != lay.pp * lay.virtual_stages:
        raise SpecError("plan.stage_layers", f"{plan.stage_layers} is not a split of {plan.model.layers} layers "
                                             f"into pp·virtual_stages = {lay.pp * lay.virtual_stages} chunks")
    cluster = plan.cluster or ClusterSpec(nodes=plan.nodes, gpus_per_node=plan.gpus_per_node,
                                          gpu=dataclasses.asdict(plan.gpu))
    if (cluster.nodes, cluster.gpus_per_node) != (plan.nodes, plan.gpus_per_node):
        raise SpecError("plan.cluster", f"{cluster.nodes} × {cluster.gpus_per_node} GPUs but the plan's ranks are "
                                        f"{plan.nodes} × {plan.gpus_per_node}")
    parallel = ParallelSpec(tp=lay.tp, cp=lay.cp, pp=lay.pp, dp=lay.dp, ep=lay.ep, zero=lay.zero,
                            recompute=lay.recompute, micro_batch=lay.micro_batch,
                            schedule=None if lay.schedule == "none" else lay.schedule,
                            virtual_stages=lay.virtual_stages, mesh_order=list(plan.mesh_order),
                            allow_cross_node_tp=not plan.tp_node_local)
    return JobSpec(name=plan.name, model=plan.model, train=plan.train, cluster=cluster, gpu=plan.gpu,
                   parallel=parallel, backend=plan.backend or BackendSpec(), diagnostics=plan.diagnostics,
                   source=source)


def job_text_of(spec: JobSpec, note: str) -> str:
    """A job file (YAML) that says what `spec` says, the layout fixed: the run dir's job.yaml when the
    job came from a plan.json."""
    import yaml

    train = dataclasses.asdict(spec.train)
    train.pop("tokens", None)                          # steps, already derived from it
    data: dict[str, Any] = {
        "name": spec.name, "model": dataclasses.asdict(spec.model), "train": train,
        "cluster": dataclasses.asdict(spec.cluster), "parallel": dataclasses.asdict(spec.parallel),
        "backend": dataclasses.asdict(spec.backend), "diagnostics": dataclasses.asdict(spec.diagnostics)}
    return f"# {note}\n" + yaml.safe_dump(data, sort_keys=False)


def _differences(prefix: str, job: Any, plan: Any) -> str | None:
    """The first field where two values of one dataclass differ, as `prefix.field: job ..., plan ...`."""
    from launcher.plan.schema import show

    if dataclasses.is_dataclass(job) and dataclasses.is_dataclass(plan) and type(job) is type(plan):
        for f in dataclasses.fields(job):
            found = _differences(f"{prefix}.{f.name}", getattr(job, f.name), getattr(plan, f.name))
            if found:
                return found
        return None
    if job != plan:
        return f"{prefix}: the job file has {show(job)}, the plan {show(plan)}"
    return None


def _data_path(train):
    """train.data as an absolute path (what `launch run` hands the trainer), 'synthetic' as is; so is
    train.entrypoint.script (what torchrun starts)."""
    if train.data != "synthetic" and not Path(train.data).is_absolute():
        train = dataclasses.replace(train, data=str(Path(train.data).resolve()))
    entry = train.entrypoint
    if entry is not None and entry.script is not None and not Path(entry.script).is_absolute():
        train = dataclasses.replace(train, entrypoint=dataclasses.replace(entry, script=str(Path(entry.script).resolve())))
    return train


def _layout_train(train):
    """The train section as far as it decides the layout: train.entrypoint only says what code runs."""
    return dataclasses.replace(_data_path(train), entrypoint=None)


def check_plan_matches(spec: JobSpec, plan: Plan, plan_path: str) -> None:
    """The job file and the plan describe the same job: model, cluster and train (first difference,
    one line). The job's backend and diagnostics sections may differ: they do not change the layout."""
    found = _differences("model", spec.model, plan.model)
    if found is None:
        found = _differences("cluster.gpu", spec.gpu, plan.gpu)
    if found is None:
        for name, mine in (("nodes", spec.cluster.nodes), ("gpus_per_node", spec.cluster.gpus_per_node)):
            theirs = getattr(plan, name)
            if mine != theirs:
                found = f"cluster.{name}: the job file has {mine}, the plan {theirs}"
                break
    if found is None and plan.cluster is not None:
        job_cluster = dataclasses.replace(spec.cluster, gpu=None)
        found = _differences("cluster", job_cluster, dataclasses.replace(plan.cluster, gpu=None))
    if found is None:
        found = _differences("train", _layout_train(spec.train), _layout_train(plan.train))
    if found is not None:
        raise UserError(f"--plan: {plan_path} was not made for {spec.source or spec.name}: {found} "
                        f"(re-plan: launch plan {spec.source or 'JOB'} -o {plan_path})")


def load_launch(path: str, plan_path: str | None = None, bwmap: str | None = None, nproc: int | None = None,
                local: bool = False) -> Launch:
    """The job at `path` (a job file, or a plan.json) with `--plan`, `--preflight/--bwmap` and (`launch
    run`) `--nproc` applied. `local`: `launch run`'s reading of a job file (train.data made absolute)."""
    given_plan = path if is_plan_file(path) else None
    if given_plan and plan_path:
        raise UserError(f"--plan: {path} is a plan.json already; give a job file with --plan, or the plan alone")
    plan_file = given_plan or plan_path
    if plan_file and bwmap:
        raise UserError(f"--preflight: {plan_file} already holds its placement (from the bandwidth map it was "
                        "planned with); to place it on another map, re-plan the job file with it")
    if given_plan:
        plan = Plan.load(given_plan)
        if nproc is not None and nproc != plan.world_size:
            raise UserError(f"--nproc: {given_plan} is a plan of {plan.world_size} processes; a plan is launched as "
                            f"it is (re-plan its job file for {nproc})")
        try:
            spec = spec_from_plan(plan, given_plan)
        except UserError as exc:
            raise UserError(f"{given_plan}: {exc}") from None
        if local and _data_path(spec.train) != spec.train:
            spec = dataclasses.replace(spec, train=_data_path(spec.train))
            plan.train = spec.train
        text = job_text_of(spec, f"from {given_plan}: the plan's layout, fixed (launch4d)")
        return Launch(spec, plan, text, given_plan, *_placement(plan))
    if local:
        spec, text = load_job(path, nproc)
    else:
        from launcher.plan.spec import load_spec_text

        if nproc is not None:
            raise UserError("--nproc applies to `launch run` only")
        spec, text = load_spec_text(path)
    if plan_path:
        plan = Plan.load(plan_path)
        check_plan_matches(spec, plan, plan_path)
        plan.diagnostics, plan.backend, plan.train = spec.diagnostics, spec.backend, spec.train
        return Launch(spec, plan, text, plan_path, *_placement(plan))
    from launcher.plan.planner import load_bwmap, plan_job

    bw, name = load_bwmap(spec, bwmap)
    result = plan_job(spec, bw, top=0, bwmap_name=name)
    if result.best is None:
        raise UserError(nothing_fits_line(path, spec, result))
    return Launch(spec, result.best, text, None, list(bw.exclude) if bw else None,
                  bw.healthy_hosts if bw else None)


def _placement(plan: Plan) -> tuple[list[str] | None, list[str] | None]:
    excluded = plan.bandwidth.get("excluded_nodes") if isinstance(plan.bandwidth, dict) else None
    return (list(excluded) if excluded else None), (list(plan.hosts) if plan.hosts else None)


def nothing_fits_line(path: str, spec: JobSpec, result) -> str:
    """One line for a job no layout of which fits: the closest candidate against the limit, the
    smallest world size that fits, or what rejected every layout."""
    from launcher.plan.explain import nothing_fits_text

    return f"{path}: no layout fits: {nothing_fits_text(spec, result)}; see `launch plan {path}`"
