"""The real operating system behind the Host seam: clock, spawn, kill, sweep, NVML, stack dumps."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from supervisor.host import gpu, peers, proctree
from supervisor.host.gpu import Device, DeviceSnapshot, Nvml
from supervisor.host.proctree import Birth, Child, StopReport


def py_spy() -> str | None:
    """py-spy on PATH, or installed beside the supervisor's interpreter (same virtualenv)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


class RealHost:
    """The real operating system, with NVML when the host has an NVIDIA driver."""

    def __init__(self, nvml: Nvml | None = None) -> None:
        self.nvml = nvml if nvml is not None else Nvml()
        self.sessions: set[int] = set()  # every engine session this run started or swept: its own

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str],
                    stdin: bool = False) -> Child:
        child = await proctree.spawn(argv, env, stdin)
        self.sessions.add(child.sid)
        return child

    async def terminate_tree(self, child: Child, grace_s: float, kill_wait_s: float) -> StopReport:
        return await proctree.terminate_tree(child, grace_s, kill_wait_s)

    def birth(self, pid: int) -> Birth:
        return proctree.birth(pid)

    async def stop_leftover(self, sid: int, born: Birth, grace_s: float,
                            kill_wait_s: float) -> list[int]:
        self.sessions.add(sid)
        seen, _, _ = await proctree.stop_session(sid, grace_s, kill_wait_s, born=born)
        return seen

    def session_pids(self, sid: int) -> list[int]:
        """The live members of session ``sid`` (an engine's whole tree: its API server,
        EngineCore, workers)."""
        return sorted(p.pid for p in proctree.session_members(sid))

    def tree_pids(self, child: Child) -> set[int]:
        return proctree.remember_descendants(child)

    async def outside_clients(self, pids: Collection[int], port: int) -> int:
        return await asyncio.to_thread(peers.outside_clients, pids, port)

    def path_exists(self, path: str) -> bool:
        return os.path.exists(os.path.expanduser(path))

    async def gpu_snapshot(self, devices: Sequence[Device] | None = None) -> list[DeviceSnapshot]:
        return await asyncio.to_thread(self.nvml.snapshot, devices)

    async def wait_gpu_released(self, pids: Collection[int], timeout_s: float) -> dict[int, int]:
        return await gpu.wait_released(self.nvml, pids, timeout_s)

    async def wait_gpu_free(self, devices: Sequence[Device] | None, fraction: float, headroom: int,
                            timeout_s: float) -> list[DeviceSnapshot]:
        def outsiders(pids: Collection[int]) -> bool:
            return proctree.held_by_outsiders(pids, self.sessions)

        return await gpu.wait_free(self.nvml, devices, fraction, headroom, timeout_s,
                                   outsiders=outsiders)

    async def dump_stacks(self, pids: Collection[int], timeout_s: float = 20.0) -> dict[int, str]:
        """py-spy stacks of each PID when py-spy is installed; {} otherwise."""
        exe = py_spy()
        if not exe:
            return {}
        out: dict[int, str] = {}
        for pid in sorted(pids):
            # --nonblocking: a hung (even SIGSTOPped) process cannot be paused by ptrace, only read.
            proc = await asyncio.create_subprocess_exec(
                exe, "dump", "--nonblocking", "--pid", str(pid),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            try:
                data, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
                out[pid] = data.decode(errors="replace")
            except TimeoutError:
                proc.kill()
                await proc.wait()
                out[pid] = "py-spy timed out"
        return out
