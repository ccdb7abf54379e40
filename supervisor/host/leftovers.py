"""A record of the running engine's session in the state directory, so that a supervisor that
died (SIGKILL, OOM killer, a crash) is followed by one that stops the old engine first: vLLM would
otherwise keep the port and the GPU memory, and every new start would fail. A precompile's throwaway
engine (``[recovery] precompile``) is recorded the same way under its own name: it is a whole vLLM
server too, and on a GPU it holds half of what was free."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import psutil
import structlog

from supervisor.host import Host
from supervisor.host.files import read_json, write_private
from supervisor.host.proctree import Birth, Child

log = structlog.get_logger("supervisor.state")
FILENAME = "engine.json"
PRECOMPILE = "precompile.json"
# recovery/spare.py: a throwaway kept asleep, apart from the precompile that may follow it
SPARE = "spare.json"
WHAT = {FILENAME: "engine", PRECOMPILE: "precompile", SPARE: "spare"}


def precompile_record(slot: int) -> str:
    """The record of the ``slot``-th throwaway compiling at once (a start's compile-first runs
    several)."""
    return PRECOMPILE if slot == 0 else f"precompile-{slot}.json"


def names(state_dir: str | Path) -> list[str]:
    """Every record a supervisor may have left: the engine's, the throwaways', the spare's."""
    extra = sorted(p.name for p in Path(state_dir).glob("precompile-*.json"))
    return [*WHAT, *extra]


@dataclass(frozen=True)
class EngineRecord:
    sid: int
    born: Birth  # the session leader's
    supervisor_pid: int


def write(state_dir: str | Path, rec: EngineRecord, name: str = FILENAME) -> None:
    """Record a session; a state directory that cannot be written costs only this record (a
    warning)."""
    d = Path(state_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        write_private(d / name, json.dumps({"sid": rec.sid, "boot_id": rec.born.boot_id,
                                            "since_boot_s": rec.born.since_boot_s,
                                            "supervisor_pid": rec.supervisor_pid}))
    except OSError as exc:
        log.warning("state.record_not_written", path=str(d / name), error=str(exc),
                    hint="a supervisor killed now would leave this engine for a person to stop")


def record(state_dir: str | Path, host: Host, child: Child, name: str = FILENAME) -> None:
    """Record ``child``'s session under ``name`` (the engine's, a throwaway's, a spare's); a
    leader already gone costs only this record (a warning)."""
    try:
        write(state_dir, EngineRecord(child.sid, host.birth(child.pid), os.getpid()), name)
    except psutil.Error as exc:
        log.warning("state.record_not_written", record=name, error=str(exc))


def read(state_dir: str | Path, name: str = FILENAME) -> EngineRecord | None:
    """The record, or None when absent or damaged in any way (a warning: nothing is signalled on
    its word)."""
    path = Path(state_dir) / name
    try:
        raw = read_json(path)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        if "since_boot_s" in raw:
            born = Birth(str(raw["boot_id"]), float(raw["since_boot_s"]))
        else:  # written by a supervisor before 2026-12: a wall-clock create time
            born = Birth("", float(raw["create_time"]) - psutil.boot_time())
        rec = EngineRecord(_int(raw["sid"]), born, _int(raw["supervisor_pid"]))
        if rec.sid <= 1 or rec.sid == os.getsid(0) or rec.supervisor_pid <= 0:
            raise ValueError(
                f"session {rec.sid} / supervisor {rec.supervisor_pid} cannot be an engine's")
        return rec
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, OverflowError) as exc:
        log.warning(
            "state.record_ignored", path=str(path), error=str(exc), hint=
            "nothing it names is stopped; check for a leftover vLLM by hand (ps -eo pid,sid,cmd)")
        return None


def _int(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{v!r} is not an integer")
    return v


def clear(state_dir: str | Path, name: str = FILENAME) -> None:
    try:
        (Path(state_dir) / name).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("state.record_not_cleared", path=str(Path(state_dir) / name), error=str(exc))
