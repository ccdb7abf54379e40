"""What comes in at the public port before the gateway looks at it: the credentials, and the body,
read under three bounds (each body's size, the time it may take, and the bytes of every body held
at once) and parsed where it cannot starve supervision (parsing.py).

A body is read whole before anything else is done with it (it is parsed, hashed, and kept to be sent
again after an engine death). Each is capped (``max_body_bytes``) and timed (``body_timeout_s``),
but forty clients each sending 16 MiB but the last byte held 640 MiB in the process that supervises,
and held requests keep their bodies while the engine restarts (160 x 16 MiB peaked at 9.2 GB RSS).
So every byte read is counted against ``max_body_bytes_in_flight`` until its request is over; a body
that would pass it is refused with 503 + Retry-After, and its bytes are given back at once.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from supervisor.config import GatewayConfig
from supervisor.decide import admission
from supervisor.decide.admission import Parsed, Rejection
from supervisor.gateway import parsing
from supervisor.host import routes

CHUNK = 1 << 16
# after a refusal mid-body: how long the rest is read and dropped before the connection closes
LINGER_S = 5.0
# ... unless nothing of it comes for this long (a stalled body's connection closes at once)
LINGER_IDLE_S = 1.0


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

    async def read(self, request: web.Request, cap: int, timeout_s: float,
                   retry_after_s: float) -> bytes | Rejection:
        """The body, refused (413) as soon as it is known to be over ``cap`` (a huge body is
        never read whole), (408) when it has not all arrived within ``timeout_s``, (503) when
        the gateway holds too many bytes."""
        if request.content_length is not None and request.content_length > cap:
            return too_big(cap)
        length = request.content_length
        if length is not None and self.budget.cap and length > self.budget.cap:
            return too_big_for_all(self.budget.cap)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._read(request, cap, retry_after_s)
        except TimeoutError:
            return Rejection(
                408, "body_timeout", f"the request body did not arrive within {timeout_s:g}s; "
                "send it whole, faster")

    async def _read(self, request: web.Request, cap: int,
                    retry_after_s: float) -> bytes | Rejection:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.content.iter_chunked(CHUNK):
            size += len(chunk)
            if size > cap:
                return too_big(cap)
            # chunked: its size is known only as it comes
            if self.budget.cap and size > self.budget.cap:
                return too_big_for_all(self.budget.cap)
            if not self.budget.take(len(chunk)):
                return Rejection(
                    503, "too_many_bodies", "the server holds as many request bodies as it may; "
                    f"retry after {retry_after_s:g}s", "server_error", retry_after_s)
            self.taken += len(chunk)
            chunks.append(chunk)
        return b"".join(chunks)

    def release(self) -> None:
        self.budget.give(self.taken)
        self.taken = 0


def too_big(cap: int) -> Rejection:
    return Rejection(
        413, "body_too_large",
        f"the request body is over the {cap}-byte limit of this server on one "
        "request body ([gateway] max_body_bytes); send a smaller body")


def too_big_for_all(cap: int) -> Rejection:
    """A body larger than every body held at once may be: it could never be admitted, so not a
    503 to retry."""
    return Rejection(
        413, "body_too_large",
        f"the request body is over the {cap}-byte limit of this server on all "
        "request bodies held at once ([gateway] max_body_bytes_in_flight); "
        "send a smaller body")


class Intake:
    """The public port's door: who may come in (the engine's API keys), and their bodies."""

    def __init__(self, g: GatewayConfig, api_keys: list[str]) -> None:
        self.g, self.api_keys = g, api_keys
        self.budget = BodyBudget(g.max_body_bytes_in_flight)
        self.parser = parsing.BodyParser()

    def configure(self, g: GatewayConfig) -> None:
        self.g, self.budget.cap = g, g.max_body_bytes_in_flight

    def authorized(self, request: web.Request) -> bool:
        return not self.api_keys or routes.authorized(request, self.api_keys)

    def body(self) -> Body:
        return Body(self.budget)

    async def read(self, request: web.Request, body: Body) -> bytes | Rejection:
        """The body, or its refusal (its bytes given back at once, before close_with drops the
        rest of it)."""
        got = await body.read(request, self.g.max_body_bytes, self.g.body_timeout_s,
                              self.g.retry_after_s)
        if isinstance(got, Rejection):
            body.release()
        return got

    async def parse(self, route: str, raw: bytes) -> Parsed | Rejection:
        return await self.parser.parse(route, raw)

    async def sketch(self, raw: bytes) -> tuple[int, ...]:
        """The prompt's sketch (admission.body_sketch), in the parser pool for a big body."""
        return await self.parser.run(len(raw), admission.body_sketch, raw)

    def close(self) -> None:
        self.parser.close()


async def close_with(answer: web.Response, request: web.Request,
                     linger_s: float = LINGER_S) -> web.Response:
    """Send ``answer`` and close the connection once the client has had the time to read it.

    A socket closed with bytes of the client's still unread makes the kernel send a reset, which
    destroys the answer on its way if the client has not read it yet; most clients write their
    whole body before they read, and saw a bare reset and no status line. So, like nginx's and
    Apache's lingering close, the rest of the body is read and dropped (never held, never
    counted) for at most ``linger_s`` (LINGER_IDLE_S without a byte ends it: nginx's
    lingering_time and lingering_timeout), then the connection is closed."""
    answer.force_close()
    await answer.prepare(request)
    await answer.write_eof()
    deadline = asyncio.get_running_loop().time() + linger_s
    # a timeout, a reset or a malformed rest of body: close now
    with contextlib.suppress(Exception):
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            # a client that went quiet is not writing
            async with asyncio.timeout(min(left, LINGER_IDLE_S)):
                if not await request.content.readany():
                    break
    if request.transport is not None:
        request.transport.close()
    return answer
