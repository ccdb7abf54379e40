"""What to do after a failure: restart budget, backoff, the downgrade ladder, climbing back (pure).

Restart intensity follows OTP: more than ``max_restarts`` in ``window_s`` and the supervisor gives
up (FATAL, non-zero exit) so that systemd's own Restart=/StartLimit* decide what happens next.
Memory knobs fall fast (one rung per OOM) and climb slowly (one rung per stable period); a rung
that failed ``max_rung_failures`` times is never tried again.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from supervisor.config import LadderConfig, RestartConfig
from supervisor.lifecycle import ExitCode, Failure, FailureKind
from supervisor.profile import Profile


@dataclass(frozen=True)
class Decision:
    """Restart after ``delay_s`` with ``profile``, or give up with ``exit_code``."""

    restart: bool
    profile: Profile
    delay_s: float = 0.0
    reason: str = ""
    exit_code: ExitCode = ExitCode.OK


def backoff_delay(consecutive: int, cfg: RestartConfig, rand: Callable[[], float]) -> float:
    """Exponential backoff capped at backoff_max_s, minus up to ``backoff_jitter`` of itself."""
    if consecutive <= 0:
        return 0.0
    base: float = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2.0 ** (consecutive - 1))
    return base * (1.0 - cfg.backoff_jitter * rand())


def step_down(profile: Profile, ladder: LadderConfig, prefer: str = "max_num_batched_tokens") -> Profile | None:
    """One rung lower for a memory failure, starting at knob ``prefer``; None when all are at floors."""
    order = ["max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization"]
    if prefer == "gpu_memory_utilization":
        order = ["gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs"]
    for knob in order:
        lowered = _lower(profile, knob, ladder)
        if lowered is not None:
            return lowered
    return None


def _lower(p: Profile, knob: str, ladder: LadderConfig) -> Profile | None:
    if knob == "max_num_batched_tokens":
        floor = ladder.max_num_batched_tokens_floor
        below = [r for r in ladder.max_num_batched_tokens if r < p.max_num_batched_tokens and r >= floor]
        nxt = max(below) if below else floor
        if nxt >= p.max_num_batched_tokens:
            return None
        # max_num_seqs may not exceed the batch token budget (vLLM refuses to start otherwise).
        return p.with_(max_num_batched_tokens=nxt, enable_chunked_prefill=True,
                       max_num_seqs=min(p.max_num_seqs, nxt))
    if knob == "max_num_seqs":
        seqs = max(ladder.max_num_seqs_floor, p.max_num_seqs // 2)
        return p.with_(max_num_seqs=seqs) if seqs < p.max_num_seqs else None
    if knob == "gpu_memory_utilization":
        util = round(max(ladder.gpu_memory_utilization_floor,
                         p.gpu_memory_utilization - ladder.gpu_memory_utilization_step), 4)
        return p.with_(gpu_memory_utilization=util) if util < p.gpu_memory_utilization else None
    if knob == "max_model_len":
        if p.max_model_len is None:
            return None
        nxt = max(ladder.max_model_len_floor, p.max_model_len // 2)
        return p.with_(max_model_len=nxt) if nxt < p.max_model_len else None
    raise ValueError(f"unknown knob {knob}")


def step_up(current: Profile, configured: Profile, ladder: LadderConfig) -> Profile | None:
    """One rung back toward the configured profile, undoing the last-taken lever first."""
    if current.gpu_memory_utilization < configured.gpu_memory_utilization:
        nxt = round(min(configured.gpu_memory_utilization,
                        current.gpu_memory_utilization + ladder.gpu_memory_utilization_step), 4)
        return current.with_(gpu_memory_utilization=nxt)
    if current.max_num_seqs < configured.max_num_seqs:
        return current.with_(max_num_seqs=min(configured.max_num_seqs, current.max_num_seqs * 2))
    if current.max_num_batched_tokens < configured.max_num_batched_tokens:
        above = [r for r in ladder.max_num_batched_tokens if current.max_num_batched_tokens < r]
        nxt = min(min(above), configured.max_num_batched_tokens) if above else configured.max_num_batched_tokens
        return current.with_(max_num_batched_tokens=nxt)
    if current.max_model_len is not None and (
            configured.max_model_len is None or current.max_model_len < configured.max_model_len):
        # Memory evidence taught us this length; it only comes back by an operator's hand.
        return None
    return None


def clamp_to_configured(saved: Profile, configured: Profile) -> Profile:
    """A remembered profile never exceeds what the operator configured now."""
    mml = saved.max_model_len
    if configured.max_model_len is not None:
        mml = configured.max_model_len if mml is None else min(mml, configured.max_model_len)
    return configured.with_(
        max_num_batched_tokens=min(saved.max_num_batched_tokens, configured.max_num_batched_tokens),
        max_num_seqs=min(saved.max_num_seqs, configured.max_num_seqs),
        gpu_memory_utilization=min(saved.gpu_memory_utilization, configured.gpu_memory_utilization),
        max_model_len=mml,
    )


@dataclass
class Policy:
    """The supervisor's memory of failures; every decision is a pure function of it and the input."""

    restart: RestartConfig
    ladder: LadderConfig
    configured: Profile
    rand: Callable[[], float] = field(default=random.random)
    rung_failures: dict[str, int] = field(default_factory=dict)
    restarts: deque[float] = field(default_factory=deque)
    consecutive: int = 0
    device_fatals: int = 0

    def on_failure(self, failure: Failure, profile: Profile, now: float) -> Decision:
        """Decide the next step after ``failure`` of an engine running ``profile`` at time ``now``."""
        kind = failure.kind
        if kind is FailureKind.CONFIG_ERROR:
            return Decision(False, profile, reason="engine configuration error: fix the config, not retried",
                            exit_code=ExitCode.ENGINE_CONFIG_ERROR)
        if kind is FailureKind.DEVICE_FATAL:
            self.device_fatals += 1
            if self.device_fatals > self.restart.device_fatal_retries:
                return Decision(False, profile, reason="fatal device error repeated: the GPU needs a person",
                                exit_code=ExitCode.DEVICE_FATAL)

        nxt = profile
        reason = f"{kind.value}: restart with the same profile"
        if kind in (FailureKind.RUNTIME_OOM, FailureKind.STARTUP_MEMORY):
            self.rung_failures[profile.key()] = self.rung_failures.get(profile.key(), 0) + 1
            lowered = self._lower_for(failure, profile)
            if lowered is None:
                return Decision(False, profile, reason="memory failure with every knob at its floor",
                                exit_code=ExitCode.NOTHING_LEFT_TO_LOWER)
            nxt, reason = lowered, f"{kind.value}: lowered {_fmt_diff(profile.diff(lowered))}"

        while self.restarts and now - self.restarts[0] > self.restart.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.restart.max_restarts:
            return Decision(False, profile, exit_code=ExitCode.RESTART_BUDGET_SPENT,
                            reason=f"restart budget spent: {len(self.restarts)} restarts in "
                                   f"{self.restart.window_s:g}s")
        self.restarts.append(now)
        self.consecutive += 1
        return Decision(True, nxt, backoff_delay(self.consecutive, self.restart, self.rand), reason)

    def _lower_for(self, failure: Failure, profile: Profile) -> Profile | None:
        if failure.knob == "max_model_len":
            target = failure.suggested
            if target is None:
                return _lower(profile, "max_model_len", self.ladder)
            length = int(target)
            if profile.max_model_len is not None:
                length = min(length, profile.max_model_len - 1)
            return profile.with_(max_model_len=length) if length >= self.ladder.max_model_len_floor else None
        if failure.knob == "gpu_memory_utilization" and failure.suggested is not None:
            # vLLM's free-memory check failed because another process holds memory: no other knob
            # changes that check, so only a utilization that fits in what is free will start.
            util = round(failure.suggested, 4)
            if util < self.ladder.gpu_memory_utilization_floor or util >= profile.gpu_memory_utilization:
                return None
            return profile.with_(gpu_memory_utilization=util)
        prefer = failure.knob if failure.knob in ("gpu_memory_utilization", "max_num_batched_tokens") \
            else "max_num_batched_tokens"
        candidate = step_down(profile, self.ladder, prefer)
        # Skip rungs already known to fail: keep lowering past them.
        while candidate is not None and self.rung_failures.get(candidate.key(), 0) >= self.ladder.max_rung_failures:
            candidate = step_down(candidate, self.ladder, prefer)
        return candidate

    def on_stable(self) -> None:
        """The engine served for a stable period: later failures start the backoff from scratch."""
        self.consecutive = 0

    def climb_target(self, profile: Profile) -> Profile | None:
        """The next rung up, unless it already failed ``max_rung_failures`` times."""
        if self.ladder.climb_after_s <= 0:
            return None
        up = step_up(profile, self.configured, self.ladder)
        if up is None or self.rung_failures.get(up.key(), 0) >= self.ladder.max_rung_failures:
            return None
        return up


def _fmt_diff(diff: dict[str, list[object]]) -> str:
    return ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items()) or "nothing"
