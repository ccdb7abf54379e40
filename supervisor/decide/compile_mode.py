"""Whether a start runs vLLM's torch.compile, or starts without it (pure).

A restart after a serving engine's death, when no spare is woken, is the start clients wait for
most, and its floor was vLLM's load of its own compiled model: on the H100 at the seed's shape
6.3-7.9 s of one thread's CPU work in a 12.2 s start (docs/runs/README.md, run 13), and a rung it
had never compiled compiled on its path (32 s on the field report's shared card). Started with
``compilation_config`` mode 0 (no torch.compile) and full CUDA graphs, vLLM has neither: its
EngineCore reached /health in 12.1-13.1 s instead of 23.1 s after its imports, and its decode
was not slower in that run's one round (run 14; its prefill on a GPU is not measured). Such an
engine serves until the next start, which compiles as configured (a climb, a planned restart, a
reload); a spare built beside it is compiled as always.

Every other start compiles as vLLM would: the first and every planned one (the user waits for
those knowing it, and the speed they serve at is the one they configured), and the restart of a
start that failed before it served (an engine that cannot start uncompiled, say an attention
backend without full CUDA graphs, is restarted as configured rather than failing the same way).
So is any start whose [engine.args] or [engine.env] already say how vLLM compiles.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from supervisor.config import Config
from supervisor.engine_states import Failure, FailureKind

# vLLM's CompilationMode.NONE; FULL captures one CUDA graph per batch size up to vLLM's largest,
# attention included, and vLLM itself steps down to FULL_DECODE_ONLY where the attention backend
# does not hold mixed batches (CompilationConfig.resolve_cudagraph_mode_and_sizes).
UNCOMPILED = {"mode": 0, "cudagraph_mode": "FULL"}

# [engine.args] keys (snake_case) that already say how vLLM compiles: the operator's choice stands
COMPILE_ARGS = ("compilation_config", "enforce_eager", "O", "optimization_level")
# [engine.env] variables that already turn vLLM's torch.compile off (vllm/config/vllm.py)
COMPILE_ENV = ("TORCH_COMPILE_DISABLE", "VLLM_USE_BREAKABLE_CUDAGRAPH")
# compilation_config's `mode` and `cudagraph_mode` are vLLM 0.11's; before, `level`
FIRST_VLLM = (0, 11)


class StartKind(Enum):
    FIRST = "first"  # the supervisor's first start
    PLANNED = "planned"  # restart, reload, climb, reset-profile
    AFTER_FAILURE = "after_failure"  # the policy restarts a failed engine


@dataclass(frozen=True)
class CompileChoice:
    compiled: bool
    why: str

    def as_dict(self) -> dict[str, object]:
        return {"compiled": self.compiled, "why": self.why}


COMPILED = CompileChoice(True, "compiled as configured")


def choose(setting: str, kind: StartKind, *, served: bool, args: Mapping[str, object],
           env: Mapping[str, str], version: str | None = None) -> CompileChoice:
    """How the next start compiles. ``served``: the engine that failed had been READY (a failure
    before that restarts compiled); ``version``: the vLLM the last engine reported."""
    if kind is StartKind.FIRST:
        return CompileChoice(True, "compiled as configured: the supervisor's first start")
    if kind is StartKind.PLANNED:
        return CompileChoice(True, "compiled as configured: a planned start")
    if setting == "off":
        return CompileChoice(True, "compiled as configured: [recovery] uncompiled_restart = "
                             "\"off\"")
    given = {a.replace("-", "_") for a in args}
    named = [k for k in COMPILE_ARGS if k in given]
    if named:
        return CompileChoice(True, "compiled as configured: [engine.args] "
                             f"{', '.join(named)} already say(s) how vLLM compiles")
    off = [k for k in COMPILE_ENV if env.get(k) == "1"]
    if off:
        return CompileChoice(True, f"as configured: [engine.env] {', '.join(off)} already turns "
                             "vLLM's torch.compile off")
    if not served:
        return CompileChoice(True, "compiled as configured: the start before failed before it "
                             "served, and a start without torch.compile may be what failed")
    if version is not None and _release(version) < FIRST_VLLM:
        return CompileChoice(True, f"compiled as configured: vLLM {version} predates "
                             "compilation_config's mode and cudagraph_mode (0.11)")
    return CompileChoice(False, "without torch.compile (compilation_config mode 0, full CUDA "
                         "graphs): a failure's restart that woke no spare, whose floor was "
                         "vLLM's load of its compiled model; the next start (a climb, a planned "
                         "restart) compiles as configured ([recovery] uncompiled_restart)")


def choose_for(cfg: Config, kind: StartKind, *, served: bool,
               version: str | None) -> CompileChoice:
    """``choose`` with the setting, the arguments and the environment read from ``cfg``."""
    e = cfg.engine
    return choose(cfg.recovery.uncompiled_restart, kind, served=served, args=e.args,
                  env=e.environment(), version=version)


def restarts_uncompiled(cfg: Config, version: str | None) -> bool:
    """Whether a served engine's failure restart that wakes no spare would start without
    torch.compile: then no rung compiles on a failure's path (recovery/next_build.py)."""
    return not choose_for(cfg, StartKind.AFTER_FAILURE, served=True, version=version).compiled


def _release(version: str) -> tuple[int, ...]:
    """``0.26.0`` -> (0, 26); ``0.10.2rc1+cpu`` -> (0, 10); unreadable -> (0, 11): not refused."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else FIRST_VLLM


def failure_of(found: Failure, compiled: bool) -> Failure:
    """A configuration error of a start without torch.compile is that start's, not the operator's
    (an older vLLM refusing compilation_config's keys): restarted, compiled as configured, and not
    the FATAL a configuration error is."""
    if compiled or found.kind is not FailureKind.CONFIG_ERROR:
        return found
    return Failure(FailureKind.ENGINE_DEAD, f"{found.evidence} (a start without torch.compile: "
                   "the next start compiles as configured)")
