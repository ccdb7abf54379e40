"""What the lifecycle asks of the gateway (Front), and what each of its parts is handed
(Part); it knows no other part by a port."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from supervisor.engine_states import Blame, FailureKind

if TYPE_CHECKING:
    from supervisor.config import Config
    from supervisor.decide.policy import Policy
    from supervisor.event_stream import Event
    from supervisor.host import Host
    from supervisor.lifecycle.records import Tally


class Front(Protocol):
    """What the lifecycle asks of the gateway: drain before a planned stop (True when nothing is
    left at the engine), take what is at the
    engine as it stops (told synchronously, before the state is written), who caused a death,
    whether clients are at the engine."""

    async def drain(self, why: str) -> bool: ...
    def stopping(self, planned: bool) -> None: ...
    async def blame(self, kind: FailureKind, suspect_request: str | None, at_floor: bool,
                    chunk: int | None) -> Blame: ...
    def busy(self) -> bool: ...
    def shutdown(self) -> None: ...


class Part:
    """A part of the lifecycle (its failures, its READY period): the same config, host, bus,
    policy, tally and gateway as the lifecycle that owns it."""

    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None], policy: Policy,
                 tally: Tally, front: Front | None) -> None:
        self.cfg, self.host, self.publish = cfg, host, publish
        self.policy, self.front = policy, front
        self.tally, self.remembered = tally, tally.remembered
