"""What the lifecycle counts: this supervisor's tally of the engine's life, and what outlives it
(state.json)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from supervisor.decide.policy import Decision
from supervisor.engine_states import FailureKind
from supervisor.event_stream import LearnedChanged, Ready
from supervisor.profile import Profile


@dataclass
class Remembered:
    """What outlives this supervisor process (state.json): restarts, the last failure, the
    slowest start."""

    restarts_total: int = 0
    last_failure: dict[str, Any] | None = None
    # start -> READY, gates included: what "auto" holds clients for
    slowest_start_s: float | None = None
    fatal: dict[str, Any] | None = None  # the supervisor gave up: until a later one is READY

    def learned(self, profile: Profile, rung_failures: dict[str, int], at: float) -> LearnedChanged:
        """What is remembered now, with the profile in force and the rungs that failed: the state
        file's next contents. Events are frozen records: they carry copies, never these dicts."""
        return LearnedChanged(at=at, profile=profile, rung_failures=dict(rung_failures),
                              last_failure=_copy(self.last_failure),
                              restarts_total=self.restarts_total,
                              slowest_start_s=self.slowest_start_s, fatal=_copy(self.fatal))

    def note_start(self, seconds: float) -> bool:
        """A start reached READY in ``seconds``; True when it is the slowest measured."""
        if self.slowest_start_s is not None and seconds <= self.slowest_start_s:
            return False
        self.slowest_start_s = round(seconds, 3)
        return True

    def gave_up(self, decision: Decision, at: float) -> None:
        self.fatal = {"exit_code": int(decision.exit_code), "reason": decision.reason, "at": at,
                      "kind": decision.failure.kind.value}

    def recovered(self, outage: Outage | None,
                  now: float) -> tuple[FailureKind | None, float] | None:
        """At READY after a failure: its kind and the seconds since the first failure of the
        outage."""
        if outage is None or outage.first_failure is None or self.last_failure is None:
            return None
        after = round(now - outage.first_failure, 3)
        self.last_failure["recovered_after_s"] = after
        kind = self.last_failure.get("kind")
        return (FailureKind(kind) if kind in {k.value for k in FailureKind} else None), after


@dataclass
class Outage:
    """The engine out of service: since when, and since the first failure in it (None: the first
    start)."""

    since: float
    first_failure: float | None = None


@dataclass
class Serving:
    """One READY period: when it began, whether the stable period was noted, whether the engine
    is idle."""

    since: float
    stable: bool = False
    idle: bool = False


@dataclass
class Tally:
    """This supervisor's count of the engine's life: its starts, the restarts since it was last
    stable, the outage and the READY period under way, and the last READY record."""

    remembered: Remembered = field(default_factory=Remembered)  # and what outlives this supervisor
    starts: int = 0
    restarts: int = 0
    outage: Outage | None = None
    serving: Serving | None = None
    last_ready: Ready | None = None

    def restart_eta_s(self) -> float:
        """How long the last start took to READY (30 s before any): what a held client is told to
        expect."""
        return float(self.last_ready.timings.get("start_to_ready_s",
                                                 30.0)) if self.last_ready else 30.0

    def outage_s(self, now: float) -> float | None:
        return None if self.outage is None else round(now - self.outage.since, 3)

    def serving_ended(self, at: float) -> float:
        """The READY period under way is over at ``at``: how long it lasted (0 when the run never
        was READY)."""
        served = at - self.serving.since if self.serving is not None else 0.0
        self.serving = None
        return served


def _copy(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    return dict(doc) if doc is not None else None
