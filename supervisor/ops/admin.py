"""The loopback admin API: /healthz (the supervisor's loop is alive), /readyz (engine READY),
/status (JSON, see docs/interface.md), /metrics (Prometheus)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST


def make_app(status: Callable[[], dict[str, Any]], loop_alive: Callable[[], bool],
             metrics: Callable[[], bytes]) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        ok = loop_alive()
        return web.json_response({"ok": ok}, status=200 if ok else 503)

    async def readyz(_: web.Request) -> web.Response:
        s = status()
        return web.json_response({"ready": s["ready"], "state": s["state"]}, status=200 if s["ready"] else 503)

    async def status_(_: web.Request) -> web.Response:
        return web.json_response(status())

    app = metrics_app(metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status_)
    return app


def metrics_app(metrics: Callable[[], bytes]) -> web.Application:
    """/metrics alone, in Prometheus' own content type."""

    async def metrics_(_: web.Request) -> web.Response:
        return web.Response(body=metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics_)
    return app


class AdminServer:
    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self.runner = web.AppRunner(app, access_log=None)
        self.host, self.port = host, port

    async def start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port, reuse_address=True)
        await site.start()

    async def close(self) -> None:
        await self.runner.cleanup()
