"""The four hang rules, on a clock the test owns."""

from __future__ import annotations

from supervisor.config import HealthConfig
from supervisor.decide.liveness import Liveness, Progress

H = HealthConfig(hang_timeout_s=10.0, probe_interval_s=1.0, canary_interval_s=30.0)


def test_start_timeout_fires_only_after_start_timeout_s() -> None:
    live = Liveness(H, start_timeout_s=900.0, spawned_at=100.0)
    assert live.start_overdue(100.0 + 900.0) is None
    assert "start_timeout_s=900s" in (live.start_overdue(100.0 + 900.1) or "")


def test_token_progress_sees_a_hang_only_when_work_is_pending_and_tokens_freeze() -> None:
    live = Liveness(H, 900.0, 0.0)
    busy = Progress(1, 0, 100)
    assert live.metrics(0, busy) is None
    assert live.metrics(9, busy) is None
    assert "no token progress for 10s" in (live.metrics(10, busy) or "")
    live2 = Liveness(H, 900.0, 0.0)
    for t in range(0, 30, 5):
        assert live2.metrics(t, Progress(0, 0, 100)) is None  # idle is not hung
    for t in range(30, 60, 5):
        assert live2.metrics(t, Progress(1, 0, 100 + t)) is None  # busy and progressing


def test_metrics_silence_fires_after_hang_timeout_and_an_answer_resets_it() -> None:
    live = Liveness(H, 900.0, 0.0)
    assert live.metrics(0, None) is None
    assert live.metrics(9.9, None) is None
    assert live.metrics(10, Progress(0, 0, 1)) is None  # it answered: the silence is over
    assert live.metrics(11, None) is None
    assert "/metrics unanswered for 10s" in (live.metrics(21, None) or "")


def test_canary_is_due_when_idle_and_overdue_only_on_the_clock() -> None:
    live = Liveness(H, 900.0, 0.0)
    live.ready(0.0)
    assert not live.canary_due(29.9)
    assert live.canary_due(30.0)
    live.canary_sent(30.0)
    assert not live.canary_due(100.0)  # one in flight at a time
    assert live.canary_overdue(39.9) is None
    assert "no answer within hang_timeout_s=10s" in (live.canary_overdue(40.0) or "")
    live.canary_done()
    assert live.canary_overdue(1000.0) is None


def test_no_canary_while_requests_are_pending() -> None:
    live = Liveness(H, 900.0, 0.0)
    live.ready(0.0)
    live.metrics(30.0, Progress(running=1, waiting=0, tokens=5))
    assert not live.canary_due(31.0)
    live.metrics(32.0, Progress(running=0, waiting=0, tokens=9))
    assert live.canary_due(32.0)
