"""How late the supervisor's event loop runs: the loop that pets the watchdog, serves /healthz and
parses client bodies, so a stall here is what a hostile client would aim for.

A task asks to wake every ``INTERVAL_S`` and notes how much later than asked it woke. This measures
the loop itself, so it reads the loop's own clock, not the host seam's (a test's fake clock would
measure nothing).
"""

from __future__ import annotations

import asyncio

INTERVAL_S = 0.05


class LoopLag:
    def __init__(self) -> None:
        self.max_s = 0.0  # the longest stall since the supervisor started
        self.last_s = 0.0  # the last one measured

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + INTERVAL_S
            await asyncio.sleep(INTERVAL_S)
            self.last_s = max(0.0, loop.time() - asked)
            self.max_s = max(self.max_s, self.last_s)

    def status(self) -> dict[str, float]:
        return {"max_stall_s": round(self.max_s, 3), "last_stall_s": round(self.last_s, 3)}
