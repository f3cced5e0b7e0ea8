"""Validate a manifest against a CustomResourceDefinition: its OpenAPI v3 schema with jsonschema,
and the CEL rules (`x-kubernetes-validations`) on the fields the manifest sets, by our own code.

No API server runs where launch4d is tested, so this is how a rendered TrainJob, TrainingRuntime
or PyTorchJob is proven to be accepted. A field the schema does not know (which the API server
would silently drop) is an error too. A CEL rule we have no translation for, on a field the
manifest sets, is reported (never silently passed); transition rules (`oldSelf`) only apply to
updates and are skipped for a create.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://.+$")


def _name(self: Any) -> bool:
    return bool(_DNS1035.match(str((self.get("metadata") or {}).get("name", ""))))


#: CEL rule text (verbatim from the Trainer v2.3.0 CRDs) -> the same predicate in Python.
CEL_RULES: dict[str, Callable[[Any], bool]] = {
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')": _name,
    "size(self.metadata.name) <= 63": lambda s: len(str((s.get("metadata") or {}).get("name", ""))) <= 63,
    "self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']":
        lambda s: s in ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue"),
    "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')": lambda s: s == "" or bool(_URI.match(s)),
    "[has(self.torch), has(self.mpi), has(self.jax), has(self.xgboost),has(self.flux)].filter(x, x).size() <= 1":
        lambda s: sum(k in s for k in ("torch", "mpi", "jax", "xgboost", "flux")) <= 1,
    "self >= 1": lambda s: s >= 1,
    "!self.exists(c, c == 'node')": lambda s: "node" not in s,
    "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' && "
    "self.replicatedJobs.exists(x, has(x.dependsOn)))":
        lambda s: not ((s.get("startupPolicy") or {}).get("startupPolicyOrder") == "InOrder"
                       and any("dependsOn" in r for r in s.get("replicatedJobs") or [])),
    "self.templates.all(t, !has(t.metadata.namespace) || size(t.metadata.namespace) == 0)":
        lambda s: all(not ((t.get("metadata") or {}).get("namespace")) for t in s.get("templates") or []),
    "has(self.lastUpdatedTime)": lambda s: "lastUpdatedTime" in s,
}


def load_crd(path: str | Path) -> dict:
    """The CRD document of a file that may begin with a licence comment and `---`."""
    import yaml

    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    (crd,) = [d for d in docs if d.get("kind") == "CustomResourceDefinition"]
    return crd


def crd_schema(crd: dict) -> dict:
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def _cel(schema: dict, value: Any, path: str, out: list[str]) -> None:
    for rule in schema.get("x-kubernetes-validations") or []:
        text = rule["rule"]
        if "oldSelf" in text:
            continue
        check = CEL_RULES.get(text)
        if check is None:
            out.append(f"{path or '/'}: CEL rule not checked: {text}")
        elif not check(value):
            out.append(f"{path or '/'}: {rule.get('message', text)}")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            child = props.get(key, extra if isinstance(extra, dict) else None)
            if child is None and props and not schema.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{path}/{key}: unknown field (the API server drops it)")
            elif child:
                _cel(child, sub, f"{path}/{key}", out)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, sub in enumerate(value):
            _cel(schema["items"], sub, f"{path}[{i}]", out)


def validate(obj: dict, crd: dict) -> list[str]:
    """Every reason the API server would refuse `obj` on create (schema and CEL); empty: valid."""
    import jsonschema

    names = crd["spec"]["names"]
    errors = []
    want = f"{crd['spec']['group']}/{crd['spec']['versions'][0]['name']}"
    if obj.get("apiVersion") != want or obj.get("kind") != names["kind"]:
        errors.append(f"/: apiVersion/kind {obj.get('apiVersion')}/{obj.get('kind')}; expected {want}/{names['kind']}")
    schema = crd_schema(crd)
    for e in sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.absolute_path)):
        errors.append("/" + "/".join(str(p) for p in e.absolute_path) + f": {e.message}")
    _cel(schema, obj, "", errors)
    return errors
