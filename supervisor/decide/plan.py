"""`vllm-supervisor plan`: the seed's sizing formula, from a model's config.json and the card's
memory (pure).

KV bytes per token = 2 (K and V) x layers x KV heads x head size x bytes of the KV dtype, which is
how vLLM sizes its cache. What the card leaves for the KV cache = memory x gpu_memory_utilization -
weights
- the activation peak of one chunk (estimated). Then, as the seed did by hand:
max_num_seqs = KV tokens / max_model_len, and the chunk ladder is the default ladder below the chunk
whose activation peak still fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from supervisor.bounds import GIB
from supervisor.profile import DEFAULT_CHUNK

DTYPE_BYTES = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
    "fp8_e5m2": 1
}
LADDER = (DEFAULT_CHUNK, 6144, 4096, 2048, 1024, 512)
# What vLLM holds outside torch's allocator and its KV cache: the CUDA context's non-torch memory
# (NCCL, cuBLAS workspaces) and the CUDA graphs it captures, which the KV budget must leave alone.
RESERVE_BYTES = int(1.5 * GIB)


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_size: int
    hidden: int
    intermediate: int
    max_len: int
    dtype: str

    @classmethod
    def from_config(cls, cfg: dict[str, object]) -> ModelShape:
        text = cfg.get("text_config")
        if isinstance(text, dict):  # multimodal wrappers keep the language model's shape here
            cfg = {**cfg, **text}

        def num(*keys: str, default: int | None = None) -> int:
            for k in keys:
                v = cfg.get(k)
                if isinstance(v, int) and not isinstance(v, bool):
                    return v
            if default is None:
                raise ValueError(f"config.json has none of {', '.join(keys)}")
            return default

        heads = num("num_attention_heads", "n_head")
        hidden = num("hidden_size", "n_embd", "d_model")
        return cls(
            layers=num("num_hidden_layers", "n_layer", "num_layers"),
            kv_heads=num("num_key_value_heads", "multi_query_group_num", default=heads),
            # ChatGLM: kv_channels
            head_size=num("head_dim", "kv_channels", default=hidden // heads),
            hidden=hidden,
            intermediate=num("intermediate_size", "ffn_hidden_size", default=4 * hidden),
            max_len=num("max_position_embeddings", "seq_length", "n_positions", default=4096),
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"))


def kv_dtype_bytes(model_dtype: str, dtype: str = "auto", kv_cache_dtype: str = "auto") -> int:
    """Bytes per KV element as vLLM picks them: the KV dtype, else the model dtype (float32 loads
    as 16-bit)."""
    if kv_cache_dtype != "auto":
        return DTYPE_BYTES[kv_cache_dtype]
    chosen = model_dtype if dtype == "auto" else dtype
    return 2 if dtype == "auto" and chosen in ("float32", "float") else DTYPE_BYTES.get(chosen, 2)


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    return 2 * shape.layers * shape.kv_heads * shape.head_size * dtype_bytes


def activation_bytes(shape: ModelShape, chunk: int, dtype_bytes: int) -> int:
    """Peak of one prefill chunk, estimated: the MLP's gate/up outputs and a few hidden-sized
    buffers."""
    return chunk * (2 * shape.intermediate + 4 * shape.hidden) * dtype_bytes


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    dtype_bytes: int
    per_token: int
    kv_budget: int
    kv_tokens: int
    max_model_len: int
    max_num_seqs: int
    chunk: int
    ladder: tuple[int, ...]
    utilization: float
    notes: tuple[str, ...]

    def toml(self) -> str:
        s = self.shape
        lines = [
            f"# vllm-supervisor plan: {s.layers} layers x {s.kv_heads} KV heads x head size "
            f"{s.head_size}, "
            f"KV {self.dtype_bytes} bytes/element",
            f"# KV cache: {self.per_token} bytes per token; {self.kv_budget / GIB:.2f} GiB for it "
            f"-> {self.kv_tokens} tokens", *(f"# {n}" for n in self.notes), "[profile]",
            f"gpu_memory_utilization = {self.utilization:g}",
            f"max_model_len = {self.max_model_len}", f"max_num_seqs = {self.max_num_seqs}",
            f"max_num_batched_tokens = {self.chunk}", "", "[ladder]",
            f"max_num_batched_tokens = [{', '.join(str(r) for r in self.ladder)}]", ""
        ]
        return "\n".join(lines)


def make_plan(shape: ModelShape, *, card_bytes: int | None, weights_bytes: int,
              utilization: float = 0.9, kv_budget: int | None = None,
              max_model_len: int | None = None, dtype: str = "auto", kv_cache_dtype: str = "auto",
              tensor_parallel_size: int = 1) -> Plan:
    """Size the profile; ``kv_budget`` (bytes, per GPU) overrides what is derived from the card.

    With ``tensor_parallel_size`` N, each of the N cards holds 1/N of the weights and of the KV
    heads (vLLM replicates KV heads when there are fewer than N) and 1/N of the MLP's
    activations."""
    tp = max(1, tensor_parallel_size)
    if tp > 1:
        shape = replace(shape, kv_heads=max(1, shape.kv_heads // tp),
                        intermediate=shape.intermediate // tp)
        weights_bytes //= tp
    b = kv_dtype_bytes(shape.dtype, dtype, kv_cache_dtype)
    # activations are in the model's dtype, not the KV cache's
    act_b = kv_dtype_bytes(shape.dtype, dtype)
    per_token = kv_bytes_per_token(shape, b)
    notes: list[str] = [
        f"tensor_parallel_size {tp}: per GPU 1/{tp} of the weights, KV heads and MLP"
    ] if tp > 1 else []
    chunk = LADDER[0]
    if kv_budget is None:
        if card_bytes is None:
            raise ValueError("the card's memory is needed: --gpu-mem GIB, or a GPU NVML can see")
        usable = int(card_bytes * utilization) - weights_bytes - RESERVE_BYTES
        # The largest ladder chunk whose activation peak leaves at least half of the rest for the KV
        # cache.
        chunk = next((c for c in LADDER if activation_bytes(shape, c, act_b) <= usable // 2),
                     LADDER[-1])
        kv_budget = usable - activation_bytes(shape, chunk, act_b)
        notes.append(
            f"card {card_bytes / GIB:.1f} GiB x {utilization:g} - weights "
            f"{weights_bytes / GIB:.2f} GiB "
            f"- {RESERVE_BYTES / GIB:.1f} GiB for vLLM's non-torch memory and CUDA graphs - "
            "activation "
            f"peak of a {chunk}-token chunk {activation_bytes(shape, chunk, act_b) / GIB:.2f} GiB "
            "(estimated)")
    if kv_budget <= 0:
        raise ValueError(
            f"nothing is left for the KV cache ({kv_budget / GIB:.2f} GiB): a bigger card, a "
            "higher "
            "gpu_memory_utilization or a smaller model")
    tokens = kv_budget // per_token
    length = min(max_model_len or shape.max_len, tokens)
    if length < (max_model_len or shape.max_len):
        notes.append(
            f"max_model_len cut to {length}: one full-length sequence must fit in the KV cache")
    seqs = max(1, min(256, tokens // max(1, length)))
    ladder = tuple(r for r in LADDER if r <= chunk)
    return Plan(shape, b, per_token, kv_budget, tokens, length, seqs, chunk, ladder, utilization,
                tuple(notes))


@dataclass(frozen=True)
class Need:
    """What N sequences of L tokens need: the inverse of ``make_plan`` on the same formula."""

    sequences: int
    length: int
    per_token: int
    kv_bytes: int
    chunk: int
    # card memory x utilization that holds it: weights + reserve + activation peak + KV
    total_bytes: int
    utilization: float  # the ask
    card_bytes: int | None
    notes: tuple[str, ...]

    @property
    def utilization_needed(self) -> float | None:
        """The gpu_memory_utilization that holds it on this card (rounded up to 0.01), None
        without a card."""
        if self.card_bytes is None:
            return None
        return math.ceil(self.total_bytes / self.card_bytes * 100) / 100

    @property
    def card_bytes_needed(self) -> int:
        """The card that holds it at ``utilization``."""
        return math.ceil(self.total_bytes / self.utilization)

    def toml(self) -> str:
        need = self.utilization_needed
        lines = [
            f"# vllm-supervisor plan, reverse: {self.sequences} sequences of {self.length} tokens",
            f"# KV cache: {self.per_token} bytes per token x {self.sequences * self.length} tokens "
            "= "
            f"{self.kv_bytes / GIB:.2f} GiB", *(f"# {n}" for n in self.notes),
            f"# needs {self.total_bytes / GIB:.2f} GiB of the card: a "
            f"{self.card_bytes_needed / GIB:.1f} GiB card "
            f"at gpu_memory_utilization {self.utilization:g}"
        ]
        if self.card_bytes is not None and need is not None:
            verdict = (
                f"gpu_memory_utilization {need:g} on this {self.card_bytes / GIB:.1f} GiB card"
                if need <= 1 else
                f"more than this {self.card_bytes / GIB:.1f} GiB card holds ({need:g} of it)")
            lines.append(f"# needs {verdict}")
        if need is not None and need > 1:
            lines.append(
                "# not written as [profile]: it does not fit this card (fewer or shorter "
                "sequences, "
                "tensor_parallel_size, an fp8 KV cache, or a bigger card)")
            return "\n".join([*lines, ""])
        util = need if need is not None else self.utilization
        lines += [
            "[profile]", f"gpu_memory_utilization = {util:g}", f"max_model_len = {self.length}",
            f"max_num_seqs = {self.sequences}", f"max_num_batched_tokens = {self.chunk}", "",
            "[ladder]",
            f"max_num_batched_tokens = [{', '.join(str(r) for r in LADDER if r <= self.chunk)}]", ""
        ]
        return "\n".join(lines)


def need_for(shape: ModelShape, *, sequences: int, length: int, weights_bytes: int,
             card_bytes: int | None, utilization: float = 0.9, dtype: str = "auto",
             kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1) -> Need:
    """The memory ``sequences`` concurrent sequences of ``length`` tokens need (per GPU), by
    ``make_plan``'s formula read backwards; ``make_plan`` at the utilization found gives at
    least ``sequences``."""
    tp = max(1, tensor_parallel_size)
    if tp > 1:
        shape = replace(shape, kv_heads=max(1, shape.kv_heads // tp),
                        intermediate=shape.intermediate // tp)
        weights_bytes //= tp
    per_token = kv_bytes_per_token(shape, kv_dtype_bytes(shape.dtype, dtype, kv_cache_dtype))
    act_b = kv_dtype_bytes(shape.dtype, dtype)
    kv = sequences * length * per_token
    # make_plan's chunk rule (its activation peak at most half of what is left after the weights)
    # holds for the largest chunk whose peak is at most the KV cache itself.
    chunk = next((c for c in LADDER if activation_bytes(shape, c, act_b) <= kv), LADDER[-1])
    act = activation_bytes(shape, chunk, act_b)
    total = weights_bytes + RESERVE_BYTES + act + kv
    notes = [f"tensor_parallel_size {tp}: per GPU 1/{tp} of the weights, KV heads and MLP"
             ] if tp > 1 else []
    notes.append(
        f"weights {weights_bytes / GIB:.2f} GiB + {RESERVE_BYTES / GIB:.1f} GiB for vLLM's "
        "non-torch "
        f"memory and CUDA graphs + activation peak of a {chunk}-token chunk {act / GIB:.2f} GiB "
        "(estimated) + the KV cache")
    if length > shape.max_len:
        notes.append(
            f"{length} tokens is over the model's own length ({shape.max_len}): vLLM refuses it "
            "unless "
            "told otherwise")
    return Need(sequences, length, per_token, kv, chunk, total, utilization, card_bytes,
                tuple(notes))
