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
import os
import platform
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import psutil
import structlog

from supervisor.about import __version__
from supervisor.child import vllm_hook
from supervisor.config import Config, WarmupConfig, is_local_path
from supervisor.decide import startup
from supervisor.decide.classify import ExitInfo, classify, death_evidence, fraction_that_fits
from supervisor.decide.evidence import ConsoleFilter, batch, event_evidence
from supervisor.decide.liveness import Liveness
from supervisor.engine import ipc, launch, warmup
from supervisor.engine.logtail import LogTail
from supervisor.engine_states import Failure, FailureKind, Phase, TriggerKind
from supervisor.event_stream import (
    CanaryFailed,
    CompileCacheUnusable,
    EngineEnvReported,
    EngineSpawned,
    EngineStopped,
    Event,
    GpuLostEvent,
    GpuNotReleased,
    GpuShort,
    ModelAppeared,
    ModelMissing,
    NoStackDump,
    Ready,
)
from supervisor.host import Host, leftovers
from supervisor.host.gpu import GpuLost
from supervisor.host.proctree import Child, StopReport
from supervisor.host.vllm_http import EngineClient, EngineError, EngineStatusError
from supervisor.profile import Knob, Profile

log = structlog.get_logger("supervisor.engine")
GIB = 2**30
DRAIN_S = 5.0  # pipes reach EOF once every holder is gone; bounded in case a grandchild escaped


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


class StandbySource(Protocol):
    """Where a start takes its standby from, at the moment it spawns (recovery)."""

    def take(self) -> Prepared | None: ...
    def lost(self, standby: Any, error: str) -> None: ...


class EngineRun:
    def __init__(self, cfg: Config, host: Host, profile: Profile, number: int, run_dir: Path,
                 publish: Callable[[Event], None], *, echo: TextIO | None = None,
                 client: EngineClient | None = None, standby: StandbySource | None = None) -> None:
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
        self.events: deque[dict[str, Any]] = deque(maxlen=1000)
        self.console = ConsoleFilter()
        self.tail = LogTail(cfg.log.tail_lines, on_line=self._on_line, echo=echo,
                            redact=lambda line: launch.redact(line, self.secrets))
        self.server = ipc.EventServer(run_dir / "events.sock", self._on_event)
        self.child: Child | None = None
        self.standby = standby  # asked for an interpreter that becomes the engine instead of a cold spawn
        self.from_standby = False
        self.liveness: Liveness | None = None
        self.started_at = host.monotonic()
        self.healthy_at: float | None = None
        self.ready_at: float | None = None
        self.deadline = self.started_at  # by when the current step must be over (the watchdog's measure)
        self.steps: list[tuple[str, float]] = []  # every step vLLM went through, with when it began
        self.spawned_at: float | None = None
        self.engine_version: str | None = None
        self._timings: dict[str, float] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._canary: asyncio.Task[None] | None = None
        self._ending = False
        self._aot_noted = False

    # ---- triggers ---------------------------------------------------------------------------
    def trigger(self, kind: TriggerKind, evidence: str, failure: Failure | None = None,
                target: Profile | None = None) -> Trigger:
        return Trigger(kind, evidence, self.host.wall(), self.host.monotonic(), failure, target)

    def end(self, kind: TriggerKind, evidence: str, failure: Failure | None = None,
            target: Profile | None = None) -> None:
        """Ask the run to end (a stop, a climb or restart to ``target``, or a rule that fired); the first wins."""
        self.triggers.put_nowait(self.trigger(kind, evidence, failure, target))

    def _on_event(self, event: dict[str, Any]) -> None:
        if event.get("kind") == vllm_hook.VLLM_ENV_KIND:  # not a log record: never evidence, never in an incident
            env = event.get("env")
            pid = event.get("pid")
            self.publish(EngineEnvReported(
                at=self.host.wall(), pid=pid if isinstance(pid, int) else None,
                env={k: v for k, v in env.items() if isinstance(k, str) and isinstance(v, str)}
                if isinstance(env, dict) else {}))
            return
        if self.secrets:
            event = {k: self._redact(v) for k, v in event.items()}
        self.events.append(event)
        if self._ending:
            return
        for text in event_evidence(event):
            found = death_evidence(text)
            if found:
                self.end(TriggerKind.DEATH, found)
                return

    def _redact(self, value: Any) -> Any:
        if isinstance(value, str):
            return launch.redact(value, self.secrets)
        if isinstance(value, list):
            return [self._redact(v) for v in value]
        return value

    def _on_line(self, line: str) -> None:
        if self.phase is Phase.LOADING:
            step = startup.step_of(line)
            if step and (not self.steps or self.steps[-1][0] != step):
                self.steps.append((step, self.host.monotonic()))
            if self.engine_version is None:
                self.engine_version = startup.version_of(line)
            reason = None if self._aot_noted else startup.aot_cache_failure(line)
            if reason:
                self._aot_noted = True
                self.publish(CompileCacheUnusable(
                    at=self.host.wall(), reason=reason,
                    hint="vLLM compiles the model again at every start (2-3 s of each on the tiny CPU model, "
                         "docs/recovery.md); VLLM_USE_AOT_COMPILE = \"0\" in [engine.env] makes it use its older "
                         "compile cache, which loads"))
        text = self.console.feed(line)
        if text and not self._ending:
            found = death_evidence(text)
            if found:
                self.end(TriggerKind.DEATH, found)

    async def _race(self, work: Awaitable[Trigger | None]) -> Trigger | None:
        """Run ``work`` until it finishes or a trigger arrives, whichever is first."""
        task = asyncio.ensure_future(work)
        getter = asyncio.ensure_future(self.triggers.get())
        done, _ = await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return getter.result()
        getter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await getter
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
        elif self.phase is Phase.LOADING and not self._ending:
            step, since = self.steps[-1] if self.steps else ("starting", self.started_at)
            startup = {"step": step, "for_s": round(now - since, 1)}
        return {"engine_pid": child.pid if child and child.proc.returncode is None else None,
                "phase": self.phase.value, "startup": startup, "engine_version": self.engine_version}

    def pids(self) -> set[int]:
        """Every process of this start's tree seen so far (the GPU memory holders)."""
        return set(self.child.known_pids) if self.child else set()

    def deadline_at(self) -> float:
        """By when the current step must be over (the supervisor stops petting the watchdog after)."""
        return self.deadline

    # ---- STARTING ------------------------------------------------------------------------------
    async def start(self) -> Trigger | Healthy:
        """Gates, spawn, and wait for /health 200."""
        e = self.cfg.engine
        self._expect(e.model_wait_s + self.cfg.gpu.free_wait_s + 30.0)
        gated = await self._race(self._gates())
        if gated is not None:
            return gated
        argv = launch.build_argv(e, self.profile)
        sock = self.run_dir / "events.sock"
        ipc_env = ipc.prepare_child_env(self.run_dir, str(sock), launch.vllm_log_level(e))
        await self.server.start()
        env = launch.build_env(e, ipc_env, str(self.run_dir))
        try:
            self.child = await self._spawn(argv, env)
        except OSError as exc:
            evidence = f"could not start the engine command {argv[0]!r}: {exc}"
            return self.trigger(TriggerKind.SPAWN_FAILED, evidence, Failure(FailureKind.CONFIG_ERROR, evidence))
        child = self.child
        self.publish(EngineSpawned(at=self.host.wall(), pid=child.pid, start=self.number,
                                   argv=tuple(launch.masked(argv, self.secrets)), standby=self.from_standby))
        try:
            leftovers.write(self.cfg.state.dir, leftovers.EngineRecord(
                child.sid, self.host.create_time(child.pid), os.getpid()))
        except (OSError, psutil.Error) as exc:
            log.warning("state.engine_record_failed", error=str(exc))
        assert child.proc.stdout is not None and child.proc.stderr is not None
        self._tasks += [asyncio.create_task(self.tail.drain(child.proc.stdout)),
                        asyncio.create_task(self.tail.drain(child.proc.stderr)),
                        asyncio.create_task(self._watch_exit(child))]
        self.spawned_at = spawned = self.host.monotonic()
        self.liveness = Liveness(self.cfg.health, e.start_timeout_s, spawned)
        self._expect(e.start_timeout_s + 10.0)
        healthy = await self._race(self._wait_healthy())
        if healthy is not None:
            return healthy
        self.phase = Phase.SERVING
        self.healthy_at = self.host.monotonic()
        # EngineCore and workers exist by now: remember them, they are the GPU memory holders.
        self.host.tree_pids(child)
        return Healthy(round(self.healthy_at - self.started_at, 3))

    async def _spawn(self, argv: list[str], env: dict[str, str]) -> Child:
        standby = self.standby.take() if self.standby is not None else None
        if standby is not None and self.standby is not None:
            try:
                child = await standby.activate(argv, env, self.cfg.recovery.standby_fork)
                self.from_standby = True
                return child
            except OSError as exc:
                self.standby.lost(standby, str(exc))
        return await self.host.spawn(argv, env)

    async def _gates(self) -> Trigger | None:
        return await self._model_gate() or await self._gpu_gate()

    async def _model_gate(self) -> Trigger | None:
        """A local model path missing at boot may be a late mount: wait for it, with backoff, for a bounded time."""
        model, wait_s = self.cfg.engine.model, self.cfg.engine.model_wait_s
        if not is_local_path(model) or self.host.path_exists(model):
            return None
        self.publish(ModelMissing(at=self.host.wall(), model=model, waiting_up_to_s=wait_s))
        deadline = self.host.monotonic() + wait_s
        delay = 1.0
        while self.host.monotonic() < deadline:
            await self.host.sleep(min(delay, max(0.0, deadline - self.host.monotonic())))
            if self.host.path_exists(model):
                self.publish(ModelAppeared(at=self.host.wall(), model=model))
                return None
            delay = min(30.0, delay * 2)
        evidence = f"local model path {model!r} does not exist (waited engine.model_wait_s={wait_s:g}s)"
        return self.trigger(TriggerKind.MODEL_MISSING, evidence, Failure(FailureKind.CONFIG_ERROR, evidence))

    async def _gpu_gate(self) -> Trigger | None:
        """Before a start: wait (bounded) until the devices have the memory vLLM will ask for.

        Still short after ``free_wait_s``: vLLM's own start check would fail a minute into loading,
        so the start is failed here, with NVML's numbers as evidence. Another process's memory is
        not the rung's fault: the failure says so, and the utilization climbs back once it is free.
        """
        gpu = self.cfg.gpu
        devices = self.cfg.engine.devices()
        util = self.profile.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.0
        headroom = gpu.start_headroom_bytes
        try:
            short = await self.host.wait_gpu_free(devices, util, headroom, gpu.free_wait_s)
        except GpuLost as exc:
            return self.trigger(TriggerKind.GPU_LOST, str(exc), Failure(FailureKind.DEVICE_FATAL, str(exc)))
        if not short:
            return None
        s = min(short, key=lambda d: d.free / d.total)
        holders = ", ".join(f"pid {pid} ({used / GIB:.2f} GiB)" for pid, used in s.processes) or "unknown"
        evidence = (f"GPU {s.index}: {s.free / GIB:.2f} of {s.total / GIB:.2f} GiB free after waiting "
                    f"{gpu.free_wait_s:g}s, below gpu_memory_utilization {util:g} + "
                    f"{gpu.start_headroom_gib:g} GiB headroom; held by {holders}")
        self.publish(GpuShort(at=self.host.wall(), devices=tuple(d.as_dict() for d in short), evidence=evidence))
        return self.trigger(TriggerKind.GPU_SHORT, evidence, Failure(
            FailureKind.STARTUP_MEMORY, evidence, knob=Knob.GPU_MEMORY_UTILIZATION,
            suggested=fraction_that_fits(max(0, s.free - headroom), s.total), rung_at_fault=False))

    async def _watch_exit(self, child: Child) -> None:
        rc = await child.wait_exit()
        self.end(TriggerKind.EXIT, f"API server {ExitInfo(rc).describe()}")

    async def _wait_healthy(self) -> Trigger | None:
        assert self.liveness is not None
        delay = 0.05
        while True:
            if await self.client.health(timeout=2.0) == 200:
                return None
            overdue = self.liveness.start_overdue(self.host.monotonic())
            if overdue:
                return self.trigger(TriggerKind.HANG, overdue)
            await self.host.sleep(delay)
            delay = min(0.5, delay * 1.5)

    # ---- WARMING --------------------------------------------------------------------------------
    async def warm(self) -> Trigger | Ready:
        """Mid-length prompts before traffic (a failure is a startup failure); the READY record."""
        w = self.cfg.warmup
        sizes = warmup.plan(self.profile, w)
        self._expect(w.timeout_s + 10.0)
        try:
            warmed = await self._race(self._warm(w, sizes))
        except warmup.WarmupFailed as exc:
            return self.trigger(TriggerKind.WARMUP_FAILED, str(exc))
        if warmed is not None:
            return warmed
        self.ready_at = t_ready = self.host.monotonic()
        assert self.healthy_at is not None
        self._timings = {"start_to_healthy_s": round(self.healthy_at - self.started_at, 3),
                         "warmup_s": round(t_ready - self.healthy_at, 3),
                         "start_to_ready_s": round(t_ready - self.started_at, 3)}
        phases = startup.phases(self.started_at, self.spawned_at, self.steps, self.healthy_at, t_ready)
        return Ready(self._timings, phases, tuple(sizes), self.engine_version, self.from_standby)

    async def _warm(self, w: WarmupConfig, sizes: list[int]) -> None:
        await warmup.run(self.client, sizes, w)

    # ---- READY ----------------------------------------------------------------------------------
    async def serve(self) -> Trigger:
        """Watch the serving engine until a trigger ends the run."""
        assert self.liveness is not None
        self.liveness.ready(self.host.monotonic())
        self._expect(self._probe_bound())
        ended = await self._race(self._monitor())
        assert ended is not None
        return ended

    def _probe_bound(self) -> float:
        h = self.cfg.health
        return h.probe_interval_s + 2 * min(h.hang_timeout_s, 5.0) + 10.0

    @property
    def idle(self) -> bool:
        return self.liveness is not None and not self.liveness.pending

    async def _monitor(self) -> Trigger:
        h = self.cfg.health
        live = self.liveness
        assert self.child is not None and live is not None
        probe_timeout = min(h.hang_timeout_s, 5.0)
        bad_health = 0
        try:
            while True:
                await self.host.sleep(h.probe_interval_s)
                self._expect(self._probe_bound())
                now = self.host.monotonic()
                self.host.tree_pids(self.child)
                if await self.client.health(timeout=probe_timeout) == 503:
                    bad_health += 1
                    if bad_health >= h.unhealthy_probes:
                        return self.trigger(TriggerKind.DEATH, f"/health returned 503 {bad_health} times in a row")
                else:
                    bad_health = 0
                try:
                    progress = await self.client.metrics(timeout=probe_timeout)
                except EngineError:
                    progress = None
                hang = live.metrics(self.host.monotonic(), progress) or live.canary_overdue(self.host.monotonic())
                if hang:
                    return self.trigger(TriggerKind.HANG, hang)
                if live.canary_due(now):
                    live.canary_sent(now)
                    self._canary = asyncio.create_task(self._send_canary(live))
        finally:
            if self._canary is not None:
                self._canary.cancel()

    async def _send_canary(self, live: Liveness) -> None:
        h = self.cfg.health
        try:
            # The rule decides "no answer" from the clock; the request's own timeout only bounds it.
            await self.client.complete("Hello", h.canary_max_tokens, timeout=h.hang_timeout_s * 2,
                                       request_id=f"canary-{self.number}-{int(self.host.wall())}")
        except EngineStatusError as exc:
            self.publish(CanaryFailed(at=self.host.wall(), status=exc.status, error=str(exc)))
        except EngineError:
            return  # no answer: the liveness rule fires on the clock
        live.canary_done()

    # ---- the end ------------------------------------------------------------------------------------
    async def conclude(self, trigger: Trigger) -> Verdict:
        """Gather the evidence, stop the whole tree, and classify (unplanned ends only)."""
        self._ending = True
        phase = self.phase
        child = self.child
        if child is not None:
            self.host.tree_pids(child)
        rc: int | None = child.proc.returncode if child else None
        if trigger.kind is TriggerKind.DEATH and child is not None and rc is None:
            # vLLM exits by itself within seconds of its engine dying; let it finish logging.
            self._expect(self.cfg.engine.dead_grace_s + 5.0)
            with contextlib.suppress(asyncio.TimeoutError):
                rc = await asyncio.wait_for(child.wait_exit(), self.cfg.engine.dead_grace_s)
        stacks: dict[int, str] = {}
        if trigger.kind is TriggerKind.HANG and child is not None:
            self._expect(30.0)
            stacks = await self.host.dump_stacks(self.host.tree_pids(child))
            if not stacks:
                self.publish(NoStackDump(at=self.host.wall()))
        report = await self.stop(planned=trigger.kind.planned)
        failure = None
        if not trigger.kind.planned:
            failure = trigger.failure or classify(
                events=list(self.events), lines=self.tail.snapshot(), exit=ExitInfo(rc), phase=phase,
                trigger=trigger.evidence, hang=trigger.evidence if trigger.kind is TriggerKind.HANG else None)
        return Verdict(trigger, failure, phase, rc, report, stacks, self._evidence())

    def stop_bound(self, planned: bool) -> float:
        e = self.cfg.engine
        grace = e.stop_timeout_s if planned else e.failed_stop_timeout_s
        return grace + e.kill_timeout_s + DRAIN_S + self.cfg.gpu.release_timeout_s + 10.0

    async def stop(self, planned: bool) -> StopReport | None:
        """Kill the whole tree, drain the pipes, wait for GPU memory to be released."""
        self._ending = True
        self._expect(self.stop_bound(planned))
        child = self.child
        report = None
        if child is not None:
            e = self.cfg.engine
            t0 = self.host.monotonic()
            # A dead or hung engine has nothing to finish: a short grace, then SIGKILL. vLLM's API server
            # ignores SIGTERM while its start is failing, and multiprocessing's resource tracker always does.
            grace = e.stop_timeout_s if planned else e.failed_stop_timeout_s
            report = await self.host.terminate_tree(child, grace, e.kill_timeout_s)
            t1 = self.host.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*self._tasks[:2], return_exceptions=True), DRAIN_S)
            t2 = self.host.monotonic()
            await self._wait_gpu_released(report.pids)
            self.publish(EngineStopped(at=self.host.wall(), pids=report.pids, sigkilled=report.killed,
                                       survivors=report.survivors, returncode=report.returncode,
                                       kill_s=round(t1 - t0, 3), drain_s=round(t2 - t1, 3),
                                       gpu_release_s=round(self.host.monotonic() - t2, 3), planned=planned))
        await self.close()
        return report

    async def _wait_gpu_released(self, pids: tuple[int, ...]) -> None:
        timeout = self.cfg.gpu.release_timeout_s
        try:
            held = await self.host.wait_gpu_released(pids, timeout)
        except GpuLost as exc:
            self.publish(GpuLostEvent(at=self.host.wall(), error=str(exc)))
            return
        if held:
            self.publish(GpuNotReleased(at=self.host.wall(), held={str(k): v for k, v in held.items()},
                                        timeout_s=timeout))

    async def shutdown(self) -> None:
        """The supervisor is exiting: a planned stop of a live engine, else just release what the run holds."""
        if self.child is not None and self.child.proc.returncode is None:
            await self.stop(planned=True)
        else:
            await self.close()

    async def close(self) -> None:
        """Release what the run holds (idempotent)."""
        self._ending = True
        for t in self._tasks:
            t.cancel()
        if self._canary is not None:
            self._canary.cancel()
        self.server.close()
        await self.client.close()

    def _evidence(self) -> dict[str, Any]:
        """What went into the verdict, for the incident bundle (secrets masked by the writer)."""
        events, lines = list(self.events), self.tail.snapshot()
        return {"requests_in_batch": batch(lines, events), "engine_version": self.engine_version,
                "events": events[-100:], "log_tail": lines[-400:], "timings": self._timings,
                "versions": {"vllm_supervisor": __version__, "python": platform.python_version(),
                             "vllm": self.engine_version},
                "argv": launch.masked(launch.build_argv(self.cfg.engine, self.profile), self.secrets)}
