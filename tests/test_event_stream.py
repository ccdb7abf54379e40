"""The event stream: publish once, every subscriber on its own bounded queue; each subscriber alone."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from supervisor.event_stream import (
    Event,
    EventBus,
    FailureClassified,
    Fatal,
    LearnedChanged,
    ProfileLowered,
    Recovered,
    StateChanged,
    StopRequested,
)
from supervisor.ops import statefile
from supervisor.ops.history import History
from supervisor.ops.logs import log_event
from supervisor.ops.metrics import Metrics
from supervisor.ops.notify import Notifier

P = {"max_num_batched_tokens": 8192, "max_num_seqs": 16, "gpu_memory_utilization": 0.9, "max_model_len": None}
P2 = {**P, "max_num_batched_tokens": 6144}


def sc(old: str, new: str, **info: Any) -> StateChanged:
    return StateChanged(at=1.0, old=old, new=new, after_s=0.5, profile=P, restarts=0, info=info)


STREAM: list[Event] = [
    sc("STOPPED", "STARTING", start=1), sc("STARTING", "WARMING"),
    sc("WARMING", "READY", start_to_ready_s=12.5),
    sc("READY", "STOPPING", reason="death"),
    FailureClassified(at=2.0, kind="runtime_oom", evidence="CUDA out of memory. Tried to allocate 1 GiB",
                      trigger="death", phase="serving", returncode=0, suspect_request=None,
                      failure={"kind": "runtime_oom"}, incident=None),
    ProfileLowered(at=2.0, diff={"max_num_batched_tokens": [8192, 6144]}, profile=P2, kind="runtime_oom",
                   evidence="CUDA out of memory"),
    sc("STOPPING", "BACKOFF", delay_s=1.0), sc("BACKOFF", "STARTING"), sc("STARTING", "WARMING"),
    sc("WARMING", "READY", start_to_ready_s=10.0),
    Recovered(at=3.0, kind="runtime_oom", recovered_after_s=14.0, profile=P2),
    StopRequested(at=4.0, reason="SIGTERM"),
]


def test_metrics_subscriber_alone() -> None:
    m = Metrics(P)
    for ev in STREAM:
        m(ev)
    text = m.render().decode()
    assert 'vllm_supervisor_engine_state{state="READY"} 1.0' in text
    assert 'vllm_supervisor_engine_state{state="BACKOFF"} 0.0' in text
    assert 'vllm_supervisor_engine_failures_total{kind="runtime_oom"} 1.0' in text
    assert 'vllm_supervisor_engine_failures_total{kind="hang"} 0.0' in text  # every kind exists from the start
    assert "vllm_supervisor_engine_restarts_total 1.0" in text
    assert 'vllm_supervisor_profile{knob="max_num_batched_tokens"} 6144.0' in text
    assert 'vllm_supervisor_profile{knob="max_model_len"} -1.0' in text
    assert "vllm_supervisor_last_recovery_seconds 14.0" in text
    assert "vllm_supervisor_last_start_to_ready_seconds 10.0" in text


def test_history_subscriber_alone() -> None:
    h = History(maxlen=5)
    for ev in STREAM:
        h(ev)
    assert [e["to"] for e in h.last()] == ["STOPPING", "BACKOFF", "STARTING", "WARMING", "READY"]  # bounded
    assert h.last()[-1]["from"] == "WARMING" and h.last()[-1]["start_to_ready_s"] == 10.0


def test_log_subscriber_alone_writes_one_line_per_event_at_its_level() -> None:
    with capture_logs() as logs:
        for ev in STREAM:
            log_event(ev)
    assert [x["event"] for x in logs] == [ev.name for ev in STREAM]
    lowered = next(x for x in logs if x["event"] == "engine.profile_lowered")
    assert lowered["log_level"] == "warning" and lowered["diff"] == {"max_num_batched_tokens": [8192, 6144]}
    ready = next(x for x in logs if x["event"] == "engine.state_changed" and x["to"] == "READY")
    assert ready["from"] == "WARMING" and ready["start_to_ready_s"] == 12.5


def test_statefile_subscriber_alone(tmp_path: Path) -> None:
    w = statefile.StateFileWriter(tmp_path)
    for ev in STREAM:
        w(ev)
    assert statefile.load(tmp_path) is None  # nothing learned, nothing written
    w(LearnedChanged(at=5.0, profile={**P2, "enable_chunked_prefill": True}, rung_failures={"k": 1},
                     last_failure={"kind": "runtime_oom"}, restarts_total=3))
    back = statefile.load(tmp_path)
    assert back is not None and back.profile.max_num_batched_tokens == 6144 and back.restarts_total == 3


def test_notify_subscriber_alone_on_a_real_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        s.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        n = Notifier(start_budget_s=600)
        for ev in STREAM:
            n(ev)
        got = []
        s.setblocking(False)
        while True:
            try:
                got.append(s.recv(4096).decode())
            except BlockingIOError:
                break
    assert got[0].startswith("EXTEND_TIMEOUT_USEC=600000000\nSTATUS=STARTING chunk=8192")
    ready = [m for m in got if "READY=1" in m]
    assert len(ready) == 1 and "STATUS=READY chunk=8192 seqs=16 util=0.9 restarts=0" in ready[0]
    assert not any(m.startswith("EXTEND") for m in got[1:])  # only until the first READY
    assert got[-1] == "STOPPING=1"


async def test_a_slow_subscriber_never_delays_publishing_and_what_it_drops_is_counted() -> None:
    bus = EventBus()
    stuck = asyncio.Event()
    fast: list[str] = []

    async def slow(_: Event) -> None:
        await stuck.wait()  # a hook that hangs

    bus.subscribe("slow", slow, queue_size=3)
    bus.subscribe("fast", lambda ev: fast.append(ev.name))
    bus.start()
    for ev in STREAM:
        bus.publish(ev)  # returns at once whatever the subscribers do
    await asyncio.wait_for(bus.drain_one("fast"), 5)
    assert fast == [ev.name for ev in STREAM]
    c = bus.counters()
    assert c["fast"]["dropped"] == 0
    assert c["slow"]["dropped"] == len(STREAM) - 3  # published before it ran: three queued, the rest dropped
    await bus.close(flush_s=0.1)


async def test_a_failing_subscriber_is_counted_and_the_others_go_on() -> None:
    bus = EventBus()
    seen: list[str] = []

    def broken(_: Event) -> None:
        raise RuntimeError("boom")

    bus.subscribe("broken", broken)
    bus.subscribe("ok", lambda ev: seen.append(ev.name))
    bus.start()
    fatal = Fatal(at=1.0, reason="restart budget spent", exit_code=4, failure={"kind": "hang"})
    for ev in (*STREAM, fatal):
        bus.publish(ev)
    with capture_logs() as logs:
        await bus.close()
    assert seen[-1] == "supervisor.fatal"  # close() flushes what was queued before stopping
    assert bus.counters()["broken"]["failed"] == len(STREAM) + 1
    assert any(x["event"] == "event_stream.subscriber_failed" for x in logs)


def test_every_event_record_is_frozen_and_json_ready() -> None:
    for ev in STREAM:
        json.dumps(ev.fields())
        with pytest.raises(AttributeError):
            ev.at = 0  # type: ignore[misc]
