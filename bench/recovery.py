"""Real vLLM (CPU): a warm-cache cold start vs recovery after a real out-of-memory death, side by side.

Each arm gets a fresh compile cache (VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR), warmed by one
start at the configured rung and nothing else, so the rung the OOM steps down to was never used
before. Then a supervisor starts from that warm cache (the baseline cold start: spawn -> READY),
stays idle for a realistic while, and a real allocation failure (prlimit on the worker +
prompt_logprobs) kills its engine. Recovery = death detected -> READY at the lower rung.

  plain:     [recovery] standby = false, precompile = "off"  (every supervisor's restart: a cold start)
  prepared:  [recovery] standby = true,  precompile = "on"   (the standby and the precompiled rung; since issue 38
             the restart runs vLLM without torch.compile, uncompiled_restart = "auto")
  compiled:  prepared with uncompiled_restart = "off" (the restart loads the precompiled rung from the cache)

Goal: prepared recovery <= 0.8x the warm-cache cold start (stretch 0.5x).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from common import OOM_LADDER, Supervisor, cap_worker, real_vllm_toml, status, wait_ready

ARMS = {
    "plain": '[recovery]\nstandby = false\nprecompile = "off"\n',
    "prepared": '[recovery]\nstandby = true\nprecompile = "on"\nprecompile_idle_s = {idle}\n',
    "compiled": '[recovery]\nstandby = true\nprecompile = "on"\nprecompile_idle_s = {idle}\n'
                'uncompiled_restart = "off"\n',
}


def oom(sup: Supervisor, engine_pid: int) -> None:
    """A real OOM: the worker's address space capped, then a prompt_logprobs request too big for it."""
    cap_worker(engine_pid)
    body = json.dumps({"model": "tiny-llama", "prompt": "word " * 3000, "max_tokens": 2,
                       "prompt_logprobs": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{sup.port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=300)
    except (urllib.error.HTTPError, urllib.error.URLError, OSError):
        pass  # a 500, or the connection dropped as the engine died


def warm_cache(toml: str) -> None:
    """One start at the configured rung, then stop: the cache holds that rung and no other."""
    sup = Supervisor(toml + ARMS["plain"])
    try:
        wait_ready(sup.admin, 0, 900)
    finally:
        sup.stop()


def wait_prepared(sup: Supervisor, idle_s: float, timeout: float = 600) -> float:
    """Idle until the standby has imported and the precompile ended (at least ``idle_s``); seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = status(sup.admin) or {}
        nxt = st.get("next_start", {})
        done = sup.events("engine.rung_precompiled")
        if time.monotonic() - t0 >= idle_s and done and not nxt.get("precompiling") \
                and (nxt.get("standby") or {}).get("imported_s") is not None:
            if not done[0]["ok"]:
                raise SystemExit(f"precompile failed: {done[0]['error']}")
            return time.monotonic() - t0
        time.sleep(0.5)
    raise SystemExit("the standby and the precompile were not ready in time")


def arm(name: str, model: str, python: str, idle_s: float) -> dict[str, Any]:
    cache = Path(tempfile.mkdtemp(prefix=f"vsup-cache-{name}-"))
    env = {"VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    toml = real_vllm_toml(model, python, OOM_LADDER, env)
    try:
        warm_cache(toml)
        sup = Supervisor(toml + ARMS[name].format(idle=max(1.0, idle_s / 3)))
        try:
            st = wait_ready(sup.admin, 0, 900)
            cold = st["timings"]
            if name != "plain":
                waited = wait_prepared(sup, idle_s)
            else:
                time.sleep(waited := idle_s)
            oom(sup, st["engine_pid"])
            st = wait_ready(sup.admin, 1, 900)
            lf = st["last_failure"]
            assert lf["kind"] == "runtime_oom", lf
            spawned = sup.events("engine.spawned")
            return {"cold": cold, "recovered_after_s": lf["recovered_after_s"], "rec": st["timings"],
                    "idle_s": waited, "rung": st["profile"]["max_num_batched_tokens"],
                    "standby": bool(spawned[-1].get("standby")), "compiled": st["compile"]["compiled"],
                    "precompiled": [e["took_s"] for e in sup.events("engine.rung_precompiled") if e["ok"]]}
        finally:
            sup.stop()
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--model", default=".cache/tiny-llama")
    ap.add_argument("--idle-s", type=float, default=60.0, help="idle time READY before the OOM (both arms)")
    ap.add_argument("--arms", default="plain,prepared", help="comma-separated, of " + ", ".join(ARMS))
    a = ap.parse_args()
    out = {name: arm(name, a.model, a.vllm_python, a.idle_s) for name in a.arms.split(",")}
    colds = [r["cold"]["start_to_ready_s"] for r in out.values()]
    cold = sum(colds) / len(colds)
    print("real vLLM CPU, tiny model, a fresh compile cache per arm warmed at chunk 2048 only; seconds")
    print(f"warm-cache cold start (spawn -> READY): {', '.join(f'{c:.2f}' for c in colds)}, mean {cold:.2f}")
    for name, r in out.items():
        print(f"{name:<9} recovery (death detected -> READY at chunk {r['rung']}, never used before): "
              f"{r['recovered_after_s']:6.2f}   {r['recovered_after_s'] / cold:4.2f}x cold start   "
              f"standby used: {r['standby']}   torch.compile: {r['compiled']}   precompiles: {r['precompiled']}   "
              "idle before the OOM: "
              f"{r['idle_s']:.0f}s")
    first = next(iter(out.values()))
    table = [("cold start", first["cold"]["phases"]),
             *((f"{name} rec.", r["rec"]["phases"]) for name, r in out.items())]
    names = list(dict.fromkeys(k for _, p in table for k in p))
    print("\nwhere each start's time went (seconds; vLLM's own log lines):")
    print(f"{'phase':<26}" + "".join(f"{label:>16}" for label, _ in table))
    for n in names:
        print(f"{n:<26}" + "".join(f"{p.get(n, 0.0):16.2f}" for _, p in table))
    print(f"{'start -> READY':<26}" + "".join(f"{t['start_to_ready_s']:16.2f}" for t in
                                             (first["cold"], *(r["rec"] for r in out.values()))))
    ratios = "; ".join(f"{name} {r['recovered_after_s'] / cold:.2f}x" for name, r in out.items())
    print(f"\nrecovery / warm-cache cold start: {ratios} (goal <= 0.8x, stretch <= 0.5x)")
    if "prepared" in out and "compiled" in out:
        print(f"without torch.compile / compiled, the same prepared restart: "
              f"{out['prepared']['recovered_after_s'] / out['compiled']['recovered_after_s']:.2f}x")


if __name__ == "__main__":
    main()
