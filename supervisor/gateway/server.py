"""The public port: vLLM's OpenAI API, fronted so that clients see latency, never a restart.

The gateway builds the parts a request passes (the door, the gate, the quarantine, the answers:
pipeline.py carries each request through them), learns the engine's state from the event stream and
publishes what it does there. It never changes the supervisor's state: the lifecycle asks it to
drain before a planned stop, tells it the engine is stopping, and asks it who caused a death.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from supervisor.config import Config, GatewayConfig, is_local_path
from supervisor.decide import admission
from supervisor.engine_states import Blame, FailureKind
from supervisor.event_stream import (
    AcceptFailed,
    EngineSpawned,
    Event,
    GatewayDrained,
    GatewayHandedOver,
    RequestQuarantined,
    SheddingChanged,
    SpareDropped,
    SpareWoken,
    StateChanged,
)
from supervisor.gateway import intake, pressure, quarantine_store
from supervisor.gateway.answers import Answers
from supervisor.gateway.gate import EngineGate, Flight
from supervisor.gateway.pipeline import EngineView, RequestPath, SupervisorSide
from supervisor.host import Host, listener
from supervisor.host.vllm_http import EngineClient

log = structlog.get_logger("supervisor.gateway")
# A quarantine at a death waits this long at most for a sketch not made when its request went alone
# (_through): a busy parser pool never holds the restart; without its sketch, only the request's
# exact key is refused.
SKETCH_WAIT_S = 0.5
CLOSE_S = 3.0  # at exit: how long open connections may hold the port's close
DEFAULT_VOCAB = 128256  # Llama 3's: a conservative guess when the model's config cannot be read
# How each request ended: exactly one of these per request (their sum is the requests answered).
OUTCOMES = ("forwarded", "engine_errors", "client_disconnected", "400", "401", "404", "408", "413",
            "429", "503")
# What happened to requests on the way (a request may be held, replayed and its stream continued).
EVENTS = ("held", "replayed", "quarantined", "streams_broken", "streams_continued")
COUNTERS = OUTCOMES + EVENTS


class Gateway:
    """The public port: builds the request path's parts, reads the engine's changes from the
    event stream, answers the lifecycle (drain, stopping, blame), and keeps the pressure watch
    and the quarantine's entries."""

    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None],
                 view: Callable[[], EngineView], side: SupervisorSide | None = None) -> None:
        assert cfg.gateway is not None
        self.cfg, self.g = cfg, cfg.gateway
        self.host, self.publish, self.view = host, publish, view
        self.gate = EngineGate(self.g.max_held, self.g.max_in_flight, self.g.solo_after_s,
                               host.monotonic)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.client = EngineClient(cfg.engine.base_url, cfg.engine.api_key())
        self.intake = intake.Intake(self.g, cfg.engine.api_keys())
        self.quarantine = quarantine_store.StoredQuarantine.open(
            quarantine_store.path_in(cfg.state.dir), host.wall())
        self.answers = Answers(self.counters, host, publish)
        self.path = RequestPath(
            cfg, host, publish, view, side or SupervisorSide(), self.gate, self.intake,
            self.quarantine, self.answers, self.client, vocab=self.g.vocab_size
            or _vocab_of(cfg.engine.model) or DEFAULT_VOCAB)
        self.watch = pressure.PressureWatch(self.g, host, self.client, cfg.engine.devices(),
                                            lambda: self.view().pids, self._serving,
                                            self.busy, self._shedding_changed)
        self._watch_task: asyncio.Task[None] | None = None
        self._successor: int | None = None  # the pid requests were last handed over to
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.path.handle)
        self.port = listener.PublicPort(app, listener.Limits.of(self.g), CLOSE_S,
                                        self.answers.refused_raw,
                                        partial(_accept_failed, host, publish), host.monotonic)

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.port.start(*self.g.host_port, "[gateway] listen")
        self._watch_task = asyncio.create_task(self.watch.run(), name="gateway:pressure")
        log.info("gateway.listening", listen=self.g.listen,
                 quarantined=len(self.quarantine.entries))

    def _serving(self) -> bool:
        """READY and open: the memory rules watch the engine; not through a hand-over, where the
        successor woke beside it (no other process's growth)."""
        return self.gate.open and self.gate.handed_over is None

    def busy(self) -> bool:
        """A client request is at the engine now."""
        return bool(self.gate.at_engine)

    def shutdown(self) -> None:
        """SIGTERM: admit nothing more (503 + Retry-After); in-flight requests may finish
        (``drain``)."""
        self.gate.shutdown()

    async def drain(self, why: str) -> bool:
        """Before a planned stop of the engine: hold new requests and let those at the engine
        finish; True when none is left there."""
        t0, in_flight = self.host.monotonic(), len(self.gate.at_engine)
        cut = await self.gate.drained(self.g.drain_timeout_s)
        self.publish(GatewayDrained(at=self.host.wall(), why=why, in_flight=in_flight,
                                    waited_s=round(self.host.monotonic() - t0, 3), cut=cut))
        return cut == 0

    async def close(self) -> None:
        self.intake.close()
        await pressure.stop(self._watch_task)
        await self.port.close()
        if "session" in vars(self.path):  # made at the first request
            await self.path.session.close()
        await self.client.close()

    def reconfigure(self, g: GatewayConfig) -> None:
        """A reload: every [gateway] setting but ``listen`` applies to the next request and the
        next poll."""
        self.g = self.path.g = g
        gate = self.gate
        gate.max_held, gate.max_in_flight = g.max_held, g.max_in_flight
        gate.solo_after_s = g.solo_after_s
        self.intake.configure(g)
        self.port.configure(g)
        self.watch.configure(g)

    def status(self) -> dict[str, Any]:
        now = self.host.wall()
        path = self.path
        safe = self.quarantine.safe_len(now, path.proven_tokens)
        return {
            "listen": self.g.listen, **self.counters, "hold_timeout_s": round(path.hold_s(), 1),
            "in_flight": len(self.gate.at_engine), "waiting": self.gate.waiting,
            "open": self.gate.open, "shedding": path.pressure.reason if path.pressure else None,
            "quarantine_size": sum(1 for e in self.quarantine.entries.values() if e["until"] > now),
            "safe_prompt_tokens": safe, "prompt_limit_source": admission.prompt_limit(
                path.counter.known_max_len(), safe)[1], "longest_prompt_served": path.proven_tokens,
            "connections": self.port.status(), "body_bytes_held": self.intake.budget.held,
            "held_seconds": dict(zip(("buckets", "sum"), self.answers.held_histogram(),
                                     strict=True))
        }

    # ---- the event stream ------------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        if isinstance(event, StateChanged):
            # before the gate opens: where this start's engine listens (a spare's port)
            if event.ready is not None:
                self.client.base_url = event.ready.engine_url or self.cfg.engine.base_url
                self.path.proven_tokens = max(event.ready.warmup_prompts, default=0)
            self.gate.on_state(event.old, event.new)
        elif isinstance(event, SpareWoken) and event.beside and event.url:
            self._hand_over(event)
        elif ((isinstance(event, SpareDropped) and event.pid == self._successor)
              or (isinstance(event, EngineSpawned) and self._successor not in (None, event.pid))):
            # not this start's engine after all: new requests wait for READY again (a no-op once
            # the hand-over ended, whatever ``_successor`` still names)
            self.gate.take_back()

    def _hand_over(self, woken: SpareWoken) -> None:
        """A climb's spare woke beside the draining engine: new requests go to it now."""
        before = self.client.base_url
        self.client.base_url = woken.url  # before the gate opens
        if not self.gate.hand_over():
            self.client.base_url = before
            return
        self._successor = woken.pid
        self.publish(GatewayHandedOver(at=self.host.wall(), pid=woken.pid,
                                       waiting=self.gate.waiting,
                                       in_flight=len(self.gate.at_engine)))

    def stopping(self, planned: bool) -> None:
        """Told by the lifecycle before the engine stops: the gate takes what is at the engine
        (gate.stopping)."""
        self.gate.stopping(planned)

    async def blame(self, kind: FailureKind, suspect_request: str | None, at_floor: bool,
                    chunk: int | None) -> Blame:
        """Asked by the lifecycle after a death, before its policy decides: who goes alone, who
        is quarantined, whether one request alone was proven to cause it."""
        blame = self.gate.on_failure(kind, suspect_request, at_floor)
        if blame.quarantined is not None and blame.quarantined.digest is not None:
            await self._quarantine(blame.quarantined, kind, at_floor, chunk)
        return blame

    async def _quarantine(self, flight: Flight, kind: FailureKind, at_floor: bool,
                          chunk: int | None) -> None:
        assert flight.digest is not None
        # its variants are refused too
        await quarantine_store.sketched(flight, self.intake.sketch, SKETCH_WAIT_S)
        reason = quarantine_store.reason(kind.value, flight.tokens, at_floor, chunk)
        # Only a measured count may lower the prompt limit for others (Quarantine.safe_len).
        self.quarantine.keep(flight.digest, self.host.wall(), self.g.quarantine_ttl_s,
                             flight.tokens, reason, kind.value, flight.shape, flight.sketch,
                             flight.prompt)
        self.counters["quarantined"] += 1
        self.publish(
            RequestQuarantined(at=self.host.wall(), request_hash=flight.digest,
                               prompt_tokens=flight.size,
                               evidence=f"{reason} (request {flight.rid})"))

    def _shedding_changed(self, p: admission.Pressure | None) -> None:
        self.path.pressure = p
        self.publish(SheddingChanged(at=self.host.wall(), reason=p.reason if p else "",
                                     everyone=bool(p and p.everyone)))

    # ---- one request -----------------------------------------------------------------------------


def _accept_failed(host: Host, publish: Callable[[Event], None], error: str, count: int) -> None:
    publish(AcceptFailed(at=host.wall(), error=error, count=count))


def _vocab_of(model: str) -> int | None:
    """The vocabulary size in a local model's config.json (the prompt_logprobs bound needs it)."""
    if not is_local_path(model):
        return None
    try:
        doc = json.loads((Path(model).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = doc.get("vocab_size") if isinstance(doc, dict) else None
    return value if isinstance(value, int) and value > 0 else None
