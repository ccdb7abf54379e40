"""The supervision loop's heartbeat: systemd's watchdog and /healthz answer from the loop's own
progress.

Every long step of the lifecycle (a start, a warm-up, a stop, a backoff) is awaited through
``wait`` in slices of ``tick_s``, with the deadline the step announced. Each slice pets the
watchdog only while the step is within that deadline (plus some slack): a step stuck past its
bound stops the petting, ``supervisor.stuck`` goes on the stream once, and systemd restarts us.
A side thread that pets regardless would keep a wedged supervisor "alive" (uvicorn's counter-
example in docs/design.md); here the beat is the loop itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from supervisor.engine_states import EngineState
from supervisor.event_stream import Event, SupervisorStuck
from supervisor.host import Host
from supervisor.ops.notify import Notifier

T = TypeVar("T")
TICK_S = 1.0  # the loop's heartbeat: watchdog petting, /healthz, the READY checks (stable, climb)
STUCK_SLACK_S = 10.0
HEALTHZ_STALE_S = 3 * TICK_S + 2.0


class Heartbeat:
    def __init__(self, host: Host, notifier: Notifier, publish: Callable[[Event], None],
                 state: Callable[[], EngineState]) -> None:
        self.host, self.notifier, self.publish, self.state = host, notifier, publish, state
        self.tick_s = TICK_S
        self._beat_at = host.monotonic()
        self._stuck_noted = False

    def beat(self) -> None:
        self._beat_at = self.host.monotonic()
        self._stuck_noted = False
        if self.notifier.watchdog_interval_s:
            self.notifier.watchdog()

    def alive(self) -> bool:
        """What /healthz answers: the loop beat recently."""
        return self.host.monotonic() - self._beat_at < HEALTHZ_STALE_S

    def within(self, seconds: float) -> Callable[[], float]:
        """A fixed deadline ``seconds`` from now, for ``wait``."""
        until = self.host.monotonic() + seconds
        return lambda: until

    async def sleep_unless(self, stop: asyncio.Event, seconds: float) -> bool:
        """Sleep ``seconds`` on the host's clock, beating; True (at once) if ``stop`` is set
        meanwhile."""
        sleeper = asyncio.ensure_future(self.host.sleep(seconds))
        stopper = asyncio.ensure_future(stop.wait())
        both = asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        await self.wait(both, self.within(seconds))
        for t in (sleeper, stopper):
            t.cancel()
        return stop.is_set()

    async def wait(self, work: Awaitable[T], deadline: Callable[[], float],
                   on_tick: Callable[[], Awaitable[None]] | None = None) -> T:
        """Await ``work`` in slices of ``tick_s``, beating while it is within ``deadline()``."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.tick_s)
                if done:
                    self.beat()
                    return task.result()
                overdue = self.host.monotonic() - deadline()
                if overdue <= STUCK_SLACK_S:
                    self.beat()
                elif not self._stuck_noted:
                    self._stuck_noted = True
                    self.publish(
                        SupervisorStuck(at=self.host.wall(), state=self.state(),
                                        overdue_s=round(overdue, 1)))
                if on_tick is not None:
                    await on_tick()
        finally:
            if not task.done():
                task.cancel()
