"""The restart policy as tables: budget, backoff, ladder down and up, floors, FATAL."""

from __future__ import annotations

from dataclasses import replace

import pytest
from supervisor.config import LadderConfig, RestartConfig
from supervisor.decide.policy import (
    Decision,
    Policy,
    backoff_delay,
    clamp_to_configured,
    into_sleeping_spare,
    step_down,
    step_up,
)
from supervisor.engine_states import ExitCode, Failure, FailureKind
from supervisor.profile import Knob, Profile

LADDER = LadderConfig()
P = Profile(max_num_batched_tokens=8192, max_num_seqs=16, gpu_memory_utilization=0.9)
OOM = Failure(FailureKind.RUNTIME_OOM, "CUDA out of memory. Tried to allocate 176.00 MiB",
              knob=Knob.MAX_NUM_BATCHED_TOKENS)


def policy(**restart: float) -> Policy:
    return Policy(RestartConfig(**restart), LADDER, P, rand=lambda: 0.0)  # type: ignore[arg-type]


def test_runtime_oom_walks_the_default_ladder_then_seqs_then_utilization() -> None:
    seen = []
    p: Profile | None = P
    while p is not None:
        seen.append((p.max_num_batched_tokens, p.max_num_seqs, p.gpu_memory_utilization))
        p = step_down(p, LADDER)
    assert [s[0] for s in seen[:6]] == [8192, 6144, 4096, 2048, 512, 512]
    assert seen[5][1] == 8  # after the chunk floor, max_num_seqs halves
    assert seen[-1] == (512, 1, 0.3)  # every knob at its floor
    assert all(b <= a for a, b in zip([s[2] for s in seen], [s[2] for s in seen[1:]], strict=False))


def test_step_down_never_goes_below_floors() -> None:
    floor = Profile(max_num_batched_tokens=512, max_num_seqs=1, gpu_memory_utilization=0.3)
    assert step_down(floor, LADDER) is None


def test_chunk_step_keeps_max_num_seqs_within_the_token_budget() -> None:
    p = step_down(Profile(max_num_batched_tokens=1024, max_num_seqs=1000), LADDER)
    assert p is not None and p.max_num_seqs <= p.max_num_batched_tokens


def test_startup_utilization_evidence_lowers_utilization_first() -> None:
    p = step_down(P, LADDER, Knob.GPU_MEMORY_UTILIZATION)
    assert p == P.with_(gpu_memory_utilization=0.85)


@pytest.mark.parametrize(("n", "expected"), [(0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (10, 60.0)])
def test_backoff_is_exponential_and_capped(n: int, expected: float) -> None:
    assert backoff_delay(n, RestartConfig(backoff_initial_s=1, backoff_max_s=60), lambda: 0.0) == expected


def test_backoff_jitter_only_shortens() -> None:
    cfg = RestartConfig(backoff_initial_s=10, backoff_max_s=60, backoff_jitter=0.2)
    assert backoff_delay(1, cfg, lambda: 1.0) == pytest.approx(8.0)


@pytest.mark.parametrize(("served", "proven", "expected"), [
    (0.0, False, 4.0), (1.5, False, 2.5), (4.0, False, 0.0), (600.0, False, 0.0),  # the third failure: 4 s
    (0.0, True, 1.0), (0.4, True, 0.6), (14.0, True, 0.0)])  # one request's doing: the shortest step
def test_time_served_before_a_failure_is_taken_off_its_backoff(served: float, proven: bool, expected: float) -> None:
    pol = policy(backoff_initial_s=1, backoff_max_s=60)
    dead = Failure(FailureKind.ENGINE_DEAD, "EngineDeadError")
    pol.on_failure(dead, P, 0)
    pol.on_failure(dead, P, 1)
    d = pol.on_failure(dead, P, 2, proven=proven, served_s=served)
    assert d.restart and d.delay_s == pytest.approx(expected)


def test_restart_budget_spent_is_fatal() -> None:
    pol = policy(max_restarts=2, window_s=60)
    dead = Failure(FailureKind.ENGINE_DEAD, "EngineDeadError")
    assert pol.on_failure(dead, P, 0).restart
    assert pol.on_failure(dead, P, 1).restart
    d = pol.on_failure(dead, P, 2)
    assert not d.restart and d.exit_code is ExitCode.RESTART_BUDGET_SPENT


def test_restarts_outside_the_window_do_not_count() -> None:
    pol = policy(max_restarts=1, window_s=10)
    dead = Failure(FailureKind.ENGINE_DEAD, "x")
    assert pol.on_failure(dead, P, 0).restart
    assert pol.on_failure(dead, P, 11).restart


def test_config_error_is_never_retried() -> None:
    d = policy().on_failure(Failure(FailureKind.CONFIG_ERROR, "unrecognized arguments"), P, 0)
    assert not d.restart and d.exit_code is ExitCode.ENGINE_CONFIG_ERROR


def test_device_fatal_is_retried_once_then_fatal() -> None:
    pol = policy()
    f = Failure(FailureKind.DEVICE_FATAL, "illegal memory access")
    assert pol.on_failure(f, P, 0).restart
    d = pol.on_failure(f, P, 1)
    assert not d.restart and d.exit_code is ExitCode.DEVICE_FATAL


COMPILE_CACHE = Failure(FailureKind.COMPILE_CACHE, "Inference tensors cannot be saved for backward")


@pytest.mark.parametrize(("case", "before", "aside", "restart"), [
    ("the first: moved aside, the same profile", [], True, True),
    ("again before any READY: the cache compiled anew is not the cause, nothing moved", [COMPILE_CACHE], False, True),
    ("again after a READY: spoiled again, moved aside again", [COMPILE_CACHE, "ready"], True, True),
    ("after other failures: moved aside", [OOM, OOM], True, True),
    ("the crash loop's bound still ends it", [COMPILE_CACHE] * 4, False, False),
])
def test_a_spoiled_compile_cache_is_moved_aside_once_per_run_of_failures(
        case: str, before: list[Failure | str], aside: bool, restart: bool) -> None:
    p = policy(max_restarts=10, max_consecutive_failures=5)
    for i, f in enumerate(before):
        p.on_ready() if f == "ready" else p.on_failure(f, P, float(i))  # type: ignore[arg-type]
    d = p.on_failure(COMPILE_CACHE, P, 100.0)
    assert (d.set_aside_compile_cache, d.restart) == (aside, restart), case
    if restart:
        assert d.profile == P and d.failure.kind is FailureKind.COMPILE_CACHE
    assert p.rung_failures.get(P.key(), 0) == sum(f is OOM for f in before)


def test_runtime_oom_lowers_chunk_and_counts_the_rung() -> None:
    pol = policy()
    d = pol.on_failure(OOM, P, 0)
    assert d.restart and d.profile.max_num_batched_tokens == 6144
    assert pol.rung_failures[P.key()] == 1


def test_memory_failure_at_floors_is_fatal() -> None:
    floor = Profile(max_num_batched_tokens=512, max_num_seqs=1, gpu_memory_utilization=0.3)
    d = policy().on_failure(OOM, floor, 0)
    assert not d.restart and d.exit_code is ExitCode.NOTHING_LEFT_TO_LOWER


def test_startup_memory_max_model_len_takes_vllms_estimate() -> None:
    p = P.with_(max_model_len=4096)
    f = Failure(FailureKind.STARTUP_MEMORY, "estimated maximum model length is 896", knob=Knob.MAX_MODEL_LEN,
                suggested=896)
    assert policy().on_failure(f, p, 0).profile.max_model_len == 896


def test_startup_memory_max_model_len_estimate_below_floor_is_fatal() -> None:
    p = P.with_(max_model_len=4096)
    f = Failure(FailureKind.STARTUP_MEMORY, "estimated maximum model length is 16", knob=Knob.MAX_MODEL_LEN,
                suggested=16)
    assert not policy().on_failure(f, p, 0).restart


def test_climb_undoes_one_rung_at_a_time_toward_configured() -> None:
    low = P.with_(max_num_batched_tokens=4096, max_num_seqs=8, gpu_memory_utilization=0.85)
    up1 = step_up(low, P, LADDER)
    assert up1 == low.with_(gpu_memory_utilization=0.9)
    assert up1 is not None
    up2 = step_up(up1, P, LADDER)
    assert up2 == up1.with_(max_num_seqs=16)
    assert up2 is not None
    assert step_up(up2, P, LADDER) == up2.with_(max_num_batched_tokens=6144)
    assert step_up(P, P, LADDER) is None


def test_a_rung_that_failed_twice_is_not_climbed_to_again() -> None:
    pol = policy()
    at_6144 = P.with_(max_num_batched_tokens=6144)
    pol.rung_failures[P.key()] = 2
    assert pol.climb_target(at_6144) is None
    pol.rung_failures[P.key()] = 1
    assert pol.climb_target(at_6144) == P


def test_a_rung_that_failed_twice_is_skipped_going_down() -> None:
    pol = policy()
    pol.rung_failures[P.with_(max_num_batched_tokens=6144).key()] = 2
    assert pol.on_failure(OOM, P, 0).profile.max_num_batched_tokens == 4096


def test_saved_profile_is_clamped_to_what_is_configured_now() -> None:
    saved = P.with_(max_num_batched_tokens=6144, max_num_seqs=64)
    assert clamp_to_configured(saved, P) == P.with_(max_num_batched_tokens=6144)


def test_a_knob_configured_differently_since_it_was_learned_takes_the_configured_value() -> None:
    then = P.with_(gpu_memory_utilization=0.4)
    saved = then.with_(max_num_batched_tokens=6144)
    now = P.with_(gpu_memory_utilization=0.5)
    assert clamp_to_configured(saved, now, then) == now.with_(max_num_batched_tokens=6144)
    assert clamp_to_configured(saved, now) == saved  # a state file from before it says nothing of then
    assert clamp_to_configured(saved, then, then) == saved


def test_startup_memory_max_model_len_without_estimate_halves_the_length() -> None:
    f = Failure(FailureKind.STARTUP_MEMORY, "max seq len (4096)", knob=Knob.MAX_MODEL_LEN, suggested=2048)
    assert policy().on_failure(f, P.with_(max_model_len=4096), 0).profile.max_model_len == 2048


def test_startup_memory_max_model_len_unset_and_no_suggestion_is_fatal() -> None:
    f = Failure(FailureKind.STARTUP_MEMORY, "?", knob=Knob.MAX_MODEL_LEN)
    d = policy().on_failure(f, P, 0)
    assert not d.restart and d.exit_code is ExitCode.NOTHING_LEFT_TO_LOWER


FREE_BELOW = Failure(FailureKind.STARTUP_MEMORY, "Free memory on device cuda:0 (69.79/139.8 GiB) ...",
                     knob=Knob.GPU_MEMORY_UTILIZATION, suggested=0.48, rung_at_fault=False)


def test_free_memory_check_lowers_utilization_to_what_fits_and_nothing_else() -> None:
    p = P.with_(gpu_memory_utilization=0.5)
    d = policy().on_failure(FREE_BELOW, p, 0)
    assert d.restart and d.profile == p.with_(gpu_memory_utilization=0.48)


def test_free_memory_check_below_the_floor_is_fatal_not_a_chunk_step() -> None:
    f = Failure(FailureKind.STARTUP_MEMORY, "Free memory ...", knob=Knob.GPU_MEMORY_UTILIZATION, suggested=0.1)
    d = policy().on_failure(f, P, 0)
    assert not d.restart and d.exit_code is ExitCode.NOTHING_LEFT_TO_LOWER


def test_failures_in_a_row_of_any_spacing_end_in_fatal_exit_4() -> None:
    pol = policy(max_restarts=100, window_s=60, max_consecutive_failures=5)
    hang = Failure(FailureKind.HANG, "engine not healthy within start_timeout_s=900s")
    decisions = [pol.on_failure(hang, P, i * 10_000.0) for i in range(5)]  # far outside the window
    assert [d.restart for d in decisions] == [True, True, True, True, False]
    assert decisions[-1].exit_code is ExitCode.RESTART_BUDGET_SPENT
    assert "5 failures in a row" in decisions[-1].reason


def test_a_ready_between_failures_resets_the_run_of_failures() -> None:
    pol = policy(max_restarts=100, window_s=60, max_consecutive_failures=2)
    dead = Failure(FailureKind.ENGINE_DEAD, "x")
    for i in range(5):
        assert pol.on_failure(dead, P, i * 1000.0).restart
        pol.on_ready()


def test_another_processs_memory_is_not_held_against_the_rung() -> None:
    pol = policy()
    p = P.with_(gpu_memory_utilization=0.5)
    assert pol.on_failure(FREE_BELOW, p, 0).profile.gpu_memory_utilization == 0.48
    assert pol.rung_failures == {}


def test_utilization_and_max_model_len_lowered_by_evidence_climb_back() -> None:
    conf = P.with_(max_model_len=4096)
    low = conf.with_(gpu_memory_utilization=0.48, max_model_len=896)
    seen = [low]
    while (up := step_up(seen[-1], conf, LADDER)) is not None:
        seen.append(up)
    assert seen[-1] == conf
    assert [p.max_model_len for p in seen][-3:] == [1792, 3584, 4096]  # the length comes back last, doubling
    assert seen[1].gpu_memory_utilization == 0.53  # utilization first, one step at a time


def test_an_unexplained_death_repeated_with_the_same_request_is_memory() -> None:
    pol = policy()
    seg = Failure(FailureKind.SIGNAL, "Worker proc VllmWorker-0 died unexpectedly",
                  suspect_request="cmpl-abc-0-1", suspect_tokens=3001)
    first = pol.on_failure(seg, P, 0)
    assert first.failure.kind is FailureKind.SIGNAL and first.profile == P
    second = pol.on_failure(seg, P, 1)
    assert second.failure.kind is FailureKind.RUNTIME_OOM
    assert "treated as a memory failure" in second.failure.evidence and "3001 prompt tokens" in second.failure.evidence
    assert second.profile.max_num_batched_tokens == 6144


def test_unexplained_deaths_with_different_requests_stay_unexplained() -> None:
    pol = policy()
    for n in (100, 200, 300):
        f = Failure(FailureKind.ENGINE_DEAD, "EngineDeadError", suspect_request=f"r{n}", suspect_tokens=n)
        assert pol.on_failure(f, P, n).failure.kind is FailureKind.ENGINE_DEAD


def test_knobs_left_to_vllm_step_down_from_its_default_and_climb_back_to_unset() -> None:
    unset = Profile()
    low = step_down(unset, LADDER)
    assert low is not None and low.max_num_batched_tokens == 6144 and low.max_num_seqs is None
    assert step_up(low, unset, LADDER) == unset.with_(enable_chunked_prefill=True)
    assert clamp_to_configured(low, unset) == low


def test_the_ladder_order_is_configuration() -> None:
    seqs_first = LadderConfig(order=("max_num_seqs", "max_num_batched_tokens"))
    assert step_down(P, seqs_first) == P.with_(max_num_seqs=8)
    assert step_down(P, seqs_first, Knob.MAX_NUM_BATCHED_TOKENS) == P.with_(max_num_batched_tokens=6144,
                                                                             enable_chunked_prefill=True)


def test_the_same_request_id_in_two_decode_deaths_is_also_memory() -> None:
    """A death mid-decode names the request (vLLM prints no prompt length for it): its X-Request-Id matches."""
    pol = policy()
    first = Failure(FailureKind.ENGINE_DEAD, "Worker proc VllmWorker-0 died unexpectedly",
                    suspect_request="cmpl-retry-me-0-1234abcd")
    again = Failure(FailureKind.ENGINE_DEAD, "Worker proc VllmWorker-0 died unexpectedly",
                    suspect_request="cmpl-retry-me-0-deadbeef")
    assert pol.on_failure(first, P, 0).failure.kind is FailureKind.ENGINE_DEAD
    d = pol.on_failure(again, P, 1)
    assert d.failure.kind is FailureKind.RUNTIME_OOM and d.profile.max_num_batched_tokens == 6144


def test_the_budget_left_is_the_lesser_of_the_window_and_the_crash_loop() -> None:
    pol = policy(max_restarts=5, window_s=100, max_consecutive_failures=3)
    assert pol.budget_left(0) == 2  # the third failure in a row is FATAL: two more are restarted
    dead = Failure(FailureKind.ENGINE_DEAD, "x")
    pol.on_failure(dead, P, 0)
    assert pol.budget_left(1) == 1
    pol.on_ready()
    assert pol.budget_left(2) == 2
    for t in (3, 4, 5):
        pol.on_failure(dead, P, t)
        pol.on_ready()
    assert pol.budget_left(6) == 1  # four restarts in the window of five
    assert pol.budget_left(200) == 2  # they left the window


def test_judge_sends_a_memory_death_to_the_floor_when_the_gateway_asks_and_a_reload_keeps_the_memory() -> None:
    """Issue 26: the floor trial and the policy's settings were the lifecycle's to set; they are the policy's."""
    from supervisor.engine_states import Blame

    p = policy(max_restarts=10)
    plain = p.judge(OOM, P, 1.0, Blame())
    assert plain.restart and plain.profile.max_num_batched_tokens == 6144
    floor = p.judge(OOM, P, 2.0, Blame(floor=True))
    assert floor.profile.max_num_batched_tokens == min(LADDER.max_num_batched_tokens)
    assert "then to the lowest rung" in floor.reason
    failed = dict(p.rung_failures)
    p.reconfigure(RestartConfig(max_restarts=3), LADDER, P.with_(max_num_seqs=8))
    assert p.configured.max_num_seqs == 8 and p.restart.max_restarts == 3 and p.rung_failures == failed
    p.forget_failed_rungs()
    assert p.rung_failures == {}


# ---- a death that restarts its own rung, while a spare of the rung below sleeps beside it (issue 38, item 4) ----
ENGINE = Profile(max_num_batched_tokens=8192, max_num_seqs=10, gpu_memory_utilization=0.5)
SPARE_6144 = Profile(max_num_batched_tokens=6144, max_num_seqs=10, gpu_memory_utilization=0.47)


def restart(kind: FailureKind, profile: Profile = ENGINE) -> Decision:
    return Decision(True, profile, Failure(kind, "x"), 0.5, f"{kind.value}: restart with the same profile")


# (case, the policy's decision, the sleeping spare's rung, climb_after_s, the chunk the restart goes to)
INTO_SPARE: list[tuple[str, Decision, Profile | None, float, int]] = [
    ("EngineCore SIGKILLed: a wake, not a start of 8192", restart(FailureKind.SIGNAL), SPARE_6144, 1800.0, 6144),
    ("engine dead with no memory cause", restart(FailureKind.ENGINE_DEAD), SPARE_6144, 1800.0, 6144),
    ("a hang", restart(FailureKind.HANG), SPARE_6144, 1800.0, 6144),
    ("no spare asleep: the same rung", restart(FailureKind.SIGNAL), None, 1800.0, 8192),
    ("climbing off: the engine would stay lower for good", restart(FailureKind.SIGNAL), SPARE_6144, 0.0, 8192),
    ("a device's fault keeps nothing on the card", restart(FailureKind.DEVICE_FATAL), SPARE_6144, 1800.0, 8192),
    ("a runtime OOM goes to the spare's rung by the policy already",
     restart(FailureKind.RUNTIME_OOM, SPARE_6144.with_(gpu_memory_utilization=0.5)), SPARE_6144, 1800.0, 6144),
    ("a spare of a rung above the restart's (after the ladder stepped lower) is no step down",
     restart(FailureKind.SIGNAL, Profile(max_num_batched_tokens=4096, max_num_seqs=10)), SPARE_6144, 1800.0, 4096),
    ("given up: no restart to redirect", replace(restart(FailureKind.SIGNAL), restart=False), SPARE_6144, 1800.0,
     8192),
]


@pytest.mark.parametrize(("case", "decided", "spare", "climb_after_s", "chunk"), INTO_SPARE,
                         ids=[c[0] for c in INTO_SPARE])
def test_a_death_that_restarts_its_rung_goes_into_the_sleeping_spares_rung(
        case: str, decided: Decision, spare: Profile | None, climb_after_s: float, chunk: int) -> None:
    d = into_sleeping_spare(decided, spare, LadderConfig(climb_after_s=climb_after_s))
    assert d.profile.chunk() == chunk, case
    assert d.delay_s == decided.delay_s and d.restart == decided.restart
    if chunk != decided.profile.chunk():
        # the spare serves it: its rung, at no more than the utilization the engine had
        assert d.profile.compile_key() == SPARE_6144.compile_key()
        assert d.profile.gpu_memory_utilization == ENGINE.gpu_memory_utilization
        assert "into the rung of the spare asleep" in d.reason
    else:
        assert d == decided
