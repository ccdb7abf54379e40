"""The OS seam: every effect the supervisor and an engine run have on the machine goes through Host.

Tests replace it with a recording fake (tests/unit/test_supervision_fakes.py); production uses
supervisor.host.real.RealHost.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from supervisor.host.gpu import Device, DeviceSnapshot
from supervisor.host.proctree import Birth, Child, StopReport


class Host(Protocol):
    def monotonic(self) -> float: ...
    def wall(self) -> float: ...
    async def sleep(self, seconds: float) -> None: ...

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str],
                    stdin: bool = False) -> Child:
        ...

    async def terminate_tree(self, child: Child, grace_s: float, kill_wait_s: float) -> StopReport:
        ...
    def tree_pids(self, child: Child) -> set[int]: ...
    def session_pids(self, sid: int) -> list[int]: ...
    def birth(self, pid: int) -> Birth: ...
    async def outside_clients(self, pids: Collection[int], port: int) -> int:
        """TCP connections of ``pids`` on ``port`` from anyone but this process (the gateway)."""
        ...
    def path_exists(self, path: str) -> bool: ...

    async def stop_leftover(self, sid: int, born: Birth, grace_s: float,
                            kill_wait_s: float) -> list[int]:
        ...

    async def gpu_snapshot(self, devices: Sequence[Device] | None = None) -> list[DeviceSnapshot]:
        ...

    async def wait_gpu_released(self, pids: Collection[int], timeout_s: float) -> dict[int, int]:
        ...
    async def wait_gpu_free(self, devices: Sequence[Device] | None, fraction: float, headroom: int,
                            timeout_s: float) -> list[DeviceSnapshot]:        ...

    async def dump_stacks(self, pids: Collection[int], timeout_s: float = 20.0) -> dict[int, str]:
        ...


__all__ = ["Birth", "Child", "Device", "DeviceSnapshot", "Host", "StopReport"]
