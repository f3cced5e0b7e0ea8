"""User-facing errors: the CLI turns these into one line on stderr and exit code 2."""

from __future__ import annotations

import contextlib
import signal


class UserError(Exception):
    """Bad input from a person (a job file, a flag, a missing file): no traceback, exit 2."""

    exit_code = 2


class SpecError(UserError):
    """A job-file value is wrong; the message starts with its dotted path."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class RunError(Exception):
    """A run failed for a reason one line says fully (a full disk, an unreadable checkpoint): the
    trainer prints it without a traceback and exits 1."""

    exit_code = 1


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt while the block runs, so the caller's cleanup stops what it started
    (a CI job's timeout sends SIGTERM, not SIGINT). Outside the main thread, signals are left alone."""
    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        before = signal.signal(signal.SIGTERM, stop)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
