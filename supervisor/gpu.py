"""GPU memory as NVML reports it: snapshots, who holds memory, waiting until it is released.

vLLM preallocates ~gpu_memory_utilization of the card, so a high "used" is normal. What matters
to the supervisor is (1) that the processes of a stopped engine no longer hold memory before the
next start, and (2) that enough memory is free for the next start (a foreign process may hold it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger("supervisor.gpu")


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
    """A thin adapter over pynvml; ``available`` is False on hosts without an NVIDIA driver."""

    def __init__(self) -> None:
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as exc:  # noqa: BLE001 - any NVML failure means "no GPU view"
            log.info("gpu.nvml_unavailable", reason=str(exc) or type(exc).__name__)

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def snapshot(self, indices: Sequence[int] | None = None) -> list[DeviceSnapshot]:
        if self._nvml is None:
            return []
        nv = self._nvml
        out = []
        count = nv.nvmlDeviceGetCount()
        for i in (indices if indices is not None else range(count)):
            if i >= count:
                continue
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            procs: list[tuple[int, int]] = []
            for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    for p in getattr(nv, getter)(h):
                        procs.append((int(p.pid), int(p.usedGpuMemory or 0)))
                except nv.NVMLError:
                    continue
            out.append(DeviceSnapshot(i, int(mem.total), int(mem.free), int(mem.used), tuple(procs)))
        return out

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


def short_of(snaps: Sequence[DeviceSnapshot], fraction: float, headroom: int = 0) -> list[DeviceSnapshot]:
    """Devices whose free memory is below ``fraction`` of their total plus ``headroom`` bytes.

    vLLM checks free >= fraction x total after its own CUDA context exists, which takes some
    hundreds of MiB that NVML still counts as free now: hence the headroom.
    """
    return [s for s in snaps if s.free < fraction * s.total + headroom]


async def wait_released(nvml: Nvml, pids: Collection[int], timeout_s: float, poll_s: float = 0.25) -> dict[int, int]:
    """Wait until no PID of ``pids`` holds GPU memory; returns what is still held at the deadline."""
    if not nvml.available or not pids:
        return {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    held = holders(nvml.snapshot(), pids)
    while held and loop.time() < deadline:
        await asyncio.sleep(poll_s)
        held = holders(nvml.snapshot(), pids)
    return held


async def wait_free(nvml: Nvml, indices: Sequence[int] | None, fraction: float, headroom: int,
                    timeout_s: float, poll_s: float = 1.0) -> list[DeviceSnapshot]:
    """Wait until each device has ``fraction`` of its memory (+ headroom) free; returns those still short."""
    if not nvml.available:
        return []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    short = short_of(nvml.snapshot(indices), fraction, headroom)
    while short and loop.time() < deadline:
        await asyncio.sleep(poll_s)
        short = short_of(nvml.snapshot(indices), fraction, headroom)
    return short
