"""What the lifecycle asks of the gateway (Front); it knows no other part by a port."""

from __future__ import annotations

from typing import Protocol

from supervisor.engine_states import Blame, FailureKind


class Front(Protocol):
    """What the lifecycle asks of the gateway: drain before a planned stop, take what is at the
    engine as it stops (told synchronously, before the state is written), who caused a death,
    whether clients are at the engine."""

    async def drain(self, why: str) -> None: ...
    def stopping(self, planned: bool) -> None: ...
    async def blame(self, kind: FailureKind, suspect_request: str | None, at_floor: bool,
                    chunk: int | None) -> Blame: ...
    def busy(self) -> bool: ...
    def shutdown(self) -> None: ...
