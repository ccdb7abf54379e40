"""The per-supervisor run directory (event sockets, logging configs, standby files), and its leftovers.

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

PREFIX = "vllm-supervisor-"
NAME = re.compile(rf"{PREFIX}(\d+)-\w+")


def parent() -> Path:
    return Path(os.environ.get("RUNTIME_DIRECTORY") or tempfile.gettempdir())


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
