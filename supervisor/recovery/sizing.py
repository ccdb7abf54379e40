"""How much of a card a second engine beside the serving one needs (the precompile's throwaway, a spare)."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor.bounds import GIB
from supervisor.decide import plan
from supervisor.profile import Profile

SECOND_ENGINE_RESERVE = 3 * GIB  # its CUDA context, CUDA graphs and a minimal KV cache


def activation_of(model: str, rung: Profile) -> int:
    """The rung's prefill peak by the plan's estimate (config.json), or 2 GiB when the shape is unknown."""
    try:
        shape = plan.ModelShape.from_config(json.loads((Path(model).expanduser() / "config.json").read_text()))
    except (OSError, ValueError, TypeError):
        return 2 * GIB
    return plan.activation_bytes(shape, rung.chunk(), plan.DTYPE_BYTES.get(shape.dtype, 2))
