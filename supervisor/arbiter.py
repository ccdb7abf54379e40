"""The arbiter: the only writer of the engine state; spawns, watches, classifies, restarts.

Everything that can end an engine's life (its exit, a death message on IPC or in its logs,
a hang seen by the probes, a stop request, a planned climb) becomes a Trigger on one queue.
Each phase of a start races its own work against that queue, so the first trigger wins and
nothing is polled for luck. Signal handlers only enqueue; the loop acts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO, TypeVar

import psutil
import structlog

from supervisor import incident, ipc, launch, leftovers, statefile, warmup
from supervisor.admin import AdminServer, make_app
from supervisor.classify import ExitInfo, classify, death_evidence, event_texts, fraction_that_fits
from supervisor.config import Config
from supervisor.gpu import DeviceSnapshot
from supervisor.lifecycle import EngineState, ExitCode, Failure, FailureKind, Phase, check_transition
from supervisor.logtail import LogTail
from supervisor.metrics import Metrics
from supervisor.notify import Notifier
from supervisor.policy import Policy, clamp_to_configured
from supervisor.probe import EngineClient, EngineError, ProgressWatch
from supervisor.proctree import Child, StopReport

log = structlog.get_logger("supervisor.arbiter")
S = EngineState
T = TypeVar("T")
GIB = 2**30


class Host(Protocol):
    """The OS seam (see supervisor.host.RealHost)."""

    def monotonic(self) -> float: ...
    def wall(self) -> float: ...
    async def sleep(self, seconds: float) -> None: ...
    async def spawn(self, argv: list[str], env: dict[str, str]) -> Child: ...
    async def terminate_tree(self, child: Child, grace_s: float, kill_wait_s: float) -> StopReport: ...
    def tree_pids(self, child: Child) -> set[int]: ...
    def create_time(self, pid: int) -> float: ...
    async def stop_leftover(self, sid: int, born_after: float, grace_s: float, kill_wait_s: float) -> list[int]: ...
    def gpu_snapshot(self) -> list[DeviceSnapshot]: ...
    async def wait_gpu_released(self, pids: Any, timeout_s: float) -> dict[int, int]: ...
    async def wait_gpu_free(self, indices: Any, fraction: float, headroom: int,
                            timeout_s: float) -> list[DeviceSnapshot]: ...
    async def dump_stacks(self, pids: Any, timeout_s: float = 20.0) -> dict[int, str]: ...


@dataclass(frozen=True)
class Trigger:
    """Why the current engine's life is ending."""

    kind: str  # exit | death | hang | warmup_failed | spawn_failed | gpu_short | stop | climb
    evidence: str
    at: float  # wall clock, for detection latency
    at_mono: float
    # Set when the trigger already is the verdict (nothing ran that left logs to classify).
    failure: Failure | None = None


class Arbiter:
    def __init__(self, cfg: Config, host: Host, *, notifier: Notifier | None = None,
                 echo: TextIO | None = None, install_signals: bool = True,
                 client: EngineClient | None = None) -> None:
        self.cfg = cfg
        self.host = host
        self.notifier = notifier or Notifier()
        self.echo = echo
        self.install_signals = install_signals
        learned = statefile.load(cfg.state.dir)
        self.profile = clamp_to_configured(learned.profile, cfg.profile) if learned else cfg.profile
        if learned and self.profile != cfg.profile:
            log.info("engine.profile_restored", profile=self.profile.knobs(),
                     below_configured=cfg.profile.diff(self.profile))
        self.policy = Policy(cfg.restart, cfg.ladder, cfg.profile,
                             rung_failures=dict(learned.rung_failures) if learned else {})
        self.restarts_total = learned.restarts_total if learned else 0
        self.last_failure: dict[str, Any] | None = learned.last_failure if learned else None
        self.state = S.STOPPED
        self.state_since = host.monotonic()
        self.started_mono = host.monotonic()
        self.restarts = 0
        self.history: deque[dict[str, Any]] = deque(maxlen=50)
        self.child: Child | None = None
        self.tail = LogTail(cfg.log.tail_lines)
        self.events: deque[dict[str, Any]] = deque(maxlen=1000)
        self.client = client or EngineClient(cfg.engine.base_url)
        self.ready_once = False
        self.ready_at: float | None = None
        self.timings: dict[str, float] = {}
        self._triggers: asyncio.Queue[Trigger] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._starts = 0
        self._phase = Phase.LOADING
        self._run_dir: Path | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._loop_beat = host.monotonic()
        self.metrics = Metrics()
        self._outage_since: float | None = None
        self.metrics.set_profile(self.profile)

    # ---- state -------------------------------------------------------------------------------
    def change_state(self, new: EngineState, **info: Any) -> None:
        """The only place the engine state changes: checked, logged, announced."""
        check_transition(self.state, new)
        old, self.state = self.state, new
        now = self.host.monotonic()
        self.history.append({"from": old.value, "to": new.value, "at": self.host.wall(), **_jsonable(info)})
        log.info("engine.state_changed", **{"from": old.value, "to": new.value}, **info,
                 after_s=round(now - self.state_since, 3))
        self.state_since = now
        self.metrics.transition(old, new)
        self.notifier.status(self.status_line())

    def status_line(self) -> str:
        p = self.profile
        return (f"{self.state.value} chunk={p.max_num_batched_tokens} seqs={p.max_num_seqs} "
                f"util={p.gpu_memory_utilization:g} restarts={self.restarts}")

    def status(self) -> dict[str, Any]:
        """The /status document (docs/interface.md)."""
        return {
            "state": self.state.value,
            "ready": self.state is S.READY,
            "profile": self.profile.knobs(),
            "configured_profile": self.cfg.profile.knobs(),
            "restarts": self.restarts,
            "restarts_total": self.restarts_total,
            "last_failure": self.last_failure,
            "engine_pid": self.child.pid if self.child and self.child.proc.returncode is None else None,
            "engine_url": self.cfg.engine.base_url,
            "state_for_s": round(self.host.monotonic() - self.state_since, 3),
            "uptime_s": round(self.host.monotonic() - self.started_mono, 3),
            "timings": self.timings,
            "history": list(self.history)[-20:],
        }

    # ---- triggers ------------------------------------------------------------------------------
    def _trigger_now(self, kind: str, evidence: str, failure: Failure | None = None) -> Trigger:
        return Trigger(kind, evidence, self.host.wall(), self.host.monotonic(), failure)

    def trigger(self, kind: str, evidence: str) -> None:
        self._triggers.put_nowait(self._trigger_now(kind, evidence))

    def request_stop(self, why: str = "stop requested") -> None:
        if not self._stop.is_set():
            log.info("supervisor.stop_requested", reason=why)
            self.notifier.stopping()
            self._stop.set()
            self.trigger("stop", why)

    def _on_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        if self.state in (S.STARTING, S.WARMING, S.READY, S.DRAINING):
            for text in event_texts([event]):
                found = death_evidence(text)
                if found:
                    self.trigger("death", found)
                    return

    def _on_line(self, line: str) -> None:
        if self.state in (S.STARTING, S.WARMING, S.READY, S.DRAINING):
            found = death_evidence(line)
            if found:
                self.trigger("death", found)

    async def _race(self, work: Awaitable[T]) -> T | Trigger:
        """Run ``work`` until it finishes or a trigger arrives, whichever is first."""
        task = asyncio.ensure_future(work)
        getter = asyncio.ensure_future(self._triggers.get())
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

    # ---- main loop -------------------------------------------------------------------------------
    async def run(self) -> int:
        """Supervise until asked to stop (0) or FATAL (non-zero ExitCode)."""
        loop = asyncio.get_running_loop()
        if self.install_signals:
            loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM")
            loop.add_signal_handler(signal.SIGINT, self.request_stop, "SIGINT")
        # systemd's RuntimeDirectory= when there is one: private, and removed with the unit.
        self._run_dir = Path(tempfile.mkdtemp(prefix="vllm-supervisor-", dir=os.environ.get("RUNTIME_DIRECTORY")))
        host, port = self.cfg.admin.host_port
        admin = AdminServer(make_app(self.status, self._loop_alive, self.metrics.render), host, port)
        await admin.start()
        log.info("supervisor.started", admin=self.cfg.admin.listen, engine=self.cfg.engine.base_url,
                 profile=self.profile.knobs(), state_dir=self.cfg.state.dir)
        self._tasks.append(asyncio.create_task(self._heartbeat()))
        try:
            await self._stop_leftover_engine()
            return await self._lifecycle()
        finally:
            for t in self._tasks:
                t.cancel()
            if self.child is not None and self.child.proc.returncode is None:
                await self.host.terminate_tree(self.child, self.cfg.engine.stop_timeout_s,
                                               self.cfg.engine.kill_timeout_s)
            leftovers.clear(self.cfg.state.dir)
            await self.client.close()
            await admin.close()
            shutil.rmtree(self._run_dir, ignore_errors=True)
            if self.install_signals:
                loop.remove_signal_handler(signal.SIGTERM)
                loop.remove_signal_handler(signal.SIGINT)

    async def _lifecycle(self) -> int:
        while True:
            trigger = await self._run_engine()
            if trigger.kind == "stop":
                await self._stop_engine(trigger)
                self.change_state(S.STOPPED, reason=trigger.evidence)
                return ExitCode.OK
            if trigger.kind == "climb":
                await self._climb(trigger)
                continue
            failure = await self._handle_failure(trigger)
            decision = self.policy.on_failure(failure, self.profile, self.host.monotonic())
            if not decision.restart:
                self.change_state(S.FATAL, reason=decision.reason, exit_code=int(decision.exit_code))
                log.error("supervisor.fatal", reason=decision.reason, exit_code=int(decision.exit_code),
                          failure=failure.as_dict())
                self._persist()
                return decision.exit_code
            if decision.profile != self.profile:
                log.warning("engine.profile_lowered", diff=self.profile.diff(decision.profile),
                            kind=failure.kind.value, evidence=failure.evidence)
            self.profile = decision.profile
            self.metrics.set_profile(self.profile)
            self.metrics.restarts.inc()
            self.restarts += 1
            self.restarts_total += 1
            self._persist()
            self.change_state(S.BACKOFF, delay_s=round(decision.delay_s, 3), reason=decision.reason)
            if await self._sleep_or_stop(decision.delay_s):
                self.change_state(S.STOPPED, reason="stop requested during backoff")
                return ExitCode.OK

    async def _sleep_or_stop(self, seconds: float) -> bool:
        """Sleep ``seconds`` on the host's clock; True if a stop was requested meanwhile."""
        sleeper = asyncio.ensure_future(self.host.sleep(seconds))
        stopper = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for t in (sleeper, stopper):
            t.cancel()
        return self._stop.is_set()

    # ---- one engine's life ---------------------------------------------------------------------------
    async def _run_engine(self) -> Trigger:
        self._triggers = asyncio.Queue()
        self.child = None
        if self._stop.is_set():
            self.trigger("stop", "stop requested")
        self._starts += 1
        self._phase = Phase.LOADING
        self.events = deque(maxlen=1000)
        self.client.model = None
        t_start = self.host.monotonic()
        argv = launch.build_argv(self.cfg.engine, self.profile)
        self.change_state(S.STARTING, start=self._starts, profile=self.profile.knobs())
        if not self.ready_once:
            self.notifier.extend_timeout(self.cfg.engine.start_timeout_s + self.cfg.warmup.timeout_s)

        gated = await self._race(self._gpu_gate())
        if gated is not None:
            return gated
        assert self._run_dir is not None
        run_dir = self._run_dir / f"start-{self._starts}"
        sock = run_dir / "events.sock"
        ipc_env = ipc.prepare_child_env(run_dir, str(sock))
        server = ipc.EventServer(sock, self._on_event)
        await server.start()
        env = launch.build_env(self.cfg.engine, ipc_env, str(run_dir))
        try:
            self.child = await self.host.spawn(argv, env)
        except OSError as exc:
            server.close()
            evidence = f"could not start the engine command {argv[0]!r}: {exc}"
            return self._trigger_now("spawn_failed", evidence, Failure(FailureKind.CONFIG_ERROR, evidence))
        self._server = server
        log.info("engine.spawned", pid=self.child.pid, argv=argv)
        try:
            leftovers.write(self.cfg.state.dir, leftovers.EngineRecord(
                self.child.sid, self.host.create_time(self.child.pid), os.getpid()))
        except (OSError, psutil.Error) as exc:
            log.warning("state.engine_record_failed", error=str(exc))
        self.tail = LogTail(self.cfg.log.tail_lines, on_line=self._on_line, echo=self.echo)
        child = self.child
        assert child.proc.stdout is not None and child.proc.stderr is not None
        self._drains = [asyncio.create_task(self.tail.drain(child.proc.stdout)),
                        asyncio.create_task(self.tail.drain(child.proc.stderr))]
        self._exit_watch = asyncio.create_task(self._watch_exit(child))

        healthy = await self._race(self._wait_healthy())
        if isinstance(healthy, Trigger):
            return healthy
        self._phase = Phase.SERVING
        # EngineCore and workers exist by now: remember them, they are the GPU memory holders.
        self.host.tree_pids(self.child)
        t_healthy = self.host.monotonic()
        self.change_state(S.WARMING, healthy_after_s=round(t_healthy - t_start, 3))
        sizes = warmup.plan(self.profile, self.cfg.warmup)
        try:
            warmed = await self._race(warmup.run(self.client, sizes, self.cfg.warmup))
        except warmup.WarmupFailed as exc:
            return self._trigger_now("warmup_failed", str(exc))
        if isinstance(warmed, Trigger):
            return warmed
        t_ready = self.host.monotonic()
        self.timings = {"start_to_healthy_s": round(t_healthy - t_start, 3),
                        "warmup_s": round(t_ready - t_healthy, 3),
                        "start_to_ready_s": round(t_ready - t_start, 3)}
        self.change_state(S.READY, warmup_prompts=sizes, **self.timings)
        self.metrics.start.set(t_ready - t_start)
        self.ready_at = t_ready
        if not self.ready_once:
            self.ready_once = True
            self.notifier.ready(self.status_line())
        if self._outage_since is not None and self.last_failure is not None:
            # From the first failure of this outage, however many failed starts followed it.
            self.last_failure["recovered_after_s"] = round(t_ready - self._outage_since, 3)
            self.metrics.recovery.set(t_ready - self._outage_since)
            log.info("engine.recovered", kind=self.last_failure.get("kind"),
                     recovered_after_s=self.last_failure["recovered_after_s"], profile=self.profile.knobs())
            self._outage_since = None
        monitor = asyncio.create_task(self._monitor())
        try:
            return await self._triggers.get()
        finally:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor

    async def _stop_leftover_engine(self) -> None:
        """An engine left by a supervisor that died holds the port and the GPU: stop it first."""
        rec = leftovers.read(self.cfg.state.dir)
        if rec is None or rec.supervisor_pid == os.getpid():
            return
        pids = await self.host.stop_leftover(rec.sid, rec.create_time, self.cfg.engine.failed_stop_timeout_s,
                                             self.cfg.engine.kill_timeout_s)
        if pids:
            log.warning("engine.leftover_stopped", pids=pids, sid=rec.sid,
                        hint="a previous supervisor died without stopping its engine")
            await self._wait_gpu_released(pids)
        leftovers.clear(self.cfg.state.dir)

    async def _gpu_gate(self) -> Trigger | None:
        """Before a start: wait (bounded) until the devices have the memory vLLM will ask for.

        Still short after ``free_wait_s``: vLLM's own start check would fail a minute into
        loading, so the start is failed here, with NVML's numbers as evidence.
        """
        indices = launch.visible_devices({**self.cfg.engine.env})
        util = self.profile.gpu_memory_utilization
        headroom = int(self.cfg.gpu.start_headroom_gib * GIB)
        short = await self.host.wait_gpu_free(indices, util, headroom, self.cfg.gpu.free_wait_s)
        if not short:
            return None
        s = min(short, key=lambda d: d.free / d.total)
        holders = ", ".join(f"pid {pid} ({used / GIB:.2f} GiB)" for pid, used in s.processes) or "unknown"
        evidence = (f"GPU {s.index}: {s.free / GIB:.2f} of {s.total / GIB:.2f} GiB free after waiting "
                    f"{self.cfg.gpu.free_wait_s:g}s, below gpu_memory_utilization {util:g} + "
                    f"{self.cfg.gpu.start_headroom_gib:g} GiB headroom; held by {holders}")
        log.warning("gpu.not_enough_free", devices=[d.as_dict() for d in short], evidence=evidence)
        return self._trigger_now("gpu_short", evidence, Failure(
            FailureKind.STARTUP_MEMORY, evidence, knob="gpu_memory_utilization",
            suggested=fraction_that_fits(max(0, s.free - headroom), s.total)))

    async def _watch_exit(self, child: Child) -> None:
        rc = await child.wait_exit()
        self.trigger("exit", f"API server {ExitInfo(rc).describe()}")

    async def _wait_healthy(self) -> None:
        deadline = self.host.monotonic() + self.cfg.engine.start_timeout_s
        delay = 0.05
        while True:
            if await self.client.health(timeout=2.0) == 200:
                return
            if self.host.monotonic() > deadline:
                self.trigger("hang", f"engine not healthy within start_timeout_s={self.cfg.engine.start_timeout_s:g}s")
                await asyncio.Event().wait()
            await self.host.sleep(delay)
            delay = min(0.5, delay * 1.5)

    async def _monitor(self) -> None:
        """While READY: health, token progress, idle canary, and the climb timer."""
        h = self.cfg.health
        watch = ProgressWatch(h.hang_timeout_s)
        bad_health = 0
        unresponsive_since: float | None = None
        last_canary = self.host.monotonic()
        canary: asyncio.Task[None] | None = None
        assert self.child is not None and self.ready_at is not None
        stable_noted = False
        try:
            while True:
                await self.host.sleep(h.probe_interval_s)
                now = self.host.monotonic()
                self.host.tree_pids(self.child)
                status = await self.client.health(timeout=min(h.hang_timeout_s, 5.0))
                if status == 503:
                    bad_health += 1
                    if bad_health >= h.unhealthy_probes:
                        self.trigger("death", f"/health returned 503 {bad_health} times in a row")
                        return
                else:
                    bad_health = 0
                try:
                    progress = await self.client.metrics(timeout=min(h.hang_timeout_s, 5.0))
                    unresponsive_since = None
                except Exception as exc:  # noqa: BLE001 - any failure is "no answer"
                    unresponsive_since = unresponsive_since or now
                    if now - unresponsive_since >= h.hang_timeout_s:
                        self.trigger("hang", f"/metrics unanswered for {now - unresponsive_since:.0f}s ({exc})")
                        return
                    continue
                hang = watch.observe(now, progress)
                if hang:
                    self.trigger("hang", hang)
                    return
                if not progress.pending and (canary is None or canary.done()) \
                        and now - last_canary >= h.canary_interval_s:
                    last_canary = now
                    canary = asyncio.create_task(self._canary())
                if not stable_noted and now - self.ready_at >= self.cfg.restart.window_s:
                    stable_noted = True
                    self.policy.on_stable()
                    log.info("engine.stable", ready_for_s=round(now - self.ready_at, 1))
                if self.cfg.ladder.climb_after_s and now - self.ready_at >= self.cfg.ladder.climb_after_s \
                        and not progress.pending:
                    target = self.policy.climb_target(self.profile)
                    if target is not None:
                        self._climb_to = target
                        self.trigger("climb", f"stable for {now - self.ready_at:.0f}s")
                        return
        finally:
            if canary is not None:
                canary.cancel()

    async def _canary(self) -> None:
        h = self.cfg.health
        t0 = self.host.monotonic()
        try:
            await self.client.complete("Hello", h.canary_max_tokens, timeout=h.hang_timeout_s,
                                       request_id=f"canary-{int(time.time())}")
        except EngineError as exc:
            if "no answer" in str(exc):
                self.trigger("hang", f"canary generation ({h.canary_max_tokens} token) gave no answer "
                                     f"within hang_timeout_s={h.hang_timeout_s:g}s")
            else:
                log.warning("engine.canary_failed", error=str(exc))
            return
        log.debug("engine.canary_ok", seconds=round(self.host.monotonic() - t0, 3))

    # ---- stopping ------------------------------------------------------------------------------------
    async def _stop_engine(self, trigger: Trigger) -> StopReport | None:
        """STOPPING: kill the whole tree, drain the pipes, wait for GPU memory to be released."""
        self.change_state(S.STOPPING, reason=trigger.kind, evidence=trigger.evidence)
        child = self.child
        if child is None:
            return None
        t0 = self.host.monotonic()
        # A dead or hung engine has nothing to finish: a short grace, then SIGKILL. vLLM's API server
        # ignores SIGTERM while its start is failing, and multiprocessing's resource tracker always does.
        planned = trigger.kind in ("stop", "climb")
        grace = self.cfg.engine.stop_timeout_s if planned else self.cfg.engine.failed_stop_timeout_s
        report = await self.host.terminate_tree(child, grace, self.cfg.engine.kill_timeout_s)
        t1 = self.host.monotonic()
        # With every holder of the pipes gone they reach EOF; bounded in case a grandchild escaped.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._drains, return_exceptions=True), 5.0)
        t2 = self.host.monotonic()
        for t in (*self._drains, self._exit_watch):
            t.cancel()
        self._server.close()
        await self._wait_gpu_released(report.pids)
        log.info("engine.stopped", pids=list(report.pids), sigkilled=list(report.killed),
                 survivors=list(report.survivors), returncode=report.returncode, kill_s=round(t1 - t0, 3),
                 drain_s=round(t2 - t1, 3), gpu_release_s=round(self.host.monotonic() - t2, 3))
        return report

    async def _wait_gpu_released(self, pids: tuple[int, ...] | list[int]) -> None:
        """Bounded wait until NVML shows none of ``pids`` holding GPU memory; an error event if not."""
        held = await self.host.wait_gpu_released(pids, self.cfg.gpu.release_timeout_s)
        if held:
            log.error("gpu.not_released", held={str(k): v for k, v in held.items()},
                      timeout_s=self.cfg.gpu.release_timeout_s)

    async def _handle_failure(self, trigger: Trigger) -> Failure:
        log.warning("engine.failure_detected", trigger=trigger.kind, evidence=trigger.evidence,
                    state=self.state.value)
        if self._outage_since is None:
            self._outage_since = trigger.at_mono
        phase = self._phase
        if self.child is not None:
            self.host.tree_pids(self.child)
        rc_before: int | None = self.child.proc.returncode if self.child else None
        if trigger.kind == "death" and self.child is not None and rc_before is None:
            # vLLM exits by itself within seconds of its engine dying; let it finish logging.
            with contextlib.suppress(asyncio.TimeoutError):
                rc_before = await asyncio.wait_for(self.child.wait_exit(), self.cfg.engine.dead_grace_s)
        stacks: dict[int, str] = {}
        if trigger.kind == "hang" and self.child is not None:
            stacks = await self.host.dump_stacks(self.host.tree_pids(self.child))
            if not stacks:
                log.info("engine.no_stack_dump", hint="install py-spy to capture stacks of a hung engine")
        report = await self._stop_engine(trigger)
        failure = trigger.failure or classify(
            events=list(self.events), lines=self.tail.snapshot(), exit=ExitInfo(rc_before), phase=phase,
            trigger=trigger.evidence, hang=trigger.evidence if trigger.kind == "hang" else None)
        detection = round(trigger.at_mono - self.state_since, 3)
        self.last_failure = {**failure.as_dict(), "detected_at": trigger.at,
                             "trigger": trigger.kind, "phase": phase.value, "profile": self.profile.knobs()}
        self.metrics.failures.labels(failure.kind.value).inc()
        log.warning("engine.failed", kind=failure.kind.value, evidence=failure.evidence, trigger=trigger.kind,
                    phase=phase.value, returncode=rc_before, suspect_request=failure.suspect_request)
        try:
            path = incident.write(self.cfg.state.dir, failure.kind.value, {
                "failure": failure.as_dict(), "trigger": trigger.__dict__, "phase": phase.value,
                "profile": self.profile.knobs(), "stop": report.__dict__ if report else None,
                "gpu": [s.as_dict() for s in self.host.gpu_snapshot()], "stacks": stacks,
                "events": list(self.events)[-100:], "log_tail": self.tail.snapshot()[-400:],
                "detected_after_state_s": detection,
            })
            self.last_failure["incident"] = str(path)
        except OSError as exc:
            log.error("incident.write_failed", error=str(exc))
        return failure

    async def _climb(self, trigger: Trigger) -> None:
        target = self._climb_to
        self.change_state(S.DRAINING, reason="climb", target=target.knobs())
        await self._stop_engine(trigger)
        log.info("engine.profile_raised", diff=self.profile.diff(target), reason=trigger.evidence)
        self.profile = target
        self.metrics.set_profile(self.profile)
        self._persist()

    def _persist(self) -> None:
        try:
            statefile.save(self.cfg.state.dir, statefile.Learned(
                self.profile, dict(self.policy.rung_failures),
                self.last_failure,
                self.restarts_total))
        except OSError as exc:
            log.error("state.save_failed", dir=self.cfg.state.dir, error=str(exc))

    async def _heartbeat(self) -> None:
        """Pets systemd's watchdog only while this loop keeps turning."""
        interval = self.notifier.watchdog_interval_s or 1.0
        while True:
            self._loop_beat = self.host.monotonic()
            if self.notifier.watchdog_interval_s:
                self.notifier.watchdog()
            await asyncio.sleep(interval)

    def _loop_alive(self) -> bool:
        return self.host.monotonic() - self._loop_beat < 10.0


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v))
            for k, v in info.items()}


