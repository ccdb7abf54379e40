"""What the next start finds ready, built while the engine serves: one second engine at a time.

What to build is decided by recovery/next_build.py's ``next_step``, from the facts gathered here: a
spare for the rung the next runtime OOM would pick (recovery/spare.py), else a precompile of the
next rung not yet compiled (recovery/precompile.py), each where it fits beside the engine
(recovery/sizing.py). This class carries the step out. Both are launched by recovery/throwaway.py; a
rung whose second engine failed is remembered once (``FailedRungs``). The work is killed, never
waited for, the moment the engine leaves READY. Where neither fits beside the engine, a planned
start builds them first (``build_first``): the rungs not yet compiled, several at once, then the
spare, on the card its gates found free.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from typing import Any

import psutil

from supervisor.bounds import SPARE_CANARY_S, SPARE_SLEEP_S, THROWAWAY_STOP_S
from supervisor.config import Config
from supervisor.decide.compile_mode import restarts_uncompiled
from supervisor.event_stream import Event
from supervisor.host import Child, Host
from supervisor.host.gpu import DeviceSnapshot, GpuLost
from supervisor.profile import Profile
from supervisor.recovery import canary
from supervisor.recovery.builder import Builder
from supervisor.recovery.next_build import Action, Facts, Moment, Step, next_step
from supervisor.recovery.precompile import Precompiler
from supervisor.recovery.progress import FirstBuilds, spare_due
from supervisor.recovery.sizing import one_sequence_kv, second_engine_bytes
from supervisor.recovery.spare import Spare, SpareKeeper, window
from supervisor.recovery.throwaway import FailedRungs


class Ahead:
    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None],
                 targets: Callable[[Profile], list[Profile]]) -> None:
        self.cfg, self.host, self.publish, self.targets = cfg, host, publish, targets
        self.failed = FailedRungs()
        self.precompiler = Precompiler(cfg, host)
        self.keeper = SpareKeeper(cfg, host, publish, self.failed)
        # a build-first's step, while one runs
        self.first = FirstBuilds(cfg.state.dir, host, publish)
        self.builder = Builder(cfg, host, publish, self.failed, self.precompiler, self.keeper,
                               self.first.times)
        self._task: asyncio.Task[None] | None = None
        self._gpu_host: bool | None = None  # NVML sees a device (asked once)
        # the next start is not a failure's: the supervisor's first, a climb, a reload
        self.planned = True
        # how long until the engine has been READY long enough to build
        self._asked_in_s: float | None = None
        # the vLLM of the last READY engine (the spare's is the same install)
        self.version: str | None = None
        # a planned start's second engines are being built before its engine
        self.building_first = False
        # the last failure was the GPU's own (Xid, ECC): nothing on it is kept
        self.device_fault = False
        # a rung compiled beside the engine at READY, not precompile_idle_s on
        self._at_ready: Profile | None = None
        # the last decision (recovery/next_build.py), its reason shown in /status
        self.step: Step | None = None
        self.last_start_s: float | None = None  # the last start that woke no spare, to READY
        # a climb (or reset-profile) wanted while the engine serves: the rung it starts at
        self.climb: Profile | None = None

    def configure(self, cfg: Config) -> None:
        self.cfg = cfg
        for part in (self.builder, self.precompiler, self.keeper):
            part.configure(cfg)

    async def tick(self, profile: Profile, version: str | None, idle_for_s: float,
                   ready_for_s: float, after_failure: bool = False) -> None:
        """Once the engine was idle long enough (on a GPU host: READY long enough), build the
        next second engine. On a GPU host its compile is CPU work on many cores, niced, and
        its GPU memory is bounded by what the serving engine left, so it does not wait for a
        lull that busy servers never have: the seed's crash came under steady traffic. A spare
        whose rung is no longer the first target (or that died asleep) goes first. After a
        failure's restart (``after_failure``) the next spare is not kept waiting."""
        targets = self.below(profile)
        kept = self.keeper.spare
        await self.keeper.check(self.climb or (targets[0] if targets else None))
        if kept is not None and self.keeper.spare is None:
            return  # the card is read again at the next tick, without what it held
        if self.running():  # nothing to read: a second engine at a time
            self.step = next_step(
                Facts(Moment.READY, self.cfg.recovery, profile, tuple(targets), building=True,
                      climb=self.climb))
            return
        await self._on_gpu()
        facts = await self._facts(Moment.READY, profile, version,
                                  ready_for_s if self.gpu_host else idle_for_s, after_failure)
        self._at_ready = None
        step = self._take(next_step(facts))
        self._asked_in_s = step.wait_s
        if step.rung is not None and step.action in (Action.SPARE, Action.COMPILE):
            spare = step.action is Action.SPARE
            self._task = asyncio.create_task(
                self.builder.build(step.rung, version, spare, reach=facts.reach()),
                name="recovery:spare" if spare else "recovery:precompile")

    async def _facts(self, moment: Moment, profile: Profile, version: str | None,
                     waited_s: float = 0.0, after_failure: bool = False) -> Facts:
        """What ``next_step`` reads, gathered here: the card once, the compile record, the rungs'
        sizes."""
        e, targets = self.cfg.engine, tuple(self.below(profile))
        # a climb's rung (reset-profile: maybe rungs above) is weighed as any within reach
        within = (profile, *targets, *(() if self.climb is None else (self.climb, )))
        try:
            card: tuple[DeviceSnapshot, ...] | None = tuple(await
                                                            self.host.gpu_snapshot(e.devices()))
        except GpuLost:
            card = None
        # sizes are weighed against a card only (the model's files read)
        on_card = within if card else ()
        return Facts(
            moment, self.cfg.recovery, profile, targets, compiled=frozenset(
                p.compile_key() for p in within
                if self.precompiler.is_compiled(p, version)), failed=self.failed.kinds(), card=card,
            sizes={p.compile_key(): second_engine_bytes(e.model, p, e.ranks()) for p in on_card
                   }, kv={p.compile_key(): one_sequence_kv(e.model, p, e.ranks())
                          for p in on_card}, ram_available=psutil.virtual_memory().available,
            cpus=os.cpu_count() or 1, ranks=e.ranks(), headroom=self.cfg.gpu.start_headroom_bytes,
            floor=self.cfg.ladder.gpu_memory_utilization_floor, gateway=self.cfg.gateway
            is not None, breaks_on_wake=canary.breaks_on_wake(dict(e.args)),
            spare_kept=self.keeper.spare is not None, building=self.running(),
            kept=self.keeper.spare.profile if self.keeper.spare else None, climb=self.climb,
            at_ready=self._at_ready, waited_s=waited_s, first_start=self.version is None
            and self.gpu_host, after_failure=after_failure, last_start_s=self.last_start_s,
            restart_uncompiled=restarts_uncompiled(self.cfg, version))

    def _take(self, step: Step) -> Step:
        """The step decided: /status's reasons (the spare's, the rungs') are the step's."""
        self.step = step
        if step.spare_why is not None:
            self.keeper.why = step.spare_why
        if step.order is not None:
            self.keeper.order = step.order
        if step.compile_why is not None:
            self.precompiler.why = step.compile_why
        if step.plan is not None:
            self.precompiler.order = step.plan.order
        return step

    def prepared_for(self, target: Profile) -> bool:
        """Whether a climb (or reset-profile) to ``target`` may end the serving engine now: its
        spare sleeps, or no spare of its rung can be had (the climb is then a start). Asked each
        tick while the climb is wanted; until then the next ticks build its spare. A second
        engine under way when the climb is first wanted was started for something else (the
        next failure's spare, a precompile, which the climb would drop or outdate): it is stopped,
        not waited for (a spare's build took 58-99 s on the H200)."""
        if self.climb != target:
            self.climb, self.step = target, None
            if self._task is not None:
                _cancel_once(self._task)
            return False
        step = self.step
        return step is not None and step.action is Action.CLIMB

    async def spare_for(self, profile: Profile) -> Spare | None:
        """The spare, woken for a start at ``profile``; None when it cannot serve it. A failure's
        restart at the same rung (a death that was not memory's, nor the GPU's) leaves a spare
        of the rung below asleep for the next one."""
        targets = self.below(profile)
        keep_for = targets[0] if targets and not self.planned and not self.device_fault else None
        return await self.keeper.take(profile, keep_for)

    def below(self, profile: Profile) -> list[Profile]:
        """The rungs a failure at ``profile`` may go to, other than ``profile``'s own; the first
        is the spare's."""
        return [p for p in self.targets(profile) if p.compile_key() != profile.compile_key()]

    async def build_first(self, profile: Profile) -> bool:
        """Before a planned start at ``profile``, on the card its gates found free: the rungs
        within reach not yet compiled, its own among them (``precompile_order``), then the
        spare (``spare_order``), each where it would not fit beside the engine. True when a
        spare is kept asleep now. A failure's restart never waits for them: that start is the
        outage."""
        if not self.planned:
            return False
        await self._on_gpu()
        self.building_first = True
        version = self.version or self.precompiler.known_version()
        try:
            step = self._take(next_step(await self._facts(Moment.BEFORE_START, profile, version)))
            self._at_ready = step.at_ready
            if step.action is Action.COMPILE_FIRST and step.plan is not None:
                await self.builder.compile_first(step.plan, self.version, self.first)
                step = self._take(
                    next_step(await self._facts(Moment.BEFORE_START_COMPILED, profile, version)))
            if step.action is Action.SPARE and step.rung is not None:
                return await self._spare_first(step.rung)
            return False
        finally:
            self.building_first = False
            self.first.over()

    async def _spare_first(self, rung: Profile) -> bool:
        """A spare at ``rung`` (its utilization set) built before the engine; True when it sleeps
        now."""
        self.first.step("spare", 0, 1)
        await self.builder.build(rung, self.version, True)
        if self.keeper.spare is not None:
            self.keeper.spare.built_first = True
            self.first.times.note("spare", self.keeper.last_build_s)
            self.first.step("spare", 1, 1)
        return self.keeper.spare is not None

    def spare_standby_wanted(self) -> bool:
        """Whether the next spare's build should find vLLM imported in a standby of its own
        (recovery/standby.py, role "spare"): spares are not off, on a GPU host, and the last
        decision found one fits beside the engine, or one is built or kept in this run. Not at
        vLLM's default 0.9, where none fits beside: a standby nobody takes holds host memory."""
        r = self.cfg.recovery
        if r.spare == "off" or not r.standby or not self.gpu_host:
            return False
        step = self.step
        return bool((step is not None and step.spare_fits) or self.builder.spare_since is not None
                    or self.keeper.last_build_s is not None)

    @property
    def gpu_host(self) -> bool:
        """NVML saw a device when last asked (a planned start asks before its spawn)."""
        return bool(self._gpu_host)

    async def _on_gpu(self) -> bool:
        if self._gpu_host is None:
            try:
                self._gpu_host = bool(await self.host.gpu_snapshot(self.cfg.engine.devices()))
            except GpuLost:
                self._gpu_host = True
        return self._gpu_host

    def stop(self) -> None:
        """The engine ended (it failed or stops): the work under way is killed, not waited for.
        The kill runs beside the engine's own stop; ``settled`` waits for it before the next
        start."""
        if self._task is not None:
            _cancel_once(self._task)

    async def settled(self) -> None:
        """No second engine left starting (its processes may hold memory the next start needs)."""
        task, self._task = self._task, None
        if task is not None:
            _cancel_once(task)
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def running(self) -> bool:
        return bool(self._task is not None and not self._task.done())

    def pids(self) -> set[int]:
        """Processes of ours besides the engine (second engines hold GPU memory)."""
        return self.builder.launcher.pids() | self.keeper.pids()

    def processes(self) -> list[tuple[str, Child, str | None, Profile | None]]:
        return self.builder.processes()

    def status(self) -> dict[str, Any]:
        step = self.step
        return {
            "precompiling": self.running(), "precompile": self.precompiler.status(self.running()),
            "step": None if step is None else {"action": step.action.value, "why": step.why},
            "building_first": self.first.status(),
            "building_beside": self.builder.beside_status(), "spare": {
                **self.keeper.status(), "due": self._due(),
                "window": window(self.keeper.spare, self.last_start_s)
            }
        }

    def _due(self) -> dict[str, Any]:
        k, since = self.keeper, self.builder.spare_since
        return spare_due(k.spare is not None, k.last_build_s,
                         None if since is None else self.host.monotonic() - since,
                         k.order is not None and k.order.order == "first", self.cfg.recovery.spare,
                         self._asked_in_s, k.why)

    async def close(self) -> None:
        await self.settled()
        await self.keeper.close()


def build_first_bound_s(cfg: Config) -> float:
    """The longest ``Ahead.build_first`` takes, its steps' own bounds summed (the start's watchdog
    deadline): the rungs (``Builder.compile_first``: every throwaway within
    precompile_timeout_s, then each stopped, the ones the timeout cancelled too, then the card's
    memory released), then the spare (``_spare_first``: to /health within
    precompile_timeout_s, its canary and its sleep, or stopped when they fail)."""
    # Throwaway.stop: SIGTERM, SIGKILL
    p, stopped = cfg.recovery.precompile_timeout_s, 2 * THROWAWAY_STOP_S
    return (p + stopped + cfg.gpu.release_timeout_s) + (p + SPARE_CANARY_S + SPARE_SLEEP_S
                                                        + stopped)


def _cancel_once(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` unless it is done or already being cancelled: a second cancel would land
    in its cleanup (stopping the throwaway's processes) and leave a throwaway slow to stop
    running into the next start."""
    if not task.done() and not task.cancelling():
        task.cancel()
