"""What must hold before a start spawns anything: the model is there, and the GPU has the memory.

Each gate waits a bounded time and returns None (go on) or the verdict that ends the start before
any process exists: a config error (the model never appeared), a device fault (NVML lost the GPU)
or a startup memory failure (too little free memory), with NVML's numbers as evidence.
"""

from __future__ import annotations

from collections.abc import Callable

from supervisor.config import Config, is_local_path
from supervisor.decide.classify import fraction_that_fits
from supervisor.engine_states import Failure, FailureKind, TriggerKind
from supervisor.event_stream import Event, GpuShort, ModelAppeared, ModelMissing
from supervisor.host import Host
from supervisor.host.gpu import GpuLost
from supervisor.profile import Knob, Profile

GIB = 2**30
Closed = tuple[TriggerKind, str, Failure]


async def model_gate(cfg: Config, host: Host, publish: Callable[[Event], None]) -> Closed | None:
    """A local model path missing at boot may be a late mount: wait for it, with backoff, for a bounded time."""
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


async def gpu_gate(cfg: Config, host: Host, publish: Callable[[Event], None], profile: Profile) -> Closed | None:
    """Wait (bounded) until the devices have the memory vLLM will ask for.

    Still short after ``free_wait_s``: vLLM's own start check would fail a minute into loading,
    so the start is failed here, with NVML's numbers as evidence. Another process's memory is
    not the rung's fault: the failure says so, and the utilization climbs back once it is free.
    """
    gpu = cfg.gpu
    util = profile.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.0
    headroom = gpu.start_headroom_bytes
    try:
        short = await host.wait_gpu_free(cfg.engine.devices(), util, headroom, gpu.free_wait_s)
    except GpuLost as exc:
        return TriggerKind.GPU_LOST, str(exc), Failure(FailureKind.DEVICE_FATAL, str(exc))
    if not short:
        return None
    s = min(short, key=lambda d: d.free / d.total)
    holders = ", ".join(f"pid {pid} ({used / GIB:.2f} GiB)" for pid, used in s.processes) or "unknown"
    evidence = (f"GPU {s.index}: {s.free / GIB:.2f} of {s.total / GIB:.2f} GiB free after waiting "
                f"{gpu.free_wait_s:g}s, below gpu_memory_utilization {util:g} + "
                f"{gpu.start_headroom_gib:g} GiB headroom; held by {holders}")
    publish(GpuShort(at=host.wall(), devices=tuple(d.as_dict() for d in short), evidence=evidence))
    return TriggerKind.GPU_SHORT, evidence, Failure(
        FailureKind.STARTUP_MEMORY, evidence, knob=Knob.GPU_MEMORY_UTILIZATION,
        suggested=fraction_that_fits(max(0, s.free - headroom), s.total), rung_at_fault=False)
