"""Process-tree handling and the IPC channel, against real tiny child processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
from supervisor.decide.liveness import Progress
from supervisor.engine import ipc
from supervisor.host import proctree
from supervisor.host.vllm_http import parse_progress

TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    # A grandchild that ignores SIGTERM, like a wedged GPU worker.
    g = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('grandchild', flush=True); time.sleep(600)"])
    print("child", os.getpid(), g.pid, flush=True)
    time.sleep(600)
""")


async def spawn_tree() -> tuple[proctree.Child, int]:
    child = await proctree.spawn([sys.executable, "-c", TREE], os.environ)
    assert child.proc.stdout is not None
    seen: dict[str, list[str]] = {}
    while len(seen) < 2:  # both ready: the grandchild has installed its SIGTERM handler
        words = (await child.proc.stdout.readline()).decode().split()
        seen[words[0]] = words
    return child, int(seen["child"][2])


async def test_terminate_tree_escalates_to_sigkill_and_leaves_nothing() -> None:
    child, grandchild = await spawn_tree()
    try:
        report = await proctree.terminate_tree(child, grace_s=0.5, kill_wait_s=5)
        assert grandchild in report.killed
        assert report.survivors == ()
        assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    finally:
        _cleanup(child.sid)


ESCAPED = textwrap.dedent("""
    import os, subprocess, sys, time
    # A child that leaves the session (vLLM 0.26's EngineCore under a woken spare did, on the H100) and tears down
    # slowly on SIGTERM, holding what it holds.
    g = subprocess.Popen([sys.executable, "-c",
        "import os, signal, time; os.setsid(); signal.signal(signal.SIGTERM, lambda *a: time.sleep(30)); "
        "print('escaped', os.getpid(), flush=True); time.sleep(600)"], stdout=sys.stdout)
    print("child", os.getpid(), g.pid, flush=True)
    time.sleep(600)
""")


async def test_a_descendant_that_left_the_session_is_stopped_with_it_at_once() -> None:
    child = await proctree.spawn([sys.executable, "-c", ESCAPED], os.environ)
    assert child.proc.stdout is not None
    seen: dict[str, list[str]] = {}
    while len(seen) < 2:
        words = (await child.proc.stdout.readline()).decode().split()
        seen[words[0]] = words
    escaped = int(seen["escaped"][1])
    try:
        assert os.getsid(escaped) != child.sid and escaped not in [p.pid for p in proctree.session_members(child.sid)]
        report = await proctree.terminate_tree(child, grace_s=0.0, kill_wait_s=5)
        assert escaped in report.pids and escaped in report.killed and report.survivors == ()
        assert not psutil.pid_exists(escaped) or psutil.Process(escaped).status() == psutil.STATUS_ZOMBIE
    finally:
        _cleanup(child.sid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(escaped, signal.SIGKILL)


async def test_a_member_the_groups_sigterm_already_took_does_not_break_the_stop(monkeypatch: Any) -> None:
    """CI of 2026-12-05: between the group's SIGTERM and the check of each member's group, a member exited and
    os.getpgid raised ESRCH out of the stop; the grandchild that ignores SIGTERM must still be SIGKILLed."""
    child, grandchild = await spawn_tree()

    def gone(pid: int) -> int:
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(proctree.os, "getpgid", gone)
    try:
        seen, killed, survivors = await proctree.stop_session(child.sid, 0.3, 5)
        assert {child.pid, grandchild} <= set(seen) and grandchild in killed and survivors == []
    finally:
        _cleanup(child.sid)


async def test_orphans_of_a_sigkilled_leader_are_swept() -> None:
    child, grandchild = await spawn_tree()
    try:
        os.kill(child.pid, signal.SIGKILL)  # someone else kills the API server
        await child.wait_exit()  # noticed although the orphan still holds the pipes
        assert psutil.pid_exists(grandchild)  # the orphan survives its parent...
        report = await proctree.terminate_tree(child, grace_s=0.3, kill_wait_s=5)
        assert report.survivors == ()  # ...but not the sweep
        assert not proctree.session_members(child.sid)
    finally:
        _cleanup(child.sid)


async def test_a_recorded_session_is_stopped_by_its_birth_whatever_the_wall_clock_says(
        tmp_path: Path, monkeypatch: Any) -> None:
    """CI flake of 2026-12-01: psutil's create time adds the boot time read from /proc/stat at each call, and that
    moves with the clock; the next supervisor's reading of the same process differed, and the leftover was kept."""
    from supervisor.host import leftovers

    child, grandchild = await spawn_tree()
    try:
        leftovers.write(tmp_path, leftovers.EngineRecord(child.sid, proctree.birth(child.pid), 1))
        rec = leftovers.read(tmp_path)
        assert rec is not None
        booted = psutil.boot_time()
        monkeypatch.setattr("psutil._pslinux.boot_time", lambda: booted - 1.5)  # /proc/stat's btime reads lower now
        seen, _, survivors = await proctree.stop_session(rec.sid, 0.3, 5, born=rec.born)
        assert {child.pid, grandchild} <= set(seen) and survivors == []
    finally:
        _cleanup(child.sid)


async def test_a_recycled_session_id_or_another_boots_record_stops_nothing() -> None:
    child, grandchild = await spawn_tree()
    try:
        born = proctree.birth(child.pid)
        older = proctree.Birth(born.boot_id, born.since_boot_s - 60)  # the record's leader is not this one
        assert await proctree.stop_session(child.sid, 0.3, 5, born=older) == ([], [], [])
        rebooted = proctree.Birth("another-boot", born.since_boot_s)
        assert await proctree.stop_session(child.sid, 0.3, 5, born=rebooted) == ([], [], [])
        assert psutil.pid_exists(grandchild) and psutil.pid_exists(child.pid)
        seen, _, _ = await proctree.stop_session(child.sid, 0.3, 5, born=born)
        assert {child.pid, grandchild} <= set(seen)
    finally:
        _cleanup(child.sid)


def test_a_record_written_before_births_were_kept_still_names_its_session(tmp_path: Path) -> None:
    from supervisor.host import leftovers

    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        me = psutil.Process(leader.pid)
        (tmp_path / "engine.json").write_text(json.dumps(
            {"sid": leader.pid, "create_time": me.create_time(), "supervisor_pid": 1}))
        rec = leftovers.read(tmp_path)
        assert rec is not None and rec.sid == leader.pid
        assert abs(rec.born.since_boot_s - proctree.since_boot_s(me.pid)) < proctree.BIRTH_SLACK_S
    finally:
        leader.kill()
        leader.wait()


def _cleanup(sid: int) -> None:
    for p in proctree.session_members(sid):
        p.kill()


async def test_vllm_processes_send_typed_events_over_the_logging_config(tmp_path: Path) -> None:
    got: list[dict[str, Any]] = []
    arrived = asyncio.Event()

    def on_event(ev: dict[str, Any]) -> None:
        got.append(ev)
        if ev.get("exc_type"):
            arrived.set()

    sock = tmp_path / "ev.sock"
    server = ipc.EventServer(sock, on_event)
    await server.start()
    env = {**os.environ, **ipc.prepare_child_env(tmp_path / "run", str(sock)),
           "PYTHONPATH": str(tmp_path / "run")}
    # What vllm/logger.py does with VLLM_LOGGING_CONFIG_PATH, in a child and a forked grandchild.
    code = textwrap.dedent("""
        import json, logging, logging.config, os
        logging.config.dictConfig(json.load(open(os.environ["VLLM_LOGGING_CONFIG_PATH"])))
        log = logging.getLogger("vllm.v1.engine.core")
        log.info("not an event")
        if os.fork() == 0:
            log.warning("from the worker")
            os._exit(0)
        os.wait()
        try:
            raise RuntimeError("CUDA out of memory. Tried to allocate 10.78 GiB. GPU 0 has a total capacity")
        except RuntimeError:
            log.exception("EngineCore encountered a fatal error.")
    """)
    try:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, env=env,
                                                    stdout=asyncio.subprocess.PIPE)
        stdout, _ = await proc.communicate()
        assert proc.returncode == 0
        await asyncio.wait_for(arrived.wait(), 10)
    finally:
        server.close()
    console = stdout.decode()
    assert "not an event" in console  # console output kept, in vLLM's format
    assert "ERROR" in console and "[<string>:" in console
    msgs = [e["msg"] for e in got]
    assert "not an event" not in msgs and "from the worker" in msgs
    fatal = next(e for e in got if e.get("exc_type"))
    assert fatal["exc_type"] == "RuntimeError"
    assert fatal["alloc"] == "Tried to allocate 10.78 GiB"
    assert len({e["pid"] for e in got}) == 2
    json.dumps(got)


METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} 50.0
"""


def test_parse_progress_sums_vllm_metrics() -> None:
    assert parse_progress(METRICS) == Progress(2.0, 1.0, 150.0)


def test_the_hook_lets_the_supervisor_trace_each_vllm_process(monkeypatch: Any) -> None:
    """PR_SET_PTRACER with the supervisor's PID, from every process the hook loads in (Yama ptrace_scope=1)."""
    from supervisor.child import vllm_hook

    calls: list[tuple[int, ...]] = []

    class Libc:
        def prctl(self, *args: int) -> int:
            calls.append(args)
            return 0

    monkeypatch.setattr(vllm_hook.ctypes, "CDLL", lambda *a, **k: Libc())  # this machine has no Yama LSM
    monkeypatch.setenv("VLLMSUP_PID", str(os.getpid()))
    assert vllm_hook.allow_supervisor_ptrace() is True
    assert calls == [(0x59616D61, os.getpid(), 0, 0, 0)]  # PR_SET_PTRACER, the supervisor
    monkeypatch.setenv("VLLMSUP_PID", "")
    assert vllm_hook.allow_supervisor_ptrace() is False
    env = ipc.prepare_child_env(Path(os.environ.get("TMPDIR", "/tmp")) / f"hook-{os.getpid()}", "/x.sock")
    assert env["VLLMSUP_PID"] == str(os.getpid())
