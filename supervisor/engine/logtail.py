"""Drain the engine's stdout/stderr continuously into a bounded tail.

A pipe nobody reads fills up (64 KiB) and blocks the writer: a vLLM that cannot log looks
exactly like a hung vLLM. So both pipes are read from spawn to EOF, whatever else happens.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Callable
from typing import TextIO

MAX_LINE = 16 * 1024  # characters of one console line that the tail keeps and the classifier reads
LINE_CUT = " ...[line cut]"


def _line(raw: bytes) -> str:
    line = raw[:MAX_LINE * 4].decode(errors="replace").rstrip("\r\n")
    return line[:MAX_LINE] + LINE_CUT if len(line) > MAX_LINE else line


async def _skip_to_next_line(stream: asyncio.StreamReader) -> None:
    """Read and drop the rest of a line that overran the stream's limit."""
    while True:
        try:
            await stream.readuntil(b"\n")
            return
        except asyncio.IncompleteReadError:
            return
        except asyncio.LimitOverrunError as exc:
            await stream.read(exc.consumed)


class LogTail:
    """The last ``maxlen`` lines of the engine's console output, in arrival order."""

    def __init__(self, maxlen: int, on_line: Callable[[str], None] | None = None,
                 echo: TextIO | None = None, redact: Callable[[str], str] | None = None) -> None:
        self.lines: deque[str] = deque(maxlen=maxlen)
        self.on_line = on_line
        self.echo = echo
        self.redact = redact  # masks secrets (vLLM prints its args, --api-key included, at INFO)

    def add(self, line: str) -> None:
        if self.redact is not None:
            line = self.redact(line)
        self.lines.append(line)
        if self.echo is not None:
            try:
                self.echo.write(line + "\n")
            except (OSError, ValueError):
                self.echo = None  # our own stderr is gone; keep supervising
        if self.on_line is not None:
            self.on_line(line)

    async def drain(self, stream: asyncio.StreamReader) -> None:
        """Read ``stream`` to EOF, one line at a time.

        A line longer than the stream's limit (a request logged with megabytes of stop strings)
        is kept as its first MAX_LINE characters and the rest is read and dropped: never handed
        on in pieces, each of which would start wherever the cut fell, like a line of its own
        (``prog: error: ...``, argparse's words)."""
        while True:
            try:
                raw = await stream.readuntil(b"\n")
            # EOF, perhaps after a last line without its newline
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    self.add(_line(exc.partial))
                return
            except asyncio.LimitOverrunError as exc:
                head = await stream.read(exc.consumed)
                await _skip_to_next_line(stream)
                line = _line(head)
                self.add(line if line.endswith(LINE_CUT) else line + LINE_CUT)
                continue
            self.add(_line(raw))

    def snapshot(self) -> list[str]:
        return list(self.lines)



# vLLM's console header (ConsoleFormatter, on every line of a message): an optional "(EngineCore_DP0
# pid=12) ", then the level and the date. Only the header decides: a client's text never stands at
# the start of a line.
_HEADER_LEVEL = re.compile(r"(?:\([^()\n]{1,80}\) )?(CRITICAL|ERROR|WARNING) \d\d-\d\d ")
JOURNAL_PRIORITY = {"CRITICAL": 2, "ERROR": 3, "WARNING": 4}  # syslog's crit, err, warning


def journal_line(line: str) -> str:
    """One of vLLM's console lines as journald should file it: ``<3>`` before an ERROR line
    (SyslogLevelPrefix=, on by default, turns it into the entry's priority), ``<4>`` before a
    WARNING; the rest at the unit's level."""
    m = _HEADER_LEVEL.match(line)
    return f"<{JOURNAL_PRIORITY[m.group(1)]}>{line}" if m else line


class JournalEcho:
    """The engine's console echoed to journald (the supervisor's stderr under systemd:
    $JOURNAL_STREAM), each line with its priority, so that `journalctl -p err` shows vLLM's
    errors."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write("".join(
            journal_line(line) for line in text.splitlines(keepends=True)))

    def flush(self) -> None:
        self.stream.flush()
