"""The one event stream: frozen records of everything that changes, published once, read by
subscribers.

Each event type has one publisher (the lifecycle, an engine run, the gateway, recovery, the alert
hooks); logging, metrics, the systemd notifier, the /status history, the state file, the gateway,
the alert rules and recovery subscribe. Records are typed: states, failure and trigger kinds are
the enums of supervisor.engine_states, profiles are Profile objects, and ``fields()`` renders them
for the log line under the names docs/interface.md gives. Each subscriber implements ``on_event``
and reads from its own bounded queue in its own task, so a slow or failing subscriber never delays
supervision: when its queue is full the event is dropped for that subscriber alone and counted.

(Not ``events.py``: supervisord, which vLLM installs, has a module of that name in its own
``supervisor`` package.)
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol

import structlog

from supervisor.aio import cancel_and_wait
from supervisor.engine_states import EngineState, Failure, FailureKind, Phase, TriggerKind
from supervisor.profile import Profile

log = structlog.get_logger("supervisor.event_stream")


@dataclass(frozen=True, kw_only=True)
class Event:
    """One thing that happened; ``name`` is the structlog event name, ``at`` the wall clock."""

    name: ClassVar[str]
    level: ClassVar[str] = "info"
    at: float

    def log_level(self) -> str:
        return self.level

    def fields(self) -> dict[str, Any]:
        """The record's own fields (not ``at``), JSON-ready."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in fields(self) if f.name != "at"}


@dataclass(frozen=True, kw_only=True)
class SupervisorStarted(Event):
    name = "supervisor.started"
    admin: str
    engine: str
    profile: Profile
    state_dir: str


@dataclass(frozen=True, kw_only=True)
class StopRequested(Event):
    name = "supervisor.stop_requested"
    reason: str


@dataclass(frozen=True)
class Ready:
    """What one start reports when it reaches READY: where its time went, how it warmed up, what
    it runs."""

    timings: Mapping[str, float]  # start_to_healthy_s, warmup_s, start_to_ready_s
    phases: Mapping[str, float]  # seconds per phase, in order (decide/startup.phases)
    warmup_prompts: tuple[int, ...]
    engine_version: str | None = None
    from_standby: bool = False
    from_spare: bool = False  # a spare engine was woken: nothing was built
    engine_url: str = ""  # where this start's engine listens (a woken spare has a port of its own)
    # the torch.compile cache directory vLLM said it used (host/compile_cache.py)
    compile_cache: str | None = None
    compiled: bool = True  # False: started without torch.compile (decide/compile_mode.py)

    def as_dict(self) -> dict[str, Any]:
        return {**self.timings, "phases": dict(self.phases)}


@dataclass(frozen=True, kw_only=True)
class StateChanged(Event):
    """The engine state moved along one edge of the lifecycle; what moved it in named fields."""

    name = "engine.state_changed"
    old: EngineState
    new: EngineState
    after_s: float  # time spent in ``old``
    profile: Profile
    restarts: int
    reason: str | None = None
    evidence: str | None = None
    start: int | None = None  # STARTING: the start's number
    healthy_after_s: float | None = None  # WARMING
    ready: Ready | None = None  # READY
    delay_s: float | None = None  # BACKOFF
    exit_code: int | None = None  # FATAL
    target: Profile | None = None  # DRAINING before a planned restart
    outage_s: float | None = None  # how long the engine has been out of service (None: it is not)

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "from": self.old.value, "to": self.new.value, "after_s": self.after_s,
            "profile": self.profile.knobs(), "restarts": self.restarts
        }
        for name in ("reason", "evidence", "start", "healthy_after_s", "delay_s", "exit_code",
                     "outage_s"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.target is not None:
            out["target"] = self.target.knobs()
        if self.ready is not None:
            out.update(_jsonable(self.ready.as_dict()))
            out["warmup_prompts"] = list(self.ready.warmup_prompts)
            out["engine_version"] = self.ready.engine_version
        return out


@dataclass(frozen=True, kw_only=True)
class ProfileRestored(Event):
    """At start: the profile learned by an earlier run, below what is configured."""

    name = "engine.profile_restored"
    profile: Profile
    below_configured: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class ProfileLowered(Event):
    name = "engine.profile_lowered"
    level = "warning"
    diff: Mapping[str, Any]
    profile: Profile
    kind: FailureKind
    evidence: str


@dataclass(frozen=True, kw_only=True)
class ProfileRaised(Event):
    name = "engine.profile_raised"
    diff: Mapping[str, Any]
    profile: Profile
    reason: str


@dataclass(frozen=True, kw_only=True)
class ProfileChanged(Event):
    """The profile changed other than by a failure or a climb: an operator's restart target, a
    reload."""

    name = "engine.profile_changed"
    diff: Mapping[str, Any]
    profile: Profile
    reason: str


def profile_changed(old: Profile, new: Profile, at: float, reason: str,
                    failure: Failure | None = None) -> Event:
    """The one event that says how the profile changed: lowered for a failure, raised, or
    otherwise changed."""
    diff = old.diff(new)
    if failure is not None:
        return ProfileLowered(at=at, diff=diff, profile=new, kind=failure.kind,
                              evidence=failure.evidence)
    if new.reaches(old):
        return ProfileRaised(at=at, diff=diff, profile=new, reason=reason)
    return ProfileChanged(at=at, diff=diff, profile=new, reason=reason)


@dataclass(frozen=True, kw_only=True)
class EngineSpawned(Event):
    name = "engine.spawned"
    pid: int
    start: int
    argv: tuple[str, ...]  # secrets already masked
    standby: bool = False  # an interpreter that had imported vLLM already became this engine
    spare: bool = False  # a spare engine, woken, became this engine (nothing was spawned)


@dataclass(frozen=True, kw_only=True)
class RungPrecompiled(Event):
    """A throwaway engine compiled a rung's graphs into vLLM's cache ahead of need (or failed
    to)."""

    name = "engine.rung_precompiled"
    profile: Profile
    ok: bool
    took_s: float
    error: str | None = None

    def log_level(self) -> str:
        return "info" if self.ok else "warning"


@dataclass(frozen=True, kw_only=True)
class BuildingFirst(Event):
    """A planned start builds ahead before its engine (``precompile_order``/``spare_order``
    "first"): one record per step, for the journal, systemd's STATUS= and /status. ``left_s``:
    what is left as the last builds on this host took (``<state dir>/builds.json``); None
    before any."""

    name = "start.building_first"
    step: str  # "rungs" (compiles side by side) or "spare"
    done: int
    of: int
    left_s: float | None = None

    def line(self) -> str:
        return building_line(self.step, self.done, self.of, self.left_s)


def building_line(step: str, done: int, of: int, left_s: float | None) -> str:
    """A build-first's step in words: systemd's STATUS=, `vllm-supervisor status`."""
    what = "rungs compiled" if step == "rungs" else "spare asleep"
    return f"building first: {done} of {of} {what}, {_left(left_s)}"


def _left(left_s: float | None) -> str:
    return ("no earlier build to tell the time" if left_s is None else
            f"about {left_s:.0f} s left" if left_s < 120 else f"about {left_s / 60:.0f} min left")


@dataclass(frozen=True, kw_only=True)
class BuildingBeside(Event):
    """A second engine is being built beside the serving engine (recovery/next_build.py's
    COMPILE or SPARE while READY): the journal's line and systemd's STATUS= for it. ``done`` of
    ``of``: the rungs within reach compiled before it; ``left_s``: as long as the last such
    build on this host took (``<state dir>/builds.json``), None before any."""

    name = "ahead.building_beside"
    what: str  # "rung" (a throwaway compiling it) or "spare"
    profile: Profile
    done: int
    of: int
    left_s: float | None = None

    def line(self) -> str:
        return building_beside_line(self.what, self.profile.knobs(), self.done, self.of,
                                    self.left_s)


def building_beside_line(what: str, knobs: Mapping[str, Any], done: int, of: int,
                         left_s: float | None) -> str:
    """What is built beside the serving engine, in words: systemd's STATUS=, `vllm-supervisor
    status` (``left_s`` there is what is left now)."""
    rung = f"chunk={knobs.get('max_num_batched_tokens')} seqs={knobs.get('max_num_seqs')}"
    if what == "spare":
        return f"building beside: a spare at {rung}, {_left(left_s)}"
    return (f"building beside: compiling {rung} ({done} of {of} rungs within reach compiled), "
            f"{_left(left_s)}")


@dataclass(frozen=True, kw_only=True)
class EngineStopped(Event):
    name = "engine.stopped"
    pids: tuple[int, ...]
    sigkilled: tuple[int, ...]
    survivors: tuple[int, ...]
    returncode: int | None
    kill_s: float
    drain_s: float
    gpu_release_s: float
    # a stop the supervisor chose (SIGTERM, a climb, a restart): it should never need SIGKILL
    planned: bool = False
    # killed without a grace on purpose: a settled death, or a restart drained of every request
    at_once: bool = False
    # False: its GPU memory's release not waited for (the next engine, a spare, was woken beside it)
    release_waited: bool = True


@dataclass(frozen=True, kw_only=True)
class FailureDetected(Event):
    name = "engine.failure_detected"
    level = "warning"
    trigger: TriggerKind
    evidence: str
    state: EngineState


@dataclass(frozen=True, kw_only=True)
class DeathSettled(Event):
    """A dead engine's verdict was settled before its stop (``settled_before_exit``): recovery may
    wake the spare the restart wants beside it while its tree is killed."""

    name = "engine.death_settled"
    kind: FailureKind
    profile: Profile


@dataclass(frozen=True, kw_only=True)
class DeathSeen(Event):
    """A serving engine's death whose verdict waits for vLLM's last words (``[engine]
    dead_grace_s``): ``kind`` is what the evidence so far says. Recovery may wake the spare the
    restart would take while the API server exits by itself (recovery/spare.py
    ``wake_while_it_exits``)."""

    name = "engine.death_seen"
    kind: FailureKind
    profile: Profile


@dataclass(frozen=True, kw_only=True)
class CompileCacheSetAside(Event):
    """After a ``compile_cache`` failure (the engine's, or a second engine's): vLLM's torch.compile
    cache renamed (kept for a person to look at or remove), so that the next start compiles anew;
    ``moved_to`` None where it could not be moved (``error`` says why) or did not exist."""

    name = "compile_cache.set_aside"
    level = "warning"
    cache: str
    moved_to: str | None
    error: str | None = None
    # whose death showed it: "engine", or a second engine's ("precompile", "spare") before the
    # engine's own start on it (decide/spoiled_cache.py)
    after: str = "engine"


@dataclass(frozen=True, kw_only=True)
class FailureClassified(Event):
    name = "engine.failed"
    level = "warning"
    kind: FailureKind
    evidence: str
    trigger: TriggerKind
    phase: Phase
    returncode: int | None
    suspect_request: str | None
    failure: Failure
    incident: str | None
    # vLLM's own record named the request in the failing batch (its scheduler dump): evidence that
    # the request, not the engine, is to blame. None when nothing named one.
    named_by_vllm: bool = False
    # The engine that died already ran at the ladder's lowest batch token budget, and that budget: a
    # request that killed it twice is tried alone at the lowest rung before it is quarantined
    # (docs/interface.md).
    at_floor: bool = True
    chunk: int | None = None
    # The gateway proved one request alone caused it: no restart budget spent (the request is
    # quarantined at its second such death).
    caused_by_request: bool = False


@dataclass(frozen=True, kw_only=True)
class Recovered(Event):
    name = "engine.recovered"
    kind: FailureKind | None
    recovered_after_s: float
    profile: Profile


@dataclass(frozen=True, kw_only=True)
class Stable(Event):
    name = "engine.stable"
    ready_for_s: float


@dataclass(frozen=True, kw_only=True)
class Fatal(Event):
    name = "supervisor.fatal"
    level = "error"
    reason: str
    exit_code: int
    failure: Failure | None


@dataclass(frozen=True, kw_only=True)
class LearnedChanged(Event):
    """What the supervisor learned changed; the state file subscriber persists it."""

    name = "state.learned"
    level = "debug"
    profile: Profile
    rung_failures: Mapping[str, int]
    last_failure: Mapping[str, Any] | None
    restarts_total: int
    slowest_start_s: float | None = None
    fatal: Mapping[str, Any] | None = None  # the supervisor gave up: exit_code, reason, at, kind


@dataclass(frozen=True, kw_only=True)
class Reloading(Event):
    """SIGHUP or `vllm-supervisor reload`: the config file is read again."""

    name = "supervisor.reloading"
    source: str


@dataclass(frozen=True, kw_only=True)
class Reloaded(Event):
    name = "supervisor.reloaded"
    changed: tuple[str, ...]  # the sections that differ
    engine_restart: bool  # engine settings changed: the engine is restarted (planned)
    configured_profile: Profile | None = None  # [profile] as the new file has it


@dataclass(frozen=True, kw_only=True)
class ReloadFailed(Event):
    """The new config is invalid: the supervisor keeps running on the old one."""

    name = "supervisor.reload_failed"
    level = "error"
    error: str


@dataclass(frozen=True, kw_only=True)
class PlannedRestart(Event):
    name = "engine.planned_restart"
    reason: str


@dataclass(frozen=True, kw_only=True)
class RequestQuarantined(Event):
    """A request that killed the engine again is refused from now on (published by the gateway)."""

    name = "gateway.request_quarantined"
    level = "warning"
    request_hash: str  # of the content: never the text itself
    prompt_tokens: int | None
    evidence: str


@dataclass(frozen=True, kw_only=True)
class RequestRejected(Event):
    """The gateway answered a request itself (413, 429, 503); at most one record per code and
    second."""

    name = "gateway.request_rejected"
    status: int
    code: str
    request_id: str
    count: int = 1  # rejections with this code since the last record (the first of them named)

    def log_level(self) -> str:
        return "warning" if self.status == 413 else "info"


@dataclass(frozen=True, kw_only=True)
class AcceptFailed(Event):
    """The public port could not accept a connection (out of descriptors or memory); at most one
    a second."""

    name = "gateway.accept_failed"
    error: str
    count: int = 1  # failures since the last record

    def log_level(self) -> str:
        return "warning"


@dataclass(frozen=True, kw_only=True)
class StreamContinued(Event):
    """A stream the engine died under, after text reached the client, goes on on the new engine."""

    name = "gateway.stream_continued"
    request_id: str
    resumed: int  # continuations of this stream so far
    tokens_sent: int  # tokens the client had received
    why: str


@dataclass(frozen=True, kw_only=True)
class RequestReplayed(Event):
    """A request the engine lost before it sent the client anything goes to the new engine."""

    name = "gateway.request_replayed"
    request_id: str
    replays: int
    alone: bool  # the suspect of the death, sent alone first


@dataclass(frozen=True, kw_only=True)
class SheddingChanged(Event):
    """The gateway started (reason) or stopped (empty) shedding new requests with 429."""

    name = "gateway.shedding"
    reason: str
    # the KV cache is full: every new request; else only prompts that need new memory
    everyone: bool = False

    def log_level(self) -> str:
        return "warning" if self.reason else "info"


@dataclass(frozen=True, kw_only=True)
class GatewayDrained(Event):
    """Before a planned stop of the engine: what the gateway let finish, and what it had to cut."""

    name = "gateway.drained"
    why: str
    in_flight: int  # at the engine when the drain began
    waited_s: float
    cut: int


@dataclass(frozen=True, kw_only=True)
class GatewayHandedOver(Event):
    """The engine drains for a planned start whose engine is awake beside it: new requests go to
    that one from now on, not held through the drain, the stop and the warm-up."""

    name = "gateway.handed_over"
    pid: int  # the successor (a climb's spare, woken)
    waiting: int  # requests held until now, sent to it
    in_flight: int  # still at the draining engine, finishing there


@dataclass(frozen=True, kw_only=True)
class AlertOutcome(Event):
    """What became of one alert on one hook: sent, failed (after the retries), suppressed,
    dropped."""

    name = "alert.outcome"
    channel: str
    alert: str
    severity: str
    outcome: str
    error: str = ""

    def log_level(self) -> str:
        return "info" if self.outcome == "sent" else "warning"


# ---- what used to be bare log lines: now on the stream, so alert rules and metrics can read them -


@dataclass(frozen=True, kw_only=True)
class SupervisorStuck(Event):
    """A step of the supervision loop ran past the bound it announced: the watchdog is no longer
    petted."""

    name = "supervisor.stuck"
    level = "error"
    state: EngineState
    overdue_s: float
    hint: str = "the watchdog is no longer petted; systemd will restart the supervisor"


@dataclass(frozen=True, kw_only=True)
class GpuNotReleased(Event):
    """Processes of a stopped engine still hold GPU memory after ``[gpu] release_timeout_s``."""

    name = "gpu.not_released"
    level = "error"
    held: Mapping[str, int]  # pid -> bytes
    timeout_s: float


@dataclass(frozen=True, kw_only=True)
class GpuLostEvent(Event):
    name = "gpu.lost"
    level = "error"
    error: str


@dataclass(frozen=True, kw_only=True)
class GpuShort(Event):
    """The start gate found too little free GPU memory."""

    name = "gpu.not_enough_free"
    level = "warning"
    devices: tuple[Mapping[str, Any], ...]
    evidence: str


@dataclass(frozen=True, kw_only=True)
class StartupStep(Event):
    """vLLM's startup reached a new step (loading weights, compiling, capturing graphs, ...),
    from its console."""

    name = "engine.startup_step"
    step: str


@dataclass(frozen=True, kw_only=True)
class UtilizationAdapted(Event):
    """The start gate found memory held steady by another process: the engine starts now at the
    ``gpu_memory_utilization`` that fits, not after a wait for memory that is not coming back."""

    name = "gpu.utilization_adapted"
    level = "warning"
    before: float
    after: float
    devices: tuple[Mapping[str, Any], ...]
    evidence: str
    hint: str = "the climb raises it again once the other process lets go (ladder.climb_after_s)"


@dataclass(frozen=True, kw_only=True)
class LeftoverEngineStopped(Event):
    name = "engine.leftover_stopped"
    level = "warning"
    pids: tuple[int, ...]
    sid: int
    what: str = "engine"  # or "precompile": a throwaway engine compiling a rung
    hint: str = "a previous supervisor died without stopping its engine"


@dataclass(frozen=True, kw_only=True)
class ModelMissing(Event):
    name = "engine.model_missing"
    level = "warning"
    model: str
    waiting_up_to_s: float
    hint: str = "a late mount? waiting for it before calling it a configuration error"


@dataclass(frozen=True, kw_only=True)
class ModelAppeared(Event):
    name = "engine.model_appeared"
    model: str


@dataclass(frozen=True, kw_only=True)
class CompileCacheUnusable(Event):
    name = "engine.compile_cache_unusable"
    level = "warning"
    reason: str
    hint: str


@dataclass(frozen=True, kw_only=True)
class CanaryFailed(Event):
    name = "engine.canary_failed"
    level = "warning"
    status: int
    error: str


@dataclass(frozen=True, kw_only=True)
class NoStackDump(Event):
    name = "engine.no_stack_dump"
    hint: str = "install py-spy to capture stacks of a hung engine"


@dataclass(frozen=True, kw_only=True)
class EngineEnvReported(Event):
    """The variables vLLM set for its EngineCore (the IPC hook's ``vllm_env``); the log line
    names them only."""

    name = "engine.vllm_env"
    pid: int | None
    env: Mapping[str, str]
    # a precompile throwaway's or a spare's EngineCore, not the engine's
    second_engine: bool = False

    def fields(self) -> dict[str, Any]:
        return {"pid": self.pid, "names": sorted(self.env), "second_engine": self.second_engine}


@dataclass(frozen=True, kw_only=True)
class EngineIdle(Event):
    """While READY: nothing of the clients' or the supervisor's is at the engine (True), or work
    arrived."""

    name = "engine.idle"
    level = "debug"
    idle: bool


@dataclass(frozen=True, kw_only=True)
class IncidentWriteFailed(Event):
    name = "incident.write_failed"
    level = "error"
    error: str


@dataclass(frozen=True, kw_only=True)
class StandbySpawned(Event):
    name = "standby.spawned"
    pid: int
    mode: str
    target: str
    vllm_env: tuple[str, ...]  # names only
    # "engine": the next start's; "spare": the next spare's build (recovery/standby.py)
    role: str = "engine"


@dataclass(frozen=True, kw_only=True)
class StandbyUnavailable(Event):
    """A standby could not be made (``spawn_failed``), was gone when the start wanted it
    (``lost``), or one found that importing the engine's modules ahead starts CUDA
    (``engine_imports_refused``: ``error`` names the module; later standbys import vLLM alone)."""

    name = "standby.unavailable"
    level = "warning"
    what: str  # spawn_failed | lost | engine_imports_refused
    error: str
    pid: int | None = None
    hint: str = "this start is cold"


@dataclass(frozen=True, kw_only=True)
class PrecompileStarted(Event):
    name = "precompile.started"
    profile: Profile
    port: int
    standby: bool = False  # a spare's standby became it (vLLM imported ahead), not a cold spawn


@dataclass(frozen=True, kw_only=True)
class PrecompileCrashed(Event):
    """The precompiler's own fault (not the throwaway engine's): the rung is not tried again in
    this run."""

    name = "precompile.crashed"
    level = "warning"
    profile: Profile
    error: str


@dataclass(frozen=True, kw_only=True)
class SpareAsleep(Event):
    """The next rung's engine is built and asleep: the start that wants that rung wakes it
    (recovery/spare.py)."""

    name = "spare.asleep"
    pid: int
    port: int
    profile: Profile
    took_s: float  # spawn -> asleep
    sleep_s: float
    standby: bool = False  # started from a standby of its own (vLLM imported ahead)
    held_awake_mib: int  # what its processes held on the card awake, and asleep (NVML)
    held_asleep_mib: int


@dataclass(frozen=True, kw_only=True)
class SpareWoken(Event):
    name = "spare.woken"
    pid: int
    port: int
    profile: Profile
    took_s: float
    # the check after the wake: equal, tokens, max_logprob_drift, took_s
    canary: Mapping[str, Any] | None = None
    # woken for a climb while the engine it replaces still drained (not after that engine's stop)
    beside: bool = False
    url: str = ""  # where it answers
    # woken beside: its warm-up, done before it takes requests (its start then has none to do)
    warmup_s: float | None = None
    # its weights woken ahead, beside the dead engine, before the rest (``took_s``) once that
    # engine's memory was free: seconds, or None where it woke in one part
    weights_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class SpareChecked(Event):
    """A sleeping spare was woken, answered the canary as before it first slept, and sleeps
    again."""

    name = "spare.checked"
    pid: int
    profile: Profile
    wakes: int  # how often its checks have woken it
    took_s: float  # wake, canary and sleep
    canary: Mapping[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class SpareDropped(Event):
    """The spare was stopped: it no longer serves the next start, or it failed (``fault``)."""

    name = "spare.dropped"
    pid: int
    profile: Profile
    reason: str  # "canary" when the woken spare answered otherwise than before it slept
    fault: bool = False
    detail: str = ""  # what differed, for reason "canary"
    incident: str | None = None
    hint: str = "the next start at that rung is cold (the standby and the compile cache still help)"

    def log_level(self) -> str:
        return "warning" if self.fault else "info"


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool, type(None))):
        return v
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, Profile):
        return v.knobs()
    if isinstance(v, Failure):
        return v.as_dict()
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)


class Subscriber(Protocol):
    """What every part that reads the stream implements: one event at a time, from its own queue."""

    def on_event(self, event: Event) -> Awaitable[None] | None: ...


@dataclass
class Subscription:
    name: str
    subscriber: Subscriber
    queue: asyncio.Queue[Event]
    dropped: int = 0
    failed: int = 0
    task: asyncio.Task[None] | None = None


class EventBus:
    """Publish once; every subscriber gets the event on its own bounded queue."""

    def __init__(self, queue_size: int = 1000) -> None:
        self.queue_size = queue_size
        self.subscriptions: list[Subscription] = []

    def subscribe(self, name: str, subscriber: Subscriber,
                  queue_size: int | None = None) -> Subscription:
        sub = Subscription(name, subscriber, asyncio.Queue(queue_size or self.queue_size))
        self.subscriptions.append(sub)
        return sub

    def publish(self, event: Event) -> None:
        """Never blocks and never raises: a full queue drops the event for that subscriber only."""
        for sub in self.subscriptions:
            try:
                sub.queue.put_nowait(event)
            except asyncio.QueueFull:
                sub.dropped += 1

    def start(self) -> None:
        for sub in self.subscriptions:
            if sub.task is None:
                sub.task = asyncio.create_task(self._deliver(sub), name=f"subscriber:{sub.name}")

    async def _deliver(self, sub: Subscription) -> None:
        while True:
            event = await sub.queue.get()
            try:
                result = sub.subscriber.on_event(event)
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:  # noqa: BLE001 - a subscriber's bug must not stop the others
                sub.failed += 1
                log.error("event_stream.subscriber_failed", subscriber=sub.name,
                          event_name=event.name, error=f"{type(exc).__name__}: {exc}")
            finally:
                sub.queue.task_done()

    async def drain_one(self, name: str) -> None:
        """Wait until subscriber ``name`` has handled what is queued for it."""
        await next(s for s in self.subscriptions if s.name == name).queue.join()

    async def drain(self) -> None:
        """Wait until every running subscriber has handled what is queued."""
        await asyncio.gather(*(s.queue.join() for s in self.subscriptions if s.task))

    async def close(self, flush_s: float = 5.0) -> None:
        """Deliver what is queued (bounded by ``flush_s`` in all), then stop every subscriber."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.drain(), flush_s)
        for sub in self.subscriptions:
            if sub.task is not None:
                await cancel_and_wait(sub.task)
                sub.task = None

    def counters(self) -> dict[str, dict[str, int]]:
        return {s.name: {"dropped": s.dropped, "failed": s.failed, "queued": s.queue.qsize()}
                for s in self.subscriptions}
