"""The gateway end to end: `vllm-supervisor run` with [gateway], over loopback HTTP, in front of the stand-in."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from supervisor.host.vllm_http import parse_progress

from tests.helpers.gateway_client import completion, post
from tests.helpers.processes import Sup

GW: dict[str, Any] = {"gateway": {"hold_timeout_s": 60.0, "pressure_poll_s": 0.2}}
LONG = "word " * 30_000


def engine_running(sup: Sup) -> float:
    with urllib.request.urlopen(sup.engine_url + "/metrics", timeout=5) as r:
        return parse_progress(r.read().decode()).running


async def until(sup: Sup, pred: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    """Sup.wait_for (10 s) off the event loop: the test's own clients keep running meanwhile."""
    return await asyncio.to_thread(sup.wait_for, pred, 10, what)


def gw_status(sup: Sup) -> dict[str, Any]:
    st = sup.status()
    assert st is not None
    gw: dict[str, Any] = st["gateway"]
    return gw


async def test_forwards_keeps_the_request_id_and_streams_chunk_by_chunk(supervise: Callable[..., Sup]) -> None:
    sup = supervise({**GW, "engine": {"env": {"FAKE_VLLM_TOKEN_DELAY": "0.2"}}})
    sup.wait_ready()
    assert sup.gateway is not None
    async with aiohttp.ClientSession() as s:
        code, doc, headers = await post(s, sup.gateway + "/v1/completions", completion("hello", 2),
                                        {"X-Request-Id": "client-id-1"})
        assert code == 200 and doc["choices"][0]["text"] == " x1 x2"  # token k of the output is x<n+k>
        assert headers["X-Request-Id"] == "client-id-1"
        code, doc, headers = await post(s, sup.gateway + "/v1/chat/completions",
                                        {"model": "fake-model", "max_tokens": 1,
                                         "messages": [{"role": "user", "content": "héllo ✓ 日本語"}]})
        assert code == 200 and headers["X-Request-Id"].startswith("gw-")
        async with s.get(sup.gateway + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "fake-model"
        # Streaming: each token's chunk reaches the client as it is made (0.2 s apart), not all at the end.
        arrivals: list[float] = []
        async with s.post(sup.gateway + "/v1/completions", json=completion("hi", 4, stream=True)) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())
        assert len(arrivals) == 4
        assert arrivals[-1] - arrivals[0] > 0.4
    # vLLM saw our id: the stand-in names it in its request log like vLLM's request ids do.
    gw = gw_status(sup)
    assert gw["forwarded"] == 4 and gw["in_flight"] == 0


async def test_authorization_passes_through_to_vllms_api_key(supervise: Callable[..., Sup]) -> None:
    sup = supervise({**GW, "engine": {"args": {"api_key": "sekrit"}}})
    sup.wait_ready()
    assert sup.gateway is not None
    async with aiohttp.ClientSession() as s:
        code, _, _ = await post(s, sup.gateway + "/v1/completions", completion("hi"))
        assert code == 401
        code, _, _ = await post(s, sup.gateway + "/v1/completions", completion("hi"),
                                {"Authorization": "Bearer sekrit"})
        assert code == 200


async def test_precheck_at_the_limit_minus_one_the_limit_and_plus_one(supervise: Callable[..., Sup]) -> None:
    sup = supervise({**GW, "profile": {"max_model_len": 300}})
    sup.wait_ready()
    assert sup.gateway is not None
    async with aiohttp.ClientSession() as s:
        url = sup.gateway + "/v1/completions"
        codes = [(await post(s, url, completion("w " * n, 1)))[0] for n in (299, 300)]
        assert codes == [200, 200]
        code, doc, _ = await post(s, url, completion("w " * 301, 1))
        assert code == 413 and doc["error"]["code"] == "prompt_too_long"
        assert "301 tokens" in doc["error"]["message"] and "at most 300" in doc["error"]["message"]
        assert set(doc["error"]) == {"message", "type", "code"}
        # Token ids count exactly, without asking the engine.
        code, doc, _ = await post(s, url, completion(list(range(301)), 1))
        assert code == 413 and "301 tokens" in doc["error"]["message"]
        # Chat: the template's tokens count too (the stand-in's template adds none).
        code, doc, _ = await post(s, sup.gateway + "/v1/chat/completions",
                                  {"model": "fake-model", "messages": [{"role": "user", "content": "w " * 301}]})
        assert code == 413 and doc["error"]["code"] == "prompt_too_long"
    assert gw_status(sup)["413"] == 3


async def test_bad_input_gets_a_clear_error_naming_the_field(supervise: Callable[..., Sup]) -> None:
    sup = supervise({**GW, "gateway": {**GW["gateway"], "max_body_bytes": 100_000}})
    sup.wait_ready()
    assert sup.gateway is not None
    url = sup.gateway + "/v1/completions"
    async with aiohttp.ClientSession() as s:
        code, doc, _ = await post(s, url, None, raw=b'{"prompt": "unterminated')
        assert code == 400 and doc["error"]["code"] == "invalid_json"
        code, doc, _ = await post(s, url, None, raw=b"\xff\xfe not utf-8")
        assert code == 400 and doc["error"]["code"] == "invalid_json"
        code, doc, _ = await post(s, url, [1, 2])
        assert code == 400 and "JSON object" in doc["error"]["message"]
        code, doc, _ = await post(s, url, completion("hi", stream="yes"))
        assert code == 400 and "'stream'" in doc["error"]["message"]
        code, doc, _ = await post(s, url, {"model": "fake-model", "prompt": {"a": 1}})
        assert code == 400 and "'prompt'" in doc["error"]["message"]
        code, doc, _ = await post(s, url, completion("hi", prompt_logprobs="all"))
        assert code == 400 and "'prompt_logprobs'" in doc["error"]["message"]
        code, doc, _ = await post(s, sup.gateway + "/v1/chat/completions", {"messages": [{"role": "user",
                                                                                           "content": 7}]})
        assert code == 400 and "'messages[0].content'" in doc["error"]["message"]
        code, doc, _ = await post(s, url, None, raw=b'{"prompt": "' + b"x" * 200_000 + b'"}')
        assert code == 413 and doc["error"]["code"] == "body_too_large"
        code, doc, headers = await post(s, url, completion("hi"), {"X-Request-Id": "bad id\twith tab"})
        assert code == 200 and headers["X-Request-Id"].startswith("gw-")  # replaced, never refused
        code, doc, _ = await post(s, url, completion("ünïcödé ✓ 🚀 " * 20))
        assert code == 200
    gw = gw_status(sup)
    assert gw["400"] == 7 and gw["413"] == 1 and gw["forwarded"] == 2


async def test_requests_in_flight_at_an_oom_are_replayed_and_the_poison_is_quarantined(
        supervise: Callable[..., Sup]) -> None:
    # The stand-in's core works one request at a time: the ones sent after the poison wait behind it and die with it.
    # 1000: even the ladder's lowest rung (2048) runs out of memory on the poison's prefill.
    sup = supervise({**GW, "engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "1000", "FAKE_VLLM_TOKEN_DELAY": "0.01"}},
                     "warmup": {"prompt_tokens": [256, 512]}})
    sup.wait_ready()
    assert sup.gateway is not None
    url = sup.gateway + "/v1/completions"
    async with aiohttp.ClientSession() as s:
        poison = asyncio.create_task(post(s, url, completion(LONG), {"X-Request-Id": "poison-1"}))
        await asyncio.sleep(0.05)  # the poison reaches the engine first (order, not luck: checked below)
        smalls = await asyncio.gather(*(post(s, url, completion("hello " * 20, 8)) for _ in range(6)))
        code, doc, _ = await poison
        assert [c for c, _, _ in smalls] == [200] * 6
        assert code == 413 and doc["error"]["code"] == "request_quarantined", doc
        # A retrying client: the same content is refused at once, without another death.
        restarts = sup.wait_ready()["restarts"]
        code, doc, _ = await post(s, url, completion(LONG), {"X-Request-Id": "poison-2"})
        assert code == 413 and doc["error"]["code"] == "request_quarantined"
    st = sup.wait_ready()
    # 8192 and 6144 died with it; then it went alone to the lowest rung (2048, not 4096), died there, and only
    # then was quarantined (that death still lowered the budget to the floor, 512, until the climb).
    assert st["restarts"] == restarts == 3
    assert [e["diff"]["max_num_batched_tokens"][1] for e in sup.events("engine.profile_lowered")] == [6144, 2048, 512]
    gw = st["gateway"]
    assert gw["replayed"] >= 1 and gw["quarantined"] == 1 and gw["safe_prompt_tokens"] == 30_000 - 1
    replayed = sup.events("gateway.request_replayed")
    # The poison goes alone (after the new engine's control period, in which the others may go first).
    mine = [e for e in replayed if e["request_id"] == "poison-1"]
    assert mine and all(e["alone"] is True for e in mine), replayed
    q = sup.events("gateway.request_quarantined")
    assert len(q) == 1 and q[0]["prompt_tokens"] == 30_000 and "word" not in json.dumps(q[0])
    assert "lowest rung" in q[0]["evidence"] and "30000 prompt tokens as counted" in q[0]["evidence"]
    assert "could not serve this request at its current settings" in doc["error"]["message"]
    saved = json.loads((sup.state_dir / "quarantine.json").read_text())
    assert list(saved["quarantine"]) == [q[0]["request_hash"]]
    assert (sup.state_dir / "quarantine.json").stat().st_mode & 0o777 == 0o600


async def long_prompt_served(sup: Sup) -> dict[str, Any]:
    """The 30,000-word prompt through the gateway is answered 200; the status once READY again."""
    sup.wait_ready()
    assert sup.gateway is not None
    async with aiohttp.ClientSession() as s:
        code, doc, _ = await post(s, sup.gateway + "/v1/completions", completion(LONG))
    assert code == 200, doc
    return sup.wait_ready()


async def test_a_long_prompt_that_fits_after_the_step_down_is_served(supervise: Callable[..., Sup]) -> None:
    st = await long_prompt_served(supervise({**GW, "engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "7000"}}}))
    assert st["restarts"] == 1 and st["profile"]["max_num_batched_tokens"] == 6144
    assert st["gateway"]["replayed"] == 1 and st["gateway"]["quarantined"] == 0


async def test_a_prompt_that_killed_two_rungs_is_tried_alone_at_the_lowest_rung_before_any_quarantine(
        supervise: Callable[..., Sup]) -> None:
    """A rung of 2048 may serve what 6144 could not: two strikes are not yet a quarantine (issue 16)."""
    sup = supervise({**GW, "engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "3000"}},
                     "warmup": {"prompt_tokens": [256, 512]}})
    st = await long_prompt_served(sup)
    assert st["restarts"] == 2 and st["profile"]["max_num_batched_tokens"] == 2048  # 8192, 6144, then 2048
    assert st["gateway"]["quarantined"] == 0 and st["gateway"]["safe_prompt_tokens"] is None
    lowered = [e["diff"]["max_num_batched_tokens"] for e in sup.events("engine.profile_lowered")]
    assert lowered == [[8192, 6144], [6144, 2048]]


async def test_the_quarantine_survives_a_restart_of_the_supervisor(supervise: Callable[..., Sup]) -> None:
    overrides = {**GW, "engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "1000"}}, "warmup": {"prompt_tokens": [256, 512]}}
    sup = supervise(overrides)
    sup.wait_ready()
    assert sup.gateway is not None
    async with aiohttp.ClientSession() as s:
        code, _, _ = await post(s, sup.gateway + "/v1/completions", completion(LONG))
    assert code == 413
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.wait_exit(60) == 0
    again = supervise({**overrides, "state": {"dir": str(sup.state_dir)}})
    st = again.wait_ready()
    assert again.gateway is not None
    async with aiohttp.ClientSession() as s:
        code, doc, _ = await post(s, again.gateway + "/v1/completions", completion(LONG))
        assert code == 413 and doc["error"]["code"] == "request_quarantined"
        # A variant of it is the same poison; any other prompt as long is over the learned safe length; a shorter
        # one is served.
        code, doc, _ = await post(s, again.gateway + "/v1/completions", completion(LONG + "more"))
        assert code == 413 and doc["error"]["code"] == "request_quarantined"
        code, doc, _ = await post(s, again.gateway + "/v1/completions", completion("other " * 30_000))
        assert code == 413 and doc["error"]["code"] == "prompt_too_long"
        code, _, _ = await post(s, again.gateway + "/v1/completions", completion("word " * 2000))
        assert code == 200
    assert st["restarts"] == 0


async def read_stream(r: aiohttp.ClientResponse, on_event: Callable[[int], None] | None = None) -> list[Any]:
    """The stream's events, parsed ("[DONE]" as the string); ``on_event(count)`` after each."""
    events: list[Any] = []
    async for line in r.content:
        if line.startswith(b"data:"):
            body = line[5:].strip()
            events.append("[DONE]" if body == b"[DONE]" else json.loads(body))
            if on_event is not None:
                on_event(len(events))
    return events


def kill_core(sup: Sup) -> None:
    core = [p for p in sup.engine_tree() if "--engine-core-fd" in " ".join(p.cmdline())]
    core[0].kill()


def text_of(events: list[Any]) -> str:
    out = []
    for e in events:
        for c in (e.get("choices") or []) if isinstance(e, dict) else []:
            out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


async def test_a_completion_stream_cut_by_an_engine_death_continues_on_the_next_engine_as_one_stream(
        supervise: Callable[..., Sup]) -> None:
    """Issue 17: 3 streams were cut mid-generation by the seed's crash; now they continue, same id, one usage."""
    sup = supervise({**GW, "engine": {"env": {"FAKE_VLLM_TOKEN_DELAY": "0.05"}}})
    sup.wait_ready()
    assert sup.gateway is not None
    body = completion("one two three", 20, stream=True, stream_options={"include_usage": True})
    async with aiohttp.ClientSession() as s, s.post(sup.gateway + "/v1/completions", json=body) as r:
        events = await read_stream(r, lambda n: kill_core(sup) if n == 5 else None)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events
    # The prompt is 3 tokens: the output reads x3 .. x22 as if the engine had never died.
    assert text_of(events) == "".join(f" x{3 + k}" for k in range(20))
    chunks = [e for e in events if isinstance(e, dict)]
    assert len({e["id"] for e in chunks}) == 1 and len({e["created"] for e in chunks}) == 1
    usage = [e["usage"] for e in chunks if e.get("usage")]
    assert usage == [{"prompt_tokens": 3, "completion_tokens": 20, "total_tokens": 23}]
    assert [c["finish_reason"] for e in chunks for c in e["choices"] if c.get("finish_reason")] == ["length"]
    st = sup.wait_ready(restarts=1)
    assert st["gateway"]["streams_continued"] == 1 and st["gateway"]["streams_broken"] == 0
    (ev,) = sup.events("gateway.stream_continued")
    assert ev["tokens_sent"] >= 4 and ev["resumed"] == 1


async def test_a_chat_stream_cut_by_an_engine_death_continues_its_partial_assistant_message(
        supervise: Callable[..., Sup]) -> None:
    sup = supervise({**GW, "engine": {"env": {"FAKE_VLLM_TOKEN_DELAY": "0.05"}}})
    sup.wait_ready()
    assert sup.gateway is not None
    body = {"model": "fake-model", "max_tokens": 12, "stream": True,
            "messages": [{"role": "user", "content": "hello there"}]}
    async with aiohttp.ClientSession() as s, s.post(sup.gateway + "/v1/chat/completions", json=body) as r:
        events = await read_stream(r, lambda n: kill_core(sup) if n == 4 else None)
    chunks = [e for e in events if isinstance(e, dict)]
    assert events[-1] == "[DONE]" and not [e for e in chunks if "error" in e], events
    assert text_of(events) == "".join(f" x{2 + k}" for k in range(12))
    roles = [c["delta"]["role"] for e in chunks for c in e["choices"] if c.get("delta", {}).get("role")]
    assert roles == ["assistant"]  # the continuation's own role chunk is not sent again
    assert not [e for e in chunks if e.get("usage")]  # not asked for: none, though the gateway counted it
    assert len({e["id"] for e in chunks}) == 1
    assert sup.wait_ready(restarts=1)["gateway"]["streams_continued"] == 1


async def test_a_stream_that_cannot_be_continued_faithfully_still_ends_with_an_error_event(
        supervise: Callable[..., Sup]) -> None:
    sup = supervise({**GW, "engine": {"env": {"FAKE_VLLM_TOKEN_DELAY": "0.05"}}})
    sup.wait_ready()
    assert sup.gateway is not None
    body = completion("hi", 200, stream=True, guided_json={"type": "object"})
    async with aiohttp.ClientSession() as s, s.post(sup.gateway + "/v1/completions", json=body) as r:
        events = await read_stream(r, lambda n: kill_core(sup) if n == 2 else None)
    assert "error" in events[-2] and events[-1] == "[DONE]"
    assert "guided decoding" in events[-2]["error"]["message"]
    st = sup.wait_ready(restarts=1)
    assert st["gateway"]["streams_broken"] == 1 and st["gateway"]["replayed"] == 0


async def test_a_stream_that_sent_only_its_role_chunk_counts_as_unsent_and_is_replayed(
        supervise: Callable[..., Sup]) -> None:
    sup = supervise({**GW, "engine": {"env": {"FAKE_VLLM_TOKEN_DELAY": "1.0"}}})
    sup.wait_ready()
    assert sup.gateway is not None
    body = {"model": "fake-model", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as s:
        async def client() -> list[Any]:
            async with s.post(sup.gateway + "/v1/chat/completions", json=body) as r:  # type: ignore[operator]
                return await read_stream(r)

        task = asyncio.create_task(client())
        # The engine sent its role chunk at once; its first token is a second away: kill it in between.
        await asyncio.to_thread(sup.wait_for, lambda _: engine_running(sup) >= 1, 10, "the request at the engine")
        kill_core(sup)
        events = await task
    assert text_of(events) == " x1 x2" and events[-1] == "[DONE]"
    assert not [e for e in events if isinstance(e, dict) and "error" in e]
    st = sup.wait_ready(restarts=1)
    assert st["gateway"]["replayed"] == 1 and st["gateway"]["streams_broken"] == 0
    assert st["gateway"]["streams_continued"] == 0


async def test_a_client_that_disconnects_aborts_its_engine_request(supervise: Callable[..., Sup]) -> None:
    sup = supervise({**GW, "engine": {"env": {"FAKE_VLLM_TOKEN_DELAY": "0.05"}}})
    sup.wait_ready()
    assert sup.gateway is not None
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(post(s, sup.gateway + "/v1/completions", completion("hi", 400)))
        await until(sup, lambda st: st["gateway"]["in_flight"] == 1, "the request at the engine")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    st = await until(sup, lambda st: st["gateway"]["client_disconnected"] == 1, "the disconnect counted")
    assert st["gateway"]["in_flight"] == 0
    # The engine saw its client go and dropped the request (20 s of generation left).
    assert engine_running(sup) == 0


async def test_sigterm_lets_requests_in_flight_finish_and_refuses_new_ones(supervise: Callable[..., Sup]) -> None:
    sup = supervise({**GW, "engine": {"env": {"FAKE_VLLM_TOKEN_DELAY": "0.02"}}})
    sup.wait_ready()
    assert sup.gateway is not None
    url = sup.gateway + "/v1/completions"
    async with aiohttp.ClientSession() as s:
        inflight = [asyncio.create_task(post(s, url, completion("hello", 50))) for _ in range(3)]
        await until(sup, lambda st: st["gateway"]["in_flight"] == 3, "three requests at the engine")
        sup.proc.send_signal(signal.SIGTERM)
        await until(sup, lambda st: st["state"] != "READY", "draining")
        code, doc, headers = await post(s, url, completion("late"))
        assert code == 503 and doc["error"]["code"] == "shutting_down" and int(headers["Retry-After"]) >= 1
        assert [c for c, _, _ in await asyncio.gather(*inflight)] == [200, 200, 200]
    assert sup.wait_exit(60) == 0
    drained = sup.events("gateway.drained")
    assert drained and (drained[0]["in_flight"], drained[0]["cut"]) == (3, 0)


async def test_held_through_a_planned_restart_costs_only_latency(supervise: Callable[..., Sup]) -> None:
    sup = supervise({**GW, "engine": {"env": {"FAKE_VLLM_TOKEN_DELAY": "0.01", "FAKE_VLLM_START_DELAY": "1.0"}}})
    sup.wait_ready()
    assert sup.gateway is not None
    url = sup.gateway + "/v1/completions"
    from supervisor.ops import control

    async with aiohttp.ClientSession() as s:
        stop = asyncio.Event()

        async def client() -> list[int]:
            codes = []
            while not stop.is_set():
                codes.append((await post(s, url, completion("hello", 5)))[0])
            return codes

        clients = [asyncio.create_task(client()) for _ in range(4)]
        await asyncio.sleep(0.3)
        answer = await asyncio.to_thread(control.send, control.path_in(sup.state_dir), "restart")
        assert answer["ok"], answer
        await asyncio.to_thread(sup.wait_for, lambda st: st["start"] >= 2 and st["ready"], 60, "restarted")
        await asyncio.sleep(0.3)
        stop.set()
        codes = [c for t in clients for c in await t]
    assert set(codes) == {200} and len(codes) > 8
    gw = gw_status(sup)
    assert gw["held"] >= 1 and gw["503"] == 0
    # /metrics: one outcome per request (their sum is what the clients got), the waits in a histogram, no _created.
    async with aiohttp.ClientSession() as s, s.get(f"http://{sup.admin}/metrics") as r:
        text = await r.text()
    outcomes = {line.split('outcome="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("vllm_supervisor_gateway_requests_total{")}
    assert "held" not in outcomes and sum(outcomes.values()) == len(codes)
    assert f'vllm_supervisor_gateway_request_events_total{{event="held"}} {float(gw["held"])}' in text
    held = [line for line in text.splitlines() if line.startswith("vllm_supervisor_gateway_held_seconds_count")]
    assert held and float(held[0].rsplit(" ", 1)[1]) >= gw["held"]
    assert "_created" not in text


async def test_kv_cache_full_with_requests_waiting_sheds_new_ones_with_429(supervise: Callable[..., Sup]) -> None:
    sup = supervise({**GW, "profile": {"max_num_seqs": 2}, "engine": {"env": {"FAKE_VLLM_TOKEN_DELAY": "0.05"}},
                     "gateway": {**GW["gateway"], "retry_after_s": 3.0}})
    sup.wait_ready()
    assert sup.gateway is not None
    url = sup.gateway + "/v1/completions"
    async with aiohttp.ClientSession() as s:
        # 40 tokens each: the serial stand-in finishes one every 2 s, within the 3 s hang rule.
        busy = [asyncio.create_task(post(s, url, completion("hello", 40))) for _ in range(4)]
        await until(sup, lambda st: st["gateway"]["shedding"], "shedding")
        code, doc, headers = await post(s, url, completion("one more"))
        assert code == 429 and doc["error"]["code"] == "engine_overloaded" and headers["Retry-After"] == "3"
        assert "KV cache" in doc["error"]["message"]
        assert [c for c, _, _ in await asyncio.gather(*busy)] == [200] * 4
        await until(sup, lambda st: not st["gateway"]["shedding"], "shedding over")
        code, _, _ = await post(s, url, completion("after"))
        assert code == 200
    shed = sup.events("gateway.shedding")
    assert shed[0]["reason"] and not shed[-1]["reason"]  # started (its reason may change), then stopped


async def test_a_reload_applies_gateway_settings_at_once_but_not_a_new_listen(supervise: Callable[..., Sup]) -> None:
    from supervisor.ops import control

    sup = supervise({**GW, "gateway": {**GW["gateway"], "max_body_bytes": 1_000_000}})
    sup.wait_ready()
    assert sup.gateway is not None
    body = completion("w " * 1000)  # about 2 kB
    async with aiohttp.ClientSession() as s:
        assert (await post(s, sup.gateway + "/v1/completions", body))[0] == 200
        text = sup.config.read_text()
        sup.config.write_text(text.replace("max_body_bytes = 1000000", "max_body_bytes = 1000"))
        answer = await asyncio.to_thread(control.send, control.path_in(sup.state_dir), "reload")
        assert answer["ok"] and "engine keeps running" in str(answer["message"]), answer
        code, doc, _ = await post(s, sup.gateway + "/v1/completions", body)
        assert code == 413 and doc["error"]["code"] == "body_too_large"
        listen = sup.gateway.removeprefix("http://")
        sup.config.write_text(text.replace(listen, "127.0.0.1:1"))
        answer = await asyncio.to_thread(control.send, control.path_in(sup.state_dir), "reload")
        assert not answer["ok"] and "gateway.listen" in str(answer["message"])
    assert sup.status()["start"] == 1  # type: ignore[index]


async def test_with_auto_a_request_held_through_a_restart_longer_than_180_s_is_served(
        supervise: Callable[..., Sup], tmp_path: Any) -> None:
    """Issue 17: with the old fixed 180 s, every request held through a 187 s restart would have got 503."""
    delay = tmp_path / "restart-delay"
    sup = supervise({"engine": {"env": {"FAKE_VLLM_DELAY_FILE": str(delay)}, "start_timeout_s": 400.0},
                     "gateway": {}})  # hold_timeout_s left at its default, "auto"
    sup.wait_ready()
    assert sup.gateway is not None
    assert gw_status(sup)["hold_timeout_s"] >= 180
    delay.write_text("190")  # the restart's engine takes 190 s to answer /health
    core = [p for p in sup.engine_tree() if "--engine-core-fd" in " ".join(p.cmdline())]
    core[0].kill()
    await asyncio.to_thread(sup.wait_for, lambda st: st["state"] == "STARTING", 30, "the restart")
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=400)) as s:
        code, doc, _ = await post(s, sup.gateway + "/v1/completions", completion("held for minutes"))
    assert code == 200, doc
    assert time.monotonic() - t0 > 180
    gw = gw_status(sup)
    assert gw["held"] == 1 and gw["503"] == 0
