"""The per-supervisor run directory (event sockets, logging configs, standby files), and its
leftovers.

It lives in systemd's ``RuntimeDirectory=`` when there is one (private, removed with the unit), else
in the temporary directory. Its name carries the supervisor's PID, so that the next supervisor can
remove the directories of supervisors that died without cleaning up (SIGKILL, the OOM killer): a
directory whose PID no longer runs, and that belongs to this user, is removed at start.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import structlog

log = structlog.get_logger("supervisor.state")
PREFIX = "vllm-supervisor-"
NAME = re.compile(rf"{PREFIX}(\d+)-\w+")
SOCKET_PATH_MAX = 107  # AF_UNIX's sun_path: 108 bytes, its NUL included
# The longest path inside a run directory: a second engine's events socket
# (recovery/throwaway.work_name).
LONGEST_INSIDE = len("/precompile-0123456789ab/events.sock")
# the largest PID Linux hands out, mkdtemp's 8 characters
MADE_NAME = len(f"{PREFIX}4194304-abcdefgh")


def parent() -> Path:
    """systemd's RuntimeDirectory= when there is one, else the temporary directory; a
    RuntimeDirectory too deep for the event sockets inside it is passed over (a warning), for
    an engine whose socket cannot be bound goes unheard."""
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime and fits(Path(runtime)):
        return Path(runtime)
    if runtime:
        log.warning(
            "state.runtime_directory_too_deep", path=runtime,
            max_bytes=SOCKET_PATH_MAX - MADE_NAME - LONGEST_INSIDE - 1, using=tempfile.gettempdir(),
            hint=
            "the engines' event sockets must fit AF_UNIX's 108 bytes: give RuntimeDirectory= a "
            "shorter "
            "name")
    return Path(tempfile.gettempdir())


def fits(where: Path) -> bool:
    return len(os.fsencode(where)) + 1 + MADE_NAME + LONGEST_INSIDE <= SOCKET_PATH_MAX


def make() -> Path:
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent()))


def sweep(where: Path | None = None) -> list[Path]:
    """Remove the run directories of supervisors that are gone; the ones removed."""
    removed: list[Path] = []
    try:
        entries = list((where or parent()).iterdir())
    except OSError:
        return removed
    for d in entries:
        m = NAME.fullmatch(d.name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            if d.stat().st_uid != os.getuid() or not d.is_dir():
                continue
            os.kill(int(m.group(1)), 0)
            continue  # that supervisor still runs
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        except OSError:
            continue
    return removed
