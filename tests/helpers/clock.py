"""A virtual monotonic clock for unit tests of code that waits through the host seam (``monotonic``, ``sleep``):
each sleep moves the clock, so nothing waits for real."""

from __future__ import annotations


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
