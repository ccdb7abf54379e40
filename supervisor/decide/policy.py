"""What to do after a failure: restart budget, backoff, the downgrade ladder, climbing back (pure).

Restart intensity follows OTP: more than ``max_restarts`` in ``window_s`` and the supervisor gives
up (FATAL, non-zero exit) so that systemd's own Restart=/StartLimit* decide what happens next.
``max_consecutive_failures`` ends a crash loop of any period: failures that never reach READY
(a start that hangs for 15 minutes each time) would never fill the window.
Memory knobs fall fast (one rung per OOM, in ``[ladder] order``) and climb slowly (one rung per
stable period, last lowered first); a rung that failed ``max_rung_failures`` times is never tried
again. A failure caused by another process's memory is not held against the rung.
A death that one request was proven to cause (it was alone at an engine that had served without it:
the gateway's evidence) spends no restart budget and does not count toward a crash loop: the budget
is for loops the supervisor cannot explain, and the gateway quarantines such a request at its second
strike, so a client cannot spend it.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from supervisor.config import LadderConfig, RestartConfig
from supervisor.decide.evidence import request_stem
from supervisor.engine_states import Blame, ExitCode, Failure, FailureKind
from supervisor.profile import Knob, Profile


@dataclass(frozen=True)
class Decision:
    """Restart after ``delay_s`` with ``profile``, or give up with ``exit_code``.

    ``failure`` is the failure as the policy understood it (a repeated unexplained death becomes
    a memory failure).
    """

    restart: bool
    profile: Profile
    failure: Failure
    delay_s: float = 0.0
    reason: str = ""
    exit_code: ExitCode = ExitCode.OK
    # vLLM's compile cache is moved aside before the restart (a ``compile_cache`` failure, once)
    set_aside_compile_cache: bool = False


def backoff_delay(consecutive: int, cfg: RestartConfig, rand: Callable[[], float]) -> float:
    """Exponential backoff capped at backoff_max_s, minus up to ``backoff_jitter`` of itself."""
    if consecutive <= 0:
        return 0.0
    base: float = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2.0 ** (consecutive - 1))
    return base * (1.0 - cfg.backoff_jitter * rand())


def after_serving(backoff: float, served_s: float) -> float:
    """The backoff counts from the engine's READY, as runit and s6 count from a service's start:
    time it served already spaced the restarts, so an engine that served longer than its
    backoff restarts at once (a start that fails before READY, the crash loop the backoff is
    for, waits all of it)."""
    return max(0.0, backoff - max(0.0, served_s))


def step_down(profile: Profile, ladder: LadderConfig, first: Knob | None = None) -> Profile | None:
    """One rung lower for a memory failure, in ``ladder.order`` (``first`` tried first); None at
    the floors."""
    order = list(ladder.knob_order)
    if first is not None:
        order = [first, *(k for k in order if k is not first)]
    for knob in order:
        lowered = _lower(profile, knob, ladder)
        if lowered is not None:
            return lowered
    return None


def _lower(p: Profile, knob: Knob, ladder: LadderConfig) -> Profile | None:
    cur = p.effective(knob)
    if knob is Knob.MAX_NUM_BATCHED_TOKENS:
        assert cur is not None
        floor = ladder.max_num_batched_tokens_floor
        below = [r for r in ladder.max_num_batched_tokens if floor <= r < cur]
        nxt = max(below) if below else floor
        if nxt >= cur:
            return None
        seqs = p.max_num_seqs
        if (p.effective(Knob.MAX_NUM_SEQS) or 0) > nxt:
            seqs = nxt  # vLLM refuses max_num_seqs above the batch token budget
        return p.with_(max_num_batched_tokens=nxt, enable_chunked_prefill=True, max_num_seqs=seqs)
    if knob is Knob.MAX_NUM_SEQS:
        assert cur is not None
        seqs = max(ladder.max_num_seqs_floor, int(cur) // 2)
        return p.with_(max_num_seqs=seqs) if seqs < cur else None
    if knob is Knob.GPU_MEMORY_UTILIZATION:
        assert cur is not None
        util = round(
            max(ladder.gpu_memory_utilization_floor, cur - ladder.gpu_memory_utilization_step), 4)
        return p.with_(gpu_memory_utilization=util) if util < cur else None
    if cur is None:  # max_model_len left to vLLM: the model's length is not known here
        return None
    nxt = max(ladder.max_model_len_floor, int(cur) // 2)
    return p.with_(max_model_len=nxt) if nxt < cur else None


def floor_of(profile: Profile, ladder: LadderConfig) -> Profile:
    """``profile`` with the batch token budget at the ladder's lowest listed rung (2048 by
    default; the ``_floor`` below it is for memory failures at that rung), where a long
    prompt's prefill needs least."""
    listed = [r for r in ladder.max_num_batched_tokens if r >= ladder.max_num_batched_tokens_floor]
    lowest = min(listed, default=ladder.max_num_batched_tokens_floor)
    while (profile.effective(Knob.MAX_NUM_BATCHED_TOKENS) or 0) > lowest:
        lower = _lower(profile, Knob.MAX_NUM_BATCHED_TOKENS, ladder)
        if lower is None:
            break
        profile = lower
    return profile


def step_up(current: Profile, configured: Profile, ladder: LadderConfig) -> Profile | None:
    """One rung back toward the configured profile, undoing the last-taken lever first."""
    for knob in (*reversed(ladder.knob_order), Knob.MAX_MODEL_LEN):
        up = _raise(current, configured, knob, ladder)
        if up is not None:
            return up
    return None


def _raise(cur_p: Profile, conf_p: Profile, knob: Knob, ladder: LadderConfig) -> Profile | None:
    cur, conf = cur_p.effective(knob), conf_p.effective(knob)
    if cur_p.value(knob) == conf_p.value(knob) or cur is None:
        return None
    if conf is not None and cur >= conf:
        return None
    if knob is Knob.GPU_MEMORY_UTILIZATION:
        nxt: float | None = round(cur + ladder.gpu_memory_utilization_step, 4)
    elif knob is Knob.MAX_NUM_BATCHED_TOKENS:
        above = [r for r in ladder.max_num_batched_tokens if r > cur]
        nxt = min(above) if above else None
    else:  # max_num_seqs, max_model_len: double
        nxt = cur * 2
    # Reaching what was configured restores it exactly (None = vLLM decides again).
    if nxt is None or (conf is None and knob is Knob.MAX_MODEL_LEN) or (conf is not None
                                                                        and nxt >= conf):
        return cur_p.with_knob(knob, conf_p.value(knob))
    return cur_p.with_knob(knob, nxt)


def clamp_to_configured(saved: Profile, configured: Profile,
                        saved_under: Profile | None = None) -> Profile:
    """A remembered profile never exceeds what the operator configured now, and a knob the
    operator changed since it was learned (``saved_under``: what was configured then) takes
    the new value: raising gpu_memory_utilization from 0.4 to 0.5 is a decision, not a step
    down to remember."""
    out = configured
    for knob in Knob:
        s, c = saved.value(knob), configured.effective(knob)
        if saved_under is not None and saved_under.effective(knob) != c:
            continue
        if s is not None and (c is None or s < c):
            out = out.with_knob(knob, s)
    if out != configured and configured.enable_chunked_prefill is None:
        out = out.with_(enable_chunked_prefill=saved.enable_chunked_prefill)
    return out


# Deaths that restart the rung they died at: none of them says the rung was short of memory.
SAME_RUNG_DEATHS = frozenset({FailureKind.ENGINE_DEAD, FailureKind.SIGNAL, FailureKind.HANG})


def spare_takes_the_restart(kind: FailureKind, profile: Profile, spare: Profile | None,
                            ladder: LadderConfig) -> bool:
    """Whether a death of ``kind`` whose restart would be at ``profile`` goes into the rung of the
    spare asleep beside it instead (``into_sleeping_spare``)."""
    return (spare is not None and kind in SAME_RUNG_DEATHS and ladder.climb_after_s > 0
            and spare.compile_key() != profile.compile_key() and spare.chunk() <= profile.chunk())


def into_sleeping_spare(decision: Decision, spare: Profile | None,
                        ladder: LadderConfig) -> Decision:
    """A death that would restart the rung it died at (the engine dead with no memory cause, a
    signal, a hang), while a spare of the rung below sleeps beside it, restarts into the spare's
    rung instead: a wake (0.8 s on the H100) rather than a start of the same rung (9-15 s). The
    ladder's climb takes the engine back up after ``climb_after_s``, as after any step down; where
    climbing is off (0) the engine would stay lower for good, so the rung is kept. ``spare`` is the
    sleeping spare's rung only where the next one is built beside the engine again (a spare built
    first, at vLLM's default 0.9, is kept for the memory failure it was built for). A memory
    failure already goes to the spare's rung, a device's fault keeps nothing on the card, and a
    configuration error is not restarted."""
    if spare is None or not decision.restart or not spare_takes_the_restart(
            decision.failure.kind, decision.profile, spare, ladder):
        return decision
    into = spare.with_(gpu_memory_utilization=decision.profile.gpu_memory_utilization)
    return replace(
        decision, profile=into,
        reason=f"{decision.reason}; into the rung of the spare asleep beside it "
        f"(max_num_batched_tokens {spare.chunk()}): a wake, not a start; the climb takes it back "
        f"up after climb_after_s ({ladder.climb_after_s:g}s)")


@dataclass
class Policy:
    """The supervisor's memory of failures; every decision is a pure function of it and the
    input."""

    restart: RestartConfig
    ladder: LadderConfig
    configured: Profile
    rand: Callable[[], float] = field(default=random.random)
    rung_failures: dict[str, int] = field(default_factory=dict)
    restarts: deque[float] = field(default_factory=deque)
    consecutive: int = 0  # for the backoff; reset after a stable period
    in_a_row: int = 0  # failures since the last READY
    device_fatals: int = 0
    compile_cache_set_aside: bool = False  # once until a READY (again before one: not the cache)
    _last_unexplained: tuple[str, int | str] | None = None

    def on_failure(self, failure: Failure, profile: Profile, now: float, proven: bool = False,
                   served_s: float = 0.0) -> Decision:
        """Decide the next step after ``failure`` of an engine running ``profile`` at time
        ``now``; ``proven``: one request alone was proven to cause it; ``served_s``: how long
        the engine was READY before it failed."""
        return self.decide(self.explain(failure, profile), profile, now, proven, served_s)

    def decide(self, failure: Failure, profile: Profile, now: float, proven: bool = False,
               served_s: float = 0.0) -> Decision:
        """``on_failure`` for a failure already through ``explain``."""
        kind = failure.kind
        if not proven:
            self.in_a_row += 1
        if kind is FailureKind.CONFIG_ERROR:
            return Decision(False, profile, failure,
                            reason="engine configuration error: fix the config, not retried",
                            exit_code=ExitCode.ENGINE_CONFIG_ERROR)
        if kind is FailureKind.DEVICE_FATAL:
            self.device_fatals += 1
            if self.device_fatals > self.restart.device_fatal_retries:
                return Decision(False, profile, failure,
                                reason="fatal device error repeated: the GPU needs a person",
                                exit_code=ExitCode.DEVICE_FATAL)

        nxt = profile
        reason = f"{kind.value}: restart with the same profile"
        aside = kind is FailureKind.COMPILE_CACHE and not self.compile_cache_set_aside
        if aside:
            self.compile_cache_set_aside = True
            reason = (f"{kind.value}: vLLM's compile cache moved aside, the restart compiles anew "
                      "at the same profile")
        elif kind is FailureKind.COMPILE_CACHE:
            reason = (f"{kind.value}: again on the cache compiled anew since it was moved aside: "
                      "restart with the same profile")
        if kind.memory:
            if failure.rung_at_fault:
                self.rung_failures[profile.key()] = self.rung_failures.get(profile.key(), 0) + 1
            lowered = self._lower_for(failure, profile)
            if lowered is None and proven:
                # at the floors, and one request is to blame: it is quarantined, not the host
                lowered = profile
            if lowered is None:
                return Decision(False, profile, failure,
                                reason="memory failure with every knob at its floor",
                                exit_code=ExitCode.NOTHING_LEFT_TO_LOWER)
            nxt, reason = lowered, f"{kind.value}: lowered {_fmt_diff(profile.diff(lowered))}"

        if proven and kind.request_can_cause:
            # BACKOFF's shortest step: the next engine is as needed as after any death, and nothing
            # loops here.
            return Decision(
                True, nxt, failure, after_serving(self.restart.backoff_initial_s, served_s),
                f"{reason}; caused by one request alone at the engine: no restart budget spent")
        if self.in_a_row >= self.restart.max_consecutive_failures:
            return Decision(
                False, profile, failure, exit_code=ExitCode.RESTART_BUDGET_SPENT,
                reason=f"{self.in_a_row} failures in a row without the engine becoming READY "
                f"(max_consecutive_failures={self.restart.max_consecutive_failures})")
        while self.restarts and now - self.restarts[0] > self.restart.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.restart.max_restarts:
            return Decision(False, profile, failure, exit_code=ExitCode.RESTART_BUDGET_SPENT,
                            reason=f"restart budget spent: {len(self.restarts)} restarts in "
                                   f"{self.restart.window_s:g}s")
        self.restarts.append(now)
        self.consecutive += 1
        delay = after_serving(backoff_delay(self.consecutive, self.restart, self.rand), served_s)
        return Decision(True, nxt, failure, delay, reason, set_aside_compile_cache=aside)

    def forgive(self, n: int) -> None:
        """``n`` earlier failures turned out to be one request's doing (proven later): their
        restarts are given back to the budget, and they no longer count as a crash loop."""
        for _ in range(min(n, len(self.restarts))):
            self.restarts.pop()
        self.in_a_row = max(0, self.in_a_row - n)

    def explain(self, failure: Failure, profile: Profile) -> Failure:
        """An unexplained death that repeats at the same profile with the same request is memory.

        On real vLLM CPU an allocation with no margin left kills the worker with SIGSEGV instead of
        raising, so the evidence says only "engine dead". The same request in the batch of two
        deaths at one profile (the same prompt length when vLLM printed it, else the same
        X-Request-Id) is the memory signature.
        """
        if not failure.kind.unexplained or failure.suspect_request is None:
            return failure
        same: int | str = failure.suspect_tokens if failure.suspect_tokens is not None \
            else request_stem(failure.suspect_request)
        sig = (profile.key(), same)
        if self._last_unexplained != sig:
            self._last_unexplained = sig
            return failure
        self._last_unexplained = None
        return replace(
            failure, kind=FailureKind.RUNTIME_OOM, knob=Knob.MAX_NUM_BATCHED_TOKENS,
            evidence=f"{failure.evidence}; the second death at this profile with the same request "
            f"in the batch ({_describe(failure)}): treated as a memory failure")

    def _lower_for(self, failure: Failure, profile: Profile) -> Profile | None:
        if failure.knob is Knob.MAX_MODEL_LEN:
            target = failure.suggested
            if target is None:
                return _lower(profile, Knob.MAX_MODEL_LEN, self.ladder)
            length = int(target)
            if profile.max_model_len is not None:
                length = min(length, profile.max_model_len - 1)
            return profile.with_(
                max_model_len=length) if length >= self.ladder.max_model_len_floor else None
        if failure.knob is Knob.GPU_MEMORY_UTILIZATION and failure.suggested is not None:
            # vLLM's free-memory check failed because another process holds memory: no other knob
            # changes that check, so only a utilization that fits in what is free will start.
            util = round(failure.suggested, 4)
            current = profile.effective(Knob.GPU_MEMORY_UTILIZATION)
            floor = self.ladder.gpu_memory_utilization_floor
            if util < floor or current is None or util >= current:
                return None
            return profile.with_(gpu_memory_utilization=util)
        return self._step_down_past_failed(profile, failure.knob)

    def _step_down_past_failed(self, profile: Profile, knob: Knob | None) -> Profile | None:
        candidate = step_down(profile, self.ladder, knob)
        # Skip rungs already known to fail: keep lowering past them.
        while candidate is not None and self.rung_failures.get(candidate.key(),
                                                               0) >= self.ladder.max_rung_failures:
            candidate = step_down(candidate, self.ladder, knob)
        return candidate

    def next_rungs(self, profile: Profile) -> list[Profile]:
        """The rungs the next starts would most likely use: a runtime OOM's step down, then the
        climb back, then the rungs that further runtime OOMs would walk down the batch-token
        ladder to its floor (each its own compile; the knobs below that floor are lowered by
        OOMs at the floor, rare enough to compile then)."""
        down = self._step_down_past_failed(profile, Knob.MAX_NUM_BATCHED_TOKENS)
        rungs = [p for p in (down, self.climb_target(profile)) if p is not None]
        chunk = Knob.MAX_NUM_BATCHED_TOKENS
        while down is not None:
            lower = self._step_down_past_failed(down, chunk)
            if lower is None or lower.effective(chunk) == down.effective(chunk):
                break
            rungs.append(down := lower)
        return rungs

    def budget_left(self, now: float) -> int:
        """Failures that would still be restarted: the lesser of the window's and the crash
        loop's allowance."""
        in_window = sum(1 for t in self.restarts if now - t <= self.restart.window_s)
        return max(0, min(self.restart.max_restarts - in_window,
                          self.restart.max_consecutive_failures - 1 - self.in_a_row))

    def on_ready(self) -> None:
        """The engine became READY: a crash loop, if there was one, is over (and a compile cache
        spoiled again later is moved aside again)."""
        self.in_a_row = 0
        self.compile_cache_set_aside = False

    def on_stable(self) -> None:
        """The engine served for a stable period: later failures start the backoff from scratch."""
        self.consecutive = 0

    def reconfigure(self, restart: RestartConfig, ladder: LadderConfig,
                    configured: Profile) -> None:
        """A reload: these settings apply from the next decision; the memory of failures stays."""
        self.restart, self.ladder, self.configured = restart, ladder, configured

    def forget_failed_rungs(self) -> None:
        """`reset-profile`: every rung may be tried again."""
        self.rung_failures.clear()

    def judge(self, raw: Failure, profile: Profile, now: float, blame: Blame,
              served_s: float = 0.0) -> Decision:
        """The decision after ``raw``, with what the gateway found (``blame``); ``served_s`` as
        in ``decide``."""
        # A death one request alone was proven to cause is that request's (the gateway quarantines
        # it), never read as the engine's memory signature.
        failure = raw if blame.proven else self.explain(raw, profile)
        self.forgive(blame.explained)
        decision = self.decide(failure, profile, now, blame.proven, served_s)
        if decision.restart and failure.kind.memory and blame.floor:
            decision = self.to_floor(decision)
        return decision

    def to_floor(self, decision: Decision) -> Decision:
        """The restart goes to the ladder's lowest rung: a request that killed the engine twice
        is tried there alone."""
        floor = floor_of(decision.profile, self.ladder)
        if floor == decision.profile:
            return decision
        rung = (f"max_num_batched_tokens {floor.chunk()}, max_num_seqs "
                f"{floor.effective(Knob.MAX_NUM_SEQS)}")
        return replace(
            decision, profile=floor,
            reason=f"{decision.reason}; then to the lowest rung ({rung}): a "
            "request that killed the engine twice is tried there alone before it is quarantined")

    def climb_target(self, profile: Profile) -> Profile | None:
        """The next rung up, unless it already failed ``max_rung_failures`` times."""
        if self.ladder.climb_after_s <= 0:
            return None
        up = step_up(profile, self.configured, self.ladder)
        if up is None or self.rung_failures.get(up.key(), 0) >= self.ladder.max_rung_failures:
            return None
        return up


def _describe(f: Failure) -> str:
    tokens = f"{f.suspect_tokens} prompt tokens, " if f.suspect_tokens is not None else ""
    return f"{tokens}{f.suspect_request}"


def _fmt_diff(diff: dict[str, list[object]]) -> str:
    return ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items()) or "nothing"
