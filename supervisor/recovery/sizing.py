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
KV_BLOCK_SLACK = GIB // 4  # KV blocks round up, and a layer's blocks are allocated whole
# torch.compile's inductor runs its own pool of compile workers: more throwaways than one per this many cores share
# compile time rather than save it (two at once still overlap their GPU work: weights, CUDA graphs, context).
CORES_PER_COMPILE = 4


def _shape(model: str) -> plan.ModelShape | None:
    try:
        return plan.ModelShape.from_config(json.loads((Path(model).expanduser() / "config.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def activation_of(model: str, rung: Profile) -> int:
    """The rung's prefill peak by the plan's estimate (config.json), or 2 GiB when the shape is unknown."""
    shape = _shape(model)
    if shape is None:
        return 2 * GIB
    return plan.activation_bytes(shape, rung.chunk(), plan.DTYPE_BYTES.get(shape.dtype, 2))


def one_sequence_kv(model: str, rung: Profile, ranks: int = 1) -> int | None:
    """Per rank, the KV cache of one sequence at the rung's max_model_len (the model's when unset): the least
    vLLM accepts at start. None when the shape is unknown (no config.json)."""
    shape = _shape(model)
    if shape is None:
        return None
    tokens = rung.max_model_len or shape.max_len
    return plan.kv_bytes_per_token(shape, plan.kv_dtype_bytes(shape.dtype)) * tokens // max(1, ranks) + KV_BLOCK_SLACK


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
