"""A spare's build takes the spare standby pool's interpreter (recovery/standby.py ``take_imported``): once its
imports are done; one still importing is waited for, within STANDBY_IMPORT_WAIT_S; none, or one for another engine
config, means a cold spawn. On a virtual clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from supervisor.bounds import STANDBY_IMPORT_WAIT_S
from supervisor.config_file import parse
from supervisor.recovery.standby import SPARE, StandbyPool

from tests.helpers.clock import VirtualClock


class Standby:
    """An interpreter importing vLLM until ``imported_at`` (never, when None); ``fits``: made for the engine config
    in force."""

    def __init__(self, clock: VirtualClock, imported_at: float | None, fits: bool = True) -> None:
        self.clock, self.imported_at, self._fits = clock, imported_at, fits

    def import_s(self) -> float | None:
        done = self.imported_at is not None and self.clock.now >= self.imported_at
        return self.imported_at if done else None

    def fits(self, engine: Any, vllm_env: Any) -> bool:
        return self._fits


def taken(standby: Standby | None, clock: VirtualClock, standby_on: bool = True) -> tuple[object, float, object]:
    """What the build got, when (virtual seconds), and what the pool still holds."""
    cfg = parse({"engine": {"model": "m"}, "recovery": {"standby": standby_on}})
    pool = StandbyPool(cfg, clock, lambda _: None, role=SPARE)  # type: ignore[arg-type]
    pool.standby = standby  # type: ignore[assignment]
    got = asyncio.run(pool.take_imported())
    return got, clock.now, pool.standby


# (case, the standby's import done at (None: never), it fits, [recovery] standby, taken, at, left in the pool)
CASES: list[tuple[str, float | None, bool, bool, bool, float, bool]] = [
    ("imported: taken at once", 0.0, True, True, True, 0.0, False),
    ("still importing for 12 s: waited for, then taken", 12.0, True, True, True, 12.0, False),
    ("imports that never end: a cold spawn after STANDBY_IMPORT_WAIT_S", None, True, True, False,
     STANDBY_IMPORT_WAIT_S, True),
    ("made for another engine config (a reload): a cold spawn, at once", 0.0, False, True, False, 0.0, True),
    ("[recovery] standby off: a cold spawn, at once", 0.0, True, False, False, 0.0, True),
]


@pytest.mark.parametrize(("case", "imported_at", "fits", "standby_on", "is_taken", "at", "left"), CASES,
                         ids=[c[0] for c in CASES])
def test_a_spares_build_takes_its_standby_once_imported(case: str, imported_at: float | None, fits: bool,
                                                        standby_on: bool, is_taken: bool, at: float,
                                                        left: bool) -> None:
    clock = VirtualClock()
    standby = Standby(clock, imported_at, fits)
    got, when, kept = taken(standby, clock, standby_on)
    assert (got is standby) is is_taken, case
    assert when == pytest.approx(at, abs=0.25), case
    assert (kept is standby) is left, case


def test_no_standby_is_a_cold_spawn_at_once() -> None:
    clock = VirtualClock()
    assert taken(None, clock) == (None, 0.0, None)


# The engine's pool with a reserve (a GPU host): (case, the standby imported, the reserve: None, "imported",
# "importing" or "unfit", which one the start takes, which one is the next standby)
RESERVE_CASES: list[tuple[str, bool, str | None, str, str | None]] = [
    ("no reserve: the standby, importing or not", False, None, "standby", None),
    ("both imported: the standby; the reserve is the next", True, "imported", "standby", "reserve"),
    ("the standby still importing, the reserve done: the reserve (a second death right after a restart)", False,
     "imported", "reserve", "standby"),
    ("both importing: the standby, the older one", False, "importing", "standby", "reserve"),
    ("the reserve made for another engine config: the standby", False, "unfit", "standby", "reserve"),
]


@pytest.mark.parametrize(("case", "standby_done", "reserve", "taken_one", "next_one"), RESERVE_CASES,
                         ids=[c[0] for c in RESERVE_CASES])
def test_a_start_takes_whichever_standby_has_imported(case: str, standby_done: bool, reserve: str | None,
                                                      taken_one: str, next_one: str | None) -> None:
    clock = VirtualClock()
    cfg = parse({"engine": {"model": "m"}, "recovery": {"standby": True}})
    pool = StandbyPool(cfg, clock, lambda _: None)  # type: ignore[arg-type]
    made = {"standby": Standby(clock, 0.0 if standby_done else None)}
    if reserve is not None:
        made["reserve"] = Standby(clock, None if reserve == "importing" else 0.0, fits=reserve != "unfit")
    pool.standby, pool.reserve = made["standby"], made.get("reserve")  # type: ignore[assignment]
    assert pool.take() is made[taken_one], case
    assert pool.standby is (made[next_one] if next_one else None) and pool.reserve is None, case
