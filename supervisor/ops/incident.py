"""One JSON bundle per engine failure in <state dir>/incidents: what on-call reads first."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.host.files import write_private

MAX_KEPT = 50


def write(state_dir: str | Path, kind: str, bundle: dict[str, Any],
          redact: Callable[[str], str] | None = None) -> Path:
    """Write one bundle (mode 0600, ``redact`` applied to its whole text); keep the newest MAX_KEPT."""
    d = Path(state_dir) / "incidents"
    d.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    path = d / f"{stamp}-{int(time.time() * 1000) % 1000:03d}-{kind}.json"
    text = json.dumps(bundle, indent=1, default=str)
    write_private(path, redact(text) if redact else text)
    for old in sorted(d.glob("*.json"))[:-MAX_KEPT]:
        old.unlink(missing_ok=True)
    return path
