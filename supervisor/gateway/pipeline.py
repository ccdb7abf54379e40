"""One request through the public port, from its head to its answer.

Its body read under a size cap and parsed (generation routes), refused if quarantined, shed (429)
under real memory pressure, held at the gate while the engine is not READY, prechecked against the
current profile's limits (413), forwarded, re-issued to the next engine when the engine lost it
before the client got a byte, and a stream cut after text reached the client continued there
(streams.py). The parts it uses are the gateway's (gateway/server.py builds them); what it learns of
the engine it reads from ``view``.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import aiohttp
import structlog
from aiohttp import web

from supervisor.config import Config, GatewayConfig
from supervisor.decide import admission
from supervisor.decide.admission import Parsed, Rejection
from supervisor.event_stream import Event, RequestReplayed, StreamContinued
from supervisor.gateway import intake, proxy, quarantine_store, streams
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
AUTO_HOLD_MIN_S = 180.0  # "auto" never holds for less than this (the number it replaced)


@dataclass(frozen=True)
class EngineView:
    """What the gateway may know of the engine the supervisor runs now."""

    chunk: int  # the profile's max_num_batched_tokens (vLLM's default when unset)
    max_model_len: int | None
    pids: set[int] = field(default_factory=set)
    restart_eta_s: float = 30.0
    # start -> READY, the slowest this host has measured (state.json)
    slowest_start_s: float | None = None
    # the supervisor is bringing the engine back (a restart it began is under way)
    restarting: bool = False


@dataclass(frozen=True)
class SupervisorSide:
    """What the gateway asks of the supervisor around it."""

    sound: Callable[[], bool] = lambda: True  # the supervisor's loop beats (what /healthz answers)


class RequestPath:
    """Carries each request; holds what requests teach the gateway: the longest prompt the
    current engine ran and the memory pressure in force."""

    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None],
                 view: Callable[[], EngineView], side: SupervisorSide, gate: EngineGate,
                 intake: intake.Intake, quarantine: quarantine_store.StoredQuarantine,
                 answers: Answers, client: EngineClient, vocab: int) -> None:
        assert cfg.gateway is not None
        self.cfg, self.g, self.host, self.publish = cfg, cfg.gateway, host, publish
        self.view, self.side, self.gate, self.intake = view, side, gate, intake
        self.quarantine, self.answers, self.client = quarantine, answers, client
        self.counters, self.vocab = answers.counters, vocab
        self.counter = PromptCounter(client, lambda: gate.generation, lambda: view().max_model_len)
        self.pressure: admission.Pressure | None = None
        # the longest prompt the current engine ran (its warm-up's): its memory is held
        self.proven_tokens = 0

    @cached_property
    def session(self) -> aiohttp.ClientSession:
        """Made at the first request: a supervisor that never listened (its port taken) has none
        left unclosed at its exit."""
        return proxy.new_session()

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
        # absent, or characters vLLM's ids and our logs should not carry: replaced
        if not RID.fullmatch(rid):
            rid = f"gw-{uuid.uuid4().hex[:24]}"
        if request.path in ("/health", "/readyz", "/healthz"):
            return probe(request.path, self.gate, self.side.sound())
        if not routes.public(request.path):
            return self.answers.reject(
                rid, Rejection(404, "not_found", f"{request.path} is not served on this port"))
        if not self.intake.authorized(request):
            # vLLM's own answer to a request without the key, given before any work is done for it.
            self.answers.count(Rejection(401, "unauthorized", ""), rid)
            return web.json_response({"error": "Unauthorized"}, status=401,
                                     headers={"X-Request-Id": rid})
        if self.gate.closing:
            return self.answers.reject(
                rid,
                Rejection(503, "shutting_down", "the server is shutting down; retry later",
                          "server_error", self.g.retry_after_s))
        reading = self.intake.body()
        try:
            return await self._with_body(request, rid, reading)
        finally:
            reading.release()

    async def _with_body(self, request: web.Request, rid: str,
                         reading: intake.Body) -> web.StreamResponse:
        body = await self.intake.read(request, reading)
        if isinstance(body, Rejection):
            return await intake.close_with(self.answers.reject(rid, body), request)
        route = routes.model_route(request.path) if request.method == "POST" else None
        parsed = await self.intake.parse(route, body) if route else None
        if isinstance(parsed, Rejection):
            return self.answers.reject(rid, parsed)
        flight = Flight.of(rid, parsed, body, self.host.monotonic())
        entry = await self.quarantine.refuses(flight, self.intake.sketch, self.host.wall())
        if entry is not None:
            return self.answers.reject(rid, admission.quarantined(entry, flight.digest or ""))
        if parsed is not None and self.pressure is not None and self.gate.open:
            tokens = await self.counter.tokens_if_long(parsed, flight, self.proven_tokens)
            refused = admission.shed(self.pressure, tokens, self.proven_tokens,
                                     self.g.retry_after_s)
            if refused is not None:
                return self.answers.reject(rid, refused)
        try:
            return await self._through(request, route, flight, parsed, body)
        except Refused as r:
            retry = self.g.retry_after_s if r.status == 429 else max(self.g.retry_after_s,
                                                                     self.view().restart_eta_s)
            return self.answers.reject(
                rid, Rejection(r.status, r.code, r.message, "server_error", retry))
        except asyncio.CancelledError:
            self.counters["client_disconnected"] += 1
            raise
        finally:
            self.gate.forget(flight)

    async def _through(self, request: web.Request, route: str | None, flight: Flight,
                       parsed: Parsed | None, body: bytes) -> web.StreamResponse:
        while True:
            await self._admit(flight)
            # Quarantined while it waited: itself, or the same request (or a variant) sent by
            # another client.
            entry = await self.quarantine.refuses(flight, self.intake.sketch, self.host.wall())
            if flight.quarantined or entry is not None:
                self.gate.leave(flight)
                return self.answers.reject(flight.rid,
                                           admission.quarantined(entry or {}, flight.digest or ""))
            if self.gate.solo is flight:  # a suspect: its sketch is ready should it be quarantined
                await quarantine_store.sketched(flight, self.intake.sketch)
            if flight.replays:
                self.counters["replayed"] += 1
                self.publish(
                    RequestReplayed(at=self.host.wall(), request_id=flight.rid,
                                    replays=flight.replays, alone=self.gate.solo is flight))
            if parsed is not None:
                refused = await self._precheck(parsed, flight)
                if refused is not None:
                    self.gate.leave(flight)
                    return self.answers.reject(flight.rid, refused)
            state = StreamState(route or "")
            # after the admission: a restart may move the engine
            url = self.client.base_url + str(request.rel_url)
            out = await proxy.forward(self.session, url, request, body, flight.rid, state,
                                      cuttable=route in streams.CONTINUABLE_ROUTES,
                                      send_timeout_s=self.g.send_timeout_s)
            if isinstance(out, proxy.Cut):
                return await self._continue(request, flight, body, out)
            if not isinstance(out, proxy.Unsent):
                self.gate.leave(flight)
                ran = flight.generation == self.gate.generation
                if out.status == 200 and flight.tokens is not None and ran:
                    # the engine ran it: its memory is held
                    self.proven_tokens = max(self.proven_tokens, flight.tokens)
                return self.answers.forwarded(out)
            died = await self.gate.engine_left(flight, DEATH_WAIT_S)
            self.gate.leave(flight)
            if not died:  # the engine lives: its error is the answer
                self.counters["engine_errors"] += 1
                return out.response(flight.rid)
            if flight.replays >= self.g.max_replays:
                raise Refused(
                    503, "engine_unavailable",
                    f"the engine failed this request {flight.replays + 1} "
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

    async def _continue(self, request: web.Request, flight: Flight, body: bytes,
                        cut: proxy.Cut) -> web.StreamResponse:
        """A stream the engine died under, after text reached the client: continued on the next
        engine as the same stream (streams.py), or ended with an error event where that cannot
        be faithful."""
        while True:
            # Built from the client's body: in the parser pool when it is big (the loop runs
            # supervision).
            try:
                more = await self.intake.parser.run(len(body), streams.continue_request, body,
                                                    cut.state)
            # the client's stream ends with an error event, never silently
            except Exception as exc:  # noqa: BLE001
                log.error("gateway.continuation_failed", request_id=flight.rid,
                          error=repr(exc)[:200])
                more = streams.Continuation(None, "the gateway could not build its continuation",
                                            False)
            cut.state.usage_wanted, why_not = more.usage_wanted, more.why_not
            died = await self.gate.engine_left(flight, DEATH_WAIT_S)
            self.gate.leave(flight)
            if why_not or not died or flight.replays >= self.g.max_replays:
                reason = f"it cannot be continued faithfully ({why_not})" if why_not else \
                    "it could not be continued" if died else "the engine failed under it"
                # its 200 and most of its stream: the client's
                return self.answers.forwarded(
                    await proxy.end_cut(
                        cut,
                        f"the inference engine failed during this response and {reason}; the "
                        "response is "
                        "incomplete, send the request again"), cut_short=True)
            flight.replays += 1
            try:
                await self._admit(flight)
            except Refused as r:
                return self.answers.forwarded(
                    await
                    proxy.end_cut(cut,
                                  f"the inference engine failed during this response: {r.message}"),
                    cut_short=True)
            assert more.body is not None
            self.counters["streams_continued"] += 1
            self.publish(
                StreamContinued(at=self.host.wall(), request_id=flight.rid,
                                resumed=cut.state.resumed + 1, tokens_sent=cut.state.tokens,
                                why=cut.why))
            url = self.client.base_url + str(request.rel_url)
            out = await proxy.resume(self.session, url, request, more.body, flight.rid, cut)
            if not isinstance(out, proxy.Cut):
                self.gate.leave(flight)
                return self.answers.forwarded(out)
            cut = out

    def hold_s(self) -> float:
        """How long a request may wait for the engine now (hold_bound)."""
        return hold_bound(self.cfg, self.g, self.view().slowest_start_s)

    def _keep_holding(self) -> bool:
        """With "auto", a request held past its bound keeps waiting while the supervisor's own
        restart runs."""
        return isinstance(self.g.hold_timeout_s, str) and self.view().restarting

    async def _precheck(self, parsed: Parsed, flight: Flight) -> Rejection | None:
        """413 over the current limits; counts the prompt exactly only when the byte bound is not
        enough."""
        limit, why = admission.prompt_limit(
            await self.counter.engine_max_len(),
            self.quarantine.safe_len(self.host.wall(), self.proven_tokens))
        # A suspect going alone is counted exactly: if it is quarantined, its count is the evidence
        # shown.
        await self.counter.tokens_if_long(
            parsed, flight, limit, always=parsed.prompt_logprobs is not None
            or self.gate.solo is flight)
        if flight.tokens is None:
            return None
        flight.size = flight.tokens
        if limit is not None:
            refused = admission.too_long(flight.tokens, limit, why)
            if refused is not None:
                return refused
        return admission.logprobs_too_big(parsed, flight.tokens, self.view().chunk, self.vocab,
                                          self.g.prompt_logprobs_max_gib)


def probe(path: str, gate: EngineGate, sound: bool) -> web.Response:
    """The gateway's own probes, never forwarded: ``/healthz`` the supervisor is sound (its loop
    beats), ``/readyz`` the engine takes traffic now (READY, not draining, not shutting down);
    ``/health`` as before."""
    if path == "/healthz":
        return web.json_response({"ok": sound}, status=200 if sound else 503)
    if gate.closing:
        return web.json_response(
            {"status": "shutting_down", "ready": False, "engine": gate.state.value}, status=503)
    if path == "/readyz":
        return web.json_response({"ready": gate.open, "engine": gate.state.value},
                                 status=200 if gate.open else 503)
    return web.json_response(
        {"status": "ok" if gate.open else "holding", "engine": gate.state.value})


def hold_bound(cfg: Config, g: GatewayConfig, slowest_start_s: float | None) -> float:
    """How long a request may wait for the engine: the configured seconds, or with "auto" the
    slowest start this host measured (x1.5) plus what a restart adds before it (stop, GPU
    release, backoff, the gates)."""
    if not isinstance(g.hold_timeout_s, str):
        return float(g.hold_timeout_s)
    around = (cfg.engine.failed_stop_timeout_s + cfg.engine.kill_timeout_s
              + cfg.gpu.release_timeout_s + cfg.restart.backoff_max_s + cfg.gpu.free_wait_s)
    return max(AUTO_HOLD_MIN_S, 1.5 * (slowest_start_s or 0.0) + around)
