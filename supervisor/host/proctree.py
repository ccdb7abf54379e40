"""Spawning the engine in its own session and taking the whole process tree down.

Why so careful: vLLM's API server forks an EngineCore, which spawns GPU workers. When the
API server dies (or is SIGKILLed by someone else) those children are re-parented to init and
keep their GPU memory. Every process of the engine shares the session (and process group)
created at spawn, so the group signal and a session-id sweep find them even as orphans.
Stopping escalates in bounded, observable steps: SIGTERM, wait, SIGKILL, sweep, confirm.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import psutil
import structlog

log = structlog.get_logger("supervisor.host.proctree")

# Lines of vLLM's config dump run to several KB; the StreamReader default (64 KiB) is kept
# generous so one pathological line never kills the drain task.
STREAM_LIMIT = 4 * 1024 * 1024


BOOT_ID = "/proc/sys/kernel/random/boot_id"
# Two reads of one process's birth agree to the clock tick; a recycled PID cannot be born within a
# second of the process it replaces (that one was alive then), and a record of an older supervisor
# (a wall-clock create time, which moves with the clock) is off by at most about that.
BIRTH_SLACK_S = 1.0


@dataclass(frozen=True)
class Birth:
    """When a process was born, as seconds since this boot: unlike psutil's wall-clock create
    time (boot time read from /proc/stat each call, which moves with clock steps), two
    supervisors read the same value, so a record written by one identifies the session for the
    next."""

    boot_id: str
    since_boot_s: float


def boot_id() -> str:
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def since_boot_s(pid: int) -> float:
    """/proc/PID/stat's start time (field 22, clock ticks since boot); psutil offers it only as
    wall time."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[19]) / os.sysconf("SC_CLK_TCK")


def birth(pid: int) -> Birth:
    return Birth(boot_id(), since_boot_s(pid))


@dataclass
class Child:
    """One spawned engine: the API server process and the session it leads."""

    proc: asyncio.subprocess.Process
    argv: tuple[str, ...]
    known_pids: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def sid(self) -> int:
        return self.proc.pid  # start_new_session=True makes the child its session and group leader

    async def wait_exit(self) -> int:
        """The API server's exit status, as soon as it exits.

        Not ``proc.wait()``: asyncio resolves that only once every pipe is closed, and an orphaned
        EngineCore keeps our pipes open, so the death of the API server would go unnoticed.
        A pidfd becomes readable the moment the process terminates.
        """
        loop = asyncio.get_running_loop()
        if self.proc.returncode is None:
            try:
                fd = os.pidfd_open(self.pid)
            except (ProcessLookupError, OSError):
                fd = -1
            if fd >= 0:
                fut: asyncio.Future[None] = loop.create_future()
                def readable() -> None:
                    if not fut.done():
                        fut.set_result(None)

                loop.add_reader(fd, readable)
                try:
                    await fut
                finally:
                    loop.remove_reader(fd)
                    os.close(fd)
        # asyncio's child watcher reaps it and records the status a moment after termination.
        while self.proc.returncode is None:
            await asyncio.sleep(0.002)
        return self.proc.returncode


async def spawn(argv: Sequence[str], env: Mapping[str, str], stdin: bool = False) -> Child:
    """Start ``argv`` in a new session with piped output; stdin a pipe only when asked (a
    standby's order)."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=dict(env),
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        limit=STREAM_LIMIT,
    )
    child = Child(proc=proc, argv=tuple(argv))
    child.known_pids.add(proc.pid)
    return child


def session_members(sid: int) -> list[psutil.Process]:
    """Every live process whose session id is ``sid`` (orphans of a dead leader included).

    Out of file descriptors (EMFILE: a flood of client connections), /proc cannot be read: the scan
    comes back empty for this round rather than raising into the supervision loop."""
    out = []
    try:
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (OSError, psutil.Error):
                continue
    except (OSError, psutil.Error):
        return out
    return out


def held_by_outsiders(pids: Collection[int], ours: Collection[int]) -> bool:
    """Whether every one of ``pids`` is a live process that is none of the supervisor's: not its
    descendant, and not in a session it started (``ours``: its engines', whose orphans keep their
    killed leader's session). Such a holder of GPU memory is not letting go, and a start need not
    watch the card to learn so. No PIDs (NVML cannot see them: another PID namespace) is not
    known: False."""
    if not pids:
        return False
    me = os.getpid()
    try:
        for pid in pids:
            p = psutil.Process(pid)
            if (p.status() == psutil.STATUS_ZOMBIE or pid == me or os.getsid(pid) in ours
                    or me in (a.pid for a in p.parents())):
                return False
    except (OSError, psutil.Error):
        return False
    return True


def remember_descendants(child: Child) -> set[int]:
    """Record the tree's current PIDs (for NVML matching and stack dumps); returns them."""
    with contextlib.suppress(psutil.Error, OSError):
        for p in session_members(child.sid):
            child.known_pids.add(p.pid)
    return set(child.known_pids)


def _ours(pgid: int) -> bool:
    """Group (or session) 0 is the caller's own, 1 is init's: neither is ever an engine's."""
    return pgid <= 1 or pgid in (os.getpgrp(), os.getsid(0))


def _signal_group(pgid: int, sig: signal.Signals) -> bool:
    if _ours(pgid):
        log.error("engine.signal_refused", pgid=pgid, signal=sig.name,
                  hint="never the supervisor's own or init's")
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - only when a member changed uid
        log.warning("engine.signal_refused", pgid=pgid, signal=sig.name)
        return False


def _alive(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


async def _wait_gone(procs: list[psutil.Process], timeout: float,
                     poll: float = 0.02) -> list[psutil.Process]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    alive = _alive(procs)
    while alive and loop.time() < deadline:
        await asyncio.sleep(poll)
        alive = _alive(alive)
    return alive


@dataclass(frozen=True)
class StopReport:
    """What stopping the tree took: PIDs seen, which needed SIGKILL, and any survivor."""

    pids: tuple[int, ...]
    killed: tuple[int, ...]
    survivors: tuple[int, ...]
    returncode: int | None


async def stop_session(sid: int, grace_s: float, kill_wait_s: float, born: Birth | None = None,
                       kin: Sequence[psutil.Process] = (),
                       ) -> tuple[list[int], list[int], list[int]]:
    """SIGTERM every process of session ``sid``, wait ``grace_s``, SIGKILL the rest, sweep again.

    Returns (pids seen, pids that needed SIGKILL, survivors). ``born`` (the session leader's birth,
    when the session is known only from a record) keeps a recycled session id from taking down
    processes that are not ours: after a reboot nothing of it is left; a live leader born at another
    time leads another session; no member can be older than its leader. ``kin``: the leader's
    descendants as it is stopped, stopped with it even where one left its session (on the H100 a
    woken spare's EngineCore outlived its session's SIGKILL by 4.2 s, tearing down by itself while
    the restart waited for its GPU memory).
    """
    if _ours(sid):
        log.error("engine.stop_refused", sid=sid,
                  hint="session 0, 1 or the supervisor's own is never an engine's")
        return [], [], []
    this_boot = boot_id()
    if born is not None and born.boot_id and this_boot and born.boot_id != this_boot:
        return [], [], []

    def members() -> list[psutil.Process]:
        out = []
        for p in session_members(sid):
            with contextlib.suppress(OSError, ValueError):
                if born is None or since_boot_s(p.pid) >= born.since_boot_s - BIRTH_SLACK_S:
                    out.append(p)
        return out + [p for p in _alive(kin) if p not in out]

    if born is not None and _recycled(sid, born):
        return [], [], []
    first = members()
    seen = {p.pid for p in first}
    killed: list[int] = []
    if first:
        _signal_group(sid, signal.SIGTERM)
        for p in first:
            # The group's SIGTERM may already have taken it (CI, 2026-12-05: getpgid raised ESRCH).
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(p.pid) != sid:
                    p.terminate()
        left = await _wait_gone(first, grace_s)
        # Processes started after the snapshot (a worker mid-spawn) are caught by the sweep.
        left = _alive(left + [p for p in members() if p not in left])
        seen |= {p.pid for p in left}
        if left:
            killed = [p.pid for p in left]
            # With no grace asked for (a dead engine's settled verdict), SIGKILL is the plan, not an
            # escalation.
            (log.warning if grace_s > 0 else log.info)("engine.stop_escalated", signal="SIGKILL",
                                                       pids=killed, grace_s=grace_s)
            _signal_group(sid, signal.SIGKILL)
            for p in left:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            await _wait_gone(left, kill_wait_s)
    survivors = [p.pid for p in members()]
    if survivors:
        log.error("engine.survivors", pids=survivors, hint="processes ignored SIGKILL (D state?)")
    return sorted(seen), killed, survivors


def _recycled(sid: int, born: Birth) -> bool:
    try:
        leader = since_boot_s(sid)
    except (OSError, ValueError):
        return False  # the leader is gone; its orphans may not be
    return abs(leader - born.since_boot_s) > BIRTH_SLACK_S


async def terminate_tree(child: Child, grace_s: float, kill_wait_s: float) -> StopReport:
    """Stop the engine's whole session (see stop_session) and reap the API server."""
    kin: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        kin = psutil.Process(child.pid).children(recursive=True)
    seen, killed, survivors = await stop_session(child.sid, grace_s, kill_wait_s, kin=kin)
    child.known_pids.update(seen)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(child.wait_exit(), timeout=max(kill_wait_s, 1.0))
    return StopReport(tuple(sorted(child.known_pids)), tuple(killed), tuple(survivors),
                      child.proc.returncode)
