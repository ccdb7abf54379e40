"""The signals the supervisor answers: SIGTERM and SIGINT stop it, SIGHUP reloads its config. The
handlers only enqueue; the loop acts."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

ANSWERED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def answer(stop: Callable[[str], None], reload: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop, "SIGTERM")
    loop.add_signal_handler(signal.SIGINT, stop, "SIGINT")
    loop.add_signal_handler(signal.SIGHUP, reload)


def stop_answering() -> None:
    loop = asyncio.get_running_loop()
    for sig in ANSWERED:
        loop.remove_signal_handler(sig)
