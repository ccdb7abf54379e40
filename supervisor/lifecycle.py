"""The engine's lifecycle: the state machine, the policy's decisions, and the only writer of both.

It runs one EngineRun after another (supervisor.engine.run: one start of vLLM), reads the records
each step returns (Healthy, Ready, a Trigger, the Verdict), asks the policy what a failure means,
and publishes every change once on the event stream. ``change_state`` and ``change_profile`` are
the only places the state and the profile change; every edge has its comment (``# X -> Y``).

An outage is decided here alone (``Outage``): it begins when the supervisor starts (until the first
READY) and when an unplanned failure is detected, and it ends at READY; ``engine.recovered`` says
how long after the outage's first failure. Every state change carries how long
the current outage has lasted (``outage_s``), so the alert rules and /status need no definition
of their own.

Building the parts, reload and shutdown are the composition root's (supervisor.daemon); the
gateway and recovery are reached only through the small protocols below.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from supervisor.bounds import SHORT_SLACK_S
from supervisor.config import Config
from supervisor.decide.policy import Decision, Policy, floor_of
from supervisor.engine.origin import PreparedSource
from supervisor.engine.run import EngineRun, Healthy, Verdict
from supervisor.engine.steps import Trigger
from supervisor.engine_states import (
    Blame,
    EngineState,
    ExitCode,
    Failure,
    FailureKind,
    TriggerKind,
    check_transition,
)
from supervisor.event_stream import (
    EngineIdle,
    Event,
    FailureClassified,
    FailureDetected,
    Fatal,
    LearnedChanged,
    PlannedRestart,
    ProfileChanged,
    ProfileLowered,
    ProfileRaised,
    Ready,
    Recovered,
    Stable,
    StateChanged,
    StopRequested,
)
from supervisor.heartbeat import Heartbeat
from supervisor.host import Host
from supervisor.host.gpu import GpuLost, short_of
from supervisor.ops import incident
from supervisor.profile import Knob, Profile

S = EngineState


class Front(Protocol):
    """What the lifecycle asks of the gateway: drain before a planned stop, take what is at the engine as it stops
    (told synchronously, before the state is written), who caused a death, whether clients are at the engine."""

    async def drain(self, why: str) -> None: ...
    def stopping(self, planned: bool) -> None: ...
    async def blame(self, kind: FailureKind, suspect_request: str | None, at_floor: bool,
                    chunk: int | None) -> Blame: ...
    def busy(self) -> bool: ...
    def shutdown(self) -> None: ...


class RecoveryPort(PreparedSource, Protocol):
    """What the lifecycle asks of recovery: the standby (through the run), and no throwaway engine left."""

    async def settled(self) -> None: ...
    def pids(self) -> set[int]: ...


@dataclass
class Remembered:
    """What outlives this supervisor process (state.json): restarts, the last failure, the slowest start."""

    restarts_total: int = 0
    last_failure: dict[str, Any] | None = None
    slowest_start_s: float | None = None  # start -> READY, gates included: what "auto" holds clients for
    fatal: dict[str, Any] | None = None  # the supervisor gave up: until a later one is READY

    def note_start(self, seconds: float) -> bool:
        """A start reached READY in ``seconds``; True when it is the slowest measured."""
        if self.slowest_start_s is not None and seconds <= self.slowest_start_s:
            return False
        self.slowest_start_s = round(seconds, 3)
        return True

    def gave_up(self, decision: Decision, at: float) -> None:
        self.fatal = {"exit_code": int(decision.exit_code), "reason": decision.reason, "at": at,
                      "kind": decision.failure.kind.value}

    def recovered(self, outage: Outage | None, now: float) -> tuple[FailureKind | None, float] | None:
        """At READY after a failure: its kind and the seconds since the first failure of the outage."""
        if outage is None or outage.first_failure is None or self.last_failure is None:
            return None
        after = round(now - outage.first_failure, 3)
        self.last_failure["recovered_after_s"] = after
        kind = self.last_failure.get("kind")
        return (FailureKind(kind) if kind in {k.value for k in FailureKind} else None), after


@dataclass
class Outage:
    """The engine out of service: since when, and since the first failure in it (None: the first start)."""

    since: float
    first_failure: float | None = None


@dataclass
class Serving:
    """One READY period: when it began, whether the stable period was noted, whether the engine is idle."""

    since: float
    stable: bool = False
    idle: bool = False


@dataclass
class Tally:
    """This supervisor's count of the engine's life: its starts, the restarts since it was last stable, the outage
    and the READY period under way, and the last READY record."""

    starts: int = 0
    restarts: int = 0
    outage: Outage | None = None
    serving: Serving | None = None
    last_ready: Ready | None = None

    def restart_eta_s(self) -> float:
        """How long the last start took to READY (30 s before any): what a held client is told to expect."""
        return float(self.last_ready.timings.get("start_to_ready_s", 30.0)) if self.last_ready else 30.0

    def outage_s(self, now: float) -> float | None:
        return None if self.outage is None else round(now - self.outage.since, 3)

    def serving_ended(self, at: float) -> float:
        """The READY period under way is over at ``at``: how long it lasted (0 when the run never was READY)."""
        served = at - self.serving.since if self.serving is not None else 0.0
        self.serving = None
        return served


class Lifecycle:
    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None], heartbeat: Heartbeat,
                 policy: Policy, profile: Profile, new_run: Callable[[Profile, int, PreparedSource], EngineRun],
                 *, recovery: RecoveryPort, front: Front | None = None, learned: dict[str, Any] | None = None) -> None:
        self.cfg, self.host, self.publish, self.heartbeat = cfg, host, publish, heartbeat
        self.policy, self.new_run, self.recovery, self.front = policy, new_run, recovery, front
        self.profile = profile
        self.state = S.STOPPED
        self.state_since = host.monotonic()
        self.remembered = Remembered(**(learned or {}))
        self.tally = Tally(outage=Outage(host.monotonic()))  # not READY since the supervisor started
        self.run: EngineRun | None = None
        self.stop_asked = asyncio.Event()

    # ---- the only writers ------------------------------------------------------------------------
    def change_state(self, new: EngineState, **why: Any) -> None:
        """The only place the engine state changes: checked, then published once."""
        check_transition(self.state, new)
        old, self.state = self.state, new
        now = self.host.monotonic()
        if new is S.READY:
            self.tally.outage = None
        self.publish(StateChanged(at=self.host.wall(), old=old, new=new, after_s=round(now - self.state_since, 3),
                                  profile=self.profile, restarts=self.restarts, outage_s=self.tally.outage_s(now),
                                  **why))
        self.state_since = now

    def change_profile(self, new: Profile, reason: str, failure: Failure | None = None) -> None:
        """The only place the profile changes: one event says how (lowered, raised, or otherwise changed)."""
        old, self.profile = self.profile, new
        if new == old:
            return
        diff, at = old.diff(new), self.host.wall()
        if failure is not None:
            self.publish(ProfileLowered(at=at, diff=diff, profile=new, kind=failure.kind, evidence=failure.evidence))
        elif new.reaches(old):
            self.publish(ProfileRaised(at=at, diff=diff, profile=new, reason=reason))
        else:
            self.publish(ProfileChanged(at=at, diff=diff, profile=new, reason=reason))

    def learned(self) -> None:
        r, failed = self.remembered, dict(self.policy.rung_failures)
        self.publish(LearnedChanged(at=self.host.wall(), profile=self.profile, rung_failures=failed,
                                    last_failure=_copy(self.last_failure), restarts_total=r.restarts_total,
                                    slowest_start_s=r.slowest_start_s, fatal=_copy(r.fatal)))

    @property
    def restarts(self) -> int:  # since the engine was last stable: what max_restarts counts
        return self.tally.restarts

    @property
    def last_failure(self) -> dict[str, Any] | None:
        return self.remembered.last_failure

    # ---- intent ----------------------------------------------------------------------------------------
    def request_stop(self, why: str = "stop requested") -> None:
        if self.stop_asked.is_set():
            return
        self.publish(StopRequested(at=self.host.wall(), reason=why))
        self.stop_asked.set()
        if self.front is not None:
            self.front.shutdown()
        if self.run is not None:
            self.run.end(TriggerKind.STOP, why)

    def restart_at(self, target: Profile, why: str) -> tuple[bool, str]:
        """A planned restart at ``target`` (the operator's restart or reset-profile, a reload)."""
        run = self.run
        if self.state not in (S.STARTING, S.WARMING, S.READY) or run is None:
            if self.state in (S.BACKOFF, S.STOPPING):
                self.change_profile(target, why)  # the start that comes next uses it
                self.learned()
                return True, f"the engine is already restarting ({self.state.value}); the next start uses the profile"
            return False, f"the engine is {self.state.value}: nothing to restart"
        run.end(TriggerKind.RESTART, why, target=target)
        return True, f"{why}: the engine restarts at {target.knobs()}"

    def reset_profile(self) -> tuple[bool, str]:
        self.policy.forget_failed_rungs()
        self.learned()
        if self.profile == self.cfg.profile:
            return True, "the profile already is the configured one; failed rungs forgotten"
        return self.restart_at(self.cfg.profile, "reset-profile: back to [profile]")

    def reconfigure(self, cfg: Config) -> None:
        """A reload: the policy's settings apply to its next decision."""
        self.cfg = cfg
        self.policy.reconfigure(cfg.restart, cfg.ladder, cfg.profile)

    # ---- what others may read ----------------------------------------------------------------------------
    def pids(self) -> set[int]:
        """The current engine's processes (the GPU memory holders)."""
        return self.run.pids() if self.run else set()

    def restarting(self) -> bool:
        """The supervisor is bringing the engine back: a start or a restart it began is under way."""
        return not self.stop_asked.is_set() and self.state in (S.STOPPED, S.STARTING, S.WARMING, S.STOPPING,
                                                               S.BACKOFF, S.DRAINING)

    def status(self) -> dict[str, Any]:
        now = self.host.monotonic()
        run, last = self.run, self.tally.last_ready
        warming = self.state_since if self.state is S.WARMING else None
        run_status = run.status(warming) if run else {"engine_pid": None, "phase": None, "startup": None,
                                                       "engine_version": None}
        if self.state not in (S.STARTING, S.WARMING):
            run_status["startup"] = None
        return {
            "state": self.state.value,
            "ready": self.state is S.READY,
            "profile": self.profile.knobs(),
            "configured_profile": self.cfg.profile.knobs(),
            "restarts": self.tally.restarts,
            "restarts_total": self.remembered.restarts_total,
            "failures_in_a_row": self.policy.in_a_row,
            "last_failure": self.last_failure,
            "engine_pid": run_status["engine_pid"],
            "engine_url": (last and last.engine_url) or self.cfg.engine.base_url,
            "start": self.tally.starts,
            "phase": run_status["phase"],
            "startup": run_status["startup"],
            "engine_version": run_status["engine_version"],
            "degraded": self.profile.knobs() != self.cfg.profile.knobs(),
            "state_for_s": round(now - self.state_since, 3),
            "outage_s": self.tally.outage_s(now),
            "timings": last.as_dict() if last else {},
            "fatal": self.remembered.fatal,
        }

    # ---- the main loop -------------------------------------------------------------------------------------
    async def run_until_stopped(self) -> int:
        """Supervise until asked to stop (0) or FATAL (non-zero ExitCode)."""
        while True:
            await self.recovery.settled()  # a throwaway precompile engine is gone before any start
            self.tally.starts += 1
            run = self.run = self.new_run(self.profile, self.tally.starts, self.recovery)
            if self.stop_asked.is_set():
                run.end(TriggerKind.STOP, "stop requested")
            trigger = await self._drive(run)
            served_s = self.tally.serving_ended(trigger.at_mono)
            if trigger.kind is TriggerKind.STOP:
                if self.front is not None:  # without one, nothing of the clients' passes through us to drain
                    await self._drain("stop")
                self._stopping(trigger, planned=True)
                await self.heartbeat.wait(run.conclude(trigger), run.deadline_at)
                self.change_state(S.STOPPED, reason=trigger.evidence)  # STOPPING -> STOPPED
                return ExitCode.OK
            if trigger.kind in (TriggerKind.CLIMB, TriggerKind.RESTART):
                await self._planned(run, trigger)
                continue
            exit_code = await self._fail(run, trigger, served_s)
            if exit_code is not None:
                return exit_code

    async def _drive(self, run: EngineRun) -> Trigger:
        """STARTING -> WARMING -> READY, then serving until a trigger ends the run."""
        self.change_state(S.STARTING, start=self.tally.starts)  # STOPPED|BACKOFF|STOPPING -> STARTING
        gated = await self.heartbeat.wait(run.gates(), run.deadline_at)
        if isinstance(gated, Trigger):
            return gated
        if gated is not None:  # another process's memory: this start runs at a lower utilization
            self.change_profile(gated.profile, gated.reason)
            self.learned()
        healthy = await self.heartbeat.wait(run.start(), run.deadline_at)
        if not isinstance(healthy, Healthy):
            return healthy
        self.change_state(S.WARMING, healthy_after_s=healthy.after_s)  # STARTING -> WARMING
        ready = await self.heartbeat.wait(run.warm(), run.deadline_at)
        if not isinstance(ready, Ready):
            return ready
        self.tally.last_ready = ready
        slower = self.remembered.note_start(float(ready.timings.get("start_to_ready_s") or 0.0))
        self.tally.serving = Serving(self.host.monotonic())
        self.policy.on_ready()
        recovered = self.remembered.recovered(self.tally.outage, self.host.monotonic())
        self.change_state(S.READY, ready=ready)  # WARMING -> READY
        if recovered is not None:
            self.publish(Recovered(at=self.host.wall(), kind=recovered[0], recovered_after_s=recovered[1],
                                   profile=self.profile))
        if recovered is not None or slower or self.remembered.fatal is not None:
            self.remembered.fatal = None  # an earlier supervisor's FATAL is over
            self.learned()
        return await self.heartbeat.wait(run.serve(), run.deadline_at, on_tick=lambda: self._tick_ready(run))

    async def _tick_ready(self, run: EngineRun) -> None:
        """Level-triggered checks while READY: a stable period, idleness, and the climb back one rung."""
        serving = self.tally.serving
        assert serving is not None
        ready_for = self.host.monotonic() - serving.since
        if not serving.stable and ready_for >= self.cfg.restart.window_s:
            serving.stable = True
            self.policy.on_stable()
            self.publish(Stable(at=self.host.wall(), ready_for_s=round(ready_for, 1)))
        idle = run.idle and not (self.front is not None and self.front.busy())
        if idle != serving.idle:
            serving.idle = idle
            self.publish(EngineIdle(at=self.host.wall(), idle=idle))
        climb_after = self.cfg.ladder.climb_after_s
        if not climb_after or ready_for < climb_after or not run.idle:
            return
        target = self.policy.climb_target(self.profile)
        if target is None or not await self._room_for(target):
            return
        run.end(TriggerKind.CLIMB, f"stable for {ready_for:.0f}s", target=target)

    async def _room_for(self, target: Profile) -> bool:
        """A utilization lowered for another process's memory climbs back only once that memory is free."""
        util = target.effective(Knob.GPU_MEMORY_UTILIZATION)
        if util is None or util <= (self.profile.effective(Knob.GPU_MEMORY_UTILIZATION) or 0):
            return True
        try:
            snaps = await self.host.gpu_snapshot(self.cfg.engine.devices())
        except GpuLost:
            return False
        # Our own engine holds what it took; that memory is its successor's.
        return not short_of(snaps, util, self.cfg.gpu.start_headroom_bytes, ours=self.pids())

    async def _planned(self, run: EngineRun, trigger: Trigger) -> None:
        """A planned restart (a climb, or asked by the operator): drain, stop, and start at the target profile."""
        target = trigger.target or self.profile
        await self._drain(trigger.kind.value, target=target)
        self._stopping(trigger, planned=True)
        await self.heartbeat.wait(run.conclude(trigger), run.deadline_at)
        if trigger.kind is TriggerKind.RESTART:
            self.publish(PlannedRestart(at=self.host.wall(), reason=trigger.evidence))
        self.change_profile(target, trigger.evidence)
        self.learned()

    def _stopping(self, trigger: Trigger, planned: bool) -> None:
        """X -> STOPPING, the gateway told first: it takes what is at the engine, with no event queue between."""
        if self.front is not None:
            self.front.stopping(planned)
        self.change_state(S.STOPPING, reason=trigger.kind.value, evidence=trigger.evidence)  # X -> STOPPING

    async def _drain(self, why: str, target: Profile | None = None) -> None:
        """READY -> DRAINING before a planned stop; with a gateway, its in-flight requests finish first."""
        if self.state is not S.READY:
            return
        self.change_state(S.DRAINING, reason=why, target=target)  # READY -> DRAINING
        if self.front is not None:
            bound = self.cfg.gateway.drain_timeout_s if self.cfg.gateway else 0.0
            await self.heartbeat.wait(self.front.drain(why), self.heartbeat.within(bound + SHORT_SLACK_S))

    async def _fail(self, run: EngineRun, trigger: Trigger, served_s: float) -> ExitCode | None:
        """STOPPING, classify, ask the policy (``served_s``: READY that long); BACKOFF and None, or FATAL's code."""
        self.publish(FailureDetected(at=self.host.wall(), trigger=trigger.kind, evidence=trigger.evidence,
                                     state=self.state))
        if self.tally.outage is None:
            self.tally.outage = Outage(trigger.at_mono)
        if self.tally.outage.first_failure is None:
            self.tally.outage.first_failure = trigger.at_mono
        detected_after = round(trigger.at_mono - self.state_since, 3)
        self._stopping(trigger, planned=False)
        verdict = await self.heartbeat.wait(run.conclude(trigger), run.deadline_at)
        assert verdict.failure is not None
        before = self.profile
        at_floor = floor_of(before, self.cfg.ladder) == before
        blame = Blame() if self.front is None else \
            await self.front.blame(verdict.failure.kind, verdict.failure.suspect_request, at_floor, before.chunk())
        decision = self.policy.judge(verdict.failure, before, self.host.monotonic(), blame, served_s)
        failure = decision.failure
        path = await write_incident(self.cfg, self.host, self.publish, verdict, failure, before, decision.profile,
                                    decision.reason, detected_after)
        self.remembered.last_failure = {**failure.as_dict(), "detected_at": trigger.at, "trigger": trigger.kind.value,
                                  "phase": verdict.phase.value, "profile": before.knobs(),
                                  **({"incident": path} if path else {})}
        self.publish(FailureClassified(at=self.host.wall(), kind=failure.kind, evidence=failure.evidence,
                                       trigger=trigger.kind, phase=verdict.phase, returncode=verdict.returncode,
                                       suspect_request=failure.suspect_request, failure=failure, incident=path,
                                       named_by_vllm=failure.suspect_request is not None,
                                       at_floor=at_floor, chunk=before.chunk(), caused_by_request=blame.proven))
        if not decision.restart:
            self.change_state(S.FATAL, reason=decision.reason, exit_code=int(decision.exit_code))  # STOPPING -> FATAL
            self.publish(Fatal(at=self.host.wall(), reason=decision.reason, exit_code=int(decision.exit_code),
                               failure=failure))
            self.remembered.gave_up(decision, self.host.wall())
            self.learned()
            return decision.exit_code
        self.change_profile(decision.profile, decision.reason, failure=failure)
        self.tally.restarts += 1
        self.remembered.restarts_total += 1
        self.learned()
        self.change_state(S.BACKOFF, delay_s=round(decision.delay_s, 3), reason=decision.reason)  # STOPPING -> BACKOFF
        if await self._sleep_or_stop(decision.delay_s):
            self.change_state(S.STOPPED, reason="stop requested during backoff")  # BACKOFF -> STOPPED
            return ExitCode.OK
        return None

    async def _sleep_or_stop(self, seconds: float) -> bool:
        """Sleep ``seconds`` on the host's clock; True if a stop was requested meanwhile."""
        sleeper = asyncio.ensure_future(self.host.sleep(seconds))
        stopper = asyncio.ensure_future(self.stop_asked.wait())
        both = asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        await self.heartbeat.wait(both, self.heartbeat.within(seconds))
        for t in (sleeper, stopper):
            t.cancel()
        return self.stop_asked.is_set()



async def write_incident(cfg: Config, host: Host, publish: Callable[[Event], None], verdict: Verdict,
                         failure: Failure, before: Profile, after: Profile, decision: str,
                         detected_after: float) -> str | None:
    """The incident bundle in the state directory; its path, or None (and an event) when it cannot be written."""
    try:
        gpu: Any = [s.as_dict() for s in await host.gpu_snapshot()]
    except GpuLost as exc:
        gpu = {"error": str(exc)}
    bundle = incident.bundle(verdict, failure, before, after, decision, detected_after, gpu)
    return incident.keep(cfg.state.dir, failure.kind.value, bundle, cfg.engine.secrets(), publish, host.wall)


def _copy(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """Events are frozen records: they carry copies, never the lifecycle's own dicts."""
    return dict(doc) if doc is not None else None
