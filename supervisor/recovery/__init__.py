"""Recovery: what the next start finds ready, prepared while the engine serves (``[recovery]``).

A restart is shorter than a cold start when its slow parts were done ahead: the standby pool
(``standby``, ``standby_fork``) keeps an interpreter with vLLM imported that becomes the next
engine, and the precompiler (``precompile``, ``precompile_idle_s``, ``precompile_timeout_s``)
compiles the rungs the next start would pick into vLLM's cache, and the spare (``spare``) keeps
the next rung's whole engine asleep: both second engines, one at a time (``ahead``, launched by
``throwaway``). Recovery plugs into the rest as
an event-stream subscriber (READY, the engine's reported environment, idleness, leaving READY)
plus the calls of the lifecycle and its runs: ``take()`` (the standby, at the moment a start
spawns), ``spare_for()`` (the spare engine, woken for a start at its rung: recovery/spare.py) and
``settled()`` (no throwaway engine left before a start). It never decides anything about the
engine's state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.aio import cancel_and_wait
from supervisor.bounds import SPARE_ROOM_WAIT_S
from supervisor.config import Config
from supervisor.decide.compile_mode import CompileChoice, StartKind, choose_for
from supervisor.engine_states import EngineState, FailureKind
from supervisor.event_stream import (
    CompileCacheSetAside,
    DeathSeen,
    DeathSettled,
    EngineEnvReported,
    EngineIdle,
    Event,
    FailureClassified,
    StateChanged,
)
from supervisor.host import Child, Host
from supervisor.profile import Profile
from supervisor.recovery.ahead import Ahead, build_first_bound_s
from supervisor.recovery.spare import (
    Spare,
    take_bound_s,
    wake_beside_the_dying,
    wake_while_it_exits,
)
from supervisor.recovery.standby import SPARE, Standby, StandbyPool, vllm_env_of

TICK_S = 1.0


class Recovery:
    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None],
                 next_rungs: Callable[[Profile], list[Profile]]) -> None:
        self.host = host
        self.pool = StandbyPool(cfg, host, publish)
        # the next spare's build starts from a standby of its own (vLLM imported ahead)
        self.spare_pool = StandbyPool(cfg, host, publish, role=SPARE)
        self.ahead = Ahead(cfg, host, publish, next_rungs)
        self.ahead.builder.spare_standby = self.spare_pool.take_imported
        # the READY engine's profile, its vLLM version, and whether its start was a failure's
        self._serving: tuple[Profile, str | None, bool] | None = None
        self._idle_since: float | None = None
        self._ready_since: float | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._engine_reported = False  # an engine (not a second one) said what vLLM set for it
        # a climb's spare, woken as the engine drains; a runtime OOM's, as the dead one is stopped
        self._wake_ahead: asyncio.Task[None] | None = None
        # the rung of the spare woken while a dead engine's API server exits: still the one its
        # restart goes into (``sleeping_spare``)
        self._dying_into: Profile | None = None
        # how the last engine stopped: a planned end or a failure, and whether it had been READY
        self._stopped = (StartKind.FIRST, False)

    def use_dir(self, directory: Path) -> None:
        """Where standbys and throwaway engines keep their per-process files (the run directory)."""
        self.pool.dir = self.spare_pool.dir = self.ahead.builder.launcher.dir = directory

    def configure(self, cfg: Config) -> None:
        self.pool.configure(cfg)
        self.spare_pool.configure(cfg)
        self.ahead.configure(cfg)

    # ---- the subscriber ------------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        if isinstance(event, EngineEnvReported):
            if not event.second_engine:
                self._engine_reported = True
                reported = vllm_env_of(dict(event.env))
                self.pool.engine_env(reported)
                self.spare_pool.engine_env(reported)
                if self._early_standby():
                    self.pool.want()
            elif self.ahead.building_first and not self._engine_reported:
                # No engine has said it yet: a second engine built before the first one says it for
                # the same install, and the standby it lets start now is what that engine spawns
                # from.
                self.pool.engine_env(vllm_env_of(dict(event.env)))
                self.pool.want()
        elif isinstance(event, StateChanged):
            if event.new is EngineState.STOPPING:  # a planned end drains first
                self._stopped = (StartKind.PLANNED if event.old is EngineState.DRAINING
                                 else StartKind.AFTER_FAILURE, event.old is EngineState.READY)
            if event.new is EngineState.READY:
                version = event.ready.engine_version if event.ready else None
                self._serving = (event.profile, version, not self.ahead.planned)
                self.ahead.planned, self.ahead.version = True, version
                self._ready_since = self.ahead.builder.ready_at = self.host.monotonic()
                self._dying_into = None
                self.ahead.precompiler.learnt_version(version)
                # a spare's graphs are a sleep-mode engine's
                if not (event.ready and event.ready.from_spare):
                    # an engine without torch.compile compiled nothing
                    if not event.ready or event.ready.compiled:
                        self.ahead.precompiler.note_compiled(
                            event.profile, version,
                            event.ready.compile_cache if event.ready else None)
                    if event.ready:  # what a restart without a spare costs, for /status
                        self.ahead.last_start_s = event.ready.timings.get("start_to_ready_s")
                self.pool.want()
            elif event.old is EngineState.READY:
                self._serving, self._idle_since, self._ready_since = None, None, None
                self.ahead.climb = None
                self.ahead.stop()  # the host is the next start's now
                if event.new is EngineState.DRAINING and event.target is not None:
                    self._wake_spare(event.target)
        elif isinstance(event, DeathSettled):
            # the spare of the rung its restart goes to, woken beside the dead engine where it fits
            target = wake_beside_the_dying(event.kind, self.ahead.below(event.profile))
            if target is not None:
                self._wake_spare(target)
        elif isinstance(event, DeathSeen):
            # ... or while its API server exits by itself, before the verdict
            self._dying_into = wake_while_it_exits(
                event.kind, self.ahead.below(event.profile), self.sleeping_spare(), event.profile,
                self.ahead.cfg.ladder)
            if self._dying_into is not None:
                self._wake_spare(self._dying_into, SPARE_ROOM_WAIT_S)
        elif isinstance(event, FailureClassified):
            # until the next READY: the restarts of an outage build no spare first
            self.ahead.planned = False
            self.ahead.device_fault = event.kind is FailureKind.DEVICE_FATAL
        elif isinstance(event, CompileCacheSetAside):
            self.ahead.builder.aside_at = self.host.monotonic()
            if event.moved_to is not None:
                # what was compiled there is gone, and what failed there may have failed of it
                self.ahead.precompiler.forget_compiled()
                self.ahead.failed.clear()
        elif isinstance(event, EngineIdle):
            self._idle_since = self.host.monotonic() if event.idle and self._serving else None

    # ---- the calls of the lifecycle and its runs -------------------------------------------------
    def take(self) -> Standby | None:
        standby = self.pool.take()
        if standby is not None and self._early_standby():
            self.pool.want()
        return standby

    def _early_standby(self) -> bool:
        """On a GPU host the next start's standby imports during a start, not after its READY: a
        failure in the first seconds of serving then finds vLLM imported (the H200 imports for
        15-24 s; a second death 10 s after a recovery waited 11 s for it). There an engine's
        start is GPU work with cores to spare (16 on the H200), and the import takes one of
        them. On a CPU host a start is CPU work on every core, and the next standby waits for
        READY."""
        return self.ahead.gpu_host

    async def spare_for(self, profile: Profile) -> Spare | None:
        """The spare, woken for a start at ``profile``; None when there is none that can serve
        it."""
        return await self.ahead.spare_for(profile)

    def sleeping_spare(self) -> Profile | None:
        """The rung of the spare asleep beside the engine, where a failure that would restart the
        same rung may restart into it instead (decide/policy.py ``into_sleeping_spare``): one
        built beside the serving engine, whose successor is built beside again at the next
        READY. None for one built first (at 0.9 the next memory failure needs it, and no other
        is built before a planned start) or woken already, and after a device's fault."""
        spare = self.ahead.keeper.spare
        if spare is None or spare.built_first or self.ahead.device_fault:
            return None
        if spare.whole_asleep or spare.profile == self._dying_into:
            return spare.profile
        return None

    def how_to_compile(self) -> CompileChoice:
        """How the start spawning now runs vLLM's torch.compile: a failure's restart that wakes no
        spare skips it where decide/compile_mode.py allows."""
        kind, served = self._stopped
        return choose_for(self.ahead.cfg, kind, served=served, version=self.ahead.version)

    def _wake_spare(self, target: Profile, room_wait_s: float = 0.0) -> None:
        if self._wake_ahead is None or self._wake_ahead.done():
            self._wake_ahead = asyncio.create_task(
                self.ahead.keeper.wake_ahead(target, room_wait_s), name="recovery:wake-ahead")

    def woken_ahead(self) -> bool:
        """A climb's spare is awake beside the engine being stopped, or waking there: the start
        that follows adopts it, and needs none of that engine's memory."""
        spare = self.ahead.keeper.spare  # woken is set once the card's check passed
        return spare is not None and spare.woken

    def prepared_for(self, target: Profile) -> bool:
        """Whether a planned start the clients wait through (a climb to ``target``, the operator's
        reset-profile, a reload of the engine's settings) may go now: its spare asleep or none to
        be had (recovery/ahead.py ``prepared_for``), and vLLM imported for the engine's command
        and environment in force (recovery/standby.py ``prepared``)."""
        spare = self.ahead.prepared_for(target)  # each asked every tick: each may start its part
        return self.pool.prepared() and spare

    async def build_first(self, profile: Profile) -> bool:
        """Before a planned start's spawn: the rungs within reach compiled and a spare built and
        asleep, each when it would not fit beside the engine; True when a spare sleeps on the
        card now."""
        return await self.ahead.build_first(profile)

    def build_first_bound_s(self) -> float:
        return build_first_bound_s(self.ahead.cfg)

    def spare_for_bound_s(self) -> float:
        return take_bound_s(self.ahead.cfg)

    def lost(self, standby: Standby, error: str) -> None:
        self.pool.lost(standby, error)

    async def settled(self) -> None:
        """No throwaway engine left (its processes may hold memory the next start needs)."""
        await self.ahead.settled()

    # ---- precompiling while idle -----------------------------------------------------------------
    def start(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick(), name="recovery:idle")

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            if self._serving is not None and self._ready_since is not None:
                profile, version, after_failure = self._serving
                now = self.host.monotonic()
                idle_for = now - self._idle_since if self._idle_since is not None else 0.0
                await self.ahead.tick(profile, version, idle_for, now - self._ready_since,
                                      after_failure)
                if self._serving is not None and self.ahead.spare_standby_wanted():
                    self.spare_pool.want()
                if self._serving is not None and self._early_standby():  # a GPU host, as there
                    self.pool.want(reserve=True)

    def pids(self) -> set[int]:
        """Processes of ours besides the engine (a throwaway engine may hold GPU memory)."""
        return self.ahead.pids()

    def processes(self) -> list[tuple[str, Child, str | None, Profile | None]]:
        """What runs besides the engine, for /status: (role, its session's leader, its URL, its
        rung)."""
        out: list[tuple[str, Child, str | None, Profile | None]] = [
            (role, s.child, None, None)
            for role, s in (("standby", self.pool.standby),
                            ("standby (reserve)", self.pool.reserve),
                            ("spare standby", self.spare_pool.standby)) if s is not None
        ]
        return out + self.ahead.processes()

    def status(self) -> dict[str, Any]:
        return {"standby": self.pool.status(), "spare_standby": self.spare_pool.status(),
                **self.ahead.status()}

    async def close(self) -> None:
        await cancel_and_wait(self._ticker)
        await cancel_and_wait(self._wake_ahead)
        await self.ahead.close()
        await self.pool.close()
        await self.spare_pool.close()
