"""The four hang rules, decided from a clock and the probes' readings (pure).

``/health`` stays 200 while a wedged EngineCore makes no progress, so liveness is never judged by
it alone:
1. start timeout: spawned and not healthy within ``start_timeout_s``;
2. ``/metrics`` silence: no answer for ``hang_timeout_s``;
3. no progress: requests running or waiting, and vLLM's token counters and KV-cache usage frozen
   for ``hang_timeout_s`` (vLLM counts a prompt's tokens only when its prefill ends: a long
   prompt's chunked prefill moves only the KV-cache usage, chunk by chunk);
4. canary: when idle, a real one-token generation every ``canary_interval_s``, which must answer
   within ``hang_timeout_s``, or later only while it waits behind work that progresses (a
   request that arrived with it, say a long prefill) and rule 3 watches.
Each rule returns the hang's evidence (a sentence for the incident) or None.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.config import HealthConfig


@dataclass(frozen=True)
class Progress:
    running: float
    waiting: float
    tokens: float  # prompt + generated tokens, monotonic while the engine works
    kv_usage: float = 0.0  # vLLM's KV cache usage, 0..1 (the fullest engine when there are several)

    @property
    def pending(self) -> bool:
        return self.running + self.waiting > 0


class Liveness:
    """One engine start's liveness; feed it readings with the time they were taken."""

    def __init__(self, health: HealthConfig, start_timeout_s: float, spawned_at: float) -> None:
        self.health = health
        self.start_timeout_s = start_timeout_s
        self.spawned_at = spawned_at
        self._mark: tuple[float, float] | None = None  # the token counters and the KV-cache usage
        self._stalled_since: float | None = None
        self._silent_since: float | None = None
        self._canary_at: float | None = None  # a canary in flight since
        self._last_canary = spawned_at
        # the canaries answered with an error status since the last good one
        self._canary_errors: list[str] = []
        self.pending = False

    def start_overdue(self, now: float) -> str | None:
        """Rule 1, while waiting for the first /health 200."""
        if now - self.spawned_at > self.start_timeout_s:
            return f"engine not healthy within start_timeout_s={self.start_timeout_s:g}s"
        return None

    def ready(self, now: float) -> None:
        self._last_canary = now

    def metrics(self, now: float, progress: Progress | None) -> str | None:
        """Rules 2 and 3: one /metrics reading, or None when it did not answer."""
        timeout = self.health.hang_timeout_s
        if progress is None:
            self._silent_since = now if self._silent_since is None else self._silent_since
            if now - self._silent_since >= timeout:
                return (f"/metrics unanswered for {now - self._silent_since:.0f}s "
                        f"(hang_timeout_s={timeout:g}s)")
            return None
        self._silent_since = None
        self.pending = progress.pending
        mark = (progress.tokens, progress.kv_usage)
        if not progress.pending or self._mark is None or mark != self._mark:
            self._mark = mark
            self._stalled_since = now if progress.pending else None
            return None
        if self._stalled_since is None:
            self._stalled_since = now
        stalled = now - self._stalled_since
        if stalled >= timeout:
            return (
                f"no token progress for {stalled:.0f}s with {progress.running:g} running and "
                f"{progress.waiting:g} waiting requests (vllm:*_tokens_total frozen at "
                f"{progress.tokens:g}, KV-cache usage at {progress.kv_usage:.2%})"
            )
        return None

    def canary_due(self, now: float) -> bool:
        """Rule 4: idle, none in flight, and ``canary_interval_s`` since the last one
        (``probe_interval_s`` after one that failed: a second opinion comes soon)."""
        h = self.health
        every = h.probe_interval_s if self._canary_errors else h.canary_interval_s
        return not self.pending and self._canary_at is None and now - self._last_canary >= every

    def canary_sent(self, now: float) -> None:
        self._canary_at = self._last_canary = now

    def canary_done(self) -> None:
        """The canary was answered with a generation."""
        self._canary_at = None
        self._canary_errors.clear()

    def canary_failed(self, error: str) -> None:
        """The canary was answered with an error status (5xx): the engine answers, but does not
        generate."""
        self._canary_at = None
        self._canary_errors.append(error)

    def canary_failing(self) -> str | None:
        """Rule 5: ``unhealthy_probes`` canaries in a row answered with an error (an engine whose
        /health says 200 while it fails every generation, e.g. put to sleep behind the
        supervisor's back)."""
        n = len(self._canary_errors)
        if n >= self.health.unhealthy_probes:
            return (f"canary generation failed {n} times in a row while /health answered 200 "
                    f"({self._canary_errors[-1]})")
        return None

    def _progressing(self, now: float) -> bool:
        """Work is pending and moved within ``hang_timeout_s`` (rule 3 watches it)."""
        return (self.pending and self._stalled_since is not None
                and now - self._stalled_since < self.health.hang_timeout_s)

    def canary_unanswered(self, now: float) -> None:
        """The canary's request gave up without an answer. Past its deadline, which only work
        that progressed has held off, it is let go and the next one sent when idle; before it,
        the clock judges it as before."""
        if self._canary_at is not None and now - self._canary_at >= self.health.hang_timeout_s:
            self._canary_at = None

    def canary_overdue(self, now: float) -> str | None:
        if (self._canary_at is not None and now - self._canary_at >= self.health.hang_timeout_s
                and not self._progressing(now)):
            return (
                f"canary generation ({self.health.canary_max_tokens} token) gave no answer within "
                f"hang_timeout_s={self.health.hang_timeout_s:g}s")
        return None
