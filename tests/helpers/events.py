"""Typed event records for tests of the subscribers (what the lifecycle and the gateway publish)."""

from __future__ import annotations

from typing import Any

from supervisor.engine_states import EngineState, Failure, FailureKind, Phase, TriggerKind
from supervisor.event_stream import Event, FailureClassified, ProfileLowered, Ready, Recovered, StateChanged
from supervisor.profile import Profile

P = Profile(max_num_batched_tokens=8192, max_num_seqs=16, gpu_memory_utilization=0.9)
P2 = P.with_(max_num_batched_tokens=6144)


def sc(old: str, new: str, at: float = 1.0, profile: Profile = P, start_to_ready_s: float | None = None,
       outage_s: float | None = -1.0, **why: Any) -> StateChanged:
    """A state change; ``outage_s`` defaults to what the lifecycle says: none at READY, else one just begun."""
    ready = Ready({"start_to_ready_s": start_to_ready_s}, {}, (100, 200)) if start_to_ready_s is not None else None
    if outage_s == -1.0:
        outage_s = None if new == "READY" else 0.0
    return StateChanged(at=at, old=EngineState(old), new=EngineState(new), after_s=0.1, profile=profile, restarts=0,
                        ready=ready, outage_s=outage_s, **why)


def failed(kind: str = "runtime_oom", evidence: str = "CUDA out of memory. Tried to allocate 176.00 MiB",
           at: float = 2.0, suspect_request: str | None = None) -> FailureClassified:
    k = FailureKind(kind)
    return FailureClassified(at=at, kind=k, evidence=evidence, trigger=TriggerKind.DEATH, phase=Phase.SERVING,
                             returncode=0, suspect_request=suspect_request, failure=Failure(k, evidence),
                             incident="/var/lib/x/incidents/1.json", named_by_vllm=suspect_request is not None)


def lowered(at: float = 2.0) -> ProfileLowered:
    return ProfileLowered(at=at, diff={"max_num_batched_tokens": [8192, 6144]}, profile=P2,
                          kind=FailureKind.RUNTIME_OOM, evidence="CUDA out of memory")


def recovered(kind: str = "runtime_oom", after_s: float = 14.0, at: float = 3.0) -> Recovered:
    return Recovered(at=at, kind=FailureKind(kind), recovered_after_s=after_s, profile=P2)


def crash_and_recover(kind: str = "runtime_oom") -> list[Event]:
    return [sc("READY", "STOPPING"), failed(kind), sc("STOPPING", "BACKOFF", delay_s=1.0),
            sc("BACKOFF", "STARTING"), sc("STARTING", "WARMING"), sc("WARMING", "READY"),
            recovered(kind, 42.0)]
