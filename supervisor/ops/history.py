"""The /status history: the last state transitions, kept by an event-stream subscriber."""

from __future__ import annotations

from collections import deque
from typing import Any

from supervisor.event_stream import Event, StateChanged


class History:
    def __init__(self, maxlen: int = 50) -> None:
        self.entries: deque[dict[str, Any]] = deque(maxlen=maxlen)

    def on_event(self, event: Event) -> None:
        if isinstance(event, StateChanged):
            self.entries.append({**event.fields(), "at": event.at})

    def last(self, n: int = 20) -> list[dict[str, Any]]:
        return list(self.entries)[-n:]
