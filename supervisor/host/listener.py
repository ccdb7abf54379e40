"""The public port's connections: how many may be open, and how long one may take to send a request
head.

aiohttp times out neither a connection that never finishes its request head (slowloris) nor caps how
many are open, so each accepted connection is wrapped: beyond ``max_connections`` it is answered 503
at once and closed; a connection that has not sent a whole request head within ``header_timeout_s``
of its first byte (or of its accept) is answered 408 and closed. Idle keep-alive connections are
aiohttp's own ``keepalive_timeout`` (``idle_timeout_s``); a trickled body is the handler's
``body_timeout_s``. Running out of file descriptors at accept is counted, reported at most once a
second and retried after ``ACCEPT_RETRY_S`` (the accept loop is ours: asyncio's floods the log);
nothing here raises.
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.web_runner import BaseRunner, BaseSite

from supervisor.config import GatewayConfig


def _raw(status: str, code: str, message: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 answer written straight to the socket, for a connection aiohttp never
    sees."""
    body = json.dumps({"error": {"message": message, "type": "server_error",
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status}\r\n{extra}Connection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


REFUSED = _raw("503 Service Unavailable", "too_many_connections",
               "too many open connections to this server; retry later", "Retry-After: 1\r\n")
ACCEPT_RETRY_S = 0.5  # after an accept failed for want of descriptors or memory
HEAD_LATE = _raw("408 Request Timeout", "header_timeout",
                 "the request head did not arrive in time; send it whole")



class OncePerSecond:
    """At most one report per key and second: a storm (429s, failed accepts) must not flood the
    log or the stream. ``due(key)`` is how many happened since the last report when one is due
    now, else None."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._last: dict[str, tuple[float, int]] = {}  # key -> (last report, happened since)

    def due(self, key: str) -> int | None:
        now = self.clock()
        last, since = self._last.get(key, (-math.inf, 0))
        if now - last < 1.0:
            self._last[key] = (last, since + 1)
            return None
        self._last[key] = (now, 0)
        return since + 1

@dataclass
class Limits:
    max_connections: int
    header_timeout_s: float
    idle_timeout_s: float = 75.0  # aiohttp's keepalive_timeout: applies at start
    per_client: int = 0  # open connections from one peer address (0: no cap)

    @classmethod
    def of(cls, g: GatewayConfig) -> Limits:
        return cls(g.max_connections, g.header_timeout_s, g.idle_timeout_s,
                   g.max_connections_per_client)


@dataclass
class ConnectionCounts:
    refused: int = 0
    header_timeouts: int = 0
    seen: set[GuardedConnection] = field(default_factory=set)  # the connections open now
    by_peer: dict[str, int] = field(default_factory=dict)  # open connections per client address

    @property
    def open(self) -> int:
        return len(self.seen)


class GuardedConnection(asyncio.Protocol):
    """One accepted connection: aiohttp's request handler inside, with the head deadline and the
    cap outside."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.inner: Any = None  # aiohttp's RequestHandler, made only for an accepted connection
        self.transport: asyncio.Transport | None = None
        self.in_request = False
        self.peer = ""
        self._deadline: asyncio.TimerHandle | None = None

    # ---- asyncio's protocol, delegated -----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        counts, limits = self.guard.counts, self.guard.limits
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if len(counts.seen) >= limits.max_connections or \
                (limits.per_client and counts.by_peer.get(self.peer, 0) >= limits.per_client):
            counts.refused += 1
            self.guard.refused(503, "too_many_connections")
            transport.write(REFUSED)
            transport.close()
            return
        counts.seen.add(self)
        counts.by_peer[self.peer] = counts.by_peer.get(self.peer, 0) + 1
        self.inner = self.guard.factory()
        self.inner.connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        counts = self.guard.counts
        if self in counts.seen:
            counts.seen.discard(self)
            left = counts.by_peer.get(self.peer, 1) - 1
            if left > 0:
                counts.by_peer[self.peer] = left
            else:
                counts.by_peer.pop(self.peer, None)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self._deadline is None and not self.in_request:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # ---- the request head's deadline -------------------------------------------------------------
    def head_received(self) -> None:
        """The handler has a whole request head: the deadline is over until the next request
        begins."""
        self.in_request = True
        self._disarm()

    def request_done(self) -> None:
        self.in_request = False

    def _arm(self) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self.guard.limits.header_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_late(self) -> None:
        self._deadline = None
        if self.in_request or self.transport is None or self.transport.is_closing():
            return
        self.guard.counts.header_timeouts += 1
        self.guard.refused(408, "header_timeout")
        self.transport.write(HEAD_LATE)
        self.transport.close()


class ConnectionGuard:
    """Makes a ``GuardedConnection`` per accept, around the handler aiohttp's server would have
    made."""

    def __init__(self, factory: Callable[[], Any], limits: Limits,
                 refused: Callable[[int, str], None]) -> None:
        self.factory, self.limits, self.refused = factory, limits, refused
        self.counts = ConnectionCounts()

    def __call__(self) -> GuardedConnection:
        return GuardedConnection(self)


def of(request: web.BaseRequest) -> GuardedConnection | None:
    """The guarded connection a request came on (None outside a guarded site, e.g. in unit
    tests)."""
    transport = request.transport
    proto = transport.get_protocol() if transport is not None else None
    return proto if isinstance(proto, GuardedConnection) else None


class GuardedSite(BaseSite):
    """aiohttp's TCPSite, but every connection goes through the guard, and accepts are ours.

    asyncio's own accept loop, on EMFILE, logs a traceback and schedules a retry once per backlog
    slot in the same tick (hundreds of lines a second); this one counts the failure, says so at most
    once a second, and tries again after ``ACCEPT_RETRY_S``.
    """

    def __init__(self, runner: BaseRunner, host: str, port: int, guard: ConnectionGuard,
                 on_accept_failed: Callable[[OSError], None], backlog: int = 512) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port = host, port
        self.guard = guard
        self.on_accept_failed = on_accept_failed

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(self._backlog)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._server = Acceptor(sock, self.guard, self.on_accept_failed)  # type: ignore[assignment]


class Acceptor:
    """The listening socket and its accept loop; ``close`` is what aiohttp's site calls at stop."""

    def __init__(self, sock: socket.socket, guard: ConnectionGuard,
                 on_accept_failed: Callable[[OSError], None]) -> None:
        self.sockets = [sock]
        self.sock, self.guard, self.on_accept_failed = sock, guard, on_accept_failed
        self.task = asyncio.create_task(self._serve(), name="gateway:accept")

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except (ConnectionAbortedError, InterruptedError):
                continue
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: out of a resource, for now
                self.on_accept_failed(exc)
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            try:
                await loop.connect_accepted_socket(self.guard, conn)
            except OSError as exc:
                conn.close()
                self.on_accept_failed(exc)

    def close(self) -> None:
        self.task.cancel()
        self.sock.close()


class PublicPort:
    """The listening side of the gateway: aiohttp's runner, the connection guard and the accept
    loop.

    ``accept_failed(error, count)`` is told at most once a second while accepts fail, with how many
    failed.
    """

    def __init__(self, app: web.Application, limits: Limits, close_s: float,
                 refused: Callable[[int, str], None], accept_failed: Callable[[str, int], None],
                 clock: Callable[[], float]) -> None:
        # handler_cancellation: a client that disconnects cancels its handler, which closes the
        # engine request. shutdown_timeout: a client with a half-sent body holds the exit a few
        # seconds, not aiohttp's 60. keepalive_timeout: an idle kept-alive connection is closed
        # (aiohttp's default is an hour).
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                    shutdown_timeout=close_s,
                                    keepalive_timeout=limits.idle_timeout_s)
        self.limits = limits
        self.guard = ConnectionGuard(self._handler, self.limits, refused)
        self.accept_failed = accept_failed
        self.accept_failures = 0
        self._reports = OncePerSecond(clock)

    def _handler(self) -> Any:
        """aiohttp's protocol for one connection (its server exists once the runner is set up)."""
        assert self.runner.server is not None
        return self.runner.server()

    async def start(self, host: str, port: int, key: str) -> None:
        """Listen on ``host:port``; one that cannot be bound names ``key``, the config key that
        set it (``[admin] listen``), and what to do."""
        await self.runner.setup()
        try:
            await GuardedSite(self.runner, host, port, self.guard, self._failed).start()
        except OSError as exc:
            await self.runner.cleanup()
            taken = exc.errno == errno.EADDRINUSE
            raise OSError(
                f"{key} {host}:{port}: {exc.strerror or exc}" + (
                    f" (`ss -ltnp 'sport = :{port}'` names who holds it; a second supervisor on "
                    f"this host needs ports of its own, and `vllm-supervisor status` asks the "
                    f"one there)" if taken else "")) from exc

    async def close(self) -> None:
        await self.runner.cleanup()

    def configure(self, g: GatewayConfig) -> None:
        """A reload: the cap and the head deadline apply to the next connection (idle_timeout_s
        at the next start)."""
        self.limits.max_connections = g.max_connections
        self.limits.header_timeout_s = g.header_timeout_s
        self.limits.per_client = g.max_connections_per_client

    def status(self) -> dict[str, int]:
        c = self.guard.counts
        return {"open": c.open, "refused": c.refused, "header_timeouts": c.header_timeouts,
                "accept_failures": self.accept_failures}

    def _failed(self, exc: OSError) -> None:
        """Out of descriptors (or memory) at accept: the loop waits and tries again; reported
        once a second."""
        self.accept_failures += 1
        n = self._reports.due("accept")
        if n is not None:
            self.accept_failed(str(exc), n)
