"""One start of vLLM, from the start gates to its verdict.

An EngineRun owns everything that lives and dies with one start: the child and its process
tree, the log tail and its pipe drains, the IPC server, the exit watch, the HTTP client, the
liveness rules, its phase and its trigger queue. Whatever ends the run (the API server's exit,
vLLM's own error record saying the engine died, a liveness rule, a warm-up failure, a stop or a
climb asked by the supervisor) becomes one Trigger on that queue, and each step races its work
against the queue, so the first trigger wins and nothing is polled for luck.

The lifecycle drives the steps (start → warm → serve → conclude) and is the only writer of the
engine state; the run never imports it. Each step returns a record (Healthy, Ready, a Trigger,
the Verdict) instead of leaving fields to be read, and the run tells the world what it did only
through ``publish``. A new start is a new EngineRun: nothing is reset by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import platform
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO, TypeVar

import structlog

from supervisor.about import __version__
from supervisor.aio import cancel_and_wait
from supervisor.bounds import (
    GATE_SLACK_S,
    SHORT_SLACK_S,
    STACK_DUMP_S,
    STEP_SLACK_S,
)
from supervisor.config import Config, WarmupConfig, masked
from supervisor.decide import startup
from supervisor.decide.classify import ExitInfo, classify, settled_before_exit
from supervisor.decide.evidence import batch
from supervisor.decide.liveness import Liveness
from supervisor.engine import gates, ipc, launch, warmup
from supervisor.engine.gates import Adapted
from supervisor.engine.monitor import Monitor
from supervisor.engine.observer import Observer
from supervisor.engine_states import Failure, FailureKind, Phase, TriggerKind
from supervisor.event_stream import (
    EngineSpawned,
    EngineStopped,
    Event,
    NoStackDump,
    Ready,
)
from supervisor.host import Host, leftovers
from supervisor.host.proctree import Child, StopReport
from supervisor.host.vllm_http import EngineClient
from supervisor.profile import Profile

R = TypeVar("R")
log = structlog.get_logger("supervisor.engine")
# A dead engine whose verdict is settled (settled_before_exit): how long its API server gets to answer the requests
# it had in flight (vLLM fails them the moment its engine core dies) before its tree is killed.
SETTLED_EXIT_S = 0.25
DRAIN_S = 5.0  # pipes reach EOF once every holder is gone; bounded in case a grandchild escaped


SPAWN_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM})


def spawn_failure_kind(exc: OSError) -> FailureKind:
    """Out of descriptors, processes or memory is the host's state now, not the command: retried."""
    return FailureKind.ENGINE_DEAD if exc.errno in SPAWN_RESOURCE_ERRNOS else FailureKind.CONFIG_ERROR


@dataclass(frozen=True)
class Trigger:
    """Why the run is ending: what fired, the evidence, and when (wall clock for detection latency)."""

    kind: TriggerKind
    evidence: str
    at: float
    at_mono: float
    # Set when the trigger already is the verdict (nothing ran that left logs to classify).
    failure: Failure | None = None
    target: Profile | None = None  # a planned restart's profile (a climb, the operator's)


@dataclass
class Timeline:
    """When this start began, spawned its engine, and first got /health 200 (the host's monotonic clock)."""

    started: float
    spawned: float | None = None
    healthy: float | None = None
    ready: float | None = None

    def timings(self) -> dict[str, float]:
        if self.healthy is None or self.ready is None:
            return {}
        return {"start_to_healthy_s": round(self.healthy - self.started, 3),
                "warmup_s": round(self.ready - self.healthy, 3),
                "start_to_ready_s": round(self.ready - self.started, 3)}


@dataclass(frozen=True)
class Healthy:
    """The engine answered /health 200 ``after_s`` after the start began."""

    after_s: float


@dataclass(frozen=True)
class Verdict:
    """How the run ended: the trigger, for an unplanned end the classified failure, and the evidence."""

    trigger: Trigger
    failure: Failure | None
    phase: Phase
    returncode: int | None
    stop: StopReport | None
    stacks: dict[int, str] = field(default_factory=dict)
    evidence: Mapping[str, Any] = field(default_factory=dict)  # for the incident bundle (secrets masked)


class Prepared(Protocol):
    """An interpreter prepared to become this start's engine (recovery's standby)."""

    @property
    def pid(self) -> int: ...
    async def activate(self, argv: Sequence[str], env: Mapping[str, str], fork: bool) -> Child: ...


@dataclass
class Origin:
    """Where this start's engine comes from, and where it answers and sends its events: a spawn (cold, or the
    standby becoming it) at the configured port and the run directory's socket, or a woken spare at its own."""

    url: str
    events: Path
    spare: Woken | None = None  # woken at the gates: the start adopts it instead of spawning
    standby: bool = False  # the standby became the engine (known at the spawn)


class Woken(Protocol):
    """A whole engine that was kept asleep and is awake now (recovery's spare): it becomes this start's engine."""

    profile: Profile
    url: str
    work: Path
    argv: tuple[str, ...]
    version: str | None

    async def hand_over(self) -> Child: ...


class PreparedSource(Protocol):
    """Where a start takes its standby (at the moment it spawns) or its spare (at its gates) from: recovery."""

    def take(self) -> Prepared | None: ...
    def lost(self, standby: Any, error: str) -> None: ...
    async def spare_for(self, profile: Profile) -> Woken | None: ...
    def spare_for_bound_s(self) -> float: ...
    async def build_first(self, profile: Profile) -> bool: ...
    def build_first_bound_s(self) -> float: ...


class EngineRun:
    def __init__(self, cfg: Config, host: Host, profile: Profile, number: int, run_dir: Path,
                 publish: Callable[[Event], None], *, echo: TextIO | None = None,
                 client: EngineClient | None = None, standby: PreparedSource | None = None) -> None:
        self.cfg = cfg
        self.host = host
        self.profile = profile
        self.number = number
        self.run_dir = run_dir
        self.publish = publish
        self.secrets = cfg.engine.secrets()
        self.client = client or EngineClient(cfg.engine.base_url, cfg.engine.api_key())
        self.triggers: asyncio.Queue[Trigger] = asyncio.Queue()
        self.phase = Phase.LOADING
        self.seen = Observer(cfg, host, publish, self.secrets, lambda found: self.end(TriggerKind.DEATH, found),
                             echo)
        self.origin = Origin(cfg.engine.base_url, run_dir / ipc.SOCKET_NAME)
        self.server = ipc.EventServer(self.origin.events, self.seen.on_event)
        self.child: Child | None = None
        self.standby = standby  # asked for an interpreter that becomes the engine instead of a cold spawn
        self.monitor: Monitor | None = None  # from the spawn on
        self.t = Timeline(host.monotonic())
        self.deadline = self.t.started  # by when the current step must be over (the watchdog's measure)
        self._tasks: list[asyncio.Task[Any]] = []

    # ---- triggers ---------------------------------------------------------------------------
    def trigger(self, kind: TriggerKind, evidence: str, failure: Failure | None = None,
                target: Profile | None = None) -> Trigger:
        return Trigger(kind, evidence, self.host.wall(), self.host.monotonic(), failure, target)

    def end(self, kind: TriggerKind, evidence: str, failure: Failure | None = None,
            target: Profile | None = None) -> None:
        """Ask the run to end (a stop, a climb or restart to ``target``, or a rule that fired); the first wins."""
        self.triggers.put_nowait(self.trigger(kind, evidence, failure, target))

    async def _race(self, work: Awaitable[R]) -> R | Trigger:
        """Run ``work`` until it finishes or a trigger arrives, whichever is first."""
        task = asyncio.ensure_future(work)
        getter = asyncio.ensure_future(self.triggers.get())
        done, _ = await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return getter.result()
        await cancel_and_wait(getter)
        return task.result()

    def _expect(self, seconds: float) -> None:
        self.deadline = self.host.monotonic() + seconds

    def status(self, warming_since: float | None = None) -> dict[str, Any]:
        """This start's part of /status: the engine's pid, its phase, vLLM's step while it starts."""
        child = self.child
        now = self.host.monotonic()
        startup: dict[str, Any] | None = None
        if warming_since is not None:
            startup = {"step": "warming", "for_s": round(now - warming_since, 1)}
        elif self.phase is Phase.LOADING and not self.seen.ending:
            step, since = self.seen.step() or ("starting", self.t.started)
            startup = {"step": step, "for_s": round(now - since, 1)}
        return {"engine_pid": child.pid if child and child.proc.returncode is None else None,
                "phase": self.phase.value, "startup": startup, "engine_version": self.seen.engine_version}

    def pids(self) -> set[int]:
        """Every process of this start's tree seen so far (the GPU memory holders)."""
        return set(self.child.known_pids) if self.child else set()

    def deadline_at(self) -> float:
        """By when the current step must be over (the supervisor stops petting the watchdog after)."""
        return self.deadline

    # ---- STARTING ------------------------------------------------------------------------------
    async def gates(self) -> Trigger | Adapted | None:
        """The model and the GPU memory, before anything is spawned: None to go on, an adapted profile to start
        at (this run takes it; the lifecycle records it), or the trigger that ends the start."""
        if self.standby is not None:
            self._expect(self.standby.spare_for_bound_s() + STEP_SLACK_S)  # a spare stopped, or woken
            spare = await self._race(self.standby.spare_for(self.profile))
            if isinstance(spare, Trigger):
                return spare
            if spare is not None:
                return self._adopting(spare)
        gated = await self._gated()
        if self.standby is None or isinstance(gated, Trigger):
            return gated
        self._expect(self.standby.build_first_bound_s() + STEP_SLACK_S)
        first = await self._race(self.standby.build_first(self.profile))
        if first is True:  # the card has the spare asleep on it now: the engine starts beside its footprint
            return await self._gated() or gated
        return first if isinstance(first, Trigger) else gated

    async def _gated(self) -> Trigger | Adapted | None:
        e = self.cfg.engine
        self._expect(e.model_wait_s + self.cfg.gpu.free_wait_s + GATE_SLACK_S)
        gated = await self._race(gates.every_gate(self.cfg, self.host, self.publish, self.profile))
        if isinstance(gated, tuple):
            return self.trigger(*gated)
        if isinstance(gated, Adapted):
            self.profile = gated.profile
        return gated

    def _adopting(self, spare: Woken) -> Adapted | None:
        """This start takes the woken spare: its profile (the utilization it started at), its port, its events."""
        self.origin = Origin(spare.url, spare.work / ipc.SOCKET_NAME, spare)
        self.client.base_url = spare.url  # the client made before the gates: it has no request open yet
        self.server = ipc.EventServer(self.origin.events, self.seen.on_event)
        self.seen.engine_version = spare.version
        if spare.profile == self.profile:
            return None
        self.profile = spare.profile
        return Adapted(spare.profile, "a spare engine built beside the last one became this engine, at the "
                                      "gpu_memory_utilization that fitted beside it")

    async def start(self) -> Trigger | Healthy:
        """Spawn (or adopt the woken spare), and wait for /health 200."""
        e, spare = self.cfg.engine, self.origin.spare
        if spare is not None:  # its hook, logging config and socket were made when it was built
            await self.server.start()
            child, shown = await spare.hand_over(), spare.argv
        else:
            argv = launch.build_argv(e, self.profile, self.cfg.health.hang_timeout_s)
            ipc_env = ipc.prepare_child_env(self.run_dir, str(self.origin.events), launch.vllm_log_level(e),
                                            ipc.dev_mode(e.env))  # makes the run directory the socket is in
            await self.server.start()
            env = launch.build_env(e, ipc_env, str(self.run_dir), withheld=self.cfg.withheld_env())
            try:
                child, shown = await self._spawn(argv, env), tuple(masked(argv, self.secrets))
            except OSError as exc:
                evidence = f"could not start the engine command {argv[0]!r}: {exc}"
                return self.trigger(TriggerKind.SPAWN_FAILED, evidence, Failure(spawn_failure_kind(exc), evidence))
        self.child = child
        self.publish(EngineSpawned(at=self.host.wall(), pid=child.pid, start=self.number, argv=shown,
                                   standby=self.origin.standby, spare=spare is not None))
        leftovers.record(self.cfg.state.dir, self.host, child)
        assert child.proc.stdout is not None and child.proc.stderr is not None
        self._tasks += [asyncio.create_task(self.seen.tail.drain(child.proc.stdout)),
                        asyncio.create_task(self.seen.tail.drain(child.proc.stderr)),
                        asyncio.create_task(self._watch_exit(child))]
        self.t.spawned = spawned = self.host.monotonic()
        self.monitor = Monitor(self.cfg.health, self.host, self.client, self.publish,
                               Liveness(self.cfg.health, e.start_timeout_s, spawned), f"canary-{self.number}")
        self._expect(e.start_timeout_s + STEP_SLACK_S)
        healthy = await self._race(self._wait_healthy())
        if healthy is not None:
            return healthy
        self.phase = Phase.SERVING
        self.seen.loading = False
        self.t.healthy = self.host.monotonic()
        # EngineCore and workers exist by now: remember them, they are the GPU memory holders.
        self.host.tree_pids(child)
        return Healthy(round(self.t.healthy - self.t.started, 3))

    async def _spawn(self, argv: list[str], env: dict[str, str]) -> Child:
        standby = self.standby.take() if self.standby is not None else None
        if standby is not None and self.standby is not None:
            try:
                child = await standby.activate(argv, env, self.cfg.recovery.standby_fork)
                self.origin.standby = True
                return child
            except OSError as exc:
                self.standby.lost(standby, str(exc))
        return await self.host.spawn(argv, env)

    async def _watch_exit(self, child: Child) -> None:
        rc = await child.wait_exit()
        self.end(TriggerKind.EXIT, f"API server {ExitInfo(rc).describe()}")

    async def _wait_healthy(self) -> Trigger | None:
        assert self.monitor is not None
        delay = 0.05
        while True:
            if await self.client.health(timeout=2.0) == 200:
                return None
            overdue = self.monitor.live.start_overdue(self.host.monotonic())
            if overdue:
                return self.trigger(TriggerKind.HANG, overdue)
            await self.host.sleep(delay)
            delay = min(0.5, delay * 1.5)

    # ---- WARMING --------------------------------------------------------------------------------
    async def warm(self) -> Trigger | Ready:
        """Mid-length prompts before traffic (a failure is a startup failure); the READY record."""
        w = self.cfg.warmup
        sizes = warmup.plan(self.profile, w)
        if self.origin.spare is not None:
            w = warmup.after_wake(w, sizes)
        self._expect(w.timeout_s + STEP_SLACK_S)
        try:
            warmed = await self._race(self._warm(w, sizes))
        except warmup.WarmupFailed as exc:
            return self.trigger(TriggerKind.WARMUP_FAILED, str(exc))
        if warmed is not None:
            return warmed
        t = self.t
        t.ready = self.host.monotonic()
        assert t.healthy is not None
        phases = startup.phases(t.started, t.spawned, self.seen.steps, t.healthy, t.ready)
        return Ready(t.timings(), phases, tuple(sizes), self.seen.engine_version, self.origin.standby,
                     self.origin.spare is not None, engine_url=self.origin.url, compile_cache=self.seen.compile_cache)

    async def _warm(self, w: WarmupConfig, sizes: list[int]) -> None:
        await warmup.run(self.client, sizes, w)

    # ---- READY ----------------------------------------------------------------------------------
    async def serve(self) -> Trigger:
        """Watch the serving engine until a trigger ends the run."""
        assert self.monitor is not None
        self.monitor.live.ready(self.host.monotonic())
        self._expect(self.monitor.round_bound_s())
        ended = await self._race(self._monitor())
        assert ended is not None
        return ended

    @property
    def idle(self) -> bool:
        return self.monitor is not None and not self.monitor.live.pending

    async def _monitor(self) -> Trigger:
        monitor, child = self.monitor, self.child
        assert monitor is not None and child is not None

        def each_round() -> None:
            self._expect(monitor.round_bound_s())
            self.host.tree_pids(child)  # workers may come and go: they are the GPU memory holders

        return self.trigger(*await monitor.until_fired(each_round))

    # ---- the end ------------------------------------------------------------------------------------
    async def conclude(self, trigger: Trigger) -> Verdict:
        """Gather the evidence, stop the whole tree, and classify (unplanned ends only)."""
        self.seen.ending = True
        phase = self.phase
        child = self.child
        if child is not None:
            self.host.tree_pids(child)
        rc: int | None = child.proc.returncode if child else None
        settled = trigger.kind is TriggerKind.DEATH and settled_before_exit(verdict_of(self.seen, trigger, phase, rc))
        if trigger.kind is TriggerKind.DEATH and child is not None and rc is None:
            # vLLM exits by itself within seconds of its engine dying; let it finish logging. With the verdict
            # settled already, only long enough to answer its requests in flight (500, not a reset), then killed.
            grace = min(self.cfg.engine.dead_grace_s, SETTLED_EXIT_S) if settled else self.cfg.engine.dead_grace_s
            self._expect(grace + SHORT_SLACK_S)
            with contextlib.suppress(asyncio.TimeoutError):
                rc = await asyncio.wait_for(child.wait_exit(), grace)
        stacks: dict[int, str] = {}
        if trigger.kind is TriggerKind.HANG and child is not None:
            self._expect(STACK_DUMP_S)
            stacks = await self.host.dump_stacks(self.host.tree_pids(child))
            if not stacks:
                self.publish(NoStackDump(at=self.host.wall()))
        report = await self.stop(planned=trigger.kind.planned, at_once=settled)
        failure = None if trigger.kind.planned else verdict_of(self.seen, trigger, phase, rc)
        return Verdict(trigger, failure, phase, rc, report, stacks, evidence_of(self))

    async def stop(self, planned: bool, at_once: bool = False) -> StopReport | None:
        """Kill the whole tree, drain the pipes, wait for GPU memory to be released. ``at_once``: a dead engine
        whose verdict is settled (``settled_before_exit``) gets no SIGTERM grace either: its API server's graceful
        shutdown would only wait on connections to an engine that is gone."""
        self.seen.ending = True
        self._expect(stop_bound(self.cfg, planned))
        child = self.child
        report = None
        if child is not None:
            e = self.cfg.engine
            t0 = self.host.monotonic()
            # A dead or hung engine has nothing to finish: a short grace, then SIGKILL. vLLM's API server
            # ignores SIGTERM while its start is failing, and multiprocessing's resource tracker always does.
            grace = 0.0 if at_once else e.stop_timeout_s if planned else e.failed_stop_timeout_s
            report = await self.host.terminate_tree(child, grace, e.kill_timeout_s)
            t1 = self.host.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*self._tasks[:2], return_exceptions=True), DRAIN_S)
            t2 = self.host.monotonic()
            await gates.wait_released(self.cfg, self.host, self.publish, report.pids)
            self.publish(EngineStopped(at=self.host.wall(), pids=report.pids, sigkilled=report.killed,
                                       survivors=report.survivors, returncode=report.returncode,
                                       kill_s=round(t1 - t0, 3), drain_s=round(t2 - t1, 3),
                                       gpu_release_s=round(self.host.monotonic() - t2, 3), planned=planned))
        await self.close()
        return report

    async def shutdown(self) -> None:
        """The supervisor is exiting: a planned stop of a live engine, else just release what the run holds."""
        if self.child is not None and self.child.proc.returncode is None:
            await self.stop(planned=True)
        else:
            await self.close()

    async def close(self) -> None:
        """Release what the run holds (idempotent)."""
        self.seen.ending = True
        for t in self._tasks:
            t.cancel()
        if self.monitor is not None:
            self.monitor.stop()
        self.server.close()
        await self.client.close()


def evidence_of(run: EngineRun) -> dict[str, Any]:
    """What went into the verdict, for the incident bundle (secrets masked by the writer)."""
    events, lines = list(run.seen.events), run.seen.tail.snapshot()
    return {"requests_in_batch": batch(lines, events), "engine_version": run.seen.engine_version,
            "events": events[-100:], "log_tail": lines[-400:], "timings": run.t.timings(),
            "versions": {"vllm_supervisor": __version__, "python": platform.python_version(),
                         "vllm": run.seen.engine_version},
            "argv": list(run.origin.spare.argv) if run.origin.spare is not None else masked(
                launch.build_argv(run.cfg.engine, run.profile, run.cfg.health.hang_timeout_s), run.secrets)}


def verdict_of(seen: Observer, trigger: Trigger, phase: Phase, rc: int | None) -> Failure:
    """What the evidence in hand (vLLM's records and lines so far, the exit) says of an unplanned end."""
    return trigger.failure or classify(
        events=list(seen.events), lines=seen.tail.snapshot(), exit=ExitInfo(rc), phase=phase,
        trigger=trigger.evidence, hang=trigger.evidence if trigger.kind is TriggerKind.HANG else None)


def stop_bound(cfg: Config, planned: bool) -> float:
    e = cfg.engine
    grace = e.stop_timeout_s if planned else e.failed_stop_timeout_s
    return grace + e.kill_timeout_s + DRAIN_S + cfg.gpu.release_timeout_s + STEP_SLACK_S
