"""What must hold before a start spawns anything: the model is there, and the GPU has the memory.

Each gate waits a bounded time and returns None (go on), an adapted profile (start now, at the
``gpu_memory_utilization`` that fits beside memory another process holds steadily), or the verdict
that ends the start before any process exists: a config error (the model never appeared), a device
fault (NVML lost the GPU) or a startup memory failure (too little free memory even at the ladder's
floor), with NVML's numbers as evidence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from supervisor.bounds import GIB
from supervisor.config import Config, is_local_path
from supervisor.decide.classify import fraction_that_fits
from supervisor.engine_states import Failure, FailureKind, TriggerKind
from supervisor.event_stream import (
    Event,
    GpuLostEvent,
    GpuNotReleased,
    GpuShort,
    ModelAppeared,
    ModelMissing,
    UtilizationAdapted,
)
from supervisor.host import Host
from supervisor.host.gpu import GpuLost
from supervisor.profile import Knob, Profile

Closed = tuple[TriggerKind, str, Failure]


@dataclass(frozen=True)
class Adapted:
    """Start at ``profile`` (a lower utilization than the rung's), for the reason given."""

    profile: Profile
    reason: str


async def every_gate(cfg: Config, host: Host, publish: Callable[[Event], None],
                     profile: Profile) -> Closed | Adapted | None:
    """The model gate, then the GPU gate."""
    return await model_gate(cfg, host, publish) or await gpu_gate(cfg, host, publish, profile)


async def model_gate(cfg: Config, host: Host, publish: Callable[[Event], None]) -> Closed | None:
    """A local model path missing at boot may be a late mount: wait for it, with backoff, for a
    bounded time."""
    model, wait_s = cfg.engine.model, cfg.engine.model_wait_s
    if not is_local_path(model) or host.path_exists(model):
        return None
    publish(ModelMissing(at=host.wall(), model=model, waiting_up_to_s=wait_s))
    deadline = host.monotonic() + wait_s
    delay = 1.0
    while host.monotonic() < deadline:
        await host.sleep(min(delay, max(0.0, deadline - host.monotonic())))
        if host.path_exists(model):
            publish(ModelAppeared(at=host.wall(), model=model))
            return None
        delay = min(30.0, delay * 2)
    evidence = f"local model path {model!r} does not exist (waited engine.model_wait_s={wait_s:g}s)"
    return TriggerKind.MODEL_MISSING, evidence, Failure(FailureKind.CONFIG_ERROR, evidence)


async def gpu_gate(cfg: Config, host: Host, publish: Callable[[Event], None],
                   profile: Profile) -> Closed | Adapted | None:
    """Wait until the devices have the memory vLLM will ask for, but only while it is being
    released.

    The wait (``host.wait_gpu_free``) ends as soon as the shortfall is steady: memory another
    process holds is not coming back by waiting. Then the engine starts now at the utilization that
    fits (vLLM's own start check would otherwise fail a minute into loading); the climb takes it
    back once the card frees. Only when even the ladder's floor does not fit is the start failed
    here, as startup_memory, with NVML's numbers as evidence; another process's memory is not the
    rung's fault either way.
    """
    gpu = cfg.gpu
    util = profile.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.0
    headroom = gpu.start_headroom_bytes
    t0 = host.monotonic()
    try:
        short = await host.wait_gpu_free(cfg.engine.devices(), util, headroom, gpu.free_wait_s)
    except GpuLost as exc:
        return TriggerKind.GPU_LOST, str(exc), Failure(FailureKind.DEVICE_FATAL, str(exc))
    if not short:
        return None
    s = min(short, key=lambda d: d.free / d.total)
    holders = ", ".join(f"pid {pid} ({used / GIB:.2f} GiB)"
                        for pid, used in s.processes) or "unknown"
    evidence = (
        f"GPU {s.index}: {s.free / GIB:.2f} of {s.total / GIB:.2f} GiB free after waiting "
        f"{host.monotonic() - t0:.1f}s (free_wait_s {gpu.free_wait_s:g}), below "
        "gpu_memory_utilization "
        f"{util:g} + {gpu.start_headroom_gib:g} GiB headroom; held by {holders}")
    devices = tuple(d.as_dict() for d in short)
    fits = fraction_that_fits(max(0, s.free - headroom), s.total)
    if cfg.ladder.gpu_memory_utilization_floor <= fits < util:
        publish(
            UtilizationAdapted(at=host.wall(), before=util, after=fits, devices=devices,
                               evidence=evidence))
        return Adapted(
            profile.with_(gpu_memory_utilization=fits),
            "another process holds GPU memory steadily: started at gpu_memory_utilization "
            f"{fits:g} "
            f"instead of {util:g} ({evidence})")
    publish(GpuShort(at=host.wall(), devices=devices, evidence=evidence))
    return TriggerKind.GPU_SHORT, evidence, Failure(
        FailureKind.STARTUP_MEMORY, evidence, knob=Knob.GPU_MEMORY_UTILIZATION, suggested=fits,
        rung_at_fault=False)


async def wait_released(cfg: Config, host: Host, publish: Callable[[Event], None],
                        pids: tuple[int, ...]) -> None:
    """After a stop: wait (``[gpu] release_timeout_s``) until the stopped processes' GPU memory
    is free again."""
    timeout = cfg.gpu.release_timeout_s
    try:
        held = await host.wait_gpu_released(pids, timeout)
    except GpuLost as exc:
        publish(GpuLostEvent(at=host.wall(), error=str(exc)))
        return
    if held:
        publish(
            GpuNotReleased(at=host.wall(), held={str(k): v for k, v in held.items()},
                           timeout_s=timeout))
