"""The event stream: publish once, every subscriber on its own bounded queue; each subscriber alone."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from supervisor.engine_states import Failure, FailureKind
from supervisor.event_stream import (
    Event,
    EventBus,
    Fatal,
    LearnedChanged,
    Reloaded,
    StopRequested,
)
from supervisor.ops import statefile
from supervisor.ops.history import History
from supervisor.ops.logs import EventLog
from supervisor.ops.metrics import Metrics
from supervisor.ops.notify import Notifier

from tests.helpers.events import P2, P, failed, lowered, recovered, sc

STREAM: list[Event] = [
    sc("STOPPED", "STARTING", start=1), sc("STARTING", "WARMING"),
    sc("WARMING", "READY", start_to_ready_s=12.5),
    sc("READY", "STOPPING", reason="death"),
    failed(evidence="CUDA out of memory. Tried to allocate 1 GiB"),
    lowered(),
    sc("STOPPING", "BACKOFF", profile=P2, delay_s=1.0), sc("BACKOFF", "STARTING", profile=P2),
    sc("STARTING", "WARMING", profile=P2),
    sc("WARMING", "READY", profile=P2, start_to_ready_s=10.0),
    recovered(),
    StopRequested(at=4.0, reason="SIGTERM"),
]


class Recorder:
    """A subscriber that keeps what it gets (or runs ``action`` on it)."""

    def __init__(self, action: Any = None) -> None:
        self.seen: list[str] = []
        self.action = action

    def on_event(self, event: Event) -> Any:
        self.seen.append(event.name)
        return self.action(event) if self.action else None


def test_metrics_subscriber_alone() -> None:
    m = Metrics(P.knobs())
    for ev in STREAM:
        m.on_event(ev)
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
        h.on_event(ev)
    assert [e["to"] for e in h.last()] == ["STOPPING", "BACKOFF", "STARTING", "WARMING", "READY"]  # bounded
    assert h.last()[-1]["from"] == "WARMING" and h.last()[-1]["start_to_ready_s"] == 10.0


def test_log_subscriber_alone_writes_one_line_per_event_at_its_level() -> None:
    with capture_logs() as logs:
        for ev in STREAM:
            EventLog().on_event(ev)
    assert [x["event"] for x in logs] == [ev.name for ev in STREAM]
    lowered = next(x for x in logs if x["event"] == "engine.profile_lowered")
    assert lowered["log_level"] == "warning" and lowered["diff"] == {"max_num_batched_tokens": [8192, 6144]}
    ready = next(x for x in logs if x["event"] == "engine.state_changed" and x["to"] == "READY")
    assert ready["from"] == "WARMING" and ready["start_to_ready_s"] == 12.5


def test_statefile_subscriber_alone(tmp_path: Path) -> None:
    w = statefile.StateFileWriter(tmp_path, P2)
    for ev in STREAM:
        w.on_event(ev)
    assert statefile.load(tmp_path) is None  # nothing learned, nothing written
    w.on_event(LearnedChanged(at=5.0, profile=P2.with_(enable_chunked_prefill=True), rung_failures={"k": 1},
                              last_failure={"kind": "runtime_oom"}, restarts_total=3))
    back = statefile.load(tmp_path)
    assert back is not None and back.profile.max_num_batched_tokens == 6144 and back.restarts_total == 3
    assert back.configured == P2  # what was configured when it was learned
    reloaded = P2.with_(gpu_memory_utilization=0.5)
    w.on_event(Reloaded(at=6.0, changed=("profile",), engine_restart=True, configured_profile=reloaded))
    w.on_event(LearnedChanged(at=7.0, profile=P2, rung_failures={}, last_failure=None, restarts_total=3))
    back = statefile.load(tmp_path)
    assert back is not None and back.configured == reloaded


def test_notify_subscriber_alone_on_a_real_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        s.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        n = Notifier(start_budget_s=600)
        for ev in STREAM:
            n.on_event(ev)
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


def test_a_build_first_tells_systemd_its_step_n_of_m_and_the_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38, item 6: `systemctl status` shows what a long first start is doing, not only STARTING."""
    from supervisor.event_stream import BuildingFirst

    sent: list[str] = []
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent")
    n = Notifier()
    monkeypatch.setattr(n, "send", lambda *fields: sent.append("\n".join(fields)))
    n.on_event(STREAM[0])
    n.on_event(BuildingFirst(at=1.0, step="rungs", done=0, of=5, left_s=None))
    n.on_event(BuildingFirst(at=2.0, step="rungs", done=2, of=5, left_s=216.0))
    n.on_event(BuildingFirst(at=3.0, step="spare", done=0, of=1, left_s=48.0))
    assert sent[1:] == [
        "STATUS=STARTING (building first: 0 of 5 rungs compiled, no earlier build to tell the time) chunk=8192 "
        "seqs=16 util=0.9 restarts=0",
        "STATUS=STARTING (building first: 2 of 5 rungs compiled, about 4 min left) chunk=8192 seqs=16 util=0.9 "
        "restarts=0",
        "STATUS=STARTING (building first: 0 of 1 spare asleep, about 48 s left) chunk=8192 seqs=16 util=0.9 "
        "restarts=0"]


def test_a_build_beside_the_serving_engine_tells_systemd_what_it_builds_until_it_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38, item 6, where the default builds now: after READY, beside the engine. STATUS= says the rung being
    compiled, n of m within reach, and the time left; the build's end (ok or not) puts the plain line back."""
    from supervisor.engine_states import EngineState
    from supervisor.event_stream import BuildingBeside, PrecompileCrashed, RungPrecompiled

    sent: list[str] = []
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent")
    n = Notifier()
    monkeypatch.setattr(n, "send", lambda *fields: sent.append("\n".join(fields)))
    n.on_event(sc(EngineState.WARMING, EngineState.READY))
    rung = P.with_(max_num_batched_tokens=6144)
    n.on_event(BuildingBeside(at=1.0, what="rung", profile=rung, done=1, of=4, left_s=None))
    n.on_event(RungPrecompiled(at=2.0, profile=rung, ok=True, took_s=58.3))
    n.on_event(RungPrecompiled(at=2.5, profile=rung, ok=True, took_s=1.0))  # a build-first's: nothing to undo
    n.on_event(BuildingBeside(at=3.0, what="spare", profile=rung, done=2, of=4, left_s=47.6))
    n.on_event(PrecompileCrashed(at=4.0, profile=rung, error="boom"))
    plain = "STATUS=READY chunk=8192 seqs=16 util=0.9 restarts=0"
    assert sent == [
        "READY=1\n" + plain,
        "STATUS=READY (building beside: compiling chunk=6144 seqs=16 (1 of 4 rungs within reach compiled), no "
        "earlier build to tell the time) chunk=8192 seqs=16 util=0.9 restarts=0", plain,
        "STATUS=READY (building beside: a spare at chunk=6144 seqs=16, about 48 s left) chunk=8192 seqs=16 util=0.9 "
        "restarts=0", plain]


def test_a_build_besides_time_left_is_the_last_such_builds_less_its_own_so_far() -> None:
    from supervisor.recovery.progress import Beside

    b = Beside("rung", P, 100.0, 1, 3, 60.0)
    assert b.as_dict(130.0) == {"what": "rung", "profile": P.knobs(), "for_s": 30.0, "done": 1, "of": 3,
                                "left_s": 30.0, "each_s": 60.0}
    assert b.left_s(175.0) == 0.0  # past the last one's time: nothing left to tell
    assert Beside("spare", P, 0.0, 0, 3, None).left_s(5.0) is None  # no earlier build on this host


def test_the_time_left_is_the_batches_left_as_the_last_build_took(tmp_path: Path) -> None:
    from supervisor.recovery.progress import BuildTimes, Progress

    assert Progress("rungs", 0, 5, 2, None, 0.0).left_s(10.0) is None
    assert Progress("rungs", 0, 5, 2, 100.0, 0.0).left_s(30.0) == 270.0  # 3 batches of 2, 30 s into the first
    assert Progress("rungs", 4, 5, 2, 100.0, 0.0).left_s(150.0) == 0.0  # running past the last one's time
    assert Progress("rungs", 5, 5, 2, 100.0, 0.0).left_s(1.0) == 0.0
    times = BuildTimes(str(tmp_path))
    times.note("rungs", 63.04)
    times.note("spare", None)
    times.note("rung", 58.31)
    (tmp_path / "junk").write_text("x")
    assert BuildTimes(str(tmp_path)).took_s == {"rungs": 63.0, "rung": 58.3}
    (tmp_path / "builds.json").write_text('{"rungs": "soon", "spare": -1, "other": 5}')
    assert BuildTimes(str(tmp_path)).took_s == {}  # a damaged record tells nothing


async def test_a_slow_subscriber_never_delays_publishing_and_what_it_drops_is_counted() -> None:
    bus = EventBus()
    stuck = asyncio.Event()
    fast = Recorder()

    async def slow(_: Event) -> None:
        await stuck.wait()  # a hook that hangs

    bus.subscribe("slow", Recorder(slow), queue_size=3)
    bus.subscribe("fast", fast)
    bus.start()
    for ev in STREAM:
        bus.publish(ev)  # returns at once whatever the subscribers do
    await asyncio.wait_for(bus.drain_one("fast"), 5)
    assert fast.seen == [ev.name for ev in STREAM]
    c = bus.counters()
    assert c["fast"]["dropped"] == 0
    assert c["slow"]["dropped"] == len(STREAM) - 3  # published before it ran: three queued, the rest dropped
    await bus.close(flush_s=0.1)


async def test_a_failing_subscriber_is_counted_and_the_others_go_on() -> None:
    bus = EventBus()
    ok = Recorder()

    def broken(_: Event) -> None:
        raise RuntimeError("boom")

    bus.subscribe("broken", Recorder(broken))
    bus.subscribe("ok", ok)
    bus.start()
    fatal = Fatal(at=1.0, reason="restart budget spent", exit_code=4, failure=Failure(FailureKind.HANG, "x"))
    for ev in (*STREAM, fatal):
        bus.publish(ev)
    with capture_logs() as logs:
        await bus.close()
    assert ok.seen[-1] == "supervisor.fatal"  # close() flushes what was queued before stopping
    assert bus.counters()["broken"]["failed"] == len(STREAM) + 1
    assert any(x["event"] == "event_stream.subscriber_failed" for x in logs)


def test_every_event_record_is_frozen_and_json_ready() -> None:
    for ev in STREAM:
        json.dumps(ev.fields())
        with pytest.raises(AttributeError):
            ev.at = 0  # type: ignore[misc]


def test_metrics_follow_a_profile_change_in_any_state_and_a_reload_of_the_configured_profile() -> None:
    """Every fact on /metrics moves with an event: the profile rides on each state change, and a reload
    that changes [profile] says so (both were stale before)."""
    m = Metrics(P.knobs(), P.knobs())
    m.on_event(sc("STOPPING", "BACKOFF", delay_s=1.0))
    m.on_event(sc("BACKOFF", "STARTING", profile=P2))  # the operator's target, set during the backoff
    text = m.render().decode()
    assert 'vllm_supervisor_profile{knob="max_num_batched_tokens"} 6144.0' in text
    assert "vllm_supervisor_degraded 1.0" in text
    m.on_event(Reloaded(at=5.0, changed=("profile",), engine_restart=True, configured_profile=P2))
    text = m.render().decode()
    assert 'vllm_supervisor_configured_profile{knob="max_num_batched_tokens"} 6144.0' in text
    assert "vllm_supervisor_degraded 0.0" in text


def test_typed_events_render_under_their_documented_names() -> None:
    ready = sc("WARMING", "READY", start_to_ready_s=12.5).fields()
    assert ready["from"] == "WARMING" and ready["to"] == "READY" and ready["warmup_prompts"] == [100, 200]
    assert ready["profile"] == P.knobs() and "outage_s" not in ready
    down = sc("READY", "STOPPING", reason="death", evidence="x").fields()
    assert (down["reason"], down["evidence"], down["outage_s"]) == ("death", "x", 0.0)
    f = failed(suspect_request="cmpl-1").fields()
    assert f["kind"] == "runtime_oom" and f["trigger"] == "death" and f["phase"] == "serving"
    assert f["failure"] == {"kind": "runtime_oom", "evidence": "CUDA out of memory. Tried to allocate 176.00 MiB"}


def test_the_grafana_dashboard_and_the_alert_rules_only_use_metrics_the_supervisor_exports() -> None:
    """Issue 18, item 4: a dashboard or rule over a metric name nobody exports shows nothing when it matters."""
    import json
    import re
    from pathlib import Path

    from supervisor.gateway.server import EVENTS, OUTCOMES
    from supervisor.ops.metrics import Metrics

    m = Metrics({"max_num_seqs": 8}, {"max_num_seqs": 8})
    m.budget_from(lambda: 3)
    m.loop_stall_from(lambda: 0.01)
    doc = {"in_flight": 0, "waiting": 0, "quarantine_size": 0, "held_seconds": {"buckets": [["1.0", 1]], "sum": 0.5},
           **dict.fromkeys(OUTCOMES + EVENTS, 1)}
    m.gateway_from(lambda: doc, OUTCOMES, EVENTS)
    m.set_gpu([type("D", (), {"index": 0, "total": 2, "free": 1, "used": 1})()])
    m.alerts_failed.labels("webhook")  # as the daemon does for each hook
    exported = set(re.findall(r"^(vllm_supervisor_\w+?)(?:_bucket|_sum|_count)?[{ ]", m.render().decode(), re.M))
    docs = Path(__file__).parents[2] / "docs"
    dashboard = json.loads((docs / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = (docs / "prometheus-alerts.yml").read_text()
    used = set(re.findall(r"vllm_supervisor_\w+", " ".join(exprs) + rules))
    used = {re.sub(r"_(bucket|sum|count)$", "", u) for u in used}
    assert used and used <= exported, used - exported
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_the_alert_rules_pass_promtool() -> None:
    """`promtool check rules` (CI installs it from Debian's prometheus package: .ci/run)."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    import pytest

    promtool = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool not installed (.ci/run installs it)")
    rules = Path(__file__).parents[2] / "docs" / "prometheus-alerts.yml"
    r = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_status_names_vllms_step_during_a_long_start_and_the_human_view_has_gateway_and_alert_lines() -> None:
    """Issue 18, item 8: STATUS= and `status` said only STARTING; no line for the gateway or a failing hook."""
    from supervisor.event_stream import StartupStep
    from supervisor.ops import oncall
    from supervisor.ops.notify import Notifier

    from tests.helpers.events import sc

    n = Notifier()
    sent: list[str] = []
    n.send = lambda *fields: sent.extend(fields)  # type: ignore[method-assign]
    n.on_event(sc("BACKOFF", "STARTING"))
    n.on_event(StartupStep(at=1.0, step="loading weights"))
    assert sent[-1].startswith("STATUS=STARTING (loading weights) chunk=8192")
    doc = {"state": "READY", "ready": True, "state_for_s": 5, "engine_pid": 7, "profile": {}, "restarts": 1,
           "gateway": {"listen": "0.0.0.0:8000", "waiting": 2, "held": 9, "replayed": 3, "streams_continued": 1,
                       "shedding": None, "quarantine_size": 1},
           "alerts": {"pagerduty": {"sent": 1, "failed": 2, "last_error": "pagerduty answered HTTP 503",
                                    "last_failed_at": 20.0, "last_sent_at": 10.0},
                      "slack": {"sent": 4, "failed": 1, "last_error": "x", "last_failed_at": 1.0, "last_sent_at": 9.0}},
           "fatal": {"exit_code": 4, "reason": "restart budget spent", "at": 0.0}}
    text = oncall.render_status(doc)
    assert "gateway   0.0.0.0:8000  2 held now, 9 held and 3 replayed" in text and "quarantine: 1" in text
    assert "failing: pagerduty (2 failed, 0 dropped): pagerduty answered HTTP 503" in text and "slack" not in text
    assert "GAVE UP   a previous supervisor ended FATAL at 1970-01-01 00:00:00 UTC with exit code 4" in text
