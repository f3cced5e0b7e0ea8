"""Bytes as they arrive (a pipe, an SSH channel, a growing log file, an HTTP stream) -> text lines.

The one splitter every reader of streamed output uses: a line cut across two chunks is held until
its end arrives; bytes that are not UTF-8 are replaced, never a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class LineSplitter:
    """feed(chunk) -> the lines it completed; rest() -> the unfinished last line (or None)."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[str]:
        *done, self._pending = (self._pending + chunk).split(b"\n")
        return [ln.decode(errors="replace") for ln in done]

    def rest(self) -> str | None:
        out, self._pending = self._pending, b""
        return out.decode(errors="replace") if out else None


def iter_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """Every line of a stream of chunks, the unfinished last one included."""
    split = LineSplitter()
    for chunk in chunks:
        yield from split.feed(chunk)
    last = split.rest()
    if last is not None:
        yield last
