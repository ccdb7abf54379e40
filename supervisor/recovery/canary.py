"""A woken spare proves it computes what it computed before it slept, before it serves anyone.

vLLM's sleep mode has known failures that leave an engine up, healthy and wrong: memory left pinned
that grows with every sleep/wake cycle until outputs turn to garbage (vllm-project/vllm#21336), LoRA
state silently corrupted on wake (#53888), crashes after a wake with native KV offload (#45268) or
with speculative decoding (#55013). So when the spare is built, before it sleeps, it answers one
fixed prompt greedily with each token's logprob; after the wake it answers it again, and any other
token, or a logprob further off than a numeric wobble, drops the spare. One request of ``TOKENS``
tokens: tens of milliseconds on a GPU, on the critical path of a recovery by design.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from supervisor.bounds import SPARE_CANARY_S
from supervisor.host.vllm_http import EngineClient, EngineError

PROMPT = (
    "The following is a list of the first ten prime numbers, written in words, separated by "
    "commas: two, "
    "three, five,")
# Four: a wake's corruption shows from the first token on; each more is one decode step on a
# failover's critical path (eight took 0.09 s of the H200's 1.16 s).
TOKENS = 4
# Greedy decoding of one request repeats on the same engine; its logprobs may move in the last
# digits (another kernel choice after a wake). Corruption moves them by whole units, or changes the
# tokens.
LOGPROB_TOLERANCE = 0.05
# [engine.args] with which a wake is known to break the engine (the issues above): no spare is built
# for them.
BREAKS_ON_WAKE = {
    "enable_lora": "LoRA adapters", "lora_modules": "LoRA adapters",
    "speculative_config": "speculative decoding", "kv_offloading_size": "native KV offload",
    "kv_offloading_backend": "native KV offload"
}


@dataclass(frozen=True)
class Canary:
    """The fixed prompt's greedy answer: its tokens and their logprobs."""

    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]

    def differs(self, woken: Canary) -> str | None:
        """Why ``woken`` is not this answer, or None when it is."""
        if woken.tokens != self.tokens:
            at = next((i for i, (a, b) in enumerate(zip(self.tokens, woken.tokens, strict=False))
                       if a != b), min(len(self.tokens), len(woken.tokens)))
            return (f"token {at} differs after the wake: {woken.tokens[at:at + 1]!r} instead of "
                    f"{self.tokens[at:at + 1]!r}")
        drift = self.drift(woken)
        if drift > LOGPROB_TOLERANCE:
            return (f"the same tokens, but a logprob moved by {drift:.3f} (tolerance "
                    f"{LOGPROB_TOLERANCE})")
        return None

    def drift(self, woken: Canary) -> float:
        return max((abs(a - b) for a, b in zip(self.logprobs, woken.logprobs, strict=False)),
                   default=0.0)

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": len(self.tokens), "text": "".join(self.tokens)}


async def ask(client: EngineClient) -> Canary:
    """The engine's greedy answer to the canary prompt; raises EngineError when it gives none, or
    one that is not a completion."""
    body = await client.complete(PROMPT, TOKENS, SPARE_CANARY_S, request_id="sup-canary",
                                 logprobs=1)
    try:
        choice = body["choices"][0]
        lp = choice.get("logprobs") or {}
        tokens = tuple(str(t) for t in lp.get("tokens") or ())
        logprobs = tuple(float(x) if x is not None else 0.0 for x in lp.get("token_logprobs") or ())
        if not tokens:  # an engine that returns no logprobs: compare the text alone
            tokens = (str(choice.get("text", "")),)
    except (LookupError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(
            f"the canary's answer is not a completion: {type(exc).__name__}: {exc}") from None
    return Canary(tokens, logprobs)


def breaks_on_wake(args: dict[str, Any]) -> str | None:
    """What in ``[engine.args]`` is known to break an engine woken from sleep, or None."""
    for key, what in BREAKS_ON_WAKE.items():
        value = args.get(key, args.get(key.replace("_", "-")))
        if value not in (None, False, "", [], {}):
            return (f"{what} ({key}): vLLM's sleep mode is known to corrupt or crash such an "
                    "engine on wake")
    return None
