"""Before the first start: the engines a supervisor that died left running (SIGKILL, the OOM
killer, a crash), found from its records in the state directory (host/leftovers.py), stopped,
and their GPU memory waited for: each holds a port and the card, and every new start would
fail beside it."""

from __future__ import annotations

import os
from collections.abc import Callable

from supervisor.bounds import STEP_SLACK_S
from supervisor.config import Config
from supervisor.engine import gates
from supervisor.event_stream import Event, LeftoverEngineStopped
from supervisor.host import Host, leftovers


def stop_bound_s(cfg: Config) -> float:
    """How long ``stop_engine_left`` may take (the watchdog's measure): per record, the stop and
    the release wait."""
    e = cfg.engine
    per_record = e.failed_stop_timeout_s + e.kill_timeout_s + cfg.gpu.release_timeout_s
    return len(leftovers.names(cfg.state.dir)) * per_record + STEP_SLACK_S


async def stop_engine_left(cfg: Config, host: Host, publish: Callable[[Event], None]) -> None:
    """Every engine, throwaway or spare a dead supervisor recorded: stopped, and the GPU waited
    for."""
    for name in leftovers.names(cfg.state.dir):
        await _stop_left(cfg, host, publish, name)


async def _stop_left(cfg: Config, host: Host, publish: Callable[[Event], None], name: str) -> None:
    rec = leftovers.read(cfg.state.dir, name)
    if rec is None or rec.supervisor_pid == os.getpid():
        return
    e = cfg.engine
    pids = await host.stop_leftover(rec.sid, rec.born, e.failed_stop_timeout_s, e.kill_timeout_s)
    if pids:
        publish(LeftoverEngineStopped(at=host.wall(), pids=tuple(pids), sid=rec.sid,
                                      what=leftovers.WHAT.get(name, "precompile")))
        await gates.wait_released(cfg, host, publish, tuple(pids))
    leftovers.clear(cfg.state.dir, name)
