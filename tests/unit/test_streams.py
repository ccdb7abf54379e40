"""The gateway's stream relay (proxy.forward) against an in-process upstream that streams like vLLM's chat route."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from supervisor.gateway import proxy, streams
from supervisor.gateway.streams import StreamState

ROLE = {"delta": {"role": "assistant", "content": ""}}


def sse(delta: dict[str, Any], finish: str | None = None) -> bytes:
    doc = {"id": "chatcmpl-1", "created": 1, "object": "chat.completion.chunk",
           "choices": [{"index": 0, **delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def upstream(deltas: list[dict[str, Any]], gap_s: float) -> web.Application:
    """vLLM's chat stream: its role chunk at once, then one delta every ``gap_s``, then the finish and [DONE]."""
    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse(ROLE))
        for d in deltas:
            await asyncio.sleep(gap_s)
            await resp.write(sse(d))
        await resp.write(sse({"delta": {}}, "stop") + b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def relay(deltas: list[dict[str, Any]], gap_s: float) -> tuple[float, float, StreamState]:
    """Seconds until the client had the response's head, until it had all of it, and what the relay learnt."""
    state = StreamState("chat")
    async with TestServer(upstream(deltas, gap_s)) as up, proxy.new_session() as session:
        async def handler(request: web.Request) -> web.StreamResponse:
            out = await proxy.forward(session, str(up.make_url("/v1/chat/completions")), request,
                                      await request.read(), "gw-1", state, cuttable=True)
            assert isinstance(out, web.StreamResponse)
            return out

        front = web.Application()
        front.router.add_post("/v1/chat/completions", handler)
        async with TestServer(front) as gw, aiohttp.ClientSession() as client:
            t0 = time.monotonic()
            async with client.post(gw.make_url("/v1/chat/completions"), json={"stream": True}) as resp:
                head = time.monotonic() - t0
                await resp.read()
            return head, time.monotonic() - t0, state


@pytest.mark.parametrize("first", [
    pytest.param({"delta": {"reasoning": "Let"}}, id="reasoning"),
    pytest.param({"delta": {"reasoning_content": "Let"}}, id="reasoning_content (older vLLM)"),
    pytest.param({"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]}},
                 id="tool call"),
])
async def test_a_stream_without_content_tokens_reaches_the_client_as_it_is_made(first: dict[str, Any]) -> None:
    """A reasoning model's stream was held until its first content token (minutes of reasoning), and a tool call's
    until its end: the client saw nothing while it was made. Its first delta of substance now commits it."""
    head, total, state = await relay([first] * 20, gap_s=0.05)
    assert total >= 1.0 and head < 0.5, (head, total)
    assert state.content and state.finished


async def test_a_stream_of_only_empty_deltas_is_still_held_as_unsent() -> None:
    head, _, state = await relay([{"delta": {"content": ""}}] * 10, gap_s=0.05)
    assert head >= 0.45 and not state.content  # nothing of substance came: released whole at its end


@pytest.mark.parametrize("field, why", [("reasoning", "reasoning output"), ("tool_calls", "tool calls")])
def test_a_cut_stream_that_carried_reasoning_or_a_tool_call_is_not_continued(field: str, why: str) -> None:
    state = StreamState("chat")
    state.note(sse(ROLE))
    value: Any = [{"index": 0, "function": {"name": "f"}}] if field == "tool_calls" else "hmm"
    state.note(sse({"delta": {field: value}}))
    assert state.content
    more = streams.continue_request(json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), state)
    assert more.body is None and more.why_not is not None and more.why_not.startswith(why)



def test_a_token_count_written_as_a_string_or_a_float_is_continued_or_refused_never_raised() -> None:
    """Issue 25: "max_tokens": "50.0" (vLLM accepts it) raised in the continuation: the client's stream just
    stopped, with no error event and no [DONE]."""
    state = StreamState("completions", text=["a", "b"], tokens=2)
    for given in ("50.0", 50.0, "50", 50):
        more = streams.continue_request(json.dumps({"prompt": "p", "max_tokens": given, "stream": True}).encode(),
                                        state)
        assert more.why_not is None and json.loads(more.body or b"{}")["max_tokens"] == 48, given
    for bad in ("fifty", 50.5, True, [50]):
        more = streams.continue_request(json.dumps({"prompt": "p", "max_tokens": bad}).encode(), state)
        assert more.body is None and "max_tokens" in (more.why_not or ""), bad


@pytest.mark.parametrize(("client_gone", "broken", "cut_short", "counted"), [
    (False, False, False, {"forwarded": 1}),
    (True, False, False, {"client_disconnected": 1}),
    # Ended with an error event by the proxy: a stream that cannot be cut, or a resumed one the next engine
    # refused to continue (counted as whole before issue 37's Answers.forwarded).
    (False, True, False, {"forwarded": 1, "streams_broken": 1}),
    # A cut stream the gateway ended (end_cut): most of it was the client's, even if it left before the end.
    (True, True, True, {"forwarded": 1, "streams_broken": 1}),
    (False, False, True, {"forwarded": 1, "streams_broken": 1}),
])
def test_how_a_forwarded_request_ended_is_counted_once(client_gone: bool, broken: bool, cut_short: bool,
                                                      counted: dict[str, int]) -> None:
    from types import SimpleNamespace

    from supervisor.gateway.answers import Answers
    from supervisor.gateway.server import COUNTERS

    counters = dict.fromkeys(COUNTERS, 0)
    out = proxy.Forwarded()
    out.client_gone, out.broken = client_gone, broken
    host: Any = SimpleNamespace(monotonic=time.monotonic, wall=time.time)
    assert Answers(counters, host, lambda e: None).forwarded(out, cut_short=cut_short) is out
    assert {k: v for k, v in counters.items() if v} == counted
