"""On a lent GPU: what a spare's level-1 sleep spends, and whether PyTorch's host-register pinned allocation cuts it.

vLLM 0.26's ``CuMemAllocator.sleep`` copies each weight allocation into a fresh pinned CPU tensor
(``torch.empty(..., pin_memory=True)`` then ``cudaMemcpy``), and its wake copies them back. In run 11 (H100) a spare's
``/sleep`` took 10-16 s for 17.5 GiB of weights, against a wake of 0.5 s: the copies are fast, the pinned allocation
is not. This replays that sleep and wake with the GLM-4-9B shape's allocations (one per weight tensor, as the cumem
pool maps them), each arm in a process of its own, side by side in one run:
  default        PyTorch's default pinned allocation (cudaHostAlloc), as vLLM sleeps today;
  register       PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8
                 (malloc, pages touched by 8 threads, then cudaHostRegister);
  register-late  the same variable set after ``import torch`` (as a standby that imported first and takes the
                 start's environment later), to show that PyTorch reads it at the first pinned allocation.
Usage: `python3 bench/gpu_pinned.py` (torch with CUDA importable).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"

# the GLM-4-9B shape (hidden 4096, 40 layers, 13696 intermediate, 2 KV heads of 128, 151552 vocabulary), bf16
HIDDEN, LAYERS, INTER, VOCAB, KV = 4096, 40, 13696, 151552, 2 * 2 * 128
SIZES = [VOCAB * HIDDEN * 2] * 2 + LAYERS * [
    (HIDDEN + KV) * HIDDEN * 2, HIDDEN * HIDDEN * 2, 2 * INTER * HIDDEN * 2, INTER * HIDDEN * 2]

ARM = r"""
import json, os, sys, time
import torch
late = os.environ.pop("LATE_CONF", None)
if late:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = late
sizes = json.loads(sys.argv[1])
gpu = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
torch.cuda.synchronize()
alloc = copy = 0.0
backups = []
t0 = time.perf_counter()
for g in gpu:  # vLLM's sleep: a pinned tensor per allocation, then the copy out
    t = time.perf_counter()
    cpu = torch.empty(g.numel(), dtype=torch.uint8, pin_memory=True)
    alloc += time.perf_counter() - t
    t = time.perf_counter()
    cpu.copy_(g)
    copy += time.perf_counter() - t
    backups.append(cpu)
sleep_s = time.perf_counter() - t0
t0 = time.perf_counter()
for g, cpu in zip(gpu, backups):  # the wake: back onto the card
    g.copy_(cpu)
torch.cuda.synchronize()
wake_s = time.perf_counter() - t0
print(json.dumps({"sleep_s": round(sleep_s, 3), "alloc_s": round(alloc, 3), "copy_out_s": round(copy, 3),
                  "wake_s": round(wake_s, 3), "pinned": all(b.is_pinned() for b in backups)}))
"""


def arm(name: str, env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", ARM, json.dumps(SIZES)], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return {"arm": name, "error": out.stderr.strip().splitlines()[-1:]}
    return {"arm": name, **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    base = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    os.environ.clear()
    os.environ.update(base)
    print(f"{len(SIZES)} allocations, {sum(SIZES) / 2**30:.2f} GiB (the GLM-4-9B shape's weights, bf16)")
    rows = []
    for name, env in [("default", {}), ("register", {"PYTORCH_CUDA_ALLOC_CONF": REGISTER}),
                      ("register-late", {"LATE_CONF": REGISTER}), ("default", {}),
                      ("register", {"PYTORCH_CUDA_ALLOC_CONF": REGISTER})]:
        row = arm(name, env)
        rows.append(row)
        print(json.dumps(row), flush=True)
    by: dict[str, list[float]] = {}
    for r in rows:
        if "sleep_s" in r:
            by.setdefault(str(r["arm"]), []).append(float(r["sleep_s"]))  # type: ignore[arg-type]
    if by.get("default") and by.get("register"):
        d, g = min(by["default"]), min(by["register"])
        print(f"sleep: default {d:.2f} s, register {g:.2f} s = {g / d:.2f}x (best of each, interleaved)")


if __name__ == "__main__":
    main()
