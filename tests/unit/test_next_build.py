"""Issue 37, item 1: what to build ahead is one pure decision (recovery/next_build.py), tested as a table.

The card is the H200 of docs/runs/ (140 GiB); the model the seed's GLM-4-9B shape: a second engine of it needs about
21 GiB before its KV cache (18.8 GB of weights, a rung's prefill, context and graphs), one sequence's KV cache at
128k about 5.3 GiB. Every default is the shipped one ([recovery], [ladder] floor 0.3, 1 GiB of start headroom).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from supervisor.bounds import GIB
from supervisor.config import RecoveryConfig
from supervisor.host.gpu import DeviceSnapshot
from supervisor.profile import Profile
from supervisor.recovery.next_build import Action, Facts, Moment, next_step
from supervisor.recovery.sizing import SecondEngine

TOTAL = 140 * GIB
GLM9B = SecondEngine(weights=int(18.8e9), need=21 * GIB)
KV_128K = int(5.3 * GIB)


def rung(chunk: int, util: float) -> Profile:
    return Profile(max_num_batched_tokens=chunk, gpu_memory_utilization=util)


def card(free_gib: float, total: int = TOTAL) -> tuple[DeviceSnapshot, ...]:
    free = int(free_gib * GIB)
    return (DeviceSnapshot(0, total, free, total - free, ()),)


def h100(free_gib: float) -> tuple[DeviceSnapshot, ...]:
    """An H100 of docs/runs/ run 13 (79.65 GiB), ``free_gib`` of it free."""
    return card(free_gib, int(79.65 * GIB))


def serving(util: float, other_gib: float = 0.0) -> tuple[DeviceSnapshot, ...]:
    """The card while an engine at ``util`` serves (and another process holds ``other_gib``)."""
    return card(140 - util * 140 - other_gib)


def facts(moment: Moment, util: float, the_card: tuple[DeviceSnapshot, ...] | None, **over: Any) -> Facts:
    engine = rung(8192, util)
    targets = (rung(4096, util), rung(2048, util), rung(1024, util))
    within = (engine, *targets)
    base = Facts(moment, RecoveryConfig(), engine, targets, card=the_card,
                 sizes={p.compile_key(): GLM9B for p in within}, kv={p.compile_key(): KV_128K for p in within},
                 ram_available=500 * GIB, cpus=16, headroom=GIB, floor=0.3, waited_s=600.0,
                 restart_uncompiled=True)
    return replace(base, **over)


def compiled(*chunks: int) -> frozenset[str]:
    return frozenset(rung(c, 0.9).compile_key() for c in chunks)  # the utilization is not part of the compile key


ALL = compiled(8192, 4096, 2048, 1024)
READY, BEFORE, AFTER_COMPILES = Moment.READY, Moment.BEFORE_START, Moment.BEFORE_START_COMPILED
FIRST = RecoveryConfig(precompile_order="first")  # the operator asks READY to wait for every rung within reach
SPARE_FIRST = RecoveryConfig(spare_order="auto")  # ... for a spare where none fits beside (the order before issue 38)

# (case, facts, the action, the rung's chunk or the rungs compiled first, a phrase of the reason)
CASES: list[tuple[str, Facts, Action, Any, str]] = [
    # ---- while the engine serves ----
    ("the H200 at 0.5: a spare fits beside the engine", facts(READY, 0.5, serving(0.5)),
     Action.SPARE, 4096, "holds a spare beside the engine"),
    ("the H200 at 0.6: a spare at what is left", facts(READY, 0.6, serving(0.6)),
     Action.SPARE, 4096, "holds a spare beside the engine"),
    ("the H200 at 0.9: neither a spare nor a throwaway fits beside",
     facts(READY, 0.9, serving(0.9), compiled=ALL - compiled(2048)),
     Action.NOTHING, None, "a throwaway needs"),
    ("the shared card (47 % held by another process) at 0.4", facts(READY, 0.4, serving(0.4, other_gib=66)),
     Action.NOTHING, None, "it needs at least 0.3"),
    ("a spare kept at 0.5: the next rung not compiled is compiled beside, in half of what is free",
     facts(READY, 0.5, serving(0.5), spare_kept=True, compiled=compiled(8192, 4096)),
     Action.COMPILE, 2048, "holds a throwaway"),
    ("a spare kept and every rung compiled", facts(READY, 0.5, serving(0.5), spare_kept=True, compiled=ALL),
     Action.NOTHING, None, "every rung within reach is compiled"),
    ("READY for 10 s of precompile_idle_s (30 s)", facts(READY, 0.5, serving(0.5), waited_s=10.0),
     Action.WAIT, None, "asked in 20s"),
    ("after a failure's restart, READY for 1 s: the next spare at once, not after precompile_idle_s (issue 38, "
     "item 4)", facts(READY, 0.5, serving(0.5), waited_s=1.0, after_failure=True),
     Action.SPARE, 4096, "at READY, not after precompile_idle_s: the engine serves after a failure's restart"),
    ("after a failure's restart at 0.9: no spare fits beside, so the rest still waits for precompile_idle_s",
     facts(READY, 0.9, serving(0.9), waited_s=1.0, after_failure=True),
     Action.WAIT, None, "a memory failure's restart is a start"),
    ("after a failure's restart with no GPU: a spare is never built, a precompile waits for the idle time",
     facts(READY, 0.9, (), sizes={}, kv={}, cpus=2, waited_s=1.0, after_failure=True),
     Action.WAIT, None, "asked in 29s"),
    ("after a failure's restart, a spare kept asleep already (a death at the same rung): nothing new yet",
     facts(READY, 0.5, serving(0.5), waited_s=1.0, after_failure=True, spare_kept=True),
     Action.WAIT, None, "asked in 29s"),
    ('spare = "on" at 0.9 after a failure\'s restart: none fits beside, so none is started at utilization 0.0 (a '
     "stand-in test saw one started at 0.0)",
     facts(READY, 0.9, serving(0.9), waited_s=1.0, after_failure=True, recovery=RecoveryConfig(spare="on")),
     Action.WAIT, None, "under the ladder's floor"),
    ('spare = "on" at 0.9 after precompile_idle_s, every rung compiled: nothing, not a spare at 0.0',
     facts(READY, 0.9, serving(0.9), compiled=ALL, recovery=RecoveryConfig(spare="on")),
     Action.NOTHING, None, "under the ladder's floor"),
    ('spare = "on" at 0.5: a spare at what is left beside the engine, auto\'s checks skipped',
     facts(READY, 0.5, serving(0.5), sizes={}, kv={}, recovery=RecoveryConfig(spare="on")),
     Action.SPARE, 4096, '[recovery] spare = "on"'),
    ("a second engine is being built", facts(READY, 0.5, serving(0.5), building=True),
     Action.BUSY, None, "being built"),
    ("after a failover: the rung's spare failed, so it is precompiled plainly",
     facts(READY, 0.5, serving(0.5), failed={rung(4096, 0.5).compile_key(): "spare"}),
     Action.COMPILE, 4096, "holds a throwaway"),
    ("a rung whose precompile failed is not tried again",
     facts(READY, 0.9, card(100), spare_kept=True, compiled=compiled(8192, 4096, 1024),
           failed={rung(2048, 0.9).compile_key(): "precompile"}),
     Action.NOTHING, None, "every rung within reach is compiled"),
    ("two cores and no GPU: no spare (sleep mode needs CUDA), the next rung compiled while idle",
     facts(READY, 0.9, (), sizes={}, kv={}, cpus=2),
     Action.COMPILE, 4096, "no GPU seen"),
    ("the GPU is lost", facts(READY, 0.5, None), Action.NOTHING, None, "the GPU is lost"),
    ("the first start found its own rung compiled: the next one at READY, not after precompile_idle_s",
     facts(READY, 0.5, serving(0.5), waited_s=0.0, at_ready=rung(4096, 0.5), compiled=compiled(8192)),
     Action.COMPILE, 4096, "at READY, not after precompile_idle_s"),
    ("spare and precompile off", facts(READY, 0.5, serving(0.5),
                                       recovery=RecoveryConfig(spare="off", precompile="off")),
     Action.NOTHING, None, 'spare = "off"'),
    ("auto without a [gateway]: no spare (only the gateway follows its port)",
     facts(READY, 0.5, serving(0.5), gateway=False, spare_kept=False, compiled=ALL),
     Action.NOTHING, None, "no [gateway]"),
    ("a model of unknown size (a hub name): nothing on a GPU", facts(READY, 0.5, serving(0.5), sizes={}),
     Action.NOTHING, None, "not a local directory"),
    # ---- before a planned start ----
    ("a fresh host at 0.9: nothing first, the engine compiles its own rung in its start and a failure's restart is "
     "uncompiled, so READY waits for no second engine (issue 38, item 1)",
     facts(BEFORE, 0.9, card(139), first_start=True),
     Action.NOTHING, None, "no failure waits for the next rung's compile"),
    ('uncompiled_restart = "off", a fresh host at 0.9: the start\'s own rung and the next failure\'s first, side by '
     "side (a failure in the minutes after READY would compile on its path)",
     facts(BEFORE, 0.9, card(139), first_start=True, restart_uncompiled=False),
     Action.COMPILE_FIRST, [8192, 4096], "in about the time the engine would compile its own"),
    ('precompile_order = "first", a fresh host at 0.9: every rung within reach first, four at once on 16 cores',
     facts(BEFORE, 0.9, card(139), first_start=True, recovery=FIRST),
     Action.COMPILE_FIRST, [8192, 4096, 2048, 1024], "4 at a time"),
    ("a fresh host at 0.5: nothing first, every rung beside the engine",
     facts(BEFORE, 0.5, card(139), first_start=True),
     Action.NOTHING, None, "beside the engine: half of the"),
    ('uncompiled_restart = "off", a fresh host at 0.5: the start\'s own rung and the next failure\'s first, the rest '
     "beside it", facts(BEFORE, 0.5, card(139), first_start=True, restart_uncompiled=False),
     Action.COMPILE_FIRST, [8192, 4096], "the start's own rung and the next memory failure's"),
    ("the field report's shared card on an H100 (run 13: 41.4 of 79.65 GiB free), a fresh host at 0.4: nothing first",
     facts(BEFORE, 0.4, h100(41.4), first_start=True),
     Action.NOTHING, None, "no failure waits for the next rung's compile"),
    ('uncompiled_restart = "off", the same card: one throwaway at a time holds only the start\'s own rung, which the '
     "engine compiles in its own start, so nothing first (run 13 compiled it first, then started the engine: READY "
     "14 s later for nothing)", facts(BEFORE, 0.4, h100(41.4), first_start=True, restart_uncompiled=False),
     Action.NOTHING, None, "only the start's own rung would be compiled first"),
    ('precompile_order = "first", the same card: every rung within reach, one at a time',
     facts(BEFORE, 0.4, h100(41.4), first_start=True, recovery=FIRST),
     Action.COMPILE_FIRST, [8192, 4096, 2048, 1024], "1 at a time"),
    ('uncompiled_restart = "off", a fresh host whose cache holds the next failure\'s rung but not its own: the engine '
     "compiles its own, nothing first", facts(BEFORE, 0.9, card(139), first_start=True,
                                             compiled=compiled(4096, 2048, 1024), restart_uncompiled=False),
     Action.NOTHING, None, "only the start's own rung would be compiled first"),
    ('uncompiled_restart = "off", a fresh host on two cores: two at once',
     facts(BEFORE, 0.9, card(139), first_start=True, cpus=2, restart_uncompiled=False),
     Action.COMPILE_FIRST, [8192, 4096], "2 at a time"),
    ('precompile_order = "first" on two cores: every rung, two at once',
     facts(BEFORE, 0.9, card(139), first_start=True, cpus=2, recovery=FIRST),
     Action.COMPILE_FIRST, [8192, 4096, 2048, 1024], "2 at a time"),
    ("a lost state directory whose rungs vLLM's cache holds, at 0.9: nothing first, no spare first: READY waits "
     "for nothing, /status says what the window costs", facts(BEFORE, 0.9, card(139), first_start=True, compiled=ALL,
                                                              last_start_s=17.4),
     Action.NOTHING, None, "a memory failure's restart is a start (the last start took 17s)"),
    ('spare_order = "auto", the same: the spare first', facts(BEFORE, 0.9, card(139), first_start=True,
                                                            compiled=ALL, recovery=SPARE_FIRST),
     Action.SPARE, 4096, "building it first"),
    ("a restart at 0.9 whose next rung is not compiled: nothing first (it would hold READY for a whole compile)",
     facts(BEFORE, 0.9, card(139), compiled=compiled(8192)),
     Action.NOTHING, None, "none first: the start would wait for them"),
    ("a reboot at 0.5 (its own rung compiled, not the next): nothing first, the next at READY",
     facts(BEFORE, 0.5, card(139), first_start=True, compiled=compiled(8192)),
     Action.NOTHING, None, "beside the engine"),
    ("the rungs compiled first at 0.9: no spare first by default", facts(AFTER_COMPILES, 0.9, card(139), compiled=ALL),
     Action.NOTHING, None, "one built first would hold this start's READY"),
    ('spare_order = "auto", the rungs compiled first at 0.9: the spare\'s turn',
     facts(AFTER_COMPILES, 0.9, card(139), compiled=ALL, recovery=SPARE_FIRST),
     Action.SPARE, 4096, "building it first"),
    ("at 0.9 while serving: no spare beside, and /status says what the window costs",
     facts(READY, 0.9, serving(0.9), compiled=ALL, last_start_s=15.5),
     Action.NOTHING, None, "a memory failure's restart is a start (the last start took 16s)"),
    ("a climb at 0.6 with a spare asleep: nothing before the engine", facts(BEFORE, 0.6, card(137), spare_kept=True,
                                                                          compiled=ALL),
     Action.NOTHING, None, "no rung to compile first"),
    ("the shared card at 0.4 before a restart, its own rung compiled: nothing first",
     facts(BEFORE, 0.4, card(73), compiled=compiled(8192)),
     Action.NOTHING, None, "none fits beside the engine"),
    ('precompile_order = "first", the same: two throwaways at once in what the other process left',
     facts(BEFORE, 0.4, card(73), compiled=compiled(8192), recovery=FIRST),
     Action.COMPILE_FIRST, [4096, 2048, 1024], "2 at a time"),
    ("nothing fits: another process holds all but 20 GiB", facts(BEFORE, 0.9, card(20)),
     Action.NOTHING, None, "neither beside the engine"),
    ("two cores and no GPU before a start: everything beside the engine", facts(BEFORE, 0.9, (), cpus=2),
     Action.NOTHING, None, "no rung to compile first"),
    # ---- a climb (time) or reset-profile wanted while the engine serves (issue 38, item 2) ----
    ("a climb at 0.5 after a failover: its rung's spare first, beside the serving engine",
     facts(READY, 0.5, serving(0.5), engine=rung(4096, 0.5), targets=(rung(2048, 0.5),),
           climb=rung(8192, 0.5), compiled=ALL),
     Action.SPARE, 8192, "its spare first, beside the serving engine"),
    ("the climb's spare sleeps: the climb goes, a wake", facts(
        READY, 0.5, serving(0.5, other_gib=2), engine=rung(4096, 0.5), climb=rung(8192, 0.5),
        spare_kept=True, kept=rung(8192, 0.48)),
     Action.CLIMB, None, "so the climb is a wake"),
    ("the spare kept is another rung's (the next failure's): the climb's is built, not taken",
     facts(READY, 0.5, serving(0.5), engine=rung(4096, 0.5), climb=rung(8192, 0.5), spare_kept=False,
           kept=None, compiled=ALL),
     Action.SPARE, 8192, "its spare first"),
    ("a climb while a precompile is being built waits for it", facts(
        READY, 0.5, serving(0.5), engine=rung(4096, 0.5), climb=rung(8192, 0.5), building=True),
     Action.BUSY, None, "the climb to (--max-num-batched-tokens 8192"),
    ("the H200 at 0.9: no spare fits beside, so the climb is a start (as before)",
     facts(READY, 0.9, serving(0.9), engine=rung(4096, 0.9), climb=rung(8192, 0.9), compiled=ALL),
     Action.CLIMB, None, "is a start: no spare of its rung"),
    ("the shared card at 0.4: the climb is a start", facts(
        READY, 0.4, serving(0.4, other_gib=66), engine=rung(4096, 0.4), climb=rung(8192, 0.4)),
     Action.CLIMB, None, "is a start"),
    ('spare = "off": the climb is a start', facts(
        READY, 0.5, serving(0.5), engine=rung(4096, 0.5), climb=rung(8192, 0.5),
        recovery=RecoveryConfig(spare="off")),
     Action.CLIMB, None, 'spare = "off"'),
    ("the utilization back after a woken spare's 0.47: a spare at 0.5 fits beside, so it is built",
     facts(READY, 0.47, serving(0.47), engine=rung(4096, 0.47), climb=rung(4096, 0.5)),
     Action.SPARE, 4096, "its spare first"),
    ("the utilization back where the spare would get no more than the engine has: a start",
     facts(READY, 0.55, serving(0.55), engine=rung(4096, 0.55), climb=rung(4096, 0.6),
           recovery=RecoveryConfig(spare="on")),
     Action.CLIMB, None, "no more than the engine's 0.55 fits beside it"),
    ("no GPU (two cores): the climb is a start", facts(
        READY, 0.9, (), sizes={}, kv={}, cpus=2, engine=rung(4096, 0.9), climb=rung(8192, 0.9)),
     Action.CLIMB, None, "no GPU seen"),
    ('spare_order = "beside" at 0.9: no spare first', facts(AFTER_COMPILES, 0.9, card(139), compiled=ALL,
                                                           recovery=RecoveryConfig(spare_order="beside")),
     Action.NOTHING, None, "nothing to build before the engine"),
]


@pytest.mark.parametrize(("case", "f", "action", "what", "why"), CASES, ids=[c[0] for c in CASES])
def test_what_is_built_ahead(case: str, f: Facts, action: Action, what: Any, why: str) -> None:
    step = next_step(f)
    reasons = " | ".join(str(w) for w in (step.why, step.spare_why, step.compile_why) if w)
    assert step.action is action, (case, step)
    assert why in reasons, (case, reasons)
    if action is Action.COMPILE_FIRST:
        assert step.plan is not None
        assert [p.max_num_batched_tokens for p in step.plan.rungs] == what
    elif action in (Action.SPARE, Action.COMPILE):
        assert step.rung is not None and step.rung.max_num_batched_tokens == what


def test_a_throwaway_beside_the_engine_starts_at_half_of_what_is_free_a_spare_within_it() -> None:
    """The utilization a second engine starts at is the card's, never above the rung's own."""
    step = next_step(facts(READY, 0.5, serving(0.5), spare_kept=True, compiled=compiled(8192, 4096)))
    assert step.rung is not None and step.rung.gpu_memory_utilization == 0.25  # half of the 50 % left
    spare = next_step(facts(READY, 0.6, serving(0.6)))
    assert spare.rung is not None and spare.rung.gpu_memory_utilization == pytest.approx(0.38)
    first = next_step(facts(AFTER_COMPILES, 0.9, card(139), compiled=ALL, recovery=SPARE_FIRST))
    assert first.rung is not None and first.rung.gpu_memory_utilization == 0.9
    assert first.order is not None and first.order.order == "first"


def test_the_first_start_that_found_its_own_rung_compiled_asks_for_the_next_at_ready() -> None:
    step = next_step(facts(BEFORE, 0.5, card(139), first_start=True, compiled=compiled(8192)))
    assert step.at_ready is not None and step.at_ready.max_num_batched_tokens == 4096
    for util in (0.9, 0.5):  # its own rung compiled in its start: the next from READY, where it fits
        fresh = next_step(facts(BEFORE, util, card(139), first_start=True))
        assert fresh.at_ready is not None and fresh.at_ready.max_num_batched_tokens == 4096, util
    later = next_step(facts(BEFORE, 0.5, card(139), first_start=False, compiled=compiled(8192)))
    assert later.at_ready is None  # a later planned start holds no client for it: it waits for idleness


def test_a_climbs_spare_starts_at_what_fits_beside_never_above_the_climbs_own_utilization() -> None:
    """The utilization climb after a woken spare (0.47 -> 0.5) gets a spare at 0.5, not more: it wakes into
    what the engine frees; the rung climb's spare is at the climb's rung, whatever the next failure's is."""
    back = next_step(facts(READY, 0.47, serving(0.47), engine=rung(4096, 0.47), climb=rung(4096, 0.5)))
    assert back.rung == rung(4096, 0.5)
    up = next_step(facts(READY, 0.5, serving(0.5), engine=rung(4096, 0.5), climb=rung(8192, 0.5)))
    assert up.rung is not None and up.rung.compile_key() == rung(8192, 0.5).compile_key()
    assert up.rung.gpu_memory_utilization is not None and up.rung.gpu_memory_utilization <= 0.5


# (case, facts, whether the next spare's standby should import now)
SPARE_SOON: list[tuple[str, Facts, bool]] = [
    ("the H200 at 0.5, READY 10 s of precompile_idle_s: the spare is built in 20 s, its standby imports now",
     facts(READY, 0.5, serving(0.5), waited_s=10.0), True),
    ("the H200 at 0.5, precompile_idle_s over: the spare is built now", facts(READY, 0.5, serving(0.5)), True),
    ("the H200 at 0.9: no spare fits beside, so no standby for one", facts(READY, 0.9, serving(0.9), waited_s=10.0),
     False),
    ("the shared card at 0.4: none fits beside", facts(READY, 0.4, serving(0.4, other_gib=66), waited_s=10.0), False),
    ('[recovery] spare = "off"', facts(READY, 0.5, serving(0.5), waited_s=10.0, recovery=RecoveryConfig(spare="off")),
     False),
    ("a spare kept: none to build", facts(READY, 0.5, serving(0.5), waited_s=10.0, spare_kept=True), False),
    ("a climb's spare fits beside the engine", facts(READY, 0.5, serving(0.5), engine=rung(4096, 0.5),
                                                      climb=rung(8192, 0.5)), True),
]


@pytest.mark.parametrize(("case", "f", "soon"), SPARE_SOON, ids=[c[0] for c in SPARE_SOON])
def test_the_next_spares_standby_is_asked_where_a_spare_fits_beside_the_engine(case: str, f: Facts,
                                                                              soon: bool) -> None:
    """Issue 38, item 4: a spare's build starts from a standby of its own, which imports while the engine has not
    yet been READY precompile_idle_s; where no spare fits beside (vLLM's default 0.9, the shared card) none is
    made: a standby nobody takes holds host memory."""
    assert next_step(f).spare_fits is soon, case


def test_a_build_beside_counts_the_rungs_within_reach_compiled_of_all() -> None:
    """Issue 38, item 6: "n of m" for a rung compiled beside the engine (/status `building_beside`)."""
    f = facts(Moment.READY, 0.5, serving(0.5), compiled=compiled(8192, 4096))
    assert f.reach() == (2, 4)  # the engine's 8192, then 4096, 2048, 1024 where a failure goes
    assert replace(f, climb=rung(16384, 0.5)).reach() == (2, 5)  # a reset-profile's rung above is within reach
    assert replace(f, targets=(), compiled=frozenset()).reach() == (0, 1)


def test_with_every_rung_compiled_status_says_so_not_that_it_was_not_asked() -> None:
    """Found trying it as a new user on a host whose vLLM cache held every rung (item 3): /status said "not asked
    yet: the engine has not been idle long enough" for as long as the engine served."""
    step = next_step(facts(READY, 0.5, (), compiled=ALL))
    assert step.action is Action.NOTHING and step.compile_why == "every rung within reach is compiled", step
    step = next_step(facts(READY, 0.5, (), compiled=compiled(8192)))
    assert step.action is Action.COMPILE and step.compile_why != "every rung within reach is compiled"
