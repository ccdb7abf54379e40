"""An engine that answers but does not serve, and who may reach an engine's control routes (issue 25)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable

from supervisor.child.vllm_hook import environ_of

from tests.helpers.processes import Sup


def post(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, b"", headers or {}, method="POST"), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_an_engine_that_answers_500_with_health_200_is_restarted(supervise: Callable[..., Sup]) -> None:
    """Seen after a local user put the serving engine to sleep through vLLM's dev route: 98 canaries got 500,
    /health said 200, and the supervisor stayed READY while every client got 500."""
    sup = supervise({"engine": {"args": {"enable_sleep_mode": True}, "env": {"VLLM_SERVER_DEV_MODE": "1"}}})
    first = sup.wait_ready()["engine_pid"]
    assert post(sup.engine_url + "/sleep?level=1") == 404  # dev mode is guarded: only the supervisor's token
    token = environ_of(first)["VLLMSUP_CONTROL_TOKEN"]  # as root, or the engine's own user, reads it
    assert post(sup.engine_url + "/sleep?level=1", {"X-Vllm-Supervisor-Token": token}) == 200
    st = sup.wait_for(lambda s: s["state"] == "READY" and s["engine_pid"] != first, 30, "a new engine")
    failed = sup.events("engine.failed")
    assert [f["kind"] for f in failed] == ["hang"] and "canary generation failed 2 times" in failed[0]["evidence"]
    assert st["restarts"] == 1
