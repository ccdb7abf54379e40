"""One supervisor per state directory.

Two supervisors on one state directory (two ``@`` instances left at the default ``[state] dir``)
would each read the other's engine record as a dead supervisor's leftover, stop the other's serving
engine and take its control socket. So ``run`` takes an exclusive ``flock`` on the directory itself
before it reads or touches anything there, and holds it for its life: the kernel drops it when the
process ends, SIGKILL included, so there is no stale lock to clean up. A lock on the directory (not
a file in it) works on a read-only state directory too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

PID_FILE = "supervisor.pid"


class StateDirBusy(Exception):
    """Another live supervisor holds this state directory."""


def acquire(state_dir: str | Path) -> int | None:
    """Lock ``state_dir`` for this process (the returned descriptor must stay open); None when
    the directory cannot be made or opened (the supervisor reports that where it first writes
    there). Raises StateDirBusy."""
    path = Path(state_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _holder(path)
        raise StateDirBusy(
            f"another vllm-supervisor{holder} runs with the state directory {path}: each "
            "supervisor "
            "needs its own [state] dir (e.g. /var/lib/vllm-supervisor/<instance>); nothing was "
            "touched") from None
    with contextlib.suppress(OSError):
        (path / PID_FILE).write_text(f"{os.getpid()}\n")
    return fd


def _holder(path: Path) -> str:
    try:
        pid = int((path / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return ""
    return f" (pid {pid})"
