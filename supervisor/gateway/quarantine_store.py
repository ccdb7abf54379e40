"""``<state dir>/quarantine.json``: the gateway's quarantine, kept across restarts (mode 0600).

Read by the gateway at start and by `vllm-supervisor quarantine list|clear`; written by the gateway
at each change (and by `clear` when no supervisor runs). A hand-edited entry of the wrong shape is
dropped and named, never a reason for every request to fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from supervisor.decide.admission import Quarantine
from supervisor.gateway.gate import Flight
from supervisor.host.files import read_json, write_private

FILENAME = "quarantine.json"
# a body's prompt sketch (off the loop when it is big)
Sketcher = Callable[[bytes], Awaitable[tuple[int, ...]]]
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
class StoredQuarantine(Quarantine):
    """The gateway's live quarantine, with the file it is kept in."""

    path: Path = field(default_factory=Path)

    @classmethod
    def open(cls, path: Path, now: float) -> StoredQuarantine:
        """What the file holds (empty, with a warning, when it cannot be read); expired entries
        dropped."""
        try:
            q, dropped = load(path)
        except (OSError, ValueError) as exc:
            log.warning("gateway.quarantine_unreadable", path=str(path), error=str(exc))
            return cls(path=path)
        if dropped:
            log.warning(
                "gateway.quarantine_entries_dropped", path=str(path), keys=dropped, hint=
                "entries need a numeric 'until', an integer or null 'tokens' and a string 'reason'")
        kept = cls(q.entries, path=path)
        kept.prune(now)
        return kept

    async def refuses(self, flight: Flight, sketcher: Sketcher,
                      now: float) -> dict[str, Any] | None:
        """The entry that refuses ``flight``: its own key's, or, when a live entry has its shape,
        the one its prompt is a variant of (its sketch computed then, once). Not refused, its
        ``kin`` is set."""
        if flight.digest is None:
            return None
        entry = self.holds(flight.digest, now)
        if entry is None and self.has_shape(flight.shape, now):
            entry = self.holds(flight.digest, now, flight.shape, await sketched(flight, sketcher))
        if entry is None:
            flight.kin = self.kinship(flight.prompt, flight.shape, now)
        return entry

    def keep(self, digest: str, now: float, ttl_s: float, tokens: int | None, reason: str,
             kind: str, shape: str, sketch: tuple[int, ...], prompt: str = "") -> None:
        """Quarantine a request for ``ttl_s`` and save the file."""
        self.add(digest, now + ttl_s, tokens, reason, kind, shape, sketch, prompt)
        self.save(now)

    def undo(self, key: str | None, now: float) -> tuple[bool, str]:
        """On-call's undo: one entry, or every entry; whether it did, and what to tell them."""
        n = self.clear(key)
        if n is None:
            return False, (f"no quarantined request has the key {key!r} (see `vllm-supervisor "
                           "quarantine list`)")
        self.save(now)
        log.warning("gateway.quarantine_cleared", key=key or "all", entries=n)
        return True, (f"cleared {n} quarantined request(s); the prompt-length limit is recomputed "
                      "at once")

    def save(self, now: float) -> None:
        self.prune(now)
        try:
            save(self.path, self)
        except OSError as exc:
            log.error("gateway.quarantine_not_saved", path=str(self.path), error=str(exc))


async def sketched(flight: Flight, sketcher: Sketcher,
                   within_s: float | None = None) -> tuple[int, ...]:
    """``flight``'s prompt sketch, computed once, and only where a variant could matter; () when
    not made within ``within_s``."""
    if not flight.sketch and flight.body:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                flight.sketch = await sketcher(flight.body)
    return flight.sketch


def reason(kind: str, tokens: int | None, at_floor: bool, chunk: int | None) -> str:
    """Why a request was quarantined, as its 413 and the event say it (never its text)."""
    counted = f"{tokens} prompt tokens as counted by the engine's tokenizer" if tokens is not None \
        else "its prompt length was not counted"
    at = f"max_num_batched_tokens {chunk}" if chunk else "its settings then"
    floor = ", the last time alone at the lowest rung of this server's ladder" if at_floor else ""
    return (f"{kind} twice with this request named by vLLM or alone at the engine{floor} ({at}); "
            f"{counted}")
