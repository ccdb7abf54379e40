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
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeVar

import structlog

from supervisor.about import __version__
from supervisor.bounds import (
    GATE_SLACK_S,
    SHORT_SLACK_S,
    STACK_DUMP_S,
    STEP_SLACK_S,
)
from supervisor.config import Config, masked
from supervisor.decide import startup
from supervisor.decide.classify import ExitInfo, classify, settled_before_exit
from supervisor.decide.evidence import batch
from supervisor.decide.liveness import Liveness
from supervisor.engine import gates, ipc, launch, teardown, warmup
from supervisor.engine.gates import Adapted
from supervisor.engine.monitor import Monitor
from supervisor.engine.observer import Observer
from supervisor.engine.origin import Origin, PreparedSource, Woken, spawn_engine
from supervisor.engine.steps import Steps, Trigger
from supervisor.engine.teardown import stop_bound, stop_tree
from supervisor.engine_states import Failure, Phase, TriggerKind
from supervisor.event_stream import (
    DeathSeen,
    DeathSettled,
    EngineSpawned,
    Event,
    Ready,
)
from supervisor.host import Host, leftovers
from supervisor.host.proctree import Child, StopReport
from supervisor.host.vllm_http import EngineClient
from supervisor.profile import Profile

R = TypeVar("R")
log = structlog.get_logger("supervisor.engine")


@dataclass
class Timeline:
    """When this start began, spawned its engine, and first got /health 200 (the host's monotonic
    clock)."""

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
    """How the run ended: the trigger, for an unplanned end the classified failure, and the
    evidence."""

    trigger: Trigger
    failure: Failure | None
    phase: Phase
    returncode: int | None
    stop: StopReport | None
    stacks: dict[int, str] = field(default_factory=dict)
    # for the incident bundle (secrets masked)
    evidence: Mapping[str, Any] = field(default_factory=dict)


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
        self.client = client or EngineClient(cfg.engine.base_url, cfg.engine.api_key())
        self.steps = Steps(host)
        self.phase = Phase.LOADING
        self.seen = Observer(cfg, host, publish, cfg.engine.secrets(),
                             lambda found: self.end(TriggerKind.DEATH, found), echo)
        self.origin = Origin(cfg.engine.base_url, run_dir / ipc.SOCKET_NAME)
        self.server = ipc.EventServer(self.origin.events, self.seen.on_event)
        self.child: Child | None = None
        # asked for an interpreter that becomes the engine instead of a cold spawn
        self.standby = standby
        self.monitor: Monitor | None = None  # from the spawn on
        self.t = Timeline(host.monotonic())
        self._tasks: list[asyncio.Task[Any]] = []

    def status(self, warming_since: float | None = None) -> dict[str, Any]:
        """This start's part of /status: the engine's pid, its phase, vLLM's step while it
        starts."""
        child, now = self.child, self.host.monotonic()
        startup = (self.seen.startup(now, self.t.started) if warming_since is None
                   else {"step": "warming", "for_s": round(now - warming_since, 1)})
        return {
            "engine_pid": child.pid if child and child.proc.returncode is None else None,
            "phase": self.phase.value, "startup": startup,
            "engine_version": self.seen.engine_version
        }

    def pids(self) -> set[int]:
        """Every process of this start's tree seen so far (the GPU memory holders)."""
        return set(self.child.known_pids) if self.child else set()

    def deadline_at(self) -> float:
        """By when the current step must be over (the supervisor stops petting the watchdog
        after)."""
        return self.steps.deadline

    def end(self, kind: TriggerKind, evidence: str, failure: Failure | None = None,
            target: Profile | None = None) -> None:
        """Ask the run to end (a stop, a climb or restart to ``target``, or a rule that fired);
        the first wins."""
        self.steps.end(kind, evidence, failure, target)

    # ---- STARTING ------------------------------------------------------------------------------
    async def gates(self) -> Trigger | Adapted | None:
        """The model and the GPU memory, before anything is spawned: None to go on, an adapted
        profile to start at (this run takes it; the lifecycle records it), or the trigger that
        ends the start."""
        source = self.standby
        if source is not None:  # a spare stopped, or woken
            spare = await self.steps.within(source.spare_for_bound_s() + STEP_SLACK_S,
                                            source.spare_for(self.profile))
            if isinstance(spare, Trigger):
                return spare
            if spare is not None:
                return self._adopting(spare)
        gated = await self._gated()
        if source is None or isinstance(gated, Trigger):
            return gated
        first = await self.steps.within(source.build_first_bound_s() + STEP_SLACK_S,
                                        source.build_first(self.profile))
        # the card has the spare asleep on it now: the engine starts beside its footprint
        if first is True:
            return await self._gated() or gated
        return first if isinstance(first, Trigger) else gated

    async def _gated(self) -> Trigger | Adapted | None:
        bound = self.cfg.engine.model_wait_s + self.cfg.gpu.free_wait_s + GATE_SLACK_S
        gated = await self.steps.within(
            bound, gates.every_gate(self.cfg, self.host, self.publish, self.profile))
        if isinstance(gated, tuple):
            return self.steps.trigger(*gated)
        if isinstance(gated, Adapted):
            self.profile = gated.profile
        return gated

    def _adopting(self, spare: Woken) -> Adapted | None:
        """This start takes the woken spare: its profile (the utilization it started at), its
        port, its events."""
        self.origin = Origin(spare.url, spare.work / ipc.SOCKET_NAME, spare)
        # the client made before the gates: it has no request open yet
        self.client.base_url = spare.url
        self.server = ipc.EventServer(self.origin.events, self.seen.on_event)
        self.seen.engine_version = spare.version
        if spare.profile == self.profile:
            return None
        self.profile = spare.profile
        return Adapted(
            spare.profile, "a spare engine built beside the last one became this engine, at the "
            "gpu_memory_utilization that fitted beside it")

    async def start(self) -> Trigger | Healthy:
        """Spawn (or adopt the woken spare), and wait for /health 200."""
        e = self.cfg.engine
        made = await spawn_engine(self.cfg, self.host, self.profile, self.run_dir, self.origin,
                                  self.server, self.standby)
        if isinstance(made, Failure):
            return self.steps.trigger(TriggerKind.SPAWN_FAILED, made.evidence, made)
        child, shown = made
        self.child = child
        self.publish(
            EngineSpawned(at=self.host.wall(), pid=child.pid, start=self.number, argv=shown,
                          standby=self.origin.standby, spare=self.origin.spare is not None))
        leftovers.record(self.cfg.state.dir, self.host, child)
        assert child.proc.stdout is not None and child.proc.stderr is not None
        self._tasks += [asyncio.create_task(self.seen.tail.drain(child.proc.stdout)),
                        asyncio.create_task(self.seen.tail.drain(child.proc.stderr)),
                        asyncio.create_task(self._watch_exit(child))]
        self.t.spawned = spawned = self.host.monotonic()
        self.monitor = Monitor(self.cfg.health, self.host, self.client, self.publish,
                               Liveness(self.cfg.health, e.start_timeout_s, spawned),
                               f"canary-{self.number}")
        overdue = await self.steps.within(e.start_timeout_s + STEP_SLACK_S,
                                          self.monitor.until_healthy())
        if overdue is not None:
            return overdue if isinstance(overdue, Trigger) else self.steps.trigger(*overdue)
        self.phase = Phase.SERVING
        self.seen.loading = False
        self.t.healthy = self.host.monotonic()
        # EngineCore and workers exist by now: remember them, they are the GPU memory holders.
        self.host.tree_pids(child)
        return Healthy(round(self.t.healthy - self.t.started, 3))

    async def _watch_exit(self, child: Child) -> None:
        rc = await child.wait_exit()
        self.end(TriggerKind.EXIT, f"API server {ExitInfo(rc).describe()}")

    # ---- WARMING --------------------------------------------------------------------------------
    async def warm(self) -> Trigger | Ready:
        """Mid-length prompts before traffic (a failure is a startup failure); the READY record."""
        w = self.cfg.warmup
        sizes = warmup.plan(self.profile, w)
        spare = self.origin.spare
        if spare is not None:
            w = warmup.after_wake(w, sizes)
        try:
            warmed = await self.steps.within(
                w.timeout_s + STEP_SLACK_S,
                warmup.run(self.client, [] if spare and spare.warmed else sizes, w))
        except warmup.WarmupFailed as exc:
            return self.steps.trigger(TriggerKind.WARMUP_FAILED, str(exc))
        if isinstance(warmed, Trigger):
            return warmed
        self.t.ready = self.host.monotonic()
        return ready_record(self.t, self.seen, self.origin, sizes)

    # ---- READY ----------------------------------------------------------------------------------
    async def serve(self) -> Trigger:
        """Watch the serving engine until a trigger ends the run."""
        assert self.monitor is not None
        self.monitor.live.ready(self.host.monotonic())
        ended = await self.steps.within(self.monitor.round_bound_s(), self._monitor())
        assert ended is not None
        return ended

    @property
    def idle(self) -> bool:
        return self.monitor is not None and not self.monitor.live.pending

    async def _monitor(self) -> Trigger:
        monitor, child = self.monitor, self.child
        assert monitor is not None and child is not None

        def each_round() -> None:
            self.steps.expect(monitor.round_bound_s())
            self.host.tree_pids(child)  # workers may come and go: they are the GPU memory holders

        return self.steps.trigger(*await monitor.until_fired(each_round))

    # ---- the end ---------------------------------------------------------------------------------
    async def conclude(self, trigger: Trigger) -> Verdict:
        """Gather the evidence, stop the whole tree, and classify (unplanned ends only)."""
        self.seen.ending = True
        phase = self.phase
        child = self.child
        if child is not None:
            self.host.tree_pids(child)
        rc: int | None = child.proc.returncode if child else None
        settled = settled_death(self, trigger, phase, rc)
        if trigger.kind is TriggerKind.DEATH and child is not None and rc is None:
            grace = await teardown.death_grace_s(self.cfg, self.host, child, self.origin.url,
                                                 settled)
            self.steps.expect(grace + SHORT_SLACK_S)
            rc = await teardown.exit_within(child, grace)
        stacks: dict[int, str] = {}
        if trigger.kind is TriggerKind.HANG and child is not None:
            self.steps.expect(STACK_DUMP_S)
            stacks = await teardown.stacks(self.host, self.publish, child)
        report = await self.stop(planned=trigger.kind.planned, at_once=settled or trigger.drained)
        failure = None if trigger.kind.planned else verdict_of(self.seen, trigger, phase, rc)
        return Verdict(trigger, failure, phase, rc, report, stacks, evidence_of(self))

    async def stop(self, planned: bool, at_once: bool = False) -> StopReport | None:
        """Stop the whole tree (teardown.stop_tree) and release what the run holds. ``at_once``:
        a dead engine whose verdict is settled (``settled_before_exit``) gets no SIGTERM grace
        either: its API server's graceful shutdown would only wait on connections to an engine
        that is gone; nor does a planned restart whose drain left nothing at the engine (vLLM's
        graceful exit took 3.3 s on the H100, all of it clients held)."""
        self.seen.ending = True
        self.steps.expect(stop_bound(self.cfg, planned))
        report = None
        if self.child is not None:
            report = await stop_tree(self.cfg, self.host, self.publish, self.child, self._tasks[:2],
                                     planned, at_once, self.standby)
        await self.close()
        return report

    async def shutdown(self) -> None:
        """The supervisor is exiting: a planned stop of a live engine, else just release what the
        run holds."""
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


def ready_record(t: Timeline, seen: Observer, origin: Origin, sizes: list[int]) -> Ready:
    """The READY record of a start whose warm-up is over: its timings, vLLM's steps, where its
    engine came from, whether it runs vLLM's torch.compile."""
    assert t.healthy is not None and t.ready is not None
    phases = startup.phases(t.started, t.spawned, seen.steps, t.healthy, t.ready)
    return Ready(t.timings(), phases, tuple(sizes), seen.engine_version, origin.standby,
                 origin.spare is not None, engine_url=origin.url, compile_cache=seen.compile_cache,
                 compiled=origin.compile.compiled)


def evidence_of(run: EngineRun) -> dict[str, Any]:
    """What went into the verdict, for the incident bundle (secrets masked by the writer)."""
    events, lines, e = list(run.seen.events), run.seen.tail.snapshot(), run.cfg.engine
    return {"requests_in_batch": batch(lines, events), "engine_version": run.seen.engine_version,
            "events": events[-100:], "log_tail": lines[-400:], "timings": run.t.timings(),
            "compiled": run.origin.compile.compiled,
            "versions": {"vllm_supervisor": __version__, "python": platform.python_version(),
                         "vllm": run.seen.engine_version},
            "argv": list(run.origin.spare.argv) if run.origin.spare is not None else masked(
                launch.build_argv(e, run.profile, run.cfg.health.hang_timeout_s,
                                  run.origin.compile.compiled), e.secrets())}


def settled_death(run: EngineRun, trigger: Trigger, phase: Phase, rc: int | None) -> bool:
    """Whether ``trigger`` is a death whose verdict is settled before the engine's stop
    (``settled_before_exit``); published when it is (``DeathSettled``): recovery wakes the spare
    the restart will want while the dead engine is stopped. A serving engine's that is not
    (``DeathSeen``, what the evidence says so far) may have that spare woken while its API server
    exits."""
    if trigger.kind is not TriggerKind.DEATH:
        return False
    found = verdict_of(run.seen, trigger, phase, rc)
    settled = settled_before_exit(found)
    if settled:
        run.publish(DeathSettled(at=run.host.wall(), kind=found.kind, profile=run.profile))
    elif phase is Phase.SERVING and rc is None:
        run.publish(DeathSeen(at=run.host.wall(), kind=found.kind, profile=run.profile))
    return settled


def verdict_of(seen: Observer, trigger: Trigger, phase: Phase, rc: int | None) -> Failure:
    """What the evidence in hand (vLLM's records and lines so far, the exit) says of an unplanned
    end."""
    return trigger.failure or classify(
        events=list(seen.events), lines=seen.tail.snapshot(), exit=ExitInfo(rc), phase=phase,
        trigger=trigger.evidence,
        hang=trigger.evidence if trigger.kind is TriggerKind.HANG else None)
