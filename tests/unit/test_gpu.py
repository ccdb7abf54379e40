"""NVML never crashes the supervisor: a fake pynvml module raising what the real one raises."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from supervisor.host.gpu import DeviceSnapshot, GpuLost, Nvml, wait_free, wait_released


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    """pynvml's surface as the supervisor uses it; ``fail`` makes every device call raise that NVML code."""

    NVMLError = NVMLError

    def __init__(self, fail: int | None = None, init_fails: bool = False) -> None:
        self.fail, self.init_fails = fail, init_fails

    def nvmlInit(self) -> None:
        if self.init_fails:
            raise NVMLError(9)  # driver not loaded

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def _check(self) -> None:
        if self.fail is not None:
            raise NVMLError(self.fail)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self._check()
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        return 1

    def nvmlDeviceGetIndex(self, h: int) -> int:
        return h

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        self._check()
        return SimpleNamespace(total=100, free=60 - 10 * h, used=40 + 10 * h)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [SimpleNamespace(pid=4242, usedGpuMemory=30)]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[Any]:
        raise NVMLError(3)  # not supported: ignored

    def nvmlShutdown(self) -> None:
        pass


def test_a_snapshot_by_index_and_by_uuid() -> None:
    nv = Nvml(FakeNvml())
    assert [(s.index, s.free, s.processes) for s in nv.snapshot()] == [(0, 60, ((4242, 30),)), (1, 50, ((4242, 30),))]
    assert [s.index for s in nv.snapshot(["GPU-8a2c"])] == [1]


def test_no_driver_means_no_gpu_view() -> None:
    nv = Nvml(FakeNvml(init_fails=True))
    assert not nv.available and nv.snapshot() == []


def test_a_lost_gpu_raises_gpulost_with_evidence() -> None:
    with pytest.raises(GpuLost, match="fallen off the bus"):
        Nvml(FakeNvml(fail=15)).snapshot()


def test_any_other_nvml_error_is_no_view_not_a_crash() -> None:
    assert Nvml(FakeNvml(fail=999)).snapshot() == []


async def test_waits_run_nvml_off_the_loop_and_report_what_is_held() -> None:
    nv = Nvml(FakeNvml())
    assert await wait_released(nv, [4242], timeout_s=0.05, poll_s=0.01) == {4242: 60}
    assert await wait_released(nv, [1], timeout_s=0.05) == {}
    assert [s.index for s in await wait_free(nv, None, 0.55, 0, timeout_s=0.05, poll_s=0.01)] == [1]
    with pytest.raises(GpuLost):
        await wait_free(Nvml(FakeNvml(fail=15)), None, 0.5, 0, timeout_s=0.05)


async def test_a_killed_engines_release_is_seen_within_tens_of_milliseconds_not_a_poll_later() -> None:
    """Issue 38, item 5: a failover waits for the dead engine's memory; with one read every 0.25 s a release that took
    less was seen 0.252 s after the kill on the H200. The reads come fast at first (``poll_delays``)."""
    import time
    from itertools import islice, pairwise

    from supervisor.host.gpu import poll_delays

    class Releasing(FakeNvml):
        def __init__(self, after_s: float) -> None:
            super().__init__()
            self.gone_at = time.monotonic() + after_s

        def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
            return [] if time.monotonic() >= self.gone_at else super().nvmlDeviceGetComputeRunningProcesses(h)

    t0 = time.monotonic()
    assert await wait_released(Nvml(Releasing(0.05)), [4242], timeout_s=5.0) == {}
    assert time.monotonic() - t0 < 0.15
    delays = list(islice(poll_delays(0.25), 14))
    assert delays[0] == 0.01 and delays[-1] == 0.25 and all(a <= b for a, b in pairwise(delays))
    assert sum(delays[:9]) < 0.75  # about nine reads in the first 0.7 s, then one per poll_s


class ScriptedNvml:
    """``Nvml``'s surface with a script of free bytes (one device of 100 GiB), one value per snapshot."""

    available = True

    def __init__(self, frees: list[int], seen: dict[int, tuple[float, int]] | None = None) -> None:
        self.frees, self.calls = frees, 0
        self.seen = seen or {}

    def snapshot(self, devices: Any = None) -> list[Any]:
        from supervisor.host.gpu import DeviceSnapshot

        free = self.frees[min(self.calls, len(self.frees) - 1)]
        self.calls += 1
        return [DeviceSnapshot(0, 100 * GIB, free, 100 * GIB - free, ((777, 100 * GIB - free),))]


GIB = 2**30
MIB = 2**20


async def test_the_start_gate_waits_only_while_memory_is_being_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17: the gate waited its whole free_wait_s (120 s) for memory another process held steady."""
    from supervisor.host import gpu

    monkeypatch.setattr(gpu, "STEADY_S", 0.2)
    # Held steady at 40 GiB free (50 are needed): not waited for beyond the steady window.
    steady = ScriptedNvml([40 * GIB])
    short = await wait_free(steady, None, 0.5, 0, timeout_s=60.0, poll_s=0.02)  # type: ignore[arg-type]
    assert short and short[0].free == 40 * GIB and steady.calls < 30
    # Being released (a GiB a poll, then enough): waited for, and not short in the end.
    releasing = ScriptedNvml([(30 + i) * GIB for i in range(25)])
    assert await wait_free(releasing, None, 0.5, 0, timeout_s=60.0, poll_s=0.02) == []  # type: ignore[arg-type]
    assert releasing.calls == 21  # 50 GiB free at the 21st look
    # A release that is too slow still ends at the timeout, short.
    slow = ScriptedNvml([(30 + i) * GIB for i in range(1000)])
    assert await wait_free(slow, None, 0.9, 0, timeout_s=0.3, poll_s=0.02)  # type: ignore[arg-type]


async def test_a_card_already_seen_steady_before_the_restart_is_not_watched_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU was read as the old engine stopped; the backoff since was as long as the steady window: a card
    that has not grown since starts at once (on the H200, 1 s of each recovery beside another process)."""
    import time

    from supervisor.host import gpu

    monkeypatch.setattr(gpu, "STEADY_S", 0.5)
    now = time.monotonic()
    seen_long_enough = ScriptedNvml([40 * GIB], seen={0: (now - 0.6, 40 * GIB)})
    t0 = time.monotonic()
    short = await wait_free(seen_long_enough, None, 0.5, 0, timeout_s=60.0, poll_s=0.02)  # type: ignore[arg-type]
    assert short and seen_long_enough.calls == 1 and time.monotonic() - t0 < 0.2
    # Read only just now: the rest of the window is watched.
    just_seen = ScriptedNvml([40 * GIB], seen={0: (time.monotonic() - 0.1, 40 * GIB)})
    t0 = time.monotonic()
    assert await wait_free(just_seen, None, 0.5, 0, timeout_s=60.0, poll_s=0.02)  # type: ignore[arg-type]
    assert 0.3 < time.monotonic() - t0 < 1.5
    # Grown by a GiB since it was read (a release under way): the whole window from now.
    grown = ScriptedNvml([40 * GIB], seen={0: (time.monotonic() - 5.0, 39 * GIB)})
    t0 = time.monotonic()
    assert await wait_free(grown, None, 0.5, 0, timeout_s=60.0, poll_s=0.02)  # type: ignore[arg-type]
    assert time.monotonic() - t0 >= 0.5


async def test_memory_held_by_another_live_process_is_steady_at_the_second_read_that_did_not_grow(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure's first restart has no backoff: the start watched the seed's other process for the whole steady
    window, 1.0 s of a 13 s restart on the H100. Held by others alive (proctree.held_by_outsiders), the second read
    that did not grow ends the wait; held by ours, or growing, the window is watched as before."""
    import time

    from supervisor.host import gpu

    monkeypatch.setattr(gpu, "STEADY_S", 0.5)
    asked: list[set[int]] = []

    def others(pids: Any) -> bool:
        asked.append(set(pids))
        return True

    held = ScriptedNvml([40 * GIB])
    t0 = time.monotonic()
    short = await wait_free(held, None, 0.5, 0, timeout_s=60.0, poll_s=0.02,  # type: ignore[arg-type]
                            outsiders=others)
    assert short and held.calls == 2 and time.monotonic() - t0 < 0.2
    assert asked == [{777}]  # the short device's holders, asked once the second read did not grow
    # Ours (a spare, a throwaway being stopped) or not known: the whole window, as before.
    ours = ScriptedNvml([40 * GIB])
    t0 = time.monotonic()
    assert await wait_free(ours, None, 0.5, 0, timeout_s=60.0, poll_s=0.02,  # type: ignore[arg-type]
                           outsiders=lambda pids: False)
    assert time.monotonic() - t0 >= 0.5
    # Still growing (an exiting process letting go), whoever holds it: waited for until it fits.
    releasing = ScriptedNvml([(30 + i) * GIB for i in range(25)])
    assert await wait_free(releasing, None, 0.5, 0, timeout_s=60.0, poll_s=0.02,  # type: ignore[arg-type]
                           outsiders=others) == []
    assert releasing.calls == 21


def test_only_live_processes_of_others_hold_the_card_steadily(tmp_path: Any) -> None:
    """proctree.held_by_outsiders, against real processes: another's process (its session's leader alive or gone:
    CI's harness may have left its own), the supervisor's own child, an orphan of an engine session the supervisor
    started whose leader was killed, a dead PID, and nobody."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil
    from supervisor.host.proctree import held_by_outsiders

    def orphan_in_new_session(name: str) -> tuple[int, int]:
        """A sleeper in a new session led by a shell, orphaned from us at once (its parent shell exits)."""
        pidfile = tmp_path / name
        subprocess.run(["sh", "-c", f"setsid sh -c 'sleep 60 >/dev/null 2>&1 & echo $! > {pidfile}.tmp; "
                        f"mv {pidfile}.tmp {pidfile}; wait' >/dev/null 2>&1 &"], check=True)
        deadline = time.monotonic() + 10
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = int(pidfile.read_text())
        return pid, os.getsid(pid)

    def kill_leader(sid: int, member: int) -> None:
        os.kill(sid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(sid) and psutil.Process(sid).status() != psutil.STATUS_ZOMBIE \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert psutil.Process(member).is_running()

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    other, other_sid = orphan_in_new_session("other.pid")
    engine, engine_sid = orphan_in_new_session("engine.pid")  # as an EngineCore in the session of an engine
    ours = {child.pid, engine_sid}
    try:
        assert os.getpid() not in [a.pid for a in psutil.Process(other_sid).parents()]  # not ours: the test holds
        assert held_by_outsiders({other}, ours)
        assert not held_by_outsiders({child.pid}, ours)  # ours: it may be on its way out
        assert not held_by_outsiders({other, child.pid}, ours)
        assert not held_by_outsiders(set(), ours)  # NVML saw no PIDs: not known
        gone = subprocess.Popen(["true"])
        gone.wait()
        assert not held_by_outsiders({gone.pid}, ours)
        kill_leader(other_sid, other)  # another's session whose leader is gone: still another's
        assert held_by_outsiders({other}, ours)
        kill_leader(engine_sid, engine)  # an engine's API server killed: its orphaned EngineCore may be going too
        assert not held_by_outsiders({engine}, ours)
        assert held_by_outsiders({engine}, {child.pid})  # the same process, were its session not one we started
    finally:
        child.kill()
        child.wait()
        for pid in (other, engine):
            os.kill(pid, signal.SIGKILL)


def test_the_nvml_adapter_remembers_what_it_last_read_of_each_device() -> None:
    nv = Nvml(FakeNvml())
    snaps = nv.snapshot()
    assert snaps and {i: free for i, (_, free) in nv.seen.items()} == {s.index: s.free for s in snaps}


def test_precompile_auto_on_a_gpu_compiles_ahead_only_when_half_the_free_memory_holds_a_throwaway(
        tmp_path: Any) -> None:
    """Issue 17: "auto" was off on every GPU host, so a new rung compiled on the recovery's critical path."""

    from supervisor.host.files import weights_on_disk
    from supervisor.host.gpu import DeviceSnapshot
    from supervisor.profile import Profile
    from supervisor.recovery.sizing import room_for_throwaway, second_engine_bytes

    model = glm9b_dir(tmp_path)
    with open(model / "pytorch_model.bin", "wb") as f:
        f.truncate(18 * GIB)  # a second copy in another format: vLLM loads one of them
    assert weights_on_disk(str(model)) == 18 * GIB
    rung = Profile(max_num_batched_tokens=6144)
    beside = [DeviceSnapshot(0, 140 * GIB, 70 * GIB, 70 * GIB, ())]  # the engine at 0.5 holds the other half
    size = second_engine_bytes(str(model), rung)
    ok, why = room_for_throwaway(beside, size)
    assert ok and "holds a throwaway" in why
    crowded = [DeviceSnapshot(0, 140 * GIB, 30 * GIB, 110 * GIB, ())]
    ok, why = room_for_throwaway(crowded, size)
    assert not ok and "weights 18.0 GiB" in why
    ok, why = room_for_throwaway(beside, second_engine_bytes("org/hub-model", rung))
    assert not ok and "not a local directory" in why
    # Tensor-parallel over two cards: each rank's throwaway holds half the weights, and every card must have room.
    two = [DeviceSnapshot(0, 140 * GIB, 30 * GIB, 110 * GIB, ()), DeviceSnapshot(1, 140 * GIB, 70 * GIB, 70 * GIB, ())]
    per_rank = second_engine_bytes(str(model), rung, ranks=2)
    assert room_for_throwaway(two, per_rank, ranks=2)[0]  # 9 GiB a rank fits in half of 30
    assert not room_for_throwaway([DeviceSnapshot(0, 140 * GIB, 20 * GIB, 120 * GIB, ()), two[1]], per_rank,
                                  ranks=2)[0]


def test_spare_auto_needs_the_weights_in_host_memory_and_a_second_engine_beside_the_first(tmp_path: Any) -> None:
    """The rule "auto" keeps a spare by (recovery/sizing.py room_for_spare), and what a spare needs to wake."""

    from supervisor.host.gpu import DeviceSnapshot
    from supervisor.profile import Profile
    from supervisor.recovery.sizing import room_for_spare, second_engine_bytes
    from supervisor.recovery.spare import Spare

    model = glm9b_dir(tmp_path)
    rung = Profile(max_num_batched_tokens=6144, gpu_memory_utilization=0.5)
    size = second_engine_bytes(str(model), rung)
    beside = [DeviceSnapshot(0, 140 * GIB, 70 * GIB, 70 * GIB, ())]  # the engine at 0.5 holds the other half
    util, why = room_for_spare(beside, size, rung, GIB, 0.3, 100 * GIB)
    assert util == 0.48 and "holds a spare" in why  # what fits beside it, 1 GiB of headroom kept
    assert room_for_spare(beside, size, rung.with_(gpu_memory_utilization=0.3), GIB, 0.2, 100 * GIB)[0] \
        == 0.3  # never above the rung's own
    util, why = room_for_spare(beside, size, rung, GIB, 0.3, 19 * GIB)
    assert util is None and "18.0 GiB of weights" in why  # asleep, the weights live in host memory
    crowded = [DeviceSnapshot(0, 140 * GIB, 30 * GIB, 110 * GIB, ())]
    util, why = room_for_spare(crowded, size, rung, GIB, 0.3, 100 * GIB)
    assert util is None and "at least 0.3" in why
    assert room_for_spare(beside, second_engine_bytes("org/hub-model", rung), rung, GIB, 0.3, 100 * GIB)[0] is None

    unused: Any = None  # no process behind it: only its rung and its memory are asked
    spare = Spare(child=unused, profile=rung.with_(gpu_memory_utilization=0.48), url="http://127.0.0.1:1",
                  work=tmp_path, tail=unused, drains=[], client=unused, host=unused, state_dir=str(tmp_path),
                  awake={0: 66 * GIB}, asleep={0: 2 * GIB})
    assert spare.serves(rung) and not spare.serves(rung.with_(gpu_memory_utilization=0.4))
    assert not spare.serves(rung.with_(max_num_batched_tokens=8192))
    assert spare.short_to_wake([DeviceSnapshot(0, 140 * GIB, 70 * GIB, 70 * GIB, ())], GIB) is None
    short = spare.short_to_wake([DeviceSnapshot(0, 140 * GIB, 60 * GIB, 80 * GIB, ())], GIB)
    assert short is not None and "needs 64.00 GiB back" in short
    # A sleeping footprint that grew past FOOTPRINT_GROWTH on a device, and by how much.
    assert spare.growth({0: 2 * GIB + 64 * MIB}) is None
    grown = spare.growth({0: 3 * GIB})
    assert grown == "GPU 0: +1024 MiB over the 2048 MiB it kept asleep", grown


def test_a_second_engine_is_outdated_by_a_reload_of_what_makes_the_engine_not_of_its_timeouts(tmp_path: Any) -> None:
    from dataclasses import replace

    from supervisor.config import EngineConfig
    from supervisor.profile import Profile
    from supervisor.recovery.spare import Spare, outdated

    built = EngineConfig(model="/m", command=("python3", "-m", "vllm"), env={"A": "1"}, args={"dtype": "bfloat16"})
    unused: Any = None
    spare = Spare(child=unused, profile=Profile(max_num_batched_tokens=6144), url="http://127.0.0.1:1", work=tmp_path,
                  tail=unused, drains=[], client=unused, host=unused, state_dir=str(tmp_path), engine=built)
    cases = [
        (built, None),
        (replace(built, stop_timeout_s=5.0, dead_grace_s=9.0, start_timeout_s=60.0), None),  # the supervisor's own
        (replace(built, port=19000), None),  # a second engine listens on a port of its own anyway
        (replace(built, model="/other"), "a reload changed [engine] model since it was built"),
        (replace(built, env={"A": "2"}), "a reload changed [engine] env since it was built"),
        (replace(built, args={"dtype": "float16"}, command=("vllm", "serve")),
         "a reload changed [engine] command, args since it was built"),
    ]
    for now, why in cases:
        assert outdated(spare, now) == why, now
    assert outdated(replace(spare, engine=None), replace(built, model="/other")) is None  # no record: not judged


def glm9b_dir(tmp_path: Any) -> Any:
    """A local model directory of the GLM-4-9B shape: its config.json and 18 GiB of (sparse) safetensors."""
    import json

    model = tmp_path / "glm9b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 40, "hidden_size": 4096,
                                                   "intermediate_size": 13696, "num_attention_heads": 32,
                                                   "num_key_value_heads": 2, "torch_dtype": "bfloat16"}))
    with open(model / "model-00001.safetensors", "wb") as f:
        f.truncate(18 * GIB)  # sparse: its size is what vLLM would load
    return model


@pytest.mark.parametrize(("free_gib", "total_gib", "util", "want"), [
    (139.8, 139.8, 0.9, "first"),  # the H200 at vLLM's default: 12.8 GiB beside, the spare needs ~21
    (139.8, 139.8, 0.5, "beside"),  # today's case: room beside
    (42.4, 80.0, 0.4, "first"),  # the field report's A800: another process holds 47 % from before the start
    (25.0, 80.0, 0.4, None),  # neither: the engine alone barely fits
])
def test_the_spare_is_built_beside_when_it_fits_else_first_else_not_at_all(
        free_gib: float, total_gib: float, util: float, want: str | None) -> None:
    """Issue 27, item 1: the order from NVML's numbers and the rung's needs (the 9B shape: ~21 GiB)."""
    from supervisor.recovery.sizing import choose_order

    snaps = [DeviceSnapshot(0, int(total_gib * GIB), int(free_gib * GIB), int((total_gib - free_gib) * GIB), ())]
    order = choose_order(snaps, util, 21 * GIB, 0.3, GIB)
    assert order.order == want, order.why
    if want == "first":
        # At the engine's own utilization (what the dead engine frees is what it wakes into), and the engine fits
        # beside its sleeping footprint.
        assert order.spare_util == util and free_gib * GIB - 2.5 * GIB - GIB >= util * total_gib * GIB
    assert choose_order(snaps, util, 21 * GIB, 0.3, GIB, mode="beside").order in ("beside", None)
    assert choose_order(snaps, util, 21 * GIB, 0.3, GIB, mode="first").order in ("first", None)


@pytest.mark.parametrize(("free_gib", "total_gib", "util", "cpus", "want"), [
    (139.8, 139.8, 0.9, 16, ("first", 4)),  # the H200 at vLLM's default: 12.8 GiB beside; 16 cores compile 4
    (139.8, 139.8, 0.5, 16, ("beside", 0)),  # half of the 68 GiB beside holds one
    (42.4, 80.0, 0.4, 16, ("first", 1)),  # the field report's A800, shared: the free card holds one at a time
    (139.8, 139.8, 0.9, 2, ("first", 2)),  # two at once overlap their GPU work even on two cores
    (20.0, 80.0, 0.2, 16, (None, 0)),  # neither: no throwaway fits even on the free card
])
def test_the_rungs_are_compiled_beside_the_engine_when_one_fits_else_first_several_at_once(
        free_gib: float, total_gib: float, util: float, cpus: int, want: tuple[str | None, int]) -> None:
    """Issue 27, item 2: a throwaway of the 9B shape (~21 GiB with its prefill, plus one 128k sequence's KV
    cache, 5.3 GiB) is compiled beside the engine where it fits, else before the engine, as many at once as the
    free card holds and the cores compile."""
    from supervisor.recovery.sizing import plan_first

    snaps = [DeviceSnapshot(0, int(total_gib * GIB), int(free_gib * GIB), int((total_gib - free_gib) * GIB), ())]
    plan = plan_first(snaps, 21 * GIB, int(5.3 * GIB), util, GIB, "auto", cpus)
    assert (plan.order, plan.at_once) == want, plan.why
    if plan.order == "first":
        # Each asks vLLM's start check for no more than its share, so the last to start still passes it.
        assert plan.at_once * plan.util * total_gib <= free_gib - 1 and plan.util * total_gib * GIB >= 26.3 * GIB
    assert plan_first(snaps, 21 * GIB, int(5.3 * GIB), util, GIB, "first", cpus).order in ("first", None)


def test_one_sequence_kv_is_what_vllm_needs_to_start_at_the_rungs_max_model_len(tmp_path: Any) -> None:
    from supervisor.profile import Profile
    from supervisor.recovery.sizing import KV_BLOCK_SLACK, one_sequence_kv

    model = glm9b_dir(tmp_path)
    per_token = 2 * 40 * 2 * 128 * 2  # K and V, 40 layers, 2 KV heads of 128, bf16
    assert one_sequence_kv(str(model), Profile(max_model_len=131072)) == per_token * 131072 + KV_BLOCK_SLACK
    assert one_sequence_kv(str(model), Profile(max_model_len=131072), ranks=2) == per_token * 65536 + KV_BLOCK_SLACK
    assert one_sequence_kv(str(tmp_path / "nowhere"), Profile()) is None


def test_a_spares_weights_are_read_from_vllms_sleep_line_and_woken_first_where_only_they_fit(tmp_path: Any) -> None:
    """Issue 38, item 5: beside a dead engine at 0.5 on the H200 the whole spare (66 GiB) did not fit until that
    engine's memory was released, so its wake (0.69 s) came after the stop; its weights (17.6 GiB) did."""
    from pathlib import Path

    from supervisor.host.gpu import DeviceSnapshot
    from supervisor.profile import Profile
    from supervisor.recovery.spare import Spare, offloaded_bytes

    real = Path(__file__).parents[1] / "fixtures" / "vllm-logs" / "h200-vllm0.26-spare-sleep-wake.log"
    weights = offloaded_bytes(real.read_text().splitlines())
    assert weights == int(17.59 * GIB), weights  # "of which 17.58 GiB is backed up in CPU", rounded up
    assert offloaded_bytes(["(APIServer pid=1) INFO: POST /sleep?level=1 HTTP/1.1 200 OK"]) is None
    later = ["CuMemAllocator: sleep freed 61.49 GiB memory in total, of which 17.58 GiB is backed up in CPU",
             "CuMemAllocator: sleep freed 50.00 GiB memory in total, of which 8.00 GiB is backed up in CPU"]
    assert offloaded_bytes(later) == int(8.01 * GIB)  # the last sleep's

    unused: Any = None
    child: Any = SimpleNamespace(pid=4242)
    spare = Spare(child=child, profile=Profile(max_num_batched_tokens=6144, gpu_memory_utilization=0.47),
                  url="http://127.0.0.1:1", work=tmp_path, tail=unused, drains=[], client=unused, host=unused,
                  state_dir=str(tmp_path), awake={0: 68 * GIB}, asleep={0: 2 * GIB})
    beside_dead = [DeviceSnapshot(0, 140 * GIB, 66 * GIB, 74 * GIB, ())]  # the dead engine's 70 GiB still held
    released = [DeviceSnapshot(0, 140 * GIB, 138 * GIB - weights, 2 * GIB + weights, ())]
    assert spare.short_to_wake(beside_dead, GIB) is not None  # 66 GiB + 1 GiB headroom > 66 GiB free
    why = spare.short_for_weights(beside_dead, GIB)
    assert why is not None and "not known" in why  # no sleep line read: it wakes in one part, after the stop
    spare.weights = weights
    assert spare.short_for_weights(beside_dead, GIB) is None
    assert spare.status()["state"] == "asleep"
    short = spare.short_for_weights([DeviceSnapshot(0, 140 * GIB, 18 * GIB, 122 * GIB, ())], GIB)
    assert short is not None and "its weights need 17.59 GiB" in short  # the field report's shared card: not even they
    # Woken, its weights are no longer what the rest of its wake needs: 66 - 17.59 GiB, once the dead engine's is free.
    spare.weights_back_s = 0.55
    assert spare.weights_woken
    assert spare.status()["state"] == "weights awake"  # /status: not "asleep" between its two wakes
    short = spare.short_to_wake([DeviceSnapshot(0, 140 * GIB, 40 * GIB, 100 * GIB, ())], GIB)
    assert short is not None and "needs 48.41 GiB back" in short, short
    assert spare.short_to_wake(released, GIB) is None
