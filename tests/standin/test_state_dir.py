"""The state directory as a careless operator leaves it: shared by two supervisors, damaged, unwritable (issue 25)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from tests.helpers.processes import Sup

DEEP = "[" * 200_000 + "]" * 200_000


def test_a_second_supervisor_on_the_same_state_directory_exits_and_touches_nothing(
        supervise: Callable[..., Sup], tmp_path: Path) -> None:
    """Two `@` instances with the default state dir: the second stopped the first's serving engine."""
    first = supervise({})
    st = first.wait_ready()
    engine = st["engine_pid"]
    second = supervise({"state": {"dir": str(first.state_dir)}})
    assert second.wait_exit(30) == 2
    out = second.log_path.read_text()
    assert "another vllm-supervisor" in out and f"(pid {first.proc.pid})" in out and "own [state] dir" in out
    assert not second.events("engine.spawned") and not second.events("engine.leftover_stopped")
    assert first.wait_ready()["engine_pid"] == engine and psutil.pid_exists(engine)
    assert (first.state_dir / "engine.json").exists()


def test_every_state_file_damaged_any_way_is_a_warning_and_the_engine_is_ready(
        supervise: Callable[..., Sup], tmp_path: Path) -> None:
    """A state.json nested 200,000 deep raised RecursionError (exit 1 at every start); "sid": 0 in a record made
    the next supervisor signal its own process group and SIGKILL every session-0 process, PID 1 among them."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "state.json").write_text(DEEP)
    (state / "quarantine.json").write_text(DEEP)
    (state / "pages.json").write_text("\x00\xff garbage")
    (state / "compiled.json").mkdir()  # a directory in its place
    for name in ("engine.json", "precompile.json", "spare.json"):
        (state / name).write_text(json.dumps({"sid": 0, "boot_id": "", "since_boot_s": 0.0, "supervisor_pid": 1}))
    # A process of our own session that a signal to "session 0" would reach.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        sup = supervise({"state": {"dir": str(state)}})
        st = sup.wait_ready()
        assert st["state"] == "READY" and sup.proc.poll() is None
        assert bystander.poll() is None, "a damaged record made the supervisor signal a bystander"
        assert not sup.events("engine.leftover_stopped")
        log = sup.log_path.read_text()
        assert log.count('"state.record_ignored"') >= 3 and '"state.corrupt_ignored"' in log
        assert "Traceback" not in log
    finally:
        bystander.kill()
        bystander.wait()


def test_a_state_directory_that_cannot_be_written_never_changes_how_the_supervisor_ends(
        supervise: Callable[..., Sup]) -> None:
    """SIGTERM gave exit 1 with the standby left running, and a crash loop ended in exit 1, not 4, without its
    `fatal` page. (The tests run as root, whom a read-only mode does not stop: a directory stands where the
    supervisor writes its engine record instead.)"""
    sup = supervise({})
    sup.wait_ready()
    record = sup.state_dir / "engine.json"
    record.unlink()
    record.mkdir()
    (record / "keep").write_text("x")  # not empty: unlink and replace both fail
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.wait_exit(60) == 0, sup.log_tail()
    assert "state.record_not_cleared" in sup.log_path.read_text()

    loop = supervise({"engine": {"env": {"FAKE_VLLM_DIE_AFTER_READY": "0.3"}}, "restart": {"max_restarts": 1},
                      "state": {"dir": str(sup.state_dir)}})
    assert loop.wait_exit(60) == 4, loop.log_tail()
    log = loop.log_path.read_text()
    assert "state.record_not_written" in log and '"supervisor.fatal"' in log


def test_records_naming_session_0_or_1_or_our_own_are_never_acted_on() -> None:
    from supervisor.host import leftovers, proctree

    async def stops() -> list[list[int]]:
        out = []
        for sid in (0, 1, os.getsid(0)):
            seen, killed, _ = await proctree.stop_session(sid, 0.1, 0.1)
            out.append(seen + killed)
        return out

    import asyncio
    t0 = time.monotonic()
    assert asyncio.run(stops()) == [[], [], []] and time.monotonic() - t0 < 1
    assert proctree._signal_group(os.getpgrp(), signal.SIGCONT) is False
    assert leftovers.read("/nonexistent-dir") is None
