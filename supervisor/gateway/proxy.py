"""Forwarding one request to the engine and its answer back, with aiohttp on both sides.

A non-streaming answer is read whole before the client sees anything, and a stream's events are
held until one carries text, reasoning or a tool call: until then nothing of substance has reached
the client, so a request the engine lost on its way down can be sent again to the next engine
(``Unsent``). Once a stream is under way, an engine that dies under it leaves it open (``Cut``) for
the gateway to continue on the next engine (``resume``, see streams.py), or, where that cannot be
faithful, ends it with an OpenAI-style error event and [DONE].
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from supervisor.gateway import streams
from supervisor.gateway.streams import StreamState
from supervisor.host import routes, vllm_http

# RFC 9110 hop-by-hop headers, and what aiohttp sets itself.
HOP = frozenset(h.lower() for h in ("Connection", "Keep-Alive", "Proxy-Authenticate",
                                    "Proxy-Authorization", "TE", "Trailer", "Transfer-Encoding",
                                    "Upgrade", "Host", "Content-Length"))


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
    """A stream the client received (``broken``: the engine died under it; ``client_gone``: the
    client left, or read nothing for ``send_timeout_s`` and was cut)."""

    broken = False
    client_gone = False
    send_timeout_s: float | None = None
    # the client's connection, aborted when it stops reading
    client: asyncio.BaseTransport | None = None


async def _write(resp: Forwarded, data: bytes) -> None:
    """One write to the client, which must take its bytes within ``send_timeout_s``: a client
    that stops reading holds a connection and a slot at the engine for ever otherwise. Cut:
    the connection is aborted, and the caller sees the ConnectionResetError of a client that
    left."""
    try:
        async with asyncio.timeout(resp.send_timeout_s):
            await resp.write(data)
    except TimeoutError:
        if isinstance(resp.client, asyncio.Transport):
            resp.client.abort()
        raise ConnectionResetError(
            f"the client read nothing for {resp.send_timeout_s:g}s") from None


def passed(headers: Mapping[str, str], rid: str) -> CIMultiDict[str]:
    """The end-to-end headers (either way), with the request's id: vLLM names it in its dumps,
    and the credentials in the one form every vLLM reads (routes.canonical_auth)."""
    out = CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP)
    out["X-Request-Id"] = rid
    if "Authorization" in out:
        out["Authorization"] = routes.canonical_auth(out["Authorization"])
    return out


def new_session() -> aiohttp.ClientSession:
    # No cookie jar: a proxy must not carry one client's cookies to the next. No decompression:
    # bytes pass as-is.
    return aiohttp.ClientSession(connector=vllm_http.connector(limit=0, enable_cleanup_closed=True),
                                 cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0))


@dataclass
class Cut:
    """The engine died under a stream after content reached the client: ``resp`` is still open,
    and ``state`` says what the client has; the gateway continues it on the next engine
    (``resume``) or ends it."""

    resp: Forwarded
    state: StreamState
    why: str


async def forward(session: aiohttp.ClientSession, url: str, request: web.Request, body: bytes,
                  rid: str, state: StreamState, cuttable: bool,
                  send_timeout_s: float | None = None,) -> web.StreamResponse | Unsent | Cut:
    """Send ``request`` (its body already read) to ``url``; the client's response, Unsent, or
    (``cuttable``) Cut."""
    try:
        up = await vllm_http.send(session, request.method, url, data=body or None,
                                  allow_redirects=False, headers=passed(request.headers, rid))
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return Unsent(502, {}, _error_json(f"the engine did not answer: {type(exc).__name__}"),
                      str(exc))
    try:
        if up.status >= 500:
            return Unsent(up.status, up.headers, await up.read(),
                          f"the engine answered {up.status}")
        if "text/event-stream" not in up.headers.get("Content-Type", ""):
            return web.Response(status=up.status, body=await up.read(),
                                headers=passed(up.headers, rid))
        opening = await _until_content(up, state)
        if isinstance(opening, Unsent):
            return opening
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        up.close()
        return Unsent(502, {}, _error_json("the engine failed the request"),
                      f"{type(exc).__name__}: {exc}")
    except BaseException:
        up.close()
        raise
    resp = Forwarded(status=up.status, headers=passed(up.headers, rid))
    resp.send_timeout_s, resp.client = send_timeout_s, request.transport
    try:
        await resp.prepare(request)
        for event in opening:
            await _write(resp, event)
        return await _pump(up, resp, state, cuttable)
    # the client left mid-stream; closing the engine request aborts it in vLLM
    except ConnectionResetError:
        resp.client_gone = True
        return resp
    finally:
        _done_with(up)


async def resume(session: aiohttp.ClientSession, url: str, request: web.Request, body: bytes,
                 rid: str, cut: Cut) -> Forwarded | Cut:
    """Continue ``cut`` on the new engine with ``body`` (its continuation); Cut again if this
    engine fails too."""
    resp, state = cut.resp, cut.state
    state.resuming()
    try:
        up = await vllm_http.send(session, "POST", url, data=body, allow_redirects=False,
                                  headers=passed(request.headers, rid))
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return Cut(resp, state, f"the engine did not answer: {type(exc).__name__}")
    try:
        if up.status >= 500:
            return Cut(resp, state, f"the engine answered {up.status}")
        if up.status != 200 or "text/event-stream" not in up.headers.get("Content-Type", ""):
            detail = (await up.read())[:300].decode(errors="replace")
            return await _end(
                resp,
                f"the inference engine restarted during this response and refused to continue "
                f"it ({up.status}: {detail}); the response is incomplete, send the request again")
        return await _pump(up, resp, state, cuttable=True)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return Cut(resp, state, f"{type(exc).__name__}: {exc}")
    except ConnectionResetError:
        resp.client_gone = True
        return resp
    finally:
        _done_with(up)


async def end_cut(cut: Cut, why: str) -> Forwarded:
    """A cut stream that will not be continued: the client gets an error event and [DONE]."""
    try:
        return await _end(cut.resp, why)
    except ConnectionResetError:
        cut.resp.client_gone = True
        return cut.resp


async def _end(resp: Forwarded, message: str) -> Forwarded:
    resp.broken = True
    await _write(resp, engine_gone_event(message))
    await resp.write_eof()
    return resp


async def _until_content(up: aiohttp.ClientResponse, state: StreamState) -> list[bytes] | Unsent:
    """The stream's events up to its first one with substance (text, reasoning, a tool call):
    until then nothing reached the client, and a request the engine lost on the way can be
    sent again (role chunks and empty text do not count)."""
    held: list[bytes] = []
    while not state.content:
        chunk = await up.content.readany()
        if not chunk:
            if any(streams.is_done(e) for e in held):
                return held + ([state.pending] if state.pending else [])
            return Unsent(up.status, up.headers, b"".join(held),
                          "the engine's stream ended before any text")
        for event in state.events(chunk):
            if streams.is_error(event):
                return Unsent(up.status, up.headers, b"".join(held) + event,
                              "the engine's stream failed before its first token")
            state.note(event)
            held.append(event)
    return held


async def _pump(up: aiohttp.ClientResponse, resp: Forwarded, state: StreamState,
                cuttable: bool) -> Forwarded | Cut:
    """Relay the rest of the stream event by event (each write waits for the client's socket:
    backpressure)."""
    async for chunk in _chunks(up):
        if chunk is None:
            if cuttable and not state.finished:
                return Cut(resp, state, "the engine connection broke")
            return await _end(
                resp, "the inference engine failed during this response and is restarting; the "
                "response is incomplete, send the request again")
        for event in state.events(chunk):
            # vLLM's own error event: the engine failed under this stream
            if streams.is_error(event):
                if cuttable and not state.finished:
                    return Cut(resp, state, "the engine failed under the stream")
                resp.broken = True
            if state.resumed:
                rewritten = streams.rewrite(event, state, state.usage_wanted)
                if rewritten is None:
                    continue
                event = rewritten
            state.note(event)
            await _write(resp, event)
    if state.pending:
        await _write(resp, state.pending)
    if cuttable and not state.finished and not state.done:
        return Cut(resp, state, "the engine's stream ended early")
    await resp.write_eof()
    return resp


def _done_with(up: aiohttp.ClientResponse) -> None:
    # A stream cut short (the client left) closes the engine connection: vLLM aborts the request.
    if up.content.at_eof():
        up.release()
    else:
        up.close()


async def _chunks(up: aiohttp.ClientResponse) -> AsyncIterator[bytes | None]:
    """The engine's chunks; None once if the engine connection broke (the client's errors pass
    through)."""
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
    return json.dumps(
        {"error": {"message": message, "type": "server_error",
                   "code": "engine_unavailable"}}).encode()
