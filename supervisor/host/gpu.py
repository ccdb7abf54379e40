"""GPU memory as NVML reports it: snapshots, who holds memory, waiting until it is released.

vLLM preallocates ~gpu_memory_utilization of the card, so a high "used" is normal. What matters
to the supervisor is (1) that the processes of a stopped engine no longer hold memory before the
next start, and (2) that enough memory is free for the next start (a foreign process may hold it).

NVML never crashes the supervisor: every call is guarded, and the async helpers run it in a
thread (a wedged driver can block an NVML call for seconds). A device NVML reports as lost
(``NVML_ERROR_GPU_IS_LOST``: fallen off the bus) raises GpuLost, which the engine run turns into
a ``device_fatal`` verdict with this evidence; any other NVML error means "no GPU view" for now.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("supervisor.gpu")
T = TypeVar("T")
GPU_IS_LOST = 15  # pynvml.NVML_ERROR_GPU_IS_LOST
Device = int | str  # an index, or a "GPU-..." / "MIG-..." UUID as CUDA_VISIBLE_DEVICES names it


class GpuLost(RuntimeError):
    """NVML says a device is gone (fallen off the bus, or the driver lost it)."""


@dataclass(frozen=True)
class DeviceSnapshot:
    index: int
    total: int
    free: int
    used: int
    processes: tuple[tuple[int, int], ...]  # (pid, bytes)

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "total": self.total, "free": self.free, "used": self.used,
                "processes": [{"pid": p, "bytes": b} for p, b in self.processes]}


class Nvml:
    """A guarded adapter over pynvml; ``available`` is False on hosts without an NVIDIA driver."""

    def __init__(self, module: Any = None) -> None:
        self._nvml: Any = None
        self._warned = False
        # device index -> (monotonic time, free bytes) last read
        self.seen: dict[int, tuple[float, int]] = {}
        try:
            nv: Any = module
            if nv is None:
                import pynvml

                nv = pynvml
            nv.nvmlInit()
            self._nvml = nv
        except Exception as exc:  # noqa: BLE001 - any NVML failure at init means "no GPU view"
            log.info("gpu.nvml_unavailable", reason=str(exc) or type(exc).__name__)

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def snapshot(self, devices: Sequence[Device] | None = None) -> list[DeviceSnapshot]:
        """Memory and processes of ``devices`` (all when None); [] when NVML cannot answer."""
        if self._nvml is None:
            return []
        try:
            snaps = self._snapshot(devices)
        except GpuLost:
            raise
        except Exception as exc:  # noqa: BLE001 - NVMLError and anything a broken driver raises
            if getattr(exc, "value", None) == GPU_IS_LOST:
                raise GpuLost(
                    f"NVML: {exc} (the GPU has fallen off the bus or the driver lost it)") from None
            if not self._warned:
                self._warned = True
                log.warning("gpu.nvml_error", error=f"{type(exc).__name__}: {exc}",
                            hint="GPU memory checks are skipped while NVML fails")
            return []
        now = time.monotonic()
        self.seen.update({s.index: (now, s.free) for s in snaps})
        return snaps

    def _snapshot(self, devices: Sequence[Device] | None) -> list[DeviceSnapshot]:
        nv = self._nvml
        count = nv.nvmlDeviceGetCount()
        out = []
        for dev in (devices if devices is not None else range(count)):
            if isinstance(dev, str):
                h = nv.nvmlDeviceGetHandleByUUID(dev)
                index = int(nv.nvmlDeviceGetIndex(h))
            elif dev < count:
                h, index = nv.nvmlDeviceGetHandleByIndex(dev), dev
            else:
                continue
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            procs: list[tuple[int, int]] = []
            for getter in ("nvmlDeviceGetComputeRunningProcesses",
                           "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    for p in getattr(nv, getter)(h):
                        procs.append((int(p.pid), int(p.usedGpuMemory or 0)))
                except nv.NVMLError as exc:
                    if getattr(exc, "value", None) == GPU_IS_LOST:
                        raise
                    continue
            out.append(
                DeviceSnapshot(index, int(mem.total), int(mem.free), int(mem.used), tuple(procs)))
        return out

    def driver_version(self) -> str | None:
        """The NVIDIA driver's version, None when NVML cannot say."""
        if self._nvml is None:
            return None
        try:
            v = self._nvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 - NVMLError and anything a broken driver raises
            return None
        return v.decode() if isinstance(v, bytes) else str(v)

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self._nvml = None


def holders(snaps: Sequence[DeviceSnapshot], pids: Collection[int]) -> dict[int, int]:
    """Bytes still held, by PID, of the given PIDs."""
    out: dict[int, int] = {}
    for s in snaps:
        for pid, used in s.processes:
            if pid in pids:
                out[pid] = out.get(pid, 0) + used
    return out


# "Does it fit on the GPU" is decided here alone: the start gate, the climb's room check and the
# precompiler's share all count free memory the same way, with what our own processes hold (the
# engine about to be replaced) counted as free.
def free_with(s: DeviceSnapshot, ours: Collection[int] = ()) -> int:
    """Bytes free on the device once ``ours`` (processes of the supervisor's own) have let go."""
    return s.free + sum(b for pid, b in s.processes if pid in ours)


def short_of(snaps: Sequence[DeviceSnapshot], fraction: float, headroom: int = 0,
             ours: Collection[int] = ()) -> list[DeviceSnapshot]:
    """Devices whose free memory (counting ``ours`` as free) is below ``fraction`` of their total
    plus ``headroom`` bytes.

    vLLM checks free >= fraction x total after its own CUDA context exists, which takes some
    hundreds of MiB that NVML still counts as free now: hence the headroom.
    """
    return [s for s in snaps if free_with(s, ours) < fraction * s.total + headroom]


def free_fraction(snaps: Sequence[DeviceSnapshot], ours: Collection[int] = ()) -> float | None:
    """The smallest free share of any device (counting ``ours`` as free); None without a GPU
    view."""
    return min((free_with(s, ours) / s.total for s in snaps if s.total), default=None)


async def _poll(nvml: Nvml, devices: Sequence[Device] | None,
                still: Callable[[list[DeviceSnapshot]], T], timeout_s: float, poll_s: float) -> T:
    """Snapshot (in a thread) until ``still(snapshot)`` is falsy or ``timeout_s`` passed; its
    last value. The reads come fast at first and slow down to one every ``poll_s``
    (``poll_delays``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    result = still(await asyncio.to_thread(nvml.snapshot, devices))
    delays = poll_delays(poll_s)
    while result and loop.time() < deadline:
        await asyncio.sleep(next(delays))
        result = still(await asyncio.to_thread(nvml.snapshot, devices))
    return result


FIRST_POLL_S = 0.01
POLL_GROWTH = 1.5


def poll_delays(poll_s: float) -> Iterator[float]:
    """The pauses between reads of a wait on the card: 10 ms, then each 1.5 times the last, up to
    ``poll_s``. A killed engine's memory comes back within a fraction of a second, and a failover
    waits for it: on the H200 the fixed 0.25 s poll made a release of less than that take 0.252 s
    of a 1.16 s failover. A wait that lasts pays about nine reads in its first 0.7 s, then one
    per ``poll_s`` as before."""
    delay = min(FIRST_POLL_S, poll_s)
    while True:
        yield delay
        delay = min(poll_s, delay * POLL_GROWTH)


async def wait_released(nvml: Nvml, pids: Collection[int], timeout_s: float,
                        poll_s: float = 0.25) -> dict[int, int]:
    """Wait until no PID of ``pids`` holds GPU memory; returns what is still held at the
    deadline."""
    if not nvml.available or not pids:
        return {}
    return await _poll(nvml, None, lambda snaps: holders(snaps, pids), timeout_s, poll_s)


# Memory "visibly being released": some short device's free memory grew at least this much within
# the last STEADY_S. A foreign process that holds its memory steady is not waited for: the start
# adapts instead.
RELEASE_STEP = 256 * 2**20
STEADY_S = 1.0


class Release:
    """Whether the free memory of the short devices still grows (an exiting process letting go).

    ``earlier`` is what the supervisor last read of each device (``Nvml.seen``): the stop's
    release wait reads the card as the old engine goes, so by the time the restart's backoff is
    over, a card that has not grown since is known steady, and the start need not watch it for
    another STEADY_S. ``outsiders(pids)`` says whether those holding the short devices' memory are
    all live processes of others (``proctree.held_by_outsiders``): then a second read that did not
    grow is steady too. A failure's first restart has no backoff, and the STEADY_S it watched the
    seed's other process was 1.0 s of the 13 s of an H100's restart without a spare."""

    def __init__(self, now: float, earlier: Mapping[int, tuple[float, int]] | None = None,
                 outsiders: Callable[[Collection[int]], bool] | None = None) -> None:
        self.since = {i: t for i, (t, _) in (earlier or {}).items()}
        self.best: dict[int, int] = {i: free for i, (_, free) in (earlier or {}).items()}
        self.grew_at = now
        self.outsiders = outsiders
        self.reads = 0
        self.held_by_others = False

    def note(self, short: Sequence[DeviceSnapshot], now: float) -> None:
        self.reads += 1
        if self.reads == 1:
            self.grew_at = max((self.since.get(s.index, now) for s in short), default=now)
        for s in short:
            if s.free >= self.best.get(s.index, s.free) + RELEASE_STEP:
                self.grew_at = now
            self.best[s.index] = max(self.best.get(s.index, 0), s.free)
        self.held_by_others = (
            self.reads > 1 and self.grew_at < now and self.outsiders is not None
            and self.outsiders({pid for s in short for pid, _ in s.processes}))

    def steady(self, now: float) -> bool:
        return self.held_by_others or now - self.grew_at >= STEADY_S


async def wait_free(nvml: Nvml, devices: Sequence[Device] | None, fraction: float, headroom: int,
                    timeout_s: float, poll_s: float = 0.25,
                    outsiders: Callable[[Collection[int]], bool] | None = None,
                    ) -> list[DeviceSnapshot]:
    """Wait until each device has ``fraction`` of its memory (+ headroom) free; returns those still
    short.

    Returns early, short, once the shortfall is steady (nothing grew for STEADY_S, or for one
    read where ``outsiders`` says every holder is another's live process): memory another
    process holds is not coming back by waiting, and ``timeout_s`` bounds only a release that is
    under way."""
    if not nvml.available:
        return []
    loop = asyncio.get_running_loop()
    release = Release(loop.time(), dict(nvml.seen), outsiders)
    short: list[DeviceSnapshot] = []

    def still(snaps: list[DeviceSnapshot]) -> bool:
        nonlocal short
        short, now = short_of(snaps, fraction, headroom), loop.time()
        release.note(short, now)
        return bool(short) and not release.steady(now)

    await _poll(nvml, devices, still, timeout_s, poll_s)
    return short
