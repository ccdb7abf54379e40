"""structlog setup: JSON lines under systemd or when piped, a readable console on a terminal."""

from __future__ import annotations

import logging
import os
import sys

import structlog

from supervisor.event_stream import Event

# sd-daemon(3) priority prefixes: journald files a line starting "<4>" at priority warning, so our
# warnings and errors show up in `journalctl -p warning`.
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}


def with_priority(renderer: structlog.typing.Processor) -> structlog.typing.Processor:
    """Prefix each rendered line with its journald priority."""

    def render(logger: object, name: str, event: structlog.typing.EventDict) -> str:
        prio = PRIORITY.get(str(event.get("level", "info")), 6)
        line = renderer(logger, name, event)
        return f"<{prio}>{line.decode() if isinstance(line, bytes) else line}"

    return render


def configure(fmt: str = "auto", level: str = "info") -> None:
    journald = bool(os.environ.get("JOURNAL_STREAM"))
    if fmt == "auto":
        under_systemd = bool(os.environ.get("INVOCATION_ID") or journald)
        fmt = "json" if under_systemd or not sys.stdout.isatty() else "console"
    renderer: structlog.typing.Processor = (structlog.processors.JSONRenderer() if fmt == "json"
                                            else structlog.dev.ConsoleRenderer(colors=False))
    if journald:
        renderer = with_priority(renderer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=False,
    )


_events_log = structlog.get_logger("supervisor")


class EventLog:
    """Event-stream subscriber: one structlog line per event, at the event's level."""

    def on_event(self, event: Event) -> None:
        getattr(_events_log, event.log_level())(event.name, **event.fields())
