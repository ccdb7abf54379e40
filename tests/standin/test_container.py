"""The supervisor as a container's main process: PID 1 of its own PID namespace (`unshare --pid`, for real)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.processes import STANDIN_BASE, deep_merge, free_port, http_json, to_toml

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux's unshare is needed")


def test_as_pid_1_it_reaps_the_engines_orphans_and_a_sigterm_ends_it_with_0(tmp_path: Path) -> None:
    """Issue 19: as PID 1 the supervisor must reap what vLLM leaves and stop cleanly on SIGTERM."""
    admin = f"127.0.0.1:{free_port()}"
    doc = deep_merge(STANDIN_BASE, {"engine": {"port": free_port()}, "state": {"dir": str(tmp_path / "state")},
                                    "admin": {"listen": admin}})
    cfg = tmp_path / "c.toml"
    cfg.write_text(to_toml(doc))
    log = open(tmp_path / "sup.log", "wb")  # noqa: SIM115 - closed below
    ns = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-m",
                           "supervisor", "run", "--config", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        st: dict = {}
        while time.monotonic() < deadline and not st.get("ready"):
            try:
                st = http_json(f"http://{admin}/status", timeout=2)[1]
            except OSError:
                time.sleep(0.1)
        assert st.get("ready"), (tmp_path / "sup.log").read_text()[-2000:]
        sup = psutil.Process(ns.pid).children()[0]
        assert "supervisor" in " ".join(sup.cmdline())
        api = next(p for p in sup.children() if "fake_vllm" in " ".join(p.cmdline()))
        core = api.children()[0]
        api.kill()  # its EngineCore is orphaned: re-parented to PID 1, the supervisor
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (st.get("ready") and st.get("restarts", 0) >= 1):
            st = http_json(f"http://{admin}/status", timeout=2)[1]
            time.sleep(0.1)
        assert st["restarts"] >= 1 and st["ready"]

        def zombies() -> list[int]:
            return [c.pid for c in sup.children() if c.status() == psutil.STATUS_ZOMBIE]

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (zombies() or psutil.pid_exists(core.pid)):
            time.sleep(0.1)
        assert zombies() == [] and not psutil.pid_exists(core.pid)  # stopped, and reaped
        sup.send_signal(signal.SIGTERM)
        assert ns.wait(30) == 0
    finally:
        if ns.poll() is None:
            ns.kill()
            ns.wait()
        log.close()
