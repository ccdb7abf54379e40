"""``[recovery] precompile``: the compiled graphs of the rungs a restart or a climb would pick, made while
the engine serves (the throwaway itself is recovery/throwaway.py's; recovery/ahead.py decides when).

vLLM keys its torch.compile cache on a hash that includes ``max_num_batched_tokens`` and
``max_num_seqs`` (the compile ranges end at the batch token budget), so the first start at a new
rung compiles from scratch: on 2 CPU cores that is ~13 s more than a start from the cache. A
precompile is a throwaway engine at the rung with dummy weights (the load format is not part of
the hash), stopped as soon as it answers /health: its artifacts land in the same cache. It runs
niced, once the engine is idle, and is killed the moment the engine needs the host back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from supervisor.bounds import GIB
from supervisor.config import Config
from supervisor.host import Host, files
from supervisor.host.gpu import DeviceSnapshot, GpuLost, free_fraction
from supervisor.profile import Profile
from supervisor.recovery.sizing import second_engine_bytes
from supervisor.recovery.standby import fingerprint

log = structlog.get_logger("supervisor.recovery.precompile")
RECORD = "compiled.json"


class Precompiler:
    """The record of the rungs whose graphs are in vLLM's cache (``compiled.json``), and whether a throwaway may
    compile one now (``allowed``; ``why`` says why or why not, for /status)."""

    def __init__(self, cfg: Config, host: Host) -> None:
        self.cfg, self.host = cfg, host
        self.record = Path(cfg.state.dir) / RECORD
        self.compiled: dict[str, list[str]] = self._load()
        self.why = "not asked yet: the engine has not been idle long enough"

    def configure(self, cfg: Config) -> None:
        self.cfg = cfg

    # ---- the compile record ------------------------------------------------------------------------
    def _load(self) -> dict[str, list[str]]:
        try:
            doc = files.read_json(self.record)
        except (OSError, ValueError):
            return {}
        return {str(k): [str(x) for x in v] for k, v in doc.items() if isinstance(v, list)} \
            if isinstance(doc, dict) else {}

    def _engine_id(self, version: str | None) -> str:
        return f"{version or '?'}:{fingerprint(self.cfg.engine)}:{json.dumps(self.cfg.engine.args, sort_keys=True)}"

    def is_compiled(self, profile: Profile, version: str | None) -> bool:
        return profile.compile_key() in self.compiled.get(self._engine_id(version), [])

    def note_compiled(self, profile: Profile, version: str | None) -> None:
        """A start reached READY at ``profile`` (or a second engine answered /health): its graphs are in vLLM's
        cache now."""
        keys = self.compiled.setdefault(self._engine_id(version), [])
        if profile.compile_key() not in keys:
            keys.append(profile.compile_key())
            try:
                files.write_private(self.record, json.dumps(self.compiled, indent=1))
            except OSError as exc:
                log.warning("state.compiled_record_failed", error=str(exc))

    # ---- may a throwaway compile now ---------------------------------------------------------------------
    async def allowed(self, rung: Profile) -> bool:
        mode = self.cfg.recovery.precompile
        if mode != "auto":
            self.why = f'[recovery] precompile = "{mode}"'
            return mode == "on"
        try:
            snaps = await self.host.gpu_snapshot(self.cfg.engine.devices())
        except GpuLost:
            self.why = "the GPU is lost"
            return False
        if not snaps:
            self.why = "auto: no GPU, so a throwaway competes only for CPU, niced and while the engine is idle"
            return True
        ok, self.why = room_for_throwaway(snaps, self.cfg.engine.model, rung, self.cfg.engine.ranks())
        return ok

    async def beside_the_engine(self, rung: Profile) -> Profile:
        """On a GPU the throwaway must fit in what the serving engine left: half of it (vLLM's start check wants
        utilization x total free). The utilization is not part of the compile hash."""
        try:
            free = free_fraction(await self.host.gpu_snapshot(self.cfg.engine.devices()))
        except GpuLost:
            return rung
        if free is None:
            return rung
        return rung.with_(gpu_memory_utilization=round(max(0.01, free / 2), 3))

    def status(self, running: bool) -> dict[str, Any]:
        return {"running": running, "why": self.why}


def room_for_throwaway(snaps: Sequence[DeviceSnapshot], model: str, rung: Profile,
                       ranks: int = 1) -> tuple[bool, str]:
    """On a GPU, "auto" compiles ahead only when half of what the serving engine left free holds a second copy
    of the weights, the rung's prefill peak and a little KV cache (the throwaway takes half: vLLM's start
    check wants utilization x total free). A tensor-parallel engine's throwaway has as many ranks, each with
    1/N of the weights and of the prefill: that must fit on every device (the smallest free one decides)."""
    size = second_engine_bytes(model, rung, ranks)
    if size is None:
        return False, "auto: the model is not a local directory with weights, so their size is unknown"
    weights, need = size.weights // max(1, ranks), size.need
    half = min(s.free for s in snaps) // 2
    if half < need:
        return False, (f"auto: the card has {2 * half / GIB:.1f} GiB free beside the engine; a throwaway needs "
                       f"about {need / GIB:.1f} GiB in half of it (weights {weights / GIB:.1f} GiB, the rung's "
                       f"prefill, context and a minimal KV cache)")
    return True, (f"auto: half of the {2 * half / GIB:.1f} GiB free beside the engine holds a throwaway "
                  f"(about {need / GIB:.1f} GiB)")
