"""A failure, from its detection to the policy's decision: the outage it opens, who caused it
(the gateway), the policy's judgement, the incident bundle, and what is remembered of it. The
state and the profile it changes are the lifecycle's to write."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from supervisor.config import Config
from supervisor.decide.compile_mode import failure_of
from supervisor.decide.policy import Decision, floor_of, into_sleeping_spare
from supervisor.engine.origin import PreparedSource
from supervisor.engine.run import Verdict
from supervisor.engine.steps import Trigger
from supervisor.engine_states import Blame, EngineState, Failure
from supervisor.event_stream import (
    CompileCacheSetAside,
    Event,
    FailureClassified,
    FailureDetected,
    Fatal,
)
from supervisor.host import Host, compile_cache
from supervisor.host.gpu import GpuLost
from supervisor.lifecycle.ports import Part
from supervisor.lifecycle.records import Outage
from supervisor.ops import incident
from supervisor.profile import Profile


class Failures(Part):
    def detected(self, trigger: Trigger, state: EngineState) -> None:
        """An unplanned end was detected: an outage is under way from it (or from the start it
        interrupted)."""
        self.publish(
            FailureDetected(at=self.host.wall(), trigger=trigger.kind, evidence=trigger.evidence,
                            state=state))
        if self.tally.outage is None:
            self.tally.outage = Outage(trigger.at_mono)
        if self.tally.outage.first_failure is None:
            self.tally.outage.first_failure = trigger.at_mono

    async def judge(self, verdict: Verdict, before: Profile, served_s: float,
                    detected_after: float, source: PreparedSource | None = None) -> Decision:
        """The stopped run's verdict judged at profile ``before`` (READY ``served_s``): the
        gateway's blame, the policy's decision (into the rung of the spare asleep beside the
        engine, ``source.sleeping_spare()``, where the death would restart the same rung:
        ``into_sleeping_spare``), the incident bundle, the failure remembered and published."""
        trigger, found = verdict.trigger, verdict.failure
        assert found is not None
        found = failure_of(found, bool(verdict.evidence.get("compiled", True)))
        at_floor = floor_of(before, self.cfg.ladder) == before
        blame = Blame() if self.front is None else \
            await self.front.blame(found.kind, found.suspect_request, at_floor, before.chunk())
        decision = into_sleeping_spare(
            self.policy.judge(found, before, self.host.monotonic(), blame, served_s),
            source.sleeping_spare() if source is not None else None, self.cfg.ladder)
        failure = decision.failure
        path = await write_incident(self.cfg, self.host, self.publish, verdict, failure, before,
                                    decision.profile, decision.reason, detected_after)
        self.remembered.last_failure = {
            **failure.as_dict(), "detected_at": trigger.at, "trigger": trigger.kind.value,
            "phase": verdict.phase.value, "profile": before.knobs(),
            **({"incident": path} if path else {})
        }
        self.publish(
            FailureClassified(at=self.host.wall(), kind=failure.kind, evidence=failure.evidence,
                              trigger=trigger.kind, phase=verdict.phase,
                              returncode=verdict.returncode,
                              suspect_request=failure.suspect_request, failure=failure,
                              incident=path, named_by_vllm=failure.suspect_request is not None,
                              at_floor=at_floor, chunk=before.chunk(),
                              caused_by_request=blame.proven))
        return decision

    def set_aside_compile_cache(self) -> None:
        """vLLM's compile cache moved aside before the restart of a ``compile_cache`` failure
        (its graphs cannot run, and every start on that cache would die so); what the supervisor
        knew compiled there is forgotten with it (the recovery's part, on the event)."""
        root, now = compile_cache.root(self.cfg.engine.environment()), self.host.wall()
        moved, error = compile_cache.set_aside_at(root, now)
        self.publish(CompileCacheSetAside(
            at=now, cache=str(root / compile_cache.SUBDIR),
            moved_to=str(moved) if moved else None, error=error))

    def gave_up(self, decision: Decision) -> None:
        """The policy's FATAL: published, and remembered until a later supervisor is READY."""
        self.publish(
            Fatal(at=self.host.wall(), reason=decision.reason, exit_code=int(decision.exit_code),
                  failure=decision.failure))
        self.remembered.gave_up(decision, self.host.wall())

    def restarting(self, decision: Decision) -> None:
        """A restart the policy decided: counted; vLLM's compile cache moved aside first where the
        decision says so."""
        if decision.set_aside_compile_cache:
            self.set_aside_compile_cache()
        self.tally.restarts += 1
        self.remembered.restarts_total += 1


async def write_incident(cfg: Config, host: Host, publish: Callable[[Event], None],
                         verdict: Verdict, failure: Failure, before: Profile, after: Profile,
                         decision: str, detected_after: float) -> str | None:
    """The incident bundle in the state directory; its path, or None (and an event) when it
    cannot be written."""
    try:
        gpu: Any = [s.as_dict() for s in await host.gpu_snapshot()]
    except GpuLost as exc:
        gpu = {"error": str(exc)}
    bundle = incident.bundle(verdict, failure, before, after, decision, detected_after, gpu)
    return incident.keep(cfg.state.dir, failure.kind.value, bundle, cfg.engine.secrets(), publish,
                         host.wall)
