"""This machine as a Transport: processes in their own session (a timeout or a flood ends all of
it, children included), files through launcher.formats.files (atomic, never through a symlink)."""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from launcher.formats.files import atomic_write, make_dirs
from launcher.transport import CHUNK_LIMIT, OUTPUT_LIMIT, Command, Completed, Transport
from launcher.transport.lines import LineSplitter

log = logging.getLogger(__name__)  # `launch -v` shows every command run


def _argv(command: Command) -> list[str]:
    return ["bash", "-c", command] if isinstance(command, str) else list(command)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_process(command: Command, timeout: float, *, cwd: str | None = None, stdin: bytes | None = None,
                env: dict[str, str] | None = None, limit: int = OUTPUT_LIMIT) -> Completed:
    """Run here in a new session, keeping at most `limit` bytes of stdout and of stderr; on timeout
    or flood the whole session is killed. A program that is not there is rc 127, like a shell's."""
    log.debug("run here: %s", command)
    start = time.monotonic()
    argv = _argv(command)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env,
                                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                start_new_session=True)
    except FileNotFoundError as exc:
        missing = argv[0] if exc.filename in (None, argv[0]) else exc.filename
        return Completed(127, "", f"{missing}: command not found", seconds=time.monotonic() - start)
    except (NotADirectoryError, PermissionError) as exc:
        return Completed(126, "", f"{exc.filename or argv[0]}: {exc.strerror}", seconds=time.monotonic() - start)
    if stdin is not None:
        def feed() -> None:
            try:
                proc.stdin.write(stdin)  # type: ignore[union-attr]
                proc.stdin.close()  # type: ignore[union-attr]
            except OSError:  # the command exited without reading it all
                pass
        threading.Thread(target=feed, daemon=True).start()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    timed_out = flooded = False
    with selectors.DefaultSelector() as sel:
        for stream in bufs:
            sel.register(stream, selectors.EVENT_READ)  # type: ignore[arg-type]
        while sel.get_map() and not flooded:
            left = start + timeout - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(min(left, 1.0)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fileobj]  # type: ignore[index]
                buf += chunk
                flooded = flooded or len(buf) > limit
    if timed_out or flooded:
        _kill(proc)
    try:
        rc = proc.wait(timeout=max(1.0, start + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:  # the command closed its output but runs on
        timed_out = True
        _kill(proc)
        rc = proc.wait()
    for stream in bufs:
        stream.close()  # type: ignore[union-attr]
    out, err = (bytes(b[:limit]).decode(errors="replace") for b in bufs.values())
    return Completed(None if (timed_out or flooded) else rc, out, err, timed_out=timed_out, flooded=flooded,
                     seconds=time.monotonic() - start)


class LocalTransport(Transport):
    host = None

    def run(self, command: Command, *, timeout: float = 60, cwd: str | None = None,
            stdin: bytes | None = None, limit: int = OUTPUT_LIMIT, env: dict[str, str] | None = None) -> Completed:
        return run_process(command, timeout, cwd=cwd, stdin=stdin, env=env, limit=limit)

    def stream(self, command: Command, *, timeout: float | None = None, cwd: str | None = None) -> Iterator[str]:
        proc = subprocess.Popen(_argv(command), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True)
        deadline = time.monotonic() + timeout if timeout else None
        split = LineSplitter()
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
                while deadline is None or time.monotonic() < deadline:
                    wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
                    if not sel.select(wait):
                        continue
                    chunk = os.read(proc.stdout.fileno(), 1 << 16)  # type: ignore[union-attr]
                    if not chunk:
                        break
                    yield from split.feed(chunk)
            last = split.rest()
            if last is not None:
                yield last
        finally:
            _kill(proc)
            proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]

    def spawn(self, command: Command, *, output_fd: int, env: dict[str, str] | None = None,
              pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
        """Start `command` detached, in its own session (Ctrl-C here does not reach it, and it
        outlives this process), stdout and stderr appended to the open `output_fd`; `env` is added to
        this environment, `pass_fds` are inherited (a lock held for the job's life)."""
        log.debug("start here: %s", command)
        return subprocess.Popen(_argv(command), stdout=output_fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **(env or {})}, pass_fds=pass_fds)

    def put(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        atomic_write(path, data, "job file", mode)

    def get(self, path: str, offset: int = 0, limit: int = CHUNK_LIMIT) -> bytes | None:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(limit)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def exists(self, path: str) -> bool:
        return Path(path).exists()

    def makedirs(self, path: str) -> None:
        make_dirs(path, "directory")

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def home(self) -> str:
        return str(Path.home())

    def which(self, name: str) -> bool:
        return shutil.which(name) is not None
