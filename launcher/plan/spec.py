"""JobSpec: the validated job file (model, train, cluster, parallel, backend, diagnostics).

`load_spec(path)` reads YAML 1.2 (a safe loader, launcher.plan.yaml_core), resolves presets and checks every value;
any problem is a SpecError naming the dotted path and what would be valid.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import SpecError, UserError
from launcher.plan import capabilities, presets
from launcher.plan.entrypoint import EntrypointSpec
from launcher.plan.schema import bounded, did_you_mean, json_schema, key_name, load_dataclass, show
from launcher.plan.spec_backend import BackendSpec, DiagnosticsSpec
from launcher.plan.types import (  # ModelSpec: the job file's model section, re-exported where it was
    CpAttention,
    Fp8Linears,
    GradDtype,
    ModelSpec,
    Optimizer,
    Precision,
    Recompute,
    Schedule,
    ZeroStage,
)

MESH_DIMS = ("pp", "dp", "cp", "tp")
MAX_STEPS = 1 << 40
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


@dataclass(frozen=True)
class TrainSpec:
    seq_len: int = bounded(lo=1, hi=1 << 24, doc="tokens per sequence")
    global_batch: int = bounded(lo=1, hi=1 << 30, doc="sequences per optimizer step")
    steps: int = bounded(100, 1, MAX_STEPS, doc="optimizer steps")
    tokens: int | None = bounded(None, 1, 1 << 62, doc="a token budget instead of steps: "
                                                        "steps = ⌈tokens / (global_batch·seq_len)⌉ (not both)")
    optimizer: Optimizer = bounded("adam", doc="adam (AdamW), adam8bit (block-wise 8-bit AdamW) or sgd")
    precision: Precision = bounded("bf16", why_not=capabilities.PRECISION_REFUSED,
                                   doc="compute precision: bf16, fp32, or fp8 (bf16 with the linears' GEMMs in fp8, "
                                       "torchao's rowwise float8; GPUs with FP8 tensor cores only)")
    fp8_linears: Fp8Linears = bounded("auto", doc="under precision fp8, which linears run in fp8: auto (those large "
                                                  "enough to gain, torchtitan's auto_filter_small_kn) or all (both "
                                                  "dims divisible by 16); the output head, router and routed "
                                                  "experts stay bf16")
    grad_dtype: GradDtype = bounded("bf16", doc="where gradients accumulate over micro-batches under ZeRO 0/1: "
                                                "bf16 (2 B/param, the ZeRO paper's count) or an fp32 buffer (4 B/param)")
    lr: float = bounded(3e-4, 0.0, 10.0, doc="peak learning rate")
    warmup_steps: int = bounded(0, 0, 1 << 40, doc="linear warm-up steps")
    weight_decay: float = bounded(0.0, 0.0, 10.0, doc="decoupled weight decay")
    grad_clip: float = bounded(1.0, 0.0, 1e6, doc="global gradient-norm clip (0: off)")
    seed: int = bounded(1234, 0, 2**63 - 1, doc="seed of initialisation and synthetic data")
    data: str = bounded("synthetic", doc="'synthetic' or a token file (python -m launcher.trainer.tokenize)")
    loss_chunk: int = bounded(1024, 1, 1 << 24, doc="tokens per chunk of the output-head loss")
    checkpoint_every: int = bounded(0, 0, 1 << 40, doc="steps between checkpoints (0: only on preemption)")
    compile: bool | None = bounded(None, doc="compile each transformer block with torch.compile (torchtitan's "
                                             "per-block compile): true, false, or unset to let the planner choose "
                                             "(compiled where allowed, it is faster); not with the zero-bubble or "
                                             "DualPipe-V schedules, a mixture of experts, full recompute under tp > 1 "
                                             "or ALiBi with recompute")
    entrypoint: EntrypointSpec | None = bounded(None, doc="your own training code (script or module, args) instead "
                                                          "of the bundled trainer, launched with the plan's ranks "
                                                          "and the plan in the environment (LAUNCH4D_*)")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def __post_init__(self) -> None:
        if self.tokens is not None:
            steps = -(-self.tokens // (self.global_batch * self.seq_len))
            if steps > MAX_STEPS:       # else plan -o writes a plan.json its own loader refuses
                raise SpecError("train.tokens", f"{self.tokens} tokens are {steps} steps of global_batch·seq_len = "
                                                f"{self.global_batch * self.seq_len}; at most {MAX_STEPS} steps")
            object.__setattr__(self, "steps", steps)


@dataclass(frozen=True)
class GpuSpec:
    memory_gb: float = bounded(lo=0.001, hi=1e5, doc="HBM per GPU, GB")
    peak_tflops: float = bounded(lo=0.001, hi=1e6, doc="dense peak TFLOP/s in the training precision")
    nvlink_gbs: float = bounded(lo=0.001, hi=1e6, doc="NVLink bandwidth per GPU, GB/s")
    network_gbs_per_gpu: float | None = bounded(None, 0.001, 1e6, doc="NIC bandwidth per GPU, GB/s one way")
    fp8_tflops: float | None = bounded(None, 0.001, 1e6, doc="dense FP8 tensor-core peak TFLOP/s (none: no FP8 "
                                                             "tensor cores, train.precision fp8 refused)")
    name: str = bounded("custom", doc="the preset this GPU came from")


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int = bounded(1, 1, 1 << 20, doc="nodes")
    gpus_per_node: int = bounded(8, 1, 1024, doc="GPUs per node")
    gpu: Any = bounded("h100-sxm", doc="a GPU preset name or a mapping of memory_gb, peak_tflops, nvlink_gbs")
    network_gbs_per_gpu: float | None = bounded(None, 0.001, 1e6, doc="overrides the GPU's network figure")
    bwmap: str | None = bounded(None, doc="a bandwidth map from `launch preflight`")
    profile: str | None = bounded(None, doc="a cluster profile from `launch calibrate`: fitted compute efficiency, "
                                            "bandwidth and latency replace the defaults")
    compute_efficiency: float | None = bounded(None, 0.01, 1.0, doc="ceiling of achieved/peak FLOPs (default: calibrated for "
                                                        "the bundled eager trainer); set it only from your own "
                                                        "measurements (launch plan --benchmark)")
    price_per_gpu_hour: float | None = bounded(None, 0.0, 1e6, doc="price of one GPU-hour, for the plan's cost")
    memory_headroom: float = bounded(0.1, 0.0, 0.9, doc="fraction of each GPU's memory no plan may use")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class ParallelSpec:
    """Fixed degrees and choices; None means 'search it'."""

    tp: int | None = bounded(None, 1, 1 << 20, doc="tensor-parallel degree")
    cp: int | None = bounded(None, 1, 1 << 20, doc="context-parallel degree")
    cp_attention: CpAttention | None = bounded(None, doc="how attention crosses the cp group: all-gather (keys and "
                                                         "values, Llama 3's) or all-to-all (DeepSpeed-Ulysses: "
                                                         "heads/tp and kv_heads/tp divisible by cp, or kv heads "
                                                         "dividing cp); searched when not given, all-gather at cp 1")
    pp: int | None = bounded(None, 1, 1 << 20, doc="pipeline stages")
    dp: int | None = bounded(None, 1, 1 << 20, doc="data-parallel degree")
    ep: int | None = bounded(None, 1, 1 << 20, doc="expert-parallel degree (splits dp·cp)")
    zero: ZeroStage | None = bounded(None, why_not=capabilities.ZERO_REFUSED, doc="ZeRO stage")
    dp_shard: int | None = bounded(None, 1, 1 << 20, doc="dp ranks ZeRO 1-3 shard over (with cp), replicated over "
                                                         "dp / dp_shard (hybrid sharding, HSDP); dp_shard = dp "
                                                         "shards over all; searched when not given")
    recompute: Recompute | None = bounded(None, doc="activation recomputation")
    micro_batch: int | None = bounded(None, 1, 1 << 30, doc="sequences per micro-batch")
    schedule: Schedule | None = bounded(None, doc="pipeline schedule (the zero-bubble and DualPipe-V ones split the "
                                                  "backward: zero 0-2, recompute none; dualpipe-v needs "
                                                  "grad_accum >= 2·pp)")
    virtual_stages: int | None = bounded(None, 1, 1024, doc="model chunks per pipeline rank (interleaved; exactly 2 "
                                                            "under zero-bubble-v and dualpipe-v)")
    mesh_order: list[str] = dataclasses.field(default_factory=lambda: list(MESH_DIMS),
                                              metadata={"doc": "rank order outer→inner"})
    allow_cross_node_tp: bool = bounded(False, doc="let a TP group span nodes")

    @property
    def fully_fixed(self) -> bool:
        return all(getattr(self, k) is not None for k in ("tp", "cp", "pp", "zero", "recompute", "micro_batch"))


@dataclass(frozen=True)
class JobSpec:
    name: str
    model: ModelSpec
    train: TrainSpec
    cluster: ClusterSpec
    gpu: GpuSpec
    parallel: ParallelSpec
    backend: BackendSpec
    diagnostics: DiagnosticsSpec
    source: str | None = None
    notes: tuple[str, ...] = ()     # what a HuggingFace config asked that the trainer does not reproduce

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = ("name", "model", "train", "cluster", "parallel", "backend", "diagnostics")


def _preset(kind: str, table: dict[str, dict], value: Any, path: str) -> dict:
    if isinstance(value, str):
        name = presets.canonical(kind, value)
        if name is None:
            names = [*table, *(presets.GPU_ALIASES if kind == "GPU" else ())]
            raise SpecError(path, f"unknown {kind} preset {show(value)}{did_you_mean(value.lower(), names)}; "
                                  f"presets: {', '.join(table)}"
                                  + (" (or a HuggingFace config.json path)" if kind == "model" else ""))
        return {**table[name], "name" if kind == "GPU" else "preset": name}
    if isinstance(value, dict):
        return value
    raise SpecError(path, f"{show(value)} is neither a {kind} preset name nor a mapping")


def is_config_path(value: Any) -> bool:
    """`model: path/to/config.json`: a HuggingFace config rather than a preset name."""
    return isinstance(value, str) and (value.endswith(".json") or "/" in value)


def resolve_model(value: Any, path: str = "model", base: str | Path | None = None) -> ModelSpec:
    return resolve_model_notes(value, path, base)[0]


def resolve_model_notes(value: Any, path: str = "model",
                        base: str | Path | None = None) -> tuple[ModelSpec, list[str]]:
    """A preset name, a HuggingFace config.json (relative to `base`, the job file's folder), or a mapping
    in ModelSpec's keys, HuggingFace's or both; with one note per HuggingFace key the trainer does not
    reproduce."""
    from launcher.plan import hf_config

    if is_config_path(value):
        where = Path(value) if base is None or Path(value).is_absolute() else Path(base) / value
        if not where.is_file():
            raise SpecError(path, f"{show(value)}: no HuggingFace config at {where} (a path relative to the job "
                                  "file's folder, or a preset name)")
        mapping, notes = hf_config.load_config(where, path)
        try:
            return load_dataclass(ModelSpec, mapping, path), notes
        except SpecError as exc:
            raise hf_config.in_file(exc, where) from None
    if isinstance(value, dict) and hf_config.is_hf_mapping(value):
        mapping, notes = hf_config.from_hf(value, strict=True)
        return load_dataclass(ModelSpec, mapping, path), notes
    return load_dataclass(ModelSpec, _preset("model", presets.MODELS, value, path), path), []


def resolve_gpu(value: Any, path: str = "cluster.gpu") -> GpuSpec:
    return load_dataclass(GpuSpec, _preset("GPU", presets.GPUS, value, path), path)


def _check_model(m: ModelSpec) -> None:
    bad = capabilities.model_problem(m)
    if bad:
        raise SpecError(f"model.{bad[0]}", bad[1])


def _check_parallel(p: ParallelSpec, m: ModelSpec, t: TrainSpec, c: ClusterSpec) -> None:
    """Reject fixed degrees that can never work, with the reason in the message."""
    world = c.world_size
    if sorted(p.mesh_order) != sorted(MESH_DIMS):
        raise SpecError("parallel.mesh_order", f"{show(p.mesh_order)} must order exactly {', '.join(MESH_DIMS)}")
    if p.tp is not None:
        why = capabilities.tp_problem(m, p.tp)
        if why:
            raise SpecError("parallel.tp", f"{p.tp} {why}")
        if p.zero is not None and m.experts > 1 and p.tp > 1 and p.zero not in capabilities.MOE_TP_ZERO:
            raise SpecError("parallel.zero", f"{p.zero} with a mixture-of-experts model under tp {p.tp}: the experts' "
                                             "TP-replicated gradients are summed by ZeRO 0/1's optimizer; choose 0 or 1")
        if c.gpus_per_node % p.tp and not p.allow_cross_node_tp:
            raise SpecError("parallel.tp", f"{p.tp} does not divide gpus_per_node={c.gpus_per_node} "
                                           "(set parallel.allow_cross_node_tp: true to force it)")
    for name in ("tp", "cp", "pp", "dp"):
        v = getattr(p, name)
        if v is not None and world % v:
            raise SpecError(f"parallel.{name}", f"{v} does not divide the world size {world}")
    if p.pp is not None and p.pp > m.layers:
        raise SpecError("parallel.pp", f"{p.pp} exceeds layers={m.layers}")
    if p.cp is not None:
        why = capabilities.cp_problem(t.seq_len, p.cp, p.tp or 1)
        if why:
            raise SpecError("parallel.cp", f"{p.cp} {why}")
    if p.cp_attention is not None and p.cp is not None and p.tp is not None:
        why = capabilities.cp_attention_problem(m, p.cp, p.tp, p.cp_attention)
        if why:
            raise SpecError("parallel.cp_attention", f"{p.cp_attention} with cp={p.cp}: {why}")
    if p.ep is not None and p.ep > 1:
        why = capabilities.ep_problem(m, p.ep, 1, p.ep)      # dp·cp is searched: only the model's side here
        if why:
            raise SpecError("parallel.ep", f"{p.ep} {why}")
    if p.dp_shard is not None:
        if world % p.dp_shard:
            raise SpecError("parallel.dp_shard", f"{p.dp_shard} does not divide the world size {world}")
        if p.dp is not None:     # what is searched stays open (cp 2, zero 1, ep 1 refuse nothing)
            why = capabilities.dp_shard_problem(p.dp_shard, p.dp, p.cp or 2, 1 if p.zero is None else p.zero,
                                                p.ep or 1)
            if why:
                raise SpecError("parallel.dp_shard", f"{p.dp_shard} {why.replace('dp=', 'parallel.dp=')}")
    fixed = [getattr(p, k) for k in ("tp", "cp", "pp", "dp")]
    if None not in fixed and fixed[0] * fixed[1] * fixed[2] * fixed[3] != world:
        raise SpecError("parallel", f"tp·cp·pp·dp = {fixed[0] * fixed[1] * fixed[2] * fixed[3]} "
                                    f"but the cluster has {world} GPUs")
    if p.virtual_stages is not None and p.schedule is not None and p.pp != 1:
        why = capabilities.virtual_stages_problem(p.schedule, p.pp or 2, p.virtual_stages)
        if why:
            raise SpecError("parallel.virtual_stages", f"{p.virtual_stages} {why}")
    if p.virtual_stages is not None and p.virtual_stages > 1:
        if p.pp == 1:
            raise SpecError("parallel.virtual_stages", f"{p.virtual_stages} > 1 needs pp > 1")
        why = capabilities.interleave_problem(m.layers, p.pp, p.virtual_stages) if p.pp is not None else None
        if why:
            raise SpecError("parallel.virtual_stages", why)
    if p.schedule in capabilities.V_SCHEDULES and p.pp is not None:
        why = capabilities.interleave_problem(m.layers, p.pp, 2)
        if why:
            raise SpecError("parallel.schedule", f"{p.schedule}: {why}")
    if p.schedule is not None and p.pp != 1:
        bad = capabilities.split_backward_problem(p.schedule, 2 if p.zero is None else p.zero,
                                                  p.recompute or "none", (p.dp or 2) * (p.cp or 1))
        if bad:
            raise SpecError(f"parallel.{bad[0]}", bad[1])
        why = capabilities.v_tied_problem(p.schedule, m.tied_embeddings)
        if why:
            raise SpecError("model.tied_embeddings", why)
    if t.compile:
        why = capabilities.compile_problem(m, p.schedule, p.tp, p.recompute)
        if why:
            raise SpecError("train.compile", f"true: {why}")
    if p.micro_batch is not None and t.global_batch % p.micro_batch:
        raise SpecError("parallel.micro_batch", f"{p.micro_batch} does not divide train.global_batch={t.global_batch}")
    _check_degrees(p, t, c)


def _check_degrees(p: ParallelSpec, t: TrainSpec, c: ClusterSpec) -> None:
    """The degrees given must multiply to a divisor of the GPU count, and where they fix dp the global
    batch must split over dp × micro_batch: a field and the numbers, not an empty search."""
    world = c.world_size
    where = f"{c.nodes} node{'s' if c.nodes > 1 else ''} × {c.gpus_per_node} GPUs"
    given: list[str] = []
    product = 1
    for name in ("tp", "cp", "pp", "dp"):
        v = getattr(p, name)
        if v is None:
            continue
        product *= v
        given.append(f"{name}={v}")
        if world % product:
            others = f" with {' '.join(given[:-1])}" if given[:-1] else ""
            raise SpecError(f"parallel.{name}", f"{v}{others} makes {product} GPUs, which does not divide the "
                                                f"world size {world} ({where})")
    dp = p.dp
    if dp is None and None not in (p.tp, p.cp, p.pp):
        dp = world // product
    if dp is None:
        return
    how = "parallel.dp" if p.dp is not None else f"dp = {world} GPUs / tp·cp·pp {product}"
    if t.global_batch % dp:
        raise SpecError("train.global_batch", f"{t.global_batch} is not divisible by dp={dp} ({how}); "
                                              f"make it a multiple of {dp}")
    mb = p.micro_batch
    if mb is not None and t.global_batch % (dp * mb):
        raise SpecError("train.global_batch", f"{t.global_batch} is not divisible by dp × micro_batch = {dp} × {mb} "
                                              f"= {dp * mb} ({how}); make it a multiple of {dp * mb} or change "
                                              "parallel.micro_batch")


def check_name(name: Any, derived_from: str | None = None) -> str:
    """A job name becomes a directory, a Slurm job name and a Kubernetes label: short, plain, no
    path separators."""
    if isinstance(name, str) and NAME.fullmatch(name) and ".." not in name:
        return name
    where = f" (taken from the file name {show(derived_from)}; set `name:` in the job file)" if derived_from else ""
    raise SpecError("name", f"{show(name)} is not a valid job name{where}: use 1-63 letters, digits, '.', '_' "
                            "or '-', starting with a letter or digit, without '..'")


def spec_from_dict(data: Any, source: str | None = None) -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError("", f"{source or 'job file'}: expected a mapping with sections {', '.join(SECTIONS)}")
    for key in data:
        if key not in SECTIONS:
            raise SpecError(key_name(key), f"unknown section{did_you_mean(str(key), SECTIONS)}; "
                                           f"sections: {', '.join(SECTIONS)}")
    for key in ("model", "train"):
        if key not in data:
            raise SpecError(key, "is required")
    if "name" in data:
        name = check_name(data["name"])
    else:
        name = check_name(Path(source).stem if source else "job", derived_from=Path(source).name if source else None)
    base = Path(source).parent if source else None
    model, notes = resolve_model_notes(data["model"], base=base)
    _check_model(model)
    if isinstance(data["train"], dict) and {"steps", "tokens"} <= set(data["train"]):
        raise SpecError("train.tokens", "give train.steps or train.tokens (a token budget), not both")
    train = load_dataclass(TrainSpec, data["train"], "train")
    cluster = load_dataclass(ClusterSpec, data.get("cluster"), "cluster")
    gpu = resolve_gpu(cluster.gpu)
    net = cluster.network_gbs_per_gpu or gpu.network_gbs_per_gpu or 25.0
    gpu = dataclasses.replace(gpu, network_gbs_per_gpu=net)
    why = capabilities.fp8_problem(gpu) if train.precision == "fp8" else None
    if why:
        raise SpecError("train.precision", f"fp8 {why}")
    raw_parallel = data.get("parallel", "auto")
    if raw_parallel == "auto" or raw_parallel is None:
        raw_parallel = {}
    elif not isinstance(raw_parallel, dict):
        raise SpecError("parallel", f"{show(raw_parallel)} is neither 'auto' nor a mapping")
    parallel = load_dataclass(ParallelSpec, raw_parallel, "parallel")
    _check_parallel(parallel, model, train, cluster)
    backend = load_dataclass(BackendSpec, data.get("backend"), "backend")
    diagnostics = load_dataclass(DiagnosticsSpec, data.get("diagnostics"), "diagnostics")
    return JobSpec(name=name, model=model, train=train, cluster=cluster, gpu=gpu, parallel=parallel,
                   backend=backend, diagnostics=diagnostics, source=source, notes=tuple(notes))


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a job file (YAML or JSON): bounded in size, nesting and alias expansion."""
    return load_spec_text(path)[0]


def load_spec_text(path: str | Path) -> tuple[JobSpec, str]:
    """The validated spec and the text it came from, read once (bounded, UTF-8), so a job file
    given as a pipe (`<(cat job.yaml)`) is the same text for validation and for the copy kept."""
    from launcher.formats.files import JOB_FILE_LIMIT, read_text

    text = read_text(path, "job file", JOB_FILE_LIMIT)
    return spec_from_text(text, str(path)), text


def spec_from_text(text: str, source: str) -> JobSpec:
    return spec_from_dict(parse_yaml(text, source), source=source)


def parse_yaml(text: str, name: str) -> Any:
    """The job file as YAML 1.2 (launcher.plan.yaml_core: `no`, `0777`, `1:00:00` stay what they
    say; a repeated key is refused), with a one-line error for bad YAML and for structures nested
    too deep."""
    import yaml

    from launcher.plan import yaml_core

    try:
        data = yaml_core.load(text)
    except yaml_core.DuplicateKeyError as exc:
        raise UserError(f"{name}: {exc.message}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"{name}:{where} is not valid YAML ({show(getattr(exc, 'problem', exc))})") from None
    except RecursionError:
        raise UserError(f"{name}: YAML nested too deeply to be a job file") from None
    if _depth(data) > MAX_DEPTH:
        raise UserError(f"{name}: YAML nested too deeply to be a job file (more than {MAX_DEPTH} levels)")
    return data


MAX_DEPTH = 32


def _depth(value: Any) -> int:
    """Nesting depth, cut off past MAX_DEPTH. YAML aliases make a DAG: each node is walked again
    only when reached at a shallower level, so an alias bomb costs no more than its text."""
    best: dict[int, int] = {}
    stack = [(value, 0)]
    deepest = 0
    while stack:
        v, level = stack.pop()
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            break
        if not isinstance(v, (dict, list)) or best.get(id(v), MAX_DEPTH + 1) <= level:
            continue
        best[id(v)] = level
        stack.extend((c, level + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def job_schema() -> dict[str, Any]:
    """JSON Schema of the job file, from the same dataclasses, type hints and bounds that load it.

    Value-level rules the schema cannot say (tp divides heads, degrees multiply to the world size,
    ...) are checked by `spec_from_dict` and named in its one-line errors."""
    defs: dict[str, Any] = {}
    section = {name: json_schema(cls, defs) for name, cls in
               (("train", TrainSpec), ("backend", BackendSpec), ("diagnostics", DiagnosticsSpec))}
    model = {"anyOf": [{"enum": list(presets.MODELS)},
                       {"type": "string", "pattern": r"(\.json$|/)", "description": "a HuggingFace config.json, "
                                                                                     "relative to the job file"},
                       json_schema(ModelSpec, defs)],
             "description": "a model preset name, a HuggingFace config.json or the decoder's shape"}
    gpu = {"anyOf": [{"enum": [*presets.GPUS, *presets.GPU_ALIASES]}, json_schema(GpuSpec, defs)],
           "description": "a GPU preset name or the GPU's figures", "default": "h100-sxm"}
    json_schema(ClusterSpec, defs)
    defs["ClusterSpec"]["properties"]["gpu"] = gpu
    parallel = {"anyOf": [{"const": "auto"}, {"type": "null"}, json_schema(ParallelSpec, defs)],
                "description": "'auto' (search everything) or the degrees and choices to fix", "default": "auto"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "launch4d job file",
        "type": "object", "additionalProperties": False, "required": ["model", "train"],
        "properties": {
            "name": {"type": "string", "pattern": "^" + NAME.pattern + "$", "not": {"pattern": "\\.\\."},
                     "description": "job name (default: the file's stem)"},
            "model": model, "train": section["train"], "cluster": {"$ref": "#/$defs/ClusterSpec"},
            "parallel": parallel, "backend": section["backend"], "diagnostics": section["diagnostics"]},
        "$defs": defs,
    }


def spec_to_json(spec: JobSpec) -> str:
    return json.dumps(spec.to_dict(), indent=2, sort_keys=True)
