"""How much of a card a second engine beside the serving one needs (the precompile's throwaway, a spare)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from supervisor.bounds import GIB
from supervisor.decide import plan
from supervisor.host import files
from supervisor.profile import Profile

SECOND_ENGINE_RESERVE = 3 * GIB  # its CUDA context, CUDA graphs and a minimal KV cache


def activation_of(model: str, rung: Profile) -> int:
    """The rung's prefill peak by the plan's estimate (config.json), or 2 GiB when the shape is unknown."""
    try:
        shape = plan.ModelShape.from_config(json.loads((Path(model).expanduser() / "config.json").read_text()))
    except (OSError, ValueError, TypeError):
        return 2 * GIB
    return plan.activation_bytes(shape, rung.chunk(), plan.DTYPE_BYTES.get(shape.dtype, 2))


@dataclass(frozen=True)
class SecondEngine:
    """What a second engine at a rung needs on each of its ranks' devices, before its KV cache."""

    weights: int  # the whole model's, on disk (a spare asleep keeps them in host memory)
    need: int  # per rank: 1/N of the weights and of the prefill peak, plus SECOND_ENGINE_RESERVE


def second_engine_bytes(model: str, rung: Profile, ranks: int = 1) -> SecondEngine | None:
    """The one estimate of a second engine's size (a precompile's throwaway and a spare alike); None when the
    model is not a local directory with weights (their size is unknown)."""
    weights = files.weights_on_disk(model)
    if weights is None:
        return None
    n = max(1, ranks)
    return SecondEngine(weights, (weights + activation_of(model, rung)) // n + SECOND_ENGINE_RESERVE)
