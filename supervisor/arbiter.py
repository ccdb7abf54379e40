"""The supervisor: the only writer of the engine state, the profile, the counters and what is learned.

It runs one EngineRun after another (supervisor.engine.run: one start of vLLM, ending with a
verdict), asks the policy what a verdict means, and publishes every change once on the event
stream, where logging, metrics, the systemd notifier, the /status history and the state file
read it. Signal handlers only set intent; the loop acts.

The loop proves its own progress: it waits on each step in slices of TICK_S, and each slice pets
systemd's watchdog only while the step is within the deadline it announced. A step stuck past
its bound stops the petting, and systemd restarts us; /healthz answers from the same beat.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import platform
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO, TypeVar

import structlog

from supervisor import config as config_mod
from supervisor.about import __version__
from supervisor.config import Config, ConfigError
from supervisor.decide.policy import Policy, clamp_to_configured
from supervisor.engine import launch
from supervisor.engine.next_start import NextStart
from supervisor.engine.run import EngineRun, Trigger, Verdict
from supervisor.engine_states import EngineState, ExitCode, Failure, TriggerKind, check_transition
from supervisor.event_stream import (
    Event,
    EventBus,
    FailureClassified,
    FailureDetected,
    Fatal,
    LearnedChanged,
    PlannedRestart,
    ProfileLowered,
    ProfileRaised,
    ProfileRestored,
    Recovered,
    Reloaded,
    ReloadFailed,
    Reloading,
    Stable,
    StateChanged,
    StopRequested,
    SupervisorStarted,
)
from supervisor.gateway.server import COUNTERS, EngineView, Gateway
from supervisor.host import Host, leftovers
from supervisor.host.gpu import GpuLost, short_of
from supervisor.host.vllm_http import EngineClient
from supervisor.ops import control, incident, statefile
from supervisor.ops.admin import AdminServer, make_app, metrics_app
from supervisor.ops.alerts.channels import MissingSecret
from supervisor.ops.alerts.dispatch import Alerts
from supervisor.ops.control import ControlServer
from supervisor.ops.history import History
from supervisor.ops.logs import log_event
from supervisor.ops.metrics import Metrics
from supervisor.ops.notify import Notifier
from supervisor.profile import Knob, Profile

log = structlog.get_logger("supervisor.arbiter")
S = EngineState
T = TypeVar("T")
TICK_S = 1.0  # the loop's heartbeat: watchdog petting, /healthz, the READY checks (stable, climb)
STUCK_SLACK_S = 10.0
HEALTHZ_STALE_S = 3 * TICK_S + 2.0
GPU_POLL_S = 10.0


class Supervisor:
    def __init__(self, cfg: Config, host: Host, *, notifier: Notifier | None = None,
                 echo: TextIO | None = None, install_signals: bool = True,
                 client_factory: Callable[[], EngineClient] | None = None, config_path: str | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.host = host
        self.echo = echo
        self.install_signals = install_signals
        self.client_factory = client_factory
        learned = statefile.load(cfg.state.dir)
        self.profile = clamp_to_configured(learned.profile, cfg.profile) if learned else cfg.profile
        self.policy = Policy(cfg.restart, cfg.ladder, cfg.profile,
                             rung_failures=dict(learned.rung_failures) if learned else {})
        self.restarts_total = learned.restarts_total if learned else 0
        self.last_failure: dict[str, Any] | None = learned.last_failure if learned else None
        self.restarts = 0
        self.state = S.STOPPED
        self.state_since = self.started_mono = self._beat_at = host.monotonic()
        self.starts = 0
        self.engine_run: EngineRun | None = None
        self.timings: dict[str, Any] = {}
        self.outage_since: float | None = None
        self.ready_at: float | None = None
        self.stable_noted = False
        self.climb_to: Profile | None = None
        self.idle_since: float | None = None  # READY with nothing at the engine since (precompiles wait for it)
        self.restart_to: Profile | None = None  # a planned restart asked for (operator, reload), and its profile
        self._background: set[asyncio.Task[Any]] = set()
        self.stop_asked = asyncio.Event()
        self.secrets = cfg.engine.secrets()
        self.run_dir = Path()
        self._stuck_logged = False
        self.tick_s = TICK_S
        # The event stream and its subscribers.
        self.bus = EventBus()
        self.notifier = notifier or Notifier(cfg.engine.start_timeout_s + cfg.warmup.timeout_s)
        self.metrics = Metrics(self.profile.knobs(), cfg.profile.knobs())
        self.metrics.budget_from(lambda: self.policy.budget_left(self.host.monotonic()))
        self.history = History()
        self.bus.subscribe("log", log_event)
        self.bus.subscribe("metrics", self.metrics)
        self.bus.subscribe("notify", self.notifier)
        self.bus.subscribe("history", self.history)
        self.bus.subscribe("statefile", statefile.StateFileWriter(cfg.state.dir))
        # Raises MissingSecret (a configuration error) when a hook's secret is not in the environment.
        self.alerts = self._alerts_for(cfg)
        self.bus.subscribe("alerts", lambda ev: self.alerts(ev))  # a reload may replace self.alerts
        self.admin = AdminServer(make_app(self.status, self.loop_alive, self.metrics.render),
                                 *cfg.admin.host_port)
        # An optional listener with /metrics alone, for a central Prometheus (any address: it can change nothing).
        self.metrics_only = AdminServer(metrics_app(self.metrics.render), *cfg.admin.metrics_host_port) \
            if cfg.admin.metrics_listen else None
        # The public port, when [gateway] is configured: it reads the stream, and drains before planned stops.
        self.gateway = Gateway(cfg, host, self.publish, self._gateway_view) if cfg.gateway else None
        if self.gateway is not None:
            self.bus.subscribe("gateway", self.gateway.on_event)
            self.metrics.gateway_from(self.gateway.status, COUNTERS)
        self._gpu_poll: asyncio.Task[None] | None = None
        # Prepared while the engine serves, so that a restart is shorter than a cold start.
        self.next_start = NextStart(cfg, host, self.publish, self.policy.next_rungs)
        self.control = ControlServer(control.path_in(cfg.state.dir), self.control_command)

    # ---- publishing and state ----------------------------------------------------------------------
    def publish(self, event: Event) -> None:
        self.bus.publish(event)

    def change_state(self, new: EngineState, **info: Any) -> None:
        """The only place the engine state changes: checked, then published once."""
        check_transition(self.state, new)
        old, self.state = self.state, new
        now = self.host.monotonic()
        self.publish(StateChanged(at=self.host.wall(), old=old.value, new=new.value,
                                  after_s=round(now - self.state_since, 3), profile=self.profile.knobs(),
                                  restarts=self.restarts, info=info))
        self.state_since = now

    def _learned(self) -> None:
        self.publish(LearnedChanged(at=self.host.wall(), profile=self.profile.as_dict(),
                                    rung_failures=dict(self.policy.rung_failures),
                                    last_failure=self.last_failure, restarts_total=self.restarts_total))

    def status(self) -> dict[str, Any]:
        """The /status document (docs/interface.md)."""
        run = self.engine_run
        child = run.child if run else None
        return {
            "state": self.state.value,
            "ready": self.state is S.READY,
            "profile": self.profile.knobs(),
            "configured_profile": self.cfg.profile.knobs(),
            "restarts": self.restarts,
            "restarts_total": self.restarts_total,
            "failures_in_a_row": self.policy.in_a_row,
            "last_failure": self.last_failure,
            "engine_pid": child.pid if child and child.proc.returncode is None else None,
            "engine_url": self.cfg.engine.base_url,
            "start": self.starts,
            "phase": run.phase.value if run else None,
            "startup": self._startup(run),
            "engine_version": run.engine_version if run else None,
            "degraded": self.profile.knobs() != self.cfg.profile.knobs(),
            "state_for_s": round(self.host.monotonic() - self.state_since, 3),
            "uptime_s": round(self.host.monotonic() - self.started_mono, 3),
            "timings": self.timings,
            "history": self.history.last(20),
            "event_stream": self.bus.counters(),
            "next_start": self.next_start.status(),
            **({"gateway": self.gateway.status()} if self.gateway else {}),
        }

    def _gateway_view(self) -> EngineView:
        run = self.engine_run
        return EngineView(self.profile.chunk(), self.profile.max_model_len,
                          (set(run.child.known_pids) if run and run.child else set()) | self.next_start.pids(),
                          float(self.timings.get("start_to_ready_s") or 30.0))

    def _startup(self, run: EngineRun | None) -> dict[str, Any] | None:
        """While starting: vLLM's own step (loading weights, compiling, ...) and for how long."""
        if run is None or self.state not in (S.STARTING, S.WARMING):
            return None
        now = self.host.monotonic()
        if self.state is S.WARMING:
            return {"step": "warming", "for_s": round(now - self.state_since, 1)}
        if run.startup_step is None:
            return {"step": "starting", "for_s": round(now - run.started_at, 1)}
        step, since = run.startup_step
        return {"step": step, "for_s": round(now - since, 1)}

    # ---- intent ----------------------------------------------------------------------------------------
    def request_stop(self, why: str = "stop requested") -> None:
        if self.stop_asked.is_set():
            return
        self.publish(StopRequested(at=self.host.wall(), reason=why))
        self.stop_asked.set()
        if self.gateway is not None:
            self.gateway.shutdown()
        if self.engine_run is not None:
            self.engine_run.end(TriggerKind.STOP, why)

    # ---- the loop's heartbeat ---------------------------------------------------------------------------
    def _beat(self) -> None:
        self._beat_at = self.host.monotonic()
        self._stuck_logged = False
        if self.notifier.watchdog_interval_s:
            self.notifier.watchdog()

    def loop_alive(self) -> bool:
        return self.host.monotonic() - self._beat_at < HEALTHZ_STALE_S

    async def _wait(self, work: Awaitable[T], deadline: Callable[[], float],
                    on_tick: Callable[[], Awaitable[None]] | None = None) -> T:
        """Await ``work`` in slices of TICK_S, beating while it is within ``deadline()``."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.tick_s)
                if done:
                    self._beat()
                    return task.result()
                if self.host.monotonic() <= deadline() + STUCK_SLACK_S:
                    self._beat()
                elif not self._stuck_logged:
                    self._stuck_logged = True
                    log.error("supervisor.stuck", state=self.state.value,
                              overdue_s=round(self.host.monotonic() - deadline(), 1),
                              hint="the watchdog is no longer petted; systemd will restart the supervisor")
                if on_tick is not None:
                    await on_tick()
        finally:
            if not task.done():
                task.cancel()

    def _within(self, seconds: float) -> Callable[[], float]:
        until = self.host.monotonic() + seconds
        return lambda: until

    # ---- main loop ---------------------------------------------------------------------------------------
    async def run(self) -> int:
        """Supervise until asked to stop (0) or FATAL (non-zero ExitCode)."""
        loop = asyncio.get_running_loop()
        if self.install_signals:
            loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM")
            loop.add_signal_handler(signal.SIGINT, self.request_stop, "SIGINT")
            loop.add_signal_handler(signal.SIGHUP, self._soon, self.reload)
        # systemd's RuntimeDirectory= when there is one: private, and removed with the unit.
        self.run_dir = Path(tempfile.mkdtemp(prefix="vllm-supervisor-", dir=os.environ.get("RUNTIME_DIRECTORY")))
        self.next_start.dir = self.run_dir
        await self.admin.start()
        if self.metrics_only is not None:
            await self.metrics_only.start()
        await self.control.start()
        if self.gateway is not None:
            await self.gateway.start()
        self.bus.start()
        self.alerts.start()
        self._gpu_poll = asyncio.create_task(self._poll_gpu())
        self.publish(SupervisorStarted(at=self.host.wall(), admin=self.cfg.admin.listen,
                                       engine=self.cfg.engine.base_url, profile=self.profile.knobs(),
                                       state_dir=self.cfg.state.dir))
        if self.profile != self.cfg.profile:
            self.publish(ProfileRestored(at=self.host.wall(), profile=self.profile.knobs(),
                                         below_configured=self.cfg.profile.diff(self.profile)))
        try:
            await self._stop_leftover_engine()
            return await self._lifecycle()
        finally:
            run = self.engine_run
            if run is not None:
                await run.stop(planned=True) if run.child and run.child.proc.returncode is None else await run.close()
            leftovers.clear(self.cfg.state.dir)
            await self.next_start.close()
            if self.gateway is not None:
                self.gateway.shutdown()  # whoever still waits (a FATAL end) gets 503 now, not a reset
                await self.gateway.close()
            if self._gpu_poll is not None:
                self._gpu_poll.cancel()
            await self.admin.close()
            if self.metrics_only is not None:
                await self.metrics_only.close()
            await self.control.close()
            for t in self._background:
                t.cancel()
            await self.bus.close()
            await self.alerts.close()  # bounded by [alerts] flush_s: a FATAL is paged before we exit
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self.install_signals:
                loop.remove_signal_handler(signal.SIGTERM)
                loop.remove_signal_handler(signal.SIGINT)
                loop.remove_signal_handler(signal.SIGHUP)

    async def _poll_gpu(self) -> None:
        """GPU memory per device for /metrics, every 10 s (NVML in a thread; a lost GPU is the gate's business)."""
        while True:
            with contextlib.suppress(GpuLost):
                self.metrics.set_gpu(await self.host.gpu_snapshot())
            await asyncio.sleep(GPU_POLL_S)

    async def _lifecycle(self) -> int:
        while True:
            await self.next_start.settled()  # a throwaway precompile engine is gone before any start
            self.starts += 1
            run = self.engine_run = EngineRun(self.cfg, self.host, self.profile, self.starts,
                                       self.run_dir / f"start-{self.starts}", self.publish, echo=self.echo,
                                       client=self.client_factory() if self.client_factory else None,
                                       standby=self.next_start.take_standby())
            if self.stop_asked.is_set():
                run.end(TriggerKind.STOP, "stop requested")
            trigger = await self._drive(run)
            self.next_start.give_back(run.standby)  # unused: the run ended before its spawn
            self.next_start.stop_precompile()  # the host is the next start's now
            if trigger.kind is TriggerKind.STOP:
                if self.gateway is not None:  # without one, nothing of the clients' passes through us to drain
                    await self._drain("stop")
                self.change_state(S.STOPPING, reason=trigger.kind.value, evidence=trigger.evidence)  # X -> STOPPING
                await self._wait(run.conclude(trigger), run.deadline_at)
                self.change_state(S.STOPPED, reason=trigger.evidence)  # STOPPING -> STOPPED
                return ExitCode.OK
            if trigger.kind in (TriggerKind.CLIMB, TriggerKind.RESTART):
                await self._planned(run, trigger)
                continue
            exit_code = await self._fail(run, trigger)
            if exit_code is not None:
                return exit_code

    async def _drive(self, run: EngineRun) -> Trigger:
        """STARTING -> WARMING -> READY, then serving until a trigger ends the run."""
        self.change_state(S.STARTING, start=self.starts, profile=self.profile.knobs())  # STOPPED|BACKOFF -> STARTING
        ended = await self._wait(run.start(), run.deadline_at)
        if ended is not None:
            return ended
        assert run.healthy_at is not None
        self.change_state(S.WARMING, healthy_after_s=round(run.healthy_at - run.started_at, 3))
        ended = await self._wait(run.warm(), run.deadline_at)
        if ended is not None:
            return ended
        self.timings = {**run.timings, "phases": run.phases}
        self.change_state(S.READY, warmup_prompts=run.warmup_sizes, **self.timings)  # WARMING -> READY
        self._on_ready(run)
        self.next_start.note_compiled(self.profile, run.engine_version)
        self.next_start.want_standby(run.vllm_env)
        return await self._wait(run.serve(), run.deadline_at, on_tick=lambda: self._tick_ready(run))

    def _on_ready(self, run: EngineRun) -> None:
        assert run.ready_at is not None
        self.ready_at = run.ready_at
        self.stable_noted = False
        self.idle_since = None
        self.policy.on_ready()
        if self.outage_since is not None and self.last_failure is not None:
            # From the first failure of this outage, however many failed starts followed it.
            after = round(run.ready_at - self.outage_since, 3)
            self.last_failure["recovered_after_s"] = after
            self.publish(Recovered(at=self.host.wall(), kind=self.last_failure.get("kind"), recovered_after_s=after,
                                   profile=self.profile.knobs()))
            self._learned()
        self.outage_since = None

    async def _tick_ready(self, run: EngineRun) -> None:
        """Level-triggered checks while READY: a stable period, and the climb back one rung."""
        assert self.ready_at is not None
        ready_for = self.host.monotonic() - self.ready_at
        if not self.stable_noted and ready_for >= self.cfg.restart.window_s:
            self.stable_noted = True
            self.policy.on_stable()
            self.publish(Stable(at=self.host.wall(), ready_for_s=round(ready_for, 1)))
        busy = self.gateway is not None and self.gateway.busy()
        self.idle_since = (self.idle_since or self.host.monotonic()) if run.idle and not busy else None
        if self.idle_since is not None:
            await self.next_start.maybe_precompile(self.profile, run.engine_version,
                                                   self.host.monotonic() - self.idle_since)
        climb_after = self.cfg.ladder.climb_after_s
        if not climb_after or ready_for < climb_after or not run.idle or self.climb_to is not None:
            return
        target = self.policy.climb_target(self.profile)
        if target is None or not await self._room_for(target):
            return
        self.climb_to = target
        run.end(TriggerKind.CLIMB, f"stable for {ready_for:.0f}s")

    async def _room_for(self, target: Profile) -> bool:
        """A utilization lowered for another process's memory climbs back only once that memory is free."""
        util = target.effective(Knob.GPU_MEMORY_UTILIZATION)
        if util is None or util <= (self.profile.effective(Knob.GPU_MEMORY_UTILIZATION) or 0):
            return True
        try:
            snaps = await self.host.gpu_snapshot(self.cfg.engine.devices())
        except GpuLost:
            return False
        # Our own engine holds what it took; that memory is its successor's.
        ours = self.engine_run.child.known_pids if self.engine_run and self.engine_run.child else set()
        freed = [replace(s, free=s.free + sum(b for p, b in s.processes if p in ours)) for s in snaps]
        return not short_of(freed, util, self.cfg.gpu.start_headroom_bytes)

    async def _planned(self, run: EngineRun, trigger: Trigger) -> None:
        """A planned restart (a climb, or asked by the operator): drain, stop, and start at the target profile."""
        target = self.climb_to if trigger.kind is TriggerKind.CLIMB else self.restart_to
        self.climb_to = self.restart_to = None
        target = target or self.profile
        await self._drain(trigger.kind.value, target=target.knobs())
        self.change_state(S.STOPPING, reason=trigger.kind.value, evidence=trigger.evidence)  # -> STOPPING
        await self._wait(run.conclude(trigger), run.deadline_at)
        before, self.profile = self.profile, target
        if trigger.kind is TriggerKind.RESTART:
            self.publish(PlannedRestart(at=self.host.wall(), reason=trigger.evidence))
        if target != before:
            self.publish(ProfileRaised(at=self.host.wall(), diff=before.diff(target), profile=target.knobs(),
                                       reason=trigger.evidence))
        self._learned()

    async def _drain(self, why: str, **info: Any) -> None:
        """READY -> DRAINING before a planned stop; with a gateway, its in-flight requests finish first."""
        if self.state is not S.READY:
            return
        self.change_state(S.DRAINING, reason=why, **info)  # READY -> DRAINING
        if self.gateway is not None:
            bound = self.cfg.gateway.drain_timeout_s if self.cfg.gateway else 0.0
            await self._wait(self.gateway.drain(why), self._within(bound + 5.0))

    # ---- control: the operator's commands and reloads ------------------------------------------------------
    def _soon(self, work: Callable[[], Awaitable[Any]]) -> None:
        """From a signal handler: run ``work`` as a task of the loop (handlers only enqueue)."""
        task = asyncio.ensure_future(work())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def control_command(self, command: str) -> tuple[bool, str]:
        if command == "reload":
            return await self.reload()
        if command == "reset-profile":
            self.policy.rung_failures.clear()
            self._learned()
            if self.profile == self.cfg.profile:
                return True, "the profile already is the configured one; failed rungs forgotten"
            return self._restart_at(self.cfg.profile, "reset-profile: back to [profile]")
        return self._restart_at(self.profile, "restart asked by the operator")

    def _restart_at(self, target: Profile, why: str) -> tuple[bool, str]:
        run = self.engine_run
        if self.state not in (S.STARTING, S.WARMING, S.READY) or run is None:
            if self.state in (S.BACKOFF, S.STOPPING):
                self.profile = target  # the start that comes next uses it
                self._learned()
                return True, f"the engine is already restarting ({self.state.value}); the next start uses the profile"
            return False, f"the engine is {self.state.value}: nothing to restart"
        self.restart_to = target
        run.end(TriggerKind.RESTART, why)
        return True, f"{why}: the engine restarts at {target.knobs()}"

    def _alerts_for(self, cfg: Config) -> Alerts:
        """The alert hooks of ``cfg``, their series at 0 on /metrics; raises MissingSecret."""
        alerts = Alerts.from_config(cfg.alerts, self.publish)
        for hook in cfg.alerts.hooks:
            self.metrics.alerts_sent.labels(hook.type)
            self.metrics.alerts_failed.labels(hook.type)
        return alerts

    async def reload(self) -> tuple[bool, str]:
        """Read the config file again: invalid → keep the old one; engine settings changed → planned restart."""
        path = self.config_path
        self.publish(Reloading(at=self.host.wall(), source=str(path)))
        try:
            if path is None:
                raise ConfigError([("(file)", "this supervisor was started without a config file path")])
            new = config_mod.load(path)
            fixed = [name for name in ("admin", "state") if getattr(new, name) != getattr(self.cfg, name)]
            old_gw, new_gw = self.cfg.gateway, new.gateway
            if (old_gw is None) != (new_gw is None) or (old_gw and new_gw and old_gw.listen != new_gw.listen):
                fixed.append("gateway.listen")  # the public port itself; its other settings apply at once
            if fixed:
                raise ConfigError([(name, "changes only with a restart of the supervisor") for name in fixed])
            alerts = self._alerts_for(new) if new.alerts != self.cfg.alerts else None
        except (ConfigError, MissingSecret) as exc:
            self.publish(ReloadFailed(at=self.host.wall(), error=str(exc)))
            return False, f"reload refused, still running on the old config:\n{exc}"
        old, self.cfg = self.cfg, new
        changed = tuple(f.name for f in dataclasses.fields(Config) if getattr(old, f.name) != getattr(new, f.name))
        self.policy.restart, self.policy.ladder, self.policy.configured = new.restart, new.ladder, new.profile
        self.secrets = new.engine.secrets()
        if alerts is not None:
            await self.alerts.close()
            self.alerts = alerts
            self.alerts.start()
        if self.gateway is not None and new.gateway is not None:
            self.gateway.reconfigure(new.gateway)
        self.next_start.configure(new)
        engine_restart = new.engine != old.engine or new.profile != old.profile
        self.publish(Reloaded(at=self.host.wall(), changed=changed, engine_restart=engine_restart))
        if not engine_restart:
            return True, f"reloaded ({', '.join(changed) or 'nothing'} changed); the engine keeps running"
        ok, message = self._restart_at(clamp_to_configured(self.profile, new.profile), "config reloaded: "
                                       "engine settings changed")
        return ok, f"reloaded ({', '.join(changed)} changed); {message}"

    async def _fail(self, run: EngineRun, trigger: Trigger) -> ExitCode | None:
        """STOPPING, classify, ask the policy; BACKOFF and None to go on, or FATAL and its exit code."""
        self.publish(FailureDetected(at=self.host.wall(), trigger=trigger.kind.value, evidence=trigger.evidence,
                                     state=self.state.value))
        if self.outage_since is None:
            self.outage_since = trigger.at_mono
        detected_after = round(trigger.at_mono - self.state_since, 3)
        self.change_state(S.STOPPING, reason=trigger.kind.value, evidence=trigger.evidence)  # X -> STOPPING
        verdict = await self._wait(run.conclude(trigger), run.deadline_at)
        assert verdict.failure is not None
        decision = self.policy.on_failure(verdict.failure, self.profile, self.host.monotonic())
        failure = decision.failure
        before = self.profile
        self.last_failure = {**failure.as_dict(), "detected_at": trigger.at, "trigger": trigger.kind.value,
                             "phase": verdict.phase.value, "profile": before.knobs()}
        path = await self._write_incident(run, verdict, failure, before, decision.profile, decision.reason,
                                          detected_after)
        if path:
            self.last_failure["incident"] = path
        self.publish(FailureClassified(at=self.host.wall(), kind=failure.kind.value, evidence=failure.evidence,
                                       trigger=trigger.kind.value, phase=verdict.phase.value,
                                       returncode=verdict.returncode, suspect_request=failure.suspect_request,
                                       failure=failure.as_dict(), incident=path))
        if not decision.restart:
            self.change_state(S.FATAL, reason=decision.reason, exit_code=int(decision.exit_code))  # STOPPING -> FATAL
            self.publish(Fatal(at=self.host.wall(), reason=decision.reason, exit_code=int(decision.exit_code),
                               failure=failure.as_dict()))
            self._learned()
            return decision.exit_code
        if decision.profile != before:
            self.publish(ProfileLowered(at=self.host.wall(), diff=before.diff(decision.profile),
                                        profile=decision.profile.knobs(), kind=failure.kind.value,
                                        evidence=failure.evidence))
        self.profile = decision.profile
        self.restarts += 1
        self.restarts_total += 1
        self._learned()
        self.change_state(S.BACKOFF, delay_s=round(decision.delay_s, 3), reason=decision.reason)  # STOPPING -> BACKOFF
        if await self._sleep_or_stop(decision.delay_s):
            self.change_state(S.STOPPED, reason="stop requested during backoff")  # BACKOFF -> STOPPED
            return ExitCode.OK
        return None

    async def _sleep_or_stop(self, seconds: float) -> bool:
        """Sleep ``seconds`` on the host's clock; True if a stop was requested meanwhile."""
        sleeper = asyncio.ensure_future(self.host.sleep(seconds))
        stopper = asyncio.ensure_future(self.stop_asked.wait())
        both = asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        await self._wait(both, self._within(seconds))
        for t in (sleeper, stopper):
            t.cancel()
        return self.stop_asked.is_set()

    async def _write_incident(self, run: EngineRun, verdict: Verdict, failure: Failure, before: Profile,
                              after: Profile, decision: str, detected_after: float) -> str | None:
        try:
            gpu: Any = [s.as_dict() for s in await self.host.gpu_snapshot()]
        except GpuLost as exc:
            gpu = {"error": str(exc)}
        t = verdict.trigger
        bundle = {
            "failure": failure.as_dict(), "decision": decision,
            "trigger": {"kind": t.kind.value, "evidence": t.evidence, "at": t.at},
            "phase": verdict.phase.value, "returncode": verdict.returncode,
            "profile_before": before.knobs(), "profile_after": after.knobs(),
            "stop": verdict.stop.__dict__ if verdict.stop else None, "gpu": gpu, "stacks": verdict.stacks,
            "detected_after_state_s": detected_after,
            "versions": {"vllm_supervisor": __version__, "python": platform.python_version(),
                         "vllm": run.engine_version},
            **run.evidence(),
        }
        try:
            path = incident.write(self.cfg.state.dir, failure.kind.value, bundle,
                                  redact=lambda text: launch.redact(text, self.secrets))
        except OSError as exc:
            log.error("incident.write_failed", error=str(exc))
            return None
        return str(path)

    async def _stop_leftover_engine(self) -> None:
        """An engine left by a supervisor that died holds the port and the GPU: stop it first."""
        rec = leftovers.read(self.cfg.state.dir)
        if rec is None or rec.supervisor_pid == os.getpid():
            return
        e = self.cfg.engine
        pids = await self._wait(self.host.stop_leftover(rec.sid, rec.create_time, e.failed_stop_timeout_s,
                                                        e.kill_timeout_s),
                                self._within(e.failed_stop_timeout_s + e.kill_timeout_s + 10))
        if pids:
            log.warning("engine.leftover_stopped", pids=pids, sid=rec.sid,
                        hint="a previous supervisor died without stopping its engine")
            try:
                held = await self._wait(self.host.wait_gpu_released(pids, self.cfg.gpu.release_timeout_s),
                                        self._within(self.cfg.gpu.release_timeout_s))
            except GpuLost:
                held = {}
            if held:
                log.error("gpu.not_released", held={str(k): v for k, v in held.items()})
        leftovers.clear(self.cfg.state.dir)

