"""What the supervisor learned, persisted atomically in the state directory.

A corrupt or foreign file is reported and ignored, never fatal: starting from the configured
profile is always safe, merely less informed.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from supervisor.event_stream import Event, LearnedChanged, Reloaded
from supervisor.host.files import read_json
from supervisor.profile import Profile

log = structlog.get_logger("supervisor.ops.statefile")
VERSION = 1
FILENAME = "state.json"


@dataclass
class Learned:
    profile: Profile
    rung_failures: dict[str, int] = field(default_factory=dict)
    last_failure: dict[str, Any] | None = None
    restarts_total: int = 0
    slowest_start_s: float | None = None
    fatal: dict[str, Any] | None = None  # the supervisor gave up: exit_code, reason, at, kind
    # what the operator had configured when it was learned (None: an older file)
    configured: Profile | None = None

    def remembered(self) -> dict[str, Any]:
        """What the lifecycle remembers of it (its Remembered's fields)."""
        return {
            "restarts_total": self.restarts_total, "slowest_start_s": self.slowest_start_s,
            "fatal": self.fatal, "last_failure": self.last_failure
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION, "profile": self.profile.as_dict(),
            "rung_failures": self.rung_failures, "last_failure": self.last_failure,
            "restarts_total": self.restarts_total, "slowest_start_s": self.slowest_start_s,
            "fatal": self.fatal,
            "configured": self.configured.as_dict() if self.configured is not None else None
        }


def path_in(state_dir: str | Path) -> Path:
    return Path(state_dir) / FILENAME


def load(state_dir: str | Path) -> Learned | None:
    """The saved state, or None when absent or unreadable (reported as an event)."""
    p = path_in(state_dir)
    try:
        raw = read_json(p)
        if not isinstance(raw, dict) or raw.get("version") != VERSION:
            raise ValueError(
                "unsupported state version "
                f"{raw.get('version') if isinstance(raw, dict) else raw!r}"
            )
        failures = raw.get("rung_failures") or {}
        if not isinstance(failures, dict) or not all(isinstance(v, int) for v in failures.values()):
            raise ValueError("rung_failures must map profile keys to integers")
        last = raw.get("last_failure")
        return Learned(
            profile=Profile.from_dict(raw["profile"]), rung_failures=dict(failures),
            last_failure=last if isinstance(last, dict) else None,
            restarts_total=int(raw.get("restarts_total")
                               or 0), slowest_start_s=_seconds(raw.get("slowest_start_s")),
            fatal=raw["fatal"] if isinstance(raw.get("fatal"), dict) else None,
            configured=Profile.from_dict(raw["configured"]) if isinstance(
                raw.get("configured"), dict) else None)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError, OSError, AttributeError, OverflowError) as exc:
        log.warning(
            "state.corrupt_ignored", path=str(p), error=str(exc),
            hint="starting from the configured profile; the file is overwritten at the next change")
        return None


def _seconds(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def save(state_dir: str | Path, learned: Learned) -> None:
    """Write atomically: temp file in the same directory, fsync, rename, fsync the directory."""
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".state-", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(learned.to_json(), f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path_in(d))
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class StateFileWriter:
    """Event-stream subscriber: persists what the supervisor learned whenever it changes."""

    def __init__(self, state_dir: str | Path, configured: Profile) -> None:
        self.state_dir, self.configured = state_dir, configured

    def on_event(self, event: Event) -> None:
        if isinstance(event, Reloaded) and event.configured_profile is not None:
            self.configured = event.configured_profile
        if not isinstance(event, LearnedChanged):
            return
        try:
            save(
                self.state_dir,
                Learned(event.profile, dict(event.rung_failures),
                        dict(event.last_failure) if event.last_failure else None,
                        event.restarts_total, event.slowest_start_s,
                        dict(event.fatal) if event.fatal else None, self.configured))
        except OSError as exc:
            log.error("state.save_failed", dir=str(self.state_dir), error=str(exc))
