"""A second engine that died of a spoiled compile cache: the cache moved aside before the engine dies of it, once
until a READY, and the rungs that died of it not held against them (decide/spoiled_cache.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from supervisor.decide.classify import spoils_compile_cache
from supervisor.decide.spoiled_cache import after_a_second_engines_death

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-logs"  # real vLLM logs, unedited


@pytest.mark.parametrize(
    ("spoiled", "launched_at", "aside_at", "ready_at", "set_aside", "held"),
    [
        (False, 10.0, None, None, False, True),  # its own failure, as before
        (False, 10.0, 5.0, None, False, True),
        (True, 10.0, None, None, True, False),  # the first to see it, before any READY (a start building first)
        (True, 10.0, None, 3.0, True, False),  # beside a serving engine
        (True, 10.0, 12.0, None, False, False),  # the cache went aside while it started: it died on the old one
        (True, 10.0, 10.0, None, False, False),
        (True, 10.0, 5.0, None, False, True),  # launched on the cache made anew, no READY since: not the cache
        (True, 10.0, 5.0, 4.0, False, True),  # a READY before the set-aside does not count
        (True, 10.0, 5.0, 7.0, True, False),  # a READY since: the cache may be spoiled again
    ],
)
def test_what_a_second_engines_death_of_a_spoiled_cache_calls_for(
        spoiled: bool, launched_at: float, aside_at: float | None, ready_at: float | None, set_aside: bool,
        held: bool) -> None:
    verdict = after_a_second_engines_death(spoiled, launched_at, aside_at, ready_at)
    assert (verdict.set_aside, verdict.held_against_rung) == (set_aside, held), verdict.why


def test_a_spoiled_cache_is_read_from_vllms_own_line_on_the_h100() -> None:
    lines = (FIXTURES / "h100-vllm0.26-supervised-startup-spoiled-compile-cache.log").read_text().splitlines()
    assert any(map(spoils_compile_cache, lines))
    ok = (FIXTURES / "h200-vllm0.26-startup-ok.log").read_text().splitlines()
    assert not any(map(spoils_compile_cache, ok))
