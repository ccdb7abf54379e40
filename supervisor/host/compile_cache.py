"""What vLLM's own torch.compile cache holds, as the supervisor compiled it: a note in each of its
directories.

``compiled.json`` lives in the state directory: a new or lost one (a second supervisor on the host,
a state volume replaced, a reboot onto a fresh disk) knew nothing, and a first start compiled again
what vLLM's cache held (222 s on the H200). vLLM names a rung's directory by a hash of its config,
which the supervisor cannot compute without importing vLLM, but each start says which directory it
uses ("Using cache directory: ... for vLLM's torch.compile"). After that start reached /health, a
note (``vllm-supervisor.json``: the engine and the rung) is put beside vLLM's files there; a
supervisor reads every note whose directory still holds vLLM's files, so the cache is the record: a
directory removed takes its note with it.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path

import structlog

from supervisor.host import files

log = structlog.get_logger("supervisor.host.compile_cache")
NOTE = "vllm-supervisor.json"
SUBDIR = "torch_compile_cache"
# vLLM's AOT compile (VLLM_USE_AOT_COMPILE): <root>/torch_compile_cache/<AOT>/<hash>
AOT = "torch_aot_compile"
# The directory a start uses, in vLLM's words: its compile cache, or its AOT compile's (vLLM 0.32:
# saved after a compile, or loaded; decorators.py).
USING = re.compile(
    r"Using cache directory: (\S+) for vLLM's torch\.compile|saved AOT compiled function to (\S+)"
    r"|Directly load AOT compilation from path (\S+)")


def root(env: Mapping[str, str]) -> Path:
    """vLLM's cache root in the engine's environment (vllm/envs.py: VLLM_CACHE_ROOT, else
    XDG_CACHE_HOME/vllm, else ~/.cache/vllm)."""
    if env.get("VLLM_CACHE_ROOT"):
        return Path(os.path.expanduser(env["VLLM_CACHE_ROOT"]))
    home = env.get("HOME") or os.path.expanduser("~")
    return Path(env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")) / "vllm"


def directory_of(line: str) -> str | None:
    """The compile cache directory a start's console line names, else None."""
    m = USING.search(line)
    return next((g for g in m.groups() if g), None) if m else None


def rung_dir(used: str, cache_root: Path) -> Path | None:
    """The rung's own directory (``<root>/torch_compile_cache/<hash>``, or
    ``.../torch_aot_compile/<hash>``) of what vLLM said it used
    (``.../<hash>/rank_0_0/backbone``); None for anything outside the cache root."""
    base = (cache_root / SUBDIR).resolve()
    try:
        rel = Path(os.path.realpath(used)).relative_to(base)
    except ValueError:
        return None
    depth = 2 if rel.parts and rel.parts[0] == AOT else 1
    return base.joinpath(*rel.parts[:depth]) if len(rel.parts) > depth else None


def note(used: str, cache_root: Path, engine_id: str, key: str) -> bool:
    """Put (or extend) the note beside vLLM's files of one rung; False where it cannot (a
    warning)."""
    where = rung_dir(used, cache_root)
    if where is None or not where.is_dir():
        log.warning(
            "compile_cache.not_noted", used=used, root=str(cache_root),
            hint="the directory vLLM named is not inside the cache root of the engine's environment"
        )
        return False
    held = _read(where / NOTE)
    keys = held.setdefault(engine_id, [])
    if key in keys:
        return True
    keys.append(key)
    try:
        files.write_private(where / NOTE, json.dumps(held))
    except OSError as exc:
        log.warning("compile_cache.not_noted", used=used, error=str(exc))
        return False
    return True


def read(cache_root: Path) -> dict[str, list[str]]:
    """Every note under ``cache_root`` whose directory still holds vLLM's files, merged: {engine
    id: [rung keys]}."""
    out: dict[str, list[str]] = {}
    dirs: list[Path] = []
    for where in (cache_root / SUBDIR, cache_root / SUBDIR / AOT):
        try:
            dirs += sorted(d for d in where.iterdir() if d.name != AOT)
        except OSError:
            continue
    for d in dirs:
        if not (d / NOTE).is_file() or not any(d.glob("rank_*/*")):
            continue
        for engine_id, keys in _read(d / NOTE).items():
            merged = out.setdefault(engine_id, [])
            merged += [k for k in keys if k not in merged]
    return out


def set_aside(cache_root: Path, stamp: str) -> Path | None:
    """Rename vLLM's torch.compile cache under ``cache_root`` to ``<subdir>.set-aside-<stamp>`` (a
    ``compile_cache`` failure: its graphs cannot run); the new path, or None where there was none.
    Raises OSError where it cannot be renamed. Renamed, not removed: a person may want to see it,
    and a rename is instant where removing gigabytes is not."""
    cache = cache_root / SUBDIR
    if not cache.is_dir():
        return None
    moved = cache_root / f"{SUBDIR}.set-aside-{stamp}"
    cache.rename(moved)
    return moved


def set_aside_at(cache_root: Path, wall: float) -> tuple[Path | None, str | None]:
    """``set_aside`` stamped with ``wall`` (UTC): where the cache went (None where there was none),
    and, where it could not be moved, what to do."""
    try:
        return set_aside(cache_root, time.strftime("%Y%m%dT%H%M%S", time.gmtime(wall))), None
    except OSError as exc:
        return None, f"{exc}: move or remove it by hand before the next start"


def _read(path: Path) -> dict[str, list[str]]:
    try:
        doc = files.read_json(path)
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {str(k): [str(x) for x in v] for k, v in doc.items() if isinstance(v, list)}
