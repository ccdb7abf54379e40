"""Shared helpers for the benchmarks: run a supervisor, read its /status, find the engine tree."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status(admin: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://{admin}/status", timeout=5) as r:
            doc: dict[str, Any] = json.load(r)
            return doc
    except (urllib.error.URLError, OSError):
        return None


def wait_ready(admin: str, restarts: int, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = status(admin)
        if st and st["ready"] and st["restarts"] >= restarts:
            return st
        time.sleep(0.01)
    raise SystemExit(f"supervisor not READY (restarts >= {restarts}) within {timeout}s")


def engine_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


# Real vLLM (CPU) over the tiny local model; format with model= and python= (then {port} stays for Supervisor).
REAL_VLLM_TOML = """
[engine]
model = "{model}"
port = {{port}}
command = ["{python}", "-m", "vllm.entrypoints.openai.api_server"]
env = {{{{ HF_HUB_OFFLINE = "1", VLLM_NO_USAGE_STATS = "1"{env} }}}}
start_timeout_s = 600.0
[engine.args]
kv_cache_memory_bytes = 268435456
served_model_name = "tiny-llama"
[profile]
max_num_batched_tokens = 2048
max_num_seqs = 8
max_model_len = 4096
"""


# The OOM benches' ladder: the tiny model's chunk steps, and no backoff between restarts.
OOM_LADDER = """
[ladder]
max_num_batched_tokens = [2048, 1024, 512]
max_num_batched_tokens_floor = 256
[restart]
backoff_initial_s = 0.0
backoff_max_s = 0.0
"""


def cap_worker(api_pid: int) -> None:
    """Cap vLLM's worker's address space just above what it maps: its next large allocation fails (a real OOM)."""
    worker = next(p for p in engine_tree(api_pid) if "Worker" in p.name())
    subprocess.run(["prlimit", "--pid", str(worker.pid), f"--as={worker.memory_info().vms + 4 * 2**20}"],
                   check=True)


def real_vllm_toml(model: str, python: str, extra: str = "", env: dict[str, str] | None = None) -> str:
    """The real-vLLM config for ``model`` and vLLM's ``python``, plus ``extra`` TOML tables and engine ``env``."""
    more = "".join(f", {k} = {json.dumps(v)}" for k, v in (env or {}).items()).replace("{", "{{").replace("}", "}}")
    return REAL_VLLM_TOML.format(model=Path(model).resolve(), python=Path(python).absolute(), env=more) + extra


# Every bench run: no GPU gate, its own state dir and admin port, JSON events.
TAIL = """
[gpu]
free_wait_s = 0.0
[state]
dir = "{state}"
[admin]
listen = "{admin}"
[log]
format = "json"
"""


class Supervisor:
    """`vllm-supervisor run` in the background, with its output in a temp file; ``toml`` has {port}."""

    def __init__(self, toml: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="vsup-bench-"))
        self.admin = f"127.0.0.1:{free_port()}"
        self.port = free_port()
        cfg = self.dir / "c.toml"
        cfg.write_text(toml.format(port=self.port) + TAIL.format(admin=self.admin, state=self.dir / "state"))
        self.log = open(self.dir / "sup.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "--quiet-engine", "--config",
                                      str(cfg)], stdout=self.log, stderr=subprocess.STDOUT)

    def events(self, name: str) -> list[dict[str, Any]]:
        """The supervisor's own JSON events called ``name`` so far."""
        return events_in(self.dir / "sup.log", name)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def events_in(log: Path, name: str) -> list[dict[str, Any]]:
    """The supervisor's own JSON events called ``name`` in its output ``log`` (vLLM's lines are skipped)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if doc.get("event") == name:
                    out.append(doc)
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def here() -> Path:
    return Path(os.path.dirname(os.path.abspath(__file__)))
