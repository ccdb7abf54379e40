"""Stopping one start's engine: the whole tree killed, its pipes drained, its GPU memory seen
released."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import structlog

from supervisor.bounds import STEP_SLACK_S
from supervisor.config import Config
from supervisor.engine import gates
from supervisor.engine.origin import PreparedSource
from supervisor.event_stream import EngineStopped, Event, NoStackDump
from supervisor.host import Host
from supervisor.host.proctree import Child, StopReport

DRAIN_S = 5.0  # pipes reach EOF once every holder is gone; bounded in case a grandchild escaped
# A dead engine whose verdict is settled (settled_before_exit): how long its API server gets to
# answer the requests it had in flight (vLLM fails them the moment its engine core dies) before its
# tree is killed, while a client of its own port is connected.
SETTLED_EXIT_S = 0.25
log = structlog.get_logger("supervisor.engine")


async def death_grace_s(cfg: Config, host: Host, child: Child, url: str,
                        settled: bool) -> float:
    """How long a dead engine's API server may take to exit by itself. vLLM exits within seconds
    of its engine dying; let it finish logging. With the verdict settled already, only long
    enough to answer its requests in flight (a 500, not a reset) to clients of its own port, then
    it is killed; at once when every connection to it is the gateway's, which answers or replays
    what the engine lost either way (the window was 0.26 s of the H200's 1.35 s failover)."""
    if not settled:
        return cfg.engine.dead_grace_s
    port, t0 = urlsplit(url).port, host.monotonic()
    outside = await host.outside_clients(host.tree_pids(child), port) if port else 1
    grace = min(cfg.engine.dead_grace_s, SETTLED_EXIT_S) if outside else 0.0
    log.info("engine.settled_exit_window", window_s=grace, outside_clients=outside,
             checked_s=round(host.monotonic() - t0, 3))
    return grace


async def exit_within(child: Child, seconds: float) -> int | None:
    """The API server's exit status if it exits by itself within ``seconds``, else None."""
    with contextlib.suppress(asyncio.TimeoutError):
        return await asyncio.wait_for(child.wait_exit(), seconds)
    return None


async def stacks(host: Host, publish: Callable[[Event], None], child: Child) -> dict[int, str]:
    """A hung engine's Python stacks, process by process (py-spy), before it is killed; an event
    when none could be taken."""
    dumped = await host.dump_stacks(host.tree_pids(child))
    if not dumped:
        publish(NoStackDump(at=host.wall()))
    return dumped


def stop_bound(cfg: Config, planned: bool) -> float:
    """The most ``stop_tree`` takes: the grace, the kill, the drain, the GPU release wait."""
    e = cfg.engine
    grace = e.stop_timeout_s if planned else e.failed_stop_timeout_s
    return grace + e.kill_timeout_s + DRAIN_S + cfg.gpu.release_timeout_s + STEP_SLACK_S


async def stop_tree(cfg: Config, host: Host, publish: Callable[[Event], None], child: Child,
                    drains: Sequence[asyncio.Task[Any]], planned: bool, at_once: bool,
                    source: PreparedSource | None = None) -> StopReport:
    """Kill ``child``'s whole tree, let its pipes' ``drains`` finish, and wait for its GPU memory
    to be released. A dead or hung engine has nothing to finish: a short grace, then SIGKILL
    (vLLM's API server ignores SIGTERM while its start is failing, and multiprocessing's
    resource tracker always does); ``at_once``: none at all. The release is not waited for
    when a planned stop's successor is a spare awake (or waking) beside this engine
    (``source.woken_ahead``): it needs none of this memory, and a sleep-mode engine's took
    4.5 s to come back on the H200, all of it clients held in a climb. Where that wake fails,
    the next start's GPU gate waits for the memory while it is being released."""
    e = cfg.engine
    t0 = host.monotonic()
    grace = 0.0 if at_once else e.stop_timeout_s if planned else e.failed_stop_timeout_s
    report = await host.terminate_tree(child, grace, e.kill_timeout_s)
    t1 = host.monotonic()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.gather(*drains, return_exceptions=True), DRAIN_S)
    t2 = host.monotonic()
    waited = not (planned and source is not None and source.woken_ahead())
    if waited:
        await gates.wait_released(cfg, host, publish, report.pids)
    publish(
        EngineStopped(at=host.wall(), pids=report.pids, sigkilled=report.killed,
                      survivors=report.survivors, returncode=report.returncode,
                      kill_s=round(t1 - t0, 3), drain_s=round(t2 - t1, 3),
                      gpu_release_s=round(host.monotonic() - t2, 3), planned=planned,
                      at_once=at_once, release_waited=waited))
    return report
