"""What every tool parser shares: ParseError, the clean-up of a captured text (ANSI escapes, a
person's elision marks, a line cut mid-number) before a parser reads it, and `to_jsonable` for what
a parser returns.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class ParseError(ValueError):
    """Output a parser cannot use; `line_no` (1-based) and `line` say where."""

    def __init__(self, kind: str, message: str, line_no: int | None = None, line: str | None = None):
        self.kind = kind
        self.message = message
        self.line_no = line_no
        self.line = line
        where = f" line {line_no}" if line_no is not None else ""
        shown = f": {line[:120]!r}" if line is not None else ""
        super().__init__(f"{kind}:{where}: {message}{shown}")


def strip_ansi(text: str) -> str:
    return ANSI_RE.sub("", text)


#: A line a person put in a pasted capture for what they left out ("....", "…", "[...]", "<snip>"):
#: not the tool's. Parsers that note an elision (a fragment, a GPU's links cut) get it as "...";
#: the others never see it, and judge the rest (parser_for).
ELISION_RE = re.compile(r"[ \t]*(?:\.{3,}|…+|\[(?:\.{3}|…)\]|\((?:\.{3}|…)\)|<snip(?:ped)?>|\[snip(?:ped)?\]|"
                        r"(?:\.{3}|…) ?[(\[]?\d+ (?:more )?lines? (?:omitted|elided|skipped|removed)[)\]]?)[ \t]*",
                        re.I)


def drop_elisions(text: str, keep_mark: bool = False) -> str:
    if not ("..." in text or "…" in text or "snip" in text.lower()):
        return text
    out = []
    for line in text.splitlines(keepends=True):
        if ELISION_RE.fullmatch(line.rstrip("\r\n")):
            if keep_mark:
                out.append("...\n")
            continue
        out.append(line)
    return "".join(out)


def whole_lines(text: str) -> str:
    """The text up to its last line break: a capture cut mid-line ends in a line that may be cut
    mid-number ("98.38" -> "9"), a figure the tool never printed. A tool's output ends with a line
    break; text without one was cut."""
    if not text or text.endswith(("\n", "\r")):
        return text
    cut = max(text.rfind("\n"), text.rfind("\r"))
    return text[:cut + 1] if cut >= 0 else text


def to_jsonable(obj: Any) -> Any:
    """Dataclasses (and their `to_dict`) to plain JSON values."""
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    return obj
