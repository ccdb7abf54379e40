"""Talking to the engine's own HTTP surface: /health, /metrics, /v1/models, /tokenize, completions.

``/health`` stays 200 while a wedged engine core makes no progress, so liveness is judged by
token progress from /metrics while busy and by a real, timed canary generation while idle.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

TOKENS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


@dataclass(frozen=True)
class Progress:
    running: float
    waiting: float
    tokens: float  # prompt + generated tokens, monotonic while the engine works

    @property
    def pending(self) -> bool:
        return self.running + self.waiting > 0


def parse_progress(text: str) -> Progress:
    """Sum vLLM's request gauges and token counters over all label sets."""
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in TOKENS or s.name in (RUNNING, WAITING):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    return Progress(sums.get(RUNNING, 0.0), sums.get(WAITING, 0.0), sum(sums.get(t, 0.0) for t in TOKENS))


class EngineError(RuntimeError):
    """The engine answered with an error status (or not at all)."""


class EngineClient:
    """One aiohttp session to the engine's internal port."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self.model: str | None = None

    def _s(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Keep-alive is off: a pooled connection to a dead engine turns a clean refusal into
            # a confusing reset, and these are a handful of requests a second at most.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def health(self, timeout: float = 2.0) -> int | None:
        """HTTP status of /health, or None when nothing answered in time."""
        try:
            async with self._s().get(self.base_url + "/health",
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    async def metrics(self, timeout: float = 5.0) -> Progress:
        async with self._s().get(self.base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                raise EngineError(f"/metrics returned {r.status}")
            return parse_progress(await r.text())

    async def served_model(self, timeout: float = 10.0) -> str:
        if self.model is None:
            body = await self._json("GET", "/v1/models", None, timeout)
            self.model = str(body["data"][0]["id"])
        return self.model

    async def count_tokens(self, text: str, timeout: float = 30.0) -> int:
        body = await self._json("POST", "/tokenize", {"model": await self.served_model(), "prompt": text}, timeout)
        return int(body["count"])

    async def complete(self, prompt: str, max_tokens: int, timeout: float,
                       request_id: str | None = None) -> dict[str, Any]:
        """A non-streaming /v1/completions; raises EngineError on non-200 or timeout."""
        payload = {"model": await self.served_model(), "prompt": prompt, "max_tokens": max_tokens,
                   "temperature": 0.0}
        headers = {"X-Request-Id": request_id or f"sup-{uuid.uuid4().hex[:12]}"}
        body: dict[str, Any] = await self._json("POST", "/v1/completions", payload, timeout, headers)
        return body

    async def _json(self, method: str, path: str, payload: Any, timeout: float,
                    headers: dict[str, str] | None = None) -> Any:
        try:
            async with self._s().request(method, self.base_url + path, json=payload, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status != 200:
                    raise EngineError(f"{method} {path} returned {r.status}: {(await r.text())[:300]}")
                return await r.json()
        except TimeoutError:
            raise EngineError(f"{method} {path} gave no answer within {timeout:g}s") from None
        except aiohttp.ClientError as exc:
            raise EngineError(f"{method} {path} failed: {exc}") from None


class ProgressWatch:
    """Decides 'hung' from token progress: work pending and no new token for ``timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._tokens: float | None = None
        self._since: float | None = None

    def observe(self, now: float, p: Progress) -> str | None:
        """Feed one /metrics reading; returns hang evidence, or None while progress is fine."""
        if not p.pending or self._tokens is None or p.tokens != self._tokens:
            self._tokens = p.tokens
            self._since = now if p.pending else None
            return None
        if self._since is None:
            self._since = now
        stalled = now - self._since
        if stalled >= self.timeout_s:
            return (f"no token progress for {stalled:.0f}s with {p.running:g} running and "
                    f"{p.waiting:g} waiting requests (vllm:*_tokens_total frozen at {p.tokens:g})")
        return None

