"""The alerts subscriber: stream events → rules → bounded queues and tasks per hook → the service.

Sending never delays supervision: the subscriber only enqueues; each hook sends from its own tasks
(critical alerts in a lane of their own), retrying with tenacity (capped in attempts and in time,
exponential backoff with jitter, the service's Retry-After when it gives one) while the service says
to try again. A failing hook is logged and counted, never fatal. Each hook has a rate limit
(critical alerts pass it). A page (PagerDuty) stays open in ``<state dir>/pages.json`` until the
condition that clears it ends, then it is resolved with its own dedup_key, by this supervisor or the
next. ``close`` flushes what is pending for at most ``flush_s`` (before a FATAL exit) and logs what
it had to drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from supervisor.aio import cancel_and_wait
from supervisor.config import AlertsConfig, HookConfig
from supervisor.event_stream import AlertOutcome, Event
from supervisor.ops.alerts.channels import Channel, SendFailed, make_channel
from supervisor.ops.alerts.pages import OpenPages
from supervisor.ops.alerts.rules import Alert, AlertRules, rank
from supervisor.profile import Profile

log = structlog.get_logger("supervisor.alerts")
HOUR = 3600.0


@dataclass
class HookState:
    hook: HookConfig
    channel: Channel
    queue: asyncio.Queue[Alert] = field(default_factory=lambda: asyncio.Queue(100))
    # critical: its own lane
    urgent: asyncio.Queue[Alert] = field(default_factory=lambda: asyncio.Queue(20))
    recent: deque[float] = field(default_factory=deque)  # send times within the last hour
    # lane -> the alert being sent (or retried) now
    sending: dict[str, Alert] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def pages(self) -> bool:
        """This hook opens pages that must be resolved (PagerDuty, Alertmanager)."""
        return self.hook.type in ("pagerduty", "alertmanager")

    @property
    def page_key(self) -> str:
        """Which service account its pages live in, stable across restarts and config reorderings
        (two PagerDuty hooks with different routing keys keep their pages apart)."""
        return f"{self.hook.type}:{self.hook.endpoint}:{self.hook.routing_key_env}"


class Alerts:
    def __init__(self, cfg: AlertsConfig, channels: list[tuple[HookConfig, Channel]],
                 publish: Callable[[Event], None], *,
                 monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, tick_s: float = 1.0,
                 retry_wait_s: float = 0.5, state_dir: str | None = None,
                 configured: Profile | None = None) -> None:
        self.cfg = cfg
        self.publish = publish
        self.monotonic, self.wall = monotonic, wall
        self.tick_s, self.retry_wait_s = tick_s, retry_wait_s
        self.host = cfg.hostname()
        self.rules = AlertRules(cfg, self.host, monotonic(), configured)
        self.hooks = [HookState(h, c) for h, c in channels]
        self.pages = OpenPages(state_dir)
        # for /status and `status`
        self.stats: dict[str, dict[str, Any]] = {h.hook.name: {} for h in self.hooks}
        self._ticker: asyncio.Task[None] | None = None

    @classmethod
    def from_config(cls, cfg: AlertsConfig, publish: Callable[[Event], None],
                    state_dir: str | None = None, configured: Profile | None = None) -> Alerts:
        """Build every hook's channel; raises MissingSecret naming the field when a secret is
        absent."""
        secrets = cfg.withheld()
        return cls(cfg, [(h, make_channel(h, secrets)) for h in cfg.hooks], publish,
                   state_dir=state_dir, configured=configured)

    def on_event(self, event: Event) -> None:
        for alert in self.rules.on_event(event, self.monotonic()):
            self.fan_out(alert)
        conditions = self.rules.cleared(event)
        if conditions:
            self.resolve(conditions)

    def resolve(self, conditions: list[str]) -> None:
        """The pages waiting on these conditions are resolved, each with its own dedup_key, on
        the hook that opened it (also pages a supervisor before this one opened: they are kept
        in the state dir)."""
        for h in self.hooks:
            for key, page in self.pages.closing(h.page_key, conditions):
                alert = Alert(
                    f"{page.get('event', 'page')}_resolved", "info", self.host,
                    f"resolved: {page.get('event', 'the condition')} is over "
                    f"({', '.join(conditions)})",
                    self.wall(), key, details={"opened_as": page}, resolves=True)
                # In the page's own lane: a resolve overtaking its trigger on another lane would
                # leave PagerDuty (or Alertmanager, for 24 h) with a page opened after it was
                # resolved.
                self._enqueue(h, alert, lane_of=str(page.get("severity", "info")))

    def fan_out(self, alert: Alert) -> None:
        now = self.monotonic()
        for h in self.hooks:
            if rank(alert.severity) < rank(h.hook.severity_floor):
                continue
            if h.pages and alert.clears_on is None:
                continue  # notify-only: never a page nobody could resolve
            while h.recent and now - h.recent[0] > HOUR:
                h.recent.popleft()
            if alert.severity != "critical" and len(h.recent) >= h.hook.max_per_hour:
                self._outcome(h, alert, "suppressed", f"rate limit: {h.hook.max_per_hour} per hour")
                continue
            if self._enqueue(h, alert):
                h.recent.append(now)
                if h.pages and alert.clears_on is not None:
                    self.pages.opened(h.page_key, alert.dedup_key, alert.clears_on, alert.event,
                                      alert.at, alert.severity)

    def _enqueue(self, h: HookState, alert: Alert, lane_of: str | None = None) -> bool:
        lane = h.urgent if (lane_of or alert.severity) == "critical" else h.queue
        try:
            lane.put_nowait(alert)
        except asyncio.QueueFull:
            self._outcome(h, alert, "dropped", "the hook's queue is full (it is not keeping up)")
            return False
        return True

    def start(self) -> None:
        for h in self.hooks:
            if not h.tasks:
                h.tasks = [
                    asyncio.create_task(self._deliver(h, "urgent", h.urgent),
                                        name=f"alerts:{h.hook.name}:!"),
                    asyncio.create_task(self._deliver(h, "normal", h.queue),
                                        name=f"alerts:{h.hook.name}")
                ]
        if self._ticker is None and self.hooks:
            self._ticker = asyncio.create_task(self._tick(), name="alerts:outage-timer")

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            for alert in self.rules.tick(self.monotonic(), self.wall()):
                self.fan_out(alert)

    async def _deliver(self, h: HookState, lane: str, queue: asyncio.Queue[Alert]) -> None:
        """One lane of one hook: critical alerts have their own, so a hook busy retrying old
        warnings still gets the page that matters at once."""
        while True:
            alert = await queue.get()
            h.sending[lane] = alert
            try:
                await self._send(h, alert)
                self._outcome(h, alert, "sent", "")
            # a broken hook is counted and logged, never fatal
            except Exception as exc:  # noqa: BLE001
                self._outcome(h, alert, "failed",
                              str(exc) if isinstance(exc, SendFailed) else type(exc).__name__)
            finally:
                h.sending.pop(lane, None)
                queue.task_done()

    async def _send(self, h: HookState, alert: Alert) -> None:
        """Retried while the service says to try again (5xx, 408, 429, a timeout), after its
        Retry-After when it gives one; never after any other 4xx, which says the request
        itself is wrong."""
        backoff = wait_exponential_jitter(multiplier=self.retry_wait_s, max=10.0,
                                          jitter=self.retry_wait_s)

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            after = exc.retry_after if isinstance(exc, SendFailed) else None
            return after if after is not None else float(backoff(state))

        retrying = AsyncRetrying(
            retry=retry_if_exception(lambda e: isinstance(e, SendFailed) and e.retryable),
            stop=stop_after_attempt(h.hook.attempts) | stop_after_delay(h.hook.retry_for_s),
            wait=wait, reraise=True)
        async for attempt in retrying:
            with attempt:
                await h.channel.send(alert)

    def status(self) -> dict[str, dict[str, Any]]:
        """Per hook: alerts by outcome, and the last error (what `vllm-supervisor status` shows
        when one fails)."""
        return {name: dict(s) for name, s in self.stats.items()}

    def _outcome(self, h: HookState, alert: Alert, outcome: str, error: str) -> None:
        s = self.stats.setdefault(h.hook.name, {})
        s[outcome] = s.get(outcome, 0) + 1
        if outcome in ("failed", "dropped"):
            s["last_error"], s["last_failed_at"] = error, self.wall()
        elif outcome == "sent":
            s["last_sent_at"] = self.wall()
        self.publish(
            AlertOutcome(at=self.wall(), channel=h.hook.name, alert=alert.event,
                         severity=alert.severity, outcome=outcome, error=error))

    async def close(self) -> None:
        """Send what is pending for at most ``flush_s`` (critical alerts in their own lane), then
        stop every hook; whatever is left unsent is logged as an ``alert.outcome`` ``dropped``
        (the event stream is closed by now)."""
        if self._ticker is not None:
            self._ticker.cancel()
        pending = [q.join() for h in self.hooks if h.tasks for q in (h.urgent, h.queue)]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*pending), self.cfg.flush_s)
        for h in self.hooks:
            left = [*h.sending.values()]
            for q in (h.urgent, h.queue):
                while not q.empty():
                    left.append(q.get_nowait())
            await cancel_and_wait(*h.tasks)
            h.tasks = []
            for alert in left:
                log.warning(
                    "alert.outcome", channel=h.hook.name, alert=alert.event,
                    severity=alert.severity, outcome="dropped",
                    error=f"not delivered within [alerts] flush_s={self.cfg.flush_s:g}s "
                    "of the supervisor's exit")
            await h.channel.close()
