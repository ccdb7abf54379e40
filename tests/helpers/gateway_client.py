"""A client of the gateway for the stand-in tests: one request, its status, body and headers."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from multidict import CIMultiDict


async def post(s: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> tuple[int, dict[str, Any], CIMultiDict[str]]:
    data = raw if raw is not None else json.dumps(body).encode()
    async with s.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
        text = await r.text()
        try:
            doc = json.loads(text)
        except ValueError:
            doc = {"_text": text}
        return r.status, doc, CIMultiDict(r.headers)


def completion(prompt: str | list[int], max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": prompt, "max_tokens": max_tokens, **extra}
