"""What a planned start's build-first is doing (a step, n of m, the time left), what is built
beside the serving engine (a rung's compile, a spare), and how long the last builds took on this
host (``<state dir>/builds.json``), from which the time left is told."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from supervisor.event_stream import BuildingBeside, BuildingFirst, Event
from supervisor.host import Host, files
from supervisor.profile import Profile

log = structlog.get_logger("supervisor.recovery.progress")
RECORD = "builds.json"
# "rungs": a build-first's compiles side by side; "spare": a spare to asleep; "rung": one rung
# compiled beside the serving engine
STEPS = ("rungs", "spare", "rung")


class BuildTimes:
    """The seconds the last build of each step took here: a rung's compile side by side, a spare
    to asleep."""

    def __init__(self, state_dir: str) -> None:
        self.path = Path(state_dir) / RECORD
        self.took_s: dict[str, float] = self._load()

    def _load(self) -> dict[str, float]:
        try:
            doc = files.read_json(self.path)
        except (OSError, ValueError):
            return {}
        if not isinstance(doc, dict):
            return {}
        return {
            k: float(v) for k, v in doc.items()
            if k in STEPS and isinstance(v, int | float) and v > 0
        }

    def note(self, step: str, took_s: float | None) -> None:
        if took_s is None or took_s <= 0:
            return
        self.took_s[step] = round(took_s, 1)
        try:
            files.write_private(self.path, json.dumps(self.took_s))
        except OSError as exc:
            log.warning("state.builds_record_failed", error=str(exc))


@dataclass
class Progress:
    """One step of a build-first: ``done`` of ``of``, ``at_once`` side by side, each taking
    ``each_s`` (the last build's; None before any), the last step's end at ``step_at``
    (monotonic)."""

    step: str
    done: int
    of: int
    at_once: int
    each_s: float | None
    step_at: float

    def left_s(self, now: float) -> float | None:
        """The batches left times what one took, less what the running one has done already."""
        if self.each_s is None:
            return None
        batches = math.ceil((self.of - self.done) / max(1, self.at_once))
        return round(max(0.0, batches * self.each_s - (now - self.step_at) if batches else 0.0), 1)

    def as_dict(self, now: float) -> dict[str, Any]:
        return {"step": self.step, "done": self.done, "of": self.of, "left_s": self.left_s(now),
                "each_s": self.each_s}


@dataclass(frozen=True)
class Beside:
    """A second engine being built beside the serving engine since ``since`` (monotonic): a
    rung's compile (``what`` "rung"), ``done`` of the ``of`` rungs within reach compiled before
    it, or a spare; ``each_s`` the last such build's on this host (None before any)."""

    what: str
    profile: Profile
    since: float
    done: int
    of: int
    each_s: float | None

    def left_s(self, now: float) -> float | None:
        if self.each_s is None:
            return None
        return round(max(0.0, self.each_s - (now - self.since)), 1)

    def as_dict(self, now: float) -> dict[str, Any]:
        return {"what": self.what, "profile": self.profile.knobs(),
                "for_s": round(now - self.since, 1), "done": self.done, "of": self.of,
                "left_s": self.left_s(now), "each_s": self.each_s}

    def event(self, at: float) -> BuildingBeside:
        return BuildingBeside(at=at, what=self.what, profile=self.profile, done=self.done,
                              of=self.of, left_s=self.each_s)


class FirstBuilds:
    """A planned start's build-first as it goes: each step kept for /status and published (the
    journal's line, systemd's STATUS=), its time left told from the last build's on this host."""

    def __init__(self, state_dir: str, host: Host, publish: Callable[[Event], None]) -> None:
        self.times, self.host, self.publish = BuildTimes(state_dir), host, publish
        self.now: Progress | None = None

    def step(self, step: str, done: int, of: int, at_once: int = 1) -> None:
        t = self.host.monotonic()
        self.now = Progress(step, done, of, at_once, self.times.took_s.get(step), t)
        self.publish(
            BuildingFirst(at=self.host.wall(), step=step, done=done, of=of,
                          left_s=self.now.left_s(t)))

    def over(self) -> None:
        self.now = None

    def status(self) -> dict[str, Any] | None:
        return self.now.as_dict(self.host.monotonic()) if self.now else None


def spare_due(asleep: bool, last_s: float | None, building_for_s: float | None, built_first: bool,
              mode: str, asked_in_s: float | None, why: str) -> dict[str, Any]:
    """When the next spare will be ready, as far as the supervisor can tell (``in_s`` None: it
    cannot), for /status: from whether one sleeps, how long one has been built for, how long
    the last took, and why none is built."""
    if asleep:
        return {"in_s": 0.0, "when": "now: one is asleep"}
    if building_for_s is not None:
        return {
            "in_s": round(max(0.0, last_s - building_for_s), 1) if last_s else None,
            "when": f"being built for {building_for_s:.0f}s" +
            (f"; the last took {last_s:.0f}s" if last_s else "")
        }
    if built_first:
        return {
            "in_s": None,
            "when": "at the next planned start (a climb, a reload, restart): none fits beside "
            "the engine, so it is built before the engine"
        }
    if mode == "off":
        return {"in_s": None, "when": 'never: [recovery] spare = "off"'}
    if asked_in_s is not None and asked_in_s > 0:
        return {"in_s": round(asked_in_s + (last_s or 0.0), 1) if last_s else None,
                "when": f"asked in {asked_in_s:.0f}s (precompile_idle_s), then built"}
    return {"in_s": None, "when": why}
