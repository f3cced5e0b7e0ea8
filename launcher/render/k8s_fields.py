"""backend.k8s values checked as the API server (and the kubelet, for the image) would check them,
before anything is rendered: one UserError naming the field and what is valid.

The rules are Kubernetes' own (k8s.io/apimachinery/pkg/util/validation, api/resource's quantity
grammar, core/v1 Toleration validation, the distribution reference grammar for images).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from launcher.errors import UserError

if TYPE_CHECKING:
    from launcher.plan.spec_backend import K8sSpec

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
QUALIFIED_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
#: resource.Quantity: a non-negative decimal, then a binary SI, decimal SI or exponent suffix.
QUANTITY = re.compile(r"\+?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][-+]?\d+)?")
# The distribution reference grammar (docker/distribution reference/regexp.go), as the kubelet parses it.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]))*" \
          r"(?::[0-9]+)?"
IMAGE = re.compile(rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?"
                   r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")
TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _fail(path: str, value: Any, what: str) -> UserError:
    text = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return UserError(f"{path}: {text} is not {what}")


def subdomain(value: str, path: str, what: str = "a Kubernetes name") -> str:
    if len(value) > 253 or not DNS_SUBDOMAIN.fullmatch(value):
        raise _fail(path, value, f"{what} (RFC 1123 subdomain: lowercase letters, digits, '-' and '.', "
                                 "starting and ending with a letter or digit, at most 253 characters)")
    return value


def qualified_name(value: str, path: str, what: str = "a label key") -> str:
    """[prefix/]name: an optional DNS subdomain prefix, a name of at most 63 characters."""
    prefix, _, name = value.rpartition("/")
    if (prefix and (len(prefix) > 253 or not DNS_SUBDOMAIN.fullmatch(prefix))) \
            or len(name) > 63 or not QUALIFIED_NAME_PART.fullmatch(name):
        raise _fail(path, value, f"{what} ([prefix/]name: a name of at most 63 letters, digits, '-', '_' or '.', "
                                 "starting and ending with a letter or digit; a prefix is a DNS subdomain)")
    return value


def label_value(value: str, path: str) -> str:
    if len(value) > 63 or not LABEL_VALUE.fullmatch(value):
        raise _fail(path, value, "a label value (at most 63 letters, digits, '-', '_' or '.', starting and "
                                 "ending with a letter or digit, no spaces)")
    return value


def quantity(value: str, path: str) -> str:
    if not QUANTITY.fullmatch(value):
        raise _fail(path, value, "a Kubernetes quantity (a number >= 0 with an optional suffix: 500m, 2, "
                                 "16Gi, 64G, 1e9)")
    return value


def image(value: str, path: str) -> str:
    if len(value) > 4096 or not IMAGE.fullmatch(value):
        raise _fail(path, value, "an image reference ([registry[:port]/]repository[:tag][@digest]; the repository "
                                 "in lowercase, no spaces)")
    return value


def tolerations(items: list[dict[str, str]], path: str) -> list[dict[str, Any]]:
    """The tolerations as the pod spec takes them (tolerationSeconds an integer), each checked as the
    API server does: operator Exists or Equal, Exists with no value, a key that is a label key,
    an effect Kubernetes knows, tolerationSeconds only with NoExecute."""
    out = []
    for i, t in enumerate(items):
        where = f"{path}[{i}]"
        for key in t:
            if key not in TOLERATION_KEYS:
                raise UserError(f"{where}.{key}: unknown key; a toleration has {', '.join(TOLERATION_KEYS)}")
        op = t.get("operator", "Equal")
        if op not in ("Exists", "Equal"):
            raise _fail(f"{where}.operator", op, "a toleration operator (Exists or Equal)")
        key = t.get("key", "")
        if key:
            qualified_name(key, f"{where}.key", "a taint key")
        elif op != "Exists":
            raise UserError(f"{where}.key: required unless operator is Exists")
        if op == "Exists" and t.get("value"):
            raise UserError(f"{where}.value: must be empty when operator is Exists")
        if t.get("value"):
            label_value(t["value"], f"{where}.value")
        effect = t.get("effect", "")
        if effect and effect not in EFFECTS:
            raise _fail(f"{where}.effect", effect, f"a taint effect ({', '.join(EFFECTS)}, or empty for all)")
        tol: dict[str, Any] = dict(t)
        if "tolerationSeconds" in t:
            seconds = str(t["tolerationSeconds"])
            if not re.fullmatch(r"-?\d{1,18}", seconds):
                raise _fail(f"{where}.tolerationSeconds", seconds, "a whole number of seconds")
            if effect != "NoExecute":
                raise UserError(f"{where}.tolerationSeconds: only with effect NoExecute")
            tol["tolerationSeconds"] = int(seconds)
        out.append(tol)
    return out


def check_k8s_fields(k: K8sSpec) -> list[dict[str, Any]]:
    """Every backend.k8s value bound for the manifest; returns the tolerations as the pod spec takes them."""
    p = "backend.k8s"
    if k.image is not None:
        image(k.image, f"{p}.image")
    for fld in ("priority_class", "scheduler_name", "service_account", "pvc"):
        value = getattr(k, fld)
        if value is not None:
            subdomain(value, f"{p}.{fld}")
    if k.queue is not None:
        label_value(k.queue, f"{p}.queue")
        if not k.queue:
            raise UserError(f"{p}.queue: empty; name a Kueue LocalQueue or leave it out")
    if k.rdma_resource is not None:
        qualified_name(k.rdma_resource, f"{p}.rdma_resource", "an extended resource name (vendor.com/name)")
    for fld in ("cpu", "memory", "shm_size"):
        value = getattr(k, fld)
        if value is not None:
            quantity(value, f"{p}.{fld}")
    for key, value in k.node_selector.items():
        qualified_name(key, f"{p}.node_selector.{key}")
        label_value(value, f"{p}.node_selector.{key}")
    for kind in ("required", "preferred"):
        level = getattr(k.topology, kind)
        if level is not None:
            qualified_name(level, f"{p}.topology.{kind}", "a node label key")
    return tolerations(k.tolerations, f"{p}.tolerations")
