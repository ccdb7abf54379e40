"""Memory pressure on the serving engine, read every ``pressure_poll_s`` while it is READY.

NVML says what is free on the card and how much memory other processes hold; vLLM's /metrics
says how full its KV cache is and how many requests wait. The rules that turn these into a
reason to shed are pure (supervisor.decide.admission.pressure).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import structlog

from supervisor.bounds import MIB
from supervisor.config import GatewayConfig
from supervisor.decide import admission
from supervisor.host import Device, Host
from supervisor.host.gpu import GpuLost
from supervisor.host.vllm_http import EngineClient, EngineError

log = structlog.get_logger("supervisor.gateway")


class PressureWatch:
    def __init__(self, cfg: GatewayConfig, host: Host, client: EngineClient,
                 devices: Sequence[Device] | None, ours: Callable[[], set[int]],
                 serving: Callable[[], bool], busy: Callable[[], bool],
                 on_change: Callable[[admission.Pressure | None], None]) -> None:
        self.configure(cfg)
        self.host, self.client, self.devices = host, client, devices
        self.ours, self.serving, self.busy, self.on_change = ours, serving, busy, on_change
        self.now: admission.Pressure | None = None
        self._foreign: list[int] = []

    def configure(self, cfg: GatewayConfig) -> None:
        self.rules = admission.PressureRules(int(cfg.min_free_mib * MIB),
                                             int(cfg.foreign_growth_mib * MIB),
                                             cfg.kv_cache_high, cfg.kv_waiting)
        self.poll_s = cfg.pressure_poll_s

    async def run(self) -> None:
        while True:
            await self.host.sleep(self.poll_s)
            if not self.serving():
                self._foreign = []
                self._set(None)
                continue
            self._set(await self.check())

    async def check(self) -> admission.Pressure | None:
        try:
            snaps = await self.host.gpu_snapshot(self.devices)  # [] without NVML, or while it fails
        except GpuLost:
            snaps = []  # the supervisor's own checks act on it
        ours = self.ours()
        free = [s.free for s in snaps]
        foreign = [sum(b for pid, b in s.processes if pid not in ours) for s in snaps]
        before, self._foreign = self._foreign or foreign, foreign
        kv = waiting = 0.0
        if self.busy():  # an idle engine has an empty queue: spare it the /metrics render
            try:
                progress = await self.client.metrics(timeout=2.0)
                kv, waiting = progress.kv_usage, progress.waiting
            except EngineError:
                pass
        return admission.pressure(self.rules, free=free, foreign=foreign, foreign_before=before,
                                  kv_usage=kv, waiting=waiting)

    def _set(self, p: admission.Pressure | None) -> None:
        if p != self.now:
            self.now = p
            self.on_change(p)


async def stop(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
