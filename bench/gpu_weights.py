"""H200: what keeping the weights across a restart would save, where `vllm preload` is absent (vLLM 0.26).

Run on the device after the setup call of ../shared/gpu/ (MODEL=~/tinyllama by default). First the checkpoint
is read end to end, from a page cache emptied of it (posix_fadvise DONTNEED on each file) and again warm. Then
one vLLM API server start per variant, stopped as soon as it logged its weight loading (`--enforce-eager`: no
compile or graph capture to wait for): vLLM's default (memory-mapped, lazy) with the page cache warm and cold,
and the `--safetensors-load-strategy` choices `eager` and `prefetch` cold. Prints vLLM's own "Loading weights
took" and "Model loading took" figures side by side; $OUT gets weights-summary.txt and each start's log.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time

from gpu_common import MODEL, OUT, note, notes

VARIANTS = [  # label, page cache, extra vLLM arguments
    ("lazy-warm", "warm", []),
    ("lazy-cold", "cold", []),
    ("eager-cold", "cold", ["--safetensors-load-strategy", "eager"]),
    ("prefetch-cold", "cold", ["--safetensors-load-strategy", "prefetch"]),
]
WEIGHTS = re.compile(r"Loading weights took ([\d.]+) seconds")
MODEL_LOAD = re.compile(r"Model loading took ([\d.]+) GiB(?: memory)? and ([\d.]+) seconds")


def checkpoint() -> list[str]:
    return sorted(glob.glob(os.path.join(MODEL, "*.safetensors")))


def evict() -> None:
    """Drop the checkpoint's pages from the page cache (no root needed: the files are ours to read)."""
    for path in checkpoint():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all() -> float:
    t0 = time.monotonic()
    for path in checkpoint():
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
    return time.monotonic() - t0


def start(label: str, cache: str, extra: list[str]) -> tuple[float, float] | None:
    """vLLM's (weights s, model loading s) for one start, or None when it did not get that far."""
    if cache == "cold":
        evict()
    log = OUT / f"weights-{label}.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL, "--port", "18010",
           "--enforce-eager", "--gpu-memory-utilization", "0.3", "--max-model-len", "4096", *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    found = None
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 240 and proc.poll() is None and found is None:
            time.sleep(0.5)
            text = log.read_text(errors="replace")
            w, m = WEIGHTS.search(text), MODEL_LOAD.search(text)
            if w and m:
                found = float(w.group(1)), float(m.group(2))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the API server and its EngineCore share the session
        proc.wait()
    return found


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    size = sum(os.path.getsize(p) for p in checkpoint())
    evict()
    cold = read_all()
    warm = read_all()
    note(f"checkpoint {size / 1e9:.2f} GB in {len(checkpoint())} file(s): read cold {cold:.2f} s "
         f"({size / cold / 1e9:.2f} GB/s), warm {warm:.2f} s ({size / warm / 1e9:.2f} GB/s)")
    for label, cache, extra in VARIANTS:
        got = start(label, cache, extra)
        if got is None:
            note(f"{label:14} no weight-loading lines (see weights-{label}.log)")
        else:
            note(f"{label:14} page cache {cache}: vLLM loading weights {got[0]:.2f} s, model loading {got[1]:.2f} s")
    (OUT / "weights-summary.txt").write_text("\n".join(notes) + "\n")


if __name__ == "__main__":
    main()
