"""Typed loading of YAML mappings into dataclasses, with errors that name the path.

One small mechanism serves every section of the job file: unknown keys get a did-you-mean,
wrong types and out-of-range values get one line naming the dotted path and what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from launcher.errors import SpecError

T = TypeVar("T")


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def convert(value: Any, tp: Any, path: str) -> Any:
    """Convert one YAML value to the annotated type, or raise SpecError naming `path`."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        concrete = [a for a in args if a is not type(None)]
        if len(concrete) == 1:
            return convert(value, concrete[0], path)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(value, arg, path)
            except SpecError as exc:
                errors.append(exc)
        raise SpecError(path, f"{value!r} is not {_type_name(tp)}")
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        hint = did_you_mean(str(value), [str(c) for c in choices]) if isinstance(value, str) else ""
        raise SpecError(path, f"{value!r} is not valid; choose {_type_name(tp)}{hint}")
    if origin is list:
        if not isinstance(value, list):
            raise SpecError(path, f"{value!r} is not {_type_name(tp)}")
        (item,) = get_args(tp)
        return [convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecError(path, f"{value!r} is not a mapping")
        _, vt = get_args(tp)
        return {str(k): convert(v, vt, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return load_dataclass(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise SpecError(path, f"{value!r} is not true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise SpecError(path, f"{value!r} is not an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, f"{value!r} is not a number")
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise SpecError(path, f"{value!r} is not a string")
        return str(value)
    if tp is Any:
        return value
    raise TypeError(f"unsupported annotation {tp!r} at {path}")


def load_dataclass(cls: type[T], data: Any, path: str) -> T:
    """Build dataclass `cls` from a mapping; field metadata may carry `min`/`max` bounds."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(path, f"expected a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            raise SpecError(where, f"unknown key{did_you_mean(str(key), fields)}; valid keys: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        where = f"{path}.{name}" if path else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SpecError(where, "is required")
            continue
        value = convert(data[name], hints[name], where)
        lo, hi = f.metadata.get("min"), f.metadata.get("max")
        if value is not None and lo is not None and value < lo:
            raise SpecError(where, f"{value} is below the minimum {lo}")
        if value is not None and hi is not None and value > hi:
            raise SpecError(where, f"{value} is above the maximum {hi}")
        kwargs[name] = value
    return cls(**kwargs)


def bounded(default: Any, lo: float | None = None, hi: float | None = None) -> Any:
    """A dataclass field with a default and bounds that `load_dataclass` enforces."""
    meta = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
    return dataclasses.field(default=default, metadata=meta)
