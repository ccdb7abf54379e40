"""The gateway's view of the engine: who may go to it now, who waits, and who killed it.

Requests wait here while the engine is not READY (held), go through when it is, and are
re-issued after a death when nothing of theirs reached the client yet. After a death that a
request can cause, the suspect (named by vLLM's scheduler dump, else the largest prompt that
was in flight) goes alone first.

A strike needs evidence: vLLM's own record named the request, or it was alone at the engine
when an out-of-memory death came. Being the largest in a batch is a reason to send it alone,
never a strike; an unexplained death (a signal, "engine dead") with nobody named strikes
nobody, so an engine that dies after every start whatever it serves quarantines no one. Two
strikes quarantine the request. Flights are tracked by the gateway's own identity, never by
the client's X-Request-Id, which several requests may share.

The gate reads the supervisor's state changes from the event stream and never writes them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.decide import admission
from supervisor.engine_states import EngineState, FailureKind


@dataclass(eq=False)
class Flight:
    """One client request through the gateway."""

    rid: str
    digest: str | None  # content hash (generation routes only)
    size: int  # prompt tokens: exact when counted, else the upper bound
    tokens: int | None = None  # exact prompt tokens, when counted
    generation: int = 0  # the READY period it was sent in
    replays: int = 0
    strikes: int = 0  # times it was the suspect of a death
    quarantined: bool = False
    floor_tried: bool = False  # it went (or goes) alone to an engine at the ladder's lowest rung
    gone: bool = False  # answered, refused, or its client left: it will not come back to the gate
    arrived: float = 0.0  # the host's monotonic clock at arrival


class Refused(Exception):
    """Not admitted: held too long, the hold queue is full, or the gateway is shutting down."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class EngineGate:
    def __init__(self, max_held: int, max_in_flight: int = 0) -> None:
        self.max_held = max_held
        self.max_in_flight = max_in_flight
        self.state = EngineState.STOPPED
        self.generation = 0
        self.open = False  # READY and not draining
        self.closing = False  # the supervisor is stopping: admit nothing more
        self.at_engine: dict[int, Flight] = {}  # by id(flight): clients may share an X-Request-Id
        self.waiting = 0
        self.solo: Flight | None = None  # the suspect, replayed alone
        self._dead_batch: list[Flight] = []
        self.floor_wanted = False  # the next engine should start at the lowest rung: a suspect is tried there
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``ready()`` holds (re-checked on every change of the gate); False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not ready():
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return ready()
        return True

    # ---- what the supervisor publishes ---------------------------------------------------------------
    def on_state(self, old: EngineState, new: EngineState) -> None:
        self.state = new
        if new is EngineState.READY:
            self.generation += 1
            self.open = not self.closing
        else:
            self.open = False
            # Unplanned: a planned stop drains first (READY -> DRAINING).
            if old is EngineState.READY and new is EngineState.STOPPING:
                self._dead_batch = list(self.at_engine.values())
        self._notify()

    def on_failure(self, kind: FailureKind, suspect_request: str | None, at_floor: bool = True) -> Flight | None:
        """After a death: pick the suspect to replay alone; the flight to quarantine, if any.

        A memory failure's suspect with two strikes is tried once more, alone, at the ladder's lowest rung
        (``floor_wanted``) unless the engine that died already ran there: a budget of 2048 may serve what
        6144 could not."""
        # A request answered between the death and its classification is nobody's suspect: made the one to go
        # alone, it would never come back, and every other request would wait for it.
        dead, self._dead_batch = self._dead_batch, []
        batch = [f for f in dead if not f.gone]
        if not kind.request_can_cause or not batch:
            return None
        sizes = {f.rid: f.size for f in batch}
        named = admission.named_by(suspect_request, sizes)
        if named is not None:
            suspect = max((f for f in batch if f.rid == named), key=lambda f: f.size)
        else:
            suspect = max(batch, key=lambda f: f.size)
        alone = len(dead) == 1 and dead[0] is suspect
        if named is not None or (alone and kind is FailureKind.RUNTIME_OOM):
            suspect.strikes += 1
        if suspect.strikes >= 2 and kind.memory and not at_floor and not suspect.floor_tried:
            suspect.floor_tried = self.floor_wanted = True
        elif suspect.strikes >= 2:
            return self._quarantine(suspect)
        self.solo = suspect
        self._notify()
        return None

    def take_floor_wish(self) -> bool:
        """Whether the next engine should start at the lowest rung (asked once per failure)."""
        wanted, self.floor_wanted = self.floor_wanted, False
        return wanted

    def _quarantine(self, flight: Flight) -> Flight:
        flight.quarantined = True
        if self.solo is flight:
            self.solo = None
        self._notify()
        return flight

    # ---- requests --------------------------------------------------------------------------------------
    def _may_go(self, f: Flight) -> bool:
        if not self.open:
            return False
        if self.solo is not None:
            return self.solo is f and not self.at_engine
        return not self.max_in_flight or len(self.at_engine) < self.max_in_flight

    async def admit(self, f: Flight, hold_s: float, keep_holding: Callable[[], bool] = lambda: False) -> bool:
        """Wait (at most ``hold_s``, longer while ``keep_holding()``) until ``f`` may go to the engine; True
        when it was held at all."""
        if self.closing:
            raise Refused(503, "shutting_down", "the server is shutting down; retry on another replica or later")
        if self._may_go(f):
            self._sent(f)
            return False
        if self.waiting >= self.max_held:
            if self.open:
                raise Refused(429, "too_many_requests", f"{self.max_held} requests are already waiting for a slot")
            raise Refused(503, "engine_restarting",
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
            raise Refused(503, "shutting_down", "the server is shutting down; retry on another replica or later")
        if not ok:
            raise Refused(503, "engine_unavailable",
                          f"the engine did not become ready within the {hold_s:.0f}s this request may wait")
        if not f.quarantined:
            self._sent(f)
        return True

    def _sent(self, f: Flight) -> None:
        f.generation = self.generation
        self.at_engine[id(f)] = f

    async def engine_left(self, f: Flight, within_s: float) -> bool:
        """After an error from the engine: did the READY period ``f`` was sent in end (within ``within_s``)?"""
        return await self._until(lambda: self.generation != f.generation or not self.open, within_s)

    def leave(self, f: Flight) -> None:
        """``f`` no longer occupies the engine (done, failed, lost or gone)."""
        if self.at_engine.get(id(f)) is f:
            del self.at_engine[id(f)]
        if self.solo is f and f.generation == self.generation and self.open:
            self.solo = None  # it went through alone and the engine lived
        self._notify()

    def forget(self, f: Flight) -> None:
        """The request is over for good (answered, refused, or its client left): it is nobody's suspect any more."""
        f.gone = True
        self.leave(f)
        if self.solo is f:
            self.solo = None
            self._notify()

    async def drained(self, timeout: float) -> int:
        """Stop sending to the engine and wait for what is there to finish; how many were still there."""
        self.open = False
        self._notify()
        await self._until(lambda: not self.at_engine, timeout)
        return len(self.at_engine)

    def shutdown(self) -> None:
        """Admit nothing more; those waiting get 503 now."""
        self.closing = True
        self.open = False
        self._notify()
