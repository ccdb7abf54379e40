"""The woken spare's canary (issue 27, item 4): what counts as the same answer, and what breaks on wake."""

from __future__ import annotations

from supervisor.recovery.canary import LOGPROB_TOLERANCE, Canary, breaks_on_wake

BEFORE = Canary((" seven", ",", " eleven", ","), (-0.01, -0.2, -0.03, -0.1))


def test_the_same_tokens_within_a_numeric_wobble_are_the_same_answer() -> None:
    wobble = Canary(BEFORE.tokens, tuple(x + LOGPROB_TOLERANCE / 2 for x in BEFORE.logprobs))
    assert BEFORE.differs(wobble) is None and BEFORE.drift(wobble) < LOGPROB_TOLERANCE


def test_another_token_or_a_logprob_moved_by_whole_units_is_not() -> None:
    swapped = Canary((" seven", ",", " ELEVEN", ","), BEFORE.logprobs)
    assert "token 2 differs after the wake" in str(BEFORE.differs(swapped))
    shorter = Canary(BEFORE.tokens[:2], BEFORE.logprobs[:2])
    assert "token 2 differs" in str(BEFORE.differs(shorter))
    drifted = Canary(BEFORE.tokens, tuple(x - 1.5 for x in BEFORE.logprobs))
    assert "a logprob moved by 1.500" in str(BEFORE.differs(drifted))


def test_engine_arguments_known_to_break_on_wake_refuse_a_spare() -> None:
    assert "LoRA adapters" in str(breaks_on_wake({"enable_lora": True}))
    assert "speculative decoding" in str(breaks_on_wake({"speculative_config": {"method": "ngram"}}))
    assert "native KV offload" in str(breaks_on_wake({"kv-offloading-size": 16}))
    assert breaks_on_wake({"enable_lora": False, "max_loras": 2}) is None
