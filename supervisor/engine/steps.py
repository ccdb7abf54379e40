"""A run's steps: each races its work against the run's trigger queue, by a deadline the watchdog
measures.

Whatever ends a run (the API server's exit, vLLM's own record that the engine died, a liveness rule,
a warm-up failure, a stop or a climb asked by the supervisor) becomes one Trigger on the queue; the
first one wins, and the step under way stops at once, so nothing is polled for luck.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from supervisor.aio import cancel_and_wait
from supervisor.engine_states import Failure, TriggerKind
from supervisor.host import Host
from supervisor.profile import Profile

R = TypeVar("R")


@dataclass(frozen=True)
class Trigger:
    """Why the run is ending: what fired, the evidence, and when (wall clock for detection
    latency)."""

    kind: TriggerKind
    evidence: str
    at: float
    at_mono: float
    # Set when the trigger already is the verdict (nothing ran that left logs to classify).
    failure: Failure | None = None
    target: Profile | None = None  # a planned restart's profile (a climb, the operator's)
    # a planned restart after a clean drain: nothing at the engine to finish, no SIGTERM grace
    drained: bool = False


class Steps:
    """The trigger queue and the deadline of the step under way (the host's monotonic clock)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.queue: asyncio.Queue[Trigger] = asyncio.Queue()
        self.deadline = host.monotonic()

    def trigger(self, kind: TriggerKind, evidence: str, failure: Failure | None = None,
                target: Profile | None = None) -> Trigger:
        return Trigger(kind, evidence, self.host.wall(), self.host.monotonic(), failure, target)

    def end(self, kind: TriggerKind, evidence: str, failure: Failure | None = None,
            target: Profile | None = None) -> None:
        """Ask the run to end (a stop, a climb or restart to ``target``, or a rule that fired);
        the first wins."""
        self.queue.put_nowait(self.trigger(kind, evidence, failure, target))

    def expect(self, seconds: float) -> None:
        """The step under way will be over within ``seconds``."""
        self.deadline = self.host.monotonic() + seconds

    async def within(self, seconds: float, work: Awaitable[R]) -> R | Trigger:
        """One step: ``work`` raced against the queue, expected to be over within ``seconds``."""
        self.expect(seconds)
        return await self.race(work)

    async def race(self, work: Awaitable[R]) -> R | Trigger:
        """Run ``work`` until it finishes or a trigger arrives, whichever is first."""
        task = asyncio.ensure_future(work)
        getter = asyncio.ensure_future(self.queue.get())
        done, _ = await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return getter.result()
        await cancel_and_wait(getter)
        return task.result()
