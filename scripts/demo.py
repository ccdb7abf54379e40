"""The README's first command: vllm-supervisor over real vLLM (CPU) surviving a real out-of-memory death.

Clients talk to the supervisor's gateway; the prompt that kills the engine is held while the engine
restarts and answered by the stepped-down engine.

Starts the supervisor over vLLM and the tiny local model, sends traffic, lowers the vLLM worker's
address-space limit and sends a prompt with prompt_logprobs (the same death path as a CUDA OOM:
fatal error, EngineDeadError, exit status 0), and shows the recovery with a lowered profile.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

T0 = time.monotonic()


def say(who: str, text: str) -> None:
    print(f"[{time.monotonic() - T0:7.2f}s] {who:<10} {text}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def describe(ev: dict[str, Any]) -> str | None:
    """One readable timeline line for the supervisor's JSON events worth showing."""
    name = ev.get("event")
    text = _describe(ev, name)
    return None if text is None else str(text)


def _describe(ev: dict[str, Any], name: Any) -> Any:
    if name == "engine.state_changed":
        extra = ev.get("reason") or ev.get("evidence") or ""
        if ev["to"] == "READY":
            extra = (f"start {ev.get('start_to_healthy_s')}s + warm-up {ev.get('warmup_s')}s, "
                     f"prompts {ev.get('warmup_prompts')}")
        return f"{ev['from']} -> {ev['to']}" + (f"  ({extra})" if extra else "")
    if name == "engine.spawned":
        return f"spawned vLLM API server pid {ev['pid']}"
    if name == "engine.failure_detected":
        return f"detected ({ev['trigger']}): {ev['evidence']}"
    if name == "engine.failed":
        return f"FAILURE {ev['kind']}: {ev['evidence']}  (trigger {ev['trigger']}, exit {ev['returncode']})"
    if name == "engine.profile_lowered":
        return "profile lowered: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in ev["diff"].items())
    if name == "engine.stopped":
        return f"engine tree stopped: pids {ev['pids']}, survivors {ev['survivors']}"
    if name == "gateway.request_replayed":
        return f"gateway: request {ev['request_id']} sent again to the new engine" + (" (alone)" if ev["alone"] else "")
    if name == "engine.recovered":
        return f"recovered {ev['recovered_after_s']}s after detection, profile {ev['profile']}"
    if name in ("supervisor.started", "supervisor.fatal", "supervisor.stop_requested"):
        return name.split(".")[1].replace("_", " ") + (f": {ev.get('reason')}" if ev.get("reason") else "")
    return None


def follow(proc: subprocess.Popen[str], log: Path) -> None:
    assert proc.stdout is not None
    with open(log, "w") as f:
        for line in proc.stdout:
            f.write(line)
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            text = describe(ev)
            if text:
                say("supervisor", text)


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, None


def wait_ready(admin: str, restarts: int, timeout: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            code, st = http(f"http://{admin}/status", timeout=5)
            if code == 200 and st["ready"] and st["restarts"] >= restarts:
                return dict(st)
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise SystemExit("demo: the supervisor did not become READY in time")


def show_status(title: str, st: dict[str, Any]) -> None:
    print(f"\n----- status {title} -----")
    print(f"state {st['state']}  engine pid {st['engine_pid']}  restarts {st['restarts']}")
    print("profile " + "  ".join(f"{k}={v}" for k, v in st["profile"].items()))
    lf = st["last_failure"]
    print("last failure " + (f"{lf['kind']}: {lf['evidence']}" if lf else "none"))
    gw = st.get("gateway") or {}
    print("gateway " + "  ".join(f"{k}={gw.get(k)}" for k in ("forwarded", "held", "replayed", "413", "429", "503")))
    print("-" * 40 + "\n", flush=True)


def traffic(base: str, n: int) -> None:
    for i in range(n):
        t = time.monotonic()
        code, _ = http(base + "/v1/completions", {"model": "tiny-llama", "prompt": "hello world " * (50 * (i + 1)),
                                                  "max_tokens": 16})
        say("client", f"completion of ~{100 * (i + 1)} tokens -> HTTP {code} in {time.monotonic() - t:.2f}s")
    code, _ = http(base + "/v1/chat/completions", {"model": "tiny-llama", "max_tokens": 16,
                                                   "messages": [{"role": "user", "content": "hello"}]})
    say("client", f"chat completion -> HTTP {code}")


def inject_oom(engine_pid: int, base: str) -> int:
    worker = next(p for p in psutil.Process(engine_pid).children(recursive=True) if "Worker" in p.name())
    limit = worker.memory_info().vms + 4 * 2**20
    subprocess.run(["prlimit", "--pid", str(worker.pid), f"--as={limit}"], check=True)
    say("demo", f"lowered the address-space limit of vLLM worker pid {worker.pid} to its current size + 4 MiB")
    say("client", "sending a 3000-token prompt with prompt_logprobs (needs prompt x vocab x 4 bytes at once)")
    t = time.monotonic()
    code, _ = http(f"{base}/v1/completions", {"model": "tiny-llama", "prompt": "word " * 3000, "max_tokens": 2,
                                              "prompt_logprobs": 1}, timeout=600)
    say("client", f"-> HTTP {code} after {time.monotonic() - t:.1f}s (the engine died under it; the gateway held it "
                  "and sent it again to the restarted engine)")
    return code


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--model", default=".cache/tiny-llama")
    a = ap.parse_args()
    work = Path(".cache/demo")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    port, admin, gateway = free_port(), f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cfg = Path("examples/cpu-tiny.toml").read_text()
    cfg = (cfg.replace('".venv-vllm/bin/python"', json.dumps(str(Path(a.vllm_python).absolute())))
              .replace('".cache/tiny-llama"', json.dumps(str(Path(a.model).resolve())))
              .replace("port = 18000", f"port = {port}")
              .replace('".cache/state"', json.dumps(str((work / "state").resolve())))
              .replace('"127.0.0.1:8001"', json.dumps(admin))
              .replace('"127.0.0.1:8000"', json.dumps(gateway)))
    (work / "config.toml").write_text(cfg + '\n[log]\nformat = "json"\n')
    say("demo", f"starting vllm-supervisor over real vLLM (CPU) with {a.model}; engine log: {work}/supervisor.log")
    sup = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "--quiet-engine", "--config",
                            str(work / "config.toml")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = threading.Thread(target=follow, args=(sup, work / "supervisor.log"), daemon=True)
    reader.start()
    try:
        before = wait_ready(admin, 0)
        show_status("before", before)
        say("demo", f"clients talk to the gateway on {gateway}")
        traffic(f"http://{gateway}", 3)
        killer = inject_oom(before["engine_pid"], f"http://{gateway}")
        after = wait_ready(admin, 1)
        show_status("after", after)
        changed = {k: f"{before['profile'][k]} -> {v}" for k, v in after["profile"].items()
                   if before["profile"][k] != v}
        say("demo", f"profile changed by the supervisor: {changed}")
        traffic(f"http://{gateway}", 3)
    finally:
        sup.send_signal(signal.SIGTERM)
        rc = sup.wait(120)
        reader.join(5)
        say("demo", f"supervisor stopped with exit status {rc}")
    ok = after["last_failure"]["kind"] == "runtime_oom" and bool(changed) and killer == 200
    print("\nDEMO OK: a real out-of-memory death was classified, the profile lowered, the engine served again, and "
          "the client that sent the fatal prompt got its answer." if ok else "\nDEMO FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
