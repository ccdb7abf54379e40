"""The loopback admin API: /healthz (the supervisor's loop is alive), /readyz (engine READY),
/status (JSON, see docs/interface.md), /metrics (Prometheus), /metrics/engine (vLLM's own,
re-exported)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from supervisor.config import AdminConfig
from supervisor.engine_states import EngineState
from supervisor.host.listener import Limits, PublicPort
from supervisor.host.vllm_http import EngineClient, EngineError

# (HTTP status, body, content type) of the current engine's /metrics.
EngineMetrics = Callable[[], Awaitable[tuple[int, bytes, str]]]
ENGINE_SCRAPE_S = 5.0  # under Prometheus' default scrape timeout (10 s)
# an engine up and answering
SCRAPED_STATES = (EngineState.WARMING, EngineState.READY, EngineState.DRAINING)


def make_app(status: Callable[[], dict[str, Any]], loop_alive: Callable[[], bool],
             metrics: Callable[[], bytes], engine_metrics: EngineMetrics) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        ok = loop_alive()
        return web.json_response({"ok": ok}, status=200 if ok else 503)

    async def readyz(_: web.Request) -> web.Response:
        s = status()
        return web.json_response({"ready": s["ready"], "state": s["state"]},
                                 status=200 if s["ready"] else 503)

    async def status_(_: web.Request) -> web.Response:
        return web.json_response(status())

    app = metrics_app(metrics, engine_metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status_)
    return app


async def scrape_engine(client: EngineClient | None, state: EngineState) -> tuple[int, bytes, str]:
    """The serving engine's own /metrics for /metrics/engine (``client``: the current run's); 503
    with the reason while none serves."""
    if client is None or state not in SCRAPED_STATES:
        return 503, f"no engine serving (state {state.value})\n".encode(
        ), "text/plain; charset=utf-8"
    try:
        body, content_type = await client.exposition(timeout=ENGINE_SCRAPE_S)
    except EngineError as exc:
        return 503, f"the engine's /metrics: {exc}\n".encode(), "text/plain; charset=utf-8"
    return 200, body, content_type


def metrics_app(metrics: Callable[[], bytes], engine_metrics: EngineMetrics) -> web.Application:
    """/metrics (the supervisor's, in Prometheus' own content type) and /metrics/engine: the
    engine's port is loopback-only and follows a spare to its own port, so vLLM's series are
    scraped here, as vLLM wrote them. No engine serving (a restart, a stop) answers 503: the
    scrape's ``up`` is 0 and says so."""

    async def metrics_(_: web.Request) -> web.Response:
        return web.Response(body=metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def engine_(_: web.Request) -> web.Response:
        code, body, content_type = await engine_metrics()
        return web.Response(status=code, body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/metrics", metrics_)
    app.router.add_get("/metrics/engine", engine_)
    return app


# The admin and metrics listeners are documented for 0.0.0.0 (a central Prometheus): they get the
# public port's acceptor (EMFILE retried quietly, not asyncio's traceback flood), a connection cap,
# a head deadline and a short keep-alive. Sixty idle connections once filled the descriptor table
# here.
ADMIN_LIMITS = Limits(max_connections=64, header_timeout_s=10.0, idle_timeout_s=15.0)
CLOSE_S = 1.0
log = structlog.get_logger("supervisor.admin")


class AdminServer:
    def __init__(self, app: web.Application, host: str, port: int,
                 clock: Callable[[], float], key: str = "[admin] listen") -> None:
        self.host, self.port_number, self.key = host, port, key
        self.port = PublicPort(app, ADMIN_LIMITS, CLOSE_S, self._refused, self._accept_failed,
                               clock)

    async def start(self) -> None:
        await self.port.start(self.host, self.port_number, self.key)

    async def close(self) -> None:
        await self.port.close()

    def _refused(self, status: int, code: str) -> None:
        log.info("admin.connection_refused", listen=f"{self.host}:{self.port_number}",
                 status=status, code=code)

    def _accept_failed(self, error: str, count: int) -> None:
        log.warning("admin.accept_failed", listen=f"{self.host}:{self.port_number}", error=error,
                    count=count)


def admin_servers(admin: AdminConfig, clock: Callable[[], float],
                  status: Callable[[], dict[str, Any]], loop_alive: Callable[[], bool],
                  metrics: Callable[[], bytes], engine_metrics: EngineMetrics) -> list[AdminServer]:
    """The admin port (loopback), and /metrics alone on ``metrics_listen`` for a central
    Prometheus when set."""
    servers = [
        AdminServer(make_app(status, loop_alive, metrics, engine_metrics), *admin.host_port, clock)
    ]
    if admin.metrics_listen:
        servers.append(
            AdminServer(metrics_app(metrics, engine_metrics), *admin.metrics_host_port, clock,
                        "[admin] metrics_listen"))
    return servers
