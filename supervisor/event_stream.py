"""The one event stream: frozen records of everything that changes, published once, read by subscribers.

The supervisor publishes; logging, metrics, the systemd notifier, the /status history and the
state file subscribe (the gateway and the alert hooks will too). Each subscriber reads from its
own bounded queue in its own task, so a slow or failing subscriber never delays supervision:
when its queue is full the event is dropped for that subscriber alone and counted.

(Not ``events.py``: supervisord, which vLLM installs, has a module of that name in its own
``supervisor`` package.)
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import structlog

log = structlog.get_logger("supervisor.event_stream")


@dataclass(frozen=True, kw_only=True)
class Event:
    """One thing that happened; ``name`` is the structlog event name, ``at`` the wall clock."""

    name: ClassVar[str]
    level: ClassVar[str] = "info"
    at: float

    def log_level(self) -> str:
        return self.level

    def fields(self) -> dict[str, Any]:
        """The record's own fields (not ``at``), JSON-ready."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self) if f.name != "at"}


@dataclass(frozen=True, kw_only=True)
class SupervisorStarted(Event):
    name = "supervisor.started"
    admin: str
    engine: str
    profile: Mapping[str, Any]
    state_dir: str


@dataclass(frozen=True, kw_only=True)
class StopRequested(Event):
    name = "supervisor.stop_requested"
    reason: str


@dataclass(frozen=True, kw_only=True)
class StateChanged(Event):
    """The engine state moved along one edge of the lifecycle."""

    name = "engine.state_changed"
    old: str
    new: str
    after_s: float  # time spent in ``old``
    profile: Mapping[str, Any]
    restarts: int
    info: Mapping[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        out = {"from": self.old, "to": self.new, "after_s": self.after_s}
        return {**out, **{k: _jsonable(v) for k, v in self.info.items()}}


@dataclass(frozen=True, kw_only=True)
class ProfileRestored(Event):
    """At start: the profile learned by an earlier run, below what is configured."""

    name = "engine.profile_restored"
    profile: Mapping[str, Any]
    below_configured: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class ProfileLowered(Event):
    name = "engine.profile_lowered"
    level = "warning"
    diff: Mapping[str, Any]
    profile: Mapping[str, Any]
    kind: str
    evidence: str


@dataclass(frozen=True, kw_only=True)
class ProfileRaised(Event):
    name = "engine.profile_raised"
    diff: Mapping[str, Any]
    profile: Mapping[str, Any]
    reason: str


@dataclass(frozen=True, kw_only=True)
class EngineSpawned(Event):
    name = "engine.spawned"
    pid: int
    start: int
    argv: tuple[str, ...]  # secrets already masked
    standby: bool = False  # an interpreter that had imported vLLM already became this engine


@dataclass(frozen=True, kw_only=True)
class RungPrecompiled(Event):
    """A throwaway engine compiled a rung's graphs into vLLM's cache ahead of need (or failed to)."""

    name = "engine.rung_precompiled"
    profile: Mapping[str, Any]
    ok: bool
    took_s: float
    error: str | None = None

    def log_level(self) -> str:
        return "info" if self.ok else "warning"


@dataclass(frozen=True, kw_only=True)
class EngineStopped(Event):
    name = "engine.stopped"
    pids: tuple[int, ...]
    sigkilled: tuple[int, ...]
    survivors: tuple[int, ...]
    returncode: int | None
    kill_s: float
    drain_s: float
    gpu_release_s: float
    planned: bool = False  # a stop the supervisor chose (SIGTERM, a climb, a restart): it should never need SIGKILL


@dataclass(frozen=True, kw_only=True)
class FailureDetected(Event):
    name = "engine.failure_detected"
    level = "warning"
    trigger: str
    evidence: str
    state: str


@dataclass(frozen=True, kw_only=True)
class FailureClassified(Event):
    name = "engine.failed"
    level = "warning"
    kind: str
    evidence: str
    trigger: str
    phase: str
    returncode: int | None
    suspect_request: str | None
    failure: Mapping[str, Any]
    incident: str | None


@dataclass(frozen=True, kw_only=True)
class Recovered(Event):
    name = "engine.recovered"
    kind: str | None
    recovered_after_s: float
    profile: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class Stable(Event):
    name = "engine.stable"
    ready_for_s: float


@dataclass(frozen=True, kw_only=True)
class Fatal(Event):
    name = "supervisor.fatal"
    level = "error"
    reason: str
    exit_code: int
    failure: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class LearnedChanged(Event):
    """What the supervisor learned changed; the state file subscriber persists it."""

    name = "state.learned"
    level = "debug"
    profile: Mapping[str, Any]
    rung_failures: Mapping[str, int]
    last_failure: Mapping[str, Any] | None
    restarts_total: int


@dataclass(frozen=True, kw_only=True)
class Reloading(Event):
    """SIGHUP or `vllm-supervisor reload`: the config file is read again."""

    name = "supervisor.reloading"
    source: str


@dataclass(frozen=True, kw_only=True)
class Reloaded(Event):
    name = "supervisor.reloaded"
    changed: tuple[str, ...]  # the sections that differ
    engine_restart: bool  # engine settings changed: the engine is restarted (planned)


@dataclass(frozen=True, kw_only=True)
class ReloadFailed(Event):
    """The new config is invalid: the supervisor keeps running on the old one."""

    name = "supervisor.reload_failed"
    level = "error"
    error: str


@dataclass(frozen=True, kw_only=True)
class PlannedRestart(Event):
    name = "engine.planned_restart"
    reason: str


@dataclass(frozen=True, kw_only=True)
class RequestQuarantined(Event):
    """A request that killed the engine again is refused from now on (published by the gateway)."""

    name = "gateway.request_quarantined"
    level = "warning"
    request_hash: str  # of the content: never the text itself
    prompt_tokens: int | None
    evidence: str


@dataclass(frozen=True, kw_only=True)
class RequestRejected(Event):
    """The gateway answered a request itself (413, 429, 503); at most one record per code and second."""

    name = "gateway.request_rejected"
    status: int
    code: str
    request_id: str
    count: int = 1  # rejections with this code since the last record (the first of them named)

    def log_level(self) -> str:
        return "warning" if self.status == 413 else "info"


@dataclass(frozen=True, kw_only=True)
class RequestReplayed(Event):
    """A request the engine lost before it sent the client anything goes to the new engine."""

    name = "gateway.request_replayed"
    request_id: str
    replays: int
    alone: bool  # the suspect of the death, sent alone first


@dataclass(frozen=True, kw_only=True)
class SheddingChanged(Event):
    """The gateway started (reason) or stopped (empty) shedding new requests with 429."""

    name = "gateway.shedding"
    reason: str
    everyone: bool = False  # the KV cache is full: every new request; else only prompts that need new memory

    def log_level(self) -> str:
        return "warning" if self.reason else "info"


@dataclass(frozen=True, kw_only=True)
class GatewayDrained(Event):
    """Before a planned stop of the engine: what the gateway let finish, and what it had to cut."""

    name = "gateway.drained"
    why: str
    in_flight: int  # at the engine when the drain began
    waited_s: float
    cut: int


@dataclass(frozen=True, kw_only=True)
class AlertOutcome(Event):
    """What became of one alert on one hook: sent, failed (after the retries), suppressed, dropped."""

    name = "alert.outcome"
    channel: str
    alert: str
    severity: str
    outcome: str
    error: str = ""

    def log_level(self) -> str:
        return "info" if self.outcome == "sent" else "warning"


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool, type(None))):
        return v
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)


Handler = Callable[[Event], Awaitable[None] | None]


@dataclass
class Subscription:
    name: str
    handler: Handler
    queue: asyncio.Queue[Event]
    dropped: int = 0
    failed: int = 0
    task: asyncio.Task[None] | None = None


class EventBus:
    """Publish once; every subscriber gets the event on its own bounded queue."""

    def __init__(self, queue_size: int = 1000) -> None:
        self.queue_size = queue_size
        self.subscriptions: list[Subscription] = []

    def subscribe(self, name: str, handler: Handler, queue_size: int | None = None) -> Subscription:
        sub = Subscription(name, handler, asyncio.Queue(queue_size or self.queue_size))
        self.subscriptions.append(sub)
        return sub

    def publish(self, event: Event) -> None:
        """Never blocks and never raises: a full queue drops the event for that subscriber only."""
        for sub in self.subscriptions:
            try:
                sub.queue.put_nowait(event)
            except asyncio.QueueFull:
                sub.dropped += 1

    def start(self) -> None:
        for sub in self.subscriptions:
            if sub.task is None:
                sub.task = asyncio.create_task(self._deliver(sub), name=f"subscriber:{sub.name}")

    async def _deliver(self, sub: Subscription) -> None:
        while True:
            event = await sub.queue.get()
            try:
                result = sub.handler(event)
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:  # noqa: BLE001 - a subscriber's bug must not stop the others
                sub.failed += 1
                log.error("event_stream.subscriber_failed", subscriber=sub.name, event_name=event.name,
                          error=f"{type(exc).__name__}: {exc}")
            finally:
                sub.queue.task_done()

    async def drain_one(self, name: str) -> None:
        """Wait until subscriber ``name`` has handled what is queued for it."""
        await next(s for s in self.subscriptions if s.name == name).queue.join()

    async def drain(self) -> None:
        """Wait until every running subscriber has handled what is queued."""
        await asyncio.gather(*(s.queue.join() for s in self.subscriptions if s.task))

    async def close(self, flush_s: float = 5.0) -> None:
        """Deliver what is queued (bounded by ``flush_s`` in all), then stop every subscriber."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.drain(), flush_s)
        for sub in self.subscriptions:
            if sub.task is not None:
                sub.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sub.task
                sub.task = None

    def counters(self) -> dict[str, dict[str, int]]:
        return {s.name: {"dropped": s.dropped, "failed": s.failed, "queued": s.queue.qsize()}
                for s in self.subscriptions}
