"""``<state dir>/quarantine.json``: the gateway's quarantine, kept across restarts (mode 0600).

Read by the gateway at start and by `vllm-supervisor quarantine list|clear`; written by the gateway at
each change (and by `clear` when no supervisor runs). A hand-edited entry of the wrong shape is dropped
and named, never a reason for every request to fail.
"""

from __future__ import annotations

import json
from pathlib import Path

from supervisor.decide.admission import Quarantine
from supervisor.host.files import write_private

FILENAME = "quarantine.json"


def path_in(state_dir: str | Path) -> Path:
    return Path(state_dir) / FILENAME


def load(path: Path) -> tuple[Quarantine, list[str]]:
    """The quarantine in ``path`` (empty when absent) and the keys of entries dropped as malformed.

    Raises OSError or ValueError when the file cannot be read or is not JSON."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Quarantine(), []
    try:
        return Quarantine.load(json.loads(text))
    except RecursionError:
        raise ValueError("nested too deeply") from None


def save(path: Path, q: Quarantine) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, json.dumps(q.as_dict(), indent=1))
