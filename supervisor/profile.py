"""The managed memory knobs of one engine start, and how they render as vLLM flags (pure).

A knob left out of ``[profile]`` is left to vLLM: no flag is passed, and vLLM's own default
applies. Only when the policy has to lower such a knob does it need a number to step down
from; it then assumes vLLM's usual default (``VLLM_DEFAULTS``) and the knob becomes explicit.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, replace
from typing import ClassVar


class Knob(enum.Enum):
    """The memory knobs the supervisor may lower, by vLLM's own (snake_case) names."""

    MAX_NUM_BATCHED_TOKENS = "max_num_batched_tokens"
    MAX_NUM_SEQS = "max_num_seqs"
    GPU_MEMORY_UTILIZATION = "gpu_memory_utilization"
    MAX_MODEL_LEN = "max_model_len"


# vLLM's defaults for its OpenAI server on a GPU (vllm/engine/arg_utils.py); used only to step down
# from, or to size warm-up prompts, when the operator left a knob to vLLM.
DEFAULT_CHUNK = 8192  # vLLM's max_num_batched_tokens on a GPU, and the top of the default ladder
VLLM_DEFAULTS: dict[Knob, float] = {
    Knob.MAX_NUM_BATCHED_TOKENS: DEFAULT_CHUNK,
    Knob.MAX_NUM_SEQS: 256,
    Knob.GPU_MEMORY_UTILIZATION: 0.9,
}

CHUNKED_PREFILL_ON = "--enable-chunked-prefill"  # vLLM V1's default, said when a step down sets it


@dataclass(frozen=True)
class Profile:
    """Values of the knobs the supervisor may lower; names are vLLM's own; None = vLLM decides."""

    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool | None = None

    MANAGED: ClassVar[tuple[str, ...]] = tuple(k.value for k in Knob)

    def value(self, knob: Knob) -> float | None:
        v: float | None = getattr(self, knob.value)
        return v

    def effective(self, knob: Knob) -> float | None:
        """The value vLLM runs with: the knob's own, else vLLM's usual default (None: the model's
        length)."""
        v = self.value(knob)
        return VLLM_DEFAULTS.get(knob) if v is None else v

    def reaches(self, other: Profile) -> bool:
        """Every managed knob runs at least ``other``'s: back at a configured profile, whatever
        the lowering made explicit on the way (``enable_chunked_prefill``, a knob vLLM
        defaulted). No max_model_len is the model's."""
        for knob in Knob:
            a, b = self.effective(knob), other.effective(knob)
            if not (a is None or (b is not None and a >= b)):
                return False
        return True

    def chunk(self) -> int:
        """The prefill chunk this profile runs with (the batch token budget)."""
        return int(self.effective(Knob.MAX_NUM_BATCHED_TOKENS) or DEFAULT_CHUNK)

    def problems(self) -> list[tuple[str, str]]:
        """(knob, message) for every value vLLM would refuse or that makes no sense."""
        out: list[tuple[str, str]] = []
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            v = getattr(self, name)
            if v is not None and v < 1:
                out.append((name, "must be >= 1 (leave it out to keep vLLM's default)"))
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            out.append(("gpu_memory_utilization", f"must be in (0, 1], got {u}"))
        chunk, length = self.max_num_batched_tokens, self.max_model_len
        if self.enable_chunked_prefill is False and length is not None and chunk is not None \
                and chunk < length:
            out.append(
                ("max_num_batched_tokens",
                 "must be >= max_model_len when enable_chunked_prefill is false (vLLM rejects it)"))
        return out

    def flags(self) -> list[str]:
        """Render as vLLM command-line flags; a knob left to vLLM renders nothing."""
        out: list[str] = []
        for name in self.MANAGED:
            v = getattr(self, name)
            if v is not None:
                out += ["--" + name.replace("_", "-"), _fmt(v)]
        if self.enable_chunked_prefill is not None:
            out.append(CHUNKED_PREFILL_ON if self.
                       enable_chunked_prefill else "--no-enable-chunked-prefill")
        return out

    def knobs(self) -> dict[str, int | float | None]:
        """The managed knobs only, by vLLM name (what /status reports; null = vLLM's default)."""
        return {k: getattr(self, k) for k in self.MANAGED}

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    # A rung has two identities, both here: ``key`` (every managed knob) names it where failures are
    # remembered (state.json); ``compile_key`` (every flag but gpu_memory_utilization) is its part
    # of vLLM's torch.compile hash, so rungs that differ only in utilization share compiled graphs.
    def key(self) -> str:
        """The rung's identity for remembering failures: every managed knob's value."""
        k = self.knobs()
        return ",".join(f"{name}={k[name]}" for name in self.MANAGED)

    def compile_key(self) -> str:
        """The rung's identity in vLLM's compile cache: every flag but gpu_memory_utilization,
        and chunked prefill on said or left to vLLM (its V1 default, and in no compile hash: a
        step down says it, the configured rung it climbs back to may not; the H200 compiled
        that rung twice when they differed)."""
        chunked = None if self.enable_chunked_prefill else self.enable_chunked_prefill
        return " ".join(
            self.with_(gpu_memory_utilization=None, enable_chunked_prefill=chunked).flags())

    def diff(self, other: Profile) -> dict[str, list[object]]:
        """Knobs that differ, as {knob: [self value, other value]}."""
        a, b = self.knobs(), other.knobs()
        return {k: [a[k], b[k]] for k in self.MANAGED if a[k] != b[k]}

    def with_(self, **changes: object) -> Profile:
        return replace(self, **changes)  # type: ignore[arg-type]

    def with_knob(self, knob: Knob, value: float | None) -> Profile:
        if value is not None and knob is not Knob.GPU_MEMORY_UTILIZATION:
            value = int(value)
        return self.with_(**{knob.value: value})

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Profile:
        """Rebuild from as_dict() output; raises ValueError/TypeError on anything else."""
        allowed = set(cls.MANAGED) | {"enable_chunked_prefill"}
        unknown = set(data) - allowed
        if unknown:
            raise ValueError(f"unknown profile keys {sorted(unknown)}")
        p = cls(**data)  # type: ignore[arg-type]
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            v = getattr(p, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise TypeError(f"{name} must be an integer or null")
        u = p.gpu_memory_utilization
        if u is not None and (not isinstance(u, (int, float)) or isinstance(u, bool)):
            raise TypeError("gpu_memory_utilization must be a number or null")
        if p.enable_chunked_prefill is not None and not isinstance(p.enable_chunked_prefill, bool):
            raise TypeError("enable_chunked_prefill must be a boolean or null")
        if p.problems():
            raise ValueError("; ".join(f"{k}: {m}" for k, m in p.problems()))
        return p


def _fmt(x: float) -> str:
    # 0.85 not 0.8500000000000001 after repeated 0.05 steps.
    return f"{round(x, 4):g}" if isinstance(x, float) else str(x)
