"""Precise refusals (issue 36): the quarantine refuses the request that kills, never its neighbours; every route that
runs the model is counted before the engine sees it; every refused body gets an answer; one auth rule end to end."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import aiohttp

from tests.helpers.gateway_client import completion, post
from tests.helpers.processes import Sup

# The stand-in's engine core dies of a real SIGSEGV on a request whose stop strings (or prompt) hold this word.
KILLER = {"engine": {"env": {"FAKE_VLLM_SEGV_WORD": "POISONPILL", "FAKE_VLLM_TOKEN_DELAY": "0.002"}},
          "gateway": {"hold_timeout_s": 60.0}, "restart": {"max_restarts": 8}}
SYSTEM_PROMPT = " ".join(f"rule {i}: answer politely and cite the policy" for i in range(40))


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "max_tokens": 4, **extra,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]}


async def until_refused(s: aiohttp.ClientSession, url: str, body: dict[str, Any], times: int = 4) -> list[int]:
    codes: list[int] = []
    for _ in range(times):
        codes.append((await post(s, url, body))[0])
        if 400 <= codes[-1] < 500:
            break
    return codes


def deaths(sup: Sup) -> int:
    return len(sup.events("engine.failed"))


async def test_a_request_that_kills_with_its_stop_field_never_gets_its_prompt_refused_for_others(
        supervise: Callable[..., Sup]) -> None:
    """On the old code, once {"prompt": "Hello", "stop": ["POISONPILL"]} was quarantined, a plain "Hello" from any
    client was 413: the key was the prompt alone. The same with a shared system prompt."""
    sup = supervise(KILLER)
    sup.wait_ready()
    assert sup.gateway is not None
    url = sup.gateway + "/v1/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        framed = await until_refused(s, url, completion("Hello", stop=["POISONPILL"]))
        assert framed[-1] == 413 and deaths(sup) <= 3, (framed, deaths(sup))
        sup.wait_ready()
        for innocent in (completion("Hello"), completion("Hello", stop=["\n"]), completion("Hello", temperature=0.2),
                         completion([1])):
            code, doc, _ = await post(s, url, innocent)
            assert code == 200, (innocent, doc)
        # A long system prompt every tenant shares, framed with the killing field: the others still get answers.
        chat_url = sup.gateway + "/v1/chat/completions"
        before = deaths(sup)
        framed = await until_refused(s, chat_url, chat("what is rule 3?", stop=["POISONPILL"]))
        assert framed[-1] == 413 and deaths(sup) - before <= 3, (framed, deaths(sup) - before)
        sup.wait_ready()
        for innocent in (chat("what is rule 3?"), chat("what is rule 4?"), chat("what is rule 3?", stop=["."])):
            code, doc, _ = await post(s, chat_url, innocent)
            assert code == 200, (innocent, doc)
        # The attacker's variant (the same fields, a word changed) is the same request: refused, no engine dies.
        before = deaths(sup)
        code, doc, _ = await post(s, chat_url, chat("what is rule 3 ?", stop=["POISONPILL"], temperature=0.5))
        assert code == 413 and doc["error"]["code"] == "request_quarantined" and deaths(sup) == before
        # Item 5: with two requests quarantined, a token-id prompt is served while the engine is READY.
        for ids in ([1], [[1], [2, 3]]):
            code, doc, _ = await post(s, url, completion(ids))  # type: ignore[arg-type]
            assert code == 200, (ids, doc)
    st = sup.wait_ready()
    assert st["gateway"]["quarantined"] == 2 and st["fatal"] is None


async def test_every_route_that_runs_the_model_answers_an_oversized_prompt_413_before_the_engine(
        supervise: Callable[..., Sup]) -> None:
    """On the old code a 40,000-token prompt on /invocations, /v1/responses or /pooling reached the engine."""
    sup = supervise({"gateway": {}})
    sup.wait_ready()
    assert sup.gateway is not None
    big = "word " * 40_000
    bodies = {"/invocations": [completion(big), {"model": "fake-model", "messages": [
                  {"role": "user", "content": big}]}],
              "/v1/responses": [{"model": "fake-model", "input": big}],
              "/pooling": [{"model": "fake-model", "input": big}], "/v1/embeddings": [{"model": "fake-model",
                                                                                        "input": ["hi", big]}],
              "/score": [{"model": "fake-model", "text_1": "q", "text_2": big}],
              "/rerank": [{"model": "fake-model", "query": "q", "documents": ["d", big]}],
              "/v1/completions": [completion(big)]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for path, shapes in bodies.items():
            for body in shapes:
                code, doc, _ = await post(s, sup.gateway + path, body)
                assert code == 413 and doc["error"]["code"] == "prompt_too_long", (path, code, doc)
                assert "40000 tokens" in doc["error"]["message"] and "at most 32768" in doc["error"]["message"]
        # What fits still goes through to the engine (the stand-in serves completions on /invocations).
        assert (await post(s, sup.gateway + "/invocations", completion("hello there")))[0] == 200


def write_then_read(addr: tuple[str, int], head: bytes, body: bytes) -> str:
    """A client that writes its whole body before it reads (most do): the status line it gets, or what broke."""
    with socket.create_connection(addr, timeout=30) as s:
        try:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head
                      + b"\r\n" + body)
        except OSError as exc:
            return f"send failed: {exc!r}"
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                got = s.recv(65536)
                if not got:
                    break
                answer += got
        except OSError as exc:
            return f"recv failed: {exc!r} after {answer[:40]!r}"
    return answer.decode(errors="replace")


def chunked(body: bytes) -> bytes:
    step = 1 << 16
    return b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + step]), body[i:i + step])
                    for i in range(0, len(body), step)) + b"0\r\n\r\n"


def test_a_body_over_either_cap_is_answered_413_naming_the_cap_never_a_bare_close(
        supervise: Callable[..., Sup]) -> None:
    """On the old code the gateway closed the connection with the body unread: the kernel's reset reached a client
    still writing it before the answer did (no status line)."""
    sup = supervise({"gateway": {"max_body_bytes": 8 << 20, "max_body_bytes_in_flight": 2 << 20}})
    sup.wait_ready()
    assert sup.gateway is not None
    addr = ("127.0.0.1", int(sup.gateway.rsplit(":", 1)[1]))
    over_one, over_all = b'{"prompt": "' + b"a" * (12 << 20) + b'"}', b'{"prompt": "' + b"a" * (4 << 20) + b'"}'
    cases = [(over_one, b"Content-Length: %d\r\n" % len(over_one), "max_body_bytes)"),
             (chunked(over_one), b"Transfer-Encoding: chunked\r\n", "max_body_bytes_in_flight"),  # met first
             (over_all, b"Content-Length: %d\r\n" % len(over_all), "max_body_bytes_in_flight"),
             (chunked(over_all), b"Transfer-Encoding: chunked\r\n", "max_body_bytes_in_flight")]
    for body, head, cap in cases:
        answer = write_then_read(addr, head, body)
        assert answer.startswith("HTTP/1.1 413"), (head, answer[:200])
        error = json.loads(answer.split("\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "body_too_large" and cap in error["message"], error
    st = sup.status()
    assert st is not None and st["gateway"]["413"] == 4 and st["gateway"]["body_bytes_held"] == 0


async def test_one_bearer_rule_from_the_client_to_the_engine(supervise: Callable[..., Sup]) -> None:
    """On the old code the gateway admitted ``bearer <key>`` (the scheme is case-insensitive) and passed it on as
    sent; a vLLM that compares the whole header (the stand-in, as older vLLM) answered 401."""
    sup = supervise({"engine": {"args": {"api_key": "sekrit"}}, "gateway": {}})
    sup.wait_ready()
    assert sup.gateway is not None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        for path in ("/v1/completions", "/invocations"):
            for scheme in ("Bearer", "bearer", "BEARER"):
                code, doc, _ = await post(s, sup.gateway + path, completion("hi"),
                                          {"Authorization": f"{scheme} sekrit"})
                assert code == 200, (path, scheme, doc)
            for wrong in ({"Authorization": "bearer nope"}, {"Authorization": "Basic sekrit"}, {}):
                assert (await post(s, sup.gateway + path, completion("hi"), wrong))[0] == 401, (path, wrong)
