"""Real vLLM (CPU): cold start vs recovery after a real out-of-memory death, side by side.

Cold start = spawn -> READY of the first engine. Recovery = death detected -> READY again after a
real allocation failure (prlimit on the worker + prompt_logprobs). Own share = recovery minus the
new engine's own start and warm-up. Goal: recovery <= 1.1x cold start; own share <= 1 s.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

from common import OOM_LADDER, Supervisor, cap_worker, real_vllm_toml, wait_ready


def inject_oom(engine_pid: int, port: int) -> None:
    cap_worker(engine_pid)
    body = json.dumps({"model": "tiny-llama", "prompt": "word " * 3000, "max_tokens": 2,
                       "prompt_logprobs": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=120)
    except urllib.error.HTTPError as e:
        assert e.code == 500, e.code


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--model", default=".cache/tiny-llama")
    ap.add_argument("--ooms", type=int, default=2)
    a = ap.parse_args()
    toml = real_vllm_toml(a.model, a.vllm_python, OOM_LADDER)
    sup = Supervisor(toml)
    rows = []
    try:
        st = wait_ready(sup.admin, 0, 900)
        cold = st["timings"]["start_to_ready_s"]
        phases = [("cold start", st["timings"].get("phases", {}))]
        for i in range(a.ooms):
            inject_oom(st["engine_pid"], sup.port)
            st = wait_ready(sup.admin, i + 1, 900)
            lf = st["last_failure"]
            assert lf["kind"] == "runtime_oom", lf
            rows.append((lf["recovered_after_s"], st["timings"]["start_to_ready_s"], st["profile"]))
            phases.append((f"recovery {i + 1}", st["timings"].get("phases", {})))
            time.sleep(0.5)
    finally:
        sup.stop()
    print("real vLLM CPU, tiny model; times in seconds")
    print(f"cold start (spawn -> READY)          {cold:8.2f}")
    for i, (rec, eng, prof) in enumerate(rows, 1):
        print(f"OOM {i}: recovery (detected -> READY) {rec:8.2f}   ratio to cold start {rec / cold:5.2f}x"
              f"   own share {rec - eng:6.3f}   engine's own start+warm-up {eng:6.2f}"
              f"   chunk now {prof['max_num_batched_tokens']}")
    names = list(dict.fromkeys(k for _, p in phases for k in p))
    print("\nwhere each start's time went (seconds; vLLM's own log lines):")
    print(f"{'phase':<26}" + "".join(f"{label:>14}" for label, _ in phases))
    for n in names:
        print(f"{n:<26}" + "".join(f"{p.get(n, 0.0):14.2f}" for _, p in phases))
    ratios = sorted(rec / cold for rec, _, _ in rows)
    shares = sorted(rec - eng for rec, eng, _ in rows)
    print(f"median: recovery / cold start {ratios[len(ratios) // 2]:.2f}x (goal <= 1.1x), "
          f"own share {shares[len(shares) // 2]:.3f}s (goal <= 1 s)")


if __name__ == "__main__":
    main()
