"""End to end: the real `vllm-supervisor run` over the stand-in engine (tests/helpers/fake_vllm.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from prometheus_client import CONTENT_TYPE_LATEST
from supervisor.host.real import py_spy

from tests.helpers.processes import (
    LONG_PROMPT,
    Sup,
    cli,
    free_port,
    gone,
    http_json,
    send_long_prompt,
    send_until_served,
    spawned_pids,
)
from tests.helpers.receivers import Receiver, notify_listener


def test_30k_prompt_that_ooms_at_8192_is_served_after_stepping_down(supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "5000"}}})
    sup.wait_ready()
    codes = send_until_served(sup, tries=4)
    assert codes == [500, 500, 200]  # 8192 and 6144 die exactly like vLLM; 4096 serves it
    st = sup.status()
    assert st is not None
    assert st["profile"]["max_num_batched_tokens"] == 4096
    assert st["restarts"] == 2
    assert st["last_failure"]["kind"] == "runtime_oom"
    assert "Tried to allocate" in st["last_failure"]["evidence"]
    assert st["last_failure"]["suspect_request"].startswith("cmpl-")
    lowered = sup.events("engine.profile_lowered")
    assert [e["diff"]["max_num_batched_tokens"] for e in lowered] == [[8192, 6144], [6144, 4096]]
    saved = json.loads((sup.state_dir / "state.json").read_text())
    assert saved["profile"]["max_num_batched_tokens"] == 4096
    assert list((sup.state_dir / "incidents").glob("*runtime_oom.json"))
    assert all(gone(p) for p in spawned_pids(sup)[:-1])

    # The next start of the supervisor begins from what was learned.
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.wait_exit(30) == 0
    again = supervise({"engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "5000"}}, "state": {"dir": str(sup.state_dir)}})
    st2 = again.wait_ready()
    assert st2["profile"]["max_num_batched_tokens"] == 4096
    assert send_long_prompt(again) == 200


def test_a_knob_the_operator_changed_since_takes_the_new_value_over_what_was_learned(
        supervise: Callable[..., Sup]) -> None:
    """The state file kept the whole profile and every knob of it below the configuration won: a host run at 0.4
    and configured to 0.5 afterwards came back at 0.4 (the H200, 2026-12-03). What was learned at a knob the
    operator left alone (the chunk here) still stands."""
    oom = {"engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "5000"}}}
    sup = supervise({**oom, "profile": {"gpu_memory_utilization": 0.4}})
    sup.wait_ready()
    assert send_long_prompt(sup) == 500
    assert sup.wait_ready(restarts=1)["profile"]["max_num_batched_tokens"] == 6144
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.wait_exit(30) == 0
    again = supervise({**oom, "profile": {"gpu_memory_utilization": 0.5}, "state": {"dir": str(sup.state_dir)}})
    profile = again.wait_ready()["profile"]
    assert profile["gpu_memory_utilization"] == 0.5 and profile["max_num_batched_tokens"] == 6144, profile
    argv = again.events("engine.spawned")[0]["argv"]
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.5"


def test_poison_loop_exhausts_the_budget_and_exits_non_zero(supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"env": {"FAKE_VLLM_DIE_AFTER_READY": "0.3"}},
                     "restart": {"max_restarts": 2}})
    assert sup.wait_exit(60) == 4  # ExitCode.RESTART_BUDGET_SPENT
    fatal = sup.events("supervisor.fatal")
    assert fatal and "restart budget spent" in fatal[0]["reason"]
    assert len(spawned_pids(sup)) == 3
    assert all(gone(p) for p in spawned_pids(sup))


def test_api_server_sigkill_leaves_no_orphan(supervise: Callable[..., Sup]) -> None:
    sup = supervise()
    sup.wait_ready()
    tree = sup.engine_tree()
    assert len(tree) == 2, tree  # API server + EngineCore
    api, core = tree[0].pid, tree[1].pid
    os.kill(api, signal.SIGKILL)
    st = sup.wait_ready(restarts=1)
    assert gone(core), "the orphaned EngineCore survived"
    assert st["last_failure"]["kind"] == "signal"
    assert "SIGKILL" in st["last_failure"]["evidence"]
    assert st["engine_pid"] != api


def test_engine_core_sigkill_is_engine_dead_and_recovered(supervise: Callable[..., Sup]) -> None:
    sup = supervise()
    sup.wait_ready()
    core = sup.engine_tree()[1].pid
    os.kill(core, signal.SIGKILL)
    st = sup.wait_ready(restarts=1)
    assert st["last_failure"]["kind"] == "engine_dead"
    assert "engine core exited unexpectedly" in st["last_failure"]["evidence"]


def test_hung_engine_core_is_detected_within_the_timeout_and_restarted(supervise: Callable[..., Sup]) -> None:
    sup = supervise()
    sup.wait_ready()
    core = sup.engine_tree()[1].pid
    t0 = time.time()
    os.kill(core, signal.SIGSTOP)  # /health stays 200, nothing else moves
    st = sup.wait_ready(restarts=1, timeout=60)
    lf = st["last_failure"]
    assert lf["kind"] == "hang"
    # hang_timeout_s=3 plus at most one canary interval and one probe interval
    assert lf["detected_at"] - t0 < 3 + 0.5 + 0.2 + 1.5
    assert gone(core)
    bundle = json.loads(Path(lf["incident"]).read_text())
    if py_spy() is None:  # stacks are optional ([stacks] extra): without py-spy the incident says so
        assert bundle["stacks"] == {} and sup.events("engine.no_stack_dump")
    else:
        assert "engine_core_main" in bundle["stacks"][str(core)]  # py-spy read the frozen EngineCore


def test_startup_memory_failure_lowers_max_model_len_to_vllms_estimate(supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"env": {"FAKE_VLLM_KV_TOKENS": "3000"}},
                     "warmup": {"prompt_tokens": [1000, 2000]}})
    st = sup.wait_ready(restarts=1)
    assert st["profile"]["max_model_len"] == 3000
    assert st["last_failure"]["kind"] == "startup_memory"
    assert "estimated maximum model length is 3000" in st["last_failure"]["evidence"]


def test_startup_free_memory_failure_lowers_utilization_to_what_fits(supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"env": {"FAKE_VLLM_FREE_UTIL": "0.82"}}})
    st = sup.wait_ready(restarts=1)
    assert st["profile"]["gpu_memory_utilization"] == 0.81  # vLLM said 114.64/139.8 GiB free
    assert st["last_failure"]["kind"] == "startup_memory"
    assert st["last_failure"]["suggested"] == 0.81


def test_bad_flag_is_a_config_error_never_retried(supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"args": {"swap_space": 4}}})
    assert sup.wait_exit(30) == 3  # ExitCode.ENGINE_CONFIG_ERROR
    assert len(spawned_pids(sup)) == 1
    fatal = sup.events("supervisor.fatal")
    assert "unrecognized arguments: --swap-space" in fatal[0]["failure"]["evidence"]


def test_missing_engine_command_is_a_config_error(supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"command": ["/nonexistent/vllm", "serve"]}})
    assert sup.wait_exit(30) == 3


def test_sigterm_stops_everything_and_exits_zero(supervise: Callable[..., Sup]) -> None:
    sup = supervise()
    sup.wait_ready()
    pids = [p.pid for p in sup.engine_tree()]
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.wait_exit(30) == 0
    assert all(gone(p) for p in pids)
    assert sup.events("engine.state_changed")[-1]["to"] == "STOPPED"


def test_systemd_gets_ready_after_warmup_and_the_engine_gets_no_notify_socket(
        supervise: Callable[..., Sup], tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        s.settimeout(30)
        sup = supervise(env={"NOTIFY_SOCKET": str(path)})
        messages = []
        while not any("READY=1" in m for m in messages):
            messages.append(s.recv(65536).decode())
    st = sup.status()
    assert st is not None and st["state"] == "READY"
    ready = next(m for m in messages if "READY=1" in m)
    assert "STATUS=READY" in ready
    assert any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in messages)
    assert "NOTIFY_SOCKET=None" in sup.log_path.read_text()


def test_corrupt_state_file_is_reported_and_ignored(supervise: Callable[..., Sup], tmp_path: Path) -> None:
    state = tmp_path / "state0"
    state.mkdir()
    (state / "state.json").write_text("{garbage")
    sup = supervise()
    st = sup.wait_ready()
    assert st["profile"]["max_num_batched_tokens"] == 8192
    assert sup.events("state.corrupt_ignored")


def test_admin_endpoints(supervise: Callable[..., Sup]) -> None:
    metrics_port = free_port()
    sup = supervise({"admin": {"metrics_listen": f"127.0.0.1:{metrics_port}"}})
    st = sup.wait_ready()
    assert set(st) >= {"state", "ready", "profile", "restarts", "last_failure", "engine_pid"}
    assert http_json(f"http://{sup.admin}/readyz")[0] == 200
    assert http_json(f"http://{sup.admin}/healthz")[0] == 200
    with urllib.request.urlopen(f"http://{sup.admin}/metrics", timeout=5) as r:
        text = r.read().decode()
        assert r.headers["Content-Type"] == CONTENT_TYPE_LATEST  # Prometheus' own, with its version
    assert 'vllm_supervisor_engine_state{state="READY"} 1.0' in text
    assert 'vllm_supervisor_profile{knob="max_num_batched_tokens"} 8192.0' in text
    assert 'vllm_supervisor_configured_profile{knob="max_num_batched_tokens"} 8192.0' in text
    assert "vllm_supervisor_degraded 0.0" in text and "vllm_supervisor_restart_budget_left 4.0" in text
    assert "vllm_supervisor_time_to_ready_seconds_count 1.0" in text
    assert 'vllm_supervisor_build_info{python="' in text
    assert 'vllm_supervisor_engine_failures_total{kind="hang"} 0.0' in text  # every series from the start
    assert 'vllm_supervisor_state_transitions_total{from_state="BACKOFF",to_state="FATAL"} 0.0' in text
    # The metrics-only listener serves /metrics and nothing else.
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        assert "vllm_supervisor_engine_state" in r.read().decode()
    assert http_json(f"http://127.0.0.1:{metrics_port}/status")[0] == 404
    # vLLM's own series, re-exported on both listeners (its port is loopback-only and follows a spare).
    for base in (f"http://{sup.admin}", f"http://127.0.0.1:{metrics_port}"):
        with urllib.request.urlopen(f"{base}/metrics/engine", timeout=5) as r:
            assert r.status == 200 and "vllm:num_requests_running" in r.read().decode()
    sup.wait_for(lambda _: len(sup.engine_tree()) > 1, 30, "the EngineCore")
    core = sup.engine_tree()[1].pid
    os.kill(core, signal.SIGSTOP)
    sup.wait_for(lambda s: not s["ready"], 30, "not ready after the hang")
    assert http_json(f"http://{sup.admin}/readyz")[0] == 503
    try:  # the hung engine's tree is being stopped, or already replaced
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics/engine", timeout=10) as r:
            assert sup.status()["ready"]  # type: ignore[index]
    except urllib.error.HTTPError as e:
        assert e.code == 503 and e.read().decode().startswith(("no engine serving", "the engine's /metrics"))
    sup.wait_ready(restarts=1)
    with urllib.request.urlopen(f"http://{sup.admin}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'vllm_supervisor_engine_failures_total{kind="hang"} 1.0' in text
    assert "vllm_supervisor_engine_restarts_total 1.0" in text


def test_climbs_back_after_a_stable_period_and_remembers_a_rung_that_failed_twice(
        supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "5000"}},
                     "profile": {"max_num_batched_tokens": 6144},
                     "ladder": {"climb_after_s": 1.0}})
    sup.wait_ready()
    assert send_long_prompt(sup) == 500  # 6144 fails once -> 4096
    sup.wait_for(lambda s: s["ready"] and s["profile"]["max_num_batched_tokens"] == 6144 and s["restarts"] == 1,
                 30, "climb back to 6144")
    assert sup.events("engine.profile_raised")
    assert send_long_prompt(sup) == 500  # 6144 fails a second time
    st = sup.wait_ready(restarts=2)
    assert st["profile"]["max_num_batched_tokens"] == 4096
    saved = json.loads((sup.state_dir / "state.json").read_text())
    key = next(k for k in saved["rung_failures"] if "max_num_batched_tokens=6144" in k)
    assert saved["rung_failures"][key] == 2


def test_status_command_reads_a_running_supervisor(supervise: Callable[..., Sup]) -> None:
    sup = supervise()
    sup.wait_ready()
    out = subprocess.run([sys.executable, "-m", "supervisor", "status", "--config", str(sup.config), "--json"],
                         capture_output=True, text=True, check=True).stdout
    doc = json.loads(out)
    assert doc["state"] == "READY" and doc["profile"]["max_num_batched_tokens"] == 8192
    human = subprocess.run([sys.executable, "-m", "supervisor", "status", "--admin", sup.admin],
                           capture_output=True, text=True, check=True).stdout
    assert "READY" in human and "max_num_batched_tokens=8192" in human


def test_status_command_says_clearly_when_nothing_answers() -> None:
    r = subprocess.run([sys.executable, "-m", "supervisor", "status", "--admin", "127.0.0.1:9"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "no supervisor answers on 127.0.0.1:9" in r.stderr


def test_engine_left_by_a_killed_supervisor_is_stopped_by_the_next_one(supervise: Callable[..., Sup]) -> None:
    sup = supervise()
    sup.wait_ready()
    old = [p.pid for p in sup.engine_tree()]
    sup.proc.kill()  # the supervisor dies (OOM killer, a crash); its engine keeps the port and the GPU
    sup.wait_exit(10)
    assert not any(gone(p) for p in old)
    port = int(sup.engine_url.rsplit(":", 1)[1])
    again = supervise({"state": {"dir": str(sup.state_dir)}, "engine": {"port": port}})
    st = again.wait_ready()
    assert all(gone(p) for p in old)
    assert again.events("engine.leftover_stopped")[0]["pids"] == sorted(old)
    assert st["engine_pid"] not in old


HOSTILE_STOP = ["error: unrecognized arguments: --x", "EngineDeadError", "Fatal Python error: Segmentation fault",
                "estimated maximum model length is 16"]


def test_hostile_stop_strings_never_steer_a_verdict(supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "5000"}, "args": {"enable_log_requests": True}}})
    sup.wait_ready()
    # A healthy engine, request logging on, a request whose stop strings are death words: nothing happens.
    code, _ = http_json(sup.engine_url + "/v1/completions",
                        {"model": "fake-model", "prompt": "hello", "max_tokens": 4, "stop": HOSTILE_STOP})
    assert code == 200
    sup.wait_for(lambda s: "Received request" in sup.log_path.read_text() and s["ready"], 10, "the request log line")
    # The same stop strings on a request that dies of OOM: still an OOM, never a config error (exit 3).
    code, _ = http_json(sup.engine_url + "/v1/completions",
                        {"model": "fake-model", "prompt": LONG_PROMPT, "max_tokens": 4, "stop": HOSTILE_STOP})
    assert code == 500
    st = sup.wait_ready(restarts=1)
    assert st["last_failure"]["kind"] == "runtime_oom"
    assert [e["trigger"] for e in sup.events("engine.failure_detected")] in (["death"], ["exit"])
    assert sup.proc.poll() is None


def test_an_unexplained_death_repeated_with_the_same_request_steps_down(supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"env": {"FAKE_VLLM_SEGV_TOKENS": "5000"}}, "restart": {"max_restarts": 10}})
    sup.wait_ready()
    codes = send_until_served(sup, tries=6)
    assert codes == [500, 500, 500, 500, 200]  # twice at 8192, twice at 6144, served at 4096
    kinds = [e["kind"] for e in sup.events("engine.failed")]
    assert kinds == ["engine_dead", "runtime_oom", "engine_dead", "runtime_oom"]
    second = sup.events("engine.failed")[1]
    assert "treated as a memory failure" in second["evidence"] and "30000 prompt tokens" in second["evidence"]


def test_the_api_key_authenticates_our_own_requests_and_never_leaks(supervise: Callable[..., Sup],
                                                                    tmp_path: Path) -> None:
    key = "sk-very-secret-4242"
    sup = supervise({"engine": {"args": {"api_key": key}, "env": {"FAKE_VLLM_OOM_TOKENS": "5000"}}})
    sup.wait_ready()  # warm-up authenticated (it got 401 before)
    assert http_json(sup.engine_url + "/v1/models")[0] == 401  # vLLM still guards its port
    assert send_long_prompt(sup, {"Authorization": f"Bearer {key}"}) == 500
    st = sup.wait_ready(restarts=1)
    spawned = sup.events("engine.spawned")[0]
    assert "***" in spawned["argv"] and key not in spawned["argv"]
    assert key not in json.dumps(st)
    assert key not in sup.log_path.read_text()  # our events and the echoed engine output
    incident = Path(st["last_failure"]["incident"])
    assert key not in incident.read_text() and (incident.stat().st_mode & 0o777) == 0o600
    assert ((sup.state_dir / "engine.json").stat().st_mode & 0o777) == 0o600
    check = subprocess.run([sys.executable, "-m", "supervisor", "check", "--config", str(sup.config)],
                           capture_output=True, text=True)
    assert key not in check.stdout + check.stderr and "--api-key '***'" in check.stdout


def test_an_engine_port_held_by_another_process_ends_in_a_fatal_that_names_the_port(
        supervise: Callable[..., Sup]) -> None:
    """Before, five quick restarts ended in a FATAL that said only "API server exited with status 1"."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        sup = supervise({"engine": {"port": other.getsockname()[1]},
                         "restart": {"max_consecutive_failures": 2}})
        assert sup.wait_exit(60) == 4
    failed = sup.events("engine.failed")
    assert [e["kind"] for e in failed] == ["engine_dead", "engine_dead"]
    (fatal,) = sup.events("supervisor.fatal")
    assert "address already in use" in fatal["failure"]["evidence"].lower(), fatal
    assert "[engine] port" in fatal["failure"]["evidence"] and fatal["failure"]["rung_at_fault"] is False, fatal
    assert all(gone(p) for p in spawned_pids(sup))


def test_an_admin_or_gateway_port_held_by_another_process_names_its_key_and_what_to_do(
        supervise: Callable[..., Sup]) -> None:
    """Found trying a second supervisor on one host as a new user would: it said only "[Errno 98] Address already
    in use", then aiohttp's "Unclosed client session". Now the key, the address and what to do; no engine."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = f"127.0.0.1:{other.getsockname()[1]}"
        for key, over in (("[admin] listen", {"admin": {"listen": taken}}),
                          ("[gateway] listen", {"gateway": {"listen": taken}})):
            sup = supervise(over)
            assert sup.wait_exit(30) == 1, key
            said = sup.log_path.read_text()
            assert f"vllm-supervisor: {key} {taken}: Address already in use (`ss -ltnp" in said, said[-600:]
            assert "Unclosed client session" not in said and sup.events("engine.spawned") == []


def test_a_start_that_never_gets_healthy_is_a_hang_and_the_loop_ends(supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"env": {"FAKE_VLLM_START_DELAY": "60"}, "start_timeout_s": 1.0},
                     "restart": {"max_restarts": 100, "max_consecutive_failures": 2}})
    assert sup.wait_exit(60) == 4
    failed = sup.events("engine.failed")
    assert [e["kind"] for e in failed] == ["hang", "hang"]
    assert "start_timeout_s=1s" in failed[0]["evidence"]
    assert "2 failures in a row" in sup.events("supervisor.fatal")[0]["reason"]
    assert all(gone(p) for p in spawned_pids(sup))


def test_healthz_never_flaps_under_the_shipped_watchdog(supervise: Callable[..., Sup], tmp_path: Path) -> None:
    with notify_listener(tmp_path / "notify.sock") as messages:
        sup = supervise(env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "30000000"})
        sup.wait_ready()
        codes = []
        t_end = time.monotonic() + 16  # more than one 15 s watchdog period (WatchdogSec=30)
        while time.monotonic() < t_end:
            codes.append(http_json(f"http://{sup.admin}/healthz")[0])
            time.sleep(0.2)
    assert set(codes) == {200}, codes
    assert sum("WATCHDOG=1" in m for m in messages) >= 10  # petted from the loop's own ticks, not every 15 s


def test_alerts_reach_their_hooks_and_a_hanging_hook_does_not_delay_the_restart(
        supervise: Callable[..., Sup], receiver: Callable[..., Receiver]) -> None:
    hang, good = receiver(hang=True), receiver()
    sup = supervise({"alerts": {"host": "gpu-7", "hooks": [
        {"type": "webhook", "url": hang.url, "timeout_s": 30.0, "min_severity": "info"},
        {"type": "webhook", "url": good.url, "min_severity": "info"}]}})
    sup.wait_ready()
    os.kill(sup.engine_tree()[1].pid, signal.SIGKILL)  # the EngineCore
    st = sup.wait_ready(restarts=1)
    assert st["last_failure"]["recovered_after_s"] < 10  # the hook hanging for 30 s held nothing up
    sup.wait_for(lambda s: len(good.requests) >= 2, 10, "two alerts at the good hook")
    events = [r.json() for r in good.requests]
    assert [e["event"] for e in events] == ["engine_restarted", "recovered"]
    assert events[0]["kind"] == "engine_dead" and events[0]["host"] == "gpu-7" and events[0]["severity"] == "warning"


def test_a_fatal_is_paged_before_the_supervisor_exits(supervise: Callable[..., Sup],
                                                      receiver: Callable[..., Receiver]) -> None:
    sms, pd = receiver(status=201), receiver(status=202)
    sup = supervise({"engine": {"env": {"FAKE_VLLM_DIE_AFTER_READY": "0.3"}}, "restart": {"max_restarts": 1},
                     "alerts": {"hooks": [
                         {"type": "twilio", "url": sms.url, "account_sid": "AC9", "auth_token_env": "TW_TOKEN",
                          "from": "+15550001", "to": ["+15550002"]},
                         {"type": "pagerduty", "url": pd.url, "routing_key_env": "PD_KEY"}]}},
                    env={"TW_TOKEN": "tok-123", "PD_KEY": "rk-456"})
    assert sup.wait_exit(60) == 4
    (text,) = sms.requests  # SMS: critical only
    assert "[critical]" in urllib.parse.parse_qs(text.body.decode())["Body"][0]
    pages = [r.json() for r in pd.requests]
    assert pages[-1]["event_action"] == "trigger" and pages[-1]["payload"]["severity"] == "critical"
    assert "tok-123" not in sup.log_path.read_text() and "rk-456" not in sup.log_path.read_text()


def test_a_hook_whose_secret_is_missing_is_a_config_error(supervise: Callable[..., Sup]) -> None:
    sup = supervise({"alerts": {"hooks": [{"type": "pagerduty", "routing_key_env": "NO_SUCH_KEY_VAR"}]}})
    assert sup.wait_exit(30) == 2
    assert "routing_key_env: $NO_SUCH_KEY_VAR is not set" in sup.log_tail()


def test_on_call_view_status_and_incidents_live_and_after_the_supervisor_is_gone(
        supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "5000"}}})
    sup.wait_ready()
    assert send_long_prompt(sup) == 500
    sup.wait_ready(restarts=1)
    live = cli("status", "--config", str(sup.config))
    assert live.returncode == 0
    assert "max_num_batched_tokens=6144 (configured 8192)" in live.stdout and "[degraded" in live.stdout
    assert "last failure  runtime_oom: CUDA out of memory" in live.stdout
    listed = cli("incidents", "--config", str(sup.config))
    (line,) = listed.stdout.splitlines()
    stem = line.split()[0]
    assert "runtime_oom" in line and stem in live.stdout
    shown = cli("incidents", stem, "--config", str(sup.config)).stdout
    assert "failure   runtime_oom: CUDA out of memory" in shown
    assert "prompt tokens 30000" in shown and "versions  vllm_supervisor" in shown
    assert "profile   before {'max_num_batched_tokens': 8192" in shown
    assert json.loads(cli("incidents", "latest", "--config", str(sup.config), "--json").stdout)["failure"]["kind"] \
        == "runtime_oom"
    assert cli("incidents", "nope", "--config", str(sup.config)).returncode == 1
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.wait_exit(30) == 0
    offline = cli("status", "--config", str(sup.config))
    assert offline.returncode == 1 and "no supervisor answers" in offline.stderr
    assert f"from {sup.state_dir}:" in offline.stdout and "max_num_batched_tokens=6144" in offline.stdout
    assert f"newest incident {stem}" in offline.stdout
    assert cli("--version").stdout.startswith("vllm-supervisor ")


def test_reload_keeps_a_bad_config_out_and_restarts_the_engine_only_for_engine_settings(
        supervise: Callable[..., Sup]) -> None:
    sup = supervise()
    st = sup.wait_ready()
    good = sup.config.read_text()
    pid = st["engine_pid"]
    assert (control_path := sup.state_dir / "control.sock").exists() and (control_path.stat().st_mode & 0o777) == 0o600
    # An invalid file: refused, the old config stays, the engine is untouched.
    sup.config.write_text(good.replace("max_restarts = 5", 'max_restarts = "five"'))
    sup.proc.send_signal(signal.SIGHUP)
    sup.wait_for(lambda s: bool(sup.events("supervisor.reload_failed")), 10, "the reload refused")
    assert "restart.max_restarts" in sup.events("supervisor.reload_failed")[0]["error"]
    refused = cli("reload", "--config", str(sup.config))
    assert refused.returncode == 1 and "restart.max_restarts: must be an integer" in refused.stderr
    assert sup.status()["engine_pid"] == pid  # type: ignore[index]
    # Only [health] changed: applied without touching the engine.
    sup.config.write_text(good.replace("probe_interval_s = 0.2", "probe_interval_s = 0.3"))
    ok = cli("reload", "--config", str(sup.config))
    assert ok.returncode == 0 and "health changed" in ok.stdout and "the engine keeps running" in ok.stdout
    assert sup.status()["engine_pid"] == pid  # type: ignore[index]
    # An engine setting changed: a planned restart, not a failure.
    sup.config.write_text(good.replace('env = {  }', 'env = { FAKE_VLLM_TOKEN_DELAY = "0.002" }'))
    assert cli("reload", "--config", str(sup.config)).returncode == 0
    st = sup.wait_for(lambda s: s["ready"] and s["engine_pid"] not in (None, pid), 30, "the new engine READY")
    assert st["restarts"] == 0 and st["last_failure"] is None
    assert sup.events("supervisor.reloaded")[-1]["engine_restart"] is True
    assert [h["to"] for h in st["history"]][-5:] == ["DRAINING", "STOPPING", "STARTING", "WARMING", "READY"]
    # restart: the same, asked directly.
    assert cli("restart", "--config", str(sup.config)).returncode == 0
    st2 = sup.wait_for(lambda s: s["ready"] and s["engine_pid"] not in (None, st["engine_pid"]), 30, "restarted")
    assert st2["restarts"] == 0


def test_reset_profile_goes_back_to_the_configured_profile_and_forgets_failed_rungs(
        supervise: Callable[..., Sup]) -> None:
    sup = supervise({"engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "5000"}}})
    sup.wait_ready()
    assert send_long_prompt(sup) == 500
    assert sup.wait_ready(restarts=1)["profile"]["max_num_batched_tokens"] == 6144
    done = cli("reset-profile", "--config", str(sup.config))
    assert done.returncode == 0, done.stderr
    st = sup.wait_for(lambda s: s["ready"] and s["profile"]["max_num_batched_tokens"] == 8192, 30, "back to 8192")
    assert st["restarts"] == 1
    assert json.loads((sup.state_dir / "state.json").read_text())["rung_failures"] == {}


def test_notify_sequence_on_a_real_socket_across_start_crash_recovery_reload_and_stop(
        supervise: Callable[..., Sup], tmp_path: Path) -> None:
    with notify_listener(tmp_path / "notify.sock") as messages:
        sup = supervise(env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
        sup.wait_ready()
        os.kill(sup.engine_tree()[1].pid, signal.SIGKILL)
        sup.wait_ready(restarts=1)
        sup.proc.send_signal(signal.SIGHUP)  # the same file: reloaded, nothing to restart
        sup.wait_for(lambda st: bool(sup.events("supervisor.reloaded")), 10, "reloaded")
        sup.proc.send_signal(signal.SIGTERM)
        assert sup.wait_exit(30) == 0
    kinds = []
    for m in messages:
        head = m.split("\n")[0]
        kinds.append(head.split("=")[0] + ("=" + head.split("=")[1].split()[0] if head.startswith("STATUS") else ""))
    ready = [i for i, k in enumerate(kinds) if k == "READY"]
    assert kinds[0] == "EXTEND_TIMEOUT_USEC"
    assert "STATUS=BACKOFF" in kinds and kinds.index("STATUS=BACKOFF") > ready[0]
    reloading = kinds.index("RELOADING")
    assert len(ready) == 2 and ready[1] > reloading  # READY=1 at the first warm-up, and after the reload
    assert "MONOTONIC_USEC=" in messages[reloading]
    assert kinds[-1] == "STATUS=STOPPED" and "STOPPING" in kinds[reloading:]


def test_status_after_a_fatal_says_who_gave_up_when_and_why_until_a_later_supervisor_is_ready(
        supervise: Callable[..., Sup]) -> None:
    """Issue 18, item 8: after FATAL, `status` said nothing of it (the supervisor exits 0.1 s later)."""
    sup = supervise({"engine": {"env": {"FAKE_VLLM_DIE_AFTER_READY": "0.3"}}, "restart": {"max_restarts": 1}})
    assert sup.wait_exit(60) == 4
    saved = json.loads((sup.state_dir / "state.json").read_text())
    assert saved["fatal"]["exit_code"] == 4 and "restart budget" in saved["fatal"]["reason"]
    out = cli("status", "--config", str(sup.config))
    assert out.returncode == 1 and "GAVE UP" in out.stdout and "exit code 4" in out.stdout, out.stdout
    assert "restart budget" in out.stdout
    again = supervise({"state": {"dir": str(sup.state_dir)}})
    st = again.wait_ready()
    assert st["fatal"] is None  # cleared at READY: it is history now
    assert json.loads((sup.state_dir / "state.json").read_text())["fatal"] is None


def test_a_page_open_when_the_supervisor_is_sigkilled_is_resolved_by_the_next_one(
        supervise: Callable[..., Sup], receiver: Callable[..., Receiver], tmp_path: Path) -> None:
    """Issue 18, item 1: open pages lived in memory only, so a page outlived the supervisor that opened it."""
    pd = receiver(status=202)
    overrides = {"engine": {"env": {"FAKE_VLLM_START_DELAY": "30"}},
                 "alerts": {"page_after_s": 0.5, "hooks": [{"type": "pagerduty", "url": pd.url,
                                                            "routing_key_env": "PD_KEY_T"}]}}
    sup = supervise(overrides, env={"PD_KEY_T": "rk-1"})
    sup.wait_for(lambda _: len(pd.requests) >= 1, 30, "the outage page during the first cold start")
    trigger = pd.requests[0].json()
    assert trigger["event_action"] == "trigger" and trigger["payload"]["class"] == "outage"
    sup.wait_for(lambda _: (sup.state_dir / "pages.json").exists(), 10, "the page kept in the state dir")
    sup.proc.kill()
    sup.proc.wait()
    again = supervise({**overrides, "engine": {"env": {}}, "state": {"dir": str(sup.state_dir)}},
                      env={"PD_KEY_T": "rk-1"})
    again.wait_ready()
    again.wait_for(lambda _: any(r.json()["event_action"] == "resolve" for r in pd.requests), 30, "the resolve")
    resolve = next(r.json() for r in pd.requests if r.json()["event_action"] == "resolve")
    assert resolve["dedup_key"] == trigger["dedup_key"]
    assert json.loads((sup.state_dir / "pages.json").read_text())["open"] == {}


def test_two_instances_one_per_gpu_never_touch_each_other_and_status_all_shows_both(
        supervise: Callable[..., Sup], receiver: Callable[..., Receiver], tmp_path: Path) -> None:
    """Issue 19, part 2: vllm-supervisor@gpu0 and @gpu1 side by side; one engine dies, the other serves on."""
    hooks = [receiver(), receiver()]
    sups = [supervise({"engine": {"env": {"CUDA_VISIBLE_DEVICES": str(i)}}, "gateway": {},
                       "alerts": {"hooks": [{"type": "webhook", "url": hooks[i].url, "min_severity": "info"}]}})
            for i in range(2)]
    for s in sups:
        s.wait_ready()
    gpu0, gpu1 = sups
    assert gpu1.gateway is not None
    tree1 = {p.pid for p in gpu1.engine_tree()}
    state1 = sorted(p.name for p in gpu1.state_dir.iterdir())
    core = [p for p in gpu0.engine_tree() if "--engine-core-fd" in " ".join(p.cmdline())]
    core[0].kill()
    gpu0.wait_for(lambda st: st["state"] != "READY" or st["restarts"] >= 1, 30, "gpu0's restart")
    codes = [http_json(gpu1.gateway + "/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 2})[0]
             for _ in range(5)]
    assert codes == [200] * 5  # the other instance serves on
    gpu0.wait_ready(restarts=1)
    assert {p.pid for p in gpu1.engine_tree()} == tree1 and gpu1.status()["restarts"] == 0  # nothing of it touched
    assert sorted(p.name for p in gpu1.state_dir.iterdir()) == state1  # no incident, no file of gpu0's
    gpu0.wait_for(lambda _: any(r.json()["event"] == "engine_restarted" for r in hooks[0].requests), 10, "gpu0's alert")
    assert not any(r.json()["event"] == "engine_restarted" for r in hooks[1].requests)
    # `status --all` over the host's instance configs (as vllm-supervisor@NAME.service reads NAME.toml).
    etc = tmp_path / "etc"
    etc.mkdir()
    for name, s in (("gpu0", gpu0), ("gpu1", gpu1)):
        (etc / f"{name}.toml").write_text(s.config.read_text())
    out = cli("status", "--all", "--config-dir", str(etc))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].startswith("gpu0") and "READY" in lines[1] and lines[1].split()[3] == "1"
    assert lines[2].startswith("gpu1") and "READY" in lines[2] and " 1 " in lines[2]  # its device


def test_a_lost_ray_worker_node_is_a_failure_of_the_whole_engine_group(supervise: Callable[..., Sup],
                                                                       tmp_path: Path) -> None:
    """Issue 19: a multi-node engine over Ray loses a worker node; vLLM's RayWorkerMonitor says so (the
    wording of v1/executor/ray_executor_v2.py) and the supervisor restarts the whole group."""
    lost = tmp_path / "lose-a-node"
    sup = supervise({"engine": {"env": {"FAKE_VLLM_RAY_LOST_FILE": str(lost)}}})
    sup.wait_ready()
    old = {p.pid for p in sup.engine_tree()}
    lost.write_text("")
    st = sup.wait_ready(restarts=1)
    lf = st["last_failure"]
    assert lf["kind"] == "engine_dead" and "RayWorkerProc rank=[1] died unexpectedly" in lf["evidence"], lf
    assert all(gone(p) for p in old)


def test_a_tensor_parallel_stand_in_rank_that_dies_or_hangs_is_one_failure_of_the_whole_engine(
        supervise: Callable[..., Sup]) -> None:
    """Issue 19: the stand-in learns N ranks; a rank SIGKILLed is vLLM's 'Worker proc ... died unexpectedly',
    a rank SIGSTOPped holds every step: a hang."""
    sup = supervise({"engine": {"args": {"tensor_parallel_size": 2}}})
    sup.wait_ready()

    def ranks() -> list[psutil.Process]:
        return [p for p in sup.engine_tree() if "--worker-rank" in " ".join(p.cmdline())]

    assert len(ranks()) == 2
    spawned = sup.events("engine.spawned")[-1]["argv"]
    assert spawned[spawned.index("--distributed-timeout-seconds") + 1] == "3"  # [health] hang_timeout_s
    old = {p.pid for p in sup.engine_tree()}
    ranks()[1].kill()
    st = sup.wait_ready(restarts=1)
    assert "Worker proc VllmWorker-1 died unexpectedly" in st["last_failure"]["evidence"]
    assert all(gone(p) for p in old) and len(ranks()) == 2
    old = {p.pid for p in sup.engine_tree()}
    ranks()[0].suspend()
    import threading
    threading.Thread(target=lambda: send_long_prompt(sup), daemon=True).start()
    st = sup.wait_ready(30, restarts=2)
    assert st["last_failure"]["kind"] == "hang", st["last_failure"]
    assert all(gone(p) for p in old)


def test_the_lowered_profile_page_resolves_once_the_climb_is_back_at_the_configured_profile(
        supervise: Callable[..., Sup], receiver: Callable[..., Receiver]) -> None:
    """Issue 28, item 2: the lowering set enable_chunked_prefill, so the climbed profile never equalled [profile]."""
    pd = receiver(status=202)  # as PagerDuty's Events API v2 answers
    sup = supervise({"engine": {"env": {"FAKE_VLLM_OOM_TOKENS": "5000"}},
                     "profile": {"max_num_batched_tokens": 6144}, "ladder": {"climb_after_s": 1.0},
                     "alerts": {"hooks": [{"type": "pagerduty", "url": pd.url, "routing_key_env": "PD_KEY",
                                           "min_severity": "warning"}]}},
                    env={"PD_KEY": "rk-1"})
    sup.wait_ready()
    assert send_long_prompt(sup) == 500  # 6144 -> 4096: a profile_lowered page
    sup.wait_for(lambda s: s["ready"] and s["profile"]["max_num_batched_tokens"] == 6144, 30, "climb back to 6144")

    def pages() -> list[dict[str, Any]]:
        return [r.json() for r in pd.requests]

    def lowered_resolved(_: Any) -> bool:
        keys = {p["dedup_key"] for p in pages() if p["event_action"] == "trigger"
                and p["payload"]["class"] == "profile_lowered"}
        return bool(keys) and keys <= {p["dedup_key"] for p in pages() if p["event_action"] == "resolve"}

    sup.wait_for(lowered_resolved, 10, "the profile_lowered page resolved")
    opened = {p["dedup_key"] for p in pages() if p["event_action"] == "trigger"}
    assert opened <= {p["dedup_key"] for p in pages() if p["event_action"] == "resolve"}, pages()
    assert json.loads((sup.state_dir / "pages.json").read_text())["open"] in ({}, {"pagerduty": {}})


def test_systemctl_reload_runs_a_synchronous_reload_that_fails_visibly_and_always_completes_the_notify(
        supervise: Callable[..., Sup], receiver: Callable[..., Receiver], tmp_path: Path) -> None:
    """Issue 28, item 1: `kill -HUP` succeeded whatever the file said; `listen = "host:abc"` was a traceback."""
    unit = (Path(__file__).resolve().parents[2] / "systemd" / "vllm-supervisor.service").read_text()
    assert "ExecReload=/opt/vllm-supervisor/bin/vllm-supervisor reload --config " in unit
    hook = receiver()
    with notify_listener(tmp_path / "notify.sock") as messages:
        sup = supervise({"alerts": {"hooks": [{"type": "webhook", "url": hook.url}]}},
                        env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
        st = sup.wait_ready()
        good = sup.config.read_text()
        sup.config.write_text(good + '\n[gateway]\nlisten = "host:abc"\n')
        refused = cli("reload", "--config", str(sup.config))
        assert refused.returncode == 1 and 'gateway.listen: must be HOST:PORT' in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr + sup.log_path.read_text()
        sup.wait_for(lambda _: "config_reload_failed" in [r.json()["event"] for r in hook.requests], 10, "the page")
        # An engine setting: the reload completes at once; the restart it asks for goes on after READY=1.
        sup.config.write_text(good.replace('env = {  }', 'env = { FAKE_VLLM_TOKEN_DELAY = "0.002" }'))
        done = cli("reload", "--config", str(sup.config))
        assert done.returncode == 0, done.stderr
        sup.wait_for(lambda s: s["ready"] and s["engine_pid"] != st["engine_pid"], 30, "the new engine READY")
        assert sup.status()["engine_pid"] != st["engine_pid"]  # type: ignore[index]
    heads = [m.split("\n") for m in messages]
    reloads = [i for i, m in enumerate(heads) if m[0] == "RELOADING=1"]
    assert len(reloads) == 2
    for i in reloads:  # each RELOADING=1 is followed by READY=1 before anything else is said
        assert heads[i + 1][0] == "READY=1", heads[i:i + 2]
    assert heads[reloads[0] + 1][1] == "STATUS=reload failed: kept the old config"
    assert heads[reloads[1] + 1][1] == "STATUS=reload applied; engine restarting"
    assert any(m[0].startswith("STATUS=READY") for m in heads[reloads[1] + 2:])  # the restart, after it
