"""asyncio's one idiom the parts share: cancel tasks and wait until they are gone."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel ``tasks`` (None and finished ones are skipped) and wait for each to end. Their
    CancelledError is theirs and swallowed; the caller's own cancellation, arriving meanwhile,
    is not (it propagates)."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    for t in live:
        try:
            await t
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise
