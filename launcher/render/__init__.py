"""One Jinja environment for every rendered file: training jobs (sbatch.py, k8s.py, trainjob.py) and
preflight's batch script and pods (checks/runners).

Templates are package resources (the `templates` package shipped in the wheel); a user's
`--templates DIR` is searched first, file by file, and read bounded. Values are shaped in Python so
templates stay declarative and the checks can be tested: every user string that reaches a shell
goes through `q` (launcher.formats.shell.quote: safe in command position, always one line), every
value on an #SBATCH line through `sbatch` (a strict character set, the whole value) or `sbatch_arg`,
every Kubernetes name through `k8sname` (RFC 1123), every YAML scalar through `yq` (JSON, which is
YAML). Undefined variables are errors. Nothing depends on the clock: the same input renders the
same bytes. This module imports nothing of launch4d but formats and errors, so checks use it too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from launcher.errors import UserError
from launcher.formats.files import read_text
from launcher.formats.k8snames import RFC1123_LABEL
from launcher.formats.shell import quote as shell_quote
from launcher.formats.shell import sbatch_arg, sbatch_value

TEMPLATE_LIMIT = 1 << 20
TEMPLATE_PACKAGE = "templates"


def check_k8s_name(value: Any, what: str = "name", limit: int = 63) -> str:
    s = str(value)
    if len(s) > limit or not RFC1123_LABEL.fullmatch(s):
        raise UserError(f"{what}: {s!r} is not a valid Kubernetes name (RFC 1123: lowercase letters, digits "
                        f"and '-', starting and ending with a letter or digit, at most {limit} characters)")
    return s


_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def yaml_scalar(value: Any) -> str:
    """JSON is YAML: any string, list or mapping renders safely on one line. Non-ASCII characters
    are escaped the YAML way (\\uXXXX, \\UXXXXXXXX): JSON's surrogate pairs for characters beyond
    the BMP would read back in YAML as two lone surrogates, and a raw U+2028 as a line break."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return _NON_ASCII.sub(lambda m: f"\\u{ord(m.group()):04x}" if ord(m.group()) <= 0xFFFF
                          else f"\\U{ord(m.group()):08x}", text)


def _loader(user_dir: Path | None):
    """The user's directory first (files read through formats.read_text: bounded, UTF-8, a device or
    FIFO refused by name), then the templates shipped as package resources."""
    import jinja2

    class Loader(jinja2.BaseLoader):
        def get_source(self, environment, template):
            parts = jinja2.loaders.split_template_path(template)
            if user_dir is not None:
                path = Path(user_dir, *parts)
                if os.path.lexists(path) and not path.is_dir():
                    if not path.is_file():
                        raise UserError(f"{path}: a template must be a regular file")
                    text = read_text(path, "template", TEMPLATE_LIMIT)
                    mtime = path.stat().st_mtime
                    return text, str(path), lambda p=path, m=mtime: p.exists() and p.stat().st_mtime == m
            shipped = resources.files(TEMPLATE_PACKAGE).joinpath(*parts)
            if shipped.is_file():
                return shipped.read_text(encoding="utf-8"), None, lambda: True
            raise jinja2.TemplateNotFound(template)

    return Loader()


def environment(user_dir: str | Path | None = None):
    """The Jinja environment (one per template directory, made once): shipped templates, the user's
    first, the quoting filters above, undefined variables an error."""
    if user_dir is not None and not Path(user_dir).is_dir():
        raise UserError(f"--templates {user_dir}: not a directory")
    return _environment(str(Path(user_dir).resolve()) if user_dir is not None else None)


@cache
def _environment(user_dir: str | None):
    import jinja2

    env = jinja2.Environment(loader=_loader(Path(user_dir) if user_dir else None), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters.update(q=shell_quote, sbatch=sbatch_value, sbatch_arg=sbatch_arg, k8sname=check_k8s_name,
                       yq=yaml_scalar)
    return env


def render_template(name: str, context: dict[str, Any], user_dir: str | Path | None = None) -> str:
    import jinja2

    env = environment(user_dir)
    try:
        return env.get_template(name).render(**context)
    except jinja2.TemplateNotFound:
        raise UserError(f"template {name} not found (searched {user_dir or ''} and the shipped templates)") from None
    except jinja2.UndefinedError as exc:
        raise UserError(f"template {name}: {exc.message}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"template {exc.filename or name}:{exc.lineno}: {exc.message}") from None


def bash_syntax_check(script: str, what: str = "sbatch script") -> None:
    try:
        proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return  # no bash here (a login shell elsewhere will check it); nothing else can
    if proc.returncode != 0:
        raise UserError(f"rendered {what} does not parse: {proc.stderr.strip().splitlines()[0]}")
