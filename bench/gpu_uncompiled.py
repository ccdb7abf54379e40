"""On a lent GPU: issue 38, item 4: what an engine without vLLM's torch.compile costs to start and to serve.

The floor of a start without a spare is vLLM's load of its own compiled model (run 13: 6.3-7.9 s of one thread's
CPU work). An engine started without torch.compile skips that load, and compiles nothing for a rung it has never
compiled; the price is how fast it serves. This driver measures both sides with plain vLLM, the supervisor's own
engine arguments (MODEL, default ~/glm9b, at 128k, chunk 8192, 10 sequences, UTIL default 0.9), one arm after the
other on one card and one compile cache:

  compiled-fresh   vLLM's defaults on an empty compile cache (it compiles)
  compiled-warm    the same on the cache the first start filled (the reference every ratio is against)
  none+decode      -cc mode 0 (no torch.compile) with full CUDA graphs for decode batches (FULL_DECODE_ONLY)
  none+full        -cc mode 0 with full CUDA graphs for every batch that fits one (FULL)
  eager            --enforce-eager (no torch.compile, no CUDA graphs)

Each arm: spawn -> /health 200, and the part after vLLM's imports (the EngineCore's first line -> /health: what a
start from an imported standby pays); then, once, a decode load (10 clients, 1,000-token prompts, 256 tokens each,
EOS ignored: output tokens/s) and a prefill (one 16,000-token prompt, 1 token out: seconds), each run twice and the
second kept. ARMS picks arms (comma-separated). $OUT gets summary-uncompiled.txt and vllm-<arm>.log.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpu_common import OUT, PORT, T0, http, note, notes, plain_vllm, stop_group

MODEL = os.path.expanduser(os.environ.get("MODEL", "~/glm9b"))
UTIL = float(os.environ.get("UTIL", "0.9"))
CACHE = Path(os.environ.get("CACHE", "/tmp/vcache-uncompiled"))
ARMS = {
    "compiled-fresh": [],
    "compiled-warm": [],
    "none+decode": ["--compilation-config", json.dumps({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})],
    "none+full": ["--compilation-config", json.dumps({"mode": 0, "cudagraph_mode": "FULL"})],
    "eager": ["--enforce-eager"],
}


def serve(arm: str) -> tuple[subprocess.Popen[bytes], dict[str, float]]:
    """vLLM started as the arm says; returns it once /health answers 200, with its timings."""
    argv, env = plain_vllm(CACHE, MODEL, UTIL, 131072, tuple(ARMS[arm]))
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    first_engine_line: list[float] = []
    threading.Thread(target=copy, args=(proc, OUT / f"vllm-{arm}.log", first_engine_line), daemon=True).start()
    while proc.poll() is None:
        if http(f"http://127.0.0.1:{PORT}/health", timeout=2)[0] == 200:
            t = time.monotonic()
            after = t - first_engine_line[0] if first_engine_line else float("nan")
            return proc, {"start_s": t - t0, "after_imports_s": after}
        if time.monotonic() - t0 > 400:
            break
        time.sleep(0.1)
    stop_group(proc)
    raise RuntimeError(f"{arm}: vLLM exited ({proc.returncode}) or took over 400 s; see vllm-{arm}.log")


def copy(proc: subprocess.Popen[bytes], log: Path, first_engine_line: list[float]) -> None:
    assert proc.stdout is not None
    with open(log, "ab") as out:
        for line in proc.stdout:
            if not first_engine_line and b"Initializing a V1 LLM engine" in line:
                first_engine_line.append(time.monotonic())
            out.write(f"{time.monotonic() - T0:9.3f} ".encode() + line)


def complete(prompt: list[int], max_tokens: int) -> tuple[int, int]:
    code, body, _ = http(f"http://127.0.0.1:{PORT}/v1/completions",
                         {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                          "temperature": 0}, timeout=300)
    return code, int(body["usage"]["completion_tokens"]) if code == 200 and isinstance(body, dict) else 0


def decode_load(seed: int) -> float:
    """10 clients, 1,000-token prompts, 256 tokens each: output tokens/s."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 30000) for _ in range(1000)] for _ in range(10)]
    got: list[tuple[int, int]] = []
    t = time.monotonic()
    threads = [threading.Thread(target=lambda p=p: got.append(complete(p, 256))) for p in prompts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    took = time.monotonic() - t
    bad = [c for c, _ in got if c != 200]
    if bad:
        raise RuntimeError(f"decode load: answers {bad}")
    return sum(n for _, n in got) / took


def prefill(seed: int) -> float:
    """One 16,000-token prompt, 1 token out: seconds (a new prompt each time: vLLM's prefix cache would answer a
    repeated one without a prefill, as run 14's first pass did)."""
    rng = random.Random(seed)
    t = time.monotonic()
    code, _ = complete([rng.randrange(100, 30000) for _ in range(16000)], 1)
    if code != 200:
        raise RuntimeError(f"prefill: answer {code}")
    return time.monotonic() - t


def main() -> int:
    arms = os.environ.get("ARMS", ",".join(ARMS)).split(",")
    if "compiled-fresh" in arms:
        shutil.rmtree(CACHE, ignore_errors=True)
    rows: dict[str, dict[str, Any]] = {}
    for arm in arms:
        try:
            proc, row = serve(arm)
        except RuntimeError as e:
            note(str(e))
            continue
        try:
            decode_load(1), prefill(2)  # the first of each warms up
            row["decode_tok_s"], row["prefill_s"] = decode_load(3), prefill(4)
        except (RuntimeError, KeyError) as e:
            note(f"{arm}: {e}")
        finally:
            stop_group(proc)
        rows[arm] = row
        note(f"{arm}: {json.dumps({k: round(v, 2) for k, v in row.items()})}")
    ref = rows.get("compiled-warm")
    if ref:
        for arm, row in rows.items():
            ratios = {k: f"{row[k] / ref[k]:.3f}x" for k in row if ref.get(k)}
            note(f"{arm} / compiled-warm: {ratios}")
    (OUT / "summary-uncompiled.txt").write_text("\n".join(notes) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
