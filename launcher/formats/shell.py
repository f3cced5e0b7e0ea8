"""The one way a value reaches a shell script: `quote` (safe in any position, always one line),
`sbatch_value` (the character set an #SBATCH line takes) and `sbatch_arg` (any one-line value
on an #SBATCH line, quoted the way sbatch reads its directives)."""

from __future__ import annotations

import re
import shlex
from typing import Any

from launcher.errors import UserError

SBATCH_SAFE = re.compile(r"[A-Za-z0-9._:+@,=/%\[\]-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# What bash reads as an assignment (`a=b`, `a+=b`) when it stands first in a command.
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\+?=")


def quote(value: Any) -> str:
    """A bash word that is exactly `value`, wherever it stands.

    shlex.quote leaves `a=b` (and `a+=b`) bare, which bash reads as an assignment in command
    position, so such a word is quoted. A value with a control character (a newline, say) becomes an ANSI-C `$'...'`
    word, so the result is always one line and stays inert even inside a comment. NUL cannot be
    in a bash word at all and is refused."""
    s = str(value)
    if "\x00" in s:
        raise UserError(f"{s!r}: a NUL byte cannot be passed to a shell")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{s!r}: not valid Unicode text (a lone surrogate)") from None
    if _CONTROL.search(s):
        body = s.replace("\\", "\\\\").replace("'", "\\'")
        return "$'" + _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", body) + "'"
    q = shlex.quote(s)
    if _ASSIGNMENT.match(q):
        q = f"'{q}'"
    return q


def sbatch_value(value: Any) -> str:
    """A value for an #SBATCH line: one token of a strict character set (the whole string)."""
    s = str(value)
    if not SBATCH_SAFE.fullmatch(s):
        raise UserError(f"{s!r} cannot go on an #SBATCH line (allowed: letters, digits and ._:+@,=/%[]-)")
    return s


def sbatch_arg(value: Any) -> str:
    """Any one-line value for an #SBATCH line: bare when it is plain, else in double quotes with
    backslash and double quote escaped. sbatch's directive parser knows double quotes and
    backslashes, not the shell's single quotes. Newlines and control characters are refused."""
    s = str(value)
    if _CONTROL.search(s):
        raise UserError(f"{s!r} cannot go on an #SBATCH line (newline or control character)")
    if SBATCH_SAFE.fullmatch(s):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
