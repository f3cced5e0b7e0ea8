"""Job files read as YAML 1.2 (core schema), not PyYAML's YAML 1.1.

PyYAML's SafeLoader resolves plain scalars the YAML 1.1 way: `1:00:00` is 3600 (sexagesimal),
`no`/`off`/`yes` are booleans, `0777` is 511 (octal), `1_000` is 1000, `2024-01-01` a date. A job
file meant none of those. `CoreLoader` resolves plain scalars as the YAML 1.2 core schema does:

- null: `~`, `null`, `Null`, `NULL`, empty;  bool: `true`/`True`/`TRUE`, `false`/`False`/`FALSE`
- int: `[-+]?[0-9]+` (decimal, leading zeros included), `0o[0-7]+`, `0x[0-9a-fA-F]+`
- float: `[-+]?(\\.[0-9]+|[0-9]+(\\.[0-9]*)?)([eE][-+]?[0-9]+)?`, `[-+]?.inf`, `.nan`
- everything else is a string.

Numbers remember the text they were written as (`yaml_text`), so a string field given `0777` or
`1.10` keeps what the user wrote instead of `777` or `1.1`. A mapping that repeats a key is refused
(PyYAML keeps the last one silently): one line naming the key and both lines.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError

NULL = re.compile(r"~|null|Null|NULL|")
BOOL = re.compile(r"true|True|TRUE|false|False|FALSE")
INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
FLOAT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)")


class YamlInt(int):
    """An int from the job file, with the text it was written as."""

    yaml_text: str


class YamlFloat(float):
    """A float from the job file, with the text it was written as."""

    yaml_text: str


class DuplicateKeyError(ConstructorError):
    """A mapping names one key twice; `message` says which key and on which lines."""

    def __init__(self, message: str, mark: Any):
        super().__init__(None, None, message, mark)
        self.message = message


def source_text(value: Any) -> str | None:
    """The text a number was written as in a job file, if it came from one."""
    return getattr(value, "yaml_text", None)


class CoreLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema implicit resolvers and duplicate keys refused."""

    yaml_implicit_resolvers: dict = {}

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue            # an unhashable key: the base class says so
                if first is not None:
                    raise DuplicateKeyError(
                        f"duplicate key {str(key)[:60]!r} (line {first.start_mark.line + 1} and again on line "
                        f"{key_node.start_mark.line + 1}); give each key once", key_node.start_mark)
                seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _construct_null(loader: CoreLoader, node: yaml.ScalarNode) -> None:
    return None


def _construct_bool(loader: CoreLoader, node: yaml.ScalarNode) -> bool:
    text = loader.construct_scalar(node)
    if not BOOL.fullmatch(text):
        raise ConstructorError(None, None, f"{text[:60]!r} is not a YAML 1.2 boolean (true or false)", node.start_mark)
    return text.lower() == "true"


def _construct_int(loader: CoreLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if not INT.fullmatch(text):
        raise ConstructorError(None, None, f"{text[:60]!r} is not a YAML 1.2 integer", node.start_mark)
    base = 16 if text.startswith("0x") else 8 if text.startswith("0o") else 10
    out = YamlInt(int(text[2:] if base != 10 else text, base))
    out.yaml_text = text
    return out


def _construct_float(loader: CoreLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node)
    if not FLOAT.fullmatch(text):
        raise ConstructorError(None, None, f"{text[:60]!r} is not a YAML 1.2 number", node.start_mark)
    out = YamlFloat(float(text.replace(".", "", 1) if "inf" in text.lower() or "nan" in text.lower() else text))
    out.yaml_text = text
    return out


for _tag, _regexp, _first in (
        ("null", NULL, ["~", "n", "N", ""]),
        ("bool", BOOL, list("tTfF")),
        ("int", INT, list("-+0123456789")),
        ("float", FLOAT, list("-+.0123456789"))):
    CoreLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(f"^(?:{_regexp.pattern})$"), _first)
CoreLoader.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"])
CoreLoader.add_constructor("tag:yaml.org,2002:null", _construct_null)
CoreLoader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
CoreLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
CoreLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def load(text: str) -> Any:
    """One YAML document, read with the YAML 1.2 core schema (CoreLoader)."""
    return yaml.load(text, Loader=CoreLoader)  # noqa: S506 - CoreLoader is a SafeLoader
