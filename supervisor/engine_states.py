"""Engine states, failure kinds, trigger kinds, exit codes and the legal transitions between states
(pure).

The ground floor with supervisor.profile: everything else may import it; it imports only the
profile."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from supervisor.profile import Knob


class EngineState(enum.Enum):
    STOPPED = "STOPPED"
    STARTING = "STARTING"
    WARMING = "WARMING"
    READY = "READY"
    DRAINING = "DRAINING"
    STOPPING = "STOPPING"
    BACKOFF = "BACKOFF"
    FATAL = "FATAL"


S = EngineState

# Each edge is a reason the engine moves; anything else is a bug in the lifecycle.
LEGAL_TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    S.STOPPED: frozenset({S.STARTING}),
    S.STARTING: frozenset({S.WARMING, S.STOPPING}),
    S.WARMING: frozenset({S.READY, S.STOPPING}),
    S.READY: frozenset({S.DRAINING, S.STOPPING}),
    S.DRAINING: frozenset({S.READY, S.STOPPING}),
    # STOPPING -> STARTING is a planned restart (climbing back a rung), not a failure.
    S.STOPPING: frozenset({S.STOPPED, S.BACKOFF, S.STARTING, S.FATAL}),
    S.BACKOFF: frozenset({S.STARTING, S.STOPPED, S.FATAL}),
    S.FATAL: frozenset(),
}


class IllegalTransition(RuntimeError):
    """Raised when code asks for a state change the lifecycle does not allow."""


def check_transition(old: EngineState, new: EngineState) -> None:
    """Raise IllegalTransition unless old -> new is an edge of the lifecycle."""
    if new not in LEGAL_TRANSITIONS[old]:
        raise IllegalTransition(f"{old.value} -> {new.value} is not a legal engine transition")


class FailureKind(enum.Enum):
    RUNTIME_OOM = "runtime_oom"
    STARTUP_MEMORY = "startup_memory"
    ENGINE_DEAD = "engine_dead"
    HANG = "hang"
    SIGNAL = "signal"
    DEVICE_FATAL = "device_fatal"
    CONFIG_ERROR = "config_error"
    # vLLM's compiled model, as its compile cache holds it, fails at the start's first forward
    COMPILE_CACHE = "compile_cache"

    # What each kind means to the policy and to the gateway, decided here once.
    @property
    def memory(self) -> bool:
        """A memory failure: the profile steps down."""
        return self in (FailureKind.RUNTIME_OOM, FailureKind.STARTUP_MEMORY)

    @property
    def unexplained(self) -> bool:
        """A death with no cause in the evidence; repeated with the same request it is treated as
        memory."""
        return self in (FailureKind.ENGINE_DEAD, FailureKind.SIGNAL)

    @property
    def request_can_cause(self) -> bool:
        """A death a request in the batch may have caused (a hang or a device fault is not blamed
        on one)."""
        return self is FailureKind.RUNTIME_OOM or self.unexplained


class TriggerKind(enum.Enum):
    """Why one engine run is ending."""

    EXIT = "exit"  # the API server exited (any status: vLLM exits 0 after its engine died)
    DEATH = "death"  # vLLM's own error record says the engine died
    HANG = "hang"  # a liveness rule fired (start timeout, /metrics silence, no progress, canary)
    WARMUP_FAILED = "warmup_failed"
    SPAWN_FAILED = "spawn_failed"  # the engine command could not be executed
    MODEL_MISSING = "model_missing"  # a local model path never appeared
    GPU_SHORT = "gpu_short"  # the start gate found too little free GPU memory
    GPU_LOST = "gpu_lost"  # NVML says the device is gone
    STOP = "stop"  # asked to stop (SIGTERM/SIGINT)
    CLIMB = "climb"  # planned restart one rung up
    RESTART = "restart"  # planned restart asked by the operator (restart, reset-profile, a reload)

    @property
    def planned(self) -> bool:
        return self in (TriggerKind.STOP, TriggerKind.CLIMB, TriggerKind.RESTART)


class Phase(enum.Enum):
    """Where in its life the engine was when it failed; decides startup vs runtime memory
    failures."""

    LOADING = "loading"  # spawned, /health not yet 200
    SERVING = "serving"  # /health was 200 at least once (warm-up or real traffic)


@dataclass(frozen=True)
class Failure:
    """A classified engine failure and the evidence that decided it."""

    kind: FailureKind
    evidence: str
    # For memory failures: the managed knob the evidence points at, and a value it suggests.
    knob: Knob | None = None
    suggested: float | None = None
    # Engine request id and prompt length of the largest request in the failing batch, when vLLM
    # dumped it.
    suspect_request: str | None = None
    suspect_tokens: int | None = None
    # False when the cause lies outside the engine's settings (another process holds the GPU):
    # the rung is not to blame and is not remembered as failed.
    rung_at_fault: bool = True

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"kind": self.kind.value, "evidence": self.evidence}
        if self.knob:
            out["knob"] = self.knob.value
        if self.suggested is not None:
            out["suggested"] = self.suggested
        if self.suspect_request:
            out["suspect_request"] = self.suspect_request
        if self.suspect_tokens is not None:
            out["suspect_tokens"] = self.suspect_tokens
        if not self.rung_at_fault:
            out["rung_at_fault"] = False
        return out


@dataclass(frozen=True)
class Blame:
    """What the gateway found about a death: one request alone was proven to cause it (it spends
    no restart budget, and is not read as the engine's memory signature), the next engine
    should start at the lowest rung (a request that killed two engines is tried there alone),
    and how many earlier deaths that proof explains."""

    proven: bool = False
    floor: bool = False
    # Earlier deaths, each of which spent the restart budget, that the request now proven a poison
    # was at the engine for: explained now, their budget is given back.
    explained: int = 0


class ExitCode(enum.IntEnum):
    """Exit statuses of `vllm-supervisor run`; documented in docs/interface.md."""

    OK = 0
    INTERNAL_ERROR = 1
    BAD_SUPERVISOR_CONFIG = 2
    ENGINE_CONFIG_ERROR = 3
    RESTART_BUDGET_SPENT = 4
    NOTHING_LEFT_TO_LOWER = 5
    DEVICE_FATAL = 6
