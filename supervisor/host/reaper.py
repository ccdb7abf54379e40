"""Reaping what the engine leaves behind when the supervisor is PID 1 (a container's main process).

An orphan of the engine's session (its EngineCore, a worker, whatever they started) is re-parented
to PID 1, and there it stays a zombie unless PID 1 reaps it: a container whose main process never
reaps fills its PID table. The supervisor reaps only such orphans: zombie children that are members,
not leaders, of a session other than its own. Its own children (the engine's session leader,
standbys, command hooks, the parser pool, py-spy) are reaped by whatever started them (asyncio,
multiprocessing), which a blanket ``waitpid(-1)`` would break by stealing their exit statuses.
"""

from __future__ import annotations

import asyncio
import os

import psutil

REAP_S = 1.0


async def keep_reaping() -> None:
    """As PID 1: reap the engine's orphans every second (a container's PID table never fills with
    them)."""
    while True:
        reap_orphans()
        await asyncio.sleep(REAP_S)


def needed() -> bool:
    """Orphans come to us only as PID 1 (a PID namespace: a container, `unshare --pid`)."""
    return os.getpid() == 1


def reap_orphans() -> list[int]:
    """Reap the zombie orphans of other sessions among our children; the PIDs reaped."""
    me = os.getsid(0)
    reaped: list[int] = []
    try:
        children = psutil.Process().children()
    except (psutil.Error, OSError):  # EMFILE under load: try again at the next tick
        return reaped
    for p in children:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                continue
            sid = os.getsid(p.pid)
        except (psutil.Error, OSError):
            continue
        if sid in (me, p.pid):
            continue  # ours, or a session leader we spawned: its owner reaps it
        try:
            if os.waitpid(p.pid, os.WNOHANG)[0] == p.pid:
                reaped.append(p.pid)
        except ChildProcessError:
            pass
    return reaped
