"""Writes inside a run directory that never follow a symbolic link: the one helper every writer there uses.

A run dir holds no link of launch4d's making, and a job refuses to start or resume in one that holds any
(formats.rundir.planted_link). A link planted while the job runs (checkpoints/.latest.tmp -> a file of the
user's, logs/ -> elsewhere) must not turn a write of ours into a write to its target either, so:

- every directory between the run dir and the file is opened with O_NOFOLLOW, one component at a time,
  relative to the last (openat); the run dir itself may be a link, since the user chose that path;
- a file we write whole goes to a new temporary name (whatever lies there, a link included, is removed,
  then O_CREAT | O_EXCL) renamed over the final name: a link at the final name is replaced, not followed;
- a file we append to is opened O_NOFOLLOW: a link there stops the writer;
- a tree we remove that is a link is unlinked, never descended.

A link met where a directory or an appended file should be raises PlantedLinkError: one line naming it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from launcher.errors import RunError

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PlantedLinkError(RunError):
    """A write inside a run dir met a symbolic link planted after the run dir was checked."""

    def __init__(self, path: str | Path):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        self.path = str(path)
        super().__init__(f"{path} is a symbolic link (-> {target}); launch4d never writes through a link in a "
                         "run directory: remove it")


def _parts(root: Path, path: Path) -> tuple[str, ...]:
    rel = Path(os.path.normpath(path)).relative_to(os.path.normpath(root))
    if any(p == ".." for p in rel.parts):
        raise ValueError(f"{path} is not inside {root}")
    return rel.parts


def _refuse_if_link(path: Path, exc: OSError) -> None:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and os.path.islink(path):
        raise PlantedLinkError(path) from None


def _open_dir(root: Path, parts: tuple[str, ...], create: bool) -> int:
    """An fd of root/parts..., each component opened without following a link (created if `create`)."""
    if create:
        os.makedirs(root, exist_ok=True)  # the run dir itself: where the user put it, links and all
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            here = root.joinpath(*parts[: i + 1])
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                try:
                    nxt = os.open(part, _DIR, dir_fd=fd)
                except OSError as exc:
                    _refuse_if_link(here, exc)
                    raise
            except OSError as exc:
                _refuse_if_link(here, exc)
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _parent(root: str | Path, path: str | Path, create: bool = True) -> Iterator[tuple[int, str]]:
    root, path = Path(root), Path(path)
    parts = _parts(root, path)
    if not parts:
        raise ValueError(f"{path} is the run dir itself, not a file in it")
    fd = _open_dir(root, parts[:-1], create)
    try:
        yield fd, parts[-1]
    finally:
        os.close(fd)


def make_dirs(root: str | Path, path: str | Path) -> None:
    """mkdir -p of `path` inside run dir `root`, never through a link."""
    os.close(_open_dir(Path(root), _parts(Path(root), Path(path)), create=True))


def open_fd(root: str | Path, path: str | Path, flags: int, mode: int = 0o644) -> int:
    """os.open of `path` inside `root` with O_NOFOLLOW on every component (parents created)."""
    with _parent(root, path) as (dfd, name):
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
        except OSError as exc:
            _refuse_if_link(Path(path), exc)
            raise


def open_append(root: str | Path, path: str | Path, binary: bool = False, buffering: int = -1) -> IO[Any]:
    """A file object appending to `path` (created if absent); a link there raises PlantedLinkError."""
    fd = open_fd(root, path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "ab" if binary else "a", buffering=buffering)


def read_text(root: str | Path, path: str | Path) -> str:
    """The text of `path`, not read through a link (a file of someone else's copied into the run dir)."""
    fd = open_fd(root, path, os.O_RDONLY)
    with os.fdopen(fd, "r", errors="replace") as f:
        return f.read()


def write_atomic(root: str | Path, path: str | Path, data: str | bytes, durable: bool = False,
                 mode: int = 0o644) -> None:
    """Replace `path` with `data`: a new `.<name>.tmp` beside it (a link or leftover there removed first,
    then O_EXCL), renamed over the final name, which replaces a link there instead of following it.
    durable: fsync the file and the directory (a crash leaves the old content or the new)."""
    raw = data.encode() if isinstance(data, str) else data
    with _parent(root, path) as (dfd, name):
        tmp = f".{name}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        if durable:
            with contextlib.suppress(OSError):
                os.fsync(dfd)


def remove_tree(root: str | Path, path: str | Path) -> None:
    """Remove `path` (a directory tree, a file, or a link: the link itself, never what it points to);
    nothing there is no error."""
    parts = _parts(Path(root), Path(path))
    try:
        dfd = _open_dir(Path(root), parts[:-1], create=False)
    except FileNotFoundError:
        return
    try:
        st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(parts[-1], dir_fd=dfd)  # fd-based: never descends a link inside the tree
        else:
            os.unlink(parts[-1], dir_fd=dfd)
    except FileNotFoundError:
        return
    finally:
        os.close(dfd)
