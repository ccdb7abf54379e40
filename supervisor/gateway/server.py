"""The public port: vLLM's OpenAI API, fronted so that clients see latency, never a restart.

Each request: its body read under a size cap, parsed and type-checked (generation routes),
refused if quarantined, shed (429) under real memory pressure, held while the engine is not
READY, prechecked against the current profile's limits (413), forwarded, and re-issued to the
next engine when the engine lost it before the client got a byte. The gateway learns the
engine's state from the event stream and publishes what it does there; it never changes the
supervisor's state (the supervisor asks it to drain before a planned stop).
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from supervisor.config import Config, GatewayConfig, is_local_path
from supervisor.decide import admission
from supervisor.decide.admission import Parsed, Rejection
from supervisor.engine_states import Blame, FailureKind
from supervisor.event_stream import (
    AcceptFailed,
    Event,
    GatewayDrained,
    RequestQuarantined,
    RequestReplayed,
    SheddingChanged,
    StateChanged,
    StreamContinued,
)
from supervisor.gateway import intake, pressure, proxy, quarantine_store, streams
from supervisor.gateway.answers import Answers
from supervisor.gateway.counting import PromptCounter
from supervisor.gateway.gate import EngineGate, Flight, Refused
from supervisor.gateway.streams import StreamState
from supervisor.host import Host, listener, routes
from supervisor.host.vllm_http import EngineClient

log = structlog.get_logger("supervisor.gateway")
RID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# After an engine error: how long to wait for the supervisor to say whether the engine died
# (IPC and the exit watch take milliseconds; /health 503 probes take a few seconds).
DEATH_WAIT_S = 6.0
# A quarantine at a death waits this long at most for a sketch not made when its request went alone (_through): a
# busy parser pool never holds the restart; without its sketch, only the request's exact key is refused.
SKETCH_WAIT_S = 0.5
CLOSE_S = 3.0  # at exit: how long open connections may hold the port's close
DEFAULT_VOCAB = 128256  # Llama 3's: a conservative guess when the model's config cannot be read
AUTO_HOLD_MIN_S = 180.0  # "auto" never holds for less than this (the number it replaced)
# How each request ended: exactly one of these per request (their sum is the requests answered).
OUTCOMES = ("forwarded", "engine_errors", "client_disconnected", "400", "401", "404", "408", "413", "429", "503")
# What happened to requests on the way (a request may be held, replayed and its stream continued).
EVENTS = ("held", "replayed", "quarantined", "streams_broken", "streams_continued")
COUNTERS = OUTCOMES + EVENTS


@dataclass(frozen=True)
class EngineView:
    """What the gateway may know of the engine the supervisor runs now."""

    chunk: int  # the profile's max_num_batched_tokens (vLLM's default when unset)
    max_model_len: int | None
    pids: set[int] = field(default_factory=set)
    restart_eta_s: float = 30.0
    slowest_start_s: float | None = None  # start -> READY, the slowest this host has measured (state.json)
    restarting: bool = False  # the supervisor is bringing the engine back (a restart it began is under way)


class Gateway:
    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None],
                 view: Callable[[], EngineView], side: SupervisorSide | None = None) -> None:
        assert cfg.gateway is not None
        self.cfg, self.g = cfg, cfg.gateway
        self.host, self.publish, self.view = host, publish, view
        self.side = side or SupervisorSide()
        self.gate = EngineGate(self.g.max_held, self.g.max_in_flight, self.g.solo_after_s, host.monotonic)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.client = EngineClient(cfg.engine.base_url, cfg.engine.api_key())
        self.intake = intake.Intake(self.g, cfg.engine.api_keys())
        self.quarantine = quarantine_store.StoredQuarantine.open(quarantine_store.path_in(cfg.state.dir), host.wall())
        self.vocab = self.g.vocab_size or _vocab_of(cfg.engine.model) or DEFAULT_VOCAB
        self.pressure: admission.Pressure | None = None
        self.proven_tokens = 0  # the longest prompt the current engine ran (its warm-up's): its memory is held
        self.counter = PromptCounter(self.client, lambda: self.gate.generation, lambda: self.view().max_model_len)
        self.answers = Answers(self.counters, host, publish)
        self.watch = pressure.PressureWatch(self.g, host, self.client, cfg.engine.devices(),
                                            lambda: self.view().pids, lambda: self.gate.open,
                                            self.busy, self._shedding_changed)
        self._watch_task: asyncio.Task[None] | None = None
        self.session = proxy.new_session()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.port = listener.PublicPort(app, listener.Limits.of(self.g), CLOSE_S, self.answers.refused_raw,
                                           partial(_accept_failed, host, publish), host.monotonic)

    # ---- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.port.start(*self.g.host_port)
        self._watch_task = asyncio.create_task(self.watch.run(), name="gateway:pressure")
        log.info("gateway.listening", listen=self.g.listen, quarantined=len(self.quarantine.entries))

    def busy(self) -> bool:
        """A client request is at the engine now."""
        return bool(self.gate.at_engine)

    def shutdown(self) -> None:
        """SIGTERM: admit nothing more (503 + Retry-After); in-flight requests may finish (``drain``)."""
        self.gate.shutdown()

    async def drain(self, why: str) -> None:
        """Before a planned stop of the engine: hold new requests and let those at the engine finish."""
        t0, in_flight = self.host.monotonic(), len(self.gate.at_engine)
        cut = await self.gate.drained(self.g.drain_timeout_s)
        self.publish(GatewayDrained(at=self.host.wall(), why=why, in_flight=in_flight,
                                    waited_s=round(self.host.monotonic() - t0, 3), cut=cut))

    async def close(self) -> None:
        self.intake.close()
        await pressure.stop(self._watch_task)
        await self.port.close()
        await self.session.close()
        await self.client.close()

    def reconfigure(self, g: GatewayConfig) -> None:
        """A reload: every [gateway] setting but ``listen`` applies to the next request and the next poll."""
        self.g = g
        self.gate.max_held, self.gate.max_in_flight, self.gate.solo_after_s = g.max_held, g.max_in_flight, \
            g.solo_after_s
        self.intake.configure(g)
        self.port.configure(g)
        self.watch.configure(g)

    def status(self) -> dict[str, Any]:
        now = self.host.wall()
        safe = self.quarantine.safe_len(now, self.proven_tokens)
        return {"listen": self.g.listen, **self.counters, "hold_timeout_s": round(self.hold_s(), 1),
                "in_flight": len(self.gate.at_engine),
                "waiting": self.gate.waiting, "open": self.gate.open,
                "shedding": self.pressure.reason if self.pressure else None,
                "quarantine_size": sum(1 for e in self.quarantine.entries.values() if e["until"] > now),
                "safe_prompt_tokens": safe,
                "prompt_limit_source": admission.prompt_limit(self.counter.known_max_len(), safe)[1],
                "longest_prompt_served": self.proven_tokens, "connections": self.port.status(),
                "body_bytes_held": self.intake.budget.held,
                "held_seconds": dict(zip(("buckets", "sum"), self.answers.held_histogram(), strict=True))}

    # ---- the event stream ------------------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        if isinstance(event, StateChanged):
            if event.ready is not None:  # before the gate opens: where this start's engine listens (a spare's port)
                self.client.base_url = event.ready.engine_url or self.cfg.engine.base_url
                self.proven_tokens = max(event.ready.warmup_prompts, default=0)
            self.gate.on_state(event.old, event.new)

    def stopping(self, planned: bool) -> None:
        """Told by the lifecycle before the engine stops: the gate takes what is at the engine (gate.stopping)."""
        self.gate.stopping(planned)

    async def blame(self, kind: FailureKind, suspect_request: str | None, at_floor: bool, chunk: int | None) -> Blame:
        """Asked by the lifecycle after a death, before its policy decides: who goes alone, who is quarantined,
        whether one request alone was proven to cause it."""
        blame = self.gate.on_failure(kind, suspect_request, at_floor)
        if blame.quarantined is not None and blame.quarantined.digest is not None:
            await self._quarantine(blame.quarantined, kind, at_floor, chunk)
        return blame

    async def _quarantine(self, flight: Flight, kind: FailureKind, at_floor: bool, chunk: int | None) -> None:
        assert flight.digest is not None
        await quarantine_store.sketched(flight, self.intake.sketch, SKETCH_WAIT_S)  # its variants are refused too
        reason = quarantine_store.reason(kind.value, flight.tokens, at_floor, chunk)
        # Only a measured count may lower the prompt limit for others (Quarantine.safe_len).
        self.quarantine.keep(flight.digest, self.host.wall(), self.g.quarantine_ttl_s, flight.tokens, reason,
                             kind.value, flight.shape, flight.sketch, flight.prompt)
        self.counters["quarantined"] += 1
        self.publish(RequestQuarantined(at=self.host.wall(), request_hash=flight.digest, prompt_tokens=flight.size,
                                        evidence=f"{reason} (request {flight.rid})"))

    def _shedding_changed(self, p: admission.Pressure | None) -> None:
        self.pressure = p
        self.publish(SheddingChanged(at=self.host.wall(), reason=p.reason if p else "",
                                     everyone=bool(p and p.everyone)))

    # ---- one request -----------------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        conn = listener.of(request)
        if conn is not None:
            conn.head_received()
        try:
            return await self._handle(request)
        finally:
            if conn is not None:
                conn.request_done()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or ""
        if not RID.fullmatch(rid):  # absent, or characters vLLM's ids and our logs should not carry: replaced
            rid = f"gw-{uuid.uuid4().hex[:24]}"
        if request.path in ("/health", "/readyz", "/healthz"):
            return probe(request.path, self.gate, self.side.sound())
        if not routes.public(request.path):
            return self.answers.reject(rid, Rejection(404, "not_found", f"{request.path} is not served on this port"))
        if not self.intake.authorized(request):
            # vLLM's own answer to a request without the key, given before any work is done for it.
            self.answers.count(Rejection(401, "unauthorized", ""), rid)
            return web.json_response({"error": "Unauthorized"}, status=401, headers={"X-Request-Id": rid})
        if self.gate.closing:
            return self.answers.reject(rid, Rejection(503, "shutting_down", "the server is shutting down; retry later",
                                               "server_error", self.g.retry_after_s))
        reading = self.intake.body()
        try:
            return await self._with_body(request, rid, reading)
        finally:
            reading.release()

    async def _with_body(self, request: web.Request, rid: str, reading: intake.Body) -> web.StreamResponse:
        body = await self.intake.read(request, reading)
        if isinstance(body, Rejection):
            return await intake.close_with(self.answers.reject(rid, body), request)
        route = routes.model_route(request.path) if request.method == "POST" else None
        parsed = await self.intake.parse(route, body) if route else None
        if isinstance(parsed, Rejection):
            return self.answers.reject(rid, parsed)
        flight = Flight(rid, parsed.digest if parsed else None, parsed.upper_bound if parsed else 0,
                        arrived=self.host.monotonic(), shape=parsed.shape if parsed else "", body=body,
                        prompt=parsed.prompt_key if parsed else "")
        entry = await self.quarantine.refuses(flight, self.intake.sketch, self.host.wall())
        if entry is not None:
            return self.answers.reject(rid, admission.quarantined(entry, flight.digest or ""))
        if parsed is not None and self.pressure is not None and self.gate.open:
            tokens = await self.counter.tokens_if_long(parsed, flight, self.proven_tokens)
            refused = admission.shed(self.pressure, tokens, self.proven_tokens, self.g.retry_after_s)
            if refused is not None:
                return self.answers.reject(rid, refused)
        try:
            return await self._through(request, route, flight, parsed, body)
        except Refused as r:
            retry = self.g.retry_after_s if r.status == 429 else max(self.g.retry_after_s, self.view().restart_eta_s)
            return self.answers.reject(rid, Rejection(r.status, r.code, r.message, "server_error", retry))
        except asyncio.CancelledError:
            self.counters["client_disconnected"] += 1
            raise
        finally:
            self.gate.forget(flight)

    async def _through(self, request: web.Request, route: str | None, flight: Flight, parsed: Parsed | None,
                       body: bytes) -> web.StreamResponse:
        while True:
            await self._admit(flight)
            # Quarantined while it waited: itself, or the same request (or a variant) sent by another client.
            entry = await self.quarantine.refuses(flight, self.intake.sketch, self.host.wall())
            if flight.quarantined or entry is not None:
                self.gate.leave(flight)
                return self.answers.reject(flight.rid, admission.quarantined(entry or {}, flight.digest or ""))
            if self.gate.solo is flight:  # a suspect: its sketch is ready should it be quarantined
                await quarantine_store.sketched(flight, self.intake.sketch)
            if flight.replays:
                self.counters["replayed"] += 1
                self.publish(RequestReplayed(at=self.host.wall(), request_id=flight.rid, replays=flight.replays,
                                             alone=self.gate.solo is flight))
            if parsed is not None:
                refused = await self._precheck(parsed, flight)
                if refused is not None:
                    self.gate.leave(flight)
                    return self.answers.reject(flight.rid, refused)
            state = StreamState(route or "")
            url = self.client.base_url + str(request.rel_url)  # after the admission: a restart may move the engine
            out = await proxy.forward(self.session, url, request, body, flight.rid, state,
                                      cuttable=route in streams.CONTINUABLE_ROUTES,
                                      send_timeout_s=self.g.send_timeout_s)
            if isinstance(out, proxy.Cut):
                return await self._continue(request, flight, body, out)
            if not isinstance(out, proxy.Unsent):
                self.gate.leave(flight)
                if out.status == 200 and flight.tokens is not None and flight.generation == self.gate.generation:
                    self.proven_tokens = max(self.proven_tokens, flight.tokens)  # the engine ran it: its memory is held
                if isinstance(out, proxy.Forwarded) and out.client_gone:
                    self.counters["client_disconnected"] += 1
                    return out
                self.counters["forwarded"] += 1
                if isinstance(out, proxy.Forwarded) and out.broken:
                    self.counters["streams_broken"] += 1
                return out
            died = await self.gate.engine_left(flight, DEATH_WAIT_S)
            self.gate.leave(flight)
            if not died:  # the engine lives: its error is the answer
                self.counters["engine_errors"] += 1
                return out.response(flight.rid)
            if flight.replays >= self.g.max_replays:
                raise Refused(503, "engine_unavailable", f"the engine failed this request {flight.replays + 1} "
                                                         "times while restarting; retry later")
            flight.replays += 1

    async def _admit(self, flight: Flight) -> None:
        """Wait until ``flight`` may go to the engine (Refused when it may not)."""
        t0 = self.host.monotonic()
        left = flight.arrived + self.hold_s() - t0
        try:
            held = await self.gate.admit(flight, max(0.0, left), self._keep_holding)
        finally:
            self.answers.held_for(self.host.monotonic() - t0)
        if held and flight.replays == 0:
            self.counters["held"] += 1

    async def _continue(self, request: web.Request, flight: Flight, body: bytes, cut: proxy.Cut) -> web.StreamResponse:
        """A stream the engine died under, after text reached the client: continued on the next engine as the
        same stream (streams.py), or ended with an error event where that cannot be faithful."""
        while True:
            # Built from the client's body: in the parser pool when it is big (the loop runs supervision).
            try:
                more = await self.intake.parser.run(len(body), streams.continue_request, body, cut.state)
            except Exception as exc:  # noqa: BLE001 - the client's stream ends with an error event, never silently
                log.error("gateway.continuation_failed", request_id=flight.rid, error=repr(exc)[:200])
                more = streams.Continuation(None, "the gateway could not build its continuation", False)
            cut.state.usage_wanted, why_not = more.usage_wanted, more.why_not
            died = await self.gate.engine_left(flight, DEATH_WAIT_S)
            self.gate.leave(flight)
            if why_not or not died or flight.replays >= self.g.max_replays:
                self.counters["streams_broken"] += 1
                self.counters["forwarded"] += 1  # its 200 and most of its stream reached the client
                reason = f"it cannot be continued faithfully ({why_not})" if why_not else \
                    "it could not be continued" if died else "the engine failed under it"
                return await proxy.end_cut(cut, f"the inference engine failed during this response and {reason}; "
                                                "the response is incomplete, send the request again")
            flight.replays += 1
            try:
                await self._admit(flight)
            except Refused as r:
                self.counters["streams_broken"] += 1
                self.counters["forwarded"] += 1
                return await proxy.end_cut(cut, f"the inference engine failed during this response: {r.message}")
            assert more.body is not None
            self.counters["streams_continued"] += 1
            self.publish(StreamContinued(at=self.host.wall(), request_id=flight.rid, resumed=cut.state.resumed + 1,
                                         tokens_sent=cut.state.tokens, why=cut.why))
            url = self.client.base_url + str(request.rel_url)
            out = await proxy.resume(self.session, url, request, more.body, flight.rid, cut)
            if not isinstance(out, proxy.Cut):
                self.gate.leave(flight)
                self.counters["client_disconnected" if out.client_gone else "forwarded"] += 1
                return out
            cut = out

    def hold_s(self) -> float:
        return hold_bound(self.cfg, self.g, self.view().slowest_start_s)

    def _keep_holding(self) -> bool:
        """With "auto", a request held past its bound keeps waiting while the supervisor's own restart runs."""
        return isinstance(self.g.hold_timeout_s, str) and self.view().restarting

    async def _precheck(self, parsed: Parsed, flight: Flight) -> Rejection | None:
        """413 over the current limits; counts the prompt exactly only when the byte bound is not enough."""
        limit, why = admission.prompt_limit(await self.counter.engine_max_len(),
                                            self.quarantine.safe_len(self.host.wall(), self.proven_tokens))
        # A suspect going alone is counted exactly: if it is quarantined, its count is the evidence shown.
        await self.counter.tokens_if_long(parsed, flight, limit,
                                   always=parsed.prompt_logprobs is not None or self.gate.solo is flight)
        if flight.tokens is None:
            return None
        flight.size = flight.tokens
        if limit is not None:
            refused = admission.too_long(flight.tokens, limit, why)
            if refused is not None:
                return refused
        return admission.logprobs_too_big(parsed, flight.tokens, self.view().chunk, self.vocab,
                                          self.g.prompt_logprobs_max_gib)

    # ---- answers of the gateway's own ------------------------------------------------------------------



@dataclass(frozen=True)
class SupervisorSide:
    """What the gateway asks of the supervisor around it."""

    sound: Callable[[], bool] = lambda: True  # the supervisor's loop beats (what /healthz answers)


def probe(path: str, gate: EngineGate, sound: bool) -> web.Response:
    """The gateway's own probes, never forwarded: ``/healthz`` the supervisor is sound (its loop beats),
    ``/readyz`` the engine takes traffic now (READY, not draining, not shutting down); ``/health`` as before."""
    if path == "/healthz":
        return web.json_response({"ok": sound}, status=200 if sound else 503)
    if gate.closing:
        return web.json_response({"status": "shutting_down", "ready": False, "engine": gate.state.value}, status=503)
    if path == "/readyz":
        return web.json_response({"ready": gate.open, "engine": gate.state.value}, status=200 if gate.open else 503)
    return web.json_response({"status": "ok" if gate.open else "holding", "engine": gate.state.value})


def _accept_failed(host: Host, publish: Callable[[Event], None], error: str, count: int) -> None:
    publish(AcceptFailed(at=host.wall(), error=error, count=count))


def hold_bound(cfg: Config, g: GatewayConfig, slowest_start_s: float | None) -> float:
    """How long a request may wait for the engine: the configured seconds, or with "auto" the slowest start
    this host measured (x1.5) plus what a restart adds before it (stop, GPU release, backoff, the gates)."""
    if not isinstance(g.hold_timeout_s, str):
        return float(g.hold_timeout_s)
    around = (cfg.engine.failed_stop_timeout_s + cfg.engine.kill_timeout_s + cfg.gpu.release_timeout_s
              + cfg.restart.backoff_max_s + cfg.gpu.free_wait_s)
    return max(AUTO_HOLD_MIN_S, 1.5 * (slowest_start_s or 0.0) + around)


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
