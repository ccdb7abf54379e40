"""Parsing client bodies where they cannot starve supervision.

The gateway's event loop also runs the lifecycle, the admin port and the watchdog's beat. One 16 MiB
token-id body costs about a second of JSON parsing, type checks and hashing, and 24 sent together
stalled that loop 28 s (the shipped WatchdogSec=30). A thread does not help: ``json.loads`` is one C
call that holds the GIL from start to end. So a body over INLINE_BYTES goes to a small process pool
(PARSERS processes of our own interpreter, started on the first big body, spawned: they import only
the parser), the others waiting their turn without holding the loop. If the pool breaks, the body is
parsed on the loop rather than refused.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import structlog

from supervisor.decide import admission
from supervisor.decide.admission import Parsed, Rejection
from supervisor.host.routes import COUNTED

KINDS = frozenset(COUNTED.values())

INLINE_BYTES = 256 * 1024  # a body this small parses in well under a millisecond: on the loop
PARSERS = 2
PARENT_POLL_S = 0.5  # how soon a pool process notices that the supervisor is gone
T = TypeVar("T")
log = structlog.get_logger("supervisor.gateway")


class BodyParser:
    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, route: str, body: bytes) -> Parsed | Rejection:
        """Parse, type-check and hash ``body`` for ``route`` (a model route: routes.model_route)."""
        return await self.run(len(body), parse, route, body)

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, on the loop for a body under INLINE_BYTES, else in the pool (``fn``
        must be a module-level function of a module the workers can import, its arguments
        picklable)."""
        if size < INLINE_BYTES:
            return fn(*args)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(PARSERS,
                                             mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_leave_with, initargs=(os.getpid(), ))
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except BrokenProcessPool as exc:
            self._pool = None
            log.warning(
                "gateway.parser_pool_broken", error=str(exc),
                hint="this body is parsed on the event loop; "
                "the next big one starts a new pool")
            return fn(*args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _leave_with(parent: int) -> None:
    """In each pool process: exit when the supervisor is gone. A SIGKILLed supervisor's workers
    would otherwise wait on their call queue for ever (they hold both of its ends), and no
    later supervisor knows them."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def parse(route: str, body: bytes) -> Parsed | Rejection:
    if route in KINDS:
        return admission.parse(route, body)
    return admission.parse_opaque(route, body)
