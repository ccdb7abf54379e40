"""Prometheus metrics of the supervisor itself, served on the admin port at /metrics.

An event-stream subscriber: every series moves only on the events it reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from supervisor.about import __version__
from supervisor.engine_states import LEGAL_TRANSITIONS, EngineState, FailureKind
from supervisor.event_stream import (
    AlertOutcome,
    Event,
    FailureClassified,
    ProfileChanged,
    ProfileLowered,
    ProfileRaised,
    ProfileRestored,
    Recovered,
    Reloaded,
    StateChanged,
)
from supervisor.host import Host
from supervisor.host.gpu import GpuLost

GPU_POLL_S = 10.0


class Metrics:
    """One registry per supervisor (tests run several in one process)."""

    def __init__(self, profile: Mapping[str, Any] | None = None,
                 configured: Mapping[str, Any] | None = None) -> None:
        # A `_created` series per counter: noise.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self.gpu_last: list[Any] = []  # the last GPU poll's DeviceSnapshots
        r = self.registry
        Info("vllm_supervisor_build", "Version of the supervisor and its Python", registry=r).info(
            {"version": __version__, "python": platform.python_version()})
        self.configured = Gauge("vllm_supervisor_configured_profile",
                                "Configured value of each managed knob (-1 = vLLM's default)",
                                ["knob"], registry=r)
        self.degraded = Gauge("vllm_supervisor_degraded",
                              "1 while the profile is below the configured one", registry=r)
        self.budget_left = Gauge(
            "vllm_supervisor_restart_budget_left",
            "Restarts left before FATAL (the lesser of the window budget and the crash-loop "
            "limit)", registry=r)
        self.time_to_ready = Histogram("vllm_supervisor_time_to_ready_seconds",
                                       "Spawn -> READY of each start",
                                       buckets=(5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 900),
                                       registry=r)
        self.gpu_memory = Gauge("vllm_supervisor_gpu_memory_bytes",
                                "GPU memory per device as NVML reports it", ["device", "kind"],
                                registry=r)
        self.state = Gauge("vllm_supervisor_engine_state", "1 for the engine's current state",
                           ["state"], registry=r)
        self.transitions = Counter("vllm_supervisor_state_transitions", "Engine state transitions",
                                   ["from_state", "to_state"], registry=r)
        self.failures = Counter("vllm_supervisor_engine_failures", "Engine failures by kind",
                                ["kind"], registry=r)
        self.restarts = Counter("vllm_supervisor_engine_restarts", "Restarts after a failure",
                                registry=r)
        self.profile = Gauge("vllm_supervisor_profile",
                             "Current value of each managed knob (-1 = vLLM's default)", ["knob"],
                             registry=r)
        self.recovery = Gauge("vllm_supervisor_last_recovery_seconds",
                              "Failure detected -> READY again, last recovery", registry=r)
        self.start = Gauge("vllm_supervisor_last_start_to_ready_seconds",
                           "Spawn -> READY of the last start", registry=r)
        self.alerts_sent = Counter("vllm_supervisor_alerts_sent", "Alerts a hook delivered",
                                   ["channel"], registry=r)
        self.alerts_failed = Counter(
            "vllm_supervisor_alerts_failed",
            "Alerts a hook could not deliver (after its retries) or had to drop", ["channel"],
            registry=r)
        self.alerts_suppressed = Counter("vllm_supervisor_alerts_suppressed",
                                         "Alerts held back by a rate limit", ["channel"],
                                         registry=r)
        for s in EngineState:
            self.state.labels(s.value).set(1 if s is EngineState.STOPPED else 0)
        for k in FailureKind:
            self.failures.labels(k.value)
        for old, news in LEGAL_TRANSITIONS.items():  # every series exists from the start, at 0
            for new in news:
                self.transitions.labels(old.value, new.value)
        self._configured: dict[str, Any] = {}
        self._profile: dict[str, Any] = {}
        self.set_configured(configured or {})
        if profile is not None:
            self.set_profile(profile)

    def on_event(self, event: Event) -> None:
        if isinstance(event, StateChanged):
            self.state.labels(event.old.value).set(0)
            self.state.labels(event.new.value).set(1)
            self.transitions.labels(event.old.value, event.new.value).inc()
            if event.new is EngineState.BACKOFF:
                self.restarts.inc()
            self.set_profile(event.profile.knobs())
            if event.ready is not None and "start_to_ready_s" in event.ready.timings:
                self.start.set(float(event.ready.timings["start_to_ready_s"]))
                self.time_to_ready.observe(float(event.ready.timings["start_to_ready_s"]))
        elif isinstance(event, (ProfileLowered, ProfileRaised, ProfileRestored, ProfileChanged)):
            self.set_profile(event.profile.knobs())
        elif isinstance(event, Reloaded) and event.configured_profile is not None:
            self.set_configured(event.configured_profile.knobs())
        elif isinstance(event, FailureClassified):
            self.failures.labels(event.kind.value).inc()
        elif isinstance(event, Recovered):
            self.recovery.set(event.recovered_after_s)
        elif isinstance(event, AlertOutcome):
            counter = {"sent": self.alerts_sent,
                       "suppressed": self.alerts_suppressed}.get(event.outcome, self.alerts_failed)
            counter.labels(event.channel).inc()

    def set_profile(self, knobs: Mapping[str, Any]) -> None:
        self._profile = dict(knobs)
        for knob, value in knobs.items():
            self.profile.labels(knob).set(-1 if value is None else value)
        self._degraded()

    def set_configured(self, knobs: Mapping[str, Any]) -> None:
        self._configured = dict(knobs)
        for knob, value in knobs.items():
            self.configured.labels(knob).set(-1 if value is None else value)
        self._degraded()

    def _degraded(self) -> None:
        if self._configured and self._profile:
            self.degraded.set(0 if self._profile == self._configured else 1)

    def budget_from(self, left: Callable[[], float]) -> None:
        """Read the restart budget left at each scrape (it grows back as old restarts leave the
        window)."""
        self.budget_left.set_function(left)

    def loop_stall_from(self, longest: Callable[[], float]) -> None:
        """The longest stall of the supervisor's event loop since it started, read at each
        scrape."""
        Gauge(
            "vllm_supervisor_loop_stall_max_seconds",
            "The longest the supervisor's event loop ran late "
            "(watchdog, /healthz and the public port share it)",
            registry=self.registry).set_function(longest)

    def gateway_from(self, read: Callable[[], Mapping[str, Any]], outcomes: Sequence[str],
                     events: Sequence[str] = ()) -> None:
        """The gateway's own counters, read at each scrape (one source of truth: its /status
        object)."""
        self.registry.register(_GatewayCollector(read, outcomes, events))

    async def poll_gpu(self, host: Host) -> None:
        """GPU memory per device, every GPU_POLL_S (NVML in a thread; a lost GPU is the gate's
        business)."""
        while True:
            with contextlib.suppress(GpuLost):
                self.set_gpu(await host.gpu_snapshot())
            await asyncio.sleep(GPU_POLL_S)

    def set_gpu(self, devices: Sequence[Any]) -> None:
        self.gpu_last = list(devices)  # /status processes reads who held what from the same poll
        for d in devices:
            for kind in ("total", "free", "used"):
                self.gpu_memory.labels(str(d.index), kind).set(getattr(d, kind))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _GatewayCollector:
    def __init__(self, read: Callable[[], Mapping[str, Any]], outcomes: Sequence[str],
                 events: Sequence[str]) -> None:
        self.read, self.outcomes, self.events = read, outcomes, events

    def collect(self) -> list[Metric]:
        doc = self.read()
        requests = CounterMetricFamily(
            "vllm_supervisor_gateway_requests",
            "Requests by how they ended, one outcome each (forwarded, the engine's own "
            "5xx, client gone, or the status the gateway answered itself)", labels=["outcome"])
        for outcome in self.outcomes:
            requests.add_metric([outcome], float(doc.get(outcome, 0)))
        events = CounterMetricFamily(
            "vllm_supervisor_gateway_request_events",
            "What happened to requests on their way (held, replayed, quarantined, a stream "
            "broken or continued); a request may count under several", labels=["event"])
        for event in self.events:
            events.add_metric([event], float(doc.get(event, 0)))
        held = doc.get("held_seconds") or {"buckets": [("+Inf", 0.0)], "sum": 0.0}
        return [
            requests, events,
            HistogramMetricFamily(
                "vllm_supervisor_gateway_held_seconds",
                "How long requests waited for the engine (not READY, or its caps full)", buckets=[
                    (str(le), float(n)) for le, n in held["buckets"]
                ], sum_value=float(held["sum"])),
            GaugeMetricFamily("vllm_supervisor_gateway_in_flight", "Requests at the engine now",
                              value=float(doc["in_flight"])),
            GaugeMetricFamily("vllm_supervisor_gateway_waiting",
                              "Requests held waiting for the engine now",
                              value=float(doc["waiting"])),
            GaugeMetricFamily("vllm_supervisor_gateway_shedding",
                              "1 while new requests get 429 for memory "
                              "pressure", value=1.0 if doc.get("shedding") else 0.0),
            GaugeMetricFamily("vllm_supervisor_gateway_quarantined",
                              "Request hashes in quarantine now",
                              value=float(doc["quarantine_size"]))
        ]
