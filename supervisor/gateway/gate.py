"""The gateway's view of the engine: who may go to it now, who waits, and who killed it.

Requests wait here while the engine is not READY (held), go through when it is, and are
re-issued after a death when nothing of theirs reached the client yet. After a death that a
request can cause, the suspect (named by vLLM's scheduler dump, else the request that saw the
most deaths, else the largest prompt that was in flight) goes alone to the next engine, once
that engine has served ``solo_after_s`` without it (others go meanwhile): the control.

A strike needs evidence: vLLM's own record named the request, or it was alone at the engine
when it died: of an out-of-memory error, or of any death a request can cause (a segfault,
"engine dead") once the engine had served its control period without it. Being the largest in
a batch is a reason to send it alone, never a strike; an engine that dies during its control
period, or with nothing in flight, dies whatever it serves: the suspect's strikes are void, so
a crash loop quarantines no one. A request that carries a quarantined request's prompt with other
fields (its ``kin``: an attacker's next try, or an innocent sharing the prompt) is the first
suspect of a death it is at, with a strike; it goes alone then, and living alone clears it.
Two strikes quarantine the request; strikes are remembered by the quarantine's key, so a client
that sends the request again inherits them. A death that a
request alone was proven to cause spends no restart budget (``Blame.proven``): the budget is for
loops the supervisor cannot explain. Flights are tracked by the gateway's own identity, never
by the client's X-Request-Id, which several requests may share.

The gate reads the supervisor's state changes from the event stream and never writes them.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from supervisor.decide import admission
from supervisor.engine_states import Blame, EngineState, FailureKind


@dataclass(eq=False)
class Flight:
    """One client request through the gateway."""

    rid: str
    digest: str | None  # content hash (generation routes only)
    size: int  # prompt tokens: exact when counted, else the upper bound
    tokens: int | None = None  # exact prompt tokens, when counted
    generation: int = 0  # the READY period it was sent in
    replays: int = 0
    strikes: int = 0  # times it was the suspect of a death, with evidence
    deaths: int = 0  # engine deaths it was at the engine for
    # which of those spent the restart budget (death numbers)
    unexplained: set[int] = field(default_factory=set)
    # sent after its engine had served solo_after_s: a death then is evidence
    controlled: bool = False
    quarantined: bool = False
    floor_tried: bool = False  # it went (or goes) alone to an engine at the ladder's lowest rung
    gone: bool = False  # answered, refused, or its client left: it will not come back to the gate
    arrived: float = 0.0  # the host's monotonic clock at arrival
    shape: str = ""  # the quarantine's key without the prompt (admission.engine_key)
    prompt: str = ""  # the key of its prompt alone (admission.EngineKey.prompt)
    # it carries a quarantined request's prompt: 2 with its fields too, 1 with others
    # (Quarantine.kinship)
    kin: int = 0
    sketch: tuple[int, ...] = ()  # its prompt's, computed only when asked (admission.body_sketch)
    # as the client sent it (held anyway, to be sent again): what the sketch reads
    body: bytes = b""

    @classmethod
    def of(cls, rid: str, parsed: admission.Parsed | None, body: bytes, arrived: float) -> Flight:
        """A request as it arrives: a generation request's key and byte bound, or (any other
        route) its body."""
        if parsed is None:
            return cls(rid, None, 0, arrived=arrived, body=body)
        return cls(rid, parsed.digest, parsed.upper_bound, arrived=arrived, shape=parsed.shape,
                   body=body, prompt=parsed.prompt_key)


@dataclass(frozen=True)
class Blamed(Blame):
    """What the gate made of a death, and the request it quarantines."""

    quarantined: Flight | None = None


# quarantine keys whose strikes are remembered for a client that sends them again
STRUCK_KEPT = 4096
# a planned start's states through which requests handed over to its successor keep going to it
HANDED_OVER_STATES = (EngineState.DRAINING, EngineState.STOPPING, EngineState.STARTING,
                      EngineState.WARMING)


class Refused(Exception):
    """Not admitted: held too long, the hold queue is full, or the gateway is shutting down."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class EngineGate:
    def __init__(self, max_held: int, max_in_flight: int = 0, solo_after_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_held = max_held
        self.max_in_flight = max_in_flight
        self.solo_after_s = solo_after_s
        self.clock = clock
        self.ready_at = 0.0
        self.struck: OrderedDict[str, int] = OrderedDict()  # quarantine key -> strikes
        self.death_no = 0  # numbers the deaths a request can cause, for ``explained``
        self.explained: set[int] = set()  # deaths already given back
        self.state = EngineState.STOPPED
        self.generation = 0
        self.open = False  # READY and not draining
        self.closing = False  # the supervisor is stopping: admit nothing more
        self.at_engine: dict[int, Flight] = {}  # by id(flight): clients may share an X-Request-Id
        self.waiting = 0
        self.suspects: list[Flight] = []  # each goes alone, in turn; none goes in a batch
        # at the engine when it was told to stop unplanned (``stopping``)
        self._dead_batch: list[Flight] = []
        # the generation sent to the engine's successor, awake beside it while it drains
        # (``hand_over``), until that successor is READY or the hand-over ends
        self.handed_over: int | None = None
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``ready()`` holds (re-checked on every change of the gate); False on
        timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not ready():
            left = deadline - loop.time()
            if left <= 0:
                return False
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow the cancellation of
            # a client that left (CPython gh-86296), which then stayed counted as waiting and went
            # to the engine.
            try:
                async with asyncio.timeout(left):
                    await self._changed.wait()
            except TimeoutError:
                return ready()
        return True

    # ---- what the supervisor publishes -----------------------------------------------------------
    def on_state(self, old: EngineState, new: EngineState) -> None:
        self.state = new
        if new is EngineState.READY:
            self.handed_over = None
            self.generation += 1
            self.open = not self.closing
            self.ready_at = self.clock()
            if self.suspects and self.solo_after_s > 0:
                # the control is over
                asyncio.get_running_loop().call_later(self.solo_after_s, self._notify)
        elif self.handed_over is None or new not in HANDED_OVER_STATES:
            self.handed_over = None
            self.open = False
        self._notify()

    def hand_over(self) -> bool:
        """The engine drains for a planned start whose engine is already awake beside it (a
        climb's spare, woken and its canary answered): new requests go to that one now, while
        those at the draining engine finish there, instead of waiting for the drain, the stop
        and the warm-up (the caller points the proxy at it first). True when handed over: only
        while DRAINING, once."""
        if self.state is not EngineState.DRAINING or self.closing or self.handed_over is not None:
            return False
        self.generation += 1
        self.handed_over = self.generation
        self.open = True
        self._notify()
        return True

    def take_back(self) -> None:
        """The successor requests were handed to will not be this start's engine (it was dropped,
        or another was spawned): hold new requests again until READY; those at it fail over as
        at any engine that left."""
        if self.handed_over is not None:
            self.handed_over = None
            self.open = False
            self._notify()

    def _replaced(self) -> list[Flight]:
        """What is at the engine being replaced: everything, unless requests were handed over
        to its successor (those sent since are at that one)."""
        cut = self.handed_over
        return [f for f in self.at_engine.values() if cut is None or f.generation < cut]

    def stopping(self, planned: bool) -> None:
        """Told by the lifecycle, synchronously, before it writes STOPPING: nothing more goes to
        this engine, and an unplanned stop's dead batch is what is at the engine now (a
        planned one drained first: nobody's death). Never learned from the event stream: its
        queue may deliver the edge after the verdict is asked for. A planned stop whose
        successor took the requests handed over keeps sending to that one."""
        self._dead_batch = [] if planned else self._replaced()
        if not planned or self.handed_over is None:
            self.handed_over = None
            self.open = False
        self._notify()

    @property
    def solo(self) -> Flight | None:
        """The suspect that goes alone next."""
        return self.suspects[0] if self.suspects else None

    def on_failure(self, kind: FailureKind, suspect_request: str | None,
                   at_floor: bool = True) -> Blamed:
        """After a death: pick the suspect to replay alone, strike it where the evidence allows.

        A memory failure's suspect with two strikes is tried once more, alone, at the ladder's
        lowest rung (``Blame.floor``) unless the engine that died already ran there: a budget of
        2048 may serve what 6144 could not."""
        # A request answered between the death and its classification is nobody's suspect: made the
        # one to go alone, it would never come back, and every other request would wait for it.
        dead, self._dead_batch = self._dead_batch, []
        if not kind.request_can_cause:
            return Blamed()
        # nothing in flight: the engine dies whatever it serves, and no strike stands on that
        if not dead:
            self.struck.clear()
            for f in self.suspects:
                f.strikes = 0
            return Blamed()
        self.death_no += 1
        for f in dead:
            f.deaths += 1
        batch = [f for f in dead if not f.gone]
        if not batch:
            return Blamed()
        named = admission.named_by(suspect_request, {f.rid: f.size for f in batch})
        if named is not None:
            suspect = max((f for f in batch if f.rid == named), key=lambda f: f.size)
        else:
            suspect = max(batch, key=lambda f: (f.strikes, 0
                                                if f.strikes else f.kin, f.deaths, f.size))
        alone = len(dead) == 1 and dead[0] is suspect
        proven = alone and (kind is FailureKind.RUNTIME_OOM or suspect.controlled)
        # A request that reuses a quarantined request's prompt with other fields (an attacker's next
        # try) takes its first strike at a death it was at. Never an innocent's quarantine: struck,
        # it goes alone from then on, and its second strike needs a death alone (or vLLM naming it);
        # living alone voids the first (leave).
        if named is not None or proven or (suspect.kin and not suspect.strikes):
            self._strike(suspect)
        explained = self._explain(suspect, dead, proven)
        floor = suspect.strikes >= 2 and kind.memory and not at_floor and not suspect.floor_tried
        if floor:
            suspect.floor_tried = True
        elif suspect.strikes >= 2:
            return Blamed(proven=proven, explained=explained, quarantined=self._quarantine(suspect))
        # A request at two deaths, or struck once, never goes in a batch again: it would take the
        # others with it.
        for f in [suspect, *(f for f in batch if f.strikes or f.deaths >= 2)]:
            if f not in self.suspects:
                self.suspects.append(f)
        self._notify()
        return Blamed(proven=proven, floor=floor, explained=explained)

    def _explain(self, suspect: Flight, dead: list[Flight], proven: bool) -> int:
        """After a death: the earlier budget-spending deaths it explains (``suspect`` proven now:
        every one it was at). An unproven death is remembered by everyone at it, in case one
        of them is proven later."""
        if not proven:
            for f in dead:
                f.unexplained.add(self.death_no)
            return 0
        earlier = suspect.unexplained - self.explained
        self.explained |= earlier
        return len(earlier)

    def strikes_of(self, key: str | None) -> int:
        """Strikes remembered for a quarantine key: a request sent again is not a new one."""
        return self.struck.get(key, 0) if key is not None else 0

    def _strike(self, f: Flight) -> None:
        f.strikes = max(f.strikes, self.strikes_of(f.digest)) + 1
        if f.digest is not None:
            self.struck[f.digest] = f.strikes
            self.struck.move_to_end(f.digest)
            while len(self.struck) > STRUCK_KEPT:
                self.struck.popitem(last=False)

    def _void(self, f: Flight) -> None:
        f.strikes = 0
        if f.digest is not None:
            self.struck.pop(f.digest, None)

    def _quarantine(self, flight: Flight) -> Flight:
        flight.quarantined = True
        self._unsuspect(flight)
        self._notify()  # it may be waiting: its answer is the 413 now
        return flight

    def _unsuspect(self, flight: Flight) -> None:
        if flight in self.suspects:
            self.suspects.remove(flight)
            self._notify()

    # ---- requests --------------------------------------------------------------------------------
    def _may_go(self, f: Flight) -> bool:
        if not self.open:
            return False
        room = not self.max_in_flight or len(self.at_engine) < self.max_in_flight
        if self.suspects:
            controlling = self.clock() - self.ready_at < self.solo_after_s
            if f in self.suspects:
                return f is self.suspects[0] and not controlling and not self.at_engine
            return controlling and room  # others go while the engine serves its control period
        return room

    async def admit(self, f: Flight, hold_s: float,
                    keep_holding: Callable[[], bool] = lambda: False) -> bool:
        """Wait (at most ``hold_s``, longer while ``keep_holding()``) until ``f`` may go to the
        engine; True when it was held at all."""
        if self.closing:
            raise Refused(503, "shutting_down",
                          "the server is shutting down; retry on another replica or later")
        f.strikes = max(f.strikes, self.strikes_of(f.digest))
        if f.strikes and f not in self.suspects:
            # sent again after a strike (its client retried): alone, never in a batch
            self.suspects.append(f)
        if self._may_go(f):
            self._sent(f)
            return False
        if self.waiting >= self.max_held:
            if self.open:
                raise Refused(429, "too_many_requests",
                              f"{self.max_held} requests are already waiting for a slot")
            raise Refused(
                503, "engine_restarting",
                f"the engine is restarting and {self.max_held} requests are already waiting for it")
        self.waiting += 1
        try:
            ready = lambda: self.closing or f.quarantined or self._may_go(f)  # noqa: E731
            ok = await self._until(ready, hold_s)
            while not ok and keep_holding():
                ok = await self._until(ready, 1.0)
        finally:
            self.waiting -= 1
        if self.closing:
            raise Refused(503, "shutting_down",
                          "the server is shutting down; retry on another replica or later")
        if not ok:
            raise Refused(
                503, "engine_unavailable",
                f"the engine did not become ready within the {hold_s:.0f}s this request may wait")
        if not f.quarantined:
            self._sent(f)
        return True

    def _sent(self, f: Flight) -> None:
        f.generation = self.generation
        f.strikes = max(f.strikes, self.strikes_of(f.digest))
        f.controlled = self.clock() - self.ready_at >= self.solo_after_s
        self.at_engine[id(f)] = f

    async def engine_left(self, f: Flight, within_s: float) -> bool:
        """After an error from the engine: did the READY period ``f`` was sent in end (within
        ``within_s``)?"""
        return await self._until(lambda: self.generation != f.generation or not self.open, within_s)

    def leave(self, f: Flight) -> None:
        """``f`` no longer occupies the engine (done, failed, lost or gone)."""
        if self.at_engine.get(id(f)) is f:
            del self.at_engine[id(f)]
        if self.solo is f and f.generation == self.generation and self.open:
            self._unsuspect(f)  # it went through alone and the engine lived
            self._void(f)
        self._notify()

    def forget(self, f: Flight) -> None:
        """The request is over for good (answered, refused, or its client left): it is nobody's
        suspect any more."""
        f.gone = True
        self.leave(f)
        self._unsuspect(f)

    async def drained(self, timeout: float) -> int:
        """Stop sending to the engine and wait for what is there to finish; how many were still
        there. What was handed over to its successor meanwhile is not waited for."""
        if self.handed_over is None:
            self.open = False
        self._notify()
        await self._until(lambda: not self._replaced(), timeout)
        return len(self._replaced())

    def shutdown(self) -> None:
        """Admit nothing more; those waiting get 503 now."""
        self.closing = True
        self.open = False
        self._notify()
