"""How much of a card a second engine beside the serving one needs (the precompile's throwaway, a
spare), and every rule of where one fits: beside the serving engine, before it on the free
card, or nowhere."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.bounds import GIB
from supervisor.decide import plan
from supervisor.decide.classify import fraction_that_fits
from supervisor.host import files
from supervisor.host.gpu import DeviceSnapshot
from supervisor.profile import Knob, Profile

SECOND_ENGINE_RESERVE = 3 * GIB  # its CUDA context, CUDA graphs and a minimal KV cache
KV_BLOCK_SLACK = GIB // 4  # KV blocks round up, and a layer's blocks are allocated whole
# torch.compile's inductor runs its own pool of compile workers: more throwaways than one per this
# many cores share compile time rather than save it (two at once still overlap their GPU work:
# weights, CUDA graphs, context).
CORES_PER_COMPILE = 4


def _shape(model: str) -> plan.ModelShape | None:
    try:
        return plan.ModelShape.from_config(
            json.loads((Path(model).expanduser() / "config.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def activation_of(model: str, rung: Profile) -> int:
    """The rung's prefill peak by the plan's estimate (config.json), or 2 GiB when the shape is
    unknown."""
    shape = _shape(model)
    if shape is None:
        return 2 * GIB
    return plan.activation_bytes(shape, rung.chunk(), plan.DTYPE_BYTES.get(shape.dtype, 2))


def one_sequence_kv(model: str, rung: Profile, ranks: int = 1) -> int | None:
    """Per rank, the KV cache of one sequence at the rung's max_model_len (the model's when
    unset): the least vLLM accepts at start. None when the shape is unknown (no config.json)."""
    shape = _shape(model)
    if shape is None:
        return None
    tokens = rung.max_model_len or shape.max_len
    return plan.kv_bytes_per_token(shape, plan.kv_dtype_bytes(shape.dtype)) * tokens // max(
        1, ranks) + KV_BLOCK_SLACK


@dataclass(frozen=True)
class SecondEngine:
    """What a second engine at a rung needs on each of its ranks' devices, before its KV cache."""

    weights: int  # the whole model's, on disk (a spare asleep keeps them in host memory)
    need: int  # per rank: 1/N of the weights and of the prefill peak, plus SECOND_ENGINE_RESERVE


def second_engine_bytes(model: str, rung: Profile, ranks: int = 1) -> SecondEngine | None:
    """The one estimate of a second engine's size (a precompile's throwaway and a spare alike);
    None when the model is not a local directory with weights (their size is unknown)."""
    weights = files.weights_on_disk(model)
    if weights is None:
        return None
    n = max(1, ranks)
    return SecondEngine(weights,
                        (weights + activation_of(model, rung)) // n + SECOND_ENGINE_RESERVE)


# a spare's sleeping footprint before one is measured (0.9-2.1 GiB on the H200)
ASLEEP_ESTIMATE = 5 * GIB // 2


def fits_beside(snaps: Sequence[DeviceSnapshot], util: float, headroom: int) -> float:
    """The utilization a second engine can start at beside what runs (vLLM's start check wants it
    free)."""
    s = min(snaps, key=lambda d: d.free / d.total)
    return min(util, fraction_that_fits(max(0, s.free - headroom), s.total))


def host_refusal(size: SecondEngine | None, ram_available: int) -> str | None:
    """Why "auto" keeps no spare whatever the card holds: its size is unknown, or the host's
    available memory cannot keep its weights asleep (plus 2 GiB)."""
    if size is None:
        return "auto: the model is not a local directory with weights, so their size is unknown"
    if ram_available < size.weights + 2 * GIB:
        return (
            f"auto: the host has {ram_available / GIB:.1f} GiB of memory available; a spare asleep "
            "keeps its "
            f"{size.weights / GIB:.1f} GiB of weights there")
    return None


def room_for_spare(snaps: Sequence[DeviceSnapshot], size: SecondEngine | None, rung: Profile,
                   headroom: int, floor: float, ram_available: int) -> tuple[float | None, str]:
    """On a GPU, "auto" keeps a spare when its weights fit in the host's available memory (where
    they sleep) and the card holds, beside the engine, a second engine at a utilization no
    lower than the ladder's floor: its weights, the rung's prefill peak, its CUDA graphs and a
    KV cache."""
    refused = host_refusal(size, ram_available)
    if refused or size is None:
        return None, refused or ""
    weights, need = size.weights, size.need
    util = fits_beside(snaps, rung.effective(Knob.GPU_MEMORY_UTILIZATION) or 0.9, headroom)
    total = min(s.total for s in snaps)
    if util < floor or util * total < need:
        return None, (
            f"auto: a spare beside the engine could start at gpu_memory_utilization {util:g} "
            f"({util * total / GIB:.1f} GiB); it needs at least {floor:g} and about "
            f"{need / GIB:.1f} GiB "
            f"before its KV cache")
    return util, (
        f"auto: the card holds a spare beside the engine at gpu_memory_utilization {util:g} "
        f"(about {need / GIB:.1f} GiB before its KV cache); its {weights / GIB:.1f} GiB of weights "
        f"sleep in the host's {ram_available / GIB:.1f} GiB available")


@dataclass(frozen=True)
class Order:
    """Where the next spare is built: ``beside`` the serving engine, ``first`` (before it, on the
    free card), or nowhere (None); the utilization it starts at, and why, for /status."""

    order: str | None
    spare_util: float | None
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {"order": self.order, "gpu_memory_utilization": self.spare_util, "why": self.why}


def choose_order(snaps: Sequence[DeviceSnapshot], engine_util: float, need: int, floor: float,
                 headroom: int, mode: str = "auto", asleep: int = ASLEEP_ESTIMATE) -> Order:
    """With the card as it is before the engine starts (``snaps``): beside, when what the engine
    at ``engine_util`` leaves holds a second engine of ``need`` bytes at the ladder's
    ``floor`` or more; else first, when the free card holds the spare at the engine's
    utilization and then the engine beside the spare asleep (``asleep``), so that the spare
    wakes into what the dead engine frees. ``mode`` "beside" or "first" forces one."""
    s = min(snaps, key=lambda d: d.free / d.total)
    left = max(0, s.free - int(engine_util * s.total) - headroom)
    beside = min(engine_util, fraction_that_fits(left, s.total))
    why_beside = (
        f"beside the engine at gpu_memory_utilization {engine_util:g} a spare could start at "
        f"{beside:g} "
        f"({beside * s.total / GIB:.1f} GiB); it needs at least {floor:g} and about "
        f"{need / GIB:.1f} GiB"
    )
    if mode != "first" and beside >= floor and beside * s.total >= need:
        return Order("beside", beside, f"{mode}: {why_beside}")
    first = min(engine_util, fraction_that_fits(max(0, s.free - asleep - headroom), s.total))
    why_first = (
        f"built first on the free card ({s.free / GIB:.1f} GiB) at {first:g}, the engine then "
        "beside its "
        f"sleeping footprint (about {asleep / GIB:.1f} GiB)")
    if mode != "beside" and first >= floor and first * s.total >= need:
        return Order("first", first, f"{mode}: {why_first}" +
                     ("" if mode == "first" else f"; not {why_beside}"))
    return Order(None, None, f"{mode}: neither order fits: {why_beside}; and the free card "
                             f"({s.free / GIB:.1f} GiB) holds a spare only at {first:g}")


@dataclass(frozen=True)
class CompileFirst:
    """Throwaways started before the engine, ``at_once`` at a time (0: none), each at ``util``
    with a KV cache of ``kv_bytes``: vLLM then skips its memory profiling, whose arithmetic
    assumes that no other process allocates or frees memory on the card meanwhile
    (vllm/v1/worker/gpu_worker.py: "Error in memory profiling"), which throwaways starting
    side by side do. Neither is part of the compile hash."""

    order: str | None  # "first", "beside", or None: neither fits
    at_once: int
    util: float
    kv_bytes: int
    why: str
    rungs: tuple[Profile, ...] = ()  # the rungs to compile first (Precompiler.first fills it in)


def plan_first(snaps: Sequence[DeviceSnapshot], need: int, kv: int, engine_util: float,
               headroom: int, mode: str, cpus: int) -> CompileFirst:
    """With the card as it is before the engine starts: none when a throwaway of ``need`` bytes
    fits in half of what the engine at ``engine_util`` leaves (it is compiled beside the
    engine, as room_for_throwaway allows); else as many at once as the free card holds (each
    ``need`` plus one sequence's KV cache ``kv``) and the host's cores compile side by side.
    ``mode`` "first" skips the beside check."""
    s = min(snaps, key=lambda d: d.free / d.total)
    left = max(0, s.free - int(engine_util * s.total) - headroom)
    if mode != "first" and left // 2 >= need:
        return CompileFirst(
            "beside", 0, 0.0, 0, f"{mode}: beside the engine: half of the {left / GIB:.1f} GiB it "
            f"leaves holds a throwaway (about {need / GIB:.1f} GiB)")
    each = need + kv
    fit, side_by_side = max(0, (s.free - headroom) // each), max(2, cpus // CORES_PER_COMPILE)
    at_once = min(fit, side_by_side)
    util = min(0.99, math.ceil(each / s.total * 100) / 100)
    why = (
        f"{mode}: before the engine, {at_once} at a time: the free card ({s.free / GIB:.1f} GiB) "
        "holds "
        f"{fit} throwaways of about {each / GIB:.1f} GiB and {cpus} cores compile {side_by_side}; "
        "beside the engine "
        f"at {engine_util:g} there would be {left / GIB:.1f} GiB" if at_once else
        f"{mode}: neither beside the engine ({left / GIB:.1f} GiB left at {engine_util:g}) nor "
        "before it (the free "
        f"card, {s.free / GIB:.1f} GiB, holds no throwaway of about {each / GIB:.1f} GiB)")
    return CompileFirst("first" if at_once else None, at_once, util, kv, why)


def room_for_throwaway(snaps: Sequence[DeviceSnapshot], size: SecondEngine | None,
                       ranks: int = 1) -> tuple[bool, str]:
    """On a GPU, "auto" compiles ahead only when half of what the serving engine left free holds
    a second copy of the weights, the rung's prefill peak and a little KV cache (the throwaway
    takes half: vLLM's start check wants utilization x total free). A tensor-parallel engine's
    throwaway has as many ranks, each with 1/N of the weights and of the prefill: that must
    fit on every device (the smallest free one decides)."""
    if size is None:
        return False, ("auto: the model is not a local directory with weights, so their size is "
                       "unknown")
    weights, need = size.weights // max(1, ranks), size.need
    half = min(s.free for s in snaps) // 2
    if half < need:
        return False, (
            f"auto: the card has {2 * half / GIB:.1f} GiB free beside the engine; a throwaway "
            "needs "
            f"about {need / GIB:.1f} GiB in half of it (weights {weights / GIB:.1f} GiB, the "
            "rung's "
            f"prefill, context and a minimal KV cache)")
    return True, (
        f"auto: half of the {2 * half / GIB:.1f} GiB free beside the engine holds a throwaway "
        f"(about {need / GIB:.1f} GiB)")
