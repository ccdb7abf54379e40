"""Writing files only the supervisor's user can read (incidents and the engine record hold PIDs,
engine output and request shapes)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from supervisor.config import is_local_path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, mode 0600 whatever the umask."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    """A state file's JSON. Raises FileNotFoundError when it is absent, and OSError or ValueError
    for any other damage (unreadable, a directory in its place, not UTF-8, not JSON, nested
    too deep to parse): every caller treats those alike, as a warning, never as a reason not
    to start."""
    try:
        return json.loads(path.read_text())
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None


def weights_on_disk(model: str) -> int | None:
    """Bytes of the weights vLLM would load from a local model directory (safetensors when there
    are any, else .bin / .pt); None when the model is not a local directory with weights."""
    path = Path(model).expanduser()
    if not is_local_path(model) or not path.is_dir():
        return None
    for patterns in (("*.safetensors",), ("*.bin", "*.pt")):
        size = sum(f.stat().st_size for pat in patterns for f in path.glob(pat))
        if size:
            return size
    return None
