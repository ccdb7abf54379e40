"""Counting a prompt, and the engine's own context length, only when the byte bound is not enough.

The parser's upper bound (bytes of text, or the number of token ids) is free; an exact count costs a
round trip to the engine's /tokenize, so it is asked for only when the bound is over the limit that
matters, when vLLM itself would materialise something per prompt token (prompt_logprobs), or for a
suspect going alone (its count is the evidence a quarantine shows).
"""

from __future__ import annotations

from collections.abc import Callable

from supervisor.decide.admission import Parsed
from supervisor.gateway.gate import Flight
from supervisor.host.vllm_http import EngineClient, EngineError


class PromptCounter:
    def __init__(self, client: EngineClient, generation: Callable[[], int],
                 configured_max_len: Callable[[], int | None]) -> None:
        self.client, self.generation = client, generation
        self.configured_max_len = configured_max_len
        self.max_len: tuple[int, int | None] = (-1, None)  # (READY period, vLLM's max_model_len)

    async def tokens_if_long(self, parsed: Parsed, flight: Flight, limit: int | None,
                             always: bool = False) -> int | None:
        """The longest prompt's exact tokens when its byte bound exceeds ``limit`` (or
        ``always``); else the bound (None: not known, the engine judges it)."""
        if flight.tokens is None:
            if parsed.exact is not None:
                flight.tokens = parsed.exact
            elif parsed.longest is None:
                return None  # no prompt read here: the engine judges it
            elif ((limit is not None and parsed.upper_bound > limit)
                  or always) and parsed.countable:
                try:
                    flight.tokens = await self.client.tokenize(parsed.tokenize_body)
                except EngineError:
                    return None  # not known: the engine will judge it itself
            else:
                return parsed.upper_bound
        return flight.tokens

    async def engine_max_len(self) -> int | None:
        """vLLM's max_model_len as the engine of this READY period reports it (asked once per
        period)."""
        gen, value = self.max_len
        if gen != self.generation():
            try:
                value = await self.client.max_model_len()
            except (EngineError, KeyError, IndexError, TypeError):
                value = None
            value = value or self.configured_max_len()
            self.max_len = (self.generation(), value)
        return value

    def known_max_len(self) -> int | None:
        return self.max_len[1] or self.configured_max_len()
