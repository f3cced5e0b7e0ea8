"""Reading and writing the files a user hands us or we hand back, safely.

- Reads are bounded (a size limit with a clear message), refuse directories and devices, read
  pipes once (`<(cat job.yaml)` works), and decode UTF-8 strictly.
- Writes create a temporary file in the target's own directory and rename it into place, so a
  reader never sees half a file; they never write through or over a symlink, a device or a
  directory (`-o /dev/full` is refused, not replaced).
- Paths a job creates from its name are proven to stay inside their parent.
Every failure is a UserError naming the file: one line, exit 2, no traceback.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from launcher.errors import UserError

KiB, MiB = 1 << 10, 1 << 20
#: A job file is a page of YAML; anything near this limit is a mistake (or an attack).
JOB_FILE_LIMIT = 1 * MiB
#: plan.json / bwmap.json for thousands of GPUs stay well under this.
JSON_FILE_LIMIT = 64 * MiB


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISFIFO, "a FIFO")):
        if test(mode):
            return name
    return "not a regular file"


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def read_bytes(path: str | Path, what: str = "file", limit: int = JSON_FILE_LIMIT) -> bytes:
    """At most `limit` bytes of a regular file or a pipe; anything else, or more, is refused."""
    try:
        # O_NONBLOCK: opening a FIFO with no writer must not hang; cleared once open.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise UserError(f"{path}: cannot read {what} ({_why(exc)})") from None
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
            raise UserError(f"{path}: cannot read {what} (it is {_kind(st.st_mode)})")
        if stat.S_ISREG(st.st_mode) and st.st_size > limit:
            raise UserError(f"{path}: {what} is {st.st_size:,} bytes; the limit is {limit:,}")
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, min(1 * MiB, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise UserError(f"{path}: {what} is larger than the limit of {limit:,} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise UserError(f"{path}: cannot read {what} ({_why(exc)})") from None
    finally:
        os.close(fd)


def read_text(path: str | Path, what: str = "file", limit: int = JSON_FILE_LIMIT, errors: str = "strict") -> str:
    """read_bytes, decoded as strict UTF-8 (a binary file gets one line, not a traceback);
    errors="replace" for a tool's captured output, which may hold stray bytes."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8", errors)
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: {what} is not UTF-8 text (byte {exc.start})") from None


def _encode(data: str | bytes, path: Path, what: str) -> bytes:
    if isinstance(data, bytes):
        return data
    try:
        return data.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(f"{path}: cannot write {what} (character {exc.start} is not valid Unicode)") from None


def check_writable_target(path: str | Path, what: str = "file") -> None:
    """Refuse a target that exists and is not a regular file (symlink, device, directory, FIFO)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UserError(f"{path}: cannot write {what} ({_why(exc)})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path}: exists and is {_kind(st.st_mode)}; refusing to replace it with the {what}")


def atomic_write(path: str | Path, data: str | bytes, what: str = "file", mode: int = 0o644,
                 durable: bool = True) -> Path:
    """Write `data` to `path` through a temporary file in the same directory, then rename it.
    durable: fsync before the rename (a crash leaves the old file or the new one, never an empty
    one); off for bulk outputs that can be produced again."""
    p = Path(path)
    check_writable_target(p, what)
    raw = _encode(data, p, what)
    try:
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    except OSError as exc:
        raise UserError(f"{p}: cannot write {what} ({_why(exc)})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fchmod(f.fileno(), mode)
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise UserError(f"{p}: cannot write {what} ({_why(exc)})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def write_files(directory: str | Path, files: dict[str, tuple[str | bytes, int]], what: str = "file") -> list[Path]:
    """Write several files into one directory all or nothing: every file is staged as a temporary
    beside its target first; only when all are staged are they renamed into place. On failure the
    temporaries are removed and nothing is replaced."""
    d = Path(directory)
    for name, (data, _) in files.items():
        check_writable_target(d / name, what)
        _encode(data, d / name, what)
    staged: list[tuple[str, Path]] = []
    try:
        for name, (data, mode) in sorted(files.items()):
            raw = _encode(data, d / name, what)
            fd, tmp_name = tempfile.mkstemp(dir=d, prefix=f".{name}.", suffix=".tmp")
            staged.append((name, Path(tmp_name)))
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fchmod(f.fileno(), mode)
                os.fsync(f.fileno())
        for name, tmp in staged:
            os.replace(tmp, d / name)
    except OSError as exc:
        for _, tmp in staged:
            tmp.unlink(missing_ok=True)
        where = d / staged[-1][0] if staged else d
        raise UserError(f"{where}: cannot write {what} ({_why(exc)})") from None
    except BaseException:
        for _, tmp in staged:
            tmp.unlink(missing_ok=True)
        raise
    return [d / name for name, _ in staged]


def make_dirs(path: str | Path, what: str = "directory") -> list[Path]:
    """mkdir -p with one-line errors; returns the directories it created, outermost first (so a
    failed command can remove exactly those)."""
    p = Path(path)
    missing: list[Path] = []
    q = p
    while not os.path.lexists(q):
        missing.append(q)
        if q.parent == q:
            break
        q = q.parent
    if os.path.lexists(q) and not q.is_dir():
        raise UserError(f"{path}: cannot create {what} ({q} exists and is not a directory)")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        remove_created(list(reversed(missing)))
        raise UserError(f"{path}: cannot create {what} ({_why(exc)})") from None
    return list(reversed(missing))


def remove_created(dirs: list[Path]) -> None:
    """Remove directories make_dirs created (innermost first), only where they are empty."""
    for d in reversed(dirs):
        try:
            d.rmdir()
        except OSError:
            pass


def child_path(parent: str | Path, name: str, what: str = "name") -> Path:
    """parent/name, proven to be a direct child of parent: name is one path component
    (no '/', not '.' or '..', no NUL), so `name: ../../tmp/x` cannot escape backend.log_dir."""
    if not name or name in (".", "..") or "/" in name or "\x00" in name:
        raise UserError(f"{what}: {name!r} cannot be used as a directory name (one path component, "
                        "no '/', not '.' or '..')")
    base = Path(parent).expanduser()
    child = base / name
    if child.resolve().parent != base.resolve():
        raise UserError(f"{what}: {name!r} resolves outside {base}")
    return child


def is_inside(parent: str | Path, path: str | Path) -> bool:
    """Whether path (resolved) lies within parent (resolved)."""
    try:
        Path(path).resolve().relative_to(Path(parent).resolve())
    except ValueError:
        return False
    return True
