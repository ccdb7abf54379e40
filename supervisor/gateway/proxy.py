"""Forwarding one request to the engine and its answer back, with aiohttp on both sides.

A non-streaming answer is read whole before the client sees anything, and a stream's first
chunk is held until it arrives: until then nothing has reached the client, so a request the
engine lost on its way down can be sent again to the next engine (``Unsent``). Once a stream
is under way, an engine that dies ends it with an OpenAI-style error event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

# RFC 9110 hop-by-hop headers, and what aiohttp sets itself.
HOP = frozenset(h.lower() for h in ("Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
                                    "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length"))
STREAM_ERROR_PREFIX = b'data: {"error"'


def engine_gone_event(message: str) -> bytes:
    doc = {"error": {"message": message, "type": "server_error", "code": "engine_restarted"}}
    return b"data: " + json.dumps(doc).encode() + b"\n\ndata: [DONE]\n\n"


@dataclass(frozen=True)
class Unsent:
    """The engine failed the request before anything reached the client: it may be sent again."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    reason: str

    def response(self, rid: str) -> web.Response:
        """The engine's own answer, passed through when the engine turned out to be alive."""
        return web.Response(status=self.status, body=self.body, headers=passed(self.headers, rid))


class Forwarded(web.StreamResponse):
    """A stream the client received (``broken``: the engine died under it; ``client_gone``: the client left)."""

    broken = False
    client_gone = False


def passed(headers: Mapping[str, str], rid: str) -> CIMultiDict[str]:
    """The end-to-end headers (either way), with the request's id: vLLM names it in its dumps."""
    out = CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP)
    out["X-Request-Id"] = rid
    return out


def new_session() -> aiohttp.ClientSession:
    # No cookie jar: a proxy must not carry one client's cookies to the next. No decompression: bytes pass as-is.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
                                 cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0))


async def forward(session: aiohttp.ClientSession, url: str, request: web.Request, body: bytes,
                  rid: str) -> web.StreamResponse | Unsent:
    """Send ``request`` (its body already read) to ``url``; the client's response, or Unsent."""
    try:
        up = await session.request(request.method, url, data=body or None, allow_redirects=False,
                                   headers=passed(request.headers, rid))
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return Unsent(502, {}, _error_json(f"the engine did not answer: {type(exc).__name__}"), str(exc))
    try:
        if up.status >= 500:
            return Unsent(up.status, up.headers, await up.read(), f"the engine answered {up.status}")
        if "text/event-stream" not in up.headers.get("Content-Type", ""):
            return web.Response(status=up.status, body=await up.read(), headers=passed(up.headers, rid))
        first = await up.content.readany()  # the first token: until then the stream can still be replayed
        if not first or first.startswith(STREAM_ERROR_PREFIX):
            return Unsent(up.status, up.headers, first + await up.read(),
                          "the engine's stream failed before its first token")
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        up.close()
        return Unsent(502, {}, _error_json("the engine failed the request"), f"{type(exc).__name__}: {exc}")
    except BaseException:
        up.close()
        raise
    try:
        return await _relay(up, first, request, rid)
    finally:
        # A stream cut short (the client left) closes the engine connection: vLLM aborts the request.
        if up.content.at_eof():
            up.release()
        else:
            up.close()


async def _relay(up: aiohttp.ClientResponse, first: bytes, request: web.Request, rid: str) -> Forwarded:
    resp = Forwarded(status=up.status, headers=passed(up.headers, rid))
    await resp.prepare(request)
    try:
        await resp.write(first)  # each write waits for the client's socket to drain: backpressure reaches the engine
        async for chunk in _chunks(up):
            if chunk is None:
                resp.broken = True
                await resp.write(engine_gone_event("the inference engine failed during this response and is "
                                                   "restarting; the response is incomplete, send the request again"))
                break
            if STREAM_ERROR_PREFIX in chunk:  # vLLM's own error event: the engine failed under this stream
                resp.broken = True
            await resp.write(chunk)
        await resp.write_eof()
    except ConnectionResetError:  # the client left mid-stream; the caller closes the engine request
        resp.client_gone = True
    return resp


async def _chunks(up: aiohttp.ClientResponse) -> AsyncIterator[bytes | None]:
    """The engine's chunks; None once if the engine connection broke (the client's errors pass through)."""
    while True:
        try:
            chunk = await up.content.readany()
        except (aiohttp.ClientError, OSError, TimeoutError):
            yield None
            return
        if not chunk:
            return
        yield chunk


def _error_json(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error", "code": "engine_unavailable"}}).encode()
