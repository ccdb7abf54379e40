"""The supervisor's own footprint while the engine is READY and idle (real vLLM CPU, tiny model).

Prints the supervisor's RSS and its CPU share over a window with a 1 s probe interval (the goal is
<= 1 % of a core), and, side by side on the engine's real /metrics text, the cost of the probe's
line scan against a full Prometheus parse (what the probe used before). Never gates CI.
"""

from __future__ import annotations

import argparse
import time
import urllib.request

import psutil
from prometheus_client.parser import text_string_to_metric_families
from supervisor.host.vllm_http import RUNNING, TOKENS, WAITING, parse_progress

from common import Supervisor, real_vllm_toml, wait_ready

EXTRA = """
[health]
probe_interval_s = 1.0
"""


def full_parse(text: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in TOKENS or s.name in (RUNNING, WAITING):
                total += s.value
    return total


def per_call_us(fn: object, text: str, n: int = 300) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn(text)  # type: ignore[operator]
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--model", default=".cache/tiny-llama")
    ap.add_argument("--window", type=float, default=60.0, help="seconds of idle measured")
    a = ap.parse_args()
    sup = Supervisor(real_vllm_toml(a.model, a.vllm_python, EXTRA))
    try:
        wait_ready(sup.admin, 0, 600)
        proc = psutil.Process(sup.proc.pid)
        time.sleep(5.0)  # let the warm-up's garbage settle
        c0, t0 = proc.cpu_times(), time.monotonic()
        time.sleep(a.window)
        c1, t1 = proc.cpu_times(), time.monotonic()
        cpu = (c1.user + c1.system - c0.user - c0.system) / (t1 - t0) * 100
        mem = proc.memory_full_info()
        with urllib.request.urlopen(f"http://127.0.0.1:{sup.port}/metrics", timeout=5) as r:
            metrics = r.read().decode()
    finally:
        sup.stop()
    print(f"supervisor idle after READY (probe every 1 s, canary every 30 s), window {a.window:.0f} s")
    print(f"  CPU      {cpu:5.2f} % of one core   (goal <= 1 %)")
    print(f"  RSS      {mem.rss / 2**20:5.1f} MiB   (USS {mem.uss / 2**20:.1f} MiB)")
    line, full = per_call_us(parse_progress, metrics), per_call_us(full_parse, metrics)
    print(f"probe parse of the engine's /metrics ({len(metrics.splitlines())} lines): line scan {line:.0f} us, "
          f"full Prometheus parse {full:.0f} us, ratio {full / line:.1f}x")
    p = parse_progress(metrics)
    print(f"  both read the same: {p.running + p.waiting + p.tokens == full_parse(metrics)}")


if __name__ == "__main__":
    main()
