"""Fixtures shared by every tier; the helpers themselves live in tests/helpers (see tests/README.md)."""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.processes import STANDIN_BASE, Launcher, Sup, log_events
from tests.helpers.receivers import Receiver


@pytest.fixture
def supervise(tmp_path: Path) -> Iterator[Callable[..., Sup]]:
    """Start `vllm-supervisor run` over the stand-in engine (overrides merge into its config)."""
    launcher = Launcher(tmp_path, STANDIN_BASE, strict_stops=True)
    yield launcher.start
    launcher.cleanup()


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def make(status: int = 200, hang: bool = False, answer: Any = None) -> Receiver:
        made.append(Receiver(status, hang, answer))
        return made[-1]

    yield make
    for r in made:
        r.close()


# What a failed test's supervisors did, in its report: a CI run keeps no tmp_path, and a race seen once there
# (a 200 where a 413 was due) could not be told from its assertion alone.
TOLD = ("engine.state_changed", "engine.failed", "engine.spawned", "engine.recovered", "gateway.request_quarantined",
        "gateway.request_replayed", "gateway.request_rejected", "standby.spawned", "precompile.started",
        "engine.rung_precompiled", "spare.asleep", "spare.woken", "spare.dropped")
KEPT = ("from", "to", "reason", "kind", "evidence", "at_floor", "pid", "standby", "profile", "request_id", "ok")


def told(log: Path, last: int = 60) -> str:
    lines = [f"{str(e.get('timestamp', ''))[11:23]} {e['event']} {json.dumps({k: e[k] for k in KEPT if k in e})[:300]}"
             for e in log_events(log) if e.get("event") in TOLD]
    return "\n".join(lines[-last:])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when == "call" and report.failed and isinstance(tmp, Path):
        for log in sorted(tmp.glob("sup*.log")):
            report.sections.append((f"{log.name}: its events", told(log)))
