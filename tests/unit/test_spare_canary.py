"""The woken spare's canary (issue 27, item 4): what counts as the same answer, and what breaks on wake."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from supervisor.config import WarmupConfig
from supervisor.host.vllm_http import EngineError
from supervisor.profile import Profile
from supervisor.recovery.canary import LOGPROB_TOLERANCE, Canary, breaks_on_wake
from supervisor.recovery.spare import Spare, SpareFailed

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


class WarmingClient:
    """The woken spare's engine: records each warm-up request, and how many ran at once."""

    def __init__(self, fail: bool = False) -> None:
        self.asked: list[tuple[str | None, int]] = []
        self.running = self.most = 0
        self.fail = fail

    async def count_tokens(self, text: str, timeout: float = 30.0) -> int:
        return len(text.split())

    async def complete(self, prompt: str, max_tokens: int, timeout: float, request_id: str | None = None) -> Any:
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0)  # every request of a round is in flight before any ends
        self.running -= 1
        if self.fail:
            raise EngineError("HTTP 500")
        self.asked.append((request_id, max_tokens))
        return {"choices": [{"text": "x"}]}


def woken_spare(tmp_path: Path, client: WarmingClient) -> Spare:
    unused: Any = None  # no process behind it: only its client is asked
    return Spare(child=unused, profile=Profile(max_num_batched_tokens=6144), url="http://127.0.0.1:1", work=tmp_path,
                 tail=unused, drains=[], client=client, host=unused, state_dir=str(tmp_path))  # type: ignore[arg-type]


async def test_a_spare_woken_beside_warms_up_its_rungs_prompts_in_one_round_of_one_token_each(tmp_path: Path) -> None:
    """What tests/standin/test_spare.py read from the woken spare's log before its warm-up moved to the wake (its
    lines before its start adopts it are not relayed): the plan's prompts, all at once, each for one token (its
    canary has just proven its decode), whatever [warmup] concurrency and max_tokens say."""
    client = WarmingClient()
    spare = woken_spare(tmp_path, client)
    await spare.warm_up(WarmupConfig(concurrency=2, max_tokens=8))
    assert [tokens for _, tokens in client.asked] == [1, 1, 1, 1], client.asked
    assert sorted(rid or "" for rid, _ in client.asked) == [f"warmup-{i}" for i in range(4)]
    assert client.most == 4  # one round
    assert spare.warmed is not None and spare.warmed.tokens == [1536, 2048, 2560, 3072]
    assert spare.warmup_s is not None


async def test_a_woken_spares_failed_warm_up_is_the_spares_failure(tmp_path: Path) -> None:
    spare = woken_spare(tmp_path, WarmingClient(fail=True))
    with pytest.raises(SpareFailed, match="its warm-up after the wake failed: warm-up request"):
        await spare.warm_up(WarmupConfig())
    assert spare.warmed is None and spare.warmup_s is None
