"""``<state dir>/quarantine.json``: the gateway's quarantine, kept across restarts (mode 0600).

Read by the gateway at start and by `vllm-supervisor quarantine list|clear`; written by the gateway at
each change (and by `clear` when no supervisor runs). A hand-edited entry of the wrong shape is dropped
and named, never a reason for every request to fail.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from supervisor.decide.admission import Quarantine
from supervisor.host.files import read_json, write_private

FILENAME = "quarantine.json"
log = structlog.get_logger("supervisor.gateway")


def path_in(state_dir: str | Path) -> Path:
    return Path(state_dir) / FILENAME


def load(path: Path) -> tuple[Quarantine, list[str]]:
    """The quarantine in ``path`` (empty when absent) and the keys of entries dropped as malformed.

    Raises OSError or ValueError when the file cannot be read or is not JSON."""
    try:
        return Quarantine.load(read_json(path))
    except FileNotFoundError:
        return Quarantine(), []


def save(path: Path, q: Quarantine) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, json.dumps(q.as_dict(), indent=1))


@dataclass
class Kept(Quarantine):
    """The gateway's live quarantine, with the file it is kept in."""

    path: Path = field(default_factory=Path)

    @classmethod
    def open(cls, path: Path, now: float) -> Kept:
        """What the file holds (empty, with a warning, when it cannot be read); expired entries dropped."""
        try:
            q, dropped = load(path)
        except (OSError, ValueError) as exc:
            log.warning("gateway.quarantine_unreadable", path=str(path), error=str(exc))
            return cls(path=path)
        if dropped:
            log.warning("gateway.quarantine_entries_dropped", path=str(path), keys=dropped,
                        hint="entries need a numeric 'until', an integer or null 'tokens' and a string 'reason'")
        kept = cls(q.entries, path=path)
        kept.prune(now)
        return kept

    def save(self, now: float) -> None:
        self.prune(now)
        try:
            save(self.path, self)
        except OSError as exc:
            log.error("gateway.quarantine_not_saved", path=str(self.path), error=str(exc))
