"""Connections to the engine (vllm_http.send, for the gateway and the supervisor's own probes and canary): a pooled
keep-alive connection the engine closed is neither a client's failure nor a sign of a hung engine."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from supervisor.gateway import proxy
from supervisor.gateway.streams import StreamState
from supervisor.host import vllm_http
from supervisor.host.vllm_http import EngineClient

# A completion, and the model list (the supervisor's client asks /v1/models once before its first completion).
ANSWER = json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": "ok"}], "data": [{"id": "m"}]}).encode()


async def read_request(reader: asyncio.StreamReader) -> bool:
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return False
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    return True


class Engine:
    """An engine whose keep-alive runs out the way uvicorn's does on a busy host: each connection answers its
    first request and keeps the connection open, then closes it when the next request arrives on it, unanswered."""

    def __init__(self) -> None:
        self.answered = 0
        self.dropped = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if await read_request(reader):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(ANSWER) + ANSWER)
                await writer.drain()
                self.answered += 1
            if await read_request(reader):
                self.dropped += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def through_gateway(url: str, requests: int) -> list[int]:
    """The statuses ``requests`` clients get, one after another, from a gateway relaying to ``url``."""
    async with proxy.new_session() as session:
        async def handler(request: web.Request) -> web.StreamResponse:
            out = await proxy.forward(session, url, request, await request.read(), "gw-1", StreamState("completions"),
                                      cuttable=True)
            if isinstance(out, proxy.Unsent):
                return out.response("gw-1")
            assert isinstance(out, web.StreamResponse)
            return out

        front = web.Application()
        front.router.add_post("/v1/completions", handler)
        async with TestServer(front) as gw, aiohttp.ClientSession() as client:
            statuses = []
            for _ in range(requests):
                async with client.post(gw.make_url("/v1/completions"), json={"prompt": "hi"}) as resp:
                    await resp.read()
                    statuses.append(resp.status)
            return statuses


async def test_a_pooled_connection_the_engine_closed_is_retried_on_a_new_one() -> None:
    engine = Engine()
    server = await asyncio.start_server(engine.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        statuses = await through_gateway(f"http://127.0.0.1:{port}/v1/completions", 4)
    finally:
        server.close()
        await server.wait_closed()
    assert statuses == [200, 200, 200, 200]  # the old relay answered 502 from the second request on
    assert engine.dropped >= 1 and engine.answered == 4


async def test_the_canary_on_a_connection_the_engine_closed_still_gets_its_answer() -> None:
    """The canary is a POST, which aiohttp never sends again by itself: lost this way, it read as a hung engine
    after hang_timeout_s (the probes' GETs aiohttp already retries)."""
    engine = Engine()
    server = await asyncio.start_server(engine.serve, "127.0.0.1", 0)
    client = EngineClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        answers = [await client.complete("Hello", 1, timeout=5.0) for _ in range(3)]
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
    assert [a["choices"][0]["text"] for a in answers] == ["ok", "ok", "ok"]  # the old client raised EngineError
    assert engine.dropped >= 1


async def test_an_engine_that_refuses_connections_is_not_retried() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once it is closed
    t0 = time.monotonic()
    async with proxy.new_session() as session:
        with pytest.raises(aiohttp.ClientConnectorError) as refused:
            await vllm_http.send(session, "POST", f"http://127.0.0.1:{port}/v1/completions", data=b"{}")
    assert not vllm_http.stale_connection(refused.value)
    assert time.monotonic() - t0 < 1.0


async def test_an_exact_count_sends_the_prompt_as_the_parser_encoded_it_with_the_served_model_spliced_in() -> None:
    """Issue 25: the exact count json-encoded every /tokenize body on the event loop (100 held 16 MiB prompts
    released at READY stalled it 15 s). The parser (in its pool for a big body) encodes it; the client only splices
    the served model's name in front."""
    from supervisor.decide import admission

    got: list[dict[str, object]] = []

    async def tokenize(request: web.Request) -> web.Response:
        got.append(await request.json())
        return web.json_response({"count": 7})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "served-name"}]})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    async with TestServer(app) as server:
        client = EngineClient(str(server.make_url("")).rstrip("/"), None)
        try:
            plain = admission.parse("completions", json.dumps({"prompt": "héllo  wörld"}).encode())
            named = admission.parse("chat", json.dumps({"model": "mine", "messages": [
                {"role": "user", "content": "hi"}]}).encode())
            assert isinstance(plain, admission.Parsed) and isinstance(named, admission.Parsed)
            assert isinstance(plain.tokenize_body, bytes)
            assert await client.tokenize(plain.tokenize_body) == 7
            assert await client.tokenize(named.tokenize_body) == 7
        finally:
            await client.close()
    assert got == [{"model": "served-name", "prompt": "héllo  wörld"},
                   {"model": "mine", "messages": [{"role": "user", "content": "hi"}]}]


def test_the_aiohttp_internals_the_listener_relies_on_are_there() -> None:
    """Issue 39: GuardedSite sets BaseSite._server and reads _backlog (aiohttp privates): pyproject caps aiohttp below
    the next minor, and this says which internals to check before the cap moves."""
    import inspect

    import aiohttp
    from aiohttp.web_runner import BaseSite

    site_init = inspect.getsource(BaseSite.__init__)
    assert "self._backlog" in site_init and "self._server" in site_init
    assert "self._server" in inspect.getsource(BaseSite.stop)  # what stops our Acceptor (its close())
    assert hasattr(aiohttp.StreamReader, "readany")  # the lingering close drains with it
