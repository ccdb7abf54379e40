"""What one start's vLLM says, read as evidence: its IPC records and its console lines.

Only vLLM's own error records count (decide/evidence.py: never a client's text); the first one
that says the engine died is handed to ``on_death`` once. While the engine loads, its console
also says which step it is in (loading weights, compiling, ...) and which version it is. The
records and the tail are what the verdict is classified from and what the incident bundle holds,
secrets masked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from supervisor.child import vllm_hook
from supervisor.config import Config, redact
from supervisor.decide import startup
from supervisor.decide.classify import death_evidence
from supervisor.decide.evidence import ConsoleFilter, event_evidence
from supervisor.engine.logtail import LogTail
from supervisor.event_stream import CompileCacheUnusable, EngineEnvReported, Event, StartupStep
from supervisor.host import Host, compile_cache

AOT_HINT = (
    "vLLM compiles the model again at every start (2-3 s of each on the tiny CPU model, "
    "docs/recovery.md); "
    "VLLM_USE_AOT_COMPILE = \"0\" in [engine.env] makes it use its older compile cache, which loads"
)


def env_report(event: dict[str, Any], at: float,
               second_engine: bool = False) -> EngineEnvReported | None:
    """The ``vllm_env`` IPC record (what vLLM set for an EngineCore) as an event; None for any
    other record."""
    if event.get("kind") != vllm_hook.VLLM_ENV_KIND:
        return None
    env, pid = event.get("env"), event.get("pid")
    return EngineEnvReported(
        at=at, pid=pid if isinstance(pid, int) else None,
        env={k: v for k, v in env.items()
             if isinstance(k, str) and isinstance(v, str)} if isinstance(env, dict) else {},
        second_engine=second_engine)


class Observer:
    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None],
                 secrets: Sequence[str], on_death: Callable[[str], None],
                 echo: TextIO | None = None) -> None:
        self.host, self.publish, self.secrets, self.on_death = host, publish, list(
            secrets), on_death
        self.events: deque[dict[str, Any]] = deque(maxlen=1000)
        self.console = ConsoleFilter()
        self.tail = LogTail(cfg.log.tail_lines, on_line=self.on_line, echo=echo,
                            redact=lambda line: redact(line, self.secrets))
        # every step vLLM went through while loading, and when it began
        self.steps: list[tuple[str, float]] = []
        self.engine_version: str | None = None
        self.compile_cache: str | None = None  # the torch.compile cache directory vLLM said it used
        self.loading = True  # until /health 200: the console names vLLM's startup steps
        self.ending = False  # the run is ending: records are kept, no more deaths are reported
        self._aot_noted = False

    def on_event(self, event: dict[str, Any]) -> None:
        """One IPC record from any vLLM process."""
        reported = env_report(event, self.host.wall())
        if reported is not None:  # not a log record: never evidence, never in an incident
            self.publish(reported)
            return
        if self.secrets:
            event = {k: self._redact(v) for k, v in event.items()}
        self.events.append(event)
        if self.ending:
            return
        for text in event_evidence(event):
            found = death_evidence(text)
            if found:
                self.ending = True
                self.on_death(found)
                return

    def _redact(self, value: Any) -> Any:
        if isinstance(value, str):
            return redact(value, self.secrets)
        if isinstance(value, list):
            return [self._redact(v) for v in value]
        return value

    def on_line(self, line: str) -> None:
        """One console line (stdout or stderr of the API server and whatever it started)."""
        if self.loading:
            step = startup.step_of(line)
            if step and (not self.steps or self.steps[-1][0] != step):
                self.steps.append((step, self.host.monotonic()))
                self.publish(StartupStep(at=self.host.wall(), step=step))
            if self.engine_version is None:
                self.engine_version = startup.version_of(line)
            if self.compile_cache is None:
                self.compile_cache = compile_cache.directory_of(line)
            reason = None if self._aot_noted else startup.aot_cache_failure(line)
            if reason:
                self._aot_noted = True
                self.publish(CompileCacheUnusable(at=self.host.wall(), reason=reason,
                                                  hint=AOT_HINT))
        text = self.console.feed(line)
        if text and not self.ending:
            found = death_evidence(text)
            if found:
                self.ending = True
                self.on_death(found)

    def startup(self, now: float, started: float) -> dict[str, Any] | None:
        """While the engine loads (a start that began at ``started``): vLLM's current step and
        for how long."""
        if not self.loading or self.ending:
            return None
        step, since = self.steps[-1] if self.steps else ("starting", started)
        return {"step": step, "for_s": round(now - since, 1)}
