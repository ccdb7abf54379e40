"""The unit tier never reads this machine's own vLLM cache: the compile notes a real engine left there
(host/compile_cache.py) would be records of what some other run compiled."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _own_vllm_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    root: Path = tmp_path_factory.mktemp("vllm-cache")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
