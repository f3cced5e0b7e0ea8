"""The reference part of docs/job-file.md, generated from the job file's JSON Schema.

Why generated: the tables then cannot drift from what the loader accepts (a test compares them).
Regenerate with `python -m launcher.plan.schema_doc` after changing a job-file dataclass.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BEGIN = "<!-- BEGIN generated reference: python -m launcher.plan.schema_doc -->"
END = "<!-- END generated reference -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "job-file.md"

#: (title, path to the section's schema in the job schema's $defs)
SECTIONS = [("model", "ModelSpec"), ("train", "TrainSpec"), ("train.entrypoint", "EntrypointSpec"),
            ("cluster", "ClusterSpec"), ("cluster.gpu (a mapping)", "GpuSpec"), ("parallel", "ParallelSpec"),
            ("backend", "BackendSpec"), ("backend.slurm", "SlurmSpec"), ("backend.slurm.node_check", "NodeCheckSpec"),
            ("backend.k8s", "K8sSpec"), ("backend.k8s.topology", "K8sTopologySpec"),
            ("diagnostics", "DiagnosticsSpec")]


def _code(v: Any) -> str:
    return f"`{json.dumps(v)}`" if not isinstance(v, str) else f"`{v}`"


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


def type_text(s: dict[str, Any]) -> str:
    """A schema fragment as a short phrase for a table cell."""
    if "enum" in s:
        return " \\| ".join(_code(v) for v in s["enum"])
    if "const" in s:
        return _code(s["const"])
    if "anyOf" in s:
        alts = [a for a in s["anyOf"] if a.get("type") != "null"]
        return " or ".join(type_text(a) for a in alts)
    if "$ref" in s:
        return f"mapping ({s['$ref'].rsplit('/', 1)[-1]})"
    t = s.get("type")
    if t == "array":
        return f"list of {type_text(s['items'])}"
    if t == "object":
        return f"mapping of text to {type_text(s.get('additionalProperties') or {}) or 'anything'}"
    if t in ("integer", "number"):
        word = "integer" if t == "integer" else "number"
        lo, hi = s.get("minimum"), s.get("maximum")
        if lo is not None and hi is not None:
            return f"{word} {_num(lo)} … {_num(hi)}"
        if lo is not None:
            return f"{word} ≥ {_num(lo)}"
        return word
    return {"string": "text", "boolean": "true \\| false"}.get(str(t), "any")


def table(defn: dict[str, Any]) -> list[str]:
    required = set(defn.get("required", []))
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, s in defn["properties"].items():
        if key in required:
            default = "**required**"
        elif "default" in s and s["default"] is not None and s["default"] != [] and s["default"] != {}:
            default = _code(s["default"])
        else:
            default = "—"
        meaning = s.get("description", "").replace("|", "\\|")      # a bare | would end the cell
        rows.append(f"| `{key}` | {type_text(s)} | {default} | {meaning} |")
    return rows


def render_reference(schema: dict[str, Any] | None = None) -> str:
    from launcher.plan import capabilities
    from launcher.plan.spec import job_schema

    schema = schema or job_schema()
    defs = schema["$defs"]
    out = [BEGIN, "", "## Reference (generated)", "",
           "Every key the loader accepts, its type and bounds, as `launch schema job --json` exports them.",
           "Floating-point values must be finite; text must not contain control characters.", ""]
    name = schema["properties"]["name"]
    out += ["### `name`", "", f"Text matching `{name['pattern']}` (no `..`): {name['description']}.", ""]
    for title, ref in SECTIONS:
        out += [f"### `{title}`", ""]
        desc = defs[ref].get("description")
        if desc:
            out += [desc, ""]
        out += table(defs[ref]) + [""]
    t = capabilities.table()
    out += ["### What the bundled trainer runs", "",
            "The job file accepts, and the planner proposes, only these (`launcher/plan/capabilities.py`):", "",
            "| capability | values |", "|---|---|"]
    out += [f"| {k.replace('_', ' ')} | {', '.join(map(str, v)) if isinstance(v, list) else v} |" for k, v in t.items()]
    out += ["", END]
    return "\n".join(out)


def updated(text: str, reference: str) -> str:
    """`text` with its generated part replaced (appended when the markers are missing)."""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        return head + reference + rest.split(END, 1)[1]
    return text.rstrip("\n") + "\n\n" + reference + "\n"


def main() -> int:
    text = DOC.read_text()
    new = updated(text, render_reference())
    if new != text:
        DOC.write_text(new)
        print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
