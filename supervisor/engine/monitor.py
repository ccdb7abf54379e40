"""Watching a serving engine: /health and /metrics every probe interval, and a canary now and then.

vLLM keeps /health at 200 while its engine is wedged, so liveness comes from real progress: token
counters that move while work is pending, and a canary generation that answers in time (the rules
are pure, in decide/liveness.py). What this module adds is the probing itself and the bounds on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from supervisor.bounds import STEP_SLACK_S
from supervisor.config import HealthConfig
from supervisor.decide.liveness import Liveness
from supervisor.engine_states import TriggerKind
from supervisor.event_stream import CanaryFailed, Event
from supervisor.host import Host
from supervisor.host.vllm_http import EngineClient, EngineError, EngineStatusError

Fired = tuple[TriggerKind, str]

# A start's /health is asked this often: every second between asks is outage on a restart's path
# (half a second in mean when the asks slowed to one per 0.5 s). A refused connection costs
# microseconds, and vLLM listens only once its engine is up.
START_HEALTH_POLL_S = 0.05


class Monitor:
    def __init__(self, health: HealthConfig, host: Host, client: EngineClient,
                 publish: Callable[[Event], None], liveness: Liveness, canary_id: str) -> None:
        self.h, self.host, self.client = health, host, client
        self.publish, self.live = publish, liveness
        self.canary_id = canary_id
        self._canary: asyncio.Task[None] | None = None

    def round_bound_s(self) -> float:
        """How long one probe round may take (the watchdog's measure)."""
        return self.h.probe_interval_s + 2 * min(self.h.hang_timeout_s, 5.0) + STEP_SLACK_S

    async def until_healthy(self) -> Fired | None:
        """Ask /health until it answers 200 (None), or until the start is overdue (its liveness
        rule)."""
        while True:
            if await self.client.health(timeout=2.0) == 200:
                return None
            overdue = self.live.start_overdue(self.host.monotonic())
            if overdue:
                return TriggerKind.HANG, overdue
            await self.host.sleep(START_HEALTH_POLL_S)

    async def until_fired(self, on_round: Callable[[], None]) -> Fired:
        """Probe until a rule fires; ``on_round`` runs at the start of each round."""
        h, live = self.h, self.live
        probe_timeout = min(h.hang_timeout_s, 5.0)
        bad_health = 0
        try:
            while True:
                await self.host.sleep(h.probe_interval_s)
                on_round()
                now = self.host.monotonic()
                status = await self.client.health(timeout=probe_timeout)
                # vLLM's own 503 after a death, or any other error
                if status is not None and status >= 500:
                    bad_health += 1
                    if bad_health >= h.unhealthy_probes:
                        return TriggerKind.DEATH, (f"/health returned {status} {bad_health} times "
                                                   "in a row")
                else:
                    bad_health = 0
                try:
                    progress = await self.client.metrics(timeout=probe_timeout)
                except EngineError:
                    progress = None
                later = self.host.monotonic()
                hang = (live.metrics(later, progress) or live.canary_overdue(later)
                        or live.canary_failing())
                if hang:
                    return TriggerKind.HANG, hang
                if live.canary_due(now):
                    live.canary_sent(now)
                    self._canary = asyncio.create_task(self._send_canary())
        finally:
            self.stop()

    async def _send_canary(self) -> None:
        h = self.h
        try:
            # The rule decides "no answer" from the clock; the request's own timeout only bounds it.
            await self.client.complete("Hello", h.canary_max_tokens, timeout=h.hang_timeout_s * 2,
                                       request_id=f"{self.canary_id}-{int(self.host.wall())}")
        except EngineStatusError as exc:
            self.publish(CanaryFailed(at=self.host.wall(), status=exc.status, error=str(exc)))
            if exc.status >= 500:
                self.live.canary_failed(str(exc)[:200])
                return
        except EngineError:
            # no answer: the liveness rule fires on the clock, unless work that progressed held
            # it off past its deadline
            self.live.canary_unanswered(self.host.monotonic())
            return
        self.live.canary_done()

    def stop(self) -> None:
        if self._canary is not None:
            self._canary.cancel()
