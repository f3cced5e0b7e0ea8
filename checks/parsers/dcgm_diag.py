"""`dcgmi diag -r N` text tables (DCGM 2.x/3.x and 4.x layouts): each test's result per GPU.

Every row is `| name (25) | result (46) |`; a row whose name cell is empty continues the row
above. DCGM wraps long messages at a fixed width, cutting words (`desire` / `d power`), so a
message is the exact concatenation of its slices. Category separators (`|-----  Deployment  ---`)
and borders are skipped; `Successfully ran diagnostic ...` and a second copy of the table
(printed twice by some wrappers) are ignored. Result cells:

- 3.x: `Pass - All`, `Fail - GPU: 1`, `Pass - GPUs: 0, 2, 3` (one line per status), or plain
  `Pass` for Deployment checks that are not per GPU;
- 4.x: the overall `Pass` / `Fail` / `Skip`, then `GPU0: Pass` lines;
- `Warning` / `Info` / `Error` rows attach a message to the test above (or to the category).
Fragments (no header, a last row without its closing pipe, a `...` elision) parse as far as they go.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from checks.parsers.base import ParseError, strip_ansi

KIND = "dcgm-diag"
STATUSES = {"pass": "pass", "fail": "fail", "skip": "skip", "warn": "warn", "warning": "warn"}
CAT_RE = re.compile(r"^[|+]-+\s+([A-Za-z][A-Za-z ]*?)\s+-+[+|]")
GPU_LIST_RE = re.compile(r"^(Pass|Fail|Skip|Warn)\s*-\s*(?:(All)|GPUs?:\s*([\d,\s]+))\s*$", re.I)
GPU_V4_RE = re.compile(r"^GPU\s*(\d+):\s*(Pass|Fail|Skip|Warn)\s*$", re.I)
GPU_IN_MSG_RE = re.compile(r"^GPU\s*(\d+)(?!\d)")
NOTE_ROWS = ("warning", "info", "error")
META = {"dcgm version": "version", "driver version detected": "driver", "gpu device ids detected": "device_ids"}


@dataclass
class DcgmMessage:
    level: str  # warning | info | error
    text: str
    gpu: int | None = None  # the GPU the message names ("GPU 3 has ...")


@dataclass
class DcgmTest:
    category: str
    name: str
    result: str | None = None  # pass | fail | skip | warn (overall)
    gpus: dict[int, str] = field(default_factory=dict)
    all_gpus: str | None = None  # the status given as `- All`
    messages: list[DcgmMessage] = field(default_factory=list)

    def status_of(self, gpu: int) -> str | None:
        return self.gpus.get(gpu, self.all_gpus)

    def to_dict(self) -> dict[str, Any]:
        return {"category": self.category, "name": self.name, "result": self.result,
                "gpus": {str(k): v for k, v in sorted(self.gpus.items())}, "all_gpus": self.all_gpus,
                "messages": [vars(m) for m in self.messages]}


@dataclass
class DcgmDiag:
    version: str | None = None
    driver: str | None = None
    device_ids: list[str] = field(default_factory=list)
    tests: list[DcgmTest] = field(default_factory=list)
    category_messages: list[DcgmMessage] = field(default_factory=list)  # Warning/Error rows before any test
    truncated: bool = False  # a fragment: `...`, a missing closing border or pipe
    repeated: bool = False  # the table was printed more than once (only the first is kept)

    @property
    def gpu_count(self) -> int | None:
        return len(self.device_ids) or None

    @property
    def layout(self) -> str:
        return "4.x" if any(t.name == t.name.lower() for t in self.tests) else "3.x"

    def test(self, name: str) -> DcgmTest | None:
        key = _norm(name)
        return next((t for t in self.tests if _norm(t.name) == key), None)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "driver": self.driver, "device_ids": self.device_ids,
                "gpu_count": self.gpu_count, "layout": self.layout, "truncated": self.truncated,
                "repeated": self.repeated, "tests": [t.to_dict() for t in self.tests],
                "category_messages": [vars(m) for m in self.category_messages]}


def _norm(name: str) -> str:
    return re.sub(r"[\s_]+", " ", name.strip().lower())


def _cells(line: str) -> tuple[str, str, bool] | None:
    """(name cell, result slice, closed) of a `| a | b |` row; None for anything else."""
    if not line.startswith("|") or CAT_RE.match(line) or set(line.strip()) <= set("+-=|"):
        return None
    bar = line.find("|", 1)
    if bar < 0:
        return None
    name = line[1:bar].strip()
    rest = line[bar + 1:]
    closed = rest.rstrip().endswith("|")
    body = rest.rstrip()[:-1] if closed else rest
    if body.startswith(" "):
        body = body[1:]
    if closed and body.endswith(" "):
        body = body[:-1]
    return name, body, closed


def _slice(row: str) -> str:
    """The exact text of a result cell: DCGM wraps messages every 45 characters, mid-word."""
    if len(row) >= 77 and row[28] == "|":
        return row[30:75]
    return row[row.find("|", 1) + 2:] if row.find("|", 1) > 0 else ""


def _status(word: str) -> str:
    return STATUSES[word.lower()]


def parse_dcgm_diag(text: str) -> DcgmDiag:
    out = DcgmDiag()
    category = ""
    test: DcgmTest | None = None
    note: tuple[DcgmMessage, list[str]] | None = None
    seen_header = False
    rows = 0

    def flush_note() -> None:
        nonlocal note
        if note is None:
            return
        msg, parts = note
        msg.text = " ".join("".join(parts).split())  # joined slices, runs of padding collapsed
        m = GPU_IN_MSG_RE.match(msg.text)
        msg.gpu = int(m.group(1)) if m else None
        note = None

    lines = strip_ansi(text).splitlines()
    last_closed = True
    for i, raw in enumerate(lines):
        line = raw.rstrip("\n")
        s = line.strip()
        if not s or s.startswith("Successfully ran diagnostic"):
            continue
        if s in ("...", "…") or s.startswith("[...]"):
            out.truncated = True
            continue
        m = CAT_RE.match(s)
        if m:
            flush_note()
            category, test = m.group(1).strip(), None
            continue
        if set(s) <= set("+-=|"):
            continue
        if "|" not in s:
            continue        # not the table's (stderr interleaved into the capture): every row has a pipe
        cells = _cells(s)
        if cells is None:
            raise ParseError(KIND, "expected a `| name | result |` row of a dcgmi diag table", i + 1, raw)
        name, body, closed = cells
        last_closed = closed
        if _norm(name) == "diagnostic" and body.strip().lower() == "result":
            if seen_header and rows:
                out.repeated = True
                break
            seen_header = True
            continue
        rows += 1
        if name == "":
            if note is not None and not (test is not None and GPU_V4_RE.match(body.strip())):
                note[1].append(_slice(s))
                continue
            flush_note()
            piece = body.strip()
            if test is None:
                raise ParseError(KIND, "a continuation row with no test above it", i + 1, raw)
            _result_line(test, piece, i + 1, raw)
            continue
        flush_note()
        low = name.lower()
        if low in META and test is None:
            value = body.strip()
            if META[low] == "device_ids":
                out.device_ids = [x.strip() for x in value.split(",") if x.strip()]
            else:
                setattr(out, META[low], value)
            continue
        if low in NOTE_ROWS:
            msg = DcgmMessage(level=low, text="")
            (test.messages if test is not None else out.category_messages).append(msg)
            note = (msg, [_slice(s)])
            continue
        test = DcgmTest(category=category, name=name)
        out.tests.append(test)
        _result_line(test, body.strip(), i + 1, raw)
    flush_note()
    if not last_closed:
        out.truncated = True
    if not out.tests and not out.category_messages:
        raise ParseError(KIND, "no test rows: not a dcgmi diag table", 1, lines[0] if lines else "")
    for t in out.tests:
        if t.result is None:
            statuses = set(t.gpus.values()) | ({t.all_gpus} if t.all_gpus else set())
            t.result = "fail" if "fail" in statuses else "warn" if "warn" in statuses else \
                "pass" if "pass" in statuses else "skip" if statuses else None
    return out


def _result_line(test: DcgmTest, piece: str, line_no: int, raw: str) -> None:
    if not piece:
        return
    m = GPU_LIST_RE.match(piece)
    if m:
        st = _status(m.group(1))
        if m.group(2):
            test.all_gpus = st
        else:
            for g in re.findall(r"\d+", m.group(3)):
                test.gpus[int(g)] = st
        return
    m = GPU_V4_RE.match(piece)
    if m:
        test.gpus[int(m.group(1))] = _status(m.group(2))
        return
    word = piece.split()[0].lower()
    if word in STATUSES and test.result is None and len(piece.split()) == 1:
        test.result = _status(word)
        return
    raise ParseError(KIND, f"{test.name}: result {piece!r} is not Pass/Fail/Skip[ - All | - GPU: n]", line_no, raw)
