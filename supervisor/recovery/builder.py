"""How every second engine ahead is built: launched (recovery/throwaway.py), waited for until it
answers /health, then kept asleep (a spare, recovery/spare.py) or stopped (a precompile's
throwaway, its rung noted compiled). A second engine's own fault never stops the supervision:
it is remembered (``FailedRungs``) and published."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from supervisor.config import Config
from supervisor.decide.spoiled_cache import SpoiledBuild, after_a_second_engines_death
from supervisor.engine import gates
from supervisor.event_stream import (
    CompileCacheSetAside,
    Event,
    PrecompileCrashed,
    RungPrecompiled,
)
from supervisor.host import Child, Host, compile_cache
from supervisor.profile import Profile
from supervisor.recovery.precompile import Precompiler
from supervisor.recovery.progress import Beside, BuildTimes, FirstBuilds
from supervisor.recovery.sizing import CompileFirst
from supervisor.recovery.spare import SpareKeeper
from supervisor.recovery.standby import Standby
from supervisor.recovery.throwaway import FailedRungs, Launcher, Throwaway


class Builder:
    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None],
                 failed: FailedRungs, precompiler: Precompiler, keeper: SpareKeeper,
                 times: BuildTimes) -> None:
        self.cfg, self.host, self.publish, self.failed = cfg, host, publish, failed
        self.precompiler, self.keeper, self.times = precompiler, keeper, times
        self.launcher = Launcher(cfg, host, publish)
        # a spare's build takes a standby of its own from here (recovery/standby.py, role
        # "spare"), once its imports are done; None: spares start cold
        self.spare_standby: Callable[[], Awaitable[Standby | None]] | None = None
        self.spare_since: float | None = None  # a spare being built since (monotonic)
        self.beside: Beside | None = None  # what is built beside the serving engine now
        # while compiling first: the processes of the throwaways stopped
        self.stopped: set[int] | None = None
        # monotonic: vLLM's compile cache last moved aside, the engine's last READY (recovery's)
        self.aside_at: float | None = None
        self.ready_at: float | None = None
        # compile key -> its second engines whose port was taken, in this run
        self.ports_taken: dict[str, int] = {}

    def configure(self, cfg: Config) -> None:
        self.cfg = cfg
        self.launcher.configure(cfg)

    async def build(self, rung: Profile, version: str | None, spare: bool,
                    kv_bytes: int | None = None, reach: tuple[int, int] | None = None) -> None:
        """A second engine at ``rung``: a spare kept asleep, or a throwaway stopped once its
        graphs are compiled. ``reach``: built beside the serving engine, the rungs within reach
        compiled before it and of how many (its progress told as it goes)."""
        self.spare_since = self.host.monotonic() if spare else None
        if reach is not None:
            what = "spare" if spare else "rung"
            self.beside = Beside(what, rung, self.host.monotonic(), *reach,
                                 self.times.took_s.get(what))
            self.publish(self.beside.event(self.host.wall()))
        try:
            while await self._launch(rung, version, spare, kv_bytes):
                pass  # its port was taken before it bound it: again, on another
        # a second engine's own fault never stops the supervision
        except Exception as exc:  # noqa: BLE001
            self.failed.add(rung, "spare" if spare else "precompile")
            self.publish(PrecompileCrashed(at=self.host.wall(), profile=rung, error=repr(exc)))
        finally:
            self.spare_since = self.beside = None

    async def _launch(self, rung: Profile, version: str | None, spare: bool,
                      kv_bytes: int | None) -> bool:
        """A second engine at ``rung`` until it answers /health; a spare (the real weights, sleep
        mode, not niced: it may become the engine) is then kept asleep, a precompile's
        throwaway stopped. True when it is to be launched again (its port was taken)."""
        standby = await self.spare_standby() if spare and self.spare_standby else None
        t0 = self.host.monotonic()  # the spawn, or the standby told its argv: took_s from here
        try:
            t = await self.launcher.launch(rung, "real" if spare else "dummy", sleep_mode=spare,
                                           niced=not spare, version=version, kv_bytes=kv_bytes,
                                           standby=standby)
        except OSError as exc:
            self.failed.add(rung, "precompile")
            self.publish(RungPrecompiled(at=self.host.wall(), profile=rung, ok=False, took_s=0.0,
                                         error=f"could not start a second engine: {exc}"))
            return False
        why, lines = await self._until_kept(t, version, spare, t0)
        verdict = None if why is None else self._after_death(t, rung, spare, t0)
        if verdict is not None and verdict.held_against_rung:
            self.failed.add(rung, "spare" if spare else "precompile")
        again = verdict is not None and verdict.again
        if why is None and self.beside is not None:
            self.times.note(self.beside.what, self.host.monotonic() - t0)
        self.publish(
            RungPrecompiled(
                at=self.host.wall(), profile=rung, ok=why is None,
                took_s=round(self.host.monotonic() - t0, 3),
                error=None if why is None else
                f"{why}{f' ({verdict.why})' if again and verdict else ''}; last lines: "
                f"{' | '.join(lines)}"))
        return again

    def _after_death(self, t: Throwaway, rung: Profile, spare: bool, t0: float) -> SpoiledBuild:
        """A second engine that failed: whether its rung counts as failed, and whether it is
        started again; where it died of a spoiled compile cache, the cache is moved aside first
        (decide/spoiled_cache.py)."""
        key = rung.compile_key()
        verdict = after_a_second_engines_death(bool(t.spoiled), t0, self.aside_at, self.ready_at,
                                               bool(t.port_taken), self.ports_taken.get(key, 0))
        if t.port_taken:
            self.ports_taken[key] = self.ports_taken.get(key, 0) + 1
        if verdict.set_aside:
            root, now = compile_cache.root(self.cfg.engine.environment()), self.host.wall()
            moved, error = compile_cache.set_aside_at(root, now)
            self.aside_at = self.host.monotonic()
            self.publish(CompileCacheSetAside(
                at=now, cache=str(root / compile_cache.SUBDIR),
                moved_to=str(moved) if moved else None, error=error,
                after="spare" if spare else "precompile"))
        return verdict

    async def _until_kept(self, t: Throwaway, version: str | None, spare: bool,
                          t0: float) -> tuple[str | None, list[str]]:
        """Wait for ``t``'s /health; then keep it (a spare) or stop it. Why it failed, and its
        last lines."""
        kept = False
        try:
            why = await t.until_healthy(self.cfg.recovery.precompile_timeout_s)
            # a spare kept is adopted by an engine's run, which binds its events socket anew
            t.deaf()
            lines = t.last_lines()  # what it printed while failing, not its shutdown
            if why is None and spare:
                kept = await self.keeper.keep(t, t0)
            elif why is None:
                # Its graphs are in the cache, whatever comes. Not a spare's: on the H200 a start at
                # a rung only a spare had compiled compiled it again (24 s): it runs with
                # --enable-sleep-mode and dev mode, and vLLM's compile hash took them in; the rung
                # is then precompiled plainly as any.
                self.precompiler.note_compiled(t.profile, version,
                                               t.cache_used[0] if t.cache_used else None)
        finally:
            if not kept:
                if self.stopped is not None:
                    self.stopped |= t.pids()
                await t.stop()  # a spare kept has its own record now (SpareKeeper.keep)
            self.launcher.done(t)
        return why, lines

    async def compile_first(self, plan: CompileFirst, version: str | None,
                            first: FirstBuilds) -> None:
        """A planned start's rungs compiled before its engine, ``plan.at_once`` side by side
        (``first`` tells their progress), within precompile_timeout_s; then the card's memory
        they held released."""
        slots, self.stopped = asyncio.Semaphore(plan.at_once), set()
        done = 0
        first.step("rungs", done, len(plan.rungs), plan.at_once)

        async def one(rung: Profile) -> None:
            nonlocal done
            async with slots:
                t0 = self.host.monotonic()
                at = rung.with_(gpu_memory_utilization=plan.util)
                await self.build(at, version, False, plan.kv_bytes)
                if not self.failed.no_precompile(at):
                    first.times.note("rungs", self.host.monotonic() - t0)
            done += 1
            first.step("rungs", done, len(plan.rungs), plan.at_once)

        timeout = self.cfg.recovery.precompile_timeout_s
        try:
            await asyncio.wait_for(asyncio.gather(*map(one, plan.rungs)), timeout)
        except TimeoutError:
            self.precompiler.why = ("first: not all compiled within precompile_timeout_s "
                                    f"({timeout:g}s): {plan.why}")
        finally:
            stopped, self.stopped = self.stopped, None
        # The spare and the engine come next, on what the throwaways held.
        await gates.wait_released(self.cfg, self.host, self.publish, tuple(stopped or ()))

    def beside_status(self) -> dict[str, object] | None:
        return self.beside.as_dict(self.host.monotonic()) if self.beside else None

    def processes(self) -> list[tuple[str, Child, str | None, Profile | None]]:
        """The spare asleep and every second engine being started (a precompile's, or a spare
        being built)."""
        spare = self.keeper.spare
        out: list[tuple[str, Child, str | None, Profile | None]] = \
            [("spare", spare.child, spare.url, spare.profile)] if spare is not None else []
        return out + [("spare (being built)" if t.work.name.startswith("spare-") else "precompile",
                       t.child, t.url, t.profile)
                      for t in sorted(self.launcher.current, key=lambda t: t.pid) if t is not spare]
