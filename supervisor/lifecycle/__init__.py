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

What a failure costs (failures.py) and what the READY period notes (serving.py) are carried out
by their own parts; the records they keep are in records.py and /status's part in view.py. An
operator's restart is OperatorCommands' (supervisor.commands): it ends the run with its target.
Building the parts, reload and shutdown are the composition root's (supervisor.daemon). The gateway
is reached only through the small protocol in ports.py, and recovery not at all: each run comes
from ``new_run``, which the composition root makes wait until recovery's throwaways are gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from supervisor.bounds import SHORT_SLACK_S
from supervisor.config import Config
from supervisor.decide.policy import Policy
from supervisor.engine.run import EngineRun, Healthy, Verdict
from supervisor.engine.steps import Trigger
from supervisor.engine_states import EngineState, ExitCode, Failure, TriggerKind, check_transition
from supervisor.event_stream import (
    Event,
    PlannedRestart,
    Ready,
    StateChanged,
    StopRequested,
    profile_changed,
)
from supervisor.heartbeat import Heartbeat
from supervisor.host import Host
from supervisor.lifecycle import view
from supervisor.lifecycle.failures import Failures
from supervisor.lifecycle.ports import Front
from supervisor.lifecycle.records import Outage, Remembered, Tally
from supervisor.lifecycle.serving import ReadyPeriod
from supervisor.profile import Profile

S = EngineState


class Lifecycle:
    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None],
                 heartbeat: Heartbeat, policy: Policy, profile: Profile,
                 new_run: Callable[[Profile, int], Awaitable[EngineRun]], *,
                 front: Front | None = None, learned: dict[str, Any] | None = None) -> None:
        self.cfg, self.host, self.publish, self.heartbeat = cfg, host, publish, heartbeat
        self.policy, self.new_run, self.front = policy, new_run, front
        self.profile = profile
        self.state = S.STOPPED
        self.state_since = host.monotonic()
        # not READY yet
        self.tally = Tally(Remembered(**(learned or {})), outage=Outage(host.monotonic()))
        self.failures = Failures(cfg, host, publish, policy, self.tally, front)
        self.ready_period = ReadyPeriod(cfg, host, publish, policy, self.tally, front)
        self.run: EngineRun | None = None
        self.stop_asked = asyncio.Event()

    # ---- the only writers ------------------------------------------------------------------------
    def change_state(self, new: EngineState, **why: Any) -> None:
        """The only place the engine state changes: checked, then published once."""
        check_transition(self.state, new)
        old, self.state = self.state, new
        now = self.host.monotonic()
        self.publish(
            StateChanged(at=self.host.wall(), old=old, new=new,
                         after_s=round(now - self.state_since, 3), profile=self.profile,
                         restarts=self.tally.restarts, outage_s=self.tally.outage_s(now), **why))
        self.state_since = now

    def change_profile(self, new: Profile, reason: str, failure: Failure | None = None) -> None:
        """The only place the profile changes: one event says how (lowered, raised, or otherwise
        changed)."""
        old, self.profile = self.profile, new
        if new != old:
            self.publish(profile_changed(old, new, self.host.wall(), reason, failure))

    def learned(self) -> None:
        self.publish(
            self.tally.remembered.learned(self.profile, self.policy.rung_failures,
                                          self.host.wall()))

    # ---- intent ----------------------------------------------------------------------------------
    def request_stop(self, why: str = "stop requested") -> None:
        if self.stop_asked.is_set():
            return
        self.publish(StopRequested(at=self.host.wall(), reason=why))
        self.stop_asked.set()
        if self.front is not None:
            self.front.shutdown()
        if self.run is not None:
            self.run.end(TriggerKind.STOP, why)

    def reconfigure(self, cfg: Config) -> None:
        """A reload: the policy's settings apply to its next decision."""
        self.cfg = self.failures.cfg = self.ready_period.cfg = cfg
        self.policy.reconfigure(cfg.restart, cfg.ladder, cfg.profile)

    # ---- what others may read --------------------------------------------------------------------
    def pids(self) -> set[int]:
        """The current engine's processes (the GPU memory holders)."""
        return self.run.pids() if self.run else set()

    def restarting(self) -> bool:
        """The supervisor is bringing the engine back: a start or a restart it began is under
        way."""
        return not self.stop_asked.is_set() and self.state not in (S.READY, S.FATAL)

    def status(self) -> dict[str, Any]:
        return view.status(self)

    # ---- the main loop ---------------------------------------------------------------------------
    async def run_until_stopped(self) -> int:
        """Supervise until asked to stop (0) or FATAL (non-zero ExitCode)."""
        while True:
            self.tally.starts += 1
            run = self.run = await self.new_run(self.profile, self.tally.starts)
            if self.stop_asked.is_set():
                run.end(TriggerKind.STOP, "stop requested")
            trigger = await self._drive(run)
            served_s = self.tally.serving_ended(trigger.at_mono)
            if trigger.kind.planned:
                await self._planned(run, trigger)
                if trigger.kind is TriggerKind.STOP:
                    self.change_state(S.STOPPED, reason=trigger.evidence)  # STOPPING -> STOPPED
                    return ExitCode.OK
                continue
            exit_code = await self._fail(run, trigger, served_s)
            if exit_code is not None:
                return exit_code

    async def _drive(self, run: EngineRun) -> Trigger:
        """STARTING -> WARMING -> READY, then serving until a trigger ends the run."""
        # STOPPED|BACKOFF|STOPPING -> STARTING
        self.change_state(S.STARTING, start=self.tally.starts)
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
        news = self.ready_period.begin(ready)
        self.change_state(S.READY, ready=ready)  # WARMING -> READY
        if self.ready_period.began(news, self.profile):
            self.learned()
        return await self.heartbeat.wait(run.serve(), run.deadline_at,
                                         on_tick=lambda: self.ready_period.tick(run, self.profile))

    async def _planned(self, run: EngineRun, trigger: Trigger) -> None:
        """A planned end (a stop, a climb, or a restart asked by the operator): drain, stop, and
        for a restart take the target profile. Without a gateway a stop has no clients of ours
        to drain."""
        if trigger.kind is not TriggerKind.STOP or self.front is not None:
            drained = await self._drain(trigger.kind.value, target=trigger.target)
            if drained and trigger.kind is not TriggerKind.STOP:
                trigger = replace(trigger, drained=True)
        await self._stop(run, trigger, planned=True)
        if trigger.kind is TriggerKind.STOP:
            return
        if trigger.kind is TriggerKind.RESTART:
            self.publish(PlannedRestart(at=self.host.wall(), reason=trigger.evidence))
        self.change_profile(trigger.target or self.profile, trigger.evidence)
        self.learned()

    async def _stop(self, run: EngineRun, trigger: Trigger, planned: bool) -> Verdict:
        """X -> STOPPING, the gateway told first (it takes what is at the engine, with no event
        queue between); the run stopped and its verdict."""
        if self.front is not None:
            self.front.stopping(planned)
        # X -> STOPPING
        self.change_state(S.STOPPING, reason=trigger.kind.value, evidence=trigger.evidence)
        return await self.heartbeat.wait(run.conclude(trigger), run.deadline_at)

    async def _drain(self, why: str, target: Profile | None = None) -> bool:
        """READY -> DRAINING before a planned stop; with a gateway, its in-flight requests finish
        first. True when the gateway saw none left at the engine."""
        if self.state is not S.READY:
            return False
        self.change_state(S.DRAINING, reason=why, target=target)  # READY -> DRAINING
        if self.front is None:
            return False
        bound = self.cfg.gateway.drain_timeout_s if self.cfg.gateway else 0.0
        return bool(await self.heartbeat.wait(self.front.drain(why),
                                              self.heartbeat.within(bound + SHORT_SLACK_S)))

    async def _fail(self, run: EngineRun, trigger: Trigger, served_s: float) -> ExitCode | None:
        """STOPPING, judged (``served_s``: READY that long); BACKOFF and None, or FATAL's code."""
        detected_after = round(trigger.at_mono - self.state_since, 3)
        self.failures.detected(trigger, self.state)
        verdict = await self._stop(run, trigger, planned=False)
        decision = await self.failures.judge(verdict, self.profile, served_s, detected_after,
                                             run.standby)
        if not decision.restart:
            # STOPPING -> FATAL
            self.change_state(S.FATAL, reason=decision.reason, exit_code=int(decision.exit_code))
            self.failures.gave_up(decision)
            self.learned()
            return decision.exit_code
        self.change_profile(decision.profile, decision.reason, failure=decision.failure)
        self.failures.restarting(decision)
        self.learned()
        # STOPPING -> BACKOFF
        self.change_state(S.BACKOFF, delay_s=round(decision.delay_s, 3), reason=decision.reason)
        if await self.heartbeat.sleep_unless(self.stop_asked, decision.delay_s):
            # BACKOFF -> STOPPED
            self.change_state(S.STOPPED, reason="stop requested during backoff")
            return ExitCode.OK
        return None
