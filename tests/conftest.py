"""Fixtures shared by every tier; the helpers themselves live in tests/helpers (see tests/README.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.processes import STANDIN_BASE, Launcher, Sup
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


