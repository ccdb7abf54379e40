"""Where a start's engine comes from: a cold spawn, the standby interpreter given the engine's
argv, or a whole spare engine woken from sleep (recovery/ provides the last two through
``PreparedSource``)."""

from __future__ import annotations

import errno
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from supervisor.config import Config, masked
from supervisor.decide.compile_mode import COMPILED, CompileChoice
from supervisor.engine import ipc, launch
from supervisor.engine_states import Failure, FailureKind
from supervisor.host import Host
from supervisor.host.proctree import Child
from supervisor.profile import Profile

SPAWN_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM})


def spawn_failure_kind(exc: OSError) -> FailureKind:
    """Out of descriptors, processes or memory is the host's state now, not the command: retried."""
    if exc.errno in SPAWN_RESOURCE_ERRNOS:
        return FailureKind.ENGINE_DEAD
    return FailureKind.CONFIG_ERROR



class Prepared(Protocol):
    """An interpreter prepared to become this start's engine (recovery's standby)."""

    @property
    def pid(self) -> int: ...
    async def activate(self, argv: Sequence[str], env: Mapping[str, str], fork: bool) -> Child: ...


@dataclass
class Origin:
    """Where this start's engine comes from, and where it answers and sends its events: a spawn
    (cold, or the standby becoming it) at the configured port and the run directory's socket,
    or a woken spare at its own."""

    url: str
    events: Path
    spare: Woken | None = None  # woken at the gates: the start adopts it instead of spawning
    standby: bool = False  # the standby became the engine (known at the spawn)
    # with or without vLLM's torch.compile (known at the spawn; a spare is compiled as built)
    compile: CompileChoice = COMPILED


class Woken(Protocol):
    """A whole engine that was kept asleep and is awake now (recovery's spare): it becomes this
    start's engine."""

    profile: Profile
    url: str
    work: Path
    argv: tuple[str, ...]
    version: str | None
    warmed: Any  # its warm-up already done (woken beside the engine it replaces), or None

    async def hand_over(self) -> Child: ...


class PreparedSource(Protocol):
    """Where a start takes its standby (at the moment it spawns) or its spare (at its gates)
    from, and whether the next start at a rung is prepared (a climb's spare): recovery."""

    def take(self) -> Prepared | None: ...
    def lost(self, standby: Any, error: str) -> None: ...
    async def spare_for(self, profile: Profile) -> Woken | None: ...
    def spare_for_bound_s(self) -> float: ...
    async def build_first(self, profile: Profile) -> bool: ...
    def build_first_bound_s(self) -> float: ...
    def prepared_for(self, target: Profile) -> bool: ...
    def woken_ahead(self) -> bool: ...
    def sleeping_spare(self) -> Profile | None: ...
    def how_to_compile(self) -> CompileChoice: ...


async def spawn_engine(cfg: Config, host: Host, profile: Profile, run_dir: Path, origin: Origin,
                       server: ipc.EventServer, source: PreparedSource | None,
                       ) -> tuple[Child, tuple[str, ...]] | Failure:
    """This start's engine process: the woken spare handed over, or at ``profile`` the standby
    given its argv (``origin.standby``), else a cold spawn, with or without vLLM's torch.compile
    as ``source`` says (``origin.compile``); the child and its argv as shown
    (secrets masked), or the failure when neither could start. The event server is listening
    before the engine can connect."""
    if origin.spare is not None:  # its hook, logging config and socket were made when it was built
        await server.start()
        return await origin.spare.hand_over(), origin.spare.argv
    e = cfg.engine
    if source is not None:
        origin.compile = source.how_to_compile()
    argv = launch.build_argv(e, profile, cfg.health.hang_timeout_s, origin.compile.compiled)
    ipc_env = ipc.prepare_child_env(run_dir, str(origin.events), launch.vllm_log_level(e),
                                    ipc.dev_mode(e.env))  # makes the run directory the socket is in
    await server.start()
    env = launch.build_env(e, ipc_env, str(run_dir), withheld=cfg.withheld_env())
    shown = tuple(masked(argv, e.secrets()))
    try:
        standby = source.take() if source is not None else None
        if standby is not None and source is not None:
            try:
                child = await standby.activate(argv, env, cfg.recovery.standby_fork)
                origin.standby = True
                return child, shown
            except OSError as exc:
                source.lost(standby, str(exc))
        return await host.spawn(argv, env), shown
    except OSError as exc:
        evidence = f"could not start the engine command {argv[0]!r}: {exc}"
        return Failure(spawn_failure_kind(exc), evidence)
