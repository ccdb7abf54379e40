"""On a lent H200: a warm-cache cold start vs recovery from a real CUDA OOM to a rung never used before.

One arm per call (PART=plain or PART=prepared), each with a fresh compile cache (VLLM_CACHE_ROOT,
TORCHINDUCTOR_CACHE_DIR) warmed by one start at chunk 8192 and nothing else:
1. the supervisor starts vLLM from that warm cache (the baseline: spawn -> READY);
2. prepared only: it stays idle until its standby has imported vLLM and its precompile of the next rung ended
   ([recovery] precompile = "on": a throwaway engine with dummy weights in half of the card's free memory);
   plain: [recovery] standby = false, precompile = "off", idle as long;
3. another process takes all but 16 MiB of the card and a 30,000-token prompt at chunk 8192 dies of a real
   CUDA OOM; the other process leaves as soon as the supervisor saw the death (so that the GPU gate does not wait);
4. the supervisor restarts at chunk 6144: recovery = death detected -> READY.
$OUT gets summary-<part>.txt (figures, the phase table) and events-<part>.jsonl (the supervisor's own events).
ENGINE_ENV="K=V ..." adds engine environment to every start of the arm (both the baseline and the recovery), and
LABEL names the run's files (summary-<part>-<label>.txt).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import events_in
from gpu_common import (
    OUT,
    PORT,
    Stop,
    counted,
    died_or_stop,
    http,
    note,
    notes,
    run_supervisor,
    start_hog,
    stop_supervisor,
    supervisor_toml,
    wait,
)

ARMS = {
    "plain": '[recovery]\nstandby = false\nprecompile = "off"\n',
    "prepared": '[recovery]\nstandby = true\nprecompile = "on"\nprecompile_idle_s = 3.0\n',
}
IDLE_S = 20.0




def alive(sup: subprocess.Popen[bytes], log: Path) -> None:
    """A supervisor that exited ends the run at once, with its last lines (not after the whole budget)."""
    if sup.poll() is not None:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise SystemExit(f"the supervisor exited with status {sup.returncode}:\n" + "\n".join(tail))


def main() -> int:
    part = os.environ.get("PART", "prepared")
    OUT.mkdir(parents=True, exist_ok=True)
    cache = Path(f"/tmp/vcache-{part}")
    shutil.rmtree(cache, ignore_errors=True)
    env = (f', VLLM_CACHE_ROOT = "{cache}/vllm", TORCHINDUCTOR_CACHE_DIR = "{cache}/inductor", '
           f'TRITON_CACHE_DIR = "{cache}/triton"')
    extra = (kv.partition("=") for kv in os.environ.get("ENGINE_ENV", "").split())
    env += "".join(f', {k} = "{v}"' for k, _, v in extra)
    name = part + (f"-{os.environ['LABEL']}" if os.environ.get("LABEL") else "")
    state = Path(f"/tmp/sup-state-{part}")
    log = OUT / f"supervisor-{name}.log"
    hog: subprocess.Popen[str] | None = None
    sup: subprocess.Popen[bytes] | None = None
    try:
        # The cache, warmed at chunk 8192 only.
        shutil.rmtree(state, ignore_errors=True)
        cfg = Path(f"/tmp/sup-{part}.toml")
        base = supervisor_toml(state, 0.0).replace('VLLM_NO_USAGE_STATS = "1" }', f'VLLM_NO_USAGE_STATS = "1"{env} }}')
        cfg.write_text(base + ARMS["plain"])
        sup = run_supervisor(cfg, log)
        st = wait(lambda s: s["ready"], "the cache-warming start", lambda: alive(sup, log))
        note(f"cache-warming start (fresh cache): {st and st['timings']}")
        stop_supervisor(sup)
        # The measured supervisor.
        shutil.rmtree(state, ignore_errors=True)
        cfg.write_text(base + ARMS[part])
        log.write_text("")
        sup = run_supervisor(cfg, log)
        st = wait(lambda s: s["ready"], "READY from the warm cache", lambda: alive(sup, log))
        if not st:
            return 1
        cold = st["timings"]
        note(f"warm-cache cold start: {cold}")
        t = time.monotonic()
        if part == "prepared":
            ns = wait(lambda s: (s["next_start"]["standby"] or {}).get("imported_s") is not None
                      and bool(events_in(log, "engine.rung_precompiled")) and not s["next_start"]["precompiling"],
                      "the standby and the precompile")
            note(f"standby: {ns and ns['next_start']['standby']}")
            note(f"precompiles: {events_in(log, 'engine.rung_precompiled')}")
        time.sleep(max(0.0, IDLE_S - (time.monotonic() - t)))
        note(f"idle for {time.monotonic() - t:.0f}s; then the other process and the 30k-token prompt")
        note(f"the long prompt: {counted('hello ' * 30000, 'tiny', 32768)} tokens by the engine's tokenizer")
        hog = start_hog()
        code, body, _ = http(f"http://127.0.0.1:{PORT}/v1/completions",
                             {"model": "tiny", "prompt": "hello " * 30000, "max_tokens": 4}, timeout=120)
        note(f"30k-token prompt at chunk 8192 -> HTTP {code}")
        died_or_stop(code, body)
        hog.kill()
        hog.wait()
        hog = None
        note("the other process left")
        st = wait(lambda s: s["ready"] and s["restarts"] >= 1, "READY after the OOM")
        if not st:
            return 1
        lf = st["last_failure"]
        spawned = events_in(log, "engine.spawned")
        rec = lf["recovered_after_s"]
        note(f"{part}: {lf['kind']} ({lf['evidence'][:120]}); recovery (detected -> READY at chunk "
             f"{st['profile']['max_num_batched_tokens']}) {rec:.2f}s = {rec / cold['start_to_ready_s']:.2f}x the "
             f"warm-cache cold start {cold['start_to_ready_s']:.2f}s; standby used: {spawned[-1].get('standby')}")
        phases = [("cold start", cold["phases"]), (f"{part} recovery", st["timings"]["phases"])]
        names = list(dict.fromkeys(k for _, p in phases for k in p))
        note(f"{'phase':<26}" + "".join(f"{label:>20}" for label, _ in phases))
        for n in names:
            note(f"{n:<26}" + "".join(f"{p.get(n, 0.0):20.2f}" for _, p in phases))
        stop_supervisor(sup)
    except Stop as why:
        note(f"STOPPED: {why}")
        return 1
    finally:
        if hog is not None:
            hog.kill()
        if sup is not None and sup.poll() is None:
            stop_supervisor(sup)
        (OUT / f"summary-{name}.txt").write_text("\n".join(notes) + "\n")
        ours = [line for line in log.read_text(errors="replace").splitlines()
                if line.startswith('{"') and '"event": "' in line] if log.exists() else []
        (OUT / f"events-{name}.jsonl").write_text("\n".join(ours) + "\n")
        if log.exists():  # vLLM's own lines are long: only the last of them come back
            log.write_text("\n".join(log.read_text(errors="replace").splitlines()[-300:]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
