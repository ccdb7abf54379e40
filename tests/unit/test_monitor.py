"""The engine monitor's start: how soon after vLLM answers /health 200 the start sees it."""

from __future__ import annotations

import asyncio

from supervisor.config import HealthConfig
from supervisor.decide.liveness import Liveness
from supervisor.engine.monitor import START_HEALTH_POLL_S, Monitor
from supervisor.engine_states import TriggerKind

from tests.helpers.clock import VirtualClock


class Engine:
    """/health 200 from ``healthy_at`` on (a refused connection, None, before)."""

    def __init__(self, clock: VirtualClock, healthy_at: float) -> None:
        self.clock, self.healthy_at = clock, healthy_at

    async def health(self, timeout: float) -> int | None:
        return 200 if self.clock.now >= self.healthy_at else None


def seen_after(healthy_at: float, start_timeout_s: float = 600.0) -> tuple[object, float]:
    clock = VirtualClock()
    monitor = Monitor(HealthConfig(), clock, Engine(clock, healthy_at), lambda _: None,  # type: ignore[arg-type]
                      Liveness(HealthConfig(), start_timeout_s, 0.0), "canary")
    fired = asyncio.run(monitor.until_healthy())
    return fired, clock.now


def test_a_start_sees_health_within_one_short_poll_however_long_it_took() -> None:
    # A restart from the standby is about 10 s, a fresh host's first start minutes: the asks must not slow down
    # with the wait, or the start's last half second is spent between two asks.
    for healthy_at in (0.3, 9.93, 11.61, 116.27):
        fired, seen = seen_after(healthy_at)
        assert fired is None
        assert healthy_at <= seen <= healthy_at + START_HEALTH_POLL_S + 1e-9, (healthy_at, seen)
    assert START_HEALTH_POLL_S <= 0.05


def test_a_start_never_healthy_is_a_hang_once_its_start_timeout_passes() -> None:
    fired, seen = seen_after(float("inf"), start_timeout_s=30.0)
    assert fired is not None and fired[0] == TriggerKind.HANG and "start_timeout_s=30" in fired[1]
    assert 30.0 < seen <= 30.0 + START_HEALTH_POLL_S + 1e-9
