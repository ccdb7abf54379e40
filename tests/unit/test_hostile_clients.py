"""What a hostile client can send, and the quarantine's rules: nothing a client does takes the service down."""

from __future__ import annotations

import asyncio
import errno
import json
from typing import Any

import psutil
import pytest
from supervisor.decide import admission
from supervisor.engine_states import EngineState as S
from supervisor.engine_states import FailureKind
from supervisor.gateway.gate import EngineGate, Flight
from supervisor.host import proctree


def parsed(body: dict[str, Any], route: str = "completions") -> admission.Parsed:
    got = admission.parse(route, json.dumps(body).encode())
    assert isinstance(got, admission.Parsed), got
    return got


def test_two_tiny_quarantined_prompts_never_lower_the_limit_below_what_the_engine_served() -> None:
    """Defect 1: "Hello" and "Hello " quarantined at 1 token made the server accept "at most 0" tokens."""
    q = admission.Quarantine()
    q.add("a", until=1e12, tokens=1, reason="runtime_oom twice")
    q.add("b", until=1e12, tokens=2, reason="runtime_oom twice")
    limit, why = admission.prompt_limit(32768, q.safe_len(0.0, served=4096))
    assert limit == 32768 and "max_model_len" in why  # a quarantined prompt shorter than what ran lowers nothing
    q.add("c", until=1e12, tokens=20000, reason="runtime_oom twice")
    limit, why = admission.prompt_limit(32768, q.safe_len(0.0, served=4096))
    assert limit == 19999 and "quarantine" in why
    q.add("d", until=1e12, tokens=5000, reason="runtime_oom twice")
    assert admission.prompt_limit(32768, q.safe_len(0.0, served=4096))[0] == 4999
    assert admission.prompt_limit(32768, q.safe_len(0.0, served=6000))[0] == 19999  # never below what ran


def test_the_quarantine_key_covers_every_field_that_changes_what_the_engine_does() -> None:
    """Defect 2: the hash covered the route, model and prompt only."""
    base = {"model": "m", "prompt": "Hello", "max_tokens": 4}
    digests = {parsed(b).digest for b in (base, {**base, "temperature": 0.0}, {**base, "logit_bias": {"7": 100}},
                                          {**base, "guided_json": {"type": "object"}}, {**base, "n": 2})}
    assert len(digests) == 5
    # What never reaches the engine's computation does not make another request of it.
    assert parsed(base).digest == parsed({**base, "stream": True, "user": "u-1"}).digest
    assert parsed({"prompt": "x", "model": "m"}).digest == parsed({"model": "m", "prompt": "x"}).digest


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def die_with(gate: EngineGate, clock: Clock, flights: list[Flight], kind: FailureKind,
                   served_s: float = 60.0) -> Any:
    """An engine READY for ``served_s`` before ``flights`` are sent, which dies of ``kind`` under them."""
    gate.on_state(S.WARMING, S.READY)
    clock.t += served_s
    for f in flights:
        assert await gate.admit(f, 0.01) is False
    gate.stopping(planned=False)  # the lifecycle tells the gate, then writes STOPPING
    gate.on_state(S.READY, S.STOPPING)
    for f in flights:
        gate.leave(f)
    blame = gate.on_failure(kind, None)
    gate.on_state(S.STOPPING, S.STARTING)
    return blame


def test_a_strike_needs_evidence_and_a_crash_loop_quarantines_nobody() -> None:
    """Defect 3: with an engine that dies after each start whatever it serves, the largest request was
    sent alone, "died alone" and was quarantined. It dies within its control period now: the suspect, held
    for it, was never at the engine, and its strike is void."""
    async def go() -> None:
        clock = Clock()
        gate = EngineGate(max_held=10, solo_after_s=2.0, clock=clock)
        big = Flight("big", "d-big", 214)
        first = await die_with(gate, clock, [big], FailureKind.SIGNAL)  # alone after 60 s of serving: a strike
        assert big.strikes == 1 and first.proven and gate.solo is big
        for _ in range(4):  # then SIGSEGV 0.3 s after each start, the suspect held for its control period
            gate.on_state(S.WARMING, S.READY)
            held = asyncio.create_task(gate.admit(big, 5.0))
            await asyncio.sleep(0)
            clock.t += 0.3
            assert not held.done() and not gate.at_engine
            gate.stopping(planned=False)  # the lifecycle tells the gate, then writes STOPPING
            gate.on_state(S.READY, S.STOPPING)
            blame = gate.on_failure(FailureKind.SIGNAL, None)
            assert not blame.proven and blame.quarantined is None
            gate.on_state(S.STOPPING, S.STARTING)
            held.cancel()
            with pytest.raises(asyncio.CancelledError):
                await held
        assert big.strikes == 0 and not big.quarantined and gate.waiting == 0
        gate.forget(big)  # its client gave up
        # An out-of-memory death with the request alone at the engine is evidence, control or not.
        oom = Flight("oom", "d-oom", 214)
        for expect_quarantine in (False, True):
            blame = await die_with(gate, clock, [oom], FailureKind.RUNTIME_OOM, served_s=2.0)
            assert (blame.quarantined is oom) is expect_quarantine and blame.proven
    asyncio.run(go())


def test_a_segfaulting_request_alone_is_struck_twice_quarantined_and_its_deaths_are_proven() -> None:
    """Issue 25's regression: a request that kills the engine with nothing in vLLM's records naming it (a
    segfault) went alone to engine after engine and was never struck: 4 deaths a request, FATAL for two."""
    async def go() -> None:
        clock = Clock()
        gate = EngineGate(max_held=10, solo_after_s=2.0, clock=clock)
        poison, small = Flight("p", "d-poison", 300), Flight("s", "d-small", 900)
        first = await die_with(gate, clock, [poison, small], FailureKind.ENGINE_DEAD)
        assert not first.proven and poison.strikes == 0 and gate.solo is small  # the largest goes alone first
        gate.on_state(S.WARMING, S.READY)
        clock.t += 2.5
        assert await gate.admit(small, 0.01) is False
        gate.leave(small)  # it lived alone: not the poison
        assert gate.solo is None
        # The poison, sent again into a batch, dies again: it saw two deaths, the others one.
        other = Flight("o", "d-other", 5000)
        assert await gate.admit(poison, 0.01) is False and await gate.admit(other, 0.01) is False
        gate.stopping(planned=False)  # the lifecycle tells the gate, then writes STOPPING
        gate.on_state(S.READY, S.STOPPING)
        gate.leave(poison)
        gate.leave(other)
        assert gate.on_failure(FailureKind.ENGINE_DEAD, None).proven is False and gate.solo is poison
        gate.on_state(S.STOPPING, S.STARTING)
        second = await die_with(gate, clock, [poison], FailureKind.ENGINE_DEAD, served_s=2.5)
        assert second.proven and poison.strikes == 1 and second.quarantined is None
        # The client gave up and sends it again: a new request with the same key inherits the strike.
        gate.forget(poison)
        again = Flight("p2", "d-poison", 300)
        third = await die_with(gate, clock, [again], FailureKind.SIGNAL, served_s=2.5)
        assert third.proven and third.quarantined is again and again.strikes == 2
    asyncio.run(go())


def test_a_quarantined_prompt_resent_with_other_fields_is_the_first_suspect_and_struck_but_never_an_innocents_end(
        ) -> None:
    """Issue 36: an attacker's next try (a quarantined prompt with another killing field) cost three deaths under
    traffic: one in a batch (no strike), two alone. Framed, it is struck at the batch death and ends at the next;
    an innocent carrying that prompt, struck there too, is cleared by living alone and is never quarantined."""
    async def go() -> None:
        clock = Clock()
        gate = EngineGate(max_held=10, solo_after_s=2.0, clock=clock)
        attacker, bystander = Flight("a", "d-attack", 20, kin=1), Flight("b", "d-big", 900)
        first = await die_with(gate, clock, [attacker, bystander], FailureKind.SIGNAL)
        assert attacker.strikes == 1 and gate.solo is attacker and not first.proven  # chosen over the larger one
        second = await die_with(gate, clock, [attacker], FailureKind.SIGNAL, served_s=2.5)
        assert second.proven and second.quarantined is attacker  # two deaths
        # An innocent with the framed prompt, in a batch with a request that kills: struck once, then alone, lives.
        innocent, killer = Flight("i", "d-innocent", 20, kin=1), Flight("k", "d-killer", 900)
        await die_with(gate, clock, [innocent, killer], FailureKind.SIGNAL)
        assert innocent.strikes == 1 and gate.solo is innocent
        gate.on_state(S.WARMING, S.READY)
        clock.t += 2.5
        assert await gate.admit(innocent, 0.01) is False
        gate.leave(innocent)  # it lived alone
        assert gate.solo is None and gate.strikes_of("d-innocent") == 0 and not innocent.quarantined
        # Among several carrying the prompt (ordinary clients send it too), the one with the entry's fields first.
        near, plain = Flight("n", "d-near", 20, kin=2), Flight("p", "d-plain", 900, kin=1)
        await die_with(gate, clock, [plain, near], FailureKind.SIGNAL)
        assert gate.solo is near and near.strikes == 1 and plain.strikes == 0
    asyncio.run(go())


def test_others_go_during_the_control_period_and_the_suspect_alone_after_it() -> None:
    async def go() -> None:
        clock = Clock()
        gate = EngineGate(max_held=10, solo_after_s=2.0, clock=clock)
        suspect = Flight("s", "d-s", 300)
        await die_with(gate, clock, [suspect], FailureKind.ENGINE_DEAD)
        gate.on_state(S.WARMING, S.READY)
        waiting = asyncio.create_task(gate.admit(suspect, 5.0))
        a = Flight("a", "d-a", 10)
        assert await gate.admit(a, 0.01) is False  # the control: others are served meanwhile
        clock.t += 2.0
        late = asyncio.create_task(gate.admit(Flight("b", "d-b", 10), 5.0))
        await asyncio.sleep(0)
        assert not waiting.done() and not late.done()  # the suspect waits for the engine to empty, b behind it
        gate.leave(a)
        assert await waiting is True and not late.done()
        assert not suspect.controlled or gate.at_engine == {id(suspect): suspect}
        gate.leave(suspect)  # it lived: the others go
        assert await late is True
    asyncio.run(go())


def test_an_unexplained_death_strikes_only_the_request_vllm_named() -> None:
    async def go() -> None:
        gate = EngineGate(max_held=10)
        gate.on_state(S.WARMING, S.READY)
        a, b = Flight("a", "d-a", 10), Flight("b", "d-b", 9000)
        await gate.admit(a, 1.0)
        await gate.admit(b, 1.0)
        gate.stopping(planned=False)  # the lifecycle tells the gate, then writes STOPPING
        gate.on_state(S.READY, S.STOPPING)
        gate.leave(a)
        gate.leave(b)
        gate.on_failure(FailureKind.ENGINE_DEAD, "cmpl-a-0-ff")
        assert (a.strikes, b.strikes) == (1, 0) and gate.solo is a
    asyncio.run(go())


def test_requests_that_share_an_x_request_id_never_merge_in_the_gate() -> None:
    """Defect 7: max_in_flight = 2 let 8 requests with one X-Request-Id reach the engine."""
    async def go() -> None:
        gate = EngineGate(max_held=10, max_in_flight=2)
        gate.on_state(S.WARMING, S.READY)
        flights = [Flight("same", None, 1) for _ in range(4)]
        assert await gate.admit(flights[0], 1.0) is False
        assert await gate.admit(flights[1], 1.0) is False
        third = asyncio.create_task(gate.admit(flights[2], 5.0))
        await asyncio.sleep(0)
        assert len(gate.at_engine) == 2 and not third.done()  # the cap holds
        gate.leave(flights[0])
        assert await third is True
        gate.leave(flights[1])
        gate.leave(flights[2])
        assert not gate.at_engine
    asyncio.run(go())


def test_bad_entries_in_a_hand_edited_quarantine_file_are_dropped_at_load() -> None:
    """Defect 8: a valid JSON entry with "tokens": "12k" made every request and /status 500."""
    doc = {"quarantine": {"good": {"until": 1e12, "tokens": 300, "reason": "r"},
                          "bad-tokens": {"until": 1e12, "tokens": "12k", "reason": "r"},
                          "bad-until": {"until": "soon", "tokens": 3},
                          "not-a-table": 7}}
    q, dropped = admission.Quarantine.load(doc)
    assert list(q.entries) == ["good"] and sorted(dropped) == ["bad-tokens", "bad-until", "not-a-table"]
    assert q.safe_len(0.0) == 299


def test_a_deeply_nested_body_is_a_400_naming_the_problem() -> None:
    """Defect 10: RecursionError escaped the parser (500)."""
    deep = b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    got = admission.parse("completions", deep)
    assert isinstance(got, admission.Rejection) and got.status == 400 and "nested" in got.message


def test_running_out_of_file_descriptors_degrades_the_process_scan_and_never_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect 4: `Too many open files` in the probe loop (an OSError, not a psutil.Error) ended the supervisor."""
    def no_fds(*_: Any, **__: Any) -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(psutil, "process_iter", no_fds)
    class Leader:
        sid = 1
        known_pids = {1234}

    assert proctree.remember_descendants(Leader()) == {1234}  # type: ignore[arg-type]
    assert proctree.session_members(1) == []


def test_every_route_that_runs_the_model_is_checked_and_the_engines_own_routes_are_closed() -> None:
    """Defect 6: only three routes were parsed; /invocations and the others skipped every check."""
    from supervisor.host import routes

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/invocations",
                 "/pooling", "/score", "/rerank", "/v1/rerank", "/classify", "/v1/audio/transcriptions"):
        assert routes.public(path) and routes.model_route(path), path
    for path in ("/metrics", "/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache", "/start_profile",
                 "/stop_profile", "/pause", "/resume", "/scale_elastic_ep", "/update_weights",
                 "/fault_tolerance/apply", "/v1/load_lora_adapter", "/server_info", "/abort_requests"):
        assert not routes.public(path), path
    assert routes.public("/v1/models") and routes.model_route("/v1/models") is None
    assert routes.public("/v1/responses/resp_123/cancel") and not routes.public("/v1/responses/../sleep")
    # A body the gateway does not read still gets a quarantine key, whatever it is.
    opaque = admission.parse_opaque("/invocations", b"--multipart-boundary\r\n...")
    assert opaque.digest and opaque.digest != admission.parse_opaque("/invocations", b"{}").digest


def test_the_engine_inherits_no_alert_secret_and_no_credentials_directory() -> None:
    """Item 13: the hooks' secrets and CREDENTIALS_DIRECTORY reached vLLM, its EngineCore and every standby."""
    from supervisor.config_file import parse
    from supervisor.engine import launch

    cfg = parse({"engine": {"model": "m", "env": {"KEEP_ME": "1"}},
                 "alerts": {"hooks": [{"type": "pagerduty", "routing_key_env": "PD_KEY"},
                                      {"type": "twilio", "account_sid": "AC1", "auth_token_env": "TW_TOKEN",
                                       "from": "+1", "to": ["+2"]}]}})
    assert cfg.withheld_env() == ("CREDENTIALS_DIRECTORY", "PD_KEY", "TW_TOKEN")
    base = {"PATH": "/bin", "PD_KEY": "secret-1", "TW_TOKEN": "secret-2", "CREDENTIALS_DIRECTORY": "/run/creds/x"}
    env = launch.build_env(cfg.engine, {}, "/run/hook", base=base, withheld=cfg.withheld_env())
    assert env["PATH"] == "/bin" and env["KEEP_ME"] == "1"
    assert not {"PD_KEY", "TW_TOKEN", "CREDENTIALS_DIRECTORY"} & set(env)


def test_run_directories_of_supervisors_that_died_are_removed_at_the_next_start(tmp_path: Any) -> None:
    """Item 13: run directories were left in /tmp after abnormal exits."""
    import os
    import subprocess
    import sys

    from supervisor.host import rundir

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = tmp_path / f"vllm-supervisor-{gone.stdout.strip()}-abc123"
    alive = tmp_path / f"vllm-supervisor-{os.getppid()}-def456"  # a process that runs: kept
    other = tmp_path / "vllm-supervisor-notapid"
    for d in (dead, alive, other):
        d.mkdir()
    (dead / "events.sock").write_text("")
    assert rundir.sweep(tmp_path) == [dead]
    assert not dead.exists() and alive.exists() and other.exists()


def test_big_bodies_are_parsed_without_stalling_the_loop_that_runs_supervision() -> None:
    """Defect 5: one 16 MiB token-id body cost 1.3 s on the loop that also pets the watchdog."""
    from supervisor.gateway.parsing import BodyParser

    body = json.dumps({"model": "m", "prompt": list(range(2_000_000))}).encode()  # 16 MiB of token ids

    async def go() -> tuple[float, list[Any]]:
        parser = BodyParser()
        gaps: list[float] = []
        stop = asyncio.Event()

        async def beat() -> None:  # what the heartbeat and the admin port need: a turn every few ms
            last = asyncio.get_running_loop().time()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = asyncio.get_running_loop().time()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(beat())
        got = await asyncio.gather(*(parser.parse("completions", body) for _ in range(4)))
        stop.set()
        await ticker
        return max(gaps), list(got)

    worst, got = asyncio.run(go())
    assert all(isinstance(p, admission.Parsed) and p.token_ids == 2_000_000 for p in got)
    assert worst < 0.25, f"the loop stalled {worst:.3f}s while four 16 MiB bodies were parsed"


def test_an_oom_suspect_with_two_strikes_is_tried_alone_at_the_lowest_rung_before_it_is_quarantined() -> None:
    """A rung of 2048 may serve what 6144 could not: a second strike above the floor asks for the floor first."""
    from supervisor.config import LadderConfig
    from supervisor.decide.policy import floor_of
    from supervisor.profile import Profile

    async def die_alone(gate: EngineGate, f: Flight, at_floor: bool) -> Any:
        gate.on_state(S.WARMING, S.READY)
        await gate.admit(f, 1.0)
        gate.stopping(planned=False)  # the lifecycle tells the gate, then writes STOPPING
        gate.on_state(S.READY, S.STOPPING)
        gate.leave(f)
        out = gate.on_failure(FailureKind.RUNTIME_OOM, None, at_floor=at_floor)
        gate.on_state(S.STOPPING, S.STARTING)
        return out

    async def go() -> None:
        gate = EngineGate(max_held=10)
        big = Flight("big", "d-big", 30000)
        first = await die_alone(gate, big, at_floor=False)
        assert first.quarantined is None and not first.floor
        second = await die_alone(gate, big, at_floor=False)  # two strikes, above the floor: not yet
        assert second.quarantined is None and second.floor
        assert gate.solo is big and not big.quarantined
        assert (await die_alone(gate, big, at_floor=True)).quarantined is big and big.quarantined  # died there too
        # An engine already at the floor quarantines at the second strike, as before.
        other = Flight("other", "d-other", 30000)
        await die_alone(gate, other, at_floor=True)
        last = await die_alone(gate, other, at_floor=True)
        assert last.quarantined is other and not last.floor
    asyncio.run(go())
    ladder = LadderConfig()
    low = floor_of(Profile(max_num_batched_tokens=8192, max_num_seqs=16), ladder)
    assert low.max_num_batched_tokens == 2048 and low.enable_chunked_prefill  # the lowest listed rung, not 512
    assert floor_of(low, ladder) == low
    assert floor_of(Profile(max_num_batched_tokens=1024), ladder).max_num_batched_tokens == 1024  # never raised


POISON_TEXT = " ".join(f"w{i % 97} v{i % 89}" for i in range(300))


def sketch_of(body: dict[str, Any]) -> tuple[int, ...]:
    return admission.body_sketch(json.dumps(body).encode())


def test_the_quarantine_key_is_what_vllm_runs_not_the_bodys_bytes() -> None:
    """Issue 25: a junk field, a nudged temperature or a few words removed made a quarantined prompt new (three
    such variants walked every client's chunk to the floor and spent the budget)."""
    base = {"model": "m", "prompt": POISON_TEXT, "max_tokens": 8, "temperature": 0.7}
    q = admission.Quarantine()
    first = parsed(base)
    q.add(first.digest, 1e12, None, "r", "engine_dead", first.shape, sketch_of(base))
    assert q.has_shape(first.shape, 0.0)
    words = POISON_TEXT.split()
    variants = [{**base, "junk": "x" * 50},                                     # vLLM ignores unknown fields
                {**base, "temperature": 0.71, "seed": 7, "max_tokens": 9},      # values, not the code that runs
                {**base, "prompt": "  " + POISON_TEXT.replace(" ", "\n  ")},   # whitespace
                {**base, "prompt": " ".join(words[:100] + words[103:400] + words[405:])},  # a few words removed
                {**base, "user": "someone-else", "stream": True}]
    for v in variants:
        p = parsed(v)
        assert q.holds(p.digest, 0.0, p.shape, sketch_of(v)) is not None, v.keys()
    # What makes the engine run something else is another request.
    others = [{**base, "temperature": 0.0},                                      # greedy: another sampling path
              {**base, "n": 4}, {**base, "guided_json": {"type": "object"}}, {**base, "prompt_logprobs": 1},
              {**base, "prompt": " ".join(f"z{i}" for i in range(600))}, {**base, "model": "other"}]
    for o in others:
        p = parsed(o)
        assert q.holds(p.digest, 0.0, p.shape, sketch_of(o)) is None, o
    assert sketch_of({"model": "m", "prompt": "short one"}) == ()  # short prompts match exactly only
    # A 16 MiB prompt is sketched from its first and last words: what a variant shares, at a bounded cost.
    long_words = [f"w{i}" for i in range(400_000)]
    trimmed = long_words[:200_000] + long_words[200_005:]
    assert admission.similarity(admission.sketch(long_words), admission.sketch(trimmed)) == 1.0


SHARED_SYSTEM_PROMPT = " ".join(f"rule{i} applies to every answer" for i in range(60))


def test_a_field_that_kills_quarantines_its_request_never_the_prompt_alone() -> None:
    """Issue 36: once {"prompt": "Hello", "stop": ["POISONPILL"]} was quarantined, a plain "Hello" from anyone was
    413: the key held the prompt and not the stop strings, so one client could get a greeting, a shared system
    prompt or a template refused for every tenant by sending it once with a field that kills the engine."""
    q = admission.Quarantine()

    def quarantine(body: dict[str, Any], route: str = "completions") -> None:
        p = parsed(body, route)
        q.add(p.digest, 1e12, None, "r", "engine_dead", p.shape, sketch_of(body))

    def refused(body: dict[str, Any], route: str = "completions") -> bool:
        p = parsed(body, route)
        return q.holds(p.digest, 0.0, p.shape, sketch_of(body)) is not None

    hello = {"model": "m", "prompt": "Hello", "max_tokens": 8}
    quarantine({**hello, "stop": ["POISONPILL"]})
    assert refused({**hello, "stop": ["POISONPILL"]}) and refused({**hello, "stop": "POISONPILL"})  # one stop: a list
    assert refused({**hello, "stop": ["POISONPILL"], "stream": True, "user": "u2"})  # neither changes what runs
    for innocent in (hello, {**hello, "stop": ["\n"]}, {**hello, "stop": ["POISONPILL", "\n"]},
                     {**hello, "temperature": 0.2}, {**hello, "seed": 3, "stop_token_ids": [2]}):
        assert not refused(innocent), innocent
    # A long shared system prompt, framed with a killing field: every other request carrying it still goes.
    chat = {"model": "m", "messages": [{"role": "system", "content": SHARED_SYSTEM_PROMPT},
                                       {"role": "user", "content": "what is the rule?"}]}
    quarantine({**chat, "logit_bias": {"13": 100}}, "chat")
    assert not refused(chat, "chat") and not refused({**chat, "logit_bias": {"13": 5}}, "chat")
    assert not refused({**chat, "temperature": 0.3, "max_tokens": 50}, "chat")
    # The attacker's own variants: the same fields with a few words changed are the same request.
    edited = {**chat, "messages": [chat["messages"][0], {"role": "user", "content": "what is a rule?"}]}
    assert refused({**edited, "logit_bias": {"13": 100}}, "chat")
    assert refused({**edited, "logit_bias": {"13": 100}, "temperature": 0.5}, "chat")  # a value: the same path
    # The key is the request as vLLM ran it, values included: exact for a prompt too short to sketch.
    assert parsed({**hello, "temperature": 0.7}).digest != parsed({**hello, "temperature": 0.71}).digest
    assert parsed({**hello, "temperature": 1}).digest == parsed(hello).digest  # vLLM's default, sent or not
    assert parsed({**hello, "temperature": 0.7}).shape == parsed({**hello, "temperature": 0.71}).shape


def test_a_quarantined_segfault_lowers_no_ones_prompt_limit() -> None:
    """Issue 25: one 5,001-token request that crashed the engine set safe_prompt_tokens to 5,000 for everyone."""
    q = admission.Quarantine()
    q.add("segv", 1e12, 5001, "engine_dead twice", "engine_dead")
    assert q.safe_len(0.0, served=512) is None
    q.add("oom", 1e12, 20000, "runtime_oom twice", "runtime_oom")
    assert q.safe_len(0.0, served=512) == 19999
    loaded, dropped = admission.Quarantine.load(q.as_dict())
    assert not dropped and loaded.safe_len(0.0, served=512) == 19999


def test_tool_schemas_and_tool_call_arguments_count_against_the_token_gates() -> None:
    """Issue 25: only message text was counted; tools and tool_calls (rendered into the prompt) passed every gate."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"description": "x" * 50_000}}}]
    p = parsed({"messages": [{"role": "user", "content": "hi"}], "tools": tools}, "chat")
    assert p.upper_bound > 50_000 and json.loads(p.tokenize_body)["tools"] == tools
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "y" * 40_000}}]
    p = parsed({"messages": [{"role": "assistant", "content": None, "tool_calls": call},
                             {"role": "user", "content": "go"}]}, "chat")
    assert p.upper_bound > 40_000


def test_a_spawn_that_fails_for_want_of_descriptors_is_retried_not_a_config_error() -> None:
    """Issue 25: with the descriptor table full, the next engine's spawn failed 'Too many open files' and the
    supervisor exited as for a bad engine command."""
    from supervisor.engine.origin import spawn_failure_kind

    assert spawn_failure_kind(OSError(errno.EMFILE, "Too many open files")) is FailureKind.ENGINE_DEAD
    assert spawn_failure_kind(OSError(errno.EAGAIN, "Resource temporarily unavailable")) is FailureKind.ENGINE_DEAD
    assert spawn_failure_kind(FileNotFoundError(errno.ENOENT, "No such file")) is FailureKind.CONFIG_ERROR


def test_the_gateway_asks_for_the_key_as_vllm_does_and_on_every_route_that_runs_the_model() -> None:
    """Issue 25: /invocations, /pooling, /score, /rerank, /classify were served without credentials on an api_key
    engine; 'bearer' in lower case (vLLM accepts any case) or the second of several keys got 401."""
    from aiohttp.test_utils import make_mocked_request
    from supervisor.config import EngineConfig
    from supervisor.host.routes import authorized

    keys = EngineConfig(model="m", args={"api_key": ["k-one", "k-two"]}).api_keys()
    assert keys == ["k-one", "k-two"]

    def ok(path: str, auth: str | None) -> bool:
        headers = {"Authorization": auth} if auth is not None else {}
        return authorized(make_mocked_request("POST", path, headers=headers), keys)

    for path in ("/v1/completions", "/invocations", "/pooling", "/score", "/rerank", "/classify", "/v2/embed"):
        assert not ok(path, None) and not ok(path, "Bearer wrong") and not ok(path, "Basic k-one"), path
        assert ok(path, "Bearer k-one") and ok(path, "bearer k-two") and ok(path, "BEARER k-one"), path
    assert ok("/tokenize", None) and ok("/health", None) and ok("/version", None)


def test_clients_that_leave_while_held_are_never_counted_waiting_nor_sent_to_the_engine() -> None:
    """Issue 25: 34, 104 and 32 ghost requests in three runs were sent to the engine at READY: Python 3.11's
    asyncio.wait_for swallowed the cancellation of a client that left just as the gate opened (CPython gh-86296)."""
    async def go() -> None:
        gate = EngineGate(max_held=1000)
        flights = [Flight(f"r{i}", f"d{i}", 10) for i in range(200)]
        tasks = [asyncio.create_task(gate.admit(f, 60.0)) for f in flights]
        await asyncio.sleep(0)
        assert gate.waiting == 200
        gate.on_state(S.WARMING, S.READY)  # wakes every waiter ...
        for t in tasks:  # ... in the same tick as their clients leave
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        cancelled = [r for r in results if isinstance(r, asyncio.CancelledError)]
        admitted = [f for f, r in zip(flights, results, strict=True) if r is True or r is False]
        assert len(cancelled) + len(admitted) == 200 and len(cancelled) == 200, (len(cancelled), len(admitted))
        assert gate.waiting == 0 and not gate.at_engine
    asyncio.run(go())


def test_a_request_sent_again_after_a_strike_goes_alone_never_in_the_control_batch() -> None:
    """Found by bench/hostile.py: a client resending a struck poison got in with the others during the next
    engine's control period and killed it in a batch (a death no one was proven to cause: budget spent)."""
    async def go() -> None:
        clock = Clock()
        gate = EngineGate(max_held=10, solo_after_s=2.0, clock=clock)
        first = Flight("p1", "d-poison", 300)
        assert (await die_with(gate, clock, [first], FailureKind.ENGINE_DEAD)).proven  # strike 1, alone
        gate.forget(first)  # its client gave up
        gate.on_state(S.WARMING, S.READY)
        again = Flight("p2", "d-poison", 300)
        sent = asyncio.create_task(gate.admit(again, 5.0))
        other = Flight("o", "d-o", 10)
        assert await gate.admit(other, 0.01) is False  # others go during the control ...
        await asyncio.sleep(0)
        assert not sent.done() and gate.solo is again  # ... the resent poison waits to go alone
        gate.leave(other)
        clock.t += 2.0
        gate.leave(other)  # any change of the gate re-checks the waiters
        assert await sent is True and list(gate.at_engine.values()) == [again]
    asyncio.run(go())


def test_a_poison_proven_alone_gives_back_the_budget_of_the_batch_deaths_it_was_at() -> None:
    """bench/hostile.py: four distinct poisons among 32 clients each killed a batch first (nobody proven), and
    those deaths alone spent max_restarts = 6: FATAL. Once a request is proven, the deaths it was at are its."""
    from supervisor.config import LadderConfig, RestartConfig
    from supervisor.decide.policy import Policy
    from supervisor.engine_states import Failure
    from supervisor.profile import Profile

    async def go() -> None:
        clock = Clock()
        gate = EngineGate(max_held=10, solo_after_s=2.0, clock=clock)
        poison, a, b = Flight("p", "d-p", 300), Flight("a", "d-a", 10), Flight("b", "d-b", 10)
        first = await die_with(gate, clock, [poison, a, b], FailureKind.ENGINE_DEAD)
        assert not first.proven and first.explained == 0
        second = await die_with(gate, clock, [poison], FailureKind.ENGINE_DEAD, served_s=2.5)
        assert second.proven and second.explained == 1  # the batch death is now explained
        third = await die_with(gate, clock, [poison], FailureKind.ENGINE_DEAD, served_s=2.5)
        assert third.proven and third.explained == 0 and third.quarantined is poison  # given back once
    asyncio.run(go())

    policy = Policy(RestartConfig(max_restarts=2), LadderConfig(), Profile())
    dead = Failure(FailureKind.ENGINE_DEAD, "engine core exited unexpectedly")
    assert policy.on_failure(dead, Profile(), 0.0).restart and policy.on_failure(dead, Profile(), 1.0).restart
    assert policy.budget_left(2.0) == 0
    policy.forgive(1)
    assert policy.budget_left(2.0) == 1 and policy.on_failure(dead, Profile(), 2.0).restart


def test_dev_mode_is_read_as_vllm_reads_it_so_no_dev_mode_engine_goes_unguarded() -> None:
    from supervisor.engine import ipc

    for on in ("1", "2", " 1 ", "01", "true"):  # vLLM: bool(int(value)); "true" it cannot read: guarded anyway
        assert ipc.dev_mode({"VLLM_SERVER_DEV_MODE": on}), on
    for off in ("", "0", "00"):
        assert not ipc.dev_mode({"VLLM_SERVER_DEV_MODE": off}), off
    assert not ipc.dev_mode({})


def test_kinship_to_a_quarantined_request_is_its_prompt_with_or_without_its_fields() -> None:
    q = admission.Quarantine()
    killer = parsed({"model": "m", "prompt": "hello number 2", "stop": ["ZAP"]})
    q.add(killer.digest, 1e12, None, "r", "engine_dead", killer.shape, (), killer.prompt_key)
    nudged = parsed({"model": "m", "prompt": "hello number 2", "stop": ["ZAP"], "temperature": 0.9})
    plain = parsed({"model": "m", "prompt": "hello number 2"})
    other = parsed({"model": "m", "prompt": "hello number 3", "stop": ["ZAP"]})
    assert q.holds(nudged.digest, 0.0) is None and q.holds(plain.digest, 0.0) is None  # none of them refused
    assert [q.kinship(p.prompt_key, p.shape, 0.0) for p in (nudged, plain, other)] == [2, 1, 0]
    assert q.kinship(plain.prompt_key, plain.shape, 2e12) == 0  # expired
    loaded, dropped = admission.Quarantine.load(q.as_dict())
    assert not dropped and loaded.kinship(nudged.prompt_key, nudged.shape, 0.0) == 2
