"""Prometheus metrics of the supervisor itself, served on the admin port at /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from supervisor.lifecycle import EngineState
from supervisor.profile import Profile


class Metrics:
    """One registry per supervisor (tests run several in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.state = Gauge("vllm_supervisor_engine_state", "1 for the engine's current state", ["state"], registry=r)
        self.transitions = Counter("vllm_supervisor_state_transitions", "Engine state transitions",
                                   ["from_state", "to_state"], registry=r)
        self.failures = Counter("vllm_supervisor_engine_failures", "Engine failures by kind", ["kind"], registry=r)
        self.restarts = Counter("vllm_supervisor_engine_restarts", "Restarts after a failure", registry=r)
        self.profile = Gauge("vllm_supervisor_profile", "Current value of each managed knob", ["knob"], registry=r)
        self.recovery = Gauge("vllm_supervisor_last_recovery_seconds",
                              "Failure detected -> READY again, last recovery", registry=r)
        self.start = Gauge("vllm_supervisor_last_start_to_ready_seconds", "Spawn -> READY of the last start",
                           registry=r)
        for s in EngineState:
            self.state.labels(s.value).set(1 if s is EngineState.STOPPED else 0)

    def transition(self, old: EngineState, new: EngineState) -> None:
        self.state.labels(old.value).set(0)
        self.state.labels(new.value).set(1)
        self.transitions.labels(old.value, new.value).inc()

    def set_profile(self, profile: Profile) -> None:
        for knob, value in profile.knobs().items():
            self.profile.labels(knob).set(-1 if value is None else value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
