"""On a lent GPU: how long each NVML read the supervisor makes takes, while another process holds 40 GB of the card
(the spare's fit check before its wake, the GPU gates, the release wait all read it). Run 10 (an H100): a whole
`Nvml.snapshot` 0.07 ms, 0.12 ms through `asyncio.to_thread`: not where a failover's time goes.

Usage: `python3 bench/gpu_nvml.py` from the repository root (nvidia-ml-py, structlog and torch importable).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
HOLD = ("import torch, time; x = torch.empty(int(40e9), dtype=torch.uint8, device='cuda'); print('held', flush=True); "
        "time.sleep(120)")


def timed(name: str, fn: Callable[[], Any], n: int = 50) -> None:
    fn()
    took = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        took.append(1e3 * (time.perf_counter() - t))
    took.sort()
    print(f"{name}: median {took[n // 2]:.2f} ms, max {took[-1]:.2f} ms")


async def through_a_thread(snapshot: Callable[[], Any], n: int = 20) -> None:
    took = []
    for _ in range(n):
        t = time.perf_counter()
        await asyncio.to_thread(snapshot)
        took.append(1e3 * (time.perf_counter() - t))
    took.sort()
    print(f"asyncio.to_thread(Nvml.snapshot): median {took[n // 2]:.2f} ms, max {took[-1]:.2f} ms")


def main() -> None:
    import pynvml as nv
    from supervisor.host.gpu import Nvml

    hold = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout is not None
        print(hold.stdout.readline().strip())
        t = time.perf_counter()
        nv.nvmlInit()
        print(f"nvmlInit {1e3 * (time.perf_counter() - t):.1f} ms")
        h = nv.nvmlDeviceGetHandleByIndex(0)
        timed("nvmlDeviceGetCount", nv.nvmlDeviceGetCount)
        timed("nvmlDeviceGetHandleByIndex", lambda: nv.nvmlDeviceGetHandleByIndex(0))
        timed("nvmlDeviceGetMemoryInfo", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        timed("nvmlDeviceGetComputeRunningProcesses", lambda: nv.nvmlDeviceGetComputeRunningProcesses(h))
        timed("nvmlDeviceGetGraphicsRunningProcesses", lambda: nv.nvmlDeviceGetGraphicsRunningProcesses(h))
        gpu = Nvml()
        timed("supervisor Nvml.snapshot", gpu.snapshot)
        asyncio.run(through_a_thread(gpu.snapshot))
    finally:
        hold.kill()
        hold.wait()


if __name__ == "__main__":
    main()
