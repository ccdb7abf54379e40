"""The gateway's own answers (413, 429, 503, ...): counted, and recorded at most once per code
and second."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

from aiohttp import web

from supervisor.decide.admission import Rejection
from supervisor.event_stream import Event, RequestRejected
from supervisor.host import Host
from supervisor.host.listener import OncePerSecond

HELD_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Answers:
    def __init__(self, counters: dict[str, int], host: Host,
                 publish: Callable[[Event], None]) -> None:
        self.counters, self.host, self.publish = counters, host, publish
        self._reports = OncePerSecond(host.monotonic)  # by rejection code
        # requests held, by the first bucket their time fits (+Inf last)
        self.held = [0] * (len(HELD_BUCKETS) + 1)
        self.held_sum = 0.0

    def held_for(self, seconds: float) -> None:
        """A request waited ``seconds`` for the engine (held: not READY, or its caps full)."""
        if seconds < 0.001:
            return  # went straight through
        self.held[next((i for i, b in enumerate(HELD_BUCKETS) if seconds <= b),
                       len(HELD_BUCKETS))] += 1
        self.held_sum += seconds

    def held_histogram(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative buckets (Prometheus' ``le``) and the sum of the seconds held."""
        out, total = [], 0
        for bound, n in zip([*map(str, HELD_BUCKETS), "+Inf"], self.held, strict=True):
            total += n
            out.append((bound, float(total)))
        return out, self.held_sum

    def reject(self, rid: str, r: Rejection) -> web.Response:
        self.count(r, rid)
        headers = {"X-Request-Id": rid}
        if r.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(r.retry_after_s)))
        return web.Response(status=r.status, text=json.dumps(r.body()),
                            content_type="application/json", headers=headers)

    def forwarded(self, out: web.StreamResponse, cut_short: bool = False) -> web.StreamResponse:
        """How a forwarded request ended, counted once: its client left first, or it was answered
        (a stream the engine died under counts as broken too). ``cut_short``: a stream the
        gateway ended with an error event after most of it reached the client, forwarded and
        broken whether or not the client read that end."""
        if getattr(out, "client_gone", False) and not cut_short:
            self.counters["client_disconnected"] += 1
            return out
        self.counters["forwarded"] += 1
        if cut_short or getattr(out, "broken", False):
            self.counters["streams_broken"] += 1
        return out

    def refused_raw(self, status: int, code: str) -> None:
        """A connection answered before aiohttp saw a request (the connection cap, a late head)."""
        self.count(Rejection(status, code, ""))

    def count(self, r: Rejection, rid: str = "") -> None:
        self.counters[str(r.status)] = self.counters.get(str(r.status), 0) + 1
        self._record(rid, r)

    def _record(self, rid: str, r: Rejection) -> None:
        n = self._reports.due(r.code)
        if n is not None:
            self.publish(
                RequestRejected(at=self.host.wall(), status=r.status, code=r.code, request_id=rid,
                                count=n))
