"""``[recovery] spare``: the next rung's engine, built while the engine serves and kept asleep.

What is left of a recovery once the imports and the compile are done ahead (the standby, the
precompile) is vLLM building an engine: at the seed's scale 18 of a 20 s restart (docs/recovery.md
§5). A spare skips it. A second engine (recovery/throwaway.py) at the rung the next runtime OOM
would pick is started with the real weights, ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``
(the routes ``/sleep`` and ``/wake_up``, which the gateway never forwards), and once it answers
/health it is put to sleep at level 1: its weights are copied to host memory and its KV cache
dropped, its CUDA graphs, compiled code and processes kept; ~2 GiB stays on the card. When the
engine fails into that rung the next start wakes the spare (about half a second on the H200) and
adopts it as the engine.

A spare listens on a port of its own: only the gateway follows it. It is stopped, never kept "just
in case", when the engine's next rung moves elsewhere, when a start wants another rung, when the
card has not the memory it needs to wake, or when it dies; the start is then cold, as without it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from supervisor.bounds import (
    GIB,
    MIB,
    SPARE_CANARY_S,
    SPARE_HEALTH_S,
    SPARE_ROOM_WAIT_S,
    SPARE_SLEEP_S,
    SPARE_WAKE_MARGIN,
    SPARE_WAKE_S,
)
from supervisor.config import Config, EngineConfig, LadderConfig, WarmupConfig
from supervisor.decide.policy import spare_takes_the_restart
from supervisor.engine import warmup
from supervisor.engine_states import FailureKind
from supervisor.event_stream import Event, SpareAsleep, SpareChecked, SpareDropped, SpareWoken
from supervisor.host import Host, leftovers
from supervisor.host.gpu import DeviceSnapshot, GpuLost, poll_delays
from supervisor.host.vllm_http import EngineError
from supervisor.ops import incident
from supervisor.profile import Knob, Profile
from supervisor.recovery import canary
from supervisor.recovery.canary import Canary
from supervisor.recovery.sizing import Order
from supervisor.recovery.throwaway import FailedRungs, Throwaway, fields_of

log = structlog.get_logger("supervisor.recovery.spare")



class SpareFailed(Exception):
    """The spare could not be put to sleep or woken."""


@dataclass(eq=False)
class Spare(Throwaway):
    """A whole engine asleep at ``profile`` (the utilization it could start at beside the
    engine)."""

    # device -> bytes its processes held awake (NVML)
    awake: dict[int, int] = field(default_factory=dict)
    asleep: dict[int, int] = field(default_factory=dict)  # ... and asleep
    canary: Canary | None = None  # its answer to the canary prompt before it slept
    footprint_at: float = 0.0  # when its sleeping footprint was last read (monotonic)
    wakes: int = 0  # how often a check woke it (``spare_check_every_s``)
    checked_at: float = 0.0  # when it fell asleep or was last checked (monotonic)
    woken: bool = False  # awake again for a climb, beside the engine it replaces (``wake_ahead``)
    # warmed up after a wake beside the engine it replaces (``wake_ahead``): its start does not
    warmed: warmup.WarmupResult | None = None
    built_first: bool = False  # built before a planned start's engine (none fitted beside it)
    # what its sleep copied to host memory, per device (vLLM's log): its weights, which a wake in
    # two parts brings back first (``offloaded_bytes``); None until that line was read
    weights: int | None = None
    # its weights woken ahead of the rest, beside a dead engine (``wake_weights_ahead``): seconds
    weights_back_s: float | None = None

    def serves(self, profile: Profile) -> bool:
        """It can be the engine at ``profile``: the same rung (the compile key: every knob but the
        utilization), at a utilization no higher than the profile's."""
        mine = self.profile.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.0
        theirs = profile.effective(Knob.GPU_MEMORY_UTILIZATION) or 1.0
        return self.profile.compile_key() == profile.compile_key() and mine <= theirs

    @property
    def weights_woken(self) -> bool:
        return self.weights_back_s is not None

    @property
    def whole_asleep(self) -> bool:
        """Nothing of it woken: neither all (``woken``) nor its weights alone."""
        return not self.woken and not self.weights_woken

    def short_to_wake(self, snaps: Sequence[DeviceSnapshot], headroom: int) -> str | None:
        """Why the card cannot take the spare back now (what it gave up asleep, less its weights
        where they are back already, plus the headroom), or None."""
        back = (self.weights or 0) if self.weights_woken else 0
        for s in snaps:
            need = max(0, self.awake.get(s.index, 0) - self.asleep.get(s.index, 0) - back)
            if s.free < need + headroom:
                return (
                    f"GPU {s.index}: {s.free / GIB:.2f} GiB free, the spare needs {need / GIB:.2f} "
                    "GiB "
                    f"back to wake (+ {headroom / GIB:.2f} GiB headroom)")
        return None

    def short_for_weights(self, snaps: Sequence[DeviceSnapshot], headroom: int) -> str | None:
        """Why the card cannot take the spare's weights back now (plus the headroom), or None."""
        if self.weights is None:
            return "the size of its weights is not known (no vLLM sleep line read)"
        for s in snaps:
            if s.free < self.weights + headroom:
                return (f"GPU {s.index}: {s.free / GIB:.2f} GiB free, its weights need "
                        f"{self.weights / GIB:.2f} GiB (+ {headroom / GIB:.2f} GiB headroom)")
        return None

    def growth(self, held: dict[int, int]) -> str | None:
        """What its footprint grew by since it fell asleep (``held``: bytes per device now), where
        more than FOOTPRINT_GROWTH on a device; None otherwise."""
        grown = {d: b - self.asleep.get(d, 0) for d, b in held.items()}
        what = ", ".join(f"GPU {d}: +{b // MIB} MiB" for d, b in grown.items()
                         if b > FOOTPRINT_GROWTH)
        return f"{what} over the {sum(self.asleep.values()) // MIB} MiB it kept asleep" \
            if what else None

    async def grown_asleep(
            self, snapshot: Callable[[], Awaitable[list[DeviceSnapshot]]]) -> str | None:
        """``growth`` read from the card, every FOOTPRINT_EVERY_S while it sleeps; else None."""
        now = self.host.monotonic()
        if not self.asleep or now - self.footprint_at < FOOTPRINT_EVERY_S:
            return None
        self.footprint_at = now
        try:
            return self.growth(held_by(await snapshot(), self.host.tree_pids(self.child)))
        except GpuLost:
            return None

    def status(self) -> dict[str, Any]:
        return {
            "state": "awake" if self.woken else "weights awake" if self.weights_woken else "asleep",
            "pid": self.pid, "port": self.port,
            "profile": self.profile.knobs(),
            "held_asleep_mib": sum(self.asleep.values()) // MIB,
            "canary": self.canary.as_dict() if self.canary else None, "wakes": self.wakes
        }

    @property
    def warmup_s(self) -> float | None:
        return round(self.warmed.seconds, 3) if self.warmed else None

    async def warm_up(self, cfg: WarmupConfig) -> None:
        """Woken beside the engine it replaces (``wake_ahead``): its warm-up now, before the
        gateway hands it requests (a climb's) and while that engine still drains or is stopped,
        so that the start adopting it has none left (a climb's warm-up after the stop was 0.66 s
        of its 1.43 s outage on the H100, the clients' requests already at the spare)."""
        sizes = warmup.plan(self.profile, cfg)
        try:
            self.warmed = await warmup.run(self.client, sizes, warmup.after_wake(cfg, sizes))
        except warmup.WarmupFailed as exc:
            raise SpareFailed(f"its warm-up after the wake failed: {exc}") from None

    async def put_to_sleep(self, snapshot: Callable[[], Awaitable[list[DeviceSnapshot]]]) -> None:
        """Its canary's answer, then asleep, its footprint read awake and asleep (SpareFailed, or
        GpuLost, when any of it fails)."""
        pids = self.host.tree_pids(self.child)
        try:
            self.canary = await canary.ask(self.client)
        except EngineError as exc:
            raise SpareFailed(f"no answer to the canary prompt before sleeping: {exc}") from None
        self.awake = held_by(await snapshot(), pids)
        await self.fall_asleep()
        self.asleep = held_by(await snapshot(), pids)
        self.weights = offloaded_bytes(self.tail.snapshot())  # read again at a wake if late
        self.footprint_at = self.checked_at = self.host.monotonic()

    async def fall_asleep(self) -> None:
        try:
            await self.client.command("/sleep?level=1", SPARE_SLEEP_S)
        except EngineError as exc:
            raise SpareFailed(f"/sleep failed: {exc}") from None

    async def wake(self, tags: str | None = None) -> None:
        """vLLM's ``/wake_up``: everything (None), ``weights`` alone (the engine stays asleep,
        its scheduler paused), or ``kv_cache`` after the weights (then it serves)."""
        path = "/wake_up" if tags is None else f"/wake_up?tags={tags}"
        try:
            await self.client.command(path, SPARE_WAKE_S)
        except EngineError as exc:
            raise SpareFailed(f"{path} failed: {exc}") from None
        if tags != WEIGHTS and await self.client.health(timeout=SPARE_HEALTH_S) != 200:
            raise SpareFailed(f"no /health 200 after {path}")


# vLLM's CuMemAllocator at each sleep (level 1 copies the weights out; the KV cache is dropped)
OFFLOADED = re.compile(r"CuMemAllocator: sleep freed [\d.]+ GiB memory in total, of which "
                       r"([\d.]+) GiB is backed up in CPU")
WEIGHTS, KV_CACHE = "weights", "kv_cache"  # vLLM's wake-up tags


def offloaded_bytes(lines: Iterable[str]) -> int | None:
    """What the spare's last sleep copied to host memory, from vLLM's own line (a spare serves
    no client before it is the engine: nobody else's text is in its log), rounded up to the
    line's 0.01 GiB; None without one."""
    found = None
    for line in lines:
        m = OFFLOADED.search(line)
        if m:
            found = m
    return None if found is None else int((float(found.group(1)) + 0.01) * GIB)


def canary_incident(spare: Spare, before: Canary, after: Canary, wrong: str) -> dict[str, Any]:
    """The incident bundle of a spare that answered the canary otherwise after a wake."""
    return {
        "failure": {"kind": "spare_canary", "evidence": wrong}, "pid": spare.pid,
        "profile": spare.profile.knobs(), "argv": list(spare.argv), "vllm_version": spare.version,
        "before_sleep": {"tokens": list(before.tokens), "logprobs": list(before.logprobs)},
        "after_wake": {"tokens": list(after.tokens), "logprobs": list(after.logprobs)},
        "log_tail": spare.tail.snapshot()[-50:],
    }


def held_by(snaps: Iterable[DeviceSnapshot], pids: set[int]) -> dict[int, int]:
    """Bytes ``pids`` hold on each device (NVML's per-process accounting)."""
    return {s.index: sum(b for pid, b in s.processes if pid in pids) for s in snaps}


class SpareKeeper:
    """Holds at most one spare: decides whether one is wanted, keeps it asleep, hands it to a
    start, or stops it."""

    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None],
                 failed: FailedRungs) -> None:
        self.cfg, self.host, self.publish, self.failed = cfg, host, publish, failed
        self.spare: Spare | None = None
        # where the last spare was decided to be built (first, or beside)
        self.order: Order | None = None
        # how long the last spare took from its spawn to asleep
        self.last_build_s: float | None = None
        self.why = "not asked yet: no rung has been precompiled"
        # the last wake check's result (spare_check_every_s)
        self.last_check: dict[str, Any] | None = None
        self._waking = asyncio.Lock()  # a check's wake and a start's never overlap

    def configure(self, cfg: Config) -> None:
        self.cfg = cfg

    async def keep(self, started: Throwaway, spawned_at: float) -> bool:
        """Put a throwaway that answers /health to sleep and keep it; False (and an event) when
        that fails, and the caller stops it as any throwaway."""
        spare = Spare(**fields_of(started))
        t0 = self.host.monotonic()
        try:
            await spare.put_to_sleep(self._snapshot)
        except (SpareFailed, GpuLost) as exc:
            self.failed.add(spare.profile, "spare")
            self.publish(SpareDropped(at=self.host.wall(), pid=spare.pid, profile=spare.profile,
                                      reason=str(exc), fault=True))
            return False
        now = self.host.monotonic()
        spare.record_as(leftovers.SPARE)  # a spare kept is no precompile's throwaway
        self.spare, self.last_build_s = spare, round(now - spawned_at, 3)
        self.why = "asleep"
        self.publish(
            SpareAsleep(at=self.host.wall(), pid=spare.pid, port=spare.port, profile=spare.profile,
                        took_s=round(now - spawned_at, 3), sleep_s=round(now - t0, 3),
                        held_awake_mib=sum(spare.awake.values()) // MIB,
                        held_asleep_mib=sum(spare.asleep.values()) // MIB, standby=spare.standby))
        return True

    async def take(self, profile: Profile, keep_for: Profile | None = None) -> Spare | None:
        """For a start at ``profile``: the spare, awake and no longer ours to stop, or None. A
        spare that cannot serve this start is stopped first, unless it serves ``keep_for`` (a
        failure's restart at the same rung: the rung its next memory failure picks), which it
        stays asleep for. A check's wake under way ends first."""
        async with self._waking:
            return await self._take(profile, keep_for)

    async def _take(self, profile: Profile, keep_for: Profile | None) -> Spare | None:
        spare = self.spare
        if spare is None or await self._dropped_unfit(spare):
            return None
        if not spare.serves(profile):
            if keep_for is not None and spare.serves(keep_for) and spare.whole_asleep:
                # at 0.9 no spare starts beside the engine: losing this one loses the fast path
                return None
            await self.drop(f"this start wants another rung ({profile.compile_key()})")
            return None
        if not spare.woken:
            short = await short_within(spare, self._snapshot, self.host, SPARE_WAKE_MARGIN, 0.0)
            if short:
                await self.drop(short, fault=True)
                return None
            if not await self._wake(spare, beside=False):
                return None
        self.spare = None
        leftovers.clear(self.cfg.state.dir, leftovers.SPARE)
        return spare

    async def wake_ahead(self, profile: Profile, room_wait_s: float = 0.0) -> None:
        """The next start is at ``profile`` and its spare sleeps beside the engine it replaces (a
        climb's, a runtime OOM's settled before its engine's stop, or a death whose API server
        exits by itself): wake it now, while that engine drains or is killed and stops, not
        after (the wake and its canary were 0.56 s of a climb's 5.67 s outage on the H100). Only
        where the card holds it awake beside the engine and a start's headroom, as a check's
        wake, now or within ``room_wait_s`` (a dead EngineCore's memory coming back); otherwise
        the start wakes it after the stop, as before.

        Where the card holds only its weights now, those are woken first
        (``wake_weights_ahead``): the rest, its KV cache, is the dead engine's memory, woken once
        that is free."""
        async with self._waking:
            spare = self.spare
            if (spare is None or spare.woken or not spare.serves(profile)
                    or await self._dropped_unfit(spare)):
                return
            headroom = self.cfg.gpu.start_headroom_bytes
            short = await short_within(spare, self._snapshot, self.host, headroom, 0.0)
            if short:
                failed = await wake_weights_ahead(spare, self._snapshot, headroom, short)
                if failed:
                    await self.drop(failed, fault=True)
                    return
            if short and (room_wait_s or spare.weights_woken):
                short = await short_within(spare, self._snapshot, self.host, headroom,
                                           room_wait_s)
            if short:
                log.info("spare.woken_after_the_stop", pid=spare.pid, why=short,
                         weights_woken=spare.weights_woken)
                return
            spare.woken = True  # past the card's check: the stop need not wait for memory now
            await self._wake(spare, beside=True)

    async def _wake(self, spare: Spare, beside: bool) -> bool:
        """Wake ``spare`` and check its canary (``spare.woken``); False once it is dropped."""
        t0 = self.host.monotonic()
        try:
            await spare.wake(KV_CACHE if spare.weights_woken else None)
            took = round(self.host.monotonic() - t0, 3)
            checked = await self._check_canary(spare)
            if checked is not None and beside:
                await spare.warm_up(self.cfg.warmup)
        except SpareFailed as exc:
            await self.drop(str(exc), fault=True)
            return False
        except asyncio.CancelledError:
            await self.drop("the start was ended while the spare woke", fault=True)
            raise
        if checked is None:
            return False  # dropped: it answers otherwise than before it slept
        spare.woken = True
        self.publish(
            SpareWoken(at=self.host.wall(), pid=spare.pid, port=spare.port, profile=spare.profile,
                       took_s=took, canary=checked, beside=beside, url=spare.url,
                       warmup_s=spare.warmup_s, weights_s=spare.weights_back_s))
        return True

    async def _check_canary(self, spare: Spare) -> dict[str, Any] | None:
        """The canary again, after the wake: its result for ``spare.woken``, or None once the
        spare is dropped for answering otherwise (``spare.dropped`` reason "canary", an
        incident bundle); SpareFailed when the woken spare does not answer at all."""
        if spare.canary is None:
            return {"checked": False}
        t0 = self.host.monotonic()
        try:
            woken = await canary.ask(spare.client)
        except EngineError as exc:
            raise SpareFailed(f"no answer to the canary prompt after the wake: {exc}") from None
        took = round(self.host.monotonic() - t0, 3)
        wrong = spare.canary.differs(woken)
        if wrong is None:
            return {"checked": True, "equal": True, "tokens": len(woken.tokens),
                    "max_logprob_drift": round(spare.canary.drift(woken), 6), "took_s": took}
        path = incident.keep(self.cfg.state.dir, "spare_canary",
                             canary_incident(spare, spare.canary, woken, wrong),
                             self.cfg.engine.secrets(), self.publish, self.host.wall)
        # vLLM's sleep-mode bugs repeat: no spare at this rung in this run
        self.failed.add(spare.profile, "spare")
        await self.drop("canary", fault=True, detail=wrong, incident=path)
        return None

    async def check(self, next_rung: Profile | None) -> None:
        """While the engine serves: a spare that died, or that no longer is the rung a failure
        would pick, goes."""
        spare = self.spare
        if spare is None or not spare.whole_asleep or await self._dropped_unfit(spare):
            return
        if next_rung is None or next_rung.compile_key() != spare.profile.compile_key():
            await self.drop("the engine's next rung is another one now")
            return
        await self._check_footprint(spare)
        async with self._waking:
            await self._check_by_waking(spare)

    async def _check_by_waking(self, spare: Spare) -> None:
        """Every ``spare_check_every_s``: wake the spare, ask it the canary, put it back to sleep
        (``spare.checked``); one that answers otherwise, or fails to wake or sleep, is dropped
        and rebuilt now rather than found broken by the start that needs it. After
        ``spare_max_wakes`` such wakes it is rebuilt fresh (``recycled``). Only where the card
        holds it awake beside the engine and a start's headroom: the check must not squeeze
        it."""
        r, now = self.cfg.recovery, self.host.monotonic()
        every = r.spare_check_every_s
        if self.spare is not spare or not every or now - spare.checked_at < every:
            return
        spare.checked_at = now
        if spare.wakes >= r.spare_max_wakes:
            await self.drop(f"recycled: woken {spare.wakes} times by its checks (spare_max_wakes)")
            return
        short = await short_within(spare, self._snapshot, self.host,
                                   self.cfg.gpu.start_headroom_bytes, 0.0)
        if short:
            self.last_check = {
                "at": self.host.wall(), "checked": False, "why": f"not woken: {short}"
            }
            return
        try:
            await spare.wake()
            spare.wakes += 1
            checked = await self._check_canary(spare)
            if checked is None:
                return  # dropped: it answers otherwise than before it first slept
            await spare.fall_asleep()
        except SpareFailed as exc:
            await self.drop(f"its check: {exc}", fault=True)
            return
        took = round(self.host.monotonic() - now, 3)
        spare.checked_at = self.host.monotonic()
        self.last_check = {
            "at": self.host.wall(), "checked": True, "wakes": spare.wakes, "took_s": took,
            "canary": checked
        }
        self.publish(
            SpareChecked(at=self.host.wall(), pid=spare.pid, profile=spare.profile,
                         wakes=spare.wakes, took_s=took, canary=checked))

    async def _check_footprint(self, spare: Spare) -> None:
        """Every FOOTPRINT_EVERY_S: a spare whose sleeping footprint grew is recycled (dropped;
        the next one is built as any spare is). vLLM's sleep mode has left memory pinned that
        grows until outputs turn to garbage (vllm#21336); the canary would catch the garbage
        at the wake, this catches the growth before it."""
        grown = await spare.grown_asleep(self._snapshot)
        if grown:
            await self.drop("recycled: its sleeping footprint grew since it fell asleep",
                            fault=True, detail=grown)

    async def _dropped_unfit(self, spare: Spare) -> bool:
        """A spare whose API server exited while asleep is dropped (its engine core with it), and
        one a reload outdated (woken, it would serve the [engine] replaced); True if it was."""
        stale = outdated(spare, self.cfg.engine)
        if stale:
            await self.drop(stale)
            return True
        if spare.alive():
            return False
        await self.drop(f"it exited with status {spare.child.proc.returncode} while asleep",
                        fault=True)
        return True

    async def drop(self, reason: str, fault: bool = False, detail: str = "",
                   incident: str | None = None) -> None:
        spare, self.spare = self.spare, None
        if spare is None:
            return
        self.why = f"dropped: {reason}" + (f" ({detail})" if detail else "")
        e = self.cfg.engine
        await spare.stop(e.stop_timeout_s, e.kill_timeout_s)
        self.publish(
            SpareDropped(at=self.host.wall(), pid=spare.pid, profile=spare.profile, reason=reason,
                         fault=fault, detail=detail, incident=incident))

    async def _snapshot(self) -> list[DeviceSnapshot]:
        return await self.host.gpu_snapshot(self.cfg.engine.devices())

    def pids(self) -> set[int]:
        return self.spare.pids() if self.spare is not None else set()

    def status(self) -> dict[str, Any]:
        asleep = {} if self.spare is None else {
            **self.spare.status(), "last_check": self.last_check
        }
        return {
            "state": None, "why": self.why, "order": self.order.as_dict() if self.order else None,
            **asleep
        }

    async def close(self) -> None:
        await self.drop("the supervisor stops")


# What makes a second engine the one [engine] starts; not the timeouts kept around it.
ENGINE_SETTINGS = ("model", "command", "env", "args")


def outdated(built: Throwaway, engine: EngineConfig) -> str | None:
    """Why a second engine is no longer the engine ``engine`` (the [engine] in force) starts: a
    reload changed what it was started from. None while it still is."""
    changed = [k for k in ENGINE_SETTINGS
               if built.engine is not None and getattr(built.engine, k) != getattr(engine, k)]
    return f"a reload changed [engine] {', '.join(changed)} since it was built" if changed \
        else None


def take_bound_s(cfg: Config) -> float:
    """The longest ``SpareKeeper.take`` lasts, from the bounds its steps wait on (the start's
    watchdog deadline at its gates): a wake under way ends first (a check's, ``_check_by_waking``:
    /wake_up, /health, the canary, /sleep, or the spare dropped when one fails; a climb's or
    a dying engine's, ``wake_ahead``: its weights' wake (``wake_weights_ahead``), the card read
    for room, /wake_up, /health, the canary, the warm-up), then the start's own wake
    (/wake_up, /health, the canary), or the spare dropped (``drop``: the engine's stop grace, then
    SIGKILL)."""
    e = cfg.engine
    wake = SPARE_WAKE_S + SPARE_HEALTH_S + SPARE_CANARY_S
    drop = e.stop_timeout_s + e.kill_timeout_s
    ahead = SPARE_ROOM_WAIT_S + wake + max(SPARE_SLEEP_S, SPARE_WAKE_S + cfg.warmup.timeout_s) \
        + drop
    return ahead + (wake + drop)


def wake_beside_the_dying(kind: FailureKind, below: Sequence[Profile]) -> Profile | None:
    """The rung whose spare a dying engine's settled verdict wakes beside it, before its stop
    (``wake_ahead``), or None. A runtime OOM's restart steps one rung down (``below``'s first):
    the rung the spare was built for. Waking it while the dead engine's tree is killed and its
    memory released, not after, takes that 0.3 s off the failover on the H200 at 0.5. Nothing
    else: a death that restarts the same rung leaves the spare asleep, and a device's own fault
    keeps nothing on the card."""
    if kind is FailureKind.RUNTIME_OOM and below:
        return below[0]
    return None


async def short_within(spare: Spare, snapshot: Callable[[], Awaitable[list[DeviceSnapshot]]],
                       host: Host, headroom: int, wait_s: float) -> str | None:
    """Why the card cannot take ``spare`` back (``Spare.short_to_wake``), read until it can or
    ``wait_s`` is over."""
    deadline = host.monotonic() + wait_s
    for pause in poll_delays(ROOM_POLL_S):
        try:
            short = spare.short_to_wake(await snapshot(), headroom)
        except GpuLost as exc:
            return str(exc)
        if not short or host.monotonic() + pause > deadline:
            return short
        await host.sleep(pause)
    return None  # not reached: the pauses never end


async def wake_weights_ahead(spare: Spare,
                             snapshot: Callable[[], Awaitable[list[DeviceSnapshot]]],
                             headroom: int, short: str) -> str | None:
    """Where the card cannot take the whole spare back yet (``short``: a dead engine's memory is
    still held) but holds its weights: ``/wake_up?tags=weights`` now, the bulk of a wake (17.6
    GiB copied back from host memory at the seed's shape, most of the H200's 0.69 s wake at 0.5),
    while the dead engine is killed and its memory released; the rest (``kv_cache``) once it is
    (``spare.weights_woken``). Where its weights do not fit either, or their size is unknown,
    nothing is woken (the reason logged). Why the wake failed (the spare is then dropped), or
    None. (Only the supervisor's stop cancels it, and that stops the spare.)"""
    if spare.weights is None:
        spare.weights = offloaded_bytes(spare.tail.snapshot())
    try:  # an unknown size needs no card read: short_for_weights says so
        snaps = [] if spare.weights is None else await snapshot()
        not_now = spare.short_for_weights(snaps, headroom)
    except GpuLost as exc:
        not_now = str(exc)
    if not_now:
        log.info("spare.weights_not_woken_ahead", pid=spare.pid, why=not_now)
        return None
    t0 = spare.host.monotonic()
    try:
        await spare.wake(WEIGHTS)
    except SpareFailed as exc:
        return str(exc)
    spare.weights_back_s = round(spare.host.monotonic() - t0, 3)
    log.info("spare.weights_woken", pid=spare.pid, took_s=spare.weights_back_s,
             weights_gib=round((spare.weights or 0) / GIB, 2), before=short)
    return None


def wake_while_it_exits(kind: FailureKind, below: Sequence[Profile], sleeping: Profile | None,
                        profile: Profile, ladder: LadderConfig) -> Profile | None:
    """The rung whose spare is woken while a dead engine's API server exits by itself (a death
    whose verdict waits for vLLM's last words; ``kind`` is what its evidence says so far), or
    None. Its restart would take that spare: a runtime OOM's the rung below (as
    ``wake_beside_the_dying``), a death that would restart its own rung the sleeping spare's
    (decide/policy.py ``into_sleeping_spare``; ``sleeping`` is that spare's rung where it may).
    On the H200 the API server's own exit was 0.62 s of the EngineCore's SIGKILL's 1.33 s
    recovery, the wake after it. Where the final verdict goes elsewhere, the start drops the
    woken spare, as any spare that cannot serve it."""
    memory = wake_beside_the_dying(kind, below)
    if memory is not None:
        return memory
    return sleeping if spare_takes_the_restart(kind, profile, sleeping, ladder) else None


def window(spare: Spare | None, last_start_s: float | None) -> dict[str, Any] | None:
    """While no spare sleeps: what a memory failure's restart costs (a start, not a wake), as the
    last start that woke no spare took from spawn to READY (``last_start_s``; null before one)."""
    if spare is not None:
        return None
    return {
        "restart_s": last_start_s,
        "why": "no spare asleep: a memory failure's restart is a start, not a wake"
    }


ROOM_POLL_S = 0.1  # the card read while a dead EngineCore's memory comes back (0.11-0.28 s on GPUs)
FOOTPRINT_EVERY_S = 5.0  # how often a sleeping spare's memory is read
FOOTPRINT_GROWTH = 512 * MIB  # ... and how much more than it kept when it fell asleep recycles it
