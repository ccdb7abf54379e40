"""The gateway's own answers (413, 429, 503, ...): counted, and recorded at most once per code and second."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

from aiohttp import web

from supervisor.decide.admission import Rejection
from supervisor.event_stream import Event, RequestRejected
from supervisor.host import Host


class Answers:
    def __init__(self, counters: dict[str, int], host: Host, publish: Callable[[Event], None]) -> None:
        self.counters, self.host, self.publish = counters, host, publish
        self._last: dict[str, tuple[float, int]] = {}  # code -> (last record, rejections since)

    def reject(self, rid: str, r: Rejection) -> web.Response:
        self.count(r, rid)
        headers = {"X-Request-Id": rid}
        if r.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(r.retry_after_s)))
        return web.Response(status=r.status, text=json.dumps(r.body()), content_type="application/json",
                            headers=headers)

    def refused_raw(self, status: int, code: str) -> None:
        """A connection answered before aiohttp saw a request (the connection cap, a late head)."""
        self.count(Rejection(status, code, ""))

    def count(self, r: Rejection, rid: str = "") -> None:
        self.counters[str(r.status)] = self.counters.get(str(r.status), 0) + 1
        self._record(rid, r)

    def _record(self, rid: str, r: Rejection) -> None:
        """One event per code and second at most: a 429 storm must not flood the log or the stream."""
        now = self.host.monotonic()
        last, since = self._last.get(r.code, (-math.inf, 0))
        if now - last < 1.0:
            self._last[r.code] = (last, since + 1)
            return
        self._last[r.code] = (now, 0)
        self.publish(RequestRejected(at=self.host.wall(), status=r.status, code=r.code, request_id=rid,
                                     count=since + 1))
