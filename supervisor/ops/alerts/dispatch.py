"""The alerts subscriber: stream events → rules → one bounded queue and task per hook → the service.

Sending never delays supervision: the subscriber only enqueues; each hook sends from its own task,
retrying with tenacity (capped in attempts and in time, exponential backoff with jitter) on
SendFailed alone. A failing hook is logged and counted, never fatal. Each hook has a rate limit
(critical alerts pass it), and a recovery's resolve goes to every hook that got the trigger it
resolves. ``close`` flushes what is pending for at most ``flush_s`` (before a FATAL exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from supervisor.config import AlertsConfig, HookConfig
from supervisor.event_stream import AlertOutcome, Event
from supervisor.ops.alerts.channels import Channel, SendFailed, make_channel
from supervisor.ops.alerts.rules import Alert, AlertRules, rank

log = structlog.get_logger("supervisor.alerts")
HOUR = 3600.0


@dataclass
class HookState:
    hook: HookConfig
    channel: Channel
    queue: asyncio.Queue[Alert] = field(default_factory=lambda: asyncio.Queue(100))
    recent: deque[float] = field(default_factory=deque)  # send times within the last hour
    triggered: set[str] = field(default_factory=set)  # dedup keys this hook was paged with
    task: asyncio.Task[None] | None = None


class Alerts:
    def __init__(self, cfg: AlertsConfig, channels: list[tuple[HookConfig, Channel]],
                 publish: Callable[[Event], None], *, monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, tick_s: float = 1.0, retry_wait_s: float = 0.5) -> None:
        self.cfg = cfg
        self.publish = publish
        self.monotonic, self.wall, self.tick_s, self.retry_wait_s = monotonic, wall, tick_s, retry_wait_s
        self.host = cfg.host or socket.gethostname()
        self.rules = AlertRules(cfg, self.host, monotonic())
        self.hooks = [HookState(h, c) for h, c in channels]
        self._ticker: asyncio.Task[None] | None = None

    @classmethod
    def from_config(cls, cfg: AlertsConfig, publish: Callable[[Event], None]) -> Alerts:
        """Build every hook's channel; raises MissingSecret naming the field when a secret is absent."""
        return cls(cfg, [(h, make_channel(h)) for h in cfg.hooks], publish)

    def on_event(self, event: Event) -> None:
        for alert in self.rules.on_event(event, self.monotonic()):
            self.fan_out(alert)

    def fan_out(self, alert: Alert) -> None:
        now = self.monotonic()
        for h in self.hooks:
            if alert.resolves:
                if alert.dedup_key not in h.triggered:
                    continue
                h.triggered.discard(alert.dedup_key)
            elif rank(alert.severity) < rank(h.hook.severity_floor):
                continue
            while h.recent and now - h.recent[0] > HOUR:
                h.recent.popleft()
            if alert.severity != "critical" and len(h.recent) >= h.hook.max_per_hour:
                self._outcome(h, alert, "suppressed", f"rate limit: {h.hook.max_per_hour} per hour")
                continue
            try:
                h.queue.put_nowait(alert)
            except asyncio.QueueFull:
                self._outcome(h, alert, "dropped", "the hook's queue is full (it is not keeping up)")
                continue
            h.recent.append(now)
            if not alert.resolves and h.hook.type == "pagerduty":
                h.triggered.add(alert.dedup_key)

    def start(self) -> None:
        for h in self.hooks:
            if h.task is None:
                h.task = asyncio.create_task(self._deliver(h), name=f"alerts:{h.hook.name}")
        if self._ticker is None and self.hooks:
            self._ticker = asyncio.create_task(self._tick(), name="alerts:outage-timer")

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            for alert in self.rules.tick(self.monotonic(), self.wall()):
                self.fan_out(alert)

    async def _deliver(self, h: HookState) -> None:
        while True:
            alert = await h.queue.get()
            try:
                await self._send(h, alert)
                self._outcome(h, alert, "sent", "")
            except Exception as exc:  # noqa: BLE001 - a broken hook is counted and logged, never fatal
                self._outcome(h, alert, "failed", str(exc) if isinstance(exc, SendFailed) else type(exc).__name__)
            finally:
                h.queue.task_done()

    async def _send(self, h: HookState, alert: Alert) -> None:
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(SendFailed),
            stop=stop_after_attempt(h.hook.attempts) | stop_after_delay(h.hook.retry_for_s),
            wait=wait_exponential_jitter(multiplier=self.retry_wait_s, max=10.0, jitter=self.retry_wait_s),
            reraise=True)
        async for attempt in retrying:
            with attempt:
                await h.channel.send(alert)

    def _outcome(self, h: HookState, alert: Alert, outcome: str, error: str) -> None:
        self.publish(AlertOutcome(at=self.wall(), channel=h.hook.name, alert=alert.event, severity=alert.severity,
                                  outcome=outcome, error=error))

    async def close(self) -> None:
        """Send what is pending for at most ``flush_s``, then stop every hook."""
        if self._ticker is not None:
            self._ticker.cancel()
        pending = [h.queue.join() for h in self.hooks if h.task is not None]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*pending), self.cfg.flush_s)
        for h in self.hooks:
            if h.task is not None:
                h.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await h.task
                h.task = None
            await h.channel.close()
