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


def test_a_long_prefill_moves_only_the_kv_cache_usage_and_that_is_progress() -> None:
    """vLLM counts a prompt's tokens when its prefill ends: a long prompt's chunked prefill freezes both token
    counters for as long as it runs (a CI run saw a 3,000-token prompt with prompt_logprobs at chunk 256 take over
    10 s on two loaded cores), while each chunk takes KV-cache blocks. A wedge freezes both."""
    live = Liveness(H, 900.0, 0.0)
    for t in range(0, 40, 2):  # 20 chunks, tokens frozen at 500, the KV cache filling
        assert live.metrics(t, Progress(1, 0, 500, kv_usage=0.01 * t)) is None, t
    wedged = Progress(1, 0, 500, kv_usage=0.40)
    assert live.metrics(40, wedged) is None  # changed since the last reading: the wedge starts here
    assert live.metrics(49, wedged) is None
    hang = live.metrics(50, wedged) or ""
    assert "no token progress for 10s" in hang and "KV-cache usage at 40.00%" in hang, hang


def test_a_canary_behind_work_that_progresses_waits_and_rule_3_judges_the_engine() -> None:
    """The canary is sent when idle; a long prompt arriving with it holds it back (vLLM schedules the prefill
    first). While that work progresses the canary is not overdue; once it freezes both rules fire; once the engine
    is idle again an unanswered canary is a hang."""
    live = Liveness(H, 900.0, 0.0)
    live.ready(0.0)
    live.metrics(29.0, Progress(0, 0, 100))
    live.canary_sent(30.0)
    for t in range(31, 60):  # the long prefill and the canary: pending, the KV cache filling
        assert live.metrics(t, Progress(1, 1, 100, kv_usage=t / 100)) is None
        assert live.canary_overdue(t) is None, t
    stuck = Progress(1, 1, 100, kv_usage=0.59)
    assert live.canary_overdue(68.9) is None  # moved at 59: rule 3's 10 s are not over
    assert live.metrics(69.0, stuck) is not None and live.canary_overdue(69.0) is not None

    idle = Liveness(H, 900.0, 0.0)
    idle.ready(0.0)
    idle.canary_sent(30.0)
    idle.metrics(35.0, Progress(1, 0, 100, kv_usage=0.1))
    idle.metrics(38.0, Progress(0, 0, 140, kv_usage=0.0))  # the work ended; the canary never came back
    assert "no answer within hang_timeout_s=10s" in (idle.canary_overdue(40.0) or "")


def test_a_canary_whose_request_gave_up_after_progress_held_it_off_is_let_go() -> None:
    live = Liveness(H, 900.0, 0.0)
    live.ready(0.0)
    live.canary_sent(30.0)
    live.canary_unanswered(35.0)  # before its deadline (a refused connection): the clock still judges it
    assert not live.canary_due(100.0)
    live.metrics(49.0, Progress(1, 0, 100, kv_usage=0.2))
    live.metrics(50.0, Progress(1, 0, 100, kv_usage=0.3))
    assert live.canary_overdue(50.0) is None  # held off by progress
    live.canary_unanswered(50.0)  # its request's own timeout (2x hang_timeout_s)
    assert live.canary_overdue(55.0) is None
    live.metrics(56.0, Progress(0, 0, 900, kv_usage=0.0))
    assert live.canary_due(80.0)  # the next one, once idle
