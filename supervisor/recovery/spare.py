"""``[recovery] spare``: the next rung's engine, built while the engine serves and kept asleep.

What is left of a recovery once the imports and the compile are done ahead (the standby, the
precompile) is vLLM building an engine: at the seed's scale 18 of a 20 s restart (docs/recovery.md
§5). A spare skips it. A second engine (recovery/throwaway.py) at the rung the next runtime OOM would
pick is started with the real weights, ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1`` (the routes
``/sleep`` and ``/wake_up``, which the gateway never forwards), and once it answers /health it is put
to sleep at level 1: its weights are copied to host memory and its KV cache dropped, its CUDA graphs,
compiled code and processes kept; ~2 GiB stays on the card. When the engine fails into that rung the
next start wakes the spare (about half a second on the H200) and adopts it as the engine.

A spare listens on a port of its own: only the gateway follows it. It is stopped, never kept
"just in case", when the engine's next rung moves elsewhere, when a start wants another rung, when
the card has not the memory it needs to wake, or when it dies; the start is then cold, as without it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
import structlog

from supervisor.bounds import (
    GIB,
    MIB,
    SPARE_CANARY_S,
    SPARE_HEALTH_S,
    SPARE_SLEEP_S,
    SPARE_WAKE_MARGIN,
    SPARE_WAKE_S,
)
from supervisor.config import SPARE_NEEDS_GATEWAY, Config
from supervisor.decide.classify import fraction_that_fits
from supervisor.event_stream import Event, SpareAsleep, SpareChecked, SpareDropped, SpareWoken
from supervisor.host import Host, leftovers
from supervisor.host.gpu import DeviceSnapshot, GpuLost
from supervisor.host.vllm_http import EngineError
from supervisor.ops import incident
from supervisor.profile import Knob, Profile
from supervisor.recovery import canary
from supervisor.recovery.canary import Canary
from supervisor.recovery.sizing import SecondEngine, second_engine_bytes
from supervisor.recovery.throwaway import FailedRungs, Throwaway, fields_of

log = structlog.get_logger("supervisor.recovery.spare")



class SpareFailed(Exception):
    """The spare could not be put to sleep or woken."""


@dataclass(eq=False)
class Spare(Throwaway):
    """A whole engine asleep at ``profile`` (the utilization it could start at beside the engine)."""

    awake: dict[int, int] = field(default_factory=dict)  # device -> bytes its processes held awake (NVML)
    asleep: dict[int, int] = field(default_factory=dict)  # ... and asleep
    canary: Canary | None = None  # its answer to the canary prompt before it slept
    footprint_at: float = 0.0  # when its sleeping footprint was last read (monotonic)
    wakes: int = 0  # how often a check woke it (``spare_check_every_s``)
    checked_at: float = 0.0  # when it fell asleep or was last checked (monotonic)

    def serves(self, profile: Profile) -> bool:
        """It can be the engine at ``profile``: the same rung (the compile key: every knob but the
        utilization), at a utilization no higher than the profile's."""
        mine = self.profile.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.0
        theirs = profile.effective(Knob.GPU_MEMORY_UTILIZATION) or 1.0
        return self.profile.compile_key() == profile.compile_key() and mine <= theirs

    def short_to_wake(self, snaps: Sequence[DeviceSnapshot], headroom: int) -> str | None:
        """Why the card cannot take the spare back now (what it gave up asleep, plus the headroom), or None."""
        for s in snaps:
            need = max(0, self.awake.get(s.index, 0) - self.asleep.get(s.index, 0))
            if s.free < need + headroom:
                return (f"GPU {s.index}: {s.free / GIB:.2f} GiB free, the spare needs {need / GIB:.2f} GiB "
                        f"back to wake (+ {headroom / GIB:.2f} GiB headroom)")
        return None

    async def fall_asleep(self) -> None:
        try:
            await self.client.command("/sleep?level=1", SPARE_SLEEP_S)
        except EngineError as exc:
            raise SpareFailed(f"/sleep failed: {exc}") from None

    async def wake(self) -> None:
        try:
            await self.client.command("/wake_up", SPARE_WAKE_S)
        except EngineError as exc:
            raise SpareFailed(f"/wake_up failed: {exc}") from None
        if await self.client.health(timeout=SPARE_HEALTH_S) != 200:
            raise SpareFailed("no /health 200 after /wake_up")


def held_by(snaps: Iterable[DeviceSnapshot], pids: set[int]) -> dict[int, int]:
    """Bytes ``pids`` hold on each device (NVML's per-process accounting)."""
    return {s.index: sum(b for pid, b in s.processes if pid in pids) for s in snaps}


class SpareKeeper:
    """Holds at most one spare: decides whether one is wanted, keeps it asleep, hands it to a start, or stops it."""

    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None], failed: FailedRungs) -> None:
        self.cfg, self.host, self.publish, self.failed = cfg, host, publish, failed
        self.spare: Spare | None = None
        self.order: Order | None = None  # where the last spare was decided to be built (first, or beside)
        self.last_build_s: float | None = None  # how long the last spare took from its spawn to asleep
        self.why = "not asked yet: no rung has been precompiled"
        self.last_check: dict[str, Any] | None = None  # the last wake check's result (spare_check_every_s)
        self._waking = asyncio.Lock()  # a check's wake and a start's never overlap

    def configure(self, cfg: Config) -> None:
        self.cfg = cfg

    def _refusal(self, rung: Profile) -> str | None:
        """Why no spare at all for ``rung`` (its mode, its arguments, its history), before the card is asked."""
        mode = self.cfg.recovery.spare
        if self.failed.no_spare(rung):
            return ("a second engine at this rung failed to start, to sleep, or its canary after a wake in this run: "
                    "no spare for it")
        if mode == "off":
            return '[recovery] spare = "off"'
        broken = canary.breaks_on_wake(dict(self.cfg.engine.args))
        if broken:
            return f"refused: {broken}"
        if mode == "auto" and self.cfg.gateway is None:
            return f"auto: no [gateway]: {SPARE_NEEDS_GATEWAY}"
        return None

    async def wanted(self, rung: Profile) -> float | None:
        """Whether a spare for ``rung`` is built beside the serving engine: the utilization it starts at (the
        rung's when no GPU is seen), or None; ``self.why`` says why, for /status. NVML is asked only when the mode
        and the gateway leave it to the card."""
        mode, util = self.cfg.recovery.spare, rung.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.9
        self.why = self._refusal(rung) or ""
        if self.why:
            return None
        if self.cfg.recovery.spare_order == "first":
            self.why = '[recovery] spare_order = "first": a spare is built before the engine, at planned starts'
            return None
        try:
            snaps = await self._snapshot()
        except GpuLost as exc:
            self.why = f"the GPU is lost: {exc}"
            return None
        if mode == "on":
            self.why = '[recovery] spare = "on"'
            return fits_beside(snaps, util, self.cfg.gpu.start_headroom_bytes) if snaps else util
        if not snaps:
            self.why = "auto: no GPU seen (vLLM's sleep mode needs CUDA or ROCm)"
            return None
        e = self.cfg.engine
        found, self.why = room_for_spare(snaps, e.model, rung, e.ranks(), self.cfg.gpu.start_headroom_bytes,
                                         self.cfg.ladder.gpu_memory_utilization_floor,
                                         psutil.virtual_memory().available)
        return found

    async def first(self, rung: Profile, engine: Profile) -> float | None:
        """Whether a spare for ``rung`` is built now, on the card the engine is about to start on at ``engine``
        (spare first): the utilization it starts at, or None; ``self.order`` and ``self.why`` say why."""
        mode, e = self.cfg.recovery.spare, self.cfg.engine
        refused = self._refusal(rung)
        if refused or self.cfg.recovery.spare_order == "beside":
            return None
        try:
            snaps = await self._snapshot()
        except GpuLost:
            return None
        if not snaps:
            return None  # the order is the card's numbers: without them a spare is only ever built beside
        size = second_engine_bytes(e.model, rung, e.ranks())
        refused = host_refusal(size, psutil.virtual_memory().available) if mode == "auto" else None
        if refused:
            self.why = refused
            return None
        self.order = choose_order(snaps, engine.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.9,
                                  size.need if size is not None else 0, self.cfg.ladder.gpu_memory_utilization_floor,
                                  self.cfg.gpu.start_headroom_bytes, self.cfg.recovery.spare_order)
        if self.order.order != "first":
            return None
        self.why = f"building it first: {self.order.why}"
        return self.order.spare_util

    async def keep(self, started: Throwaway, spawned_at: float) -> bool:
        """Put a throwaway that answers /health to sleep and keep it; False (and an event) when that fails, and
        the caller stops it as any throwaway."""
        spare = Spare(**fields_of(started))
        pids = self.host.tree_pids(spare.child)
        t0 = self.host.monotonic()
        try:
            try:
                spare.canary = await canary.ask(spare.client)
            except EngineError as exc:
                raise SpareFailed(f"no answer to the canary prompt before sleeping: {exc}") from None
            spare.awake = held_by(await self._snapshot(), pids)
            await spare.fall_asleep()
            spare.asleep = held_by(await self._snapshot(), pids)
            spare.footprint_at = spare.checked_at = self.host.monotonic()
        except (SpareFailed, GpuLost) as exc:
            self.failed.add(spare.profile, "spare")
            self.publish(SpareDropped(at=self.host.wall(), pid=spare.pid, profile=spare.profile,
                                      reason=str(exc), fault=True))
            return False
        now = self.host.monotonic()
        spare.record_as(leftovers.SPARE)  # a spare kept is no precompile's throwaway
        self.spare, self.last_build_s = spare, round(now - spawned_at, 3)
        self.why = "asleep"
        self.publish(SpareAsleep(at=self.host.wall(), pid=spare.pid, port=spare.port, profile=spare.profile,
                                 took_s=round(now - spawned_at, 3), sleep_s=round(now - t0, 3),
                                 held_awake_mib=sum(spare.awake.values()) // MIB,
                                 held_asleep_mib=sum(spare.asleep.values()) // MIB))
        return True

    @staticmethod
    def take_bound_s(cfg: Config) -> float:
        """The longest ``take`` lasts, from the bounds its steps wait on (the start's watchdog deadline at its gates):
        a check's wake under way ends first (``_check_by_waking``: /wake_up, /health, the canary, /sleep, or the
        spare dropped when one fails), then the start's own wake (/wake_up, /health, the canary), or the spare
        dropped (``drop``: the engine's stop grace, then SIGKILL)."""
        e = cfg.engine
        wake, drop = SPARE_WAKE_S + SPARE_HEALTH_S + SPARE_CANARY_S, e.stop_timeout_s + e.kill_timeout_s
        return (wake + SPARE_SLEEP_S + drop) + (wake + drop)

    async def take(self, profile: Profile, keep_for: Profile | None = None) -> Spare | None:
        """For a start at ``profile``: the spare, awake and no longer ours to stop, or None. A spare that cannot
        serve this start is stopped first, unless it serves ``keep_for`` (a failure's restart at the same rung:
        the rung its next memory failure picks), which it stays asleep for. A check's wake under way ends first."""
        async with self._waking:
            return await self._take(profile, keep_for)

    async def _take(self, profile: Profile, keep_for: Profile | None) -> Spare | None:
        spare = self.spare
        if spare is None or await self._dropped_dead(spare):
            return None
        if not spare.serves(profile):
            if keep_for is not None and spare.serves(keep_for):
                return None  # at 0.9 no spare starts beside the engine: losing this one loses the fast path
            await self.drop(f"this start wants another rung ({profile.compile_key()})")
            return None
        try:
            short = spare.short_to_wake(await self._snapshot(), SPARE_WAKE_MARGIN)
        except GpuLost as exc:
            short = str(exc)
        if short:
            await self.drop(short, fault=True)
            return None
        t0 = self.host.monotonic()
        try:
            await spare.wake()
            took = round(self.host.monotonic() - t0, 3)
            checked = await self._check_canary(spare)
        except SpareFailed as exc:
            await self.drop(str(exc), fault=True)
            return None
        except asyncio.CancelledError:
            await self.drop("the start was ended while the spare woke", fault=True)
            raise
        if checked is None:
            return None  # dropped: it answers otherwise than before it slept
        self.spare = None
        leftovers.clear(self.cfg.state.dir, leftovers.SPARE)
        self.publish(SpareWoken(at=self.host.wall(), pid=spare.pid, port=spare.port, profile=spare.profile,
                                took_s=took, canary=checked))
        return spare

    async def _check_canary(self, spare: Spare) -> dict[str, Any] | None:
        """The canary again, after the wake: its result for ``spare.woken``, or None once the spare is dropped
        for answering otherwise (``spare.dropped`` reason "canary", an incident bundle); SpareFailed when the
        woken spare does not answer at all."""
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
        path = incident.keep(self.cfg.state.dir, "spare_canary", {
            "failure": {"kind": "spare_canary", "evidence": wrong}, "pid": spare.pid,
            "profile": spare.profile.knobs(), "argv": list(spare.argv), "vllm_version": spare.version,
            "before_sleep": {"tokens": list(spare.canary.tokens), "logprobs": list(spare.canary.logprobs)},
            "after_wake": {"tokens": list(woken.tokens), "logprobs": list(woken.logprobs)},
            "log_tail": spare.tail.snapshot()[-50:]}, self.cfg.engine.secrets(), self.publish, self.host.wall)
        self.failed.add(spare.profile, "spare")  # vLLM's sleep-mode bugs repeat: no spare at this rung in this run
        await self.drop("canary", fault=True, detail=wrong, incident=path)
        return None

    async def check(self, next_rung: Profile | None) -> None:
        """While the engine serves: a spare that died, or that no longer is the rung a failure would pick, goes."""
        spare = self.spare
        if spare is None or await self._dropped_dead(spare):
            return
        if next_rung is None or next_rung.compile_key() != spare.profile.compile_key():
            await self.drop("the engine's next rung is another one now")
            return
        await self._check_footprint(spare)
        async with self._waking:
            await self._check_by_waking(spare)

    async def _check_by_waking(self, spare: Spare) -> None:
        """Every ``spare_check_every_s``: wake the spare, ask it the canary, put it back to sleep (``spare.checked``);
        one that answers otherwise, or fails to wake or sleep, is dropped and rebuilt now rather than found broken
        by the start that needs it. After ``spare_max_wakes`` such wakes it is rebuilt fresh (``recycled``). Only
        where the card holds it awake beside the engine and a start's headroom: the check must not squeeze it."""
        r, now = self.cfg.recovery, self.host.monotonic()
        if self.spare is not spare or not r.spare_check_every_s or now - spare.checked_at < r.spare_check_every_s:
            return
        spare.checked_at = now
        if spare.wakes >= r.spare_max_wakes:
            await self.drop(f"recycled: woken {spare.wakes} times by its checks (spare_max_wakes)")
            return
        try:
            short = spare.short_to_wake(await self._snapshot(), self.cfg.gpu.start_headroom_bytes)
        except GpuLost as exc:
            short = str(exc)
        if short:
            self.last_check = {"at": self.host.wall(), "checked": False, "why": f"not woken: {short}"}
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
        self.last_check = {"at": self.host.wall(), "checked": True, "wakes": spare.wakes, "took_s": took,
                           "canary": checked}
        self.publish(SpareChecked(at=self.host.wall(), pid=spare.pid, profile=spare.profile, wakes=spare.wakes,
                                  took_s=took, canary=checked))

    async def _check_footprint(self, spare: Spare) -> None:
        """Every FOOTPRINT_EVERY_S: a spare whose sleeping footprint grew is recycled (dropped; the next one is built
        as any spare is). vLLM's sleep mode has left memory pinned that grows until outputs turn to garbage
        (vllm#21336); the canary would catch the garbage at the wake, this catches the growth before it."""
        now = self.host.monotonic()
        if not spare.asleep or now - spare.footprint_at < FOOTPRINT_EVERY_S:
            return
        spare.footprint_at = now
        try:
            held = held_by(await self._snapshot(), self.host.tree_pids(spare.child))
        except GpuLost:
            return
        more = {d: b - spare.asleep.get(d, 0) for d, b in held.items()}
        grown = {d: b for d, b in more.items() if b > FOOTPRINT_GROWTH}
        if grown:
            what = ", ".join(f"GPU {d}: +{b // MIB} MiB" for d, b in grown.items())
            await self.drop("recycled: its sleeping footprint grew since it fell asleep", fault=True,
                            detail=f"{what} over the {sum(spare.asleep.values()) // MIB} MiB it kept asleep")

    async def _dropped_dead(self, spare: Spare) -> bool:
        """A spare whose API server exited while asleep is dropped (its engine core with it); True if it was."""
        if spare.alive():
            return False
        await self.drop(f"it exited with status {spare.child.proc.returncode} while asleep", fault=True)
        return True

    async def drop(self, reason: str, fault: bool = False, detail: str = "", incident: str | None = None) -> None:
        spare, self.spare = self.spare, None
        if spare is None:
            return
        self.why = f"dropped: {reason}" + (f" ({detail})" if detail else "")
        e = self.cfg.engine
        await spare.stop(e.stop_timeout_s, e.kill_timeout_s)
        self.publish(SpareDropped(at=self.host.wall(), pid=spare.pid, profile=spare.profile, reason=reason,
                                  fault=fault, detail=detail, incident=incident))

    async def _snapshot(self) -> list[DeviceSnapshot]:
        return await self.host.gpu_snapshot(self.cfg.engine.devices())

    def pids(self) -> set[int]:
        return self.spare.pids() if self.spare is not None else set()

    def status(self) -> dict[str, Any]:
        s = self.spare
        order = self.order.as_dict() if self.order else None
        if s is None:
            return {"state": None, "why": self.why, "order": order}
        return {"state": "asleep", "pid": s.pid, "port": s.port, "profile": s.profile.knobs(),
                "held_asleep_mib": sum(s.asleep.values()) // MIB, "why": self.why,
                "canary": s.canary.as_dict() if s.canary else None, "order": order, "wakes": s.wakes,
                "last_check": self.last_check}

    async def close(self) -> None:
        await self.drop("the supervisor stops")


def fits_beside(snaps: Sequence[DeviceSnapshot], util: float, headroom: int) -> float:
    """The utilization a second engine can start at beside what runs (vLLM's start check wants it free)."""
    s = min(snaps, key=lambda d: d.free / d.total)
    return min(util, fraction_that_fits(max(0, s.free - headroom), s.total))


def host_refusal(size: SecondEngine | None, ram_available: int) -> str | None:
    """Why "auto" keeps no spare whatever the card holds: its size is unknown, or the host's available memory
    cannot keep its weights asleep (plus 2 GiB)."""
    if size is None:
        return "auto: the model is not a local directory with weights, so their size is unknown"
    if ram_available < size.weights + 2 * GIB:
        return (f"auto: the host has {ram_available / GIB:.1f} GiB of memory available; a spare asleep keeps its "
                f"{size.weights / GIB:.1f} GiB of weights there")
    return None


def room_for_spare(snaps: Sequence[DeviceSnapshot], model: str, rung: Profile, ranks: int, headroom: int,
                   floor: float, ram_available: int) -> tuple[float | None, str]:
    """On a GPU, "auto" keeps a spare when its weights fit in the host's available memory (where they sleep)
    and the card holds, beside the engine, a second engine at a utilization no lower than the ladder's floor:
    its weights, the rung's prefill peak, its CUDA graphs and a KV cache."""
    size = second_engine_bytes(model, rung, ranks)
    refused = host_refusal(size, ram_available)
    if refused or size is None:
        return None, refused or ""
    weights, need = size.weights, size.need
    util = fits_beside(snaps, rung.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.9, headroom)
    total = min(s.total for s in snaps)
    if util < floor or util * total < need:
        return None, (f"auto: a spare beside the engine could start at gpu_memory_utilization {util:g} "
                      f"({util * total / GIB:.1f} GiB); it needs at least {floor:g} and about {need / GIB:.1f} GiB "
                      f"before its KV cache")
    return util, (f"auto: the card holds a spare beside the engine at gpu_memory_utilization {util:g} "
                  f"(about {need / GIB:.1f} GiB before its KV cache); its {weights / GIB:.1f} GiB of weights "
                  f"sleep in the host's {ram_available / GIB:.1f} GiB available")


FOOTPRINT_EVERY_S = 5.0  # how often a sleeping spare's memory is read
FOOTPRINT_GROWTH = 512 * MIB  # ... and how much more than it kept when it fell asleep recycles it
ASLEEP_ESTIMATE = 5 * GIB // 2  # a spare's sleeping footprint before one is measured (0.9-2.1 GiB on the H200)


@dataclass(frozen=True)
class Order:
    """Where the next spare is built: ``beside`` the serving engine, ``first`` (before it, on the free card), or
    nowhere (None); the utilization it starts at, and why, for /status."""

    order: str | None
    spare_util: float | None
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {"order": self.order, "gpu_memory_utilization": self.spare_util, "why": self.why}


def choose_order(snaps: Sequence[DeviceSnapshot], engine_util: float, need: int, floor: float, headroom: int,
                 mode: str = "auto", asleep: int = ASLEEP_ESTIMATE) -> Order:
    """With the card as it is before the engine starts (``snaps``): beside, when what the engine at
    ``engine_util`` leaves holds a second engine of ``need`` bytes at the ladder's ``floor`` or more; else first,
    when the free card holds the spare at the engine's utilization and then the engine beside the spare asleep
    (``asleep``), so that the spare wakes into what the dead engine frees. ``mode`` "beside" or "first" forces one."""
    s = min(snaps, key=lambda d: d.free / d.total)
    left = max(0, s.free - int(engine_util * s.total) - headroom)
    beside = min(engine_util, fraction_that_fits(left, s.total))
    why_beside = (f"beside the engine at gpu_memory_utilization {engine_util:g} a spare could start at {beside:g} "
                  f"({beside * s.total / GIB:.1f} GiB); it needs at least {floor:g} and about {need / GIB:.1f} GiB")
    if mode != "first" and beside >= floor and beside * s.total >= need:
        return Order("beside", beside, f"{mode}: {why_beside}")
    first = min(engine_util, fraction_that_fits(max(0, s.free - asleep - headroom), s.total))
    why_first = (f"built first on the free card ({s.free / GIB:.1f} GiB) at {first:g}, the engine then beside its "
                 f"sleeping footprint (about {asleep / GIB:.1f} GiB)")
    if mode != "beside" and first >= floor and first * s.total >= need:
        return Order("first", first, f"{mode}: {why_first}" + ("" if mode == "first" else f"; not {why_beside}"))
    return Order(None, None, f"{mode}: neither order fits: {why_beside}; and the free card "
                             f"({s.free / GIB:.1f} GiB) holds a spare only at {first:g}")
