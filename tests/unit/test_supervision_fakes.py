"""The lifecycle's state machine, wired by the composition root, with a fake clock, OS seam and engine client."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from supervisor.config_file import parse
from supervisor.daemon import Daemon
from supervisor.engine_states import ExitCode
from supervisor.host.gpu import DeviceSnapshot, GpuLost
from supervisor.host.proctree import Birth, StopReport
from supervisor.host.vllm_http import EngineError, Progress
from supervisor.ops.notify import Notifier

from tests.helpers.processes import FIXTURES


class FakeProc:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = asyncio.StreamReader()
        self.stderr = asyncio.StreamReader()
        self.exited = asyncio.Event()

    def exit(self, rc: int) -> None:
        if self.returncode is None:
            self.returncode = rc
            self.exited.set()
            self.stdout.feed_eof()
            self.stderr.feed_eof()


class FakeChild:
    def __init__(self, pid: int, argv: list[str]) -> None:
        self.proc = FakeProc(pid)
        self.argv = argv
        self.known_pids = {pid}

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def sid(self) -> int:
        return self.proc.pid

    async def wait_exit(self) -> int:
        await self.proc.exited.wait()
        assert self.proc.returncode is not None
        return self.proc.returncode


class FakeHost:
    """Records every OS effect; the clock moves only when the arbiter sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []
        self.children: list[FakeChild] = []
        self.spawned = asyncio.Queue[FakeChild]()
        self.terminated: list[int] = []
        self.graces: list[float] = []
        self.gate_asks: list[float] = []
        self.leftover_stops: list[int] = []
        self.short: list[DeviceSnapshot] = []
        self.missing_paths: set[str] = set()
        self.gate_devices: list[Any] = []
        self.snapshots: list[DeviceSnapshot] = []
        self.gpu_lost: str | None = None
        self.snapshot_calls = 0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)

    async def spawn(self, argv: list[str], env: dict[str, str]) -> FakeChild:
        child = FakeChild(100 + len(self.children), argv)
        self.children.append(child)
        self.spawned.put_nowait(child)
        return child

    async def terminate_tree(self, child: FakeChild, grace_s: float, kill_wait_s: float) -> StopReport:
        self.terminated.append(child.pid)
        self.graces.append(grace_s)
        child.proc.exit(-15)
        return StopReport((child.pid,), (), (), child.proc.returncode)

    def birth(self, pid: int) -> Birth:
        return Birth("boot", 1.0)

    async def stop_leftover(self, sid: int, born: Birth, grace_s: float, kill_wait_s: float) -> list[int]:
        self.leftover_stops.append(sid)
        return [sid]

    def session_pids(self, sid: int) -> list[int]:
        return [sid]

    async def outside_clients(self, pids: Any, port: int) -> int:
        return 1  # a client of the engine's own port: the settled death's window stays

    def tree_pids(self, child: FakeChild) -> set[int]:
        return set(child.known_pids)

    def path_exists(self, path: str) -> bool:
        return path not in self.missing_paths

    async def gpu_snapshot(self, devices: Any = None) -> list[Any]:
        self.snapshot_calls += 1
        return list(self.snapshots)

    async def wait_gpu_released(self, pids: Any, timeout_s: float) -> dict[int, int]:
        return {}

    async def wait_gpu_free(self, devices: Any, fraction: float, headroom: int, timeout_s: float) -> list[Any]:
        if self.gpu_lost:
            raise GpuLost(self.gpu_lost)
        self.gate_devices.append(devices)
        self.gate_asks.append(fraction)
        return [self.short.pop(0)] if self.short else []

    async def dump_stacks(self, pids: Any, timeout_s: float = 20.0) -> dict[int, str]:
        return {}


class FakeClient:
    """Answers like a healthy engine: 200s, progress, and completions."""

    def __init__(self) -> None:
        self.base_url = "http://127.0.0.1:18000"
        self.model: str | None = None
        self.completions = 0
        self.healthy = True

    async def health(self, timeout: float = 2.0) -> int | None:
        return 200 if self.healthy else None

    async def metrics(self, timeout: float = 5.0) -> Progress:
        return Progress(0, 0, float(self.completions))

    async def count_tokens(self, text: str, timeout: float = 30.0) -> int:
        return len(text.split())

    async def complete(self, prompt: str, max_tokens: int, timeout: float, request_id: str | None = None) -> Any:
        self.completions += 1
        return {"choices": [{"text": "x"}]}

    async def close(self) -> None:
        pass


def make(tmp_path: Path, **sections: dict[str, Any]) -> tuple[Daemon, FakeHost, FakeClient]:
    raw: dict[str, Any] = {"engine": {"model": "m", "command": ["fake-vllm"]},
                           "profile": {"max_num_seqs": 16},
                           "restart": {"backoff_initial_s": 2.0, "backoff_max_s": 8.0, "backoff_jitter": 0.0},
                           "health": {"probe_interval_s": 1.0, "canary_interval_s": 1000.0},
                           "state": {"dir": str(tmp_path / "state")},
                           "admin": {"listen": "127.0.0.1:0"}}
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v}
    host, client = FakeHost(), FakeClient()
    arb = Daemon(parse(raw), host, notifier=Notifier(), install_signals=False,  # type: ignore[arg-type]
                     client_factory=lambda: client)  # type: ignore[arg-type,return-value]
    arb.heartbeat.tick_s = 0.02  # the loop's real-time heartbeat; the engine's time is the fake clock
    return arb, host, client


async def until(pred: Any, what: str) -> None:
    for _ in range(10_000):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never reached: {what}")


async def states(arb: Daemon) -> list[str]:
    """The state transitions so far, once every subscriber has caught up."""
    await arb.bus.drain()
    return [h["to"] for h in arb.history.entries]


async def test_ready_to_backoff_on_runtime_oom_then_restart_with_a_lower_chunk(tmp_path: Path) -> None:
    arb, host, _ = make(tmp_path)
    run = asyncio.create_task(arb.run())
    first = await host.spawned.get()
    await until(lambda: arb.lifecycle.state.value == "READY", "READY")
    first.proc.stdout.feed_data(b"(EngineCore pid=7) ERROR 11-30 07:36:17 [core.py:1332] "
                                b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 176.00 MiB.\n")
    first.proc.stdout.feed_data(b"(EngineCore pid=7) ERROR 11-30 07:36:17 [core.py:1332] "
                                b"EngineCore encountered a fatal error.\n")
    first.proc.exit(0)  # vLLM exits 0 after its engine died
    second = await host.spawned.get()
    await until(lambda: arb.lifecycle.state.value == "READY", "READY again")
    assert await states(arb) == ["STARTING", "WARMING", "READY", "STOPPING", "BACKOFF", "STARTING", "WARMING", "READY"]
    assert "--max-num-batched-tokens" in second.argv
    assert second.argv[second.argv.index("--max-num-batched-tokens") + 1] == "6144"
    lf = arb.lifecycle.tally.remembered.last_failure
    assert lf is not None and lf["kind"] == "runtime_oom"
    assert 2.0 in host.slept  # the first backoff, on the fake clock
    arb.lifecycle.request_stop("test")
    assert await run == ExitCode.OK
    assert (await states(arb))[-2:] == ["STOPPING", "STOPPED"]
    assert host.terminated == [first.pid, second.pid]
    assert host.graces == [3.0, 20.0]  # a dead engine gets the short grace, a requested stop the long one


async def test_starting_to_fatal_on_a_bad_flag(tmp_path: Path) -> None:
    arb, host, client = make(tmp_path)
    client.healthy = False
    run = asyncio.create_task(arb.run())
    child = await host.spawned.get()
    child.proc.stderr.feed_data(b"api_server.py: error: unrecognized arguments: --swap-space\n")
    child.proc.exit(2)
    assert await run == ExitCode.ENGINE_CONFIG_ERROR
    assert await states(arb) == ["STARTING", "STOPPING", "FATAL"]
    assert len(host.children) == 1


async def test_backoff_grows_on_the_fake_clock_until_the_budget_is_spent(tmp_path: Path) -> None:
    arb, host, _ = make(tmp_path, restart={"max_restarts": 3})
    run = asyncio.create_task(arb.run())
    for _ in range(4):
        child = await host.spawned.get()
        await until(lambda c=child: arb.lifecycle.state.value == "READY" and arb.lifecycle.run is not None
                    and arb.lifecycle.run.child is c, "READY")
        child.proc.exit(-11)  # SIGSEGV
    assert await run == ExitCode.RESTART_BUDGET_SPENT
    backoffs = [h["delay_s"] for h in arb.history.entries if h["to"] == "BACKOFF"]
    assert backoffs == [2.0, 4.0, 8.0]
    lf = arb.lifecycle.tally.remembered.last_failure
    assert lf is not None and lf["kind"] == "signal"


async def test_time_an_engine_served_counts_toward_its_backoff(tmp_path: Path) -> None:
    """READY 1.5 s, then a death: 0.5 s of the 2 s backoff is left; READY 30 s: the restart is at once. A start
    that fails before READY (the crash loop the backoff is for) still waits its whole backoff."""
    arb, host, client = make(tmp_path)
    run = asyncio.create_task(arb.run())

    def delays() -> list[float]:
        return [h["delay_s"] for h in arb.history.entries if h["to"] == "BACKOFF"]

    for n, served in enumerate((1.5, 30.0)):
        child = await host.spawned.get()
        await until(lambda c=child: arb.lifecycle.state.value == "READY" and arb.lifecycle.run is not None
                    and arb.lifecycle.run.child is c, "READY")
        host.now += served
        child.proc.exit(-11)
        await until(lambda k=n: len(delays()) > k, "BACKOFF")
    assert delays() == [0.5, 0.0]  # the second death's backoff would be 4 s, and it served 30
    client.healthy = False
    child = await host.spawned.get()
    child.proc.exit(-11)  # dies while starting: never READY
    await until(lambda: len(delays()) == 3, "a third BACKOFF")
    assert delays()[-1] == 8.0
    arb.lifecycle.request_stop("test")
    assert await run == ExitCode.OK


async def test_warmup_failure_is_a_startup_failure(tmp_path: Path) -> None:
    arb, host, client = make(tmp_path, restart={"max_restarts": 0})

    async def broken(*a: Any, **k: Any) -> Any:
        raise EngineError("POST /v1/completions returned 500: boom")

    client.complete = broken  # type: ignore[method-assign]
    run = asyncio.create_task(arb.run())
    await host.spawned.get()
    assert await run == ExitCode.RESTART_BUDGET_SPENT
    assert "READY" not in await states(arb)
    lf = arb.lifecycle.tally.remembered.last_failure
    assert lf is not None and "warm-up" in lf["evidence"]


async def test_stop_during_backoff_exits_zero_without_another_start(tmp_path: Path) -> None:
    arb, host, _ = make(tmp_path, restart={"backoff_initial_s": 1e6, "backoff_max_s": 1e6})
    host_sleep = host.sleep

    async def slow_sleep(seconds: float) -> None:
        if seconds >= 1e5:
            await asyncio.Event().wait()  # a backoff that only a stop ends
        await host_sleep(seconds)

    host.sleep = slow_sleep  # type: ignore[method-assign]
    run = asyncio.create_task(arb.run())
    child = await host.spawned.get()
    await until(lambda: arb.lifecycle.state.value == "READY", "READY")
    child.proc.exit(1)
    await until(lambda: arb.lifecycle.state.value == "BACKOFF", "BACKOFF")
    arb.lifecycle.request_stop("test")
    assert await run == ExitCode.OK
    assert (await states(arb))[-2:] == ["BACKOFF", "STOPPED"]
    assert len(host.children) == 1


@pytest.mark.parametrize("hang_after", [3])
async def test_ready_to_stopping_on_frozen_token_progress(tmp_path: Path, hang_after: int) -> None:
    arb, host, client = make(tmp_path, health={"hang_timeout_s": 5.0, "probe_interval_s": 1.0},
                             restart={"max_restarts": 0})

    async def stuck(timeout: float = 5.0) -> Progress:
        return Progress(running=1, waiting=2, tokens=42)  # busy, but no token moves

    client.metrics = stuck  # type: ignore[method-assign]
    run = asyncio.create_task(arb.run())
    await host.spawned.get()
    assert await run == ExitCode.RESTART_BUDGET_SPENT
    lf = arb.lifecycle.tally.remembered.last_failure
    assert lf is not None and lf["kind"] == "hang"
    assert "no token progress for 5s" in lf["evidence"]


async def test_a_card_held_steadily_by_another_process_starts_now_at_the_utilization_that_fits(
        tmp_path: Path) -> None:
    """Issue 17: the gate waited free_wait_s (120 s) for memory a foreign process held steady, then failed."""
    arb, host, _ = make(tmp_path, profile={"gpu_memory_utilization": 0.5})
    gib = 2**30
    seen: list[Any] = []
    arb.bus.subscribe("test", type("Rec", (), {"on_event": lambda self, e: seen.append(e)})())
    # The seed's situation: another process holds half of the card (the host's wait ends as soon as it is steady).
    host.short = [DeviceSnapshot(0, 140 * gib, 70 * gib, 70 * gib, ((1000, 69 * gib),))]
    run = asyncio.create_task(arb.run())
    child = await host.spawned.get()
    await until(lambda: arb.lifecycle.state.value == "READY", "READY")
    assert host.gate_asks == [0.5]  # one gate, no failed start, no second try
    assert child.argv[child.argv.index("--gpu-memory-utilization") + 1] == "0.48"  # (70 - 1) / 140 = 0.493
    lf = arb.lifecycle.tally.remembered.last_failure
    assert len(host.children) == 1 and arb.lifecycle.tally.restarts == 0 and lf is None
    assert arb.lifecycle.profile.gpu_memory_utilization == 0.48
    await arb.bus.drain()
    adapted = [e for e in seen if e.name == "gpu.utilization_adapted"]
    assert len(adapted) == 1 and (adapted[0].before, adapted[0].after) == (0.5, 0.48)
    assert "held by pid 1000 (69.00 GiB)" in adapted[0].evidence
    changed = [e for e in seen if e.name == "engine.profile_changed"]
    assert changed and "another process holds GPU memory steadily" in changed[0].reason
    arb.lifecycle.request_stop("test")
    assert await run == ExitCode.OK


async def test_warmup_without_tokenize_estimates_prompt_sizes(tmp_path: Path) -> None:
    arb, host, client = make(tmp_path)

    async def no_tokenize(text: str, timeout: float = 30.0) -> int:
        raise EngineError("POST /tokenize returned 404: Not Found")

    client.count_tokens = no_tokenize  # type: ignore[method-assign]
    run = asyncio.create_task(arb.run())
    await host.spawned.get()
    await until(lambda: arb.lifecycle.state.value == "READY", "READY")
    assert client.completions == 4
    arb.lifecycle.request_stop("test")
    assert await run == ExitCode.OK


def test_warmup_plan_spans_a_quarter_to_a_half_of_the_chunk_and_fits_the_model() -> None:
    from supervisor.config import WarmupConfig
    from supervisor.engine.warmup import plan
    from supervisor.profile import Profile

    assert plan(Profile(max_num_batched_tokens=8192), WarmupConfig()) == [2048, 2730, 3413, 4096]
    assert max(plan(Profile(max_num_batched_tokens=8192, max_model_len=1024), WarmupConfig())) <= 1024 - 8
    assert plan(Profile(), WarmupConfig(enabled=False)) == []
    assert plan(Profile(), WarmupConfig(prompt_tokens=(10, 20))) == [10, 20]


def test_a_woken_spares_warmup_is_its_prompts_in_one_round_of_one_token_each() -> None:
    from supervisor.config import WarmupConfig
    from supervisor.engine.warmup import after_wake

    woken = after_wake(WarmupConfig(concurrency=2, max_tokens=8, timeout_s=30.0), [1, 2, 3, 4])
    assert (woken.concurrency, woken.max_tokens, woken.timeout_s) == (4, 1, 30.0)


async def test_recovery_time_counts_from_the_first_failure_of_an_outage(tmp_path: Path) -> None:
    arb, host, _ = make(tmp_path, profile={"gpu_memory_utilization": 0.5}, restart={"backoff_jitter": 0.0})
    run = asyncio.create_task(arb.run())
    first = await host.spawned.get()
    await until(lambda: arb.lifecycle.state.value == "READY", "READY")
    t_fail = host.now
    first.proc.exit(-9)
    (await host.spawned.get()).proc.exit(-9)  # the restart dies too, before READY
    await host.spawned.get()
    life = arb.lifecycle
    await until(lambda: life.state.value == "READY" and life.tally.restarts == 2, "READY after two failures")
    lf = arb.lifecycle.tally.remembered.last_failure
    assert lf is not None and lf["kind"] == "signal"
    # backoffs of 2 s and 4 s on the fake clock lie between the first failure and READY
    assert 6.0 <= arb.lifecycle.tally.remembered.last_failure["recovered_after_s"] <= host.now - t_fail
    arb.lifecycle.request_stop("test")
    assert await run == ExitCode.OK


async def test_an_engine_left_by_a_dead_supervisor_is_stopped_before_the_first_start(tmp_path: Path) -> None:
    from supervisor.host import leftovers

    leftovers.write(tmp_path / "state", leftovers.EngineRecord(sid=4242, born=Birth("boot", 1.0), supervisor_pid=1))
    arb, host, _ = make(tmp_path)
    run = asyncio.create_task(arb.run())
    await host.spawned.get()
    assert host.leftover_stops == [4242]
    rec = leftovers.read(tmp_path / "state")
    assert rec is not None and rec.sid == host.children[0].sid  # now the new engine is on record
    arb.lifecycle.request_stop("test")
    assert await run == ExitCode.OK
    assert leftovers.read(tmp_path / "state") is None  # a clean stop leaves no record


GIB = 2**30


async def test_a_start_adapted_to_another_processs_memory_is_not_the_rungs_fault_and_climbs_back(
        tmp_path: Path) -> None:
    arb, host, _ = make(tmp_path, profile={"gpu_memory_utilization": 0.5}, ladder={"climb_after_s": 100.0})
    host.short = [DeviceSnapshot(0, 140 * GIB, 70 * GIB, 70 * GIB, ((1000, 69 * GIB),))]
    run = asyncio.create_task(arb.run())
    await until(lambda: arb.lifecycle.state.value == "READY", "READY at the lowered utilization")
    assert arb.lifecycle.profile.gpu_memory_utilization == 0.48
    assert arb.lifecycle.policy.rung_failures == {}  # the other process's memory is not held against the rung
    # The other process still holds its memory: no climb.
    host.snapshots = [DeviceSnapshot(0, 140 * GIB, 70 * GIB, 70 * GIB, ((1000, 69 * GIB),))]
    asked = host.snapshot_calls
    await until_async(lambda: host.snapshot_calls >= asked + 3, "the climb check looked at the card three times")
    assert arb.lifecycle.profile.gpu_memory_utilization == 0.48 and arb.lifecycle.state.value == "READY"
    # It is gone: the utilization climbs back to what is configured.
    host.snapshots = [DeviceSnapshot(0, 140 * GIB, 139 * GIB, 1 * GIB, ())]
    life = arb.lifecycle
    await until_async(lambda: life.profile.gpu_memory_utilization == 0.5 and life.state.value == "READY",
                      "climbed back to 0.5")
    assert arb.lifecycle.tally.restarts == 0  # adapted at the gate, then a planned climb: no failure at all
    arb.lifecycle.request_stop("test")
    assert await run == ExitCode.OK
    assert [e["to"] for e in arb.history.entries].count("DRAINING") == 1


async def until_async(pred: Any, what: str, timeout: float = 10.0) -> None:
    """Like until(), for conditions that need the supervisor's real-time tick."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"never reached: {what}")
        await asyncio.sleep(0.01)


async def test_a_model_path_missing_at_boot_is_waited_for_then_served(tmp_path: Path) -> None:
    arb, host, _ = make(tmp_path, engine={"model": "/models/late", "model_wait_s": 60.0})
    host.missing_paths = {"/models/late"}
    sleep = host.sleep

    async def mount_after_two_waits(seconds: float) -> None:
        await sleep(seconds)
        if len(host.slept) == 2:
            host.missing_paths.clear()  # the mount arrives

    host.sleep = mount_after_two_waits  # type: ignore[method-assign]
    run = asyncio.create_task(arb.run())
    await host.spawned.get()
    assert host.slept[:2] == [1.0, 2.0]  # backoff while waiting
    await until(lambda: arb.lifecycle.state.value == "READY", "READY")
    arb.lifecycle.request_stop("test")
    assert await run == ExitCode.OK


async def test_a_model_path_that_never_appears_is_a_config_error_after_the_wait(tmp_path: Path) -> None:
    arb, host, _ = make(tmp_path, engine={"model": "/models/never", "model_wait_s": 60.0})
    host.missing_paths = {"/models/never"}
    assert await arb.run() == ExitCode.ENGINE_CONFIG_ERROR
    assert host.children == []
    assert sum(host.slept) == pytest.approx(60.0)
    lf = arb.lifecycle.tally.remembered.last_failure
    assert lf is not None and lf["kind"] == "config_error"
    lf = arb.lifecycle.tally.remembered.last_failure
    assert "'/models/never' does not exist (waited engine.model_wait_s=60s)" in lf["evidence"]


async def test_starts_that_hang_until_start_timeout_end_in_fatal_whatever_their_spacing(tmp_path: Path) -> None:
    arb, host, client = make(tmp_path, engine={"start_timeout_s": 900.0},
                             restart={"max_restarts": 100, "window_s": 60.0, "max_consecutive_failures": 3})
    client.healthy = False  # /health never answers: every start hangs until start_timeout_s
    assert await arb.run() == ExitCode.RESTART_BUDGET_SPENT
    assert len(host.children) == 3
    lf = arb.lifecycle.tally.remembered.last_failure
    assert lf is not None and lf["kind"] == "hang"
    assert "start_timeout_s=900s" in lf["evidence"]
    assert "READY" not in await states(arb)


async def test_a_gpu_that_fell_off_the_bus_is_device_fatal_with_an_incident(tmp_path: Path) -> None:
    arb, host, _ = make(tmp_path, restart={"device_fatal_retries": 0})
    host.gpu_lost = "NVML: GPU is lost (the GPU has fallen off the bus or the driver lost it)"
    assert await arb.run() == ExitCode.DEVICE_FATAL
    assert host.children == []
    lf = arb.lifecycle.tally.remembered.last_failure
    assert lf is not None and lf["kind"] == "device_fatal" and "fallen off the bus" in lf["evidence"]
    bundle, mode = read_incident(lf["incident"])
    assert bundle["failure"]["kind"] == "device_fatal"
    assert mode == 0o600


async def test_the_gpu_gate_honours_the_supervisors_own_cuda_visible_devices(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-8a2c")
    arb, host, _ = make(tmp_path)
    run = asyncio.create_task(arb.run())
    await until(lambda: arb.lifecycle.state.value == "READY", "READY")
    assert host.gate_devices == [[1, "GPU-8a2c"]]
    arb.lifecycle.request_stop("test")
    assert await run == ExitCode.OK
    arb2, host2, _ = make(tmp_path / "b", engine={"env": {"CUDA_VISIBLE_DEVICES": "3"}})
    run2 = asyncio.create_task(arb2.run())
    await until(lambda: arb2.lifecycle.state.value == "READY", "READY")
    assert host2.gate_devices == [[3]]  # [engine.env] wins over the supervisor's own
    arb2.lifecycle.request_stop("test")
    assert await run2 == ExitCode.OK


async def test_the_watchdog_is_petted_from_the_loops_progress_and_stops_when_a_step_overruns(
        tmp_path: Path) -> None:
    arb, host, _ = make(tmp_path)
    arb.heartbeat.tick_s = 0.01
    pets: list[float] = []
    arb.notifier.watchdog_interval_s = 15.0
    arb.notifier.watchdog = lambda: pets.append(host.now)  # type: ignore[method-assign]
    within = asyncio.ensure_future(arb.heartbeat.wait(asyncio.sleep(0.1), lambda: host.now + 100))
    await within
    assert len(pets) >= 3 and arb.heartbeat.alive()
    pets.clear()
    # A step that overran its bound:
    stuck = asyncio.ensure_future(arb.heartbeat.wait(asyncio.Event().wait(), lambda: host.now - 100))
    await asyncio.sleep(0.1)
    assert pets == []
    host.now += 60
    assert not arb.heartbeat.alive()  # /healthz says 503 once the loop stopped proving progress
    stuck.cancel()


def read_incident(path: str) -> tuple[dict[str, Any], int]:
    p = Path(path)
    return json.loads(p.read_text()), p.stat().st_mode & 0o777


def test_an_engine_run_masks_the_api_key_in_events_and_console_lines(tmp_path: Path) -> None:
    from supervisor.engine.observer import Observer

    arb, host, _ = make(tmp_path, engine={"args": {"api_key": "sk-abc-123"}})
    run = Observer(arb.cfg, host, lambda ev: None, arb.cfg.engine.secrets(), lambda _: None)  # type: ignore[arg-type]
    run.on_event({"level": "WARNING", "msg": "bad key sk-abc-123", "exc_tail": ["x sk-abc-123"]})
    run.tail.add("(APIServer pid=1) INFO 12-01 00:00:00 [api_server.py:1] non-default args: "
                 "{'api_key': ['sk-abc-123']}")
    assert "sk-abc-123" not in json.dumps(list(run.events)) + json.dumps(run.tail.snapshot())
    assert "***" in run.events[0]["msg"] and "***" in run.tail.snapshot()[0]


async def test_status_shows_vllms_own_startup_step_while_starting(tmp_path: Path) -> None:
    arb, host, client = make(tmp_path)
    client.healthy = False
    run = asyncio.create_task(arb.run())
    child = await host.spawned.get()
    log = FIXTURES / "h200-vllm0.26-startup-ok.log"
    lines = log.read_text().splitlines()
    upto = next(i for i, x in enumerate(lines) if "torch.compile took" in x)
    child.proc.stdout.feed_data(("\n".join(lines[:upto - 2]) + "\n").encode())
    await until(lambda: (arb.status()["startup"] or {}).get("step") == "compiling", "the compiling step")
    assert arb.status()["engine_version"] == "0.26.0"
    child.proc.stdout.feed_data((lines[upto] + "\n").encode())
    await until(lambda: arb.status()["startup"]["step"] == "compiled", "compiled")
    client.healthy = True
    await until(lambda: arb.lifecycle.state.value == "READY", "READY")
    assert arb.status()["startup"] is None
    arb.lifecycle.request_stop("test")
    assert await run == ExitCode.OK


def test_phases_of_a_real_start_from_vllms_own_lines() -> None:
    from supervisor.decide.startup import phases, step_of

    log = (FIXTURES / "h200-vllm0.26-startup-ok.log").read_text()
    steps: list[tuple[str, float]] = []
    for i, line in enumerate(log.splitlines()):  # one line a second, as if read live
        step = step_of(line)
        if step and (not steps or steps[-1][0] != step):
            steps.append((step, 10.0 + i))
    healthy = 10.0 + len(log.splitlines())
    p = phases(started=0.0, spawned=10.0, steps=steps, healthy=healthy, ready=healthy + 1.5)
    assert list(p)[:3] == ["gates", "interpreter and imports", "engine init"]
    assert {"weight loading", "torch.compile", "KV-cache profiling", "CUDA graph capture", "warm-up"} <= set(p)
    assert p["gates"] == 10.0 and p["warm-up"] == 1.5
    assert sum(v for k, v in p.items() if k != "warm-up") == pytest.approx(healthy)  # every second accounted for
    # Issue 38, item 4: the H200's 1.03 s "after graphs" is split where vLLM says what it does: the EngineCore's
    # own end, its handshake with the API server, the API's build, the HTTP server's start.
    assert list(p)[-5:] == ["after graphs", "engine core to API server", "API build", "API server start",
                            "warm-up"], list(p)
    cpu = [step_of(line) for line in (FIXTURES / "cpu-vllm0.32-enginecore-sigkill.log").read_text().splitlines()]
    assert [s for s in cpu if s in ("engine core initialised", "building the API", "starting API server")] == [
        "engine core initialised", "building the API", "starting API server", "starting API server"]


def test_vllms_own_aot_cache_failure_is_recognised_in_real_logs() -> None:
    from supervisor.decide.startup import aot_cache_failure

    log = (FIXTURES / "cpu-vllm0.32-startup-kv-too-small.log").read_text()
    reasons = {r for line in log.splitlines() if (r := aot_cache_failure(line))}
    assert reasons == {"'function' object has no attribute 'finalize_loading'"}
    healthy = (FIXTURES / "h200-vllm0.26-startup-ok.log").read_text()
    assert not [line for line in healthy.splitlines() if aot_cache_failure(line)]


async def test_a_two_device_engine_is_gated_on_both_and_the_evidence_names_the_short_one(
        tmp_path: Path) -> None:
    """Issue 19: a tensor-parallel engine's gate covers every device it uses and names the one that was short."""
    arb, host, _ = make(tmp_path, profile={"gpu_memory_utilization": 0.5},
                        engine={"env": {"CUDA_VISIBLE_DEVICES": "0,1"}, "args": {"tensor_parallel_size": 2}})
    seen: list[Any] = []
    arb.bus.subscribe("test", type("Rec", (), {"on_event": lambda self, e: seen.append(e)})())
    host.short = [DeviceSnapshot(1, 140 * GIB, 60 * GIB, 80 * GIB, ((4242, 79 * GIB),))]  # GPU 1 has less
    run = asyncio.create_task(arb.run())
    child = await host.spawned.get()
    await until(lambda: arb.lifecycle.state.value == "READY", "READY")
    assert host.gate_devices == [[0, 1]]
    assert child.argv[child.argv.index("--gpu-memory-utilization") + 1] == "0.41"  # (60 - 1) / 140 on GPU 1
    await arb.bus.drain()
    (adapted,) = [e for e in seen if e.name == "gpu.utilization_adapted"]
    assert adapted.evidence.startswith("GPU 1:") and "pid 4242" in adapted.evidence
    arb.lifecycle.request_stop("test")
    assert await run == ExitCode.OK
