"""What the H200 drivers (gpu_oom.py, gpu_gateway.py) share: the timeline, HTTP, /status polling, the other
process that takes the card, and the supervisor's config for the 0.9B model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("OUT", "/tmp/out"))
MODEL = os.path.expanduser(os.environ.get("MODEL", "~/tinyllama"))
DEADLINE = time.monotonic() + float(os.environ.get("BUDGET_S", "540"))
T0 = time.monotonic()
ADMIN, PORT = "127.0.0.1:8001", 18000
notes: list[str] = []
HOG = ("import os, torch, time\n"
       "free, total = torch.cuda.mem_get_info()\n"
       "frac = float(os.environ.get('HOG_FRACTION', '0'))\n"  # a share of the card, else all but HOG_LEAVE_MIB
       "n = int(total * frac) if frac else free - int(os.environ.get('HOG_LEAVE_MIB', '16')) * 2**20\n"
       "x = torch.empty(n, dtype=torch.uint8, device='cuda')\n"
       "print('hog holds', x.numel() >> 20, 'MiB of', total >> 20, flush=True)\n"
       "time.sleep(3600)\n")


def note(msg: str) -> None:
    line = f"[{time.monotonic() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    notes.append(line)


def http(url: str, body: Any = None, timeout: float = 400) -> tuple[int, Any, dict[str, str]]:
    """(status, JSON body or text, headers); status 0 when nothing answered."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            doc = json.loads(raw) if raw.startswith(b"{") else raw.decode(errors="replace")
            return r.status, doc, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw), dict(e.headers)
        except ValueError:
            return e.code, raw[:300].decode(errors="replace"), dict(e.headers)
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e), {}


def plain_vllm(cache: Path, model: str, util: float, max_len: int,
               extra: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    """vLLM alone with the supervisor's engine arguments at the seed's shape (chunk 8192, 10 sequences), its
    compile caches under ``cache``: the argv and environment of every plain-vLLM reference start."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CACHE_ROOT": f"{cache}/vllm", "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor",
           "TRITON_CACHE_DIR": f"{cache}/triton", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(PORT),
            "--served-model-name", "m", "--trust-remote-code", "--max-num-batched-tokens", "8192",
            "--max-num-seqs", "10", "--gpu-memory-utilization", str(util), "--max-model-len", str(max_len), *extra]
    return argv, env


def stop_group(proc: subprocess.Popen[bytes], wait_s: float = 60) -> None:
    """SIGTERM to the process group ``proc`` leads, SIGKILL after ``wait_s``; waits for it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def status() -> dict[str, Any] | None:
    code, st, _ = http(f"http://{ADMIN}/status", timeout=5)
    return st if code == 200 else None


def spare_asleep(st: dict[str, Any]) -> bool:
    """A /status predicate: a spare sleeps. Stop, with the supervisor's reason, where /status says none will be built
    beside this engine (the defaults build none first): waiting would only spend the call (run 12 lost 577 s so)."""
    spare = st["next_start"]["spare"] or {}
    if spare.get("state") == "asleep":
        return True
    why = str(spare.get("why") or "")
    if "none fits beside the engine" in why:
        raise Stop(f"no spare will sleep beside this engine: {why[:400]}")
    return False


def wait(pred: Any, what: str, check: Any = None) -> dict[str, Any] | None:
    """Poll /status until ``pred`` holds; ``check()`` each round may end the run (a supervisor that exited)."""
    while time.monotonic() < DEADLINE:
        if check is not None:
            check()
        st = status()
        if st and pred(st):
            return st
        time.sleep(0.5)
    note(f"gave up waiting for {what}; last status: {json.dumps(status())[:600]}")
    return None


def start_hog() -> subprocess.Popen[str]:
    """Another process that takes all but 16 MiB (HOG_LEAVE_MIB) of what is free on the card (the seed's "other
    process")."""
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True)
    assert hog.stdout is not None
    note(hog.stdout.readline().strip())
    return hog


def supervisor_toml(state: Path, climb_after_s: float, extra: str = "") -> str:
    """vLLM at chunk 8192 and utilization 0.5, with the probes and bounds both drivers use; ``extra`` TOML after."""
    return f"""
[engine]
model = "{MODEL}"
port = {PORT}
env = {{ HF_HUB_OFFLINE = "1", VLLM_USE_FLASHINFER_SAMPLER = "0", VLLM_NO_USAGE_STATS = "1" }}
start_timeout_s = 400.0
[engine.args]
served_model_name = "tiny"
[profile]
max_num_batched_tokens = 8192
max_num_seqs = 16
gpu_memory_utilization = 0.5
max_model_len = 32768
[ladder]
climb_after_s = {climb_after_s}
[restart]
backoff_initial_s = 1.0
[health]
hang_timeout_s = 60.0
probe_interval_s = 1.0
canary_interval_s = 10.0
[gpu]
release_timeout_s = 30.0
free_wait_s = 10.0
[state]
dir = "{state}"
[admin]
listen = "{ADMIN}"
[log]
format = "json"
""" + extra


ROOT = Path(__file__).resolve().parents[1]  # `-m supervisor` resolves from the checkout, whatever the cwd


def run_supervisor(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    """The supervisor, its output to ``log`` as it writes it, and each line again in ``log`` + ``.timed`` with the
    bench's seconds at its arrival: vLLM's own lines carry whole seconds only, and a start's phases are tenths."""
    sup = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "--config", str(cfg)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    threading.Thread(target=copy_lines, args=(sup, log), daemon=True).start()
    return sup


def copy_lines(sup: subprocess.Popen[bytes], log: Path) -> None:
    assert sup.stdout is not None
    with open(log, "ab") as out, open(f"{log}.timed", "ab") as timed:
        for line in sup.stdout:
            out.write(line)
            out.flush()
            timed.write(f"{time.monotonic() - T0:9.3f} ".encode() + line)
            timed.flush()


def stop_supervisor(sup: subprocess.Popen[bytes], wait_s: float = 120.0) -> None:
    sup.send_signal(signal.SIGTERM)
    try:
        sup.wait(wait_s)
    except subprocess.TimeoutExpired:
        sup.kill()
        sup.wait()


class Stop(Exception):
    """A driver's part cannot go on: the reason is its summary's last line."""


def counted(prompt: str, model: str, max_len: int) -> int:
    """The prompt's tokens by the engine's own tokenizer; Stop when it cannot be sent as the incident needs
    (a prompt over max_model_len gets 400 and no incident can happen: a driver waiting for one waits in vain)."""
    code, body, _ = http(f"http://127.0.0.1:{PORT}/tokenize", {"model": model, "prompt": prompt}, timeout=120)
    if code != 200 or not isinstance(body, dict):
        raise Stop(f"/tokenize answered {code}: {str(body)[:300]}")
    n = int(body["count"])
    if n >= max_len:
        raise Stop(f"the long prompt is {n} tokens, over max_model_len {max_len}: vLLM would answer 400 and no "
                   "incident could happen; send a shorter one")
    return n


def died_or_stop(code: int, body: Any, deadline_s: float = 30.0) -> None:
    """The engine died after the long prompt (the supervisor left READY); else Stop, saying what happened."""
    t = time.monotonic()
    while time.monotonic() - t < deadline_s:
        st = status()
        if st and (st["state"] != "READY" or st["restarts"] > 0):
            return
        time.sleep(0.2)
    raise Stop(f"the incident did not happen: the long prompt got HTTP {code} ({str(body)[:300]}) and the engine "
               f"is still READY after {deadline_s:.0f}s")
