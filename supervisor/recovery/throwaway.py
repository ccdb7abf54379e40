"""One launcher for every second engine: a precompile's throwaway and a spare are each a whole vLLM
server started beside the serving engine, on a free loopback port, with a run directory, an events
socket and a leftovers record of their own.

``launch(rung, weights, sleep_mode, niced)`` spawns one (a cancelled launch stops what it had
started: a process nobody holds would keep its share of the GPU) and returns a ``Throwaway``, which
waits for its ``/health`` (``until_healthy``) and is stopped with everything it started (``stop``),
or is handed to whoever keeps it (``hand_over``: a spare becoming the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import structlog

from supervisor.aio import cancel_and_wait
from supervisor.bounds import THROWAWAY_STOP_S
from supervisor.config import Config, EngineConfig, masked, redact
from supervisor.decide.classify import says_port_taken, spoils_compile_cache
from supervisor.engine import ipc, launch
from supervisor.engine.logtail import LogTail
from supervisor.engine.observer import env_report
from supervisor.event_stream import Event, PrecompileStarted
from supervisor.host import Host, compile_cache, leftovers
from supervisor.host.proctree import Child
from supervisor.host.vllm_http import EngineClient
from supervisor.profile import Profile
from supervisor.recovery.sleep_env import sleep_mode_env
from supervisor.recovery.standby import Standby

log = structlog.get_logger("supervisor.recovery.throwaway")

Weights = Literal["dummy", "real"]
# Not part of vLLM's compile hash: what lets a precompile be cheap and fit beside the engine.
DUMMY_WEIGHTS_ARGS = {"load_format": "dummy"}
HEALTH_POLL_S = 0.5
TAIL_LINES = 40


def free_port(given: set[int] | frozenset[int] = frozenset()) -> int:
    """A port the kernel has free now, none of ``given`` (the second engines' being started: a
    port released here may be handed out again, and two started side by side then collide)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in given:
            return port


@dataclass(eq=False)  # one process each: equal only to itself, and kept in sets
class Throwaway:
    """A second engine of ours, started at ``profile`` (the utilization it was given)."""

    child: Child
    profile: Profile
    url: str
    work: Path  # its hook, logging config and events socket: removed when it stops
    tail: LogTail
    drains: list[asyncio.Task[None]]
    client: EngineClient
    host: Host
    state_dir: str  # where its leftovers record is
    argv: tuple[str, ...] = ()  # secrets masked
    version: str | None = None  # the vLLM that runs it (the serving engine's: the same install)
    record: str = leftovers.PRECOMPILE  # its leftovers record's name
    # its events socket, heard until /health: what vLLM set for its EngineCore
    ear: ipc.EventServer | None = None
    # the compile cache directory it said it uses
    cache_used: list[str] = field(default_factory=list)
    # the [engine] it was started from (a reload may replace it: recovery/spare.py ``outdated``)
    engine: EngineConfig | None = None
    standby: bool = False  # a standby of its own became it (vLLM imported ahead)
    # it said its compile cache cannot run (decide/spoiled_cache.py)
    spoiled: list[bool] = field(default_factory=list)
    # it said a port it was to bind was in use (decide/spoiled_cache.py)
    port_taken: list[bool] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.child.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.child.proc.returncode is None

    def pids(self) -> set[int]:
        return set(self.child.known_pids)

    def last_lines(self, n: int = 5) -> list[str]:
        return self.tail.snapshot()[-n:]

    async def until_healthy(self, timeout_s: float) -> str | None:
        """None once it answers /health 200, else why not (it exited, or the time ran out)."""
        deadline = self.host.monotonic() + timeout_s
        while self.host.monotonic() < deadline:
            # its EngineCore holds GPU memory: ours, not a foreign process's
            self.host.tree_pids(self.child)
            if self.child.proc.returncode is not None:
                return f"exited with status {self.child.proc.returncode}"
            if await self.client.health(timeout=2.0) == 200:
                return None
            await self.host.sleep(HEALTH_POLL_S)
        return f"no /health 200 within {timeout_s:g}s"

    def deaf(self) -> None:
        """Stop hearing its events socket (idempotent): an engine that adopts it binds that path
        anew."""
        if self.ear is not None:
            self.ear.close()
            self.ear = None

    async def hand_over(self) -> Child:
        """Stop reading its pipes and its client: whoever adopts it reads them from here on."""
        await cancel_and_wait(*self.drains)
        await self.client.close()
        return self.child

    def record_as(self, name: str) -> None:
        """Its leftovers record under ``name`` (the one it had goes): a supervisor SIGKILLed
        meanwhile is followed by one that stops it."""
        leftovers.record(self.state_dir, self.host, self.child, name)
        if name != self.record:
            leftovers.clear(self.state_dir, self.record)
            self.record = name

    async def stop(self, grace_s: float = THROWAWAY_STOP_S,
                   kill_s: float = THROWAWAY_STOP_S) -> None:
        """Stop it and everything it started; its run directory and its record go too. The
        processes go first: this runs in the cleanup of a cancelled task too, where any later
        await may be cut short."""
        await self.host.terminate_tree(self.child, grace_s, kill_s)
        self.deaf()
        for d in self.drains:
            d.cancel()
        await self.client.close()
        shutil.rmtree(self.work, ignore_errors=True)
        leftovers.clear(self.state_dir, self.record)


def fields_of(t: Throwaway) -> dict[str, Any]:
    """A throwaway's fields, for a record that extends it (a spare)."""
    return {f.name: getattr(t, f.name) for f in fields(Throwaway)}


class Launcher:
    """Starts second engines like the engine (its command, its environment without the alerts'
    secrets), on a free port and with a run directory of their own under ``dir``."""

    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None]) -> None:
        self.cfg, self.host, self.publish = cfg, host, publish
        self.dir = Path()
        # those being started or waited for (their pids are ours)
        self.current: set[Throwaway] = set()

    def configure(self, cfg: Config) -> None:
        self.cfg = cfg

    async def launch(self, rung: Profile, weights: Weights, sleep_mode: bool, niced: bool,
                     version: str | None = None, kv_bytes: int | None = None,
                     standby: Standby | None = None) -> Throwaway:
        """Spawn a second engine at ``rung`` (with a KV cache of ``kv_bytes`` when given, instead
        of what vLLM's memory profiling finds), or make ``standby`` (vLLM imported, not niced)
        become it; OSError when it cannot be started."""
        e = self.cfg.engine
        args = {**e.args, **(DUMMY_WEIGHTS_ARGS if weights == "dummy" else {})}
        if sleep_mode:
            args["enable_sleep_mode"] = True
        if kv_bytes is not None:
            args["kv_cache_memory_bytes"] = kv_bytes
        engine = replace(e, port=free_port({t.port for t in self.current}), args=args)
        work = self.dir / work_name(rung, sleep_mode)
        argv = launch.build_argv(engine, rung, self.cfg.health.hang_timeout_s)
        if niced and shutil.which("nice"):
            argv = ["nice", "-n", "10", *argv]  # never an engine that may serve: niced for good
        ipc_env = ipc.prepare_child_env(work, str(work / ipc.SOCKET_NAME), "INFO",
                                        dev_mode=sleep_mode or ipc.dev_mode(e.env))
        env = launch.build_env(e, ipc_env, str(work), withheld=self.cfg.withheld_env())
        if sleep_mode:
            env.update(sleep_mode_env(env))
        # vLLM prints its args, --api-key included: errors quote its last lines
        secrets = e.secrets()
        used: list[str] = []  # the compile cache directory it says it uses (host/compile_cache.py)
        spoiled: list[bool] = []
        port_taken: list[bool] = []
        tail = LogTail(TAIL_LINES, redact=lambda line: redact(line, secrets),
                       on_line=lambda line: _seen(line, used, spoiled, port_taken))
        self.publish(PrecompileStarted(at=self.host.wall(), profile=rung, port=engine.port,
                                       standby=standby is not None))
        ear: ipc.EventServer | None = None
        child: Child | None = None
        try:
            ear = await self._listen(work / ipc.SOCKET_NAME)
            if standby is not None:
                child, standby = await self._activate(standby, argv, env), None
            from_standby = child is not None
            if child is None:
                child = await self._spawn(argv, env)
        except BaseException:
            if ear is not None:
                ear.close()
            if standby is not None:  # taken from its pool, never told its argv
                await standby.discard(self.host)
            raise
        taken = {t.record for t in self.current}
        record = next(n for n in map(leftovers.precompile_record, range(len(taken) + 1))
                      if n not in taken)
        t = Throwaway(child, rung, engine.base_url, work, tail, [],
                      EngineClient(engine.base_url, e.api_key(), ipc.control_token(env)), self.host,
                      self.cfg.state.dir, tuple(masked(argv, secrets)), version, record, ear, used,
                      e, from_standby, spoiled, port_taken)
        self.current.add(t)  # its pids are ours from here on, and whoever launched it stops it
        t.drains += [
            asyncio.create_task(tail.drain(s)) for s in (child.proc.stdout, child.proc.stderr) if s
        ]
        t.record_as(record)
        return t

    async def _listen(self, path: Path) -> ipc.EventServer | None:
        """Its events socket, listened to; None where it cannot be bound (a path too long for
        AF_UNIX): unheard, as second engines were before."""
        ear = ipc.EventServer(path, self._heard)
        try:
            await ear.start()
        except OSError:
            return None
        return ear

    def _heard(self, event: dict[str, Any]) -> None:
        """A second engine's IPC record: only what vLLM set for its EngineCore is news
        (``engine.vllm_env``, with its pid): the standby a first start makes while these
        engines are built imports under it."""
        reported = env_report(event, self.host.wall(), second_engine=True)
        if reported is not None:
            self.publish(reported)

    async def _spawn(self, argv: list[str], env: dict[str, str]) -> Child:
        """Cancelled meanwhile (the engine died), the process that did start is stopped before
        the cancellation goes on."""
        spawning = asyncio.ensure_future(self.host.spawn(argv, env))
        try:
            return await asyncio.shield(spawning)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self.host.terminate_tree(await spawning, THROWAWAY_STOP_S, THROWAWAY_STOP_S)
            raise

    async def _activate(self, standby: Standby, argv: list[str],
                        env: dict[str, str]) -> Child | None:
        """``standby`` given this second engine's argv and environment; None when it is gone (the
        caller spawns cold). Cancelled meanwhile, ``launch`` discards it: told its argv, it would
        be a second engine nobody holds."""
        try:
            return await standby.activate(argv, env, self.cfg.recovery.standby_fork)
        except OSError as exc:
            log.info("spare.standby_lost", pid=standby.pid, error=str(exc))
            await standby.discard(self.host)
            return None

    def done(self, t: Throwaway) -> None:
        """``t`` is stopped or kept: no longer one being started."""
        self.current.discard(t)

    def pids(self) -> set[int]:
        return set().union(*(t.pids() for t in self.current))


def _seen(line: str, used: list[str], spoiled: list[bool], port_taken: list[bool]) -> None:
    """What a second engine's line tells: the compile cache directory it uses, that the cache
    cannot run, or that a port it was to bind was taken."""
    if not used:
        found = compile_cache.directory_of(line)
        if found:
            used.append(found)
    if not spoiled and spoils_compile_cache(line):
        spoiled.append(True)
    if not port_taken and says_port_taken(line):
        port_taken.append(True)


def work_name(rung: Profile, sleep_mode: bool) -> str:
    """A second engine's directory in the run directory: short, for its events socket's path must
    fit AF_UNIX's 108 bytes under systemd's /run/vllm-supervisor-<instance>/ (the rung's
    flags, spelled out, did not: the socket could not be bound and the second engine went
    unheard)."""
    digest = hashlib.sha256(rung.compile_key().encode()).hexdigest()[:12]
    return f"{'spare' if sleep_mode else 'precompile'}-{digest}"


class FailedRungs:
    """The one memory, for this run, of rungs whose second engine failed: a rung whose spare
    failed to start or to sleep is precompiled plainly next time; one whose precompile failed
    is not tried again at all."""

    def __init__(self) -> None:
        self._kind: dict[str, str] = {}  # compile key -> "spare" or "precompile"

    def add(self, rung: Profile, kind: Literal["spare", "precompile"]) -> None:
        if self._kind.get(rung.compile_key()) != "precompile":
            self._kind[rung.compile_key()] = kind

    def no_spare(self, rung: Profile) -> bool:
        return rung.compile_key() in self._kind

    def no_precompile(self, rung: Profile) -> bool:
        return self._kind.get(rung.compile_key()) == "precompile"

    def kinds(self) -> dict[str, str]:
        """Compile key -> what failed there ("spare" or "precompile"), a copy."""
        return dict(self._kind)

    def clear(self) -> None:
        """vLLM's compile cache was moved aside: what failed on it may be tried again."""
        self._kind.clear()
