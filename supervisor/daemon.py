"""The composition root: every part is built, started and stopped here, in an order read top to
bottom.

``Daemon.run`` is startup → the lifecycle's main loop → shutdown, as uvicorn's ``Server.serve``
is. The parts never build each other: the event stream and its subscribers, the lifecycle (the
state machine, the only writer of state and profile), recovery, the gateway, the admin and
metrics listeners, the alert hooks and the control socket are made in ``__init__`` and wired
through callables and the stream. The operator's commands (reload among them, which replaces the
config and the alert hooks) are commands.py's. Signal handlers only set intent; the loop acts.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import structlog

from supervisor.commands import OperatorCommands
from supervisor.config import Config
from supervisor.decide.policy import Policy, clamp_to_configured
from supervisor.engine import leftover
from supervisor.engine.run import EngineRun
from supervisor.event_stream import (
    Event,
    EventBus,
    ProfileRestored,
    SupervisorStarted,
)
from supervisor.gateway.pipeline import EngineView, SupervisorSide
from supervisor.gateway.server import EVENTS, OUTCOMES, Gateway
from supervisor.heartbeat import Heartbeat
from supervisor.host import Host, leftovers, reaper, rundir, signals
from supervisor.host.vllm_http import EngineClient
from supervisor.lifecycle import Lifecycle
from supervisor.loop_lag import LoopLag
from supervisor.ops import control, statefile
from supervisor.ops.admin import admin_servers, scrape_engine
from supervisor.ops.control import ControlServer
from supervisor.ops.history import History
from supervisor.ops.logs import EventLog
from supervisor.ops.metrics import Metrics
from supervisor.ops.notify import Notifier
from supervisor.ops.processes import Row, ours_on_host
from supervisor.profile import Profile
from supervisor.recovery import Recovery

log = structlog.get_logger("supervisor.daemon")


class Listener(Protocol):
    async def start(self) -> None: ...
    async def close(self) -> None: ...


@dataclass
class Session:
    """This supervisor process: how it was started, since when, and its run directory (its
    per-start files)."""

    config_path: str | None
    install_signals: bool
    started_mono: float
    run_dir: Path = field(default_factory=Path)


class Daemon:
    def __init__(self, cfg: Config, host: Host, *, notifier: Notifier | None = None,
                 echo: TextIO | None = None, install_signals: bool = True,
                 client_factory: Callable[[], EngineClient] | None = None,
                 config_path: str | None = None) -> None:
        self.host = host
        self.session = Session(config_path, install_signals, host.monotonic())
        self.bus = EventBus()
        publish = self.bus.publish
        learned = statefile.load(cfg.state.dir)
        profile = clamp_to_configured(learned.profile, cfg.profile,
                                      learned.configured) if learned else cfg.profile
        policy = Policy(cfg.restart, cfg.ladder, cfg.profile,
                        rung_failures=dict(learned.rung_failures) if learned else {})
        self.notifier = notifier or Notifier(cfg.engine.start_timeout_s + cfg.warmup.timeout_s)
        self.recovery = Recovery(cfg, host, publish, policy.next_rungs)
        side = SupervisorSide(sound=lambda: self.heartbeat.alive())
        self.gateway = Gateway(cfg, host, publish, self._engine_view, side) if cfg.gateway else None
        self.heartbeat = Heartbeat(host, self.notifier, publish, lambda: self.lifecycle.state)
        self.loop_lag = LoopLag()

        async def new_run(p: Profile, number: int) -> EngineRun:
            await self.recovery.settled()  # a throwaway precompile engine is gone before any start
            return EngineRun(self.cfg, host, p, number, self.session.run_dir / f"start-{number}",
                             publish, echo=echo,
                             client=client_factory() if client_factory else None,
                             standby=self.recovery)

        self.lifecycle = Lifecycle(cfg, host, publish, self.heartbeat, policy, profile, new_run,
                                   front=self.gateway,
                                   learned=learned.remembered() if learned else None)
        # Subscribers, in the order they read each event.
        self.metrics = Metrics(profile.knobs(), cfg.profile.knobs())
        self.metrics.budget_from(lambda: policy.budget_left(host.monotonic()))
        self.metrics.loop_stall_from(lambda: self.loop_lag.max_s)
        self.history = History()
        # raises MissingSecret
        self.commands = OperatorCommands(cfg, host, publish, self.metrics, config_path,
                                         self.lifecycle, self.gateway, self.recovery)
        self.bus.subscribe("log", EventLog())
        self.bus.subscribe("metrics", self.metrics)
        self.bus.subscribe("notify", self.notifier)
        self.bus.subscribe("history", self.history)
        self.bus.subscribe("statefile", statefile.StateFileWriter(cfg.state.dir, cfg.profile))
        # forwards to the commands' alerts, which a reload may replace
        self.bus.subscribe("alerts", self)
        self.bus.subscribe("recovery", self.recovery)
        if self.gateway is not None:
            self.bus.subscribe("gateway", self.gateway)
            self.metrics.gateway_from(self.gateway.status, OUTCOMES, EVENTS)
        # Listeners: the admin port (loopback), /metrics alone for a central Prometheus, the control
        # socket.
        self.listeners: list[Listener] = [
            *admin_servers(cfg.admin, host.monotonic, self.status, self.heartbeat.alive,
                           self.metrics.render, self.engine_metrics),
            ControlServer(control.path_in(cfg.state.dir), self.commands.command)
        ]
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def cfg(self) -> Config:
        return self.commands.cfg  # the config in force: a reload replaces it

    def on_event(self, event: Event) -> None:
        self.commands.alerts.on_event(event)

    # ---- startup, main loop, shutdown ------------------------------------------------------------
    async def run(self) -> int:
        """Supervise until asked to stop (0) or FATAL (non-zero ExitCode)."""
        await self.startup()
        try:
            await self.heartbeat.wait(
                leftover.stop_engine_left(self.cfg, self.host, self.bus.publish),
                self.heartbeat.within(leftover.stop_bound_s(self.cfg)))
            # Only now: a dead supervisor's throwaway still starting reads its logging config from
            # its run directory; swept first, it died by itself before it could be stopped (and
            # counted).
            rundir.sweep(self.session.run_dir.parent)
            return await self.lifecycle.run_until_stopped()
        finally:
            await self.shutdown()

    async def startup(self) -> None:
        if self.session.install_signals:
            signals.answer(self.lifecycle.request_stop, lambda: self._soon(self.commands.reload))
        self.session.run_dir = rundir.make()
        self.recovery.use_dir(self.session.run_dir)
        for listener in self.listeners:
            await listener.start()
        if self.gateway is not None:
            await self.gateway.start()
        self.bus.start()
        self.commands.alerts.start()
        self.recovery.start()
        self._soon(lambda: self.metrics.poll_gpu(self.host))
        if reaper.needed():
            self._soon(reaper.keep_reaping)
        self._soon(self.loop_lag.run)
        profile, cfg = self.lifecycle.profile, self.cfg
        self.bus.publish(
            SupervisorStarted(at=self.host.wall(), admin=cfg.admin.listen,
                              engine=cfg.engine.base_url, profile=profile, state_dir=cfg.state.dir))
        if profile != cfg.profile:
            self.bus.publish(ProfileRestored(at=self.host.wall(), profile=profile,
                                             below_configured=cfg.profile.diff(profile)))

    async def shutdown(self) -> None:
        """Every part stopped, in the reverse order of startup; the alerts flushed last (a FATAL
        is paged)."""
        if self.lifecycle.run is not None:
            await self.lifecycle.run.shutdown()
        leftovers.clear(self.cfg.state.dir)
        await self.recovery.close()
        if self.gateway is not None:
            self.gateway.shutdown()  # whoever still waits (a FATAL end) gets 503 now, not a reset
        for t in self._background:
            t.cancel()
        await self.bus.close()
        # bounded by [alerts] flush_s; before the port's close (clients hold it)
        await self.commands.alerts.close()
        if self.gateway is not None:
            await self.gateway.close()  # bounded by gateway.CLOSE_S
        for listener in self.listeners:
            await listener.close()
        shutil.rmtree(self.session.run_dir, ignore_errors=True)
        if self.session.install_signals:
            signals.stop_answering()

    def _soon(self, work: Callable[[], Awaitable[Any]]) -> None:
        """Run ``work`` as a task of the loop (signal handlers only enqueue)."""
        task = asyncio.ensure_future(work())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- what the parts read of each other -------------------------------------------------------
    def _engine_view(self) -> EngineView:
        life = self.lifecycle
        return EngineView(life.profile.chunk(), life.profile.max_model_len,
                          life.pids() | self.recovery.pids(), life.tally.restart_eta_s(),
                          life.tally.remembered.slowest_start_s, life.restarting())

    async def engine_metrics(self) -> tuple[int, bytes, str]:
        run = self.lifecycle.run
        return await scrape_engine(run.client if run else None, self.lifecycle.state)

    def status(self) -> dict[str, Any]:
        """The /status document (docs/interface.md)."""
        return {
            **self.lifecycle.status(),
            "uptime_s": round(self.host.monotonic() - self.session.started_mono, 3),
            "history": self.history.last(20),
            "event_stream": self.bus.counters(),
            "loop": self.loop_lag.status(),
            "devices": ",".join(map(str, self.cfg.engine.devices() or [])) or "all",
            "alerts": self.commands.alerts.status(),
            "next_start": self.recovery.status(),
            "processes": self.processes(),
            **({"gateway": self.gateway.status()} if self.gateway else {}),
        }

    def processes(self) -> list[dict[str, Any]]:
        run = self.lifecycle.run
        rows: list[Row] = [("engine", run.child, run.origin.url,
                            self.lifecycle.profile)] if run and run.child else []
        return ours_on_host(self.host, rows + self.recovery.processes(), self.metrics.gpu_last)
