"""On a lent H200: issue 27's proof in one device call (under 10 minutes at the seed's scale).

A fresh host (empty compile cache, fresh state directory) at UTIL (default 0.9, vLLM's own default) with every key
at its default (HOG_BEFORE: a share of the card another process holds from before the start, e.g. 0.47 with
UTIL=0.4), MODEL (default ~/glm9b, ../shared/gpu/mkglm9b.py's GLM-4-9B shape) at 128k, the gateway in front with
its memory rules off as in the field, 16 clients through it from the first READY on:
  1. the supervisor's first start: since issue 38 by default its own rung and the next compiled side by side,
     then the engine (RECOVERY_ARGS='spare_order = "auto"' and 'precompile_order = "first"': every rung within
     reach and the spare first, the runs of docs/runs/README.md before issue 38);
  2. CRASH_AFTER_S (10) after READY (with CRASH_AFTER_SPARE=1: after a spare sleeps beside the engine, e.g. at
     UTIL=0.5), the seed's crash: another process takes all but 16 MiB and stays, the long
     prompt through the gateway: death -> READY (the spare woken, its canary);
  3. SECOND_AFTER_S (10) after that READY, the EngineCore SIGKILLed: death -> READY (no spare: the standby and
     the compile cache, or since uncompiled_restart no torch.compile); DEATHS=N kills it N times, each later one
     once the next standby has imported; AFTER_S (5) of traffic after, its latency and how that engine compiles;
  4. the other process gone, the supervisor again on the same state directory with `spare = "off"`: the
     warm-cache cold start every ratio is taken against, and its KV cache without a spare beside it (REFERENCE=plain:
     plain vLLM's warm-cache start on the first start's cache instead, bench/gpu_starts.py `plain_start`;
     REFERENCE=plain+fresh: then also plain vLLM's fresh-host cold start on an empty cache of its own, the bound of
     issue 38's item 1 for step 1; it runs last, so the OS's page cache is as warm for it as it can be).
WARM_HOST=1 keeps the compile cache and state directory of an earlier run on this machine (a host after a reboot):
step 1 is then the first READY on a warm host with the spare, side by side with step 4's without it. Its
quarantine is cleared first, as an operator would (`vllm-supervisor quarantine clear`): it holds the earlier run's
long prompt, and refuses its variants too (the H200 run that kept it answered this run's 413 with no crash).
$OUT gets summary-proof.txt and events-proof.jsonl. Usage: PART-less, `python3 bench/gpu_proof.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from common import events_in
from gpu_common import OUT, Stop, counted, http, note, run_supervisor, spare_asleep, start_hog, status, wait
from gpu_seed import GW, MAX_LEN, Clients, at, ended, latency_windows, ready, second_engines, toml, wrapped_up

UTIL = float(os.environ.get("UTIL", "0.9"))
WARM = bool(os.environ.get("WARM_HOST"))
HOST = "a warm host" if WARM else "a fresh host"
CACHE, STATE = Path("/tmp/vcache-proof"), Path("/tmp/sup-state-proof")
PLAIN_FRESH = Path("/tmp/vcache-proof-plain-fresh")
LOG = OUT / "supervisor-proof.log"


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for stale in () if WARM else (CACHE, STATE):
        shutil.rmtree(stale, ignore_errors=True)
    gateway = f'[gateway]\nlisten = "{GW}"\nmin_free_mib = 0\nforeign_growth_mib = 0\n'
    spared, plain = Path("/tmp/sup-proof.toml"), Path("/tmp/sup-proof-off.toml")
    spared.write_text(toml(STATE, CACHE, gateway, UTIL, "auto"))
    plain.write_text(toml(STATE, CACHE, gateway, UTIL, "off"))
    if WARM:
        clear = subprocess.run([sys.executable, "-m", "supervisor", "quarantine", "clear", "--config", str(spared)],
                               capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        note(f"quarantine clear: rc {clear.returncode} {(clear.stdout + clear.stderr).strip()[:200]}")
    hogs = [start_hog_share(float(os.environ.get("HOG_BEFORE", "0")))]
    clients = Clients()
    sup: subprocess.Popen[bytes] | None = run_supervisor(spared, LOG)
    try:
        first, engine_s = first_start(sup)
        clients.start()
        if os.environ.get("CRASH_AFTER_SPARE"):  # (e): where the spare is built beside the serving engine
            st = wait(spare_asleep, "a spare asleep")
            if st is None:
                raise Stop("no spare asleep beside the serving engine")
            note(f"spare asleep beside the engine: {json.dumps(st['next_start']['spare'])[:400]}")
        time.sleep(float(os.environ.get("CRASH_AFTER_S", "10")))
        latency_windows(LOG, clients)
        hogs.append(seed_crash())
        rec1 = recovered(sup, 1, "the seed's crash")
        seconds = second_deaths(sup)
        time.sleep(float(os.environ.get("AFTER_S", "5")))  # ordinary traffic on the engine after the second death
        latency_windows(LOG, clients)  # on the engine the last death's restart started (compiled or not: /status)
        note(f"the engine now: compile {json.dumps((status() or {}).get('compile'))}")
        note(clients.finish())
        ended(hogs, sup)
        hogs = []
        if os.environ.get("REFERENCE", "").startswith("plain"):
            # plain vLLM's warm-cache start on the cache the first start filled: the supervisor's own with spare off
            # would start at the crash's rung, which a restart without torch.compile left uncompiled
            from gpu_starts import plain_start
            sup, cold = None, plain_start(CACHE, "a warm-cache cold start on the first start's cache")
            if os.environ.get("REFERENCE") == "plain+fresh" and not WARM:
                # item 1's fresh-host bound: plain vLLM on an empty compile cache of its own, after every start
                # above (the OS's page cache and the interpreter's bytecode as warm for it as for the supervisor's)
                shutil.rmtree(PLAIN_FRESH, ignore_errors=True)
                fresh = plain_start(PLAIN_FRESH, "a fresh-host cold start (empty compile cache)")
                note(f"proof: first READY on {HOST} {first:.1f}s = {first / fresh:.2f}x plain vLLM's fresh-host cold "
                     f"start {fresh:.1f}s (the engine's own start {engine_s:.1f}s = {engine_s / fresh:.2f}x)")
        else:
            sup = run_supervisor(plain, LOG)
            st = ready(sup, LOG, "the warm-cache cold start, spare off")
            cold = float(st["timings"]["start_to_ready_s"])
            note(f"proof: warm-cache cold start (spare off, same host) {cold:.1f}s; phases {st['timings']['phases']}")
        again = ", ".join(f"{r:.1f}s = {r / cold:.3f}x" for r in seconds)
        note(f"proof: death -> READY {rec1:.1f}s = {rec1 / cold:.3f}x (the seed's crash), {again} (each later "
             f"death of the EngineCore); first READY on {HOST} {first:.1f}s = {first / cold:.2f}x "
             f"(the engine's own start {engine_s:.1f}s)")
        kv = [line.split("]")[-1].strip() for line in LOG.read_text(errors="replace").splitlines()
              if "GPU KV cache size" in line]
        note(f"proof: KV cache of each start, in order (the first is the engine beside the spare): {kv}")
    except Stop as why:
        note(f"STOPPED: {why}")
        return 1
    finally:
        wrapped_up(clients, hogs, sup, LOG, "proof",
                   ("gpu.utilization_adapted", "engine.failed", "spare.asleep", "spare.woken", "spare.dropped"))
    return 0


def start_hog_share(share: float) -> Any:
    """Another process holding ``share`` of the card from before the start (none for 0)."""
    if not share:
        return None
    os.environ["HOG_FRACTION"] = str(share)
    try:
        return start_hog()
    finally:
        os.environ.pop("HOG_FRACTION")


def first_start(sup: Any) -> tuple[float, float]:
    """The first READY on the fresh host (and the engine's own spawn -> READY), each second engine said as it
    ends: the call may run out before READY."""
    progress = second_engines(LOG, "engine.rung_precompiled", "spare.asleep")
    st = ready(sup, LOG, f"the first READY on {HOST}", progress=progress)
    engine_s = at(next(e for e in events_in(LOG, "engine.state_changed") if e.get("to") == "READY")) \
        - at(events_in(LOG, "engine.spawned")[0])
    first = float(st["timings"]["start_to_ready_s"])
    note(f"proof: first READY on {HOST} {first:.1f}s, the engine's own start {engine_s:.1f}s; precompile "
         f"{json.dumps(st['next_start']['precompile'])[:300]}; spare {json.dumps(st['next_start']['spare'])[:400]}")
    return first, engine_s


def seed_crash() -> Any:
    """Another process takes all but 16 MiB and stays; the long prompt (sized by the engine's tokenizer) goes
    through the gateway, answered in a thread of its own."""
    unit = " the contract clause"
    per = counted(unit * 10, "m", MAX_LEN) / 10
    prompt = unit * int(min(100_000, 0.9 * MAX_LEN) / per)
    note(f"the long prompt: {counted(prompt, 'm', MAX_LEN)} tokens")
    hog = start_hog()
    t0 = time.monotonic()

    def send() -> None:
        code, body, _ = http(f"http://{GW}/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 4}, 900)
        note(f"the long prompt through the gateway: HTTP {code} after {time.monotonic() - t0:.1f}s {str(body)[:160]}")

    threading.Thread(target=send, daemon=True).start()
    return hog


def recovered(sup: Any, restarts: int, what: str) -> float:
    st = ready(sup, LOG, f"READY after {what}", restarts=restarts)
    lf = st["last_failure"]
    woken = events_in(LOG, "spare.woken")
    note(f"proof: {what}: {lf['kind']} ({lf['evidence'][:120]}); death -> READY {lf['recovered_after_s']}s; "
         f"profile {st['profile']}; spare woken {len(woken)} (canary {woken[-1].get('canary') if woken else None}; "
         f"wake s {woken[-1].get('took_s') if woken else None}, its weights ahead s "
         f"{woken[-1].get('weights_s') if woken else None})")
    return float(lf["recovered_after_s"])


def second_deaths(sup: Any) -> list[float]:
    """DEATHS (1) SIGKILLs of the EngineCore, each death -> READY: the first SECOND_AFTER_S (10) after the seed's
    crash was recovered, each later one that long after the next standby has imported (the same restart again)."""
    out: list[float] = []
    for n in range(int(os.environ.get("DEATHS", "1"))):
        if n:
            wait(lambda s: (s["next_start"]["standby"] or {}).get("imported_s") is not None, "the next standby")
        time.sleep(float(os.environ.get("SECOND_AFTER_S", "10")))
        note(f"SIGKILL to the EngineCore: {kill_engine_core()}")
        out.append(recovered(sup, 2 + n, f"the EngineCore SIGKILLed ({n + 1})"))
    return out


def kill_engine_core() -> str:
    st = status()
    pid = int(st["engine_pid"]) if st else 0
    cores = [p for p in psutil.Process(pid).children(recursive=True)
             if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]
    if not cores:
        raise Stop(f"no EngineCore under the engine {pid}")
    os.kill(cores[0].pid, signal.SIGKILL)
    return f"pid {cores[0].pid} under the engine {pid}"


if __name__ == "__main__":
    raise SystemExit(main())
