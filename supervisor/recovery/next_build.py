"""What to build ahead next: one pure decision, from the facts ``Ahead`` gathers, to one step with
its reason.

Three moments ask it. While the engine serves (``READY``, once a tick): a spare for the rung the
next memory failure picks, else a precompile of the next rung not compiled, each only where it fits
beside the engine. Before a planned start (``BEFORE_START``): by default only what the start would
not wait for (the first start's own rung and the next failure's, side by side, when the engine would
compile its own anyway and a failure's restart would compile the next: with ``uncompiled_restart``,
none); every rung within reach with ``precompile_order = "first"``; then
(``BEFORE_START_COMPILED``, with the card read again) the spare first, only where the operator asked
for that order (``spare_order`` "first" or "auto") and it would not fit beside. A planned start the
user waits for is never held for a second engine by default (issue 38, item 1). Every card rule it
applies is recovery/sizing.py's; the classes around it only carry the step out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from supervisor.config import SPARE_NEEDS_GATEWAY, RecoveryConfig
from supervisor.host.gpu import DeviceSnapshot, free_fraction
from supervisor.profile import Knob, Profile
from supervisor.recovery.sizing import (
    CompileFirst,
    Order,
    SecondEngine,
    choose_order,
    fits_beside,
    host_refusal,
    plan_first,
    room_for_spare,
    room_for_throwaway,
)


class Moment(Enum):
    READY = "ready"  # the engine serves
    BEFORE_START = "before_start"  # a planned start, before its engine: nothing compiled first yet
    # ... the rungs compiled first (or none to): the spare's turn
    BEFORE_START_COMPILED = "before_start_compiled"


class Action(Enum):
    BUSY = "busy"  # a second engine is being built: nothing new
    WAIT = "wait"  # not yet (precompile_idle_s)
    SPARE = "spare"  # build a spare at ``rung`` (its utilization set), beside the engine or first
    COMPILE = "compile"  # a throwaway compiles ``rung`` beside the serving engine
    COMPILE_FIRST = "compile_first"  # throwaways compile ``plan.rungs`` before the engine
    # the climb asked for (``Facts.climb``) may go now: its spare sleeps, or none can be had
    CLIMB = "climb"
    NOTHING = "nothing"


@dataclass(frozen=True)
class Facts:
    """Everything the decision reads; nothing in it is asked of the OS."""

    moment: Moment
    recovery: RecoveryConfig
    engine: Profile  # the serving engine's rung, or the one a planned start is about to start at
    # where a failure at ``engine`` goes, other than its own rung; the first: the spare's
    targets: tuple[Profile, ...]
    # compile keys vLLM's cache holds for this vLLM and these arguments
    compiled: frozenset[str] = frozenset()
    # compile key -> "spare" | "precompile" (FailedRungs)
    failed: Mapping[str, str] = field(default_factory=dict)
    card: tuple[DeviceSnapshot, ...] | None = ()  # () no GPU seen; None the GPU is lost
    # compile key -> a second engine's size
    sizes: Mapping[str, SecondEngine | None] = field(default_factory=dict)
    # compile key -> one sequence's KV cache per rank
    kv: Mapping[str, int | None] = field(default_factory=dict)
    ram_available: int = 0
    cpus: int = 1
    ranks: int = 1
    headroom: int = 0  # [gpu] start_headroom_bytes
    floor: float = 0.0  # [ladder] gpu_memory_utilization_floor
    gateway: bool = True  # a [gateway] fronts the engine (a spare's port is followed only by it)
    breaks_on_wake: str | None = None  # what in [engine.args] breaks an engine woken from sleep
    spare_kept: bool = False
    kept: Profile | None = None  # the spare kept: its rung and the utilization it wakes at
    building: bool = False
    # a climb (time) or reset-profile wanted, while the engine serves: the rung it starts at
    climb: Profile | None = None
    # asked by the first start: compile it the moment the engine is READY
    at_ready: Profile | None = None
    waited_s: float = 0.0  # READY for (a GPU host) or idle for (none): against precompile_idle_s
    first_start: bool = False  # the supervisor's first start on a GPU host (no READY yet)
    # the engine serves after a failure's restart (a failover's wake among them)
    after_failure: bool = False
    # the last start that woke no spare, to READY (what a restart costs)
    last_start_s: float | None = None
    # a served engine's failure restart that wakes no spare starts without torch.compile
    # (decide/compile_mode.py): no rung compiles on a failure's path
    restart_uncompiled: bool = False

    def reach(self) -> tuple[int, int]:
        """The rungs within reach (the engine's, where a failure goes, a climb's) that are
        compiled, and how many there are."""
        keys = {p.compile_key() for p in (self.engine, *self.targets, *filter(None, [self.climb]))}
        return len(keys & self.compiled), len(keys)

    def to_compile(self, rung: Profile) -> bool:
        """Not compiled for this vLLM, and no throwaway failed at it."""
        key = rung.compile_key()
        return key not in self.compiled and self.failed.get(key) != "precompile"


@dataclass(frozen=True)
class Step:
    action: Action
    why: str
    rung: Profile | None = None  # SPARE, COMPILE: at the utilization it starts at
    plan: CompileFirst | None = None  # COMPILE_FIRST; also how a planned start's rungs were weighed
    order: Order | None = None  # where the spare was weighed to be built (a planned start)
    wait_s: float = 0.0  # WAIT: how long until it asks again
    spare_why: str | None = None  # /status: why a spare is (not) built; None leaves the last one
    # /status: why the rungs are (not) compiled; None leaves the last one
    compile_why: str | None = None
    # BEFORE_START: the rung to compile beside the engine the moment it is READY
    at_ready: Profile | None = None
    # READY: a spare fits beside the engine now, built now or once precompile_idle_s is over (its
    # standby imports meanwhile)
    spare_fits: bool = False


def next_step(f: Facts) -> Step:
    if f.moment is Moment.READY:
        return _while_serving(f)
    if f.moment is Moment.BEFORE_START:
        return _before_start(f)
    return _spare_first(f, Step(Action.NOTHING, "nothing to build before the engine"))


# ---- while the engine serves ---------------------------------------------------------------------
def _while_serving(f: Facts) -> Step:
    if f.climb is not None:
        return _climb(f, f.climb)
    if f.building:
        return Step(Action.BUSY, "a second engine is being built")
    compile_why = None
    if f.at_ready is not None and f.to_compile(f.at_ready):
        ok, compile_why = _throwaway_fits(f, f.at_ready)
        if ok:
            why = (
                f"{compile_why}; the next memory failure's rung (max_num_batched_tokens "
                f"{f.at_ready.effective(Knob.MAX_NUM_BATCHED_TOKENS)}) at READY, not after "
                "precompile_idle_s: "
                "the first start found only its own rung compiled")
            return Step(Action.COMPILE, why, rung=_beside(f, f.at_ready), compile_why=why)
    wait = f.recovery.precompile_idle_s - f.waited_s
    # After a failure's restart on a GPU host the next spare is not kept waiting: deaths come in
    # runs (the field report's did), and its build (58-99 s on the H200) is the window already.
    spare_now = wait <= 0 or (f.after_failure and bool(f.card))
    spare_why = None
    if spare_now and f.targets and not f.spare_kept:
        util, spare_why = _spare_beside(f, f.targets[0])
        if util is not None:  # a spare compiles its rung too, compiled already or not
            if wait > 0:
                spare_why = (f"{spare_why}; at READY, not after precompile_idle_s: the engine "
                             "serves after a failure's restart")
            return Step(Action.SPARE, spare_why,
                        rung=f.targets[0].with_(gpu_memory_utilization=util), spare_why=spare_why,
                        spare_fits=True)
    if wait > 0:
        soon = (not spare_now and bool(f.targets) and not f.spare_kept
                and _spare_beside(f, f.targets[0])[0] is not None)
        return Step(Action.WAIT, f"asked in {wait:.0f}s (precompile_idle_s)", wait_s=wait,
                    spare_why=spare_why, compile_why=compile_why, spare_fits=soon)
    todo = [p for p in f.targets if f.to_compile(p)]
    # /status says so, not the "not asked yet" of before (vLLM's cache may hold every rung)
    compile_why = "every rung within reach is compiled"
    if todo:
        ok, compile_why = _throwaway_fits(f, todo[0])
        if ok:
            return Step(Action.COMPILE, compile_why, rung=_beside(f, todo[0]), spare_why=spare_why,
                        compile_why=compile_why)
    why = "; ".join(w for w in (spare_why, compile_why) if w)
    return Step(Action.NOTHING, why, spare_why=spare_why, compile_why=compile_why)


def _climb(f: Facts, target: Profile) -> Step:
    """A climb back (or reset-profile) is a planned start the clients wait through: where a spare
    of its rung fits beside the engine, it is built first, while the engine serves, and the
    climb then holds clients only for its wake (issue 38, item 2); where none can be had, the
    climb is a start, as before. A climb that only raises the utilization goes by a spare only
    when the spare gets more than the engine has."""
    now = f.engine.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.0
    same_rung = target.compile_key() == f.engine.compile_key()

    def gains(util: float) -> bool:
        return not same_rung or util > now

    knobs = " ".join(target.flags()) or "vLLM's defaults"
    kept = f.kept
    if kept is not None and kept.compile_key() == target.compile_key() and gains(
            kept.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.0):
        why = f"the climb to ({knobs}): its spare sleeps beside the engine, so the climb is a wake"
        return Step(Action.CLIMB, why, rung=kept, spare_why=why)
    if f.building:
        return Step(Action.BUSY, f"the climb to ({knobs}) waits: a second engine is being built")
    util, why = _spare_beside(f, target)
    if util is not None and gains(util):
        why = (f"the climb to ({knobs}): its spare first, beside the serving engine (so that the "
               f"climb holds clients only for a wake): {why}")
        return Step(Action.SPARE, why, rung=target.with_(gpu_memory_utilization=util),
                    spare_why=why, spare_fits=True)
    if util is not None:
        why = f"no more than the engine's {now:g} fits beside it"
    return Step(Action.CLIMB, f"the climb to ({knobs}) is a start: no spare of its rung: {why}")


def _spare_refusal(f: Facts, rung: Profile) -> str | None:
    """Why no spare at all for ``rung`` (its mode, its arguments, its history), whatever the card
    holds."""
    mode = f.recovery.spare
    if rung.compile_key() in f.failed:
        return (
            "a second engine at this rung failed to start, to sleep, or its canary after a wake in "
            "this run: "
            "no spare for it")
    if mode == "off":
        return '[recovery] spare = "off"'
    if f.breaks_on_wake:
        return f"refused: {f.breaks_on_wake}"
    if mode == "auto" and not f.gateway:
        return f"auto: no [gateway]: {SPARE_NEEDS_GATEWAY}"
    return None


def _spare_beside(f: Facts, rung: Profile) -> tuple[float | None, str]:
    """Whether a spare for ``rung`` is built beside the serving engine: the utilization it starts
    at (the rung's when no GPU is seen), or None; and why."""
    refused = _spare_refusal(f, rung)
    if refused:
        return None, refused
    if f.recovery.spare_order == "first":
        return None, ('[recovery] spare_order = "first": a spare is built before the engine, at '
                      'planned starts')
    if f.card is None:
        return None, "the GPU is lost"
    util = rung.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.9
    if f.recovery.spare == "on":
        fits = fits_beside(f.card, util, f.headroom) if f.card else util
        if fits < f.floor:  # "on" skips auto's checks, not vLLM's start check
            return None, (f'[recovery] spare = "on", but beside the engine the card holds a second '
                          f"engine at {fits:g} at most, under the ladder's floor ({f.floor:g}); "
                          f"{_window(f)}")
        return fits, '[recovery] spare = "on"'
    if not f.card:
        return None, "auto: no GPU seen (vLLM's sleep mode needs CUDA or ROCm)"
    room, why = room_for_spare(f.card, f.sizes.get(rung.compile_key()), rung, f.headroom, f.floor,
                               f.ram_available)
    return room, why if room is not None else f"{why}; {_window(f)}"


def _throwaway_fits(f: Facts, rung: Profile) -> tuple[bool, str]:
    """Whether a throwaway may compile ``rung`` beside the serving engine now, and why."""
    mode = f.recovery.precompile
    if mode != "auto":
        return mode == "on", f'[recovery] precompile = "{mode}"'
    if f.card is None:
        return False, "the GPU is lost"
    if not f.card:
        return True, ("auto: no GPU, so a throwaway competes only for CPU, niced and while the "
                      "engine is idle")
    return room_for_throwaway(f.card, f.sizes.get(rung.compile_key()), f.ranks)


def _beside(f: Facts, rung: Profile) -> Profile:
    """On a GPU the throwaway must fit in what the serving engine left: half of it (vLLM's start
    check wants utilization x total free). The utilization is not part of the compile hash."""
    free = free_fraction(list(f.card)) if f.card else None
    return rung if free is None else rung.with_(
        gpu_memory_utilization=round(max(0.01, free / 2), 3))


# ---- before a planned start ----------------------------------------------------------------------
def _before_start(f: Facts) -> Step:
    """The rungs within reach not yet compiled, first only where the start would not wait for
    them (``"auto"``): at the supervisor's first start, when the engine would compile its own
    rung in its start anyway, that one and the next memory failure's side by side on the free
    card (a failure in its first minutes would compile on its critical path: 70 s on the
    H200), in about the time the engine takes to compile its own; where that restart starts
    without torch.compile (``restart_uncompiled``), none, and the next is compiled beside the
    engine from READY. With its own rung compiled
    (a reboot, a restart, a climb), compiling another first would hold READY for a whole
    compile (77 s on the H200), so the next one is compiled beside the engine the moment it is
    READY, where it fits. ``"first"`` compiles every rung within reach first, as the operator
    asked."""
    within_reach = [f.engine, *f.targets]
    todo = [p for p in within_reach if f.to_compile(p)]
    own_missing = f.to_compile(f.engine)
    soon = [p for p in within_reach[:2] if f.to_compile(p)] if f.first_start and own_missing else []
    plan, compile_why = _compile_plan(f, todo, soon)
    at_ready = None
    if plan is not None and plan.at_once:
        return Step(Action.COMPILE_FIRST, plan.why, plan=plan, compile_why=compile_why)
    if plan is not None and f.first_start and (not own_missing or f.restart_uncompiled):
        at_ready = next((p for p in f.targets[:1] if f.to_compile(p)), None)
    nothing = Step(Action.NOTHING, compile_why or "no rung to compile first", plan=plan,
                   compile_why=compile_why, at_ready=at_ready)
    return _spare_first(f, nothing)


def _compile_plan(f: Facts, todo: Sequence[Profile],
                  soon: Sequence[Profile]) -> tuple[CompileFirst | None, str | None]:
    """How the rungs in ``todo`` are compiled before the engine (``plan.at_once`` 0: not first),
    or None when not weighed at all; and why. ``"auto"`` compiles first only the ones in
    ``soon`` (the first start's own rung and the next memory failure's, when its own is not
    compiled) and only as many as compile at once."""
    rc = f.recovery
    if rc.precompile == "off" or rc.precompile_order == "beside" or not todo or not f.card:
        return None, None  # without a GPU a throwaway always fits beside the engine
    sizes = [f.sizes.get(r.compile_key()) for r in todo]
    kv = f.kv.get(todo[0].compile_key())
    if kv is None or any(size is None for size in sizes):
        return None, ("first: the model is not a local directory with weights and a config.json: "
                      "its size is unknown")
    need = max(size.need for size in sizes if size is not None)
    util = f.engine.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.9
    args = (list(f.card), need, kv, util, f.headroom)
    if rc.precompile_order == "first":
        plan = replace(plan_first(*args, "first", f.cpus), rungs=tuple(todo))
        return plan, plan.why
    # beside when it fits: then nothing waits for a compile
    weighed = plan_first(*args, "auto", f.cpus)
    first = plan_first(*args, "first", f.cpus)
    # only the engine's own rung first is one start more for nothing: the engine compiles it in
    # its own start (an 80 GiB card half held by another process holds one throwaway at a time);
    # and where a failure's restart starts uncompiled, no failure waits for the next one
    ahead = () if f.restart_uncompiled else tuple(soon[:first.at_once])
    if any(r.compile_key() != f.engine.compile_key() for r in ahead):
        rest = "; the rest beside it" + (f": {weighed.why}"
                                         if weighed.order == "beside" else " where it fits")
        plan = replace(
            first, rungs=ahead, why=
            ("auto: the start's own rung and the next memory failure's before the engine, side by "
             "side, in about the time the engine would compile its own (a failure in the minutes "
             f"after READY would compile on its critical path): {first.why}{rest}"))
        return plan, plan.why
    if weighed.order == "beside":
        return replace(weighed, rungs=tuple(todo)), weighed.why
    why = (
        "auto: none first: the start would wait for them (precompile_order = \"first\" compiles "
        f"them before planned starts), and none fits beside the engine: {weighed.why}; a memory "
        "failure into a rung not compiled compiles it in its restart")
    if soon and f.restart_uncompiled:
        why = (
            "auto: none first: the engine compiles its own rung in its start, and a memory "
            "failure's restart that wakes no spare starts without torch.compile ([recovery] "
            "uncompiled_restart), so no failure waits for the next rung's compile; it is compiled "
            "beside the engine from READY, where it fits (precompile_order = \"first\" compiles "
            "every rung before the engine)")
    elif soon and first.at_once:
        why = (
            "auto: none first: only the start's own rung would be compiled first "
            f"({first.why.removeprefix('first: before the engine, ')}), and the engine compiles "
            "it in its own start in about that time: READY would wait one start more for nothing. "
            "A memory failure into the next rung compiles it in its restart (precompile_order = "
            "\"first\" compiles it before the engine)")
    return replace(weighed, order=None, at_once=0, rungs=tuple(todo), why=why), why


def _spare_first(f: Facts, otherwise: Step) -> Step:
    """A spare for the first target built now, on the card the engine is about to start on, where
    it would not fit beside the engine and the operator asked for that order (``"first"``,
    ``"auto"``); else ``otherwise``, with how the spare was weighed. The default,
    ``"beside"``, never holds a planned start's READY for it: /status says what the window
    without one costs instead."""
    if f.spare_kept or not f.targets or not f.card:
        # the order is the card's numbers: without them a spare is only ever built beside
        return otherwise
    rung, rc = f.targets[0], f.recovery
    if _spare_refusal(f, rung):
        return otherwise
    size = f.sizes.get(rung.compile_key())
    refused = host_refusal(size, f.ram_available) if rc.spare == "auto" else None
    if refused:
        return replace(otherwise, spare_why=refused)
    beside_only = rc.spare_order == "beside"
    order = choose_order(list(f.card), f.engine.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.9,
                         size.need if size is not None else 0, f.floor, f.headroom,
                         "auto" if beside_only else rc.spare_order)
    if beside_only and order.order == "first":
        why = (
            'spare_order = "beside": none fits beside the engine, and one built first would hold '
            'this start\'s '
            'READY for about another start (spare_order = "first" or "auto" builds it so: '
            f'{order.why}); '
            f"{_window(f)}")
        return replace(otherwise, order=Order(None, None, why), spare_why=why)
    if beside_only or order.order != "first" or order.spare_util is None:
        return replace(otherwise, order=order)
    why = f"building it first: {order.why}"
    return Step(Action.SPARE, why, rung=rung.with_(gpu_memory_utilization=order.spare_util),
                order=order, spare_why=why, plan=otherwise.plan, compile_why=otherwise.compile_why,
                at_ready=otherwise.at_ready)


def _window(f: Facts) -> str:
    """What serving without a spare costs: a memory failure's restart is a start, not a wake."""
    took = f"the last start took {f.last_start_s:.0f}s" if f.last_start_s else "as long as a start"
    return f"until one sleeps, a memory failure's restart is a start ({took}), not a wake"
