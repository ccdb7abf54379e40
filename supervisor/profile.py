"""The managed memory knobs of one engine start, and how they render as vLLM flags (pure)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import ClassVar


@dataclass(frozen=True)
class Profile:
    """Values of the knobs the supervisor may lower; names are vLLM's own (snake_case)."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True

    MANAGED: ClassVar[tuple[str, ...]] = (
        "max_num_batched_tokens",
        "max_num_seqs",
        "gpu_memory_utilization",
        "max_model_len",
    )

    def problems(self) -> list[tuple[str, str]]:
        """(knob, message) for every value vLLM would refuse or that makes no sense."""
        out: list[tuple[str, str]] = []
        if self.max_num_batched_tokens < 1:
            out.append(("max_num_batched_tokens", "must be >= 1"))
        if self.max_num_seqs < 1:
            out.append(("max_num_seqs", "must be >= 1"))
        if not 0 < self.gpu_memory_utilization <= 1:
            out.append(("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}"))
        if self.max_model_len is not None and self.max_model_len < 1:
            out.append(("max_model_len", "must be >= 1 (leave it out to let vLLM use the model's length)"))
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_num_batched_tokens < self.max_model_len:
            out.append(("max_num_batched_tokens",
                        "must be >= max_model_len when enable_chunked_prefill is false (vLLM rejects it)"))
        return out

    def flags(self) -> list[str]:
        """Render as vLLM command-line flags."""
        out = [
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--max-num-seqs", str(self.max_num_seqs),
            "--gpu-memory-utilization", _fmt_fraction(self.gpu_memory_utilization),
        ]
        if self.max_model_len is not None:
            out += ["--max-model-len", str(self.max_model_len)]
        if self.enable_chunked_prefill:
            out.append("--enable-chunked-prefill")
        return out

    def knobs(self) -> dict[str, int | float | None]:
        """The managed knobs only, by vLLM name (what /status reports)."""
        return {k: getattr(self, k) for k in self.MANAGED}

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def key(self) -> str:
        """A stable identity of the knob values, used to remember which rungs failed."""
        k = self.knobs()
        return ",".join(f"{name}={k[name]}" for name in self.MANAGED)

    def diff(self, other: Profile) -> dict[str, list[object]]:
        """Knobs that differ, as {knob: [self value, other value]}."""
        a, b = self.knobs(), other.knobs()
        return {k: [a[k], b[k]] for k in self.MANAGED if a[k] != b[k]}

    def with_(self, **changes: object) -> Profile:
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Profile:
        """Rebuild from as_dict() output; raises ValueError/TypeError on anything else."""
        allowed = {"max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization",
                   "max_model_len", "enable_chunked_prefill"}
        unknown = set(data) - allowed
        if unknown:
            raise ValueError(f"unknown profile keys {sorted(unknown)}")
        p = cls(**data)  # type: ignore[arg-type]
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if not isinstance(getattr(p, name), int) or isinstance(getattr(p, name), bool):
                raise TypeError(f"{name} must be an integer")
        if not isinstance(p.gpu_memory_utilization, (int, float)):
            raise TypeError("gpu_memory_utilization must be a number")
        if p.max_model_len is not None and not isinstance(p.max_model_len, int):
            raise TypeError("max_model_len must be an integer or null")
        if p.problems():
            raise ValueError("; ".join(f"{k}: {m}" for k, m in p.problems()))
        return p


def _fmt_fraction(x: float) -> str:
    # 0.85 not 0.8500000000000001 after repeated 0.05 steps.
    return f"{round(x, 4):g}"
