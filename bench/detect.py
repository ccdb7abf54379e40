"""Kill the engine N times; print p50/p99 of death->detected and the supervisor's own share of recovery.

Uses the stand-in engine (tests/helpers/fake_vllm.py) so that 50 recoveries take a minute, alternating
SIGKILL of the API server (seen as a process exit) and of the EngineCore (seen on IPC/logs).
Own share = detected->READY minus the engine's own start and warm-up (backoff set to 0).
Goal: p99 detection <= 100 ms; own share <= 1 s. Never gates CI.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from common import Supervisor, engine_tree, here, pct, wait_ready

TOML = """
[engine]
model = "fake-model"
port = {{port}}
command = ["{}", "{}"]
stop_timeout_s = 5.0
[restart]
max_restarts = 1000
window_s = 60.0
backoff_initial_s = 0.0
backoff_max_s = 0.0
[health]
probe_interval_s = 0.5
[warmup]
max_tokens = 2
""".format(sys.executable, here().parent / "tests" / "helpers" / "fake_vllm.py")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=50)
    n = ap.parse_args().kills
    sup = Supervisor(TOML)
    detect: list[float] = []
    share: list[float] = []
    engine_start: list[float] = []
    try:
        st = wait_ready(sup.admin, 0, 60)
        for i in range(n):
            procs = engine_tree(st["engine_pid"])
            victim = procs[0] if i % 2 == 0 else procs[-1]
            t_kill = time.time()
            os.kill(victim.pid, signal.SIGKILL)
            st = wait_ready(sup.admin, i + 1, 60)
            lf = st["last_failure"]
            detect.append(lf["detected_at"] - t_kill)
            engine_start.append(st["timings"]["start_to_ready_s"])
            share.append(lf["recovered_after_s"] - st["timings"]["start_to_ready_s"])
    finally:
        sup.stop()
    print(f"engine killed {n} times (alternating API server / EngineCore SIGKILL), stand-in engine")
    print(f"death -> detected     p50 {pct(detect, 50) * 1000:7.1f} ms   p99 {pct(detect, 99) * 1000:7.1f} ms"
          f"   (goal p99 <= 100 ms)")
    print(f"supervisor own share  p50 {pct(share, 50) * 1000:7.1f} ms   p99 {pct(share, 99) * 1000:7.1f} ms"
          f"   (goal <= 1000 ms)")
    print(f"engine start+warm-up  p50 {pct(engine_start, 50) * 1000:7.1f} ms   (not the supervisor's)")
    print(f"own share / engine start+warm-up (p50): {pct(share, 50) / pct(engine_start, 50):.3f}")


if __name__ == "__main__":
    main()
