"""``[recovery] precompile``: the compiled graphs of the rungs a restart or a climb would pick, made
while the engine serves (the throwaway itself is recovery/throwaway.py's; recovery/next_build.py
decides when).

vLLM keys its torch.compile cache on a hash that includes ``max_num_batched_tokens`` and
``max_num_seqs`` (the compile ranges end at the batch token budget), so the first start at a new
rung compiles from scratch: on 2 CPU cores that is ~13 s more than a start from the cache. A
precompile is a throwaway engine at the rung with dummy weights (the load format is not part of
the hash), stopped as soon as it answers /health: its artifacts land in the same cache. It runs
niced, once the engine is idle, and is killed the moment the engine needs the host back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import structlog

from supervisor.config import Config
from supervisor.host import Host, compile_cache, files
from supervisor.profile import CHUNKED_PREFILL_ON, Profile
from supervisor.recovery.standby import fingerprint

log = structlog.get_logger("supervisor.recovery.precompile")
RECORD = "compiled.json"
UNKNOWN = "?"  # the vLLM version, before any engine of this run said it


def _key_now(stored: str) -> str:
    """A compile key as recorded by an earlier supervisor, as ``Profile.compile_key`` writes it
    now (chunked prefill said explicitly is vLLM's default)."""
    return " ".join(t for t in stored.split(" ") if t != CHUNKED_PREFILL_ON)


def _merge(into: dict[str, list[str]], source: dict[Any, Any]) -> None:
    """``source``'s rungs (a record or a cache's notes) added to ``into``. A record under no version
    is from a run that never learnt it (no READY): its vLLM may be another."""
    for k, v in source.items():
        if isinstance(v, list) and not str(k).startswith(f"{UNKNOWN}:"):
            keys = into.setdefault(str(k), [])
            keys += [x for x in dict.fromkeys(_key_now(str(x)) for x in v) if x not in keys]


class Precompiler:
    """The record of the rungs whose graphs are in vLLM's cache (``compiled.json``), and whether
    a throwaway may compile one now (``allowed``; ``why`` says why or why not, for /status)."""

    def __init__(self, cfg: Config, host: Host) -> None:
        self.cfg, self.host = cfg, host
        self.record = Path(cfg.state.dir) / RECORD
        self.cache_root = compile_cache.root(cfg.engine.environment())
        self.compiled: dict[str, list[str]] = self._load()
        # (cache directory, key) compiled before the version was known
        self._unnoted: list[tuple[str, str]] = []
        self.why = "not asked yet: the engine has not been idle long enough"
        # where the rungs were last decided to be compiled: "first", "beside"
        self.order: str | None = None

    def configure(self, cfg: Config) -> None:
        """A reload: one that moves vLLM's cache (``VLLM_CACHE_ROOT`` and the like in
        ``[engine.env]``) reads the notes of the new cache and notes the next compiles there."""
        self.cfg = cfg
        cache_root = compile_cache.root(cfg.engine.environment())
        if cache_root != self.cache_root:
            self.cache_root = cache_root
            _merge(self.compiled, compile_cache.read(cache_root))

    # ---- the compile record ----------------------------------------------------------------------
    def _load(self) -> dict[str, list[str]]:
        """compiled.json, and the notes in vLLM's own compile cache (a new or lost state
        directory finds there what earlier supervisors compiled on this host:
        host/compile_cache.py)."""
        try:
            doc = files.read_json(self.record)
        except (OSError, ValueError):
            doc = {}
        merged: dict[str, list[str]] = {}
        for source in (doc if isinstance(doc, dict) else {}, compile_cache.read(self.cache_root)):
            _merge(merged, source)
        return merged

    def _engine_id(self, version: str | None) -> str:
        args = json.dumps(self.cfg.engine.args, sort_keys=True)
        return f"{version or UNKNOWN}:{fingerprint(self.cfg.engine)}:{args}"

    def known_version(self) -> str | None:
        """The vLLM an engine of this command and arguments last reported on this host: before a
        run's first READY, what its compiles are taken to be for (after an upgrade the first
        start compiles nothing first; the next planned one does)."""
        tail = self._engine_id(None).removeprefix(f"{UNKNOWN}:")
        mine = [k.removesuffix(f":{tail}") for k in self.compiled if k.endswith(f":{tail}")]
        return next((v for v in reversed(mine) if v != UNKNOWN), None)

    def is_compiled(self, profile: Profile, version: str | None) -> bool:
        return profile.compile_key() in self.compiled.get(self._engine_id(version), [])

    def note_compiled(self, profile: Profile, version: str | None,
                      cache_dir: str | None = None) -> None:
        """A start reached READY at ``profile`` (or a second engine answered /health): its graphs
        are in vLLM's cache now, in ``cache_dir`` when it said which (noted there too, once
        its vLLM is known)."""
        keys = self.compiled.setdefault(self._engine_id(version), [])
        if profile.compile_key() not in keys:
            keys.append(profile.compile_key())
            self._save()
        if cache_dir is not None and version is None:
            self._unnoted.append((cache_dir, profile.compile_key()))
        elif cache_dir is not None:
            compile_cache.note(cache_dir, self.cache_root, self._engine_id(version),
                               profile.compile_key())

    def learnt_version(self, version: str | None) -> None:
        """An engine said which vLLM this is: what second engines compiled before it (a start's
        compile-first, a spare built first) was the same install's."""
        unknown = self.compiled.pop(self._engine_id(None), None)
        if version is not None:
            for cache_dir, key in self._unnoted:
                compile_cache.note(cache_dir, self.cache_root, self._engine_id(version), key)
            self._unnoted.clear()
        if version is None or unknown is None:
            return
        keys = self.compiled.setdefault(self._engine_id(version), [])
        keys += [k for k in unknown if k not in keys]
        self._save()

    def forget_compiled(self) -> None:
        """vLLM's compile cache was moved aside (a ``compile_cache`` failure): nothing is compiled
        any more, for this supervisor or a later one on this state directory."""
        self.compiled.clear()
        self._unnoted.clear()
        self._save()

    def _save(self) -> None:
        try:
            files.write_private(self.record, json.dumps(self.compiled, indent=1))
        except OSError as exc:
            log.warning("state.compiled_record_failed", error=str(exc))


    def status(self, running: bool) -> dict[str, Any]:
        return {"running": running, "order": self.order, "why": self.why}
