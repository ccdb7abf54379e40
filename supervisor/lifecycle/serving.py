"""The READY period: what its beginning records (the start's time, the outage it ends), then
while READY the stable period noted, idleness published, and the climb back one rung when it
is due."""

from __future__ import annotations

from supervisor.engine.run import EngineRun
from supervisor.engine_states import FailureKind, TriggerKind
from supervisor.event_stream import EngineIdle, Ready, Recovered, Stable
from supervisor.host.gpu import GpuLost, short_of
from supervisor.lifecycle.ports import Part
from supervisor.lifecycle.records import Serving
from supervisor.profile import Knob, Profile

# why a reload that changed the engine's settings restarts it (supervisor/commands.py)
RELOADED = "config reloaded: engine settings changed"
# the outage it ends (kind, seconds), a slower start
News = tuple[tuple[FailureKind | None, float] | None, bool]


class ReadyPeriod(Part):
    # reset-profile or a reload asked while READY: its target and why, until that start is
    # prepared
    asked: tuple[Profile, str] | None = None

    def begin(self, ready: Ready) -> News:
        """Before WARMING -> READY is written: the start's time noted, the period begun, the
        outage ended."""
        now, tally = self.host.monotonic(), self.tally
        slower = self.remembered.note_start(float(ready.timings.get("start_to_ready_s") or 0.0))
        tally.last_ready, tally.serving = ready, Serving(now)
        self.policy.on_ready()
        recovered = self.remembered.recovered(tally.outage, now)
        tally.outage = None
        return recovered, slower

    def began(self, news: News, profile: Profile) -> bool:
        """After READY is published: the recovery it ends; True when what is remembered changed
        (a slower start, a recovery, or an earlier supervisor's FATAL that is over now)."""
        recovered, slower = news
        if self.asked == (profile, RELOADED):
            self.asked = None  # a failure's restart came first: it runs the reloaded settings
        if recovered is not None:
            self.publish(
                Recovered(at=self.host.wall(), kind=recovered[0], recovered_after_s=recovered[1],
                          profile=profile))
        if recovered is None and not slower and self.remembered.fatal is None:
            return False
        self.remembered.fatal = None
        return True

    async def tick(self, run: EngineRun, profile: Profile) -> None:
        """Level-triggered checks while READY: a stable period, idleness, and the climb back one
        rung or the operator's reset-profile (the run is asked to end with its target once the
        start is prepared: its spare asleep beside the engine, where one fits)."""
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
        if self.asked is not None:
            asked, why = self.asked
            if _prepared(run, asked):
                self.asked = None
                run.end(TriggerKind.RESTART, why, target=asked)
            return
        climb_after = self.cfg.ladder.climb_after_s
        if not climb_after or ready_for < climb_after:
            return
        target = self.policy.climb_target(profile)
        if target is None or not await self._room_for(target, profile, run.pids()):
            return
        # its spare is built under traffic; the climb itself waits for a lull
        if _prepared(run, target) and run.idle:
            run.end(TriggerKind.CLIMB, f"stable for {ready_for:.0f}s", target=target)

    async def _room_for(self, target: Profile, profile: Profile, ours: set[int]) -> bool:
        """A utilization lowered for another process's memory climbs back only once that memory
        is free."""
        util = target.effective(Knob.GPU_MEMORY_UTILIZATION)
        if util is None or util <= (profile.effective(Knob.GPU_MEMORY_UTILIZATION) or 0):
            return True
        try:
            snaps = await self.host.gpu_snapshot(self.cfg.engine.devices())
        except GpuLost:
            return False
        # Our own engine holds what it took (``ours``): that memory is its successor's.
        return not short_of(snaps, util, self.cfg.gpu.start_headroom_bytes, ours=ours)


def _prepared(run: EngineRun, target: Profile) -> bool:
    """Whether the planned start at ``target`` is prepared (recovery's ``prepared_for``: a climb's
    spare asleep, or none to be had); without a source of prepared engines, always."""
    return run.standby is None or run.standby.prepared_for(target)
