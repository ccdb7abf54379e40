"""systemd's notify protocol (READY, STATUS, WATCHDOG, EXTEND_TIMEOUT_USEC, STOPPING) via sdnotify.

Silent when NOTIFY_SOCKET is unset (not under a Type=notify unit).
"""

from __future__ import annotations

import os

import sdnotify


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._n = sdnotify.SystemdNotifier() if self.enabled else None
        usec = os.environ.get("WATCHDOG_USEC", "")
        self.watchdog_interval_s = int(usec) / 1e6 / 2 if usec.isdigit() and int(usec) > 0 else None

    def send(self, *fields: str) -> None:
        msg = "\n".join(fields)
        if self._n is not None:
            self._n.notify(msg)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def extend_timeout(self, seconds: float) -> None:
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self) -> None:
        self.send("STOPPING=1")
