"""Recovery's rules without processes: which commands a standby can become, its environment, the rungs to
precompile, OpenMP CPU sets."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from supervisor.child import vllm_standby
from supervisor.config import LadderConfig, RestartConfig
from supervisor.config_file import parse
from supervisor.decide.policy import Policy, step_down
from supervisor.event_stream import EngineEnvReported
from supervisor.host import compile_cache
from supervisor.host.real import RealHost
from supervisor.profile import Knob, Profile
from supervisor.recovery import Recovery
from supervisor.recovery.precompile import RECORD, Precompiler
from supervisor.recovery.standby import VLLM_CLI, StandbyPool, entry_of, start_env, vllm_env_of

from tests.helpers.events import failed


def test_a_standby_knows_the_engine_commands_it_can_become(tmp_path: Path) -> None:
    assert entry_of(["/v/bin/python3", "-m", "vllm.entrypoints.openai.api_server"]) is not None
    m = entry_of(["/v/bin/python3", "-m", "vllm.entrypoints.openai.api_server"])
    assert m is not None and (m.mode, m.target, m.args_from) == ("module", "vllm.entrypoints.openai.api_server", 3)
    s = entry_of([sys.executable, "/x/server.py"])
    assert s is not None and (s.mode, s.target, s.args_from) == ("script", "/x/server.py", 2)
    (tmp_path / "bin").mkdir()
    for exe in ("vllm", "python"):
        (tmp_path / "bin" / exe).write_text("#!/bin/sh\n")
        os.chmod(tmp_path / "bin" / exe, 0o755)
    v = entry_of([str(tmp_path / "bin" / "vllm"), "serve"])
    assert v is not None and (v.python, v.mode, v.target, v.args_from) == \
        (str(tmp_path / "bin" / "python"), "function", VLLM_CLI, 1)
    # Anything else (a wrapper, a shell script, a bare `vllm` without its interpreter beside it) starts cold.
    assert entry_of(["numactl", "--cpunodebind=0", "python3", "-m", "vllm.entrypoints.openai.api_server"]) is None
    assert entry_of(["/opt/start-vllm.sh"]) is None
    assert entry_of(["vllm", "serve"]) is None


def test_the_rungs_to_precompile_are_a_runtime_ooms_step_down_the_climb_back_and_the_rest_of_the_way_down() -> None:
    ladder = LadderConfig(max_num_batched_tokens=(8192, 4096, 2048), max_num_batched_tokens_floor=1024)
    configured = Profile(max_num_batched_tokens=8192, max_num_seqs=64)
    policy = Policy(RestartConfig(), ladder, configured)
    assert [p.max_num_batched_tokens for p in policy.next_rungs(configured)] == [4096, 2048, 1024]
    mid = configured.with_(max_num_batched_tokens=4096)
    assert [p.max_num_batched_tokens for p in policy.next_rungs(mid)] == [2048, 8192, 1024]
    policy.rung_failures[mid.with_(max_num_batched_tokens=2048).key()] = 2  # known to fail: skipped
    assert [p.max_num_batched_tokens for p in policy.next_rungs(mid)] == [1024, 8192]
    # At the floor a runtime OOM lowers max_num_seqs, and nothing further is walked ahead of time (the climb
    # back to 2048 is known to fail).
    floor = configured.with_(max_num_batched_tokens=1024)
    assert [(p.max_num_batched_tokens, p.max_num_seqs) for p in policy.next_rungs(floor)] == [(1024, 32)]
    # The shipped ladder from vLLM's default chunk: every rung down to the 512 floor.
    shipped = Policy(RestartConfig(), LadderConfig(), Profile(max_num_batched_tokens=8192))
    assert [p.max_num_batched_tokens for p in shipped.next_rungs(Profile(max_num_batched_tokens=8192))] \
        == [6144, 4096, 2048, 512]
    # vLLM's compile hash ignores the memory fraction: a utilization rung needs no compile of its own.
    assert mid.compile_key() == mid.with_(gpu_memory_utilization=0.8).compile_key()
    assert mid.compile_key() != mid.with_(max_num_seqs=32).compile_key()


def test_a_standby_start_forks_the_engine_core_unless_the_engine_env_names_a_method() -> None:
    assert start_env({"A": "1"}, fork=True) == {"A": "1", "VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    assert start_env({"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}, fork=True) == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert start_env({"A": "1"}, fork=False) == {"A": "1"}
    # What vLLM set for its EngineCore is added where the start's own environment is silent.
    assert start_env({"A": "1", "LD_PRELOAD": "mine.so"}, True, {"A": "2", "LD_PRELOAD": "gomp.so", "B": "3"}) == \
        {"A": "1", "LD_PRELOAD": "mine.so", "B": "3", "VLLM_WORKER_MULTIPROC_METHOD": "fork"}


def test_what_vllm_set_for_its_engine_core_is_kept_without_the_per_start_variables() -> None:
    reported = {"LD_PRELOAD": "/t/libgomp.so.1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
                "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "PYTHONPATH": "/run/7", "VLLM_LOGGING_CONFIG_PATH": "/run/7/x",
                "VLLMSUP_EVENTS": "/run/7/events.sock", "_VLLMSUP_HOOK_DIR": "/run/7", "N": 3}
    assert vllm_env_of(reported) == {"LD_PRELOAD": "/t/libgomp.so.1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    assert vllm_env_of(None) == {} and vllm_env_of(["LD_PRELOAD"]) == {}


def test_what_vllm_set_is_forgotten_when_the_engine_command_or_environment_changes(tmp_path: Path) -> None:
    raw = {"engine": {"model": "m", "env": {"A": "1"}}, "state": {"dir": str(tmp_path)},
           "recovery": {"standby": False}}
    ns = StandbyPool(parse(raw), RealHost(), lambda _: None)
    ns.engine_env({"LD_PRELOAD": "gomp.so"})
    ns.engine_env({})  # a forked EngineCore reports nothing: the last report stands
    ns.configure(parse({**raw, "gateway": {"listen": "127.0.0.1:9"}}))
    assert ns.vllm_env == {"LD_PRELOAD": "gomp.so"}
    ns.configure(parse({**raw, "engine": {"model": "m", "env": {"A": "2"}}}))
    assert ns.vllm_env == {}


def recovery(tmp_path: Path, next_rungs: Callable[[Profile], list[Profile]]) -> Recovery:
    raw = {"engine": {"model": "m"}, "state": {"dir": str(tmp_path)}, "recovery": {"standby": False}}
    return Recovery(parse(raw), RealHost(), lambda _: None, next_rungs)


def test_a_second_engines_report_of_what_vllm_set_counts_only_before_any_engine_said_it(tmp_path: Path) -> None:
    """A spare or throwaway built before the first engine says it for the same install, and lets the standby start
    (``want``); beside a serving engine, or once an engine has reported, the engine's own report is the one kept."""
    rec = recovery(tmp_path, lambda p: [])
    wanted: list[bool] = []
    rec.pool.want = lambda: wanted.append(True)  # type: ignore[method-assign]

    def heard(env: dict[str, str], second: bool) -> None:
        rec.on_event(EngineEnvReported(at=0.0, pid=1, env=env, second_engine=second))

    heard({"A": "throwaway"}, True)  # beside a serving engine (no first build): not the standby's
    assert rec.pool.vllm_env == {} and wanted == []
    rec.ahead.building_first = True
    heard({"A": "spare"}, True)
    assert rec.pool.vllm_env == {"A": "spare"} and wanted == [True]
    heard({"A": "engine"}, False)
    heard({"A": "later spare"}, True)  # a climb's spare built first: the engine's report stands
    assert rec.pool.vllm_env == {"A": "engine"} and wanted == [True]


async def test_a_failures_restart_at_the_same_rung_keeps_the_spare_unless_the_gpu_itself_failed(
        tmp_path: Path) -> None:
    """The spare (6144) stays asleep through an engine_dead's restart at 8192; after a device_fatal (an Xid, ECC),
    which may have taken every context on the card with it, and at a planned start, it goes."""
    top, below = Profile(max_num_batched_tokens=8192), Profile(max_num_batched_tokens=6144)
    rec = recovery(tmp_path, lambda p: [below] if p == top else [])
    asked: list[Profile | None] = []

    async def take(profile: Profile, keep_for: Profile | None = None) -> None:
        asked.append(keep_for)

    rec.ahead.keeper.take = take  # type: ignore[method-assign,assignment]
    await rec.spare_for(top)  # a planned start (the first)
    rec.on_event(failed("engine_dead", "engine core exited unexpectedly"))
    await rec.spare_for(top)
    rec.on_event(failed("device_fatal", "Xid 79: GPU has fallen off the bus"))
    await rec.spare_for(top)
    assert asked == [None, below, None]


def test_omp_cpu_sets_are_read_as_an_openmp_runtime_would() -> None:
    assert vllm_standby.omp_cpus({"GOMP_CPU_AFFINITY": "0 3 1-2 4-9:2"}) == {0, 1, 2, 3, 4, 6, 8}
    assert vllm_standby.omp_cpus({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}) == {0, 1, 2}
    assert vllm_standby.omp_cpus({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,2-3]"}) == {0, 2, 3}
    assert vllm_standby.omp_cpus({"OMP_PLACES": "{0:4}"}) is None  # an interval: left to the runtime
    assert vllm_standby.omp_cpus({}) is None


def test_compiles_made_before_the_first_ready_are_filed_under_the_vllm_it_reports(tmp_path: Path) -> None:
    """A start's compile-first (and a spare built first) runs before any engine of the run said which vLLM this
    is: its records wait under "?" and go under the version the first READY reports; before that READY the last
    version seen on the host is assumed; a "?" left by a run that never reached READY is not trusted later."""
    cfg = parse({"engine": {"model": "m"}, "state": {"dir": str(tmp_path)}})
    rung = Profile(max_num_batched_tokens=4096)
    first = Precompiler(cfg, host=None)  # type: ignore[arg-type]  # the record needs no host
    assert first.known_version() is None
    first.note_compiled(rung, None)
    assert first.is_compiled(rung, None) and not first.is_compiled(rung, "0.26.0")
    first.learnt_version("0.26.0")
    assert first.is_compiled(rung, "0.26.0") and not first.is_compiled(rung, None)
    first.note_compiled(rung.with_(max_num_batched_tokens=2048), None)  # a run that never reaches READY again
    later = Precompiler(cfg, host=None)  # type: ignore[arg-type]
    assert later.known_version() == "0.26.0" and later.is_compiled(rung, "0.26.0")
    assert not later.is_compiled(rung.with_(max_num_batched_tokens=2048), None)


def test_the_rung_a_failover_climbs_back_to_is_the_configured_rung_compiled_at_the_first_start(tmp_path: Path) -> None:
    """The H200 (issue 27, gpu_proof.py): the configured 8192 left chunked prefill to vLLM, the step down to 6144
    says --enable-chunked-prefill, so the climb back to 8192 said it too and was compiled a second time (41 s
    before the next start's engine) although vLLM's cache held it: chunked prefill is vLLM V1's default and in no
    compile hash. A record an earlier supervisor wrote with the flag counts too."""
    configured = Profile(max_num_batched_tokens=8192, max_num_seqs=10, max_model_len=131072)
    ladder = LadderConfig()
    policy = Policy(RestartConfig(), ladder, configured)
    down = step_down(configured, ladder, Knob.MAX_NUM_BATCHED_TOKENS)
    assert down is not None and "--enable-chunked-prefill" in down.flags()
    climb = policy.climb_target(down)
    assert climb is not None and climb.max_num_batched_tokens == 8192
    assert climb.compile_key() == configured.compile_key()
    assert configured.with_(enable_chunked_prefill=False).compile_key() != configured.compile_key()

    cfg = parse({"engine": {"model": "m"}, "state": {"dir": str(tmp_path)}})
    first = Precompiler(cfg, host=None)  # type: ignore[arg-type]  # the record needs no host
    first.note_compiled(configured, "0.26.0")
    assert first.is_compiled(climb, "0.26.0")
    (engine_id,) = first.compiled
    written_before = {engine_id: [" ".join(down.with_(gpu_memory_utilization=None).flags())]}
    (tmp_path / RECORD).write_text(json.dumps(written_before))
    assert Precompiler(cfg, host=None).is_compiled(down, "0.26.0")  # type: ignore[arg-type]


def test_a_planned_starts_build_first_bound_is_the_sum_of_its_steps_own_bounds() -> None:
    """Issue 37, item 3: the start's watchdog deadline for building first was 2 x precompile_timeout_s + the spare's
    canary and sleep: it left out the throwaways' stops (SIGTERM then SIGKILL, each THROWAWAY_STOP_S, also for those
    the timeout cancels) and the wait for the card's memory (release_timeout_s), 80 s at the defaults: past the
    heartbeat's slack, the watchdog could stop being petted while the supervisor was only waiting."""
    import inspect

    from supervisor.bounds import SPARE_CANARY_S, SPARE_SLEEP_S, STEP_SLACK_S, THROWAWAY_STOP_S
    from supervisor.recovery.ahead import build_first_bound_s
    from supervisor.recovery.throwaway import Throwaway

    cfg = parse({"engine": {"model": "m"}, "recovery": {"precompile_timeout_s": 123.0},
                 "gpu": {"release_timeout_s": 45.0}})
    stop = inspect.signature(Throwaway.stop).parameters
    assert stop["grace_s"].default == stop["kill_s"].default == THROWAWAY_STOP_S  # what each stop waits at most
    compile_first = 123.0 + 2 * THROWAWAY_STOP_S + 45.0  # the throwaways, their stops, the card released
    spare_first = 123.0 + SPARE_CANARY_S + SPARE_SLEEP_S + 2 * THROWAWAY_STOP_S  # /health, canary, sleep, or stopped
    assert build_first_bound_s(cfg) == compile_first + spare_first
    defaults = parse({"engine": {"model": "m"}})
    old = 2 * defaults.recovery.precompile_timeout_s + SPARE_CANARY_S + SPARE_SLEEP_S
    assert build_first_bound_s(defaults) - old == 4 * THROWAWAY_STOP_S + defaults.gpu.release_timeout_s
    assert build_first_bound_s(defaults) - old > STEP_SLACK_S  # what the old bound's slack could not absorb


def test_a_starts_wait_for_the_spare_is_bounded_by_a_checks_wake_and_its_own_wake() -> None:
    """Issue 37, item 3: the start's deadline at its gates was the engine's stop plus one wake (engine/run.py's
    SPARE_WAKE_BOUND_S). A start waits for a check's wake under way (the lock they share) before its own: that
    check's wake, canary and /sleep (SPARE_SLEEP_S: 300 s) were outside it, and the watchdog could stop being petted
    while a slow check finished. The bound now lives beside the steps (take_bound_s)."""
    from supervisor.bounds import (
        SPARE_CANARY_S,
        SPARE_HEALTH_S,
        SPARE_ROOM_WAIT_S,
        SPARE_SLEEP_S,
        SPARE_WAKE_S,
        STEP_SLACK_S,
    )
    from supervisor.recovery.spare import take_bound_s

    cfg = parse({"engine": {"model": "m", "stop_timeout_s": 40.0, "kill_timeout_s": 7.0}})
    wake = SPARE_WAKE_S + SPARE_HEALTH_S + SPARE_CANARY_S  # /wake_up, /health, the canary's answer
    drop = 40.0 + 7.0  # SpareKeeper.drop: the engine's stop grace, then SIGKILL
    # a check under way (its wake, canary and sleep), or a dying engine's wake ahead (its weights' wake first where
    # only they fit, the card read for room, the rest of its wake and the warm-up), or its spare dropped
    ahead = SPARE_ROOM_WAIT_S + wake + max(SPARE_SLEEP_S, SPARE_WAKE_S + 300.0) + drop  # [warmup] timeout_s
    assert take_bound_s(cfg) == ahead + wake + drop
    assert ahead > SPARE_ROOM_WAIT_S + wake + SPARE_SLEEP_S + drop  # the weights' wake came after: counted
    old = drop + wake + STEP_SLACK_S
    assert take_bound_s(cfg) - old > STEP_SLACK_S  # what the old bound's slack could not absorb



def test_a_dying_engines_settled_verdict_wakes_the_spare_only_of_a_runtime_ooms_step_down() -> None:
    """Issue 38, item 5: which spare a death settled before its stop wakes beside the dead engine (recovery/spare.py
    ``wake_beside_the_dying``): a runtime OOM's one rung down, the spare's rung; nothing for a death that restarts
    the same rung (the spare stays asleep for the next memory failure), the device's own fault (nothing on it is
    kept), or a runtime OOM at the ladder's floor."""
    from supervisor.engine_states import FailureKind as K
    from supervisor.recovery.spare import wake_beside_the_dying

    down, further = Profile(max_num_batched_tokens=6144), Profile(max_num_batched_tokens=4096)
    cases = [
        (K.RUNTIME_OOM, [down, further], down),
        (K.RUNTIME_OOM, [], None),  # at the floor: no rung below, no spare
        (K.ENGINE_DEAD, [down], None),
        (K.DEVICE_FATAL, [down], None),
        (K.STARTUP_MEMORY, [down], None),
        (K.SIGNAL, [down], None),
        (K.HANG, [down], None),
    ]
    assert [wake_beside_the_dying(kind, below) for kind, below, _ in cases] == [want for _, _, want in cases]


def test_a_death_whose_verdict_waits_for_vllms_last_words_wakes_the_spare_its_restart_would_take() -> None:
    """The H200 (run 10): the EngineCore SIGKILLed beside a sleeping spare took 1.325 s to READY, 0.62 s of it the API
    server's own exit (an `engine_dead` verdict is not settled before vLLM has finished logging), the wake after it.
    The spare the restart would take is woken meanwhile (recovery/spare.py ``wake_while_it_exits``): a runtime OOM's
    one rung down, as when settled; a death that would restart its own rung the sleeping spare's, where the policy's
    ``into_sleeping_spare`` takes it (a spare built beside, climbing on, its rung below the engine's)."""
    from supervisor.engine_states import FailureKind as K
    from supervisor.recovery.spare import wake_while_it_exits

    at, down, further = (Profile(max_num_batched_tokens=c) for c in (8192, 6144, 4096))
    climbing, never = LadderConfig(climb_after_s=1800.0), LadderConfig(climb_after_s=0.0)
    cases = [  # kind, below, the sleeping spare's rung (None: none it may take), the engine's rung, ladder -> wake
        (K.RUNTIME_OOM, [down, further], down, at, climbing, down),  # not named by vLLM's dump: not settled
        (K.RUNTIME_OOM, [], None, at, climbing, None),  # at the floor
        (K.ENGINE_DEAD, [down], down, at, climbing, down),  # the EngineCore SIGKILLed (run 10)
        (K.SIGNAL, [down], down, at, climbing, down),
        (K.ENGINE_DEAD, [down], None, at, climbing, None),  # a spare built first (0.9), or woken already
        (K.ENGINE_DEAD, [down], down, at, never, None),  # no climb back: its rung is kept, the spare asleep
        (K.ENGINE_DEAD, [down], at, at, climbing, None),  # a spare of its own rung: a wake of the same rung
        (K.ENGINE_DEAD, [further], at, down, climbing, None),  # a spare above the engine: never a climb by a death
        (K.DEVICE_FATAL, [down], down, at, climbing, None),  # nothing is kept on a faulty card
        (K.STARTUP_MEMORY, [down], down, at, climbing, None),
    ]
    assert [wake_while_it_exits(kind, below, sleeping, engine, ladder)
            for kind, below, sleeping, engine, ladder, _ in cases] == [want for *_, want in cases]


def test_a_planned_start_waits_for_vllm_imported_under_the_engine_config_in_force_or_for_none_to_be_had() -> None:
    from supervisor.bounds import STANDBY_IMPORT_WAIT_S
    from supervisor.recovery.standby import prepared

    cases = [  # runnable, fits, imported, waited_s, failed -> may go now
        (False, False, False, 0.0, False, True),  # standby off, or a launcher no standby can run: cold, as ever
        (True, True, True, 20.0, False, True),  # imported for this config: the start becomes it
        (True, True, False, 20.0, False, False),  # importing: the old engine serves on meanwhile
        (True, True, False, STANDBY_IMPORT_WAIT_S, False, True),  # an import that hangs: cold, not held for ever
        (True, False, False, STANDBY_IMPORT_WAIT_S, False, True),  # one that keeps dying: the same
        (True, False, True, 20.0, False, False),  # imported, but for the command a reload replaced: a new one
        (True, False, False, 0.0, False, False),  # none yet (asked for)
        (True, False, False, 0.0, True, True),  # its spawn failed: cold
    ]
    for *facts, ready in cases:
        assert prepared(*facts) is ready, facts  # type: ignore[arg-type]


def test_a_planned_start_waits_for_a_standby_of_the_config_in_force_at_most_standby_import_wait_s(
        tmp_path: Path) -> None:
    from supervisor.bounds import STANDBY_IMPORT_WAIT_S

    raw = {"engine": {"model": "m", "command": [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]},
           "state": {"dir": str(tmp_path)}, "recovery": {"standby": True}}
    clock = [100.0]
    host = RealHost()
    host.monotonic = lambda: clock[0]  # type: ignore[method-assign]
    pool = StandbyPool(parse(raw), host, lambda _: None)
    wanted: list[int] = []
    pool.want = lambda: wanted.append(1)  # type: ignore[method-assign]
    assert pool.prepared() is False and wanted  # none fits: one is asked for, and the start waits
    clock[0] += STANDBY_IMPORT_WAIT_S - 1
    assert pool.prepared() is False
    # A reload changed the environment meanwhile: the wait is for another standby, counted from now.
    pool.configure(parse({**raw, "engine": {**raw["engine"], "env": {"A": "2"}}}))
    clock[0] += 2
    assert pool.prepared() is False
    clock[0] += STANDBY_IMPORT_WAIT_S  # whatever became of it (an import that hangs, one that keeps dying): cold
    assert pool.prepared() is True
    off = StandbyPool(parse({**raw, "recovery": {"standby": False}}), host, lambda _: None)
    assert off.prepared() is True  # no standby to wait for: a start as ever


def test_a_reload_that_moves_vllms_cache_reads_the_new_caches_notes_and_notes_there(tmp_path: Path) -> None:
    """A reload changing VLLM_CACHE_ROOT in [engine.env] kept the old root: the new cache's rungs compiled by another
    supervisor were compiled again, and the next READY's note was refused as outside the root."""
    old, new = tmp_path / "old", tmp_path / "new"
    state = {"dir": str(tmp_path / "state")}
    before = parse({"engine": {"model": "m", "env": {"VLLM_CACHE_ROOT": str(old)}}, "state": state})
    after = parse({"engine": {"model": "m", "env": {"VLLM_CACHE_ROOT": str(new)}}, "state": state})
    rung, other = Profile(max_num_batched_tokens=4096), Profile(max_num_batched_tokens=2048)
    held = new / "torch_compile_cache" / "e33753fcf3" / "rank_0_0" / "backbone"
    held.mkdir(parents=True)
    another = parse({"engine": {"model": "m", "env": {"VLLM_CACHE_ROOT": str(new)}}, "state": {"dir": str(tmp_path)}})
    elsewhere = Precompiler(another, host=None)  # type: ignore[arg-type]  # another supervisor on the new cache
    elsewhere.note_compiled(rung, "0.26.0", str(held))

    mine = Precompiler(before, host=None)  # type: ignore[arg-type]
    assert not mine.is_compiled(rung, "0.26.0")
    mine.configure(after)
    assert mine.cache_root == new and mine.is_compiled(rung, "0.26.0")
    assert not mine.is_compiled(other, "0.26.0")
    mine.note_compiled(other, "0.26.0", str(held))
    assert other.compile_key() in compile_cache.read(new)[mine._engine_id("0.26.0")]
