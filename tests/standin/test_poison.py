"""Requests that crash the engine with nothing in vLLM's records naming them (a segfault): the gateway proves them
alone, quarantines them at two strikes, and their deaths never spend the restart budget (issue 25)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp

from tests.helpers.gateway_client import completion, post
from tests.helpers.processes import Sup

# The stand-in's engine core dies of a real SIGSEGV on any prompt holding this word: no scheduler dump, no name.
SEGV = {"engine": {"env": {"FAKE_VLLM_SEGV_WORD": "ZAP", "FAKE_VLLM_TOKEN_DELAY": "0.002"}},
        "gateway": {"hold_timeout_s": 60.0}, "restart": {"max_restarts": 6}}


def poison(name: str) -> str:
    """A segfaulting prompt of its own words (three of them are three poisons, not variants of one), longer than
    the ordinary clients' prompts."""
    return f"ZAP {name} " + " ".join(f"{name}{i}" for i in range(400))


async def ordinary(s: aiohttp.ClientSession, url: str, stop: asyncio.Event, codes: list[int]) -> None:
    while not stop.is_set():
        try:
            code, _, _ = await post(s, url, completion("hello " * 20, 4))
        except aiohttp.ClientError:
            code = -1
        codes.append(code)
        if code == -1:
            await asyncio.sleep(0.2)


async def resend(s: aiohttp.ClientSession, url: str, body: dict[str, Any], times: int) -> list[int]:
    """A client sending ``body`` up to ``times`` times, until it is refused with a 4xx."""
    codes: list[int] = []
    for _ in range(times):
        try:
            code, _, _ = await post(s, url, body)
        except aiohttp.ClientError:
            code = -1
        codes.append(code)
        if 400 <= code < 500:
            break
    return codes


async def recovered_from_all(sup: Sup) -> int:
    """Wait until every engine death logged so far was followed by a recovery; how many there were."""
    def settled() -> bool:
        return len(sup.events("engine.recovered")) >= len(sup.events("engine.failed"))
    await asyncio.to_thread(lambda: sup.wait_for(lambda st: st["state"] == "READY" and settled(), 30, "recovered"))
    return len(sup.events("engine.failed"))


async def test_three_segfaulting_prompts_retried_never_take_the_service_down(supervise: Callable[..., Sup]) -> None:
    """On the old code one such prompt sent twice spent max_restarts: FATAL, exit 4, every client refused."""
    sup = supervise(SEGV)
    sup.wait_ready()
    assert sup.gateway is not None
    url = sup.gateway + "/v1/completions"
    stop, ok_codes = asyncio.Event(), []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as s:
        clients = [asyncio.create_task(ordinary(s, url, stop, ok_codes)) for _ in range(3)]
        poisons = []
        for name in ("alpha", "beta", "gamma"):
            poisons.append(await resend(s, url, completion(poison(name)), times=3))
        deaths = await recovered_from_all(sup)
        # Variants of a quarantined poison are the same poison: refused at once, no engine dies for them.
        words = poison("alpha").split()
        variants = [completion(poison("alpha"), junk="x" * 20), completion(poison("alpha"), temperature=0.33),
                    completion(" ".join(words[:50] + words[53:]))]
        variant_codes = [(await post(s, url, v))[0] for v in variants]
        stop.set()
        await asyncio.gather(*clients)
    assert sup.proc.poll() is None, (poisons, [(f["kind"], f.get("caused_by_request")) for f in
                                               sup.events("engine.failed")], sup.log_tail(30))
    st = sup.wait_ready()
    assert st["state"] == "READY" and st["fatal"] is None
    for codes in poisons:
        assert codes[-1] == 413, poisons  # request_quarantined
    assert ok_codes and set(ok_codes) == {200}, sorted(set(ok_codes))
    failed = sup.events("engine.failed")
    assert len(failed) <= 9, [f["kind"] for f in failed]
    assert all(f["kind"] in ("engine_dead", "signal") for f in failed)
    assert sum(1 for f in failed if f.get("caused_by_request")) >= 6  # two alone per poison: no budget spent
    assert st["gateway"]["quarantined"] == 3
    assert variant_codes == [413, 413, 413] and len(failed) == deaths


async def test_a_segfaulting_prompt_through_invocations_is_quarantined_too(supervise: Callable[..., Sup]) -> None:
    sup = supervise(SEGV)
    sup.wait_ready()
    assert sup.gateway is not None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as s:
        codes = await resend(s, sup.gateway + "/invocations", completion(poison("delta")), times=4)
    assert codes[-1] == 413 and len(codes) <= 3, codes
    assert sup.proc.poll() is None
    assert len(sup.events("engine.failed")) <= 3
