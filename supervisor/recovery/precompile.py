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
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from supervisor.bounds import GIB
from supervisor.config import Config
from supervisor.host import Host, compile_cache, files
from supervisor.host.gpu import DeviceSnapshot, GpuLost, free_fraction
from supervisor.profile import CHUNKED_PREFILL_ON, Knob, Profile
from supervisor.recovery.sizing import CORES_PER_COMPILE, one_sequence_kv, second_engine_bytes
from supervisor.recovery.standby import fingerprint

log = structlog.get_logger("supervisor.recovery.precompile")
RECORD = "compiled.json"
UNKNOWN = "?"  # the vLLM version, before any engine of this run said it


def _key_now(stored: str) -> str:
    """A compile key as recorded by an earlier supervisor, as ``Profile.compile_key`` writes it now (chunked prefill
    said explicitly is vLLM's default)."""
    return " ".join(t for t in stored.split(" ") if t != CHUNKED_PREFILL_ON)


class Precompiler:
    """The record of the rungs whose graphs are in vLLM's cache (``compiled.json``), and whether a throwaway may
    compile one now (``allowed``; ``why`` says why or why not, for /status)."""

    def __init__(self, cfg: Config, host: Host) -> None:
        self.cfg, self.host = cfg, host
        self.record = Path(cfg.state.dir) / RECORD
        self.cache_root = compile_cache.root(cfg.engine.environment())
        self.compiled: dict[str, list[str]] = self._load()
        self._unnoted: list[tuple[str, str]] = []  # (cache directory, key) compiled before the version was known
        self.why = "not asked yet: the engine has not been idle long enough"
        self.order: str | None = None  # where the rungs were last decided to be compiled: "first", "beside"

    def configure(self, cfg: Config) -> None:
        self.cfg = cfg

    # ---- the compile record ------------------------------------------------------------------------
    def _load(self) -> dict[str, list[str]]:
        """compiled.json, and the notes in vLLM's own compile cache (a new or lost state directory finds there what
        earlier supervisors compiled on this host: host/compile_cache.py)."""
        try:
            doc = files.read_json(self.record)
        except (OSError, ValueError):
            doc = {}
        merged: dict[str, list[str]] = {}
        for source in (doc if isinstance(doc, dict) else {}, compile_cache.read(self.cache_root)):
            for k, v in source.items():
                # A record under no version is from a run that never learnt it (no READY): its vLLM may be another.
                if isinstance(v, list) and not str(k).startswith(f"{UNKNOWN}:"):
                    keys = merged.setdefault(str(k), [])
                    keys += [x for x in dict.fromkeys(_key_now(str(x)) for x in v) if x not in keys]
        return merged

    def _engine_id(self, version: str | None) -> str:
        return f"{version or UNKNOWN}:{fingerprint(self.cfg.engine)}:{json.dumps(self.cfg.engine.args, sort_keys=True)}"

    def known_version(self) -> str | None:
        """The vLLM an engine of this command and arguments last reported on this host: before a run's first READY,
        what its compiles are taken to be for (after an upgrade the first start compiles nothing first; the next
        planned one does)."""
        tail = self._engine_id(None).removeprefix(f"{UNKNOWN}:")
        mine = [k.removesuffix(f":{tail}") for k in self.compiled if k.endswith(f":{tail}")]
        return next((v for v in reversed(mine) if v != UNKNOWN), None)

    def is_compiled(self, profile: Profile, version: str | None) -> bool:
        return profile.compile_key() in self.compiled.get(self._engine_id(version), [])

    def note_compiled(self, profile: Profile, version: str | None, cache_dir: str | None = None) -> None:
        """A start reached READY at ``profile`` (or a second engine answered /health): its graphs are in vLLM's
        cache now, in ``cache_dir`` when it said which (noted there too, once its vLLM is known)."""
        keys = self.compiled.setdefault(self._engine_id(version), [])
        if profile.compile_key() not in keys:
            keys.append(profile.compile_key())
            self._save()
        if cache_dir is not None and version is None:
            self._unnoted.append((cache_dir, profile.compile_key()))
        elif cache_dir is not None:
            compile_cache.note(cache_dir, self.cache_root, self._engine_id(version), profile.compile_key())

    def learnt_version(self, version: str | None) -> None:
        """An engine said which vLLM this is: what second engines compiled before it (a start's compile-first,
        a spare built first) was the same install's."""
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

    def _save(self) -> None:
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

    async def first(self, todo: Sequence[Profile], engine: Profile,
                    soon: Sequence[Profile] = ()) -> CompileFirst | None:
        """Before a planned start at ``engine`` on the card its gates found free: how the rungs in ``todo`` are
        compiled first, when a throwaway would not fit beside the engine (``precompile_order``); None otherwise,
        ``self.why`` says why. Where they would fit beside, ``"auto"`` still compiles the ones of ``todo`` in
        ``soon`` first (the start's own rung and the next memory failure's): beside the engine they would wait
        for ``precompile_idle_s`` after READY, and a failure in those minutes would compile on its critical path
        (70 s on the H200), while the engine compiles its own rung in its start anyway."""
        rc, e = self.cfg.recovery, self.cfg.engine
        if rc.precompile == "off" or rc.precompile_order == "beside" or not todo:
            return None
        try:
            snaps = await self.host.gpu_snapshot(e.devices())
        except GpuLost:
            return None
        if not snaps:
            return None  # without a GPU a throwaway always fits beside the engine
        sizes = [second_engine_bytes(e.model, r, e.ranks()) for r in todo]
        kv = one_sequence_kv(e.model, todo[0], e.ranks())
        if kv is None or any(size is None for size in sizes):
            self.why = "first: the model is not a local directory with weights and a config.json: its size is unknown"
            return None
        need = max(size.need for size in sizes if size is not None)
        util = engine.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.9
        args = (snaps, need, kv, util, self.cfg.gpu.start_headroom_bytes)
        cpus = os.cpu_count() or 1
        plan = replace(plan_first(*args, rc.precompile_order, cpus), rungs=tuple(todo))
        keys = {p.compile_key() for p in soon}
        urgent = tuple(r for r in todo if r.compile_key() in keys)
        if plan.order == "beside" and urgent:
            first = plan_first(*args, "first", cpus)
            if first.at_once:
                plan = replace(first, rungs=urgent, why=(
                    f"auto: the start's own rung and the next memory failure's before the engine (a failure in the "
                    f"minutes after READY would compile on its critical path): {first.why}; the rest beside it: "
                    f"{plan.why}"))
        self.why, self.order = plan.why, plan.order
        return plan if plan.at_once else None

    def status(self, running: bool) -> dict[str, Any]:
        return {"running": running, "order": self.order, "why": self.why}


@dataclass(frozen=True)
class CompileFirst:
    """Throwaways started before the engine, ``at_once`` at a time (0: none), each at ``util`` with a KV cache of
    ``kv_bytes``: vLLM then skips its memory profiling, whose arithmetic assumes that no other process allocates
    or frees memory on the card meanwhile (vllm/v1/worker/gpu_worker.py: "Error in memory profiling"), which
    throwaways starting side by side do. Neither is part of the compile hash."""

    order: str | None  # "first", "beside", or None: neither fits
    at_once: int
    util: float
    kv_bytes: int
    why: str
    rungs: tuple[Profile, ...] = ()  # the rungs to compile first (Precompiler.first fills it in)


def plan_first(snaps: Sequence[DeviceSnapshot], need: int, kv: int, engine_util: float, headroom: int,
               mode: str, cpus: int) -> CompileFirst:
    """With the card as it is before the engine starts: none when a throwaway of ``need`` bytes fits in half of
    what the engine at ``engine_util`` leaves (it is compiled beside the engine, as room_for_throwaway allows);
    else as many at once as the free card holds (each ``need`` plus one sequence's KV cache ``kv``) and the
    host's cores compile side by side. ``mode`` "first" skips the beside check."""
    s = min(snaps, key=lambda d: d.free / d.total)
    left = max(0, s.free - int(engine_util * s.total) - headroom)
    if mode != "first" and left // 2 >= need:
        return CompileFirst("beside", 0, 0.0, 0, f"{mode}: beside the engine: half of the {left / GIB:.1f} GiB it "
                                                 f"leaves holds a throwaway (about {need / GIB:.1f} GiB)")
    each = need + kv
    fit, side_by_side = max(0, (s.free - headroom) // each), max(2, cpus // CORES_PER_COMPILE)
    at_once = min(fit, side_by_side)
    util = min(0.99, math.ceil(each / s.total * 100) / 100)
    why = (f"{mode}: before the engine, {at_once} at a time: the free card ({s.free / GIB:.1f} GiB) holds "
           f"{fit} throwaways of about {each / GIB:.1f} GiB and {cpus} cores compile {side_by_side}; beside the engine "
           f"at {engine_util:g} there would be {left / GIB:.1f} GiB" if at_once else
           f"{mode}: neither beside the engine ({left / GIB:.1f} GiB left at {engine_util:g}) nor before it (the free "
           f"card, {s.free / GIB:.1f} GiB, holds no throwaway of about {each / GIB:.1f} GiB)")
    return CompileFirst("first" if at_once else None, at_once, util, kv, why)


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
