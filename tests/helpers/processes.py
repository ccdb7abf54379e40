"""Run the real `vllm-supervisor run` against an engine command, talk to it, and clean up after it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).parent
FAKE_VLLM = HERE / "fake_vllm.py"
FIXTURES = HERE.parent / "fixtures" / "vllm-logs"  # real vLLM logs, unedited
LONG_PROMPT = "word " * 30_000


def _port_block() -> range:
    """This test process's own ports, below the kernel's ephemeral range.

    A port bound to 0 and released is free only until anything else takes it: CI saw a supervisor die of
    EADDRINUSE on a port another xdist worker's outgoing connection (or a receiver bound to 0) had been handed
    from the same ephemeral range in between. Below that range the kernel hands out nothing by itself, and each
    xdist worker gets its own block, so two workers never pick the same port."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    floor = 10_000
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    size = max(64, (low - floor) // count)
    index = int(worker) if worker.isdigit() else 0
    start = floor + size * (index % count)
    return range(start, start + size)


_PORTS = iter(_port_block())


def free_port() -> int:
    """A port free now that nothing else in this test run is handed: the next one of this process's block that
    nothing listens on (an earlier test run's listener, another program's), never one given before."""
    for port in _PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("this test process used up its block of ports; raise the block size in _port_block")


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def to_toml(doc: dict[str, dict[str, Any]]) -> str:
    out = []
    for section, table in doc.items():
        out.append(f"[{section}]")
        out += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(out) + "\n"


def deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 30.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.load(e)
        except ValueError:
            return e.code, {}


def log_events(log: Path) -> list[dict[str, Any]]:
    """Every structlog JSON event in a supervisor's log (its other lines are vLLM's and the stand-in's)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def at(event: dict[str, Any]) -> float:
    """When the supervisor logged ``event`` (seconds since the epoch)."""
    return datetime.fromisoformat(event["timestamp"]).timestamp()


@dataclass
class Sup:
    """One running `vllm-supervisor run` process."""

    proc: subprocess.Popen[bytes]
    config: Path
    admin: str
    engine_url: str
    state_dir: Path
    log_path: Path
    engine_pids: set[int] = field(default_factory=set)
    gateway: str | None = None  # the gateway's base URL, when [gateway] is configured

    def status(self) -> dict[str, Any] | None:
        try:
            code, doc = http_json(f"http://{self.admin}/status", timeout=5)
        except (urllib.error.URLError, OSError):
            return None
        if doc.get("engine_pid"):
            self.engine_pids.add(doc["engine_pid"])
        return doc if code == 200 else None

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        """Poll /status until ``pred`` holds; fail with the last status and the log tail."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            doc = self.status()
            if doc is not None:
                last = doc
                if pred(doc):
                    return doc
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; exit={self.proc.poll()} last status={last}\n"
                             f"--- log tail ---\n{self.log_tail()}")

    def wait_ready(self, timeout: float = 60, restarts: int | None = None) -> dict[str, Any]:
        return self.wait_for(lambda s: s["ready"] and (restarts is None or s["restarts"] >= restarts),
                             timeout, f"READY (restarts >= {restarts})")

    def wait_standby_imported(self, timeout: float) -> dict[str, Any]:
        """The status once the next start's standby has done its imports ([recovery] standby)."""
        return self.wait_for(lambda s: (s["next_start"]["standby"] or {}).get("imported_s") is not None, timeout,
                             "a standby that has imported")

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"supervisor did not exit within {timeout}s\n{self.log_tail()}") from None

    def log_tail(self, n: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def events(self, name: str) -> list[dict[str, Any]]:
        """The supervisor's own structlog JSON events called ``name``."""
        return [ev for ev in log_events(self.log_path) if ev.get("event") == name]

    def engine_tree(self) -> list[psutil.Process]:
        doc = self.status()
        if not doc or not doc.get("engine_pid"):
            return []
        try:
            root = psutil.Process(doc["engine_pid"])
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


def gone(pid: int) -> bool:
    """The process no longer runs (exited, or a zombie waiting for its parent)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_sessions(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Launcher:
    """Starts `vllm-supervisor run` processes from config overrides and cleans every one up."""

    def __init__(self, workdir: Path, base: dict[str, Any], strict_stops: bool = False) -> None:
        self.workdir = workdir
        self.base = base
        # fail the test if a planned stop of the engine needed SIGKILL (not one killed at once on purpose: a
        # restart drained of every request)
        self.strict_stops = strict_stops
        self.started: list[Sup] = []
        # Its own run-directory parent, as a systemd unit's RuntimeDirectory=: another test's supervisor, starting
        # beside it under xdist, sweeps the run directories of dead supervisors in a shared /tmp, and a SIGKILLed
        # supervisor's throwaway still starting died of losing its logging config before this test's next
        # supervisor could stop it (a CI flake). Short, so that the event sockets' paths stay under 108 bytes.
        self.run_parent = Path(tempfile.mkdtemp(prefix="vsr-"))

    def start(self, overrides: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> Sup:
        n = len(self.started)
        port, admin_port = free_port(), free_port()
        doc = deep_merge(self.base, {
            "engine": {"port": port},
            "state": {"dir": str(self.workdir / f"state{n}")},
            "admin": {"listen": f"127.0.0.1:{admin_port}"},
        })
        doc = deep_merge(doc, overrides or {})
        if "gateway" in doc and "listen" not in doc["gateway"]:
            doc["gateway"]["listen"] = f"127.0.0.1:{free_port()}"
        cfg = self.workdir / f"sup{n}.toml"
        cfg.write_text(to_toml(doc))
        log_path = self.workdir / f"sup{n}.log"
        base = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "INVOCATION_ID", "NOTIFY_SOCKET")}
        base["RUNTIME_DIRECTORY"] = str(self.run_parent)
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "--config", str(cfg)],
                                    stdout=logf, stderr=subprocess.STDOUT, env={**base, **(env or {})})
        sup = Sup(proc, cfg, doc["admin"]["listen"], f"http://127.0.0.1:{doc['engine']['port']}",
                  Path(doc["state"]["dir"]), log_path,
                  gateway=f"http://{doc['gateway']['listen']}" if "gateway" in doc else None)
        self.started.append(sup)
        return sup

    def cleanup(self) -> None:
        for sup in self.started:
            if sup.proc.poll() is None:
                sup.proc.send_signal(signal.SIGTERM)
                try:
                    sup.proc.wait(60)
                except subprocess.TimeoutExpired:
                    sup.proc.kill()
                    sup.proc.wait()
            kill_sessions(sup.engine_pids | set(spawned_pids(sup)))
        shutil.rmtree(self.run_parent, ignore_errors=True)
        if self.strict_stops:
            killed = [(e["pids"], e["sigkilled"]) for sup in self.started for e in sup.events("engine.stopped")
                      if e.get("planned") and e.get("sigkilled") and not e.get("at_once")]
            assert not killed, f"a planned stop escalated to SIGKILL (pids, sigkilled): {killed}"


def spawned_pids(sup: Sup) -> list[int]:
    return [e["pid"] for e in sup.events("engine.spawned")]


STANDIN_BASE: dict[str, Any] = {
    "engine": {"model": "fake-model", "command": [sys.executable, str(FAKE_VLLM)], "env": {},
               "stop_timeout_s": 5.0, "kill_timeout_s": 5.0, "dead_grace_s": 2.0},
    "profile": {"max_num_batched_tokens": 8192, "max_num_seqs": 16, "max_model_len": 32768},
    "restart": {"max_restarts": 5, "window_s": 600.0, "backoff_initial_s": 0.05, "backoff_max_s": 0.2},
    "health": {"hang_timeout_s": 3.0, "probe_interval_s": 0.2, "canary_interval_s": 0.5},
    "warmup": {"max_tokens": 4, "timeout_s": 30.0},
    "gpu": {"release_timeout_s": 5.0, "free_wait_s": 0.0},
    "log": {"format": "json"},
    # On where they are tested (tests/standin/test_recovery.py): a standby interpreter after each READY costs
    # every other test a Python start, and a throwaway engine appears after 30 s idle.
    "recovery": {"precompile": "off", "standby": False},
}




def send_long_prompt(sup: Sup, headers: dict[str, str] | None = None) -> int:
    """The 30,000-word prompt straight to the engine; the HTTP status."""
    code, _ = http_json(sup.engine_url + "/v1/completions",
                        {"model": "fake-model", "prompt": LONG_PROMPT, "max_tokens": 4}, timeout=30, headers=headers)
    return code


def send_until_served(sup: Sup, tries: int) -> list[int]:
    """Send the long prompt until it is served, waiting for each recovery; the statuses seen."""
    codes: list[int] = []
    for _ in range(tries):
        codes.append(send_long_prompt(sup))
        if codes[-1] == 200:
            break
        sup.wait_ready(restarts=len(codes))
    return codes


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`vllm-supervisor ARGS...` in a new process."""
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True, text=True)
