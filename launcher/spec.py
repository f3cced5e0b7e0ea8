"""JobSpec: the validated job file (model, train, cluster, parallel, backend, diagnostics).

`load_spec(path)` reads YAML with `yaml.safe_load`, resolves presets and checks every value;
any problem is a SpecError naming the dotted path and what would be valid.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from launcher import presets
from launcher.errors import SpecError, UserError
from launcher.schema import bounded, did_you_mean, load_dataclass
from launcher.spec_backend import BackendSpec, DiagnosticsSpec

Recompute = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class ModelSpec:
    """Decoder shape. `preset` names where it came from (or 'custom')."""

    layers: int = bounded(None, 1)
    hidden: int = bounded(None, 1)
    heads: int = bounded(None, 1)
    kv_heads: int | None = bounded(None, 1)
    ffn_hidden: int | None = bounded(None, 1)
    vocab: int = bounded(None, 1)
    mlp: Literal["gelu", "swiglu"] = "swiglu"
    tied_embeddings: bool = False
    experts: int = bounded(1, 1)
    experts_per_token: int = bounded(1, 1)
    preset: str = "custom"

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def is_moe(self) -> bool:
        return self.experts > 1


@dataclass(frozen=True)
class TrainSpec:
    seq_len: int = bounded(None, 1)
    global_batch: int = bounded(None, 1)
    steps: int = bounded(100, 1)
    tokens: int | None = bounded(None, 1)    # a token budget: steps = ceil(tokens / (global_batch·seq_len))
    optimizer: Literal["adam", "sgd", "adam8bit"] = "adam"
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    grad_dtype: Literal["bf16", "fp32"] = "bf16"
    lr: float = bounded(3e-4, 0.0)
    warmup_steps: int = bounded(0, 0)
    weight_decay: float = bounded(0.0, 0.0)
    grad_clip: float = bounded(1.0, 0.0)
    seed: int = bounded(1234, 0)
    data: str = "synthetic"
    loss_chunk: int = bounded(1024, 1)
    checkpoint_every: int = bounded(0, 0)

    def __post_init__(self) -> None:
        if self.tokens is not None:
            object.__setattr__(self, "steps", -(-self.tokens // (self.global_batch * self.seq_len)))


@dataclass(frozen=True)
class GpuSpec:
    memory_gb: float = bounded(None, 0.001)
    peak_tflops: float = bounded(None, 0.001)
    nvlink_gbs: float = bounded(None, 0.001)
    network_gbs_per_gpu: float | None = bounded(None, 0.001)
    name: str = "custom"


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int = bounded(1, 1)
    gpus_per_node: int = bounded(8, 1)
    gpu: Any = "h100-sxm"
    network_gbs_per_gpu: float | None = bounded(None, 0.001)
    bwmap: str | None = None
    compute_efficiency: float | None = bounded(None, 0.01, 1.0)
    price_per_gpu_hour: float | None = bounded(None, 0.0)    # for the plan's cost figure
    memory_headroom: float = bounded(0.1, 0.0, 0.9)   # fraction of HBM no plan may use

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class ParallelSpec:
    """Fixed degrees and choices; None means 'search it'."""

    tp: int | None = bounded(None, 1)
    cp: int | None = bounded(None, 1)
    pp: int | None = bounded(None, 1)
    dp: int | None = bounded(None, 1)
    ep: int | None = bounded(None, 1)
    zero: int | None = bounded(None, 0, 3)
    recompute: Recompute | None = None
    micro_batch: int | None = bounded(None, 1)
    schedule: Schedule | None = None
    virtual_stages: int | None = bounded(None, 1)
    mesh_order: list[str] = field(default_factory=lambda: list(MESH_DIMS))
    allow_cross_node_tp: bool = False

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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = ("name", "model", "train", "cluster", "parallel", "backend", "diagnostics")


def _preset(kind: str, table: dict[str, dict], value: Any, path: str) -> dict:
    if isinstance(value, str):
        if value not in table:
            raise SpecError(path, f"unknown {kind} preset {value!r}{did_you_mean(value, table)}; "
                                  f"presets: {', '.join(table)}")
        return {**table[value], "name" if kind == "GPU" else "preset": value}
    if isinstance(value, dict):
        return value
    raise SpecError(path, f"{value!r} is neither a {kind} preset name nor a mapping")


def resolve_model(value: Any, path: str = "model") -> ModelSpec:
    return load_dataclass(ModelSpec, _preset("model", presets.MODELS, value, path), path)


def resolve_gpu(value: Any, path: str = "cluster.gpu") -> GpuSpec:
    return load_dataclass(GpuSpec, _preset("GPU", presets.GPUS, value, path), path)


def _check_model(m: ModelSpec) -> None:
    if m.hidden % m.heads:
        raise SpecError("model.hidden", f"{m.hidden} is not divisible by heads={m.heads}")
    if m.heads % m.kv_heads:
        raise SpecError("model.kv_heads", f"{m.kv_heads} does not divide heads={m.heads}")
    if m.experts_per_token > m.experts:
        raise SpecError("model.experts_per_token", f"{m.experts_per_token} exceeds experts={m.experts}")


def _check_parallel(p: ParallelSpec, m: ModelSpec, t: TrainSpec, c: ClusterSpec) -> None:
    """Reject fixed degrees that can never work, with the reason in the message."""
    world = c.world_size
    if sorted(p.mesh_order) != sorted(MESH_DIMS):
        raise SpecError("parallel.mesh_order", f"{p.mesh_order} must order exactly {', '.join(MESH_DIMS)}")
    if p.tp is not None:
        if m.is_moe and p.tp > 1:
            raise SpecError("parallel.tp", f"{p.tp}: the bundled trainer runs mixture-of-experts layers without "
                                           "tensor parallelism; use tp: 1 with ep (expert parallelism) instead")
        if m.heads % p.tp:
            raise SpecError("parallel.tp", f"{p.tp} does not divide heads={m.heads}")
        if m.kv_heads % p.tp:
            raise SpecError("parallel.tp", f"{p.tp} does not divide kv_heads={m.kv_heads}")
        if c.gpus_per_node % p.tp and not p.allow_cross_node_tp:
            raise SpecError("parallel.tp", f"{p.tp} does not divide gpus_per_node={c.gpus_per_node} "
                                           "(set parallel.allow_cross_node_tp: true to force it)")
    for name in ("tp", "cp", "pp", "dp"):
        v = getattr(p, name)
        if v is not None and world % v:
            raise SpecError(f"parallel.{name}", f"{v} does not divide the world size {world}")
    if p.pp is not None and p.pp > m.layers:
        raise SpecError("parallel.pp", f"{p.pp} exceeds layers={m.layers}")
    if p.cp is not None and t.seq_len % (2 * p.cp * (p.tp or 1)):
        raise SpecError("parallel.cp", f"seq_len={t.seq_len} is not divisible by 2·cp·tp={2 * p.cp * (p.tp or 1)}")
    if p.ep is not None and p.ep > 1 and m.experts % p.ep:
        raise SpecError("parallel.ep", f"{p.ep} does not divide experts={m.experts}")
    fixed = [getattr(p, k) for k in ("tp", "cp", "pp", "dp")]
    if None not in fixed and fixed[0] * fixed[1] * fixed[2] * fixed[3] != world:
        raise SpecError("parallel", f"tp·cp·pp·dp = {fixed[0] * fixed[1] * fixed[2] * fixed[3]} "
                                    f"but the cluster has {world} GPUs")
    if p.virtual_stages is not None and p.virtual_stages > 1:
        if p.schedule not in (None, "interleaved-1f1b"):
            raise SpecError("parallel.virtual_stages", "virtual_stages > 1 needs schedule: interleaved-1f1b")
        if p.pp is not None and m.layers % (p.pp * p.virtual_stages):
            raise SpecError("parallel.virtual_stages",
                            f"layers={m.layers} is not divisible by pp·virtual_stages={p.pp * p.virtual_stages}")
    if p.micro_batch is not None and t.global_batch % p.micro_batch:
        raise SpecError("parallel.micro_batch", f"{p.micro_batch} does not divide train.global_batch={t.global_batch}")


def spec_from_dict(data: Any, source: str | None = None) -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError("", f"{source or 'job file'}: expected a mapping with sections {', '.join(SECTIONS)}")
    for key in data:
        if key not in SECTIONS:
            raise SpecError(str(key), f"unknown section{did_you_mean(str(key), SECTIONS)}; sections: {', '.join(SECTIONS)}")
    for key in ("model", "train"):
        if key not in data:
            raise SpecError(key, "is required")
    name = data.get("name", Path(source).stem if source else "job")
    if not isinstance(name, str) or not name:
        raise SpecError("name", f"{name!r} is not a non-empty string")
    model = resolve_model(data["model"])
    _check_model(model)
    if isinstance(data["train"], dict) and {"steps", "tokens"} <= set(data["train"]):
        raise SpecError("train.tokens", "give train.steps or train.tokens (a token budget), not both")
    train = load_dataclass(TrainSpec, data["train"], "train")
    cluster = load_dataclass(ClusterSpec, data.get("cluster"), "cluster")
    gpu = resolve_gpu(cluster.gpu)
    net = cluster.network_gbs_per_gpu or gpu.network_gbs_per_gpu or 25.0
    gpu = dataclasses.replace(gpu, network_gbs_per_gpu=net)
    raw_parallel = data.get("parallel", "auto")
    if raw_parallel == "auto" or raw_parallel is None:
        raw_parallel = {}
    elif not isinstance(raw_parallel, dict):
        raise SpecError("parallel", f"{raw_parallel!r} is neither 'auto' nor a mapping")
    parallel = load_dataclass(ParallelSpec, raw_parallel, "parallel")
    _check_parallel(parallel, model, train, cluster)
    backend = load_dataclass(BackendSpec, data.get("backend"), "backend")
    diagnostics = load_dataclass(DiagnosticsSpec, data.get("diagnostics"), "diagnostics")
    return JobSpec(name=name, model=model, train=train, cluster=cluster, gpu=gpu, parallel=parallel,
                   backend=backend, diagnostics=diagnostics, source=source)


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a job file (YAML or JSON)."""
    return load_spec_text(path)[0]


def load_spec_text(path: str | Path) -> tuple[JobSpec, str]:
    """The validated spec and the text it came from, read once (bounded, UTF-8), so a job file
    given as a pipe (`<(cat job.yaml)`) is the same text for validation and for the copy kept."""
    from launcher.formats.files import JOB_FILE_LIMIT, read_text

    text = read_text(path, "job file", JOB_FILE_LIMIT)
    return spec_from_text(text, str(path)), text


def spec_from_text(text: str, source: str) -> JobSpec:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"{source}:{where} is not valid YAML ({getattr(exc, 'problem', exc)})") from None
    except RecursionError:
        raise UserError(f"{source}: YAML nested too deeply to be a job file") from None
    return spec_from_dict(data, source=source)


def spec_to_json(spec: JobSpec) -> str:
    return json.dumps(spec.to_dict(), indent=2, sort_keys=True)
