"""A GPU for CI: a stand-in for nvidia-ml-py's ``pynvml`` whose memory the stand-in engines drive (tests only).

Put this directory first on the supervisor's PYTHONPATH and set FAKE_NVML_DIR: the supervisor's ``import pynvml``
then finds this module. The card is ``$FAKE_NVML_DIR/card.json`` ({"total_mib": N, "count": 1}); every process
that holds memory on it writes ``$FAKE_NVML_DIR/procs/<pid>`` (its MiB, a number). The stand-in engine
(tests/helpers/fake_vllm.py) writes its EngineCore's share when it starts (``--gpu-memory-utilization`` x total,
as vLLM takes), shrinks it to its sleeping footprint on /sleep and takes it back on /wake_up; a test writes one for
another process (a "foreign" holder: the field report's shared card). A file whose pid is gone counts for nothing,
as the driver frees a dead process's memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

MIB = 2**20


class NVMLError(Exception):
    def __init__(self, value: int = 999) -> None:
        super().__init__(f"fake NVML error {value}")
        self.value = value


def _dir() -> Path:
    d = os.environ.get("FAKE_NVML_DIR")
    if not d:
        raise NVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED
    return Path(d)


def _card() -> dict[str, int]:
    doc = json.loads((_dir() / "card.json").read_text())
    return {"total_mib": int(doc["total_mib"]), "count": int(doc.get("count", 1))}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie holds no memory either
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def holders() -> dict[int, int]:
    """pid -> bytes, for every living process that says it holds memory."""
    out = {}
    procs = _dir() / "procs"
    for f in procs.glob("*") if procs.is_dir() else []:
        try:
            pid, mib = int(f.name), float(f.read_text() or 0)
        except (ValueError, OSError):
            continue
        if _alive(pid):
            out[pid] = int(mib * MIB)
    return out


def set_held(pid: int, nbytes: int) -> None:
    """What a process of the stand-in calls to say how much it holds now."""
    procs = _dir() / "procs"
    procs.mkdir(parents=True, exist_ok=True)
    tmp = procs / f".{pid}.tmp"
    tmp.write_text(str(nbytes / MIB))
    tmp.replace(procs / str(pid))


def free_bytes() -> int:
    return _card()["total_mib"] * MIB - sum(holders().values())


@dataclass
class _Memory:
    total: int
    free: int
    used: int


@dataclass
class _Process:
    pid: int
    usedGpuMemory: int


def nvmlInit() -> None:
    _card()


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return _card()["count"]


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    return index


def nvmlDeviceGetHandleByUUID(uuid: str) -> int:
    return int(str(uuid).rsplit("-", 1)[-1]) if str(uuid).startswith("GPU-fake-") else 0


def nvmlDeviceGetIndex(handle: int) -> int:
    return handle


def nvmlDeviceGetMemoryInfo(handle: int) -> _Memory:
    total = _card()["total_mib"] * MIB
    used = sum(holders().values()) if handle == 0 else 0
    return _Memory(total, max(0, total - used), used)


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[_Process]:
    return [_Process(pid, b) for pid, b in holders().items()] if handle == 0 else []


def nvmlDeviceGetGraphicsRunningProcesses(handle: int) -> list[_Process]:
    return []


def nvmlSystemGetDriverVersion() -> str:
    return "fake-0.0"
