"""The cluster profile: the time model's efficiency parameters as `launch calibrate` fitted them on
measured runs of one cluster, read by later plans through `cluster.profile` in the job file.

Why a file of its own (not the job file, not the BandwidthMap): the job file is the user's and
describes one job, the BandwidthMap is what preflight measured with nccl-tests; a profile is a fit
over many jobs' step times, with the evidence for it (per-run error before and after), and one
profile serves every job on that cluster and GPU type. A fitted figure replaces what the planner
would otherwise use (the stack's compute-efficiency ceiling, the advertised or BandwidthMap
bandwidth, the per-collective latency); a figure not fitted stays as it was.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from launcher.errors import UserError
from launcher.plan.costs import Bandwidth

KIND = "launch4d-cluster-profile"
VERSION = 1
#: The parameters a profile may carry: name -> (what it is, unit shown, lower bound, upper bound).
#: compute_efficiency may exceed 1: it scales the stack's size-efficiency curve against the GPU
#: preset's peak, and a device faster than its preset says (the `cpu` preset) needs more than 1; its floor
#: is as far below: gloo ranks sharing two loaded cores ran 500x slower than the `cpu` preset predicts, and a
#: floor of 1e-3 left a one-run profile 7 % off the run it was fitted to.
PARAMS: dict[str, tuple[str, str, float, float]] = {
    "compute_efficiency": ("compute-efficiency ceiling", "", 1e-5, 100.0),
    "latency_s": ("latency per collective ring step", "s", 1e-7, 1.0),
    "net_per_gpu_gbs": ("inter-node bandwidth per GPU", "GB/s", 1e-4, 1e5),
    "intra_gbs": ("intra-node bus bandwidth", "GB/s", 1e-4, 1e5),
}


@dataclass(frozen=True)
class ClusterProfile:
    gpu: dict[str, Any]                  # the GPU's figures the runs were planned with (GpuSpec)
    gpus_per_node: int
    params: dict[str, float]             # the fitted parameters only
    base: dict[str, float]               # every parameter as the runs were planned (before the fit)
    runs: list[dict[str, Any]] = field(default_factory=list)   # per run: layout, measured, before, after
    not_fitted: dict[str, str] = field(default_factory=dict)   # parameter -> why the runs could not fit it
    path: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("path")
        return {"kind": KIND, "version": VERSION, **d}

    def summary(self) -> str:
        """One line: what was fitted, from how many runs."""
        vals = ", ".join(f"{k} {fmt(k, v)}" for k, v in self.params.items())
        return f"{vals} (fitted on {len(self.runs)} measured run{'s' * (len(self.runs) != 1)})"

    def check(self, gpu: Any, gpus_per_node: int) -> None:
        """A profile holds for the cluster and GPU type it was fitted on, nothing else."""
        mine = (self.gpu.get("name"), self.gpu.get("peak_tflops"), self.gpus_per_node)
        theirs = (gpu.name, gpu.peak_tflops, gpus_per_node)
        if mine != theirs:
            raise UserError(f"cluster.profile: {self.path} was fitted on GPU {mine[0]!r} ({mine[1]} TFLOP/s) with "
                            f"{mine[2]} per node; this job has {theirs[0]!r} ({theirs[1]} TFLOP/s) with {theirs[2]} "
                            "per node: calibrate on this cluster (`launch calibrate RUN_DIR...`)")

    def bandwidth(self, bw: Bandwidth) -> Bandwidth:
        """`bw` with the fitted figures in place of the advertised or measured ones."""
        p = self.params
        if not any(k in p for k in ("intra_gbs", "net_per_gpu_gbs", "latency_s")):
            return bw
        return replace(bw, intra_gbs=p.get("intra_gbs", bw.intra_gbs),
                       net_per_gpu_gbs=p.get("net_per_gpu_gbs", bw.net_per_gpu_gbs),
                       latency_s=p.get("latency_s", bw.latency_s),
                       source=f"{bw.source}; calibrated in {self.path}: "
                              + ", ".join(f"{k} {fmt(k, p[k])}" for k in p if k != "compute_efficiency"))

    def save(self, path: str | Path) -> None:
        from launcher.formats.files import atomic_write

        atomic_write(path, json.dumps(self.to_dict(), indent=2) + "\n", "cluster profile")

    @classmethod
    def load(cls, path: str | Path) -> ClusterProfile:
        from launcher.formats.files import read_text

        where = f"cluster.profile: {path}"
        try:
            data = json.loads(read_text(path, "cluster profile"))
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not JSON (line {exc.lineno}: {exc.msg})") from None
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise UserError(f"{where}: not a cluster profile (write one with `launch calibrate RUN_DIR...`)")
        if data.get("version") != VERSION:
            raise UserError(f"{where}: version {data.get('version')!r} is not supported (expected {VERSION})")
        params = data.get("params")
        if not isinstance(params, dict) or not params:
            raise UserError(f"{where}: params must be a non-empty mapping of {', '.join(PARAMS)}")
        for k, v in params.items():
            if k not in PARAMS:
                raise UserError(f"{where}: params.{k} is not a profile parameter ({', '.join(PARAMS)})")
            lo, hi = PARAMS[k][2:]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                raise UserError(f"{where}: params.{k} must be a number in [{lo:g}, {hi:g}], not {v!r}")
        gpu, gpn = data.get("gpu"), data.get("gpus_per_node")
        if not isinstance(gpu, dict) or not isinstance(gpn, int) or isinstance(gpn, bool) or gpn < 1:
            raise UserError(f"{where}: gpu (a mapping) and gpus_per_node (a positive integer) are required")
        runs = data["runs"] if isinstance(data.get("runs"), list) else []
        base = data["base"] if isinstance(data.get("base"), dict) else {}
        return cls(gpu=gpu, gpus_per_node=gpn, params={k: float(v) for k, v in params.items()}, base=base,
                   runs=runs, path=str(path))


def fmt(name: str, value: float) -> str:
    """A parameter as people read it: 0.42, 150 µs, 12.5 GB/s."""
    if name == "latency_s":
        return f"{value * 1e6:.3g} µs"
    unit = PARAMS[name][1]
    return f"{value:.3g}" + (f" {unit}" if unit else "")
