"""Drain the engine's stdout/stderr continuously into a bounded tail.

A pipe nobody reads fills up (64 KiB) and blocks the writer: a vLLM that cannot log looks
exactly like a hung vLLM. So both pipes are read from spawn to EOF, whatever else happens.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TextIO


class LogTail:
    """The last ``maxlen`` lines of the engine's console output, in arrival order."""

    def __init__(self, maxlen: int, on_line: Callable[[str], None] | None = None,
                 echo: TextIO | None = None, redact: Callable[[str], str] | None = None) -> None:
        self.lines: deque[str] = deque(maxlen=maxlen)
        self.on_line = on_line
        self.echo = echo
        self.redact = redact  # masks secrets (vLLM prints its args, --api-key included, at INFO)
        self.total = 0

    def add(self, line: str) -> None:
        if self.redact is not None:
            line = self.redact(line)
        self.lines.append(line)
        self.total += 1
        if self.echo is not None:
            try:
                self.echo.write(line + "\n")
            except (OSError, ValueError):
                self.echo = None  # our own stderr is gone; keep supervising
        if self.on_line is not None:
            self.on_line(line)

    async def drain(self, stream: asyncio.StreamReader) -> None:
        """Read ``stream`` to EOF, one line at a time."""
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line beyond the stream limit: take what is buffered
                raw = await stream.read(65536)
            if not raw:
                return
            self.add(raw.decode(errors="replace").rstrip("\r\n"))

    def snapshot(self) -> list[str]:
        return list(self.lines)

