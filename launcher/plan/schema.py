"""Typed loading of YAML mappings into dataclasses, with errors that name the path.

One small mechanism serves every section of the job file: unknown keys get a did-you-mean,
wrong types and out-of-range values get one line naming the dotted path and what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import reprlib
import types
import typing
from typing import Any, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints

from launcher.errors import SpecError
from launcher.plan.yaml_core import YamlFloat, YamlInt, source_text

T = TypeVar("T")

_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxdict, _SHOW.maxlist, _SHOW.maxstring, _SHOW.maxother = 2, 4, 4, 60, 60
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def show(value: Any) -> str:
    """A bounded repr for error messages: a YAML alias bomb or a huge string never floods a line."""
    return _SHOW.repr(value)


def key_name(key: Any) -> str:
    """A mapping key as it appears in a dotted path: plain when it is short printable text."""
    text = str(key)
    return text if len(text) <= 60 and not CONTROL.search(text) else show(key)


def check_text(value: str, path: str) -> str:
    """Free text never carries control characters (a newline in a name or an env key breaks the
    script it reaches)."""
    if CONTROL.search(value):
        raise SpecError(path, f"{show(value)} contains a control character (newline, tab, escape ...)")
    return value


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
    if tp in _SCALARS:          # the common case first: a plan.json holds a record per rank
        return _scalar(value, tp, path)
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
        raise SpecError(path, f"{show(value)} is not {_type_name(tp)}")
    if origin is Literal:
        choices = get_args(tp)
        for choice in choices:  # by type too: `zero: true` or `zero: 1.0` is not stage 1
            if value == choice and type(value) in (type(choice), _CORE_TYPES.get(type(choice))):
                return choice
        hint = did_you_mean(str(value), [str(c) for c in choices]) if isinstance(value, str) else ""
        if isinstance(value, str) and value in [str(c) for c in choices]:
            hint = " (a number, written without quotes)"
        raise SpecError(path, f"{show(value)} is not valid; choose {_type_name(tp)}{hint}")
    if origin is list:
        if not isinstance(value, list):
            raise SpecError(path, f"{show(value)} is not {_type_name(tp)}")
        (item,) = get_args(tp)
        return [convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecError(path, f"{show(value)} is not a mapping")
        _, vt = get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise SpecError(path, f"key {show(k)} is not a string")
            key = str(k)
            if CONTROL.search(key):
                check_text(key, f"{path}.{key_name(k)}")
            out[key] = convert(v, vt, f"{path}.{key}")
        return out
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return load_dataclass(tp, value, path)
    if tp is Any:
        return value
    raise TypeError(f"unsupported annotation {tp!r} at {path}")


_SCALARS = (bool, int, float, str)
#: numbers read from a job file carry the text they were written as (launcher.plan.yaml_core)
_CORE_TYPES: dict[type, type] = {int: YamlInt, float: YamlFloat}


def _scalar(value: Any, tp: type, path: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise SpecError(path, f"{show(value)} is not true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise SpecError(path, f"{show(value)} is not an integer")
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, f"{show(value)} is not a number")
        if not math.isfinite(value):
            raise SpecError(path, f"{value} is not a finite number")
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise SpecError(path, f"{show(value)} is not a string")
        written = source_text(value)
        if written is not None:     # `account: 0777` is "0777", `version: 1.10` is "1.10"
            return check_text(written, path)
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecError(path, f"{value} is not a string")
        return check_text(str(value), path)


def load_dataclass(cls: type[T], data: Any, path: str) -> T:
    """Build dataclass `cls` from a mapping; field metadata may carry `min`/`max` bounds."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(path, f"expected a mapping, got {show(data)}")
    hints, fields = _shape(cast(type, cls))
    for key in data:
        if key not in fields:
            where = f"{path}.{key_name(key)}" if path else key_name(key)
            raise SpecError(where, f"unknown key{did_you_mean(str(key), fields)}; valid keys: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        where = f"{path}.{name}" if path else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SpecError(where, f"is required: {_type_name(hints[name])}{_bounds_text(f)}")
            continue
        try:
            value = convert(data[name], hints[name], where)
        except SpecError:
            why = f.metadata.get("why_not", {}).get(data[name]) if _hashable(data[name]) else None
            if why:
                raise SpecError(where, f"{show(data[name])} {why}") from None
            raise
        lo, hi = f.metadata.get("min"), f.metadata.get("max")
        if value is not None and lo is not None and value < lo:
            raise SpecError(where, f"{value} is below the minimum {lo}")
        if value is not None and hi is not None and value > hi:
            raise SpecError(where, f"{value} is above the maximum {hi}")
        kwargs[name] = value
    return cls(**kwargs)


def _bounds_text(f: dataclasses.Field) -> str:
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if lo is not None and hi is not None:
        return f" from {lo} to {hi}"
    return f", at least {lo}" if lo is not None else ""


@functools.cache
def _shape(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """Type hints and init fields of a dataclass, resolved once (a plan holds a record per rank)."""
    return get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls) if f.init}


def _hashable(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) or value is None


def bounded(default: Any = dataclasses.MISSING, lo: float | None = None, hi: float | None = None,
            doc: str = "", why_not: dict | None = None) -> Any:
    """A dataclass field with bounds that `load_dataclass` enforces; no default means required.

    `doc` is the one-line description the JSON Schema and docs/job-file.md show; `why_not` maps a
    refused value to the reason (e.g. what the bundled trainer cannot run)."""
    meta: dict[str, Any] = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
    if doc:
        meta["doc"] = doc
    if why_not:
        meta["why_not"] = why_not
    return dataclasses.field(default=default, metadata=meta)


# --- JSON Schema, from the same type hints and bounds the loader enforces ----------------------

#: What a free-text value may hold: no control characters (check_text).
TEXT_PATTERN = r"^[^\u0000-\u001f\u007f]*$"


def json_schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema (2020-12) of annotation `tp`; dataclasses go into `defs` by class name."""
    origin = get_origin(tp)
    if origin is Literal:
        return {"enum": list(get_args(tp))}
    if origin in (Union, types.UnionType):
        alts = [json_schema(a, defs) for a in get_args(tp)]
        return alts[0] if len(alts) == 1 else {"anyOf": alts}
    if tp is type(None):
        return {"type": "null"}
    if origin is list:
        return {"type": "array", "items": json_schema(get_args(tp)[0], defs)}
    if origin is dict:
        return {"type": "object", "additionalProperties": json_schema(get_args(tp)[1], defs),
                "propertyNames": {"pattern": TEXT_PATTERN}}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        name = tp.__name__
        if name not in defs:
            defs[name] = {}                 # placeholder: recursion and shared sections
            defs[name] = dataclass_schema(tp, defs)
        return {"$ref": f"#/$defs/{name}"}
    simple = {int: {"type": "integer"}, float: {"type": "number"}, bool: {"type": "boolean"},
              str: {"type": "string", "pattern": TEXT_PATTERN}}
    if tp in simple:
        return dict(simple[tp])
    if tp is Any:
        return {}
    raise TypeError(f"unsupported annotation {tp!r}")


def field_schema(f: dataclasses.Field, tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    s = json_schema(tp, defs)
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if lo is not None or hi is not None:
        target = next((a for a in s.get("anyOf", [s]) if a.get("type") in ("integer", "number")), s)
        if lo is not None:
            target["minimum"] = lo
        if hi is not None:
            target["maximum"] = hi
    if f.metadata.get("doc"):
        s["description"] = f.metadata["doc"]
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
    if default is not dataclasses.MISSING and not dataclasses.is_dataclass(default):
        s["default"] = default
    return s


def dataclass_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    hints = get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    out: dict[str, Any] = {"type": "object", "additionalProperties": False,
                           "properties": {f.name: field_schema(f, hints[f.name], defs) for f in fields}}
    required = [f.name for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        out["required"] = required
    doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
    if doc and not doc.startswith(cls.__name__ + "("):
        out["description"] = doc
    return out
