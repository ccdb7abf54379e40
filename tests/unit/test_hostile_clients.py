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
                                          {**base, "guided_json": {"type": "object"}}, {**base, "max_tokens": 5})}
    assert len(digests) == 5
    # What never reaches the engine's computation does not make another request of it.
    assert parsed(base).digest == parsed({**base, "stream": True, "user": "u-1"}).digest
    assert parsed({"prompt": "x", "model": "m"}).digest == parsed({"model": "m", "prompt": "x"}).digest


def test_a_strike_needs_evidence_and_a_crash_loop_quarantines_nobody() -> None:
    """Defect 3: with an engine that dies after each start whatever it serves, the largest request was
    sent alone, "died alone" and was quarantined."""
    async def go() -> None:
        gate = EngineGate(max_held=10)
        big = Flight("big", "d-big", 214)
        for _ in range(4):  # SIGSEGV a few seconds after each start, nothing in vLLM's records names a request
            gate.on_state(S.WARMING, S.READY)
            await gate.admit(big, 1.0)
            gate.on_state(S.READY, S.STOPPING)
            gate.leave(big)
            assert gate.on_failure(FailureKind.SIGNAL, None) is None
            gate.on_state(S.STOPPING, S.STARTING)
        assert big.strikes == 0 and not big.quarantined
        # An out-of-memory death with the request alone at the engine is evidence.
        for expect_quarantine in (False, True):
            gate.on_state(S.WARMING, S.READY)
            await gate.admit(big, 1.0)
            gate.on_state(S.READY, S.STOPPING)
            gate.leave(big)
            assert (gate.on_failure(FailureKind.RUNTIME_OOM, None) is big) is expect_quarantine
            gate.on_state(S.STOPPING, S.STARTING)
    asyncio.run(go())


def test_an_unexplained_death_strikes_only_the_request_vllm_named() -> None:
    async def go() -> None:
        gate = EngineGate(max_held=10)
        gate.on_state(S.WARMING, S.READY)
        a, b = Flight("a", "d-a", 10), Flight("b", "d-b", 9000)
        await gate.admit(a, 1.0)
        await gate.admit(b, 1.0)
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
    from supervisor.gateway import routes

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
    from supervisor.config import parse
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

    async def die_alone(gate: EngineGate, f: Flight, at_floor: bool) -> Flight | None:
        gate.on_state(S.WARMING, S.READY)
        await gate.admit(f, 1.0)
        gate.on_state(S.READY, S.STOPPING)
        gate.leave(f)
        out = gate.on_failure(FailureKind.RUNTIME_OOM, None, at_floor=at_floor)
        gate.on_state(S.STOPPING, S.STARTING)
        return out

    async def go() -> None:
        gate = EngineGate(max_held=10)
        big = Flight("big", "d-big", 30000)
        assert await die_alone(gate, big, at_floor=False) is None and not gate.take_floor_wish()
        assert await die_alone(gate, big, at_floor=False) is None  # two strikes, above the floor: not yet
        assert gate.take_floor_wish() and not gate.take_floor_wish()  # asked once
        assert gate.solo is big and not big.quarantined
        assert await die_alone(gate, big, at_floor=True) is big and big.quarantined  # died alone there too
        # An engine already at the floor quarantines at the second strike, as before.
        other = Flight("other", "d-other", 30000)
        await die_alone(gate, other, at_floor=True)
        assert await die_alone(gate, other, at_floor=True) is other and not gate.take_floor_wish()
    asyncio.run(go())
    ladder = LadderConfig()
    low = floor_of(Profile(max_num_batched_tokens=8192, max_num_seqs=16), ladder)
    assert low.max_num_batched_tokens == 2048 and low.enable_chunked_prefill  # the lowest listed rung, not 512
    assert floor_of(low, ladder) == low
    assert floor_of(Profile(max_num_batched_tokens=1024), ladder).max_num_batched_tokens == 1024  # never raised
