"""The gateway's pure rules (supervisor.decide.admission) and its gate, with tables and a fake clock."""

from __future__ import annotations

import asyncio
import json

import pytest
from supervisor.bounds import GIB, MIB
from supervisor.decide import admission
from supervisor.decide.admission import Parsed, PressureRules, Quarantine, Rejection
from supervisor.engine_states import EngineState as S
from supervisor.engine_states import FailureKind
from supervisor.gateway.gate import EngineGate, Flight, Refused


def parsed(route: str, body: object) -> Parsed:
    out = admission.parse(route, json.dumps(body).encode())
    assert isinstance(out, Parsed), out
    return out


@pytest.mark.parametrize(("route", "raw", "code", "names"), [
    ("completions", b"{", "invalid_json", "JSON"),
    ("completions", b"\xff", "invalid_json", "JSON"),
    ("completions", b"[]", "invalid_json", "JSON object"),
    ("completions", b'{"prompt": "x", "stream": 1}', "invalid_type", "'stream'"),
    ("completions", b'{"prompt": "x", "model": 3}', "invalid_type", "'model'"),
    ("completions", b'{"prompt": "x", "prompt_logprobs": true}', "invalid_type", "'prompt_logprobs'"),
    ("completions", b'{"max_tokens": 3}', "missing_prompt", "'prompt'"),
    ("completions", b'{"prompt": [1, "a"]}', "invalid_type", "'prompt'"),
    ("completions", b'{"prompt": []}', "invalid_type", "'prompt'"),
    ("embeddings", b'{"input": null}', "missing_prompt", "'input'"),
    ("chat", b'{"messages": []}', "invalid_type", "'messages'"),
    ("chat", b'{"messages": ["hi"]}', "invalid_type", "'messages[0]'"),
    ("chat", b'{"messages": [{"role": "user", "content": {"a": 1}}]}', "invalid_type", "'messages[0].content'"),
    ("chat", b'{"messages": [{"role": "user", "content": ["x"]}]}', "invalid_type", "'messages[0].content[0]'"),
])
def test_bad_bodies_are_refused_with_400_naming_the_field(route: str, raw: bytes, code: str, names: str) -> None:
    out = admission.parse(route, raw)
    assert isinstance(out, Rejection)
    assert (out.status, out.code) == (400, code)
    assert names in out.message
    assert set(out.body()["error"]) == {"message", "type", "code"}


def test_the_byte_bound_and_the_hash() -> None:
    p = parsed("completions", {"model": "m", "prompt": "héllo wörld", "stream": True, "prompt_logprobs": 2})
    assert p.stream and p.prompt_logprobs == 2
    assert p.text_bytes == len("héllo wörld".encode()) and p.upper_bound == p.text_bytes + 8
    assert json.loads(p.tokenize_body) == {"model": "m", "prompt": "héllo wörld"}
    # The same request shares a hash whether it streams or not; another prompt or other sampling does not
    # (tests/unit/test_hostile_clients.py has the rest).
    same = parsed("completions", {"model": "m", "prompt": "héllo wörld", "prompt_logprobs": 2, "user": "u"})
    other = parsed("completions", {"model": "m", "prompt": "hello world"})
    assert same.digest == p.digest != other.digest
    ids = parsed("completions", {"prompt": [[1, 2, 3], [4, 5]]})
    assert ids.token_ids == 5 and ids.text_bytes == 0 and "prompt" not in json.loads(ids.tokenize_body)
    chat = parsed("chat", {"messages": [{"role": "system", "content": "ab"},
                                        {"role": "user", "content": [{"type": "text", "text": "cd"}]}]})
    assert chat.messages == 2 and chat.text_bytes == 4
    assert chat.upper_bound == 4 + admission.CHAT_TOKENS_FIXED + 2 * admission.CHAT_TOKENS_PER_MESSAGE
    assert json.loads(chat.tokenize_body)["messages"][1]["content"][0]["text"] == "cd"


def test_too_long_at_the_limit_minus_one_the_limit_and_plus_one() -> None:
    assert admission.too_long(99, 100, "why") is None
    assert admission.too_long(100, 100, "why") is None
    over = admission.too_long(101, 100, "the engine's max_model_len")
    assert over is not None and (over.status, over.code) == (413, "prompt_too_long")
    assert "101 tokens" in over.message and "at most 100" in over.message and "max_model_len" in over.message


def test_the_limit_is_the_lesser_of_max_model_len_and_the_learned_safe_length() -> None:
    assert admission.prompt_limit(4096, None) == (4096, "the engine's max_model_len")
    assert admission.prompt_limit(4096, 8000)[0] == 4096
    limit, why = admission.prompt_limit(32768, 29999)
    assert limit == 29999 and "crashed" in why
    assert admission.prompt_limit(None, None) == (None, "the engine's max_model_len")


def test_prompt_logprobs_is_bounded_by_the_logits_it_needs() -> None:
    with_lp = parsed("completions", {"prompt": "x", "prompt_logprobs": 5})
    without = parsed("completions", {"prompt": "x"})
    vocab = 128256
    # 2048 tokens x 128256 x 8 B = 1.96 GiB: fits 2 GiB; 8192 tokens at chunk 8192 does not; chunk 2048 makes it fit.
    assert admission.logprobs_too_big(with_lp, 2048, 8192, vocab, 2.0) is None
    big = admission.logprobs_too_big(with_lp, 8192, 8192, vocab, 2.0)
    assert big is not None and big.code == "prompt_logprobs_too_large" and "7.8 GiB" in big.message
    assert "at most 2092 prompt tokens" in big.message
    assert admission.logprobs_too_big(with_lp, 30000, 2048, vocab, 2.0) is None
    assert admission.logprobs_too_big(without, 30000, 8192, vocab, 2.0) is None
    assert admission.logprobs_too_big(with_lp, 30000, 8192, vocab, 0) is None  # 0 = no bound


RULES = PressureRules(min_free_bytes=256 * MIB, foreign_growth_bytes=1 * GIB, kv_cache_high=0.98, kv_waiting=1)


@pytest.mark.parametrize(("free", "foreign", "before", "kv", "waiting", "expect", "everyone"), [
    # vLLM took 90% of an H200: little is free, and that is normal.
    ([int(14 * GIB)], [0], [0], 0.5, 0, None, False),
    ([100 * MIB], [0], [0], 0.1, 0, "100 MiB free", False),
    ([int(10 * GIB)], [int(70 * GIB)], [int(68.5 * GIB)], 0.1, 0, "another process grew by 1536 MiB", False),
    ([int(10 * GIB)], [int(70 * GIB)], [int(70 * GIB)], 0.1, 0, None, False),  # big but not growing
    ([], [], [], 0.99, 3, "KV cache 99% full with 3 requests waiting", True),
    ([100 * MIB], [0], [0], 0.99, 3, "KV cache", True),  # the wider scope wins
    ([], [], [], 0.99, 0, None, False),  # full but nobody waits: vLLM is just busy
    ([], [], [], 0.5, 10, None, False),
])
def test_pressure_is_real_memory_pressure_not_high_usage(free: list[int], foreign: list[int], before: list[int],
                                                          kv: float, waiting: float, expect: str | None,
                                                          everyone: bool) -> None:
    got = admission.pressure(RULES, free=free, foreign=foreign, foreign_before=before, kv_usage=kv, waiting=waiting)
    assert (got is None) == (expect is None)
    if expect:
        assert got is not None and expect in got.reason and got.everyone is everyone


def test_pressure_rules_switch_off_at_zero() -> None:
    off = PressureRules(0, 0, 0.0, 1)
    assert admission.pressure(off, free=[0], foreign=[10 * GIB], foreign_before=[0], kv_usage=1.0, waiting=9) is None


def test_short_of_memory_sheds_only_prompts_longer_than_the_engine_has_run() -> None:
    card = admission.Pressure("GPU 0: 16 MiB free, under the 256 MiB floor", everyone=False)
    assert admission.shed(None, 30000, 1024, 2.0) is None
    assert admission.shed(card, 1024, 1024, 2.0) is None  # the warm-up ran this much: its memory is held
    long = admission.shed(card, 30000, 1024, 2.0)
    assert long is not None and (long.status, long.code, long.retry_after_s) == (429, "engine_overloaded", 2.0)
    assert "over 1024 tokens" in long.message and "16 MiB free" in long.message
    assert admission.shed(card, None, 1024, 2.0) is not None  # not known to be short
    kv = admission.Pressure("KV cache 99% full with 3 requests waiting", everyone=True)
    assert admission.shed(kv, 5, 1024, 2.0) is not None


def test_quarantine_expires_and_gives_the_safe_length() -> None:
    q = Quarantine()
    q.add("a" * 32, until=100.0, tokens=30000, reason="runtime_oom twice")
    q.add("b" * 32, until=50.0, tokens=12000, reason="runtime_oom twice")
    assert q.holds("a" * 32, 10.0) and q.holds("b" * 32, 10.0)
    assert q.safe_len(10.0) == 11999
    assert q.holds("b" * 32, 60.0) is None and q.safe_len(60.0) == 29999
    again, _ = Quarantine.load(json.loads(json.dumps(q.as_dict())))
    assert again.entries == q.entries
    assert again.prune(60.0) and list(again.entries) == ["a" * 32]
    assert Quarantine.load({"quarantine": {"x": "junk", "y": {"until": "soon"}}})[0].entries == {}
    rejection = admission.quarantined(q.entries["a" * 32], "a" * 32)
    assert (rejection.status, rejection.code) == (413, "request_quarantined")


def test_the_suspect_is_the_one_vllm_named_else_the_largest() -> None:
    flights = {"gw-1": 100, "client-a": 30000, "x": 5}
    assert admission.suspect_of("cmpl-gw-1-0-3f2a", flights) == "gw-1"
    assert admission.suspect_of("chatcmpl-x", flights) == "x"
    assert admission.suspect_of(None, flights) == "client-a"
    assert admission.suspect_of("cmpl-somebody-else-0", flights) == "client-a"
    # A hostile short id is a prefix of another's: the longest match wins.
    assert admission.suspect_of("cmpl-x-y-0-ab", {"x": 1, "x-y": 2}) == "x-y"
    assert admission.suspect_of("cmpl-x", {}) is None


def flight(rid: str, size: int = 10) -> Flight:
    return Flight(rid, rid * 4, size)


async def test_the_gate_holds_until_ready_then_times_out_with_503() -> None:
    gate = EngineGate(max_held=2)
    f = flight("a")
    waiter = asyncio.create_task(gate.admit(f, 5.0))
    await asyncio.sleep(0)
    assert gate.waiting == 1 and not waiter.done()
    gate.on_state(S.WARMING, S.READY)
    assert await waiter is True and list(gate.at_engine.values()) == [f]
    gate.stopping(planned=False)  # the lifecycle tells the gate, then writes STOPPING
    gate.on_state(S.READY, S.STOPPING)
    with pytest.raises(Refused) as r:
        await gate.admit(flight("b"), 0.05)
    assert (r.value.status, r.value.code) == (503, "engine_unavailable")


async def test_the_gate_refuses_beyond_max_held() -> None:
    gate = EngineGate(max_held=1)
    first = asyncio.create_task(gate.admit(flight("a"), 5.0))
    await asyncio.sleep(0)
    with pytest.raises(Refused) as r:
        await gate.admit(flight("b"), 5.0)
    assert (r.value.status, r.value.code) == (503, "engine_restarting")
    gate.shutdown()
    with pytest.raises(Refused) as r:
        await first
    assert r.value.code == "shutting_down"


async def test_a_full_concurrency_cap_is_429_once_the_queue_is_full() -> None:
    gate = EngineGate(max_held=1, max_in_flight=1)
    gate.on_state(S.WARMING, S.READY)
    a = flight("a")
    assert await gate.admit(a, 1.0) is False
    held = asyncio.create_task(gate.admit(flight("b"), 5.0))
    await asyncio.sleep(0)
    with pytest.raises(Refused) as r:
        await gate.admit(flight("c"), 5.0)
    assert (r.value.status, r.value.code) == (429, "too_many_requests")
    gate.leave(a)
    assert await held is True


async def test_after_a_death_the_suspect_goes_alone_and_a_second_death_quarantines_it() -> None:
    gate = EngineGate(max_held=10)
    gate.on_state(S.WARMING, S.READY)
    small, big = flight("small", 10), flight("big", 30000)
    await gate.admit(small, 1.0)
    await gate.admit(big, 1.0)
    gate.stopping(planned=False)  # the lifecycle tells the gate, then writes STOPPING
    gate.on_state(S.READY, S.STOPPING)  # unplanned: both were at the engine
    assert await gate.engine_left(small, 0.1) and await gate.engine_left(big, 0.1)
    gate.leave(small)
    gate.leave(big)
    assert gate.on_failure(FailureKind.RUNTIME_OOM, "cmpl-big-0-aa").quarantined is None  # vLLM's dump named it
    assert gate.solo is big and big.strikes == 1
    gate.on_state(S.STARTING, S.READY)
    small_again = asyncio.create_task(gate.admit(small, 5.0))
    await asyncio.sleep(0)
    assert not small_again.done()  # waits while the suspect goes alone
    assert await gate.admit(big, 1.0) is False
    gate.stopping(planned=False)  # the lifecycle tells the gate, then writes STOPPING
    gate.on_state(S.READY, S.STOPPING)
    gate.leave(big)
    assert gate.on_failure(FailureKind.RUNTIME_OOM, None).quarantined is big and big.quarantined and gate.solo is None
    gate.on_state(S.STARTING, S.READY)
    assert await small_again is True


async def test_a_verdict_before_the_gateway_saw_the_engine_leave_ready_blames_the_requests_at_the_engine() -> None:
    """Seen once in CI: the STOPPING edge reached the gateway after the lifecycle's bounded wait for it, the death
    looked like one with nothing in flight, the poison's strikes were cleared and it was served at 512 (200). The
    gate is now told by the lifecycle itself, before the state changes (issue 37): the edge's timing cannot matter."""
    gate = EngineGate(max_held=10)
    gate.on_state(S.WARMING, S.READY)
    small, big = flight("small"), flight("big", 30000)
    await gate.admit(small, 1.0)
    await gate.admit(big, 1.0)
    gate._strike(big)  # an earlier death already proved it once
    gate.stopping(planned=False)  # told synchronously by the lifecycle, before the edge is even published
    blamed = gate.on_failure(FailureKind.RUNTIME_OOM, "cmpl-big-0-aa")  # vLLM's dump named it: a second strike
    assert big.strikes == 2 and blamed.quarantined is big
    gate.on_state(S.READY, S.STOPPING)  # the edge, late
    gate.forget(big)  # its 413; small waits to be sent again
    # The next start fails before READY: the late edge left no dead batch behind for it to blame small with.
    gate.on_state(S.STOPPING, S.STARTING)
    gate.on_state(S.STARTING, S.STOPPING)
    assert gate.on_failure(FailureKind.RUNTIME_OOM, None).proven is False and gate.solo is None


async def test_a_suspect_that_lives_alone_releases_the_others() -> None:
    gate = EngineGate(max_held=10)
    gate.on_state(S.WARMING, S.READY)
    big = flight("big", 30000)
    await gate.admit(big, 1.0)
    gate.stopping(planned=False)  # the lifecycle tells the gate, then writes STOPPING
    gate.on_state(S.READY, S.STOPPING)
    gate.leave(big)
    gate.on_failure(FailureKind.ENGINE_DEAD, "cmpl-big-0-aa")
    gate.on_state(S.STARTING, S.READY)
    await gate.admit(big, 1.0)
    other = asyncio.create_task(gate.admit(flight("other"), 5.0))
    await asyncio.sleep(0)
    assert not other.done()
    gate.leave(big)  # served: the engine lived
    assert gate.solo is None and await other is True


async def test_a_request_answered_before_the_verdict_is_never_the_one_to_go_alone() -> None:
    gate = EngineGate(max_held=10)
    gate.on_state(S.WARMING, S.READY)
    done, lost = flight("done", 30000), flight("lost", 10)
    await gate.admit(done, 1.0)
    await gate.admit(lost, 1.0)
    gate.stopping(planned=False)  # the lifecycle tells the gate, then writes STOPPING
    gate.on_state(S.READY, S.STOPPING)  # both at the engine when it died...
    gate.forget(done)  # ...but this one's answer had arrived: its handler returned
    gate.leave(lost)
    assert gate.on_failure(FailureKind.RUNTIME_OOM, "cmpl-done-0-ab").quarantined is None
    assert gate.solo is lost  # the largest prompt still waiting, not the finished one
    gate.on_state(S.STARTING, S.READY)
    assert await gate.admit(lost, 1.0) is False
    gate.forget(lost)
    assert await gate.admit(flight("next"), 1.0) is False  # nothing blocks the gate


async def test_deaths_no_request_causes_and_planned_stops_blame_nobody() -> None:
    gate = EngineGate(max_held=10)
    gate.on_state(S.WARMING, S.READY)
    f = flight("f")
    await gate.admit(f, 1.0)
    gate.stopping(planned=False)  # the lifecycle tells the gate, then writes STOPPING
    gate.on_state(S.READY, S.STOPPING)
    assert gate.on_failure(FailureKind.HANG, None).quarantined is None and gate.solo is None
    gate.on_state(S.STARTING, S.READY)
    g = flight("g")
    await gate.admit(g, 1.0)
    gate.on_state(S.READY, S.DRAINING)
    gate.stopping(planned=True)
    gate.on_state(S.DRAINING, S.STOPPING)
    assert gate.on_failure(FailureKind.RUNTIME_OOM, None).quarantined is None and gate.solo is None


async def test_drained_waits_for_the_engine_requests_and_reports_the_cut() -> None:
    gate = EngineGate(max_held=10)
    gate.on_state(S.WARMING, S.READY)
    a = flight("a")
    await gate.admit(a, 1.0)
    drain = asyncio.create_task(gate.drained(5.0))
    await asyncio.sleep(0)
    assert not gate.open and not drain.done()
    gate.leave(a)
    assert await drain == 0
    gate.on_state(S.DRAINING, S.READY)
    await gate.admit(flight("b"), 1.0)
    assert await gate.drained(0.05) == 1


class FakeCard:
    """The Host's GPU view and the engine's /metrics, as the pressure watch reads them."""

    def __init__(self) -> None:
        from supervisor.host.gpu import DeviceSnapshot

        self.snap = DeviceSnapshot(0, 140 * GIB, 14 * GIB, 126 * GIB, ((100, 70 * GIB), (200, 56 * GIB)))
        self.kv, self.waiting, self.metrics_calls = 0.2, 0.0, 0

    async def gpu_snapshot(self, devices: object = None) -> list[object]:
        return [self.snap]

    async def metrics(self, timeout: float = 5.0) -> object:
        from supervisor.decide.liveness import Progress

        self.metrics_calls += 1
        return Progress(1, self.waiting, 10, self.kv)


async def test_the_pressure_watch_reads_nvml_and_vllms_kv_cache() -> None:
    from dataclasses import replace

    from supervisor.config import GatewayConfig
    from supervisor.gateway.pressure import PressureWatch

    card = FakeCard()
    busy = [False]
    watch = PressureWatch(GatewayConfig(), card, card, None, lambda: {200}, lambda: True,  # type: ignore[arg-type]
                          lambda: busy[0], lambda p: None)
    assert await watch.check() is None and card.metrics_calls == 0  # idle: vLLM's /metrics is not asked
    # Process 100 (not ours) grows by 2 GiB into the free memory.
    card.snap = replace(card.snap, free=12 * GIB, processes=((100, 72 * GIB), (200, 56 * GIB)))
    got = await watch.check()
    assert got is not None and "another process grew by 2048 MiB" in got.reason and not got.everyone
    # Our own engine growing is not "another process".
    card.snap = replace(card.snap, free=11 * GIB, processes=((100, 72 * GIB), (200, 57 * GIB)))
    assert await watch.check() is None
    card.snap = replace(card.snap, free=16 * MIB)
    got = await watch.check()
    assert got is not None and "16 MiB free" in got.reason
    card.snap = replace(card.snap, free=11 * GIB)
    busy[0], card.kv, card.waiting = True, 0.99, 4
    got = await watch.check()
    assert got is not None and got.everyone and card.metrics_calls == 1


def test_auto_holds_for_the_slowest_start_measured_plus_the_gates_and_a_number_still_works() -> None:
    from supervisor.config_file import parse
    from supervisor.gateway.pipeline import hold_bound

    cfg = parse({"engine": {"model": "m"}, "gateway": {}})
    assert cfg.gateway is not None and cfg.gateway.hold_timeout_s == "auto"
    fresh = hold_bound(cfg, cfg.gateway, None)
    assert fresh >= 180  # never below the number it replaced
    assert hold_bound(cfg, cfg.gateway, 113.0) >= 113 * 1.5 + cfg.gpu.free_wait_s + cfg.gpu.release_timeout_s
    assert hold_bound(cfg, cfg.gateway, 400.0) > hold_bound(cfg, cfg.gateway, 113.0)
    fixed = parse({"engine": {"model": "m"}, "gateway": {"hold_timeout_s": 30}})
    assert fixed.gateway is not None and hold_bound(fixed, fixed.gateway, 400.0) == 30.0
    from supervisor.config import ConfigError
    with pytest.raises(ConfigError, match=r"gateway\.hold_timeout_s"):
        parse({"engine": {"model": "m"}, "gateway": {"hold_timeout_s": "forever"}})


def test_a_request_held_past_its_bound_keeps_waiting_while_the_supervisor_restarts_the_engine() -> None:
    async def go() -> None:
        gate = EngineGate(max_held=10)
        restarting = True
        f = Flight("a", None, 1)
        waiting = asyncio.create_task(gate.admit(f, 0.05, lambda: restarting))
        await asyncio.sleep(0.3)  # six times its bound
        assert not waiting.done()
        gate.on_state(S.WARMING, S.READY)
        assert await waiting is True
        # Not restarting (FATAL, or no restart under way): the bound holds.
        gate.on_state(S.READY, S.FATAL)
        restarting = False
        with pytest.raises(Refused):
            await gate.admit(Flight("b", None, 1), 0.05, lambda: restarting)
    asyncio.run(go())


BIG = "word " * 40_000  # 200,000 bytes: over any limit below, whatever the tokenizer


@pytest.mark.parametrize(("path", "body", "longest_bound", "tokenize_key"), [
    ("/invocations", {"prompt": BIG}, len(BIG) + 8, "prompt"),
    ("/invocations", {"messages": [{"role": "user", "content": BIG}]},
     len(BIG) + admission.CHAT_TOKENS_FIXED + admission.CHAT_TOKENS_PER_MESSAGE, "messages"),
    ("/v1/responses", {"input": BIG}, len(BIG) + admission.CHAT_TOKENS_FIXED + admission.CHAT_TOKENS_PER_MESSAGE,
     "messages"),
    ("/v1/responses", {"instructions": "be brief", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": BIG}]}]}, len(BIG) + 8 + admission.CHAT_TOKENS_FIXED
     + 2 * admission.CHAT_TOKENS_PER_MESSAGE, "messages"),
    ("/pooling", {"input": BIG}, len(BIG) + 8, "prompt"),
    ("/pooling", {"messages": [{"role": "user", "content": BIG}]},
     len(BIG) + admission.CHAT_TOKENS_FIXED + admission.CHAT_TOKENS_PER_MESSAGE, "messages"),
    ("/classify", {"input": ["short", BIG]}, len(BIG) + 8, "prompt"),
    ("/v1/embeddings", {"input": ["short", BIG]}, len(BIG) + 8, "prompt"),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": BIG}]},
     len(BIG) + admission.CHAT_TOKENS_FIXED + admission.CHAT_TOKENS_PER_MESSAGE, "messages"),
    ("/score", {"text_1": "q", "text_2": [BIG, "d"]}, len(BIG) + 8, "prompt"),
    ("/rerank", {"query": "q", "documents": ["d", BIG]}, len(BIG) + 8, "prompt"),
    ("/v1/messages", {"system": "s", "messages": [{"role": "user", "content": [{"type": "text", "text": BIG}]}]},
     len(BIG) + 1 + admission.CHAT_TOKENS_FIXED + 2 * admission.CHAT_TOKENS_PER_MESSAGE, "messages"),
    ("/v2/embed", {"texts": [BIG]}, len(BIG) + 8, "prompt"),
])
def test_every_route_that_runs_the_model_has_its_longest_prompt_counted(path: str, body: dict[str, object],
                                                                        longest_bound: int, tokenize_key: str) -> None:
    """Issue 36: a 40,000-token prompt on /invocations, /v1/responses or /pooling reached the engine (400 there)
    while /v1/completions answered 413 with the limit and the count."""
    from supervisor.gateway import parsing
    from supervisor.host import routes

    kind = routes.model_route(path)
    assert kind is not None and kind in parsing.KINDS, path
    p = parsing.parse(kind, json.dumps({"model": "m", **body}).encode())
    assert isinstance(p, Parsed) and p.upper_bound == longest_bound and p.countable
    counted = json.loads(p.tokenize_body)
    assert counted["model"] == "m" and tokenize_key in counted
    assert BIG.split()[0] in json.dumps(counted)  # the longest prompt is what /tokenize counts, not the short one


def test_a_batch_is_judged_by_its_longest_prompt_and_token_ids_are_counted_without_the_engine() -> None:
    """vLLM judges each prompt of a batch against max_model_len: two 3,000-token prompts fit a 4,096 limit."""
    batch = parsed("completions", {"prompt": [[1] * 3000, [2] * 3000]})
    assert batch.token_ids == 6000 and batch.exact == 3000 and not batch.countable
    assert parsed("completions", {"prompt": [1]}).exact == 1
    texts = parsed("embeddings", {"input": ["a " * 3000, "b " * 10]})
    assert texts.upper_bound == 6000 + 8 and json.loads(texts.tokenize_body)["prompt"].startswith("a a")
    # A route read leniently leaves a body it does not understand to vLLM: hashed, not counted, never a 400 here.
    from supervisor.gateway import parsing

    deep = b'{"input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for kind, raw in (("invocations", b'{"prompt": 3}'), ("responses", b"[1, 2]"), ("pooling", b"not json"),
                      ("responses", deep)):
        odd = parsing.parse(kind, raw)
        assert isinstance(odd, Parsed) and odd.longest is None and odd.digest, kind


async def test_a_hand_over_sends_new_requests_to_the_successor_and_waits_only_for_the_old_engines() -> None:
    """A climb's spare awake beside the draining engine takes new requests (gate.hand_over); the drain waits only
    for what was at the old engine, and the planned stop and the start keep sending to the successor."""
    gate = EngineGate(max_held=10)
    assert gate.hand_over() is False  # only while DRAINING
    gate.on_state(S.WARMING, S.READY)
    old = flight("old")
    await gate.admit(old, 1.0)
    gate.on_state(S.READY, S.DRAINING)
    draining = asyncio.create_task(gate.drained(5.0))
    held = asyncio.create_task(gate.admit(flight("held"), 5.0))
    await asyncio.sleep(0)
    assert not held.done() and not gate.open
    assert gate.hand_over() is True and gate.hand_over() is False  # once
    assert await held is True  # the held request goes to the successor now
    new = flight("new")
    assert await gate.admit(new, 1.0) is False
    await asyncio.sleep(0)
    assert not draining.done()  # the old engine's request still runs
    gate.leave(new)
    gate.leave(old)
    assert await draining == 0
    gate.stopping(planned=True)
    for state in (S.STOPPING, S.STARTING, S.WARMING):
        gate.on_state(gate.state, state)
        assert gate.open and await gate.admit(flight(f"at {state.value}"), 1.0) is False
    gate.on_state(S.WARMING, S.READY)
    assert gate.open and gate.handed_over is None


@pytest.mark.parametrize("ending", ["death of the old engine", "successor dropped", "backoff"])
async def test_a_hand_over_ends_when_the_successor_will_not_be_the_engine(ending: str) -> None:
    """The old engine died during its drain (the restart is a failure's: its dead batch is only what was at it), the
    successor was dropped (gate.take_back), or the start failed: new requests are held again until READY, and
    those at the successor count as at an engine that left (they are sent again)."""
    gate = EngineGate(max_held=10)
    gate.on_state(S.WARMING, S.READY)
    old = flight("old", 30000)
    await gate.admit(old, 1.0)
    gate.on_state(S.READY, S.DRAINING)
    assert gate.hand_over()
    new = flight("new")
    await gate.admit(new, 1.0)
    if ending == "death of the old engine":
        gate.stopping(planned=False)
        gate.on_state(S.DRAINING, S.STOPPING)
        gate.leave(old)
        gate.leave(new)
        blamed = gate.on_failure(FailureKind.RUNTIME_OOM, None)
        assert blamed.proven is True and gate.solo is old  # alone at the engine that died: not the successor's
    elif ending == "successor dropped":
        gate.take_back()
    else:
        gate.stopping(planned=True)
        gate.on_state(S.DRAINING, S.STOPPING)
        gate.on_state(S.STOPPING, S.STARTING)
        assert gate.open
        gate.on_state(S.STARTING, S.BACKOFF)
    assert not gate.open and gate.handed_over is None
    assert await gate.engine_left(new, 0.1)  # sent again to the next engine
    with pytest.raises(Refused):
        await gate.admit(flight("later"), 0.05)
