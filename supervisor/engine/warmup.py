"""Re-warm a fresh engine with mid-length prompts before it takes traffic.

The seed's lesson: after a start, a few mid-length requests settle the allocator's pools, and
they also prove that the new profile survives real prefill chunks. Default prompt lengths are a
quarter to a half of the effective prefill chunk, capped by the model length.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import structlog

from supervisor.config import WarmupConfig
from supervisor.host.vllm_http import EngineClient, EngineError
from supervisor.profile import Profile

FILLER = "The quick brown fox jumps over the lazy dog. "
FILLER_WORDS = len(FILLER.split())
log = structlog.get_logger("supervisor.engine.warmup")


def plan(profile: Profile, cfg: WarmupConfig) -> list[int]:
    """Prompt lengths in tokens for one warm-up."""
    if not cfg.enabled or cfg.requests == 0:
        return []
    cap = None if profile.max_model_len is None else max(1, profile.max_model_len - cfg.max_tokens
                                                         - 8)
    if cfg.prompt_tokens:
        sizes = list(cfg.prompt_tokens)
    else:
        chunk = profile.chunk()
        lo, hi = chunk // 4, chunk // 2
        n = cfg.requests
        sizes = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    return [max(1, min(s, cap)) if cap else max(1, s) for s in sizes]


def after_wake(cfg: WarmupConfig, sizes: list[int]) -> WarmupConfig:
    """A woken spare's warm-up: its canary has just proven its decode, token for token; what is
    left to settle is the prefill's activation memory at this rung, so the same prompts go in
    one round, each for one token (on the H200 the full warm-up was 0.34 s of a 1.7 s
    recovery, most of it two rounds of 8 decode steps)."""
    return replace(cfg, concurrency=max(1, len(sizes)), max_tokens=1)


@dataclass(frozen=True)
class WarmupResult:
    requests: int
    tokens: list[int]
    seconds: float


class WarmupFailed(RuntimeError):
    """A warm-up request failed: counts as a startup failure."""


async def run(client: EngineClient, sizes: list[int], cfg: WarmupConfig) -> WarmupResult:
    """Send the planned prompts, ``cfg.concurrency`` at a time; raise WarmupFailed on any error."""
    t0 = time.monotonic()
    if not sizes:
        return WarmupResult(0, [], 0.0)
    try:
        unit = await client.count_tokens(FILLER * 8, timeout=cfg.timeout_s) / 8 or 1.0
    except EngineError as exc:
        # An engine without /tokenize still gets warmed up: roughly one token per word.
        log.info("warmup.tokenize_unavailable", error=str(exc),
                 assumed_tokens_per_sentence=FILLER_WORDS)
        unit = float(FILLER_WORDS)
    sem = asyncio.Semaphore(cfg.concurrency)

    async def one(i: int, tokens: int) -> None:
        prompt = FILLER * max(1, int(tokens / unit))
        async with sem:
            try:
                await client.complete(prompt, cfg.max_tokens, timeout=cfg.timeout_s,
                                      request_id=f"warmup-{i}")
            except EngineError as exc:
                raise WarmupFailed(
                    f"warm-up request {i} (~{tokens} tokens) failed: {exc}") from None

    try:
        await asyncio.wait_for(asyncio.gather(*(one(i, t) for i, t in enumerate(sizes))),
                               cfg.timeout_s)
    except TimeoutError:
        raise WarmupFailed(f"warm-up did not finish within {cfg.timeout_s:g}s") from None
    return WarmupResult(len(sizes), sizes, time.monotonic() - t0)
