"""systemd's notify protocol (READY, STATUS, WATCHDOG, EXTEND_TIMEOUT_USEC, STOPPING) via sdnotify.

Silent when NOTIFY_SOCKET is unset (not under a Type=notify unit). As an event-stream subscriber
it turns state changes into STATUS= lines, the first READY into READY=1 and a stop request into
STOPPING=1. The watchdog is not an event: the supervision loop pets it from its own progress.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import sdnotify

from supervisor.engine_states import EngineState
from supervisor.event_stream import (
    BuildingBeside,
    BuildingFirst,
    Event,
    PrecompileCrashed,
    Reloaded,
    ReloadFailed,
    Reloading,
    RungPrecompiled,
    StartupStep,
    StateChanged,
    StopRequested,
)

# what a long start, or a build beside the serving engine, adds to STATUS= in parentheses
STEP_EVENTS = (StartupStep, BuildingFirst, BuildingBeside)


def status_line(state: str, profile: Mapping[str, Any], restarts: int) -> str:
    def v(k: str) -> str:
        x = profile.get(k)
        return "default" if x is None else f"{x:g}" if isinstance(x, float) else str(x)

    return (f"{state} chunk={v('max_num_batched_tokens')} seqs={v('max_num_seqs')} "
            f"util={v('gpu_memory_utilization')} restarts={restarts}")


class Notifier:
    def __init__(self, start_budget_s: float = 0.0) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._n = sdnotify.SystemdNotifier() if self.enabled else None
        if self._n is not None and self._n.socket is not None:
            # A reader that stopped reading must never block our event loop: drop instead (a full
            # AF_UNIX datagram queue holds only net.unix.max_dgram_qlen = 10 messages by default).
            self._n.socket.setblocking(False)
        usec = os.environ.get("WATCHDOG_USEC", "")
        self.watchdog_interval_s = int(usec) / 1e6 / 2 if usec.isdigit() and int(usec) > 0 else None
        self.start_budget_s = start_budget_s  # what one start may take: load + warm-up
        self.ready_sent = False
        # RELOADING=1 sent: READY=1 is owed when the file is applied or refused
        self.reloading = False
        # the last state change, for step lines
        self.last: tuple[str, Mapping[str, Any], int] | None = None
        # STATUS= says what is built beside the serving engine, until that build ends
        self.beside = False

    def send(self, *fields: str) -> None:
        if self._n is not None:
            self._n.notify("\n".join(fields))

    def on_event(self, event: Event) -> None:
        if isinstance(event, STEP_EVENTS) and self.last is not None:
            # A long start says which step it is in, not only STARTING (building first n of m,
            # loading weights, compiling, ...); READY says what is built beside it, until that ends.
            state, knobs, restarts = self.last
            step = event.step if isinstance(event, StartupStep) else event.line()
            self.beside = self.beside or isinstance(event, BuildingBeside)
            self.send(f"STATUS={status_line(f'{state} ({step})', knobs, restarts)}")
        elif isinstance(event, RungPrecompiled | PrecompileCrashed) and self.beside:
            self.beside = False
            assert self.last is not None
            self.send(f"STATUS={status_line(*self.last)}")
        elif isinstance(event, StateChanged):
            self.beside = False
            self.last = (event.new.value, event.profile.knobs(), event.restarts)
            line = f"STATUS={status_line(event.new.value, event.profile.knobs(), event.restarts)}"
            if event.new is EngineState.READY and not self.ready_sent:
                self.ready_sent = True
                self.send("READY=1", line)
            elif event.new is EngineState.STARTING and not self.ready_sent and self.start_budget_s:
                # Until the first READY systemd's start timeout runs: extend it by one start's
                # budget.
                self.send(f"EXTEND_TIMEOUT_USEC={int(self.start_budget_s * 1e6)}", line)
            else:
                self.send(line)
        elif isinstance(event, StopRequested):
            self.send("STOPPING=1")
        elif isinstance(event, Reloading) and self.ready_sent:
            # Before the first READY systemd is still starting the unit: no reload state to open.
            self.reloading = True
            # MONOTONIC_USEC: what Type=notify-reload units need with RELOADING=1.
            self.send("RELOADING=1",
                      f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
        elif isinstance(event, ReloadFailed | Reloaded) and self.reloading:
            # The reload is over when the file is applied or refused: a restart it asks for is the
            # engine's business (STATUS= says it), never a unit stuck in "reloading" while the
            # engine starts or fails.
            self.reloading = False
            outcome = ("failed: kept the old config" if isinstance(event, ReloadFailed)
                       else "applied; engine restarting" if event.engine_restart else "applied")
            self.send("READY=1", f"STATUS=reload {outcome}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")
