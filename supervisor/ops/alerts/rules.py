"""Which events page whom: the event stream turned into typed alerts, deduplicated, escalated
(pure).

An alert is a frozen record a channel can send as it is. The rules keep just enough memory to
deduplicate (the same alert within ``dedup_window_s`` is sent once), to escalate (restarts that
keep repeating become an ``error``), and to give each outage a stable ``dedup_key``.

Every alert that can page names the condition whose end clears it (``clears_on``): ``ready`` (the
engine READY again: a restart, a hang, an outage, a FATAL of an earlier supervisor), ``profile``
(back at the configured profile) or ``reload`` (a reload that succeeded, or a supervisor that
started on the file). ``cleared`` says which conditions an event ends; the dispatcher resolves every
open page waiting on them. An alert with no ``clears_on`` only notifies: it never opens a page
(PagerDuty never gets it as a trigger).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from supervisor.config import SEVERITIES, AlertsConfig
from supervisor.engine_states import EngineState, FailureKind
from supervisor.event_stream import (
    Event,
    FailureClassified,
    Fatal,
    ProfileLowered,
    ProfileRaised,
    Recovered,
    Reloaded,
    ReloadFailed,
    RequestQuarantined,
    StateChanged,
    SupervisorStarted,
)
from supervisor.profile import Profile

# Which alerts can open a page, and what ends it (docs/operations.md says the same for on-call).
CLEARS_ON = {
    "outage": "ready", "fatal": "ready", "engine_restarted": "ready", "hang_detected": "ready",
    "profile_lowered": "profile", "config_reload_failed": "reload"
}


def rank(severity: str) -> int:
    return SEVERITIES.index(severity)


def rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


@dataclass(frozen=True)
class Alert:
    """One thing worth telling a person; ``as_json`` is what a webhook receives."""

    # engine_restarted, profile_lowered, profile_raised, recovered, hang_detected, outage, fatal,
    # ...
    event: str
    severity: str
    host: str
    message: str
    at: float
    dedup_key: str
    kind: str | None = None  # the failure kind, where there is one
    details: dict[str, Any] = field(default_factory=dict)
    resolves: bool = False  # PagerDuty resolves ``dedup_key`` instead of triggering
    # the condition whose end resolves this page; None: it only notifies
    clears_on: str | None = None

    @property
    def time(self) -> str:
        return rfc3339(self.at)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "event": self.event, "severity": self.severity, "host": self.host,
            "message": self.message, "time": self.time, "dedup_key": self.dedup_key
        }
        if self.kind:
            out["kind"] = self.kind
        if self.details:
            out["details"] = self.details
        return out


class AlertRules:
    """Feed it the event stream (and clock ticks for outages); it returns the alerts to send."""

    def __init__(self, cfg: AlertsConfig, host: str, started_at: float,
                 configured: Profile | None = None) -> None:
        self.cfg = cfg
        self.host = host
        self.configured = configured  # [profile] as configured: the "profile" condition ends there
        self.serving: Profile | None = None  # the profile of the last READY
        self.not_ready_since: float | None = started_at
        self.outage_key: str | None = None  # set once an outage alert went out, until the recovery
        self.last_failure: FailureClassified | None = None
        self.restarts: deque[float] = deque()
        self.sent_at: dict[tuple[str, str | None], float] = {}

    def _alert(self, event: str, severity: str, message: str, at: float, kind: str | None = None,
               details: dict[str, Any] | None = None, dedup_key: str | None = None,
               resolves: bool = False) -> Alert:
        key = dedup_key or f"vllm-supervisor/{self.host}/{event}"
        return Alert(event, severity, self.host, message, at, key, kind, details or {}, resolves,
                     CLEARS_ON.get(event))

    def cleared(self, ev: Event) -> list[str]:
        """The conditions ``ev`` ends: their open pages are resolved."""
        if isinstance(ev, StateChanged) and ev.new is EngineState.READY:
            self.serving = ev.profile
            return ["ready", "profile"] if self._back_at_configured() else ["ready"]
        if isinstance(ev, Reloaded):
            if ev.configured_profile is not None:
                self.configured = ev.configured_profile
            return ["reload", "profile"] if self._back_at_configured() else ["reload"]
        if isinstance(ev, SupervisorStarted):
            # a supervisor started on this file: the refused reload an earlier one paged is moot
            return ["reload"]
        return []

    def _back_at_configured(self) -> bool:
        """READY at (or above) the configured profile, however it got there: a climb,
        `reset-profile`, a reload that lowered [profile], a restart. Compared knob by knob as
        vLLM runs them: a lowering makes knobs explicit (``enable_chunked_prefill``, a default
        it stepped down from) that a climb leaves so."""
        return self.configured is not None and self.serving is not None and self.serving.reaches(
            self.configured)

    def on_event(self, ev: Event, now: float) -> list[Alert]:
        """Alerts for one stream event; ``now`` is the monotonic clock (the outage timer)."""
        out = self._map(ev, now)
        return [a for a in out if self._fresh(a, now)]

    def _map(self, ev: Event, now: float) -> list[Alert]:
        if isinstance(ev, StateChanged):
            # The lifecycle says whether the engine is out of service and since how long (one
            # definition).
            self.not_ready_since = None if ev.outage_s is None else now - ev.outage_s
            if ev.new is EngineState.READY:
                self.outage_key = None  # its page is resolved by the "ready" condition
            if ev.new is EngineState.BACKOFF:
                return [self._restarted(ev, now)]
            return []
        if isinstance(ev, FailureClassified):
            self.last_failure = ev
            if ev.kind is FailureKind.HANG:
                return [
                    self._alert("hang_detected", "warning", f"engine hung: {ev.evidence}", ev.at,
                                ev.kind.value, {"incident": ev.incident})
                ]
            return []
        if isinstance(ev, ProfileLowered):
            return [
                self._alert("profile_lowered", "warning", f"profile lowered after {ev.kind.value}: "
                            f"{_diff(ev.diff)}", ev.at, ev.kind.value,
                            {"profile": ev.profile.knobs()})
            ]
        if isinstance(ev, ProfileRaised):
            return [
                self._alert("profile_raised", "info", f"profile raised: {_diff(ev.diff)}", ev.at,
                            details={"profile": ev.profile.knobs()})
            ]
        if isinstance(ev, Recovered):
            kind = ev.kind.value if ev.kind else None
            return [
                self._alert(
                    "recovered", "info", f"engine READY again {ev.recovered_after_s:.0f}s after "
                    f"the {kind or 'failure'}", ev.at, kind,
                    {"recovered_after_s": ev.recovered_after_s, "profile": ev.profile.knobs()})
            ]
        if isinstance(ev, RequestQuarantined):
            return [
                self._alert(
                    "request_quarantined", "warning", f"a request that killed the engine twice is "
                    f"quarantined ({ev.prompt_tokens} prompt tokens): {ev.evidence}", ev.at,
                    FailureKind.RUNTIME_OOM.value, {"request_hash": ev.request_hash})
            ]
        if isinstance(ev, ReloadFailed):
            return [
                self._alert(
                    "config_reload_failed", "warning",
                    "config reload refused, still running on the old "
                    f"config: {ev.error}", ev.at)
            ]
        if isinstance(ev, Fatal):
            kind = ev.failure.kind.value if ev.failure else None
            return [
                self._alert("fatal", "critical",
                            f"supervisor gave up (exit {ev.exit_code}): {ev.reason}", ev.at, kind, {
                                "exit_code": ev.exit_code,
                                "failure": ev.failure.as_dict() if ev.failure else {}
                            }, dedup_key=self._outage_key(ev.at))
            ]
        return []

    def _restarted(self, ev: StateChanged, now: float) -> Alert:
        while self.restarts and now - self.restarts[0] > self.cfg.escalate_window_s:
            self.restarts.popleft()
        self.restarts.append(now)
        f = self.last_failure
        kind = f.kind.value if f else None
        msg = (f"engine restarted after {kind or 'a failure'}: "
               f"{f.evidence if f else ev.reason or ''}")
        severity = "warning"
        if len(self.restarts) >= self.cfg.escalate_after:
            severity = "error"  # restarts keep repeating: a person should look
            msg = f"{len(self.restarts)} restarts in {self.cfg.escalate_window_s:g}s; last: {msg}"
        return self._alert("engine_restarted", severity, msg, ev.at, kind,
                           {"restarts": ev.restarts + 1, "incident": f.incident if f else None,
                            "delay_s": ev.delay_s})

    def tick(self, now: float, wall: float) -> list[Alert]:
        """The outage rule: not READY for ``page_after_s`` pages once per outage."""
        since = self.not_ready_since
        if since is None or self.outage_key is not None or now - since < self.cfg.page_after_s:
            return []
        key = self._outage_key(wall)
        f = self.last_failure
        msg = (f"engine not READY for {now - since:.0f}s (page_after_s={self.cfg.page_after_s:g})"
               + (f"; last failure {f.kind}: {f.evidence}" if f else ""))
        return [self._alert("outage", "error", msg, wall, f.kind.value if f else None,
                            {"not_ready_for_s": round(now - since, 1)}, dedup_key=key)]

    def _outage_key(self, wall: float) -> str:
        if self.outage_key is None:
            self.outage_key = f"vllm-supervisor/{self.host}/outage/{int(wall)}"
        return self.outage_key

    def _fresh(self, a: Alert, now: float) -> bool:
        """Deduplication: the same alert (event and kind) within ``dedup_window_s`` goes out
        once."""
        if a.event in ("recovered", "fatal", "outage") or a.severity == "error":
            return True  # state changes a person must see every time
        key = (a.event, a.kind)
        last = self.sent_at.get(key)
        if last is not None and now - last < self.cfg.dedup_window_s:
            return False
        self.sent_at[key] = now
        return True


def _diff(diff: Any) -> str:
    return ", ".join(f"{k} {a} -> {b}" for k, (a, b) in dict(diff).items())
