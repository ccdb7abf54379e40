"""A record of the running engine's session in the state directory, so that a supervisor that
died (SIGKILL, OOM killer, a crash) is followed by one that stops the old engine first: vLLM would
otherwise keep the port and the GPU memory, and every new start would fail."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from supervisor.host.files import write_private

FILENAME = "engine.json"


@dataclass(frozen=True)
class EngineRecord:
    sid: int
    create_time: float
    supervisor_pid: int


def write(state_dir: str | Path, rec: EngineRecord) -> None:
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    write_private(d / FILENAME, json.dumps(rec.__dict__))


def read(state_dir: str | Path) -> EngineRecord | None:
    try:
        raw = json.loads((Path(state_dir) / FILENAME).read_text())
        return EngineRecord(int(raw["sid"]), float(raw["create_time"]), int(raw["supervisor_pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear(state_dir: str | Path) -> None:
    (Path(state_dir) / FILENAME).unlink(missing_ok=True)
