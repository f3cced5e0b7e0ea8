"""Following a job's log file: the one tail-and-retry loop of the Slurm and local backends.

A log is read chunk by chunk from an offset through a Transport (here, or on the login node). While
following, the scheduler is asked whether the job has ended only when the log is idle, with backoff
(the backend says how often: Slurm 2, 4, 8 ... 60 s, a local job at every idle poll), and at once when
a chunk carries the job's last words. A scheduler that does not answer (TransientError) is tolerated
for `budget_s`, each retry told to `on_retry`. Once the job has ended, what is left of the file is
read and the loop stops, so no line written before the end is lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from launcher.backends import POLL_MAX_S, POLL_START_S, RETRY_BUDGET_S, TransientError, backoff
from launcher.errors import UserError
from launcher.transport import CHUNK_LIMIT, Transport
from launcher.transport.lines import LineSplitter


def read_tail(transport: Transport, path: str, keep: int = CHUNK_LIMIT, offset: int = 0) -> bytes | None:
    """At most the last `keep` bytes (plus one chunk) of a file from `offset`, read chunk by chunk;
    None if absent."""
    tail = None
    while (chunk := transport.get(path, offset)) is not None:
        tail = (tail or b"")[-keep:] + chunk
        offset += len(chunk)
        if len(chunk) < CHUNK_LIMIT:
            break
    return tail


def read_from(transport: Transport, path: str, offset: int = 0) -> bytes | None:
    """The whole of a file from `offset`, chunk by chunk; None if absent."""
    parts = []
    while (chunk := transport.get(path, offset)) is not None:
        parts.append(chunk)
        offset += len(chunk)
        if len(chunk) < CHUNK_LIMIT:
            return b"".join(parts)
    return b"".join(parts) if parts else None


@dataclass
class LogTail:
    """The lines of `path` on `transport` from `offset`; `offset` is where reading got to."""

    transport: Transport
    path: str
    offset: int = 0
    #: Whether the job has ended (asked while following, when the log is idle); raises TransientError.
    ended: Callable[[], bool] = lambda: True
    #: A chunk in which the job may have said its last words: ask `ended` at once.
    last_words: Callable[[bytes], bool] = lambda chunk: False
    poll_s: float = 1.0                        # how often an idle log is read again
    check_start: float = POLL_START_S          # first wait before asking `ended`, doubling ...
    check_cap: float = POLL_MAX_S              # ... up to this
    budget_s: float = RETRY_BUDGET_S
    on_retry: Callable[[TransientError, float, int], None] | None = None
    sleep: Callable[[float], None] | None = field(default=None, repr=False)   # None: time.sleep (looked up
    clock: Callable[[], float] | None = field(default=None, repr=False)       # when called), time.monotonic

    def _read(self) -> bytes:
        chunk = self.transport.get(self.path, self.offset) or b""
        self.offset += len(chunk)
        return chunk

    def lines(self, follow: bool = False, timeout_s: float | None = None) -> Iterator[str]:
        """Every line there now; with `follow`, on until the job has ended (or `timeout_s` passed)."""
        sleep, clock = self.sleep or time.sleep, self.clock or time.monotonic
        split = LineSplitter()
        deadline = clock() + timeout_s if timeout_s else None
        delays = backoff(self.check_start, self.check_cap)
        next_check = clock() + next(delays)
        failing_since: float | None = None
        tries = 0
        while True:
            chunk = self._read()
            if chunk:
                yield from split.feed(chunk)
                if self.last_words(chunk):
                    next_check = clock()
                if len(chunk) >= CHUNK_LIMIT:
                    continue  # more is there already: read it before anything else
            if not follow or (deadline and clock() > deadline):
                break
            if chunk:
                delays = backoff(self.check_start, self.check_cap)
                continue
            now = clock()
            if now >= next_check:
                delay = next(delays)
                next_check = now + delay
                try:
                    done = self.ended()
                    failing_since, tries = None, 0
                except TransientError as exc:
                    failing_since = failing_since or now
                    tries += 1
                    if now - failing_since >= self.budget_s:
                        raise UserError(f"{exc}; still failing after {tries} tries over {now - failing_since:.0f} s "
                                        f"(retry budget {self.budget_s:.0f} s)") from None
                    if self.on_retry:
                        self.on_retry(exc, delay, tries)
                    done = False
                if done:
                    while tail := self._read():
                        yield from split.feed(tail)
                    break
            sleep(self.poll_s)
        last = split.rest()
        if last is not None:
            yield last
