"""Reading client bodies under three bounds: each body's size, the time it may take, and the bytes of every
body the gateway holds at once.

A body is read whole before anything else is done with it (it is parsed, hashed, and kept to be sent again
after an engine death). Each is capped (``max_body_bytes``) and timed (``body_timeout_s``), but forty clients
each sending 16 MiB but the last byte held 640 MiB in the process that supervises, and held requests keep
their bodies while the engine restarts (160 x 16 MiB peaked at 9.2 GB RSS). So every byte read is counted
against ``max_body_bytes_in_flight`` until its request is over; a body that would pass it is refused with
503 + Retry-After, and its bytes are given back at once.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from supervisor.decide.admission import Rejection

CHUNK = 1 << 16


class BodyBudget:
    """The bytes of client bodies held now, against their cap."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held = 0

    def take(self, n: int) -> bool:
        if self.cap and self.held + n > self.cap:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held = max(0, self.held - n)


class Body:
    """One request's body as read so far; ``release`` gives its bytes back to the budget (once)."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.taken = 0

    async def read(self, request: web.Request, cap: int, timeout_s: float, retry_after_s: float) -> bytes | Rejection:
        """The body, refused (413) as soon as it is known to be over ``cap`` (a huge body is never read whole),
        (408) when it has not all arrived within ``timeout_s``, (503) when the gateway holds too many bytes."""
        if request.content_length is not None and request.content_length > cap:
            return too_big(cap)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._read(request, cap, retry_after_s)
        except TimeoutError:
            return Rejection(408, "body_timeout", f"the request body did not arrive within {timeout_s:g}s; "
                                                  "send it whole, faster")

    async def _read(self, request: web.Request, cap: int, retry_after_s: float) -> bytes | Rejection:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.content.iter_chunked(CHUNK):
            size += len(chunk)
            if size > cap:
                return too_big(cap)
            if not self.budget.take(len(chunk)):
                return Rejection(503, "too_many_bodies", "the server holds as many request bodies as it may; "
                                 f"retry after {retry_after_s:g}s", "server_error", retry_after_s)
            self.taken += len(chunk)
            chunks.append(chunk)
        return b"".join(chunks)

    def release(self) -> None:
        self.budget.give(self.taken)
        self.taken = 0


def too_big(cap: int) -> Rejection:
    return Rejection(413, "body_too_large", f"the request body is over the {cap}-byte limit of this server")
