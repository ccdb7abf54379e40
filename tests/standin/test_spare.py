"""The spare: the next rung's engine built while the engine serves, kept asleep, and woken by the next start."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
from supervisor.decide.spoiled_cache import PORT_TAKEN_TRIES
from supervisor.ops import control

from tests.helpers.processes import (
    STANDIN_BASE,
    Launcher,
    Sup,
    at,
    cli,
    deep_merge,
    gone,
    http_json,
    send_long_prompt,
)

LONG = "word " * 30000
COLD_S = 3.0  # the stand-in's start delay: a cold start takes at least this long, a woken spare none of it
SPARE: dict[str, Any] = {
    "engine": {"env": {"FAKE_VLLM_START_DELAY": str(COLD_S), "FAKE_VLLM_OOM_TOKENS": "5000"}},
    "recovery": {"spare": "on", "precompile_idle_s": 0.2},
    "gateway": {"hold_timeout_s": 60.0, "pressure_poll_s": 0.2},
}


@pytest.fixture
def supervise(tmp_path: Path) -> Iterator[Callable[..., Sup]]:
    launcher = Launcher(tmp_path, deep_merge(STANDIN_BASE, SPARE), strict_stops=True)
    yield launcher.start
    launcher.cleanup()


def asleep(sup: Sup, timeout: float = 60) -> dict[str, Any]:
    st = sup.wait_for(lambda s: (s["next_start"]["spare"] or {}).get("state") == "asleep", timeout, "a spare asleep")
    spare: dict[str, Any] = st["next_start"]["spare"]
    return spare


def complete(url: str, prompt: str = "hello there") -> int:
    code, _ = http_json(url + "/v1/completions", {"model": "fake-model", "prompt": prompt, "max_tokens": 3})
    return code


def test_a_runtime_oom_wakes_the_spare_instead_of_starting_an_engine(supervise: Callable[..., Sup]) -> None:
    sup = supervise()
    first = sup.wait_ready(30)
    assert first["timings"]["start_to_ready_s"] >= COLD_S
    spare = asleep(sup)
    assert spare["profile"]["max_num_batched_tokens"] == 6144  # the rung a runtime OOM steps down to
    proc = psutil.Process(spare["pid"])
    argv = proc.cmdline()
    assert "--enable-sleep-mode" in argv and "dummy" not in argv  # the real weights, in sleep mode
    assert proc.nice() == psutil.Process().nice()  # not niced: it becomes the engine
    (building,) = sup.events("ahead.building_beside")  # issue 38, item 6: the journal's line for it
    assert building["what"] == "spare" and building["profile"]["max_num_batched_tokens"] == 6144, building
    record = sup.state_dir / "builds.json"  # the next one's time left: written as its build ends
    sup.wait_for(lambda _: record.exists() and json.loads(record.read_text()).get("spare", 0) > 0, 10, "the record")
    spare_url = f"http://127.0.0.1:{spare['port']}"
    assert complete(spare_url) == 500  # asleep: no weights to serve with
    assert sup.gateway is not None and complete(sup.gateway) == 200

    assert send_long_prompt(sup) == 500  # the engine dies of a (stand-in) runtime OOM
    # Requests that reach the gateway while the engine is out are held, and go to the spare's port once it is the
    # engine (on the H200 they were sent to the dead engine's port and answered 502 before this was fixed).
    with ThreadPoolExecutor(4) as pool:
        held = list(pool.map(complete, [sup.gateway] * 4))
    assert held == [200] * 4
    st = sup.wait_ready(30, restarts=1)
    assert st["last_failure"]["kind"] == "runtime_oom"
    assert st["engine_pid"] == spare["pid"] and st["engine_url"] == spare_url
    assert st["profile"]["max_num_batched_tokens"] == 6144
    spawned = sup.events("engine.spawned")
    assert [e["spare"] for e in spawned] == [False, True] and spawned[1]["pid"] == spare["pid"]
    woken = sup.events("spare.woken")
    assert len(woken) == 1 and woken[0]["pid"] == spare["pid"]
    # Issue 27, item 4: the woken spare answered the canary prompt as it did before it slept.
    assert woken[0]["canary"]["checked"] is True and woken[0]["canary"]["equal"] is True, woken[0]
    # Nothing was built: the wake and the warm-up, not the stand-in's start delay.
    assert st["timings"]["start_to_ready_s"] < COLD_S / 2, st["timings"]
    recovered = sup.events("engine.recovered")[-1]["recovered_after_s"]
    assert recovered < COLD_S, recovered
    # The gateway follows the engine to the spare's port; the supervisor's probes and canary do too.
    assert complete(sup.gateway) == 200
    assert complete(spare_url) == 200
    assert sup.status()["state"] == "READY"  # type: ignore[index]

    # The woken engine is ours like any: its death is classified from its own log lines (its pipes handed over)
    # and its API server's typed events reach this start's event socket.
    assert complete(spare_url, LONG) == 500  # 6144 is still over the stand-in's 5000
    st = sup.wait_ready(30, restarts=2)
    assert st["last_failure"]["kind"] == "runtime_oom", st["last_failure"]
    incident = json.loads(Path(st["last_failure"]["incident"]).read_text())
    assert incident["argv"] == spawned[1]["argv"]
    assert any("CUDA out of memory" in line for line in incident["log_tail"])
    assert any(e.get("pid") == spare["pid"] for e in incident["events"]), incident["events"][-5:]


def test_a_settled_runtime_oom_is_stopped_at_once_and_the_woken_spare_warms_in_one_round(
        supervise: Callable[..., Sup]) -> None:
    """Issue 38, item 5: of the H200's 1.7 s from the seed's crash to READY with a spare, 0.7 s went to waiting for
    vLLM's API server to exit by itself after its engine died, and 0.34 s to a full warm-up after the wake."""
    exit_s = 8.0  # this stand-in's API server exits by itself this long after its engine died
    sup = supervise({"engine": {"dead_grace_s": 2 * exit_s, "args": {"enable_log_requests": True},
                                "env": {"FAKE_VLLM_DEAD_EXIT_S": str(exit_s)}}})
    sup.wait_ready(30)
    spare = asleep(sup)
    assert send_long_prompt(sup) == 500  # the engine dies of a (stand-in) runtime OOM, its request named
    st = sup.wait_ready(30, restarts=1)
    assert st["engine_pid"] == spare["pid"]
    failed = sup.events("engine.failed")[-1]
    assert failed["kind"] == "runtime_oom" and failed["suspect_request"], failed
    # Stopped at once, not after the API server's own exit: killed by the supervisor, well before exit_s.
    stopped = sup.events("engine.stopped")[-1]
    assert stopped["returncode"] is not None and stopped["returncode"] < 0, stopped
    assert sup.events("engine.recovered")[-1]["recovered_after_s"] < exit_s / 2
    incident = json.loads(Path(st["last_failure"]["incident"]).read_text())
    assert any("CUDA out of memory" in line for line in incident["log_tail"])  # the evidence was in hand
    # The woken spare's warm-up: the same prompts, each for one token (its canary proved its decode). Woken beside the
    # dead engine, it was warmed up at the wake, while that engine was stopped (``spare.woken`` warmup_s); its log,
    # relayed once its start adopted it, shows no warm-up of that start's own.
    (woken, ) = sup.events("spare.woken")
    assert woken["beside"] is True and woken["warmup_s"] > 0, woken
    warmups = [line for line in sup.log_path.read_text(errors="replace").splitlines()
               if "Received request cmpl-warmup-" in line]
    sizes = len(st["history"][-1]["warmup_prompts"])
    assert sizes and len(warmups) == sizes, warmups  # the first start's
    assert not any("max_tokens=1)" in line or f"pid={spare['pid']})" in line for line in warmups), warmups


def test_a_settled_runtime_oom_wakes_the_spare_beside_the_dead_engine_while_its_tree_is_stopped(
        supervise: Callable[..., Sup]) -> None:
    """Issue 38, item 5: the H200's failover with a spare (1.16 s) was the dead engine's kill and GPU release (0.33 s),
    then the spare's wake (0.57 s) and canary: one after the other. Where the card holds the spare awake beside the
    dead engine (here no NVML card: it always does), a runtime OOM settled before the stop wakes the spare the
    restart goes to while the dead engine's tree is killed and its memory released. Here the wake takes 1.5 s: it
    began before the dead engine's stop was over, and the start that follows adopts the spare awake."""
    wake_s = 1.5
    sup = supervise({"engine": {"env": {"FAKE_VLLM_WAKE_S": str(wake_s)}}})
    sup.wait_ready(30)
    spare = asleep(sup)
    assert send_long_prompt(sup) == 500  # the engine dies of a (stand-in) runtime OOM, its request named
    st = sup.wait_ready(30, restarts=1)
    assert st["engine_pid"] == spare["pid"] and st["profile"]["max_num_batched_tokens"] == 6144, st
    (woken, ) = sup.events("spare.woken")
    stopped = sup.events("engine.stopped")[0]
    assert woken["beside"] is True and woken["took_s"] >= wake_s, woken
    assert stopped["release_waited"] is True, stopped  # an unplanned stop still waits for the dead engine's memory
    began = at(woken) - woken["took_s"] - woken["canary"]["took_s"]
    # The wake began before the dead engine's stop ended, so no start (which follows the stop) began it. How much of
    # it the start then waits for depends on how long the kill takes, instant here (a bound on it failed under load).
    assert began < at(stopped), (woken, stopped)


def test_a_settled_death_with_only_the_gateway_connected_is_killed_without_the_answering_window(
        supervise: Callable[..., Sup]) -> None:
    """Issue 38, item 5: a settled death's API server got 0.25 s to answer its requests in flight (0.26 s of the
    H200's 1.35 s failover), for clients on the engine's own port, which would otherwise get a reset instead of vLLM's
    500. When every connection to the engine is the gateway's, nobody needs it: the gateway answers or replays
    what the engine lost either way. The engine's tree is killed at once."""
    sup = supervise()
    sup.wait_ready(30)
    asleep(sup)
    assert sup.gateway is not None
    gateway = sup.gateway
    # The long prompt through the gateway: it kills the engine, is replayed to the woken spare (6144), kills that one
    # too, and the supervisor goes to the lowest rung, where it is served.
    code, doc = http_json(gateway + "/v1/completions", {"model": "fake-model", "prompt": LONG, "max_tokens": 4}, 60)
    sup.wait_ready(30, restarts=2)
    windows = sup.events("engine.settled_exit_window")
    assert windows and all(w["outside_clients"] == 0 and w["window_s"] == 0.0 for w in windows), windows
    assert sup.events("engine.failed")[0]["kind"] == "runtime_oom" and sup.events("spare.woken")
    # Its client was held through both deaths and answered, never reset; ordinary requests are served.
    assert code == 200 and doc["choices"], (code, doc)
    assert complete(gateway) == 200


def climb_clients(sup: Sup, until: Callable[[], Any]) -> tuple[Any, list[tuple[float, int]]]:
    """One client through the gateway, a request every 50 ms, until ``until()`` returns; its result and each
    request's (seconds, status)."""
    assert sup.gateway is not None
    gateway, stop, seen = sup.gateway, threading.Event(), []

    def client() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            code = complete(gateway)
            seen.append((time.monotonic() - t0, code))
            stop.wait(0.05)

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(client)
        try:
            out = until()
        finally:
            stop.set()
            running.result()
    return out, seen


def at_rung(chunk: int) -> Callable[[dict[str, Any]], bool]:
    return lambda s: bool(s["ready"] and s["profile"]["max_num_batched_tokens"] == chunk)


@pytest.mark.parametrize("asked_by", ["time", "reset-profile"])
def test_a_climb_wakes_its_rungs_spare_built_beside_and_holds_clients_only_for_the_wake(
        supervise: Callable[..., Sup], asked_by: str) -> None:
    """Issue 38, item 2: a climb back (climb_after_s, or the operator's reset-profile) started its rung cold while
    every client waited (on the H200 at 0.9, 73-87 s with a spare built first). Now its rung's spare is built beside
    the serving engine while it serves, and the climb is a wake: no engine is started while clients wait."""
    sup = supervise({"ladder": {"climb_after_s": 6.0 if asked_by == "time" else 0}})
    sup.wait_ready(30)
    asleep(sup)
    assert send_long_prompt(sup) == 500  # a (stand-in) runtime OOM: the spare at 6144 becomes the engine
    st = sup.wait_ready(30, restarts=1)
    assert st["profile"]["max_num_batched_tokens"] == 6144 and st["degraded"] is True

    def climbed() -> dict[str, Any]:
        if asked_by == "reset-profile":
            answer = control.send(control.path_in(sup.state_dir), "reset-profile")
            assert answer["ok"] is True and "once that start is prepared" in answer["message"], answer
            assert sup.status()["restart_asked"]["max_num_batched_tokens"] == 8192  # type: ignore[index]
        return sup.wait_for(at_rung(8192), 60, "the climb to 8192")

    st, seen = climb_clients(sup, climbed)
    spares = [e for e in sup.events("spare.asleep") if e["profile"]["max_num_batched_tokens"] == 8192]
    assert len(spares) == 1 and st["engine_pid"] == spares[0]["pid"], (spares, st["engine_pid"])
    # Nothing was spawned for the climb: the first start, then two wakes (the failover's and the climb's).
    assert [e["spare"] for e in sup.events("engine.spawned")] == [False, True, True]
    assert st["timings"]["start_to_ready_s"] < COLD_S / 2, st["timings"]
    assert st["restart_asked"] is None
    # Drained of every request, the old engine got no SIGTERM grace to wait out (3.3 s of clients held on the H100).
    stopped = sup.events("engine.stopped")[-1]
    assert stopped["planned"] is True and stopped["at_once"] is True, stopped
    # The client was answered all along, never held for a start (COLD_S).
    assert seen and all(code == 200 for _, code in seen), seen
    assert max(took for took, _ in seen) < COLD_S / 2, seen


def test_a_spare_that_cannot_serve_the_start_is_stopped_and_the_start_is_cold(
        supervise: Callable[..., Sup]) -> None:
    """The operator's restart keeps the profile (8192): the spare (6144) is another rung, so it is stopped
    before the start, which spawns as without a spare; the next READY makes a new one."""
    sup = supervise()
    sup.wait_ready(30)
    first = asleep(sup)
    assert control.send(control.path_in(sup.state_dir), "restart")["ok"] is True
    st = sup.wait_for(lambda s: s["state"] == "READY" and s["start"] == 2, 30, "the restart")
    assert st["engine_pid"] != first["pid"] and st["profile"]["max_num_batched_tokens"] == 8192
    dropped = sup.events("spare.dropped")
    assert dropped and dropped[0]["pid"] == first["pid"] and "another rung" in dropped[0]["reason"]
    assert dropped[0]["fault"] is False
    assert gone(first["pid"])
    second = asleep(sup)
    assert second["pid"] != first["pid"]

    # A spare that dies asleep is noticed and replaced, and a stop takes the spare down with the engine.
    os.kill(second["pid"], signal.SIGKILL)
    sup.wait_for(lambda s: len(sup.events("spare.dropped")) == 2, 30, "the dead spare dropped")
    assert sup.events("spare.dropped")[1]["fault"] is True
    third = asleep(sup)
    assert sup.proc.send_signal(signal.SIGTERM) is None and sup.wait_exit(30) == 0
    assert gone(third["pid"])


def test_a_death_that_restarts_its_rung_wakes_the_spare_below_and_the_climb_takes_the_engine_back_up(
        supervise: Callable[..., Sup]) -> None:
    """Issue 38, item 4: the engine (8192) is SIGKILLed while the spare of 6144 sleeps beside it. A death that is not
    memory's restarts its own rung: a start (the stand-in's COLD_S; 9-15 s on the H100 and H200), with the spare
    left asleep. Since the next spare is built beside the engine again at READY, the restart goes into the spare's
    rung instead: a wake. The ladder's climb takes the engine back to 8192 after climb_after_s. (Where the spare was
    built first, at 0.9, it is kept for the memory failure: tests/standin/test_spare_order.py.)"""
    sup = supervise({"ladder": {"climb_after_s": 4.0}})
    first = sup.wait_ready(30)
    spare = asleep(sup)
    os.kill(first["engine_pid"], signal.SIGKILL)
    st = sup.wait_ready(30, restarts=1)
    assert st["last_failure"]["kind"] == "signal", st["last_failure"]
    assert st["engine_pid"] == spare["pid"] and st["profile"]["max_num_batched_tokens"] == 6144, st
    assert [e["pid"] for e in sup.events("spare.woken")] == [spare["pid"]]
    assert st["timings"]["start_to_ready_s"] < COLD_S / 2, st["timings"]
    (lowered, ) = sup.events("engine.profile_lowered")
    assert lowered["kind"] == "signal" and lowered["diff"]["max_num_batched_tokens"] == [8192, 6144], lowered
    backoff = [e for e in sup.events("engine.state_changed") if e["to"] == "BACKOFF"]
    assert "into the rung of the spare asleep" in backoff[-1]["reason"], backoff
    assert sup.gateway is not None and complete(sup.gateway) == 200

    st = sup.wait_for(lambda s: s["ready"] and s["profile"]["max_num_batched_tokens"] == 8192, 60,
                      "the climb back to 8192")
    assert st["last_failure"]["kind"] == "signal" and st["restarts"] >= 1, st


def test_an_enginecores_death_wakes_the_spare_while_its_api_server_exits_by_itself(
        supervise: Callable[..., Sup]) -> None:
    """The H200 (run 10, docs/runs/README.md): the EngineCore SIGKILLed beside a sleeping spare recovered in 1.325 s,
    0.62 s of it its API server's own exit: an `engine_dead` verdict waits for vLLM's last words (dead_grace_s), and
    the spare was woken only after the stop. Now it is woken while the API server exits (`engine.death_seen`): here
    the stand-in's API server takes 1.2 s to exit (within dead_grace_s) and the wake 1 s, and the spare is awake
    before the dead engine's stop is over: the recovery is the exit, not the exit and then the wake."""
    exit_s, wake_s = 1.2, 1.0
    sup = supervise({"engine": {"env": {"FAKE_VLLM_DEAD_EXIT_S": str(exit_s), "FAKE_VLLM_WAKE_S": str(wake_s)}},
                     "ladder": {"climb_after_s": 60.0}})
    first = sup.wait_ready(30)
    spare = asleep(sup)
    (core, ) = psutil.Process(first["engine_pid"]).children()
    core.kill()
    st = sup.wait_ready(30, restarts=1)
    assert st["last_failure"]["kind"] == "engine_dead", st["last_failure"]
    assert st["engine_pid"] == spare["pid"] and st["profile"]["max_num_batched_tokens"] == 6144, st
    (seen, ) = sup.events("engine.death_seen")
    assert seen["kind"] == "engine_dead", seen
    (woken, ) = sup.events("spare.woken")
    (stopped, ) = sup.events("engine.stopped")
    assert at(woken) < at(stopped) and woken["beside"] is True, (woken, stopped)
    assert stopped["sigkilled"] == [] and stopped["returncode"] == 0  # it exited by itself: its last words are in
    (recovered, ) = sup.events("engine.recovered")
    assert recovered["recovered_after_s"] < exit_s + wake_s, recovered  # the wake inside the exit, not after it
    assert sup.gateway is not None and complete(sup.gateway) == 200


def test_a_spare_left_by_a_sigkilled_supervisor_is_stopped_by_the_next_one(
        supervise: Callable[..., Sup]) -> None:
    sup = supervise()
    sup.wait_ready(30)
    spare = asleep(sup)
    sup.proc.kill()
    sup.proc.wait()
    assert psutil.pid_exists(spare["pid"])
    following = supervise({"state": {"dir": str(sup.state_dir)}})
    following.wait_ready(30)
    left = following.events("engine.leftover_stopped")
    assert any(e["what"] == "spare" and spare["pid"] in e["pids"] for e in left), left
    assert gone(spare["pid"])


def test_a_spare_that_wakes_wrong_is_dropped_by_its_canary_and_no_client_gets_its_garbage(
        supervise: Callable[..., Sup]) -> None:
    """Issue 27, item 4: vLLM's sleep-mode bugs leave a woken engine healthy and wrong; nothing checked it."""
    sup = supervise({"engine": {"env": {"FAKE_VLLM_CORRUPT_AFTER_WAKE": "1"}}})
    sup.wait_ready(30)
    spare = asleep(sup)
    assert sup.gateway is not None
    assert send_long_prompt(sup) == 500  # the engine dies; the start wants the spare's rung
    st = sup.wait_ready(60, restarts=1)
    (dropped,) = sup.events("spare.dropped")
    assert dropped["pid"] == spare["pid"] and dropped["reason"] == "canary" and dropped["fault"] is True
    assert "differs after the wake" in dropped["detail"], dropped
    bundle = json.loads(Path(dropped["incident"]).read_text())
    assert bundle["failure"]["kind"] == "spare_canary"
    assert bundle["before_sleep"]["tokens"] != bundle["after_wake"]["tokens"]
    assert not sup.events("spare.woken") and gone(spare["pid"])
    # The start went on cold: a fresh engine, never the woken one, serves the clients their real answers.
    spawned = sup.events("engine.spawned")
    assert [e["spare"] for e in spawned] == [False, False] and st["engine_pid"] != spare["pid"]
    code, body = http_json(sup.gateway + "/v1/completions", {"model": "fake-model", "prompt": "hello there",
                                                               "max_tokens": 3})
    assert code == 200 and body["choices"][0]["text"] == " x2 x3 x4"


def test_no_spare_is_built_for_engine_arguments_a_wake_is_known_to_break(supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"args": {"enable_lora": True}}})
    st = sup.wait_ready(30)
    st = sup.wait_for(lambda s: "refused" in str((s["next_start"]["spare"] or {}).get("why", "")), 30,
                      "the spare refused")
    assert "LoRA adapters (enable_lora)" in st["next_start"]["spare"]["why"]
    assert not sup.events("spare.asleep")


CHECKED = {"recovery": {"spare_check_every_s": 0.5, "spare_max_wakes": 2}}


def test_a_sleeping_spare_is_woken_checked_and_rebuilt_after_spare_max_wakes(supervise: Callable[..., Sup]) -> None:
    """Issue 27, item 4: each check is a sleep/wake cycle (what vllm#21336's pinned memory grows with): after
    ``spare_max_wakes`` of them the spare is rebuilt fresh; the engine serves throughout."""
    sup = supervise(CHECKED)
    engine = sup.wait_ready(30)["engine_pid"]
    first = asleep(sup)
    st = sup.wait_for(lambda s: any(e["pid"] == first["pid"] for e in sup.events("spare.dropped")), 60,
                      "the spare recycled")
    checks = [e for e in sup.events("spare.checked") if e["pid"] == first["pid"]]
    assert [e["wakes"] for e in checks] == [1, 2], checks
    assert all(e["canary"]["checked"] and e["canary"]["equal"] for e in checks), checks
    (dropped,) = [e for e in sup.events("spare.dropped") if e["pid"] == first["pid"]]
    assert dropped["reason"] == "recycled: woken 2 times by its checks (spare_max_wakes)", dropped
    assert dropped["fault"] is False and gone(first["pid"])
    second = asleep(sup)
    assert second["pid"] != first["pid"] and second["wakes"] in (0, 1, 2)
    st = sup.status() or {}
    assert st["restarts"] == 0 and st["engine_pid"] == engine and st["state"] == "READY"
    assert sup.gateway is not None and complete(sup.gateway) == 200


def test_a_check_finds_a_spare_that_wakes_wrong_before_any_incident_and_none_is_built_again_at_its_rung(
        supervise: Callable[..., Sup]) -> None:
    """A spare vLLM's sleep mode breaks is found by its check while the engine serves (not by the start that
    needed it); the rung gets no spare again in this run, and the failure into it starts cold, not from garbage."""
    sup = supervise(deep_merge(CHECKED, {"engine": {"env": {"FAKE_VLLM_CORRUPT_AFTER_WAKE": "1"}}}))
    sup.wait_ready(30)
    spare = asleep(sup)
    st = sup.wait_for(lambda s: "canary after a wake" in str((s["next_start"]["spare"] or {}).get("why")), 60,
                      "the spare dropped by its check and refused for its rung")
    (dropped,) = sup.events("spare.dropped")
    assert dropped["pid"] == spare["pid"] and dropped["reason"] == "canary" and dropped["fault"] is True
    assert json.loads(Path(dropped["incident"]).read_text())["failure"]["kind"] == "spare_canary"
    assert not sup.events("spare.checked") and gone(spare["pid"])
    assert st["restarts"] == 0 and st["state"] == "READY"
    assert len(sup.events("spare.asleep")) == 1  # none built again at that rung
    assert sup.gateway is not None and send_long_prompt(sup) == 500
    st = sup.wait_ready(30, restarts=1)
    assert [e["spare"] for e in sup.events("engine.spawned")] == [False, False]
    assert st["profile"]["max_num_batched_tokens"] == 6144
    code, body = http_json(sup.gateway + "/v1/completions", {"model": "fake-model", "prompt": "hello there",
                                                               "max_tokens": 3})
    assert code == 200 and body["choices"][0]["text"] == " x2 x3 x4"


def test_a_reload_that_changes_the_engine_wakes_a_spare_of_the_new_settings_never_the_old_one(
        supervise: Callable[..., Sup]) -> None:
    """A spare is a whole engine of the settings it was built with. A reload that changes [engine] (the model, its
    arguments, its environment) and lowers [profile] to the spare's own rung used to wake the old spare for its
    restart: it served the settings the operator had just replaced. Now that spare is dropped at the reload, and the
    reload's restart, prepared while the old engine serves as a climb's is, wakes a spare built from the new
    settings: the clients wait for a wake, not a start."""
    sup = supervise()
    sup.wait_ready(30)
    old = asleep(sup)
    assert old["profile"]["max_num_batched_tokens"] == 6144
    text = sup.config.read_text()
    env, chunk = 'FAKE_VLLM_OOM_TOKENS = "5000"', "max_num_batched_tokens = 8192"
    assert env in text and chunk in text
    sup.config.write_text(text.replace(env, env + ', FAKE_VLLM_TOKEN_DELAY = "0.0011"')
                          .replace(chunk, "max_num_batched_tokens = 6144"))
    done = cli("reload", "--config", str(sup.config))
    assert done.returncode == 0, done.stderr
    st = sup.wait_for(lambda s: s["ready"] and s["start"] == 2, 30, "the restart after the reload")
    assert st["profile"]["max_num_batched_tokens"] == 6144 and st["engine_pid"] != old["pid"], st
    assert psutil.Process(st["engine_pid"]).environ().get("FAKE_VLLM_TOKEN_DELAY") == "0.0011"
    dropped = sup.events("spare.dropped")
    assert [d["pid"] for d in dropped] == [old["pid"]] and dropped[0]["fault"] is False, dropped
    assert dropped[0]["reason"] == "a reload changed [engine] env since it was built", dropped
    (woken, ) = sup.events("spare.woken")
    assert woken["pid"] == st["engine_pid"]  # built after the reload, from its settings
    assert st["timings"]["start_to_ready_s"] < COLD_S / 2, st["timings"]  # a wake, not a start
    assert gone(old["pid"])


PINNED_S = 4.0  # the stand-in's pinned allocation of its weights' copies at a sleep, under PyTorch's default


@pytest.mark.parametrize("setting", ["default", "0"])
def test_a_spare_pins_its_weights_copies_by_host_register_so_its_sleep_does_not_wait_on_pinned_allocation(
        supervise: Callable[..., Sup], setting: str) -> None:
    """Issue 38 (the window after a start or a failover, where a second death finds no spare): most of a level-1
    sleep is PyTorch's pinned allocation of the weights' copies (run 11, H100: 10-16 s of it against a 0.5 s wake).
    A spare runs with ``pinned_use_cuda_host_register`` added to the operator's own allocator settings, in the
    environment its vLLM reads when it sleeps (a standby took it after its imports); ``VLLMSUP_SPARE_HOST_REGISTER
    = "0"`` keeps PyTorch's default."""
    env = {"FAKE_VLLM_PINNED_S": str(PINNED_S), "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    if setting == "0":
        env["VLLMSUP_SPARE_HOST_REGISTER"] = "0"
    sup = supervise({"engine": {"env": env}})
    sup.wait_ready(30)
    spare = asleep(sup)
    (slept,) = [e for e in sup.events("spare.asleep") if e["pid"] == spare["pid"]]
    if setting == "0":
        assert slept["sleep_s"] >= PINNED_S, slept
    else:
        assert slept["sleep_s"] < PINNED_S / 2, slept


@pytest.mark.parametrize("taken", [1, PORT_TAKEN_TRIES])
def test_a_spare_whose_port_is_taken_before_it_binds_it_is_started_again_on_another_and_its_rung_kept(
        supervise: Callable[..., Sup], tmp_path: Path, taken: int) -> None:
    """A second engine is given any port the kernel had free a moment before, and anything on the host may take it
    during vLLM's imports (CI saw it happen to this suite's own ports). Before, that death counted against the rung:
    no spare at that rung for the rest of the run. Now the spare is started again at once on another port; only a
    port taken PORT_TAKEN_TRIES times (one fixed for every engine) counts against the rung."""
    flag = tmp_path / "spare-ports-taken"
    flag.write_text(str(taken))
    sup = supervise({"engine": {"env": {"FAKE_VLLM_SPARE_PORT_TAKEN_FILE": str(flag)}}})
    sup.wait_ready(30)
    if taken < PORT_TAKEN_TRIES:
        spare = asleep(sup)
        assert spare["profile"]["max_num_batched_tokens"] == 6144
    else:
        sup.wait_for(lambda s: "failed to start" in (s["next_start"]["spare"] or {}).get("why", ""), 60,
                     "the rung's spare given up")
    failed = [e for e in sup.events("engine.rung_precompiled") if not e["ok"]]
    assert len(failed) == taken, failed
    assert all("address already in use" in e["error"].lower() for e in failed), failed
    launched = [e["port"] for e in sup.events("precompile.started")]
    if taken < PORT_TAKEN_TRIES:
        assert len(launched) == taken + 1 and spare["port"] == launched[-1], (launched, spare)
        assert "started again on another" in failed[0]["error"], failed[0]
    else:
        assert len(launched) == taken, launched
    assert flag.read_text() == "0"
