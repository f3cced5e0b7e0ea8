"""What the judges hold figures to: per-GPU-model bandwidth thresholds, outlier fractions, margins.

Bandwidth thresholds default per GPU model to the figures Azure's health checks publish for a
single-node all_reduce (../shared/notes/preflight.md §3, §9): H100 460 GB/s, H200 431, A100 228. There is no
published figure for a two-node all-GPU all_reduce, so inter-node pairs are judged against the
cluster itself (outliers below the median) unless the user sets one. Everything is configurable
from a YAML/JSON file (`JudgeConfig.load`) or flags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelThresholds:
    intra_busbw_gbs: float | None = None
    inter_busbw_gbs: float | None = None
    source: str = ""


DEFAULT_THRESHOLDS: dict[str, ModelThresholds] = {
    "H100": ModelThresholds(460.0, None, "Azure ND H100 v5 check_nccl_allreduce 460 GB/s"),
    "H200": ModelThresholds(431.0, None, "Azure ND H200 v5 check_nccl_allreduce 431 GB/s"),
    "A100": ModelThresholds(228.0, None, "Azure ND A100 v4 check_nccl_allreduce 228 GB/s"),
}


class JudgeConfigError(ValueError):
    """A thresholds file or value that cannot be used; the message names it."""


@dataclass
class JudgeConfig:
    expected_gpus: int | None = None
    thresholds: dict[str, ModelThresholds] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    min_intra_busbw_gbs: float | None = None  # overrides the per-model figure for every model
    min_inter_busbw_gbs: float | None = None
    min_all_busbw_gbs: float | None = None
    outlier_fail: float = 0.75  # below this fraction of the median: fail
    outlier_warn: float = 0.9  # below this fraction: warn
    warn_margin: float = 0.0  # within this fraction above a threshold: warn (Azure uses 0.05 for nvbandwidth)
    ecc_corrected_warn: int = 10000
    ib_rate_gbps: float | None = None  # expected port rate; default: the best seen for that HCA

    def for_model(self, model: str | None) -> ModelThresholds:
        base = ModelThresholds()
        if model:
            for key, t in self.thresholds.items():
                if key.lower() in model.lower():
                    base = t
                    break
        if self.min_intra_busbw_gbs is not None:
            base = replace(base, intra_busbw_gbs=self.min_intra_busbw_gbs, source="--min-intra-busbw")
        if self.min_inter_busbw_gbs is not None:
            base = replace(base, inter_busbw_gbs=self.min_inter_busbw_gbs)
        return base

    @classmethod
    def load(cls, path: str | Path) -> JudgeConfig:
        """YAML or JSON: {expected_gpus, outlier_fail, ..., models: {H100: {intra_busbw_gbs: 460}}}."""
        import yaml

        from launcher.errors import UserError
        from launcher.formats.files import JOB_FILE_LIMIT, read_text

        p = Path(path)
        try:
            text = read_text(p, "thresholds file", JOB_FILE_LIMIT)
            data = yaml.safe_load(text) if p.suffix in (".yaml", ".yml") else json.loads(text)
        except UserError as exc:
            raise JudgeConfigError(str(exc)) from None
        except (yaml.YAMLError, json.JSONDecodeError) as exc:
            raise JudgeConfigError(f"{p}: not valid YAML/JSON ({exc})") from None
        except RecursionError:
            raise JudgeConfigError(f"{p}: nested too deeply") from None
        return cls.from_dict(data or {}, where=str(p))

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "thresholds") -> JudgeConfig:
        if not isinstance(data, dict):
            raise JudgeConfigError(f"{where}: expected a mapping")
        cfg = cls()
        models = data.pop("models", {}) or {}
        scalars = {f for f in cls.__dataclass_fields__ if f != "thresholds"}
        for k, v in data.items():
            if k not in scalars:
                raise JudgeConfigError(f"{where}: unknown key {k!r} (valid: models, {', '.join(sorted(scalars))})")
            if v is not None and not isinstance(v, int | float):
                raise JudgeConfigError(f"{where}: {k} must be a number")
            setattr(cfg, k, v)
        if not isinstance(models, dict):
            raise JudgeConfigError(f"{where}: models must map a GPU model name to thresholds")
        for name, t in models.items():
            if not isinstance(t, dict) or set(t) - {"intra_busbw_gbs", "inter_busbw_gbs"}:
                raise JudgeConfigError(f"{where}: models.{name}: valid keys are intra_busbw_gbs, inter_busbw_gbs")
            mine = {str(name): ModelThresholds(t.get("intra_busbw_gbs"), t.get("inter_busbw_gbs"),
                                               f"{where} models.{name}")}
            cfg.thresholds = {**mine, **{k: v for k, v in cfg.thresholds.items() if k != str(name)}}  # first match wins
        return cfg

