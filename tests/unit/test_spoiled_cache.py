"""A second engine that died of a spoiled compile cache: the cache moved aside before the engine dies of it, once
until a READY, and the rungs that died of it not held against them (decide/spoiled_cache.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from supervisor.decide.classify import says_port_taken, spoils_compile_cache
from supervisor.decide.spoiled_cache import PORT_TAKEN_TRIES, after_a_second_engines_death

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


@pytest.mark.parametrize(
    ("spoiled", "port_taken", "before", "again", "held", "set_aside"),
    [
        (False, True, 0, True, False, False),  # chance: another process took the port during vLLM's imports
        (False, True, PORT_TAKEN_TRIES - 2, True, False, False),
        (False, True, PORT_TAKEN_TRIES - 1, False, True, False),  # taken every time: a port fixed for all engines
        (False, True, PORT_TAKEN_TRIES + 4, False, True, False),
        (False, False, 0, False, True, False),  # its own failure: held, never started again at once
        (False, False, PORT_TAKEN_TRIES, False, True, False),
        (True, True, 0, False, False, True),  # the spoiled cache explains it first: moved aside, not started again
    ],
)
def test_a_second_engine_whose_port_was_taken_is_started_again_until_it_is_taken_every_time(
        spoiled: bool, port_taken: bool, before: int, again: bool, held: bool, set_aside: bool) -> None:
    verdict = after_a_second_engines_death(spoiled, 10.0, None, None, port_taken, before)
    assert (verdict.again, verdict.held_against_rung, verdict.set_aside) == (again, held, set_aside), verdict.why


def test_a_taken_port_is_read_from_the_oss_words_and_from_no_other_failure() -> None:
    taken = (FIXTURES / "cpu-vllm0.32-startup-port-taken.log").read_text().splitlines()
    assert [line for line in taken if says_port_taken(line)] == ["OSError: [Errno 98] Address already in use"]
    # aiohttp's words (the stand-in's bind) and ZMQ's (vLLM's internal ports)
    assert says_port_taken("OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): "
                           "address already in use")
    assert says_port_taken("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5570')")
    for name in ("h200-vllm0.26-startup-ok.log", "h200-vllm0.26-runtime-cuda-oom.log",
                 "h100-vllm0.26-supervised-startup-spoiled-compile-cache.log",
                 "h200-vllm0.26-spare-sleep-wake.log"):
        assert not any(map(says_port_taken, (FIXTURES / name).read_text().splitlines())), name
