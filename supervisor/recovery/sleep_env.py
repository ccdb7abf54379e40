"""The environment a second engine started with ``--enable-sleep-mode`` (a spare) runs under
(pure).

vLLM serves ``/sleep`` and ``/wake_up`` only in its dev mode. Its level-1 sleep copies every weight
allocation into a new pinned CPU tensor. With PyTorch's default pinned allocation
(``cudaHostAlloc``, one thread) that allocation is most of the sleep: 10-16 s for the 9B shape's
17.5 GiB in run 11, against a 0.5 s wake. PyTorch's host-register path (``malloc``, the pages
touched by several threads, then ``cudaHostRegister``) pins the same memory; the copies and the
wake are unchanged. PyTorch reads these settings at the first allocation that needs them, so a
standby that imported before taking this environment sleeps under it too.
"""
from __future__ import annotations

from collections.abc import Mapping

DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}
# [engine.env] VLLMSUP_SPARE_HOST_REGISTER = "0": a spare pins as PyTorch does by default
HOST_REGISTER_ENV = "VLLMSUP_SPARE_HOST_REGISTER"
# PyTorch's CUDA allocator config, which the pinned allocation reads, takes the first of these that
# is set, even to nothing (PYTORCH_ALLOC_CONF is the newer, device-neutral name)
ALLOC_CONF_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
HOST_REGISTER = "pinned_use_cuda_host_register"
REGISTER_THREADS = "pinned_num_register_threads"
THREADS = 8  # PyTorch's own benchmark's best; it caps the count at 128


def sleep_mode_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables to set over the engine's own ``env`` for a sleep-mode engine: dev mode, and
    the host-register pinned allocation added to the allocator settings PyTorch would read, unless
    ``VLLMSUP_SPARE_HOST_REGISTER=0`` or the operator's settings already say how to pin."""
    out = dict(DEV_MODE)
    if env.get(HOST_REGISTER_ENV, "1").strip() == "0":
        return out
    name = next((n for n in ALLOC_CONF_NAMES if n in env), ALLOC_CONF_NAMES[0])
    current = env.get(name, "").strip().strip(",")
    keys = {part.partition(":")[0].strip() for part in current.split(",") if part.strip()}
    if HOST_REGISTER in keys:
        return out  # the operator's own choice, on or off
    added = [f"{HOST_REGISTER}:True"]
    if REGISTER_THREADS not in keys:
        added.append(f"{REGISTER_THREADS}:{THREADS}")
    out[name] = ",".join([current, *added] if current else added)
    return out
