"""What the gateway admits (pure): request parsing, the 413 limits, the 429 pressure rules,
quarantine.

Everything here treats the client's bytes as hostile: a body is parsed once, every field the
gateway relies on is type-checked with an error naming it, and nothing a client sends ever
reaches a log line (a request is known by its id, its size and its content hash).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from supervisor.bounds import GIB, MIB
from supervisor.decide import prompts

# re-exported
from supervisor.decide.prompts import CHAT_TOKENS_FIXED, CHAT_TOKENS_PER_MESSAGE  # noqa: F401

# vLLM computes prompt logprobs from float32 logits over the whole vocabulary, one prefill chunk at
# a time, and keeps the logprobs beside them: about 8 bytes per (token, vocabulary entry).
PROMPT_LOGPROBS_BYTES = 8
# The quarantine's key (docs/interface.md): the request as vLLM runs it, never the prompt alone.
# vLLM ignores fields it does not know (a junk field makes no other request of it), so only the
# fields its request models read count:
# - ENGINE_FIELDS select what the engine computes (stop strings, logits processors, structured
#   output, n, ...): as sent, in the key and in its shape. A prompt that killed the engine with one
#   of them is another request than the same prompt without it (a shared system prompt must not be
#   refused for everyone because one client sent it with a stop string that kills);
# - VALUE_FIELDS change numbers, not the code that runs: as sent in the key (the request as vLLM ran
#   it), and in the shape only as which sampling paths are on (SAMPLING_SWITCHES), so a variant of a
#   quarantined prompt with temperature 0.7 -> 0.71 is still that prompt's variant;
# - the rest (stream, user, request ids, priority, ...) changes neither: a retry that streams is the
#   same request.
ENGINE_FIELDS = ("n", "best_of", "use_beam_search", "echo", "logprobs", "top_logprobs",
                 "prompt_logprobs", "logprob_token_ids", "logit_bias", "allowed_token_ids",
                 "bad_words", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
                 "skip_special_tokens", "spaces_between_special_tokens", "guided_json",
                 "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                 "guided_whitespace_pattern", "structured_outputs", "response_format", "text",
                 "tools", "tool_choice", "parallel_tool_calls", "max_tool_calls", "chat_template",
                 "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                 "add_special_tokens", "truncate_prompt_tokens", "truncation_side", "truncation",
                 "suffix", "logits_processors", "vllm_xargs", "kv_transfer_params",
                 "ec_transfer_params", "prompt_embeds", "mm_payload", "mm_processor_kwargs",
                 "media_io_kwargs", "return_tokens_as_token_ids", "return_token_ids",
                 "return_token_offsets", "return_prompt_text", "return_mm_kwargs",
                 "encoding_format", "embed_dtype", "endianness", "dimensions", "padding",
                 "use_activation", "task", "embedding_types", "input_type", "output_dimension",
                 "truncate", "instruction", "reasoning", "reasoning_effort", "include_reasoning",
                 "thinking_token_budget", "repetition_detection", "watermarking", "cache_salt",
                 "previous_response_id", "include", "enable_response_messages",
                 "routed_experts_prompt_start")
# Sampling field -> (vLLM's default, the value that switches its path off).
SAMPLING_SWITCHES = {
    "temperature": (1.0, 0), "top_p": (1.0, 1), "top_k": (-1, -1), "min_p": (0.0, 0),
    "presence_penalty": (0.0, 0), "frequency_penalty": (0.0, 0), "repetition_penalty": (1.0, 1)
}
VALUE_FIELDS = (*SAMPLING_SWITCHES, "seed", "max_tokens", "max_completion_tokens",
                "max_output_tokens", "min_tokens", "length_penalty", "max_tokens_per_doc",
                "max_tokens_per_query", "top_n")
# Where a route's prompt is (prompts.py reads them): the key holds them whitespace-normalised, the
# sketch their words.
PROMPT_FIELDS = ("prompt", "messages", "input", "instructions", "system", "query", "documents",
                 "queries", "items", "text_1", "text_2", "data_1", "data_2", "texts", "inputs",
                 "token_ids")
# v2 keys (the prompt and a shorter field list) match no v3 request: they expire unused
KEY_VERSION = "v3"
SKETCH_SIZE = 128  # bottom-k hashes of the prompt's 3-word shingles
# shorter prompts are matched exactly only: a few words are a large share of them
SKETCH_MIN_WORDS = 32
# The sketch reads the prompt's first and last this many words (about 0.7 us a word): a few words
# removed or changed anywhere leave most of both the same, and a 16 MiB prompt costs no more than a
# 64 KiB one.
SKETCH_WINDOW = 4096
NEAR = 0.9  # estimated Jaccard similarity at which a prompt is a variant of a quarantined one


@dataclass(frozen=True)
class Rejection:
    """An answer the gateway gives itself, in OpenAI's error shape."""

    status: int
    code: str
    message: str
    type: str = "invalid_request_error"
    retry_after_s: float | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


def bad_request(message: str, code: str = "invalid_request") -> Rejection:
    return Rejection(400, code, message)


@dataclass(frozen=True)
class Parsed:
    """What the gateway needs to know about one request to a route that runs the model."""

    route: str  # the kind of route (routes.COUNTED), or the path of one whose body is not read here
    stream: bool
    text_bytes: int  # UTF-8 bytes of all its prompts' text
    messages: int  # chat messages (0 for a plain prompt)
    token_ids: int  # prompt tokens given as ids, in all its prompts
    prompt_logprobs: int | None
    digest: str  # the quarantine's key: what vLLM will run; identical retries share it
    # What /tokenize needs to count its longest prompt exactly, as JSON bytes: encoded here, where
    # the parse runs (the parser pool for a big body), never on the event loop (100 held 16 MiB
    # prompts encoded there stalled it 15 s). Nothing to ask when ``countable`` is false (token ids
    # alone are counted exactly; some prompts cannot be).
    tokenize_body: bytes = b""
    # the key without the prompt: variants of a quarantined prompt are looked for among these
    shape: str = ""
    # the prompt vLLM judges against max_model_len (None: none was read)
    longest: prompts.Prompt | None = None
    prompt_key: str = ""  # the key of its prompt alone (EngineKey.prompt)

    @property
    def upper_bound(self) -> int:
        """No tokenizer makes more tokens than bytes (plus a few specials; chat templates add
        their markers): the longest prompt's bound, 0 when no prompt was read."""
        return self.longest.upper_bound if self.longest is not None else 0

    @property
    def countable(self) -> bool:
        """/tokenize can count its longest prompt."""
        return self.longest is not None and bool(self.longest.tokenize)

    @property
    def exact(self) -> int | None:
        """The longest prompt's tokens when they are known without the engine (token ids alone)."""
        return self.longest.token_ids if self.longest is not None and self.longest.exact else None


# a wrong field is a 400 here; the others are vLLM's to judge
STRICT = ("completions", "chat", "embeddings")


def parse(route: str, raw: bytes) -> Parsed | Rejection:
    """Parse, type-check and hash a body for a route of ``route``'s kind; a Rejection (400) names
    the field that is wrong (strictly read kinds only: on the others a body this cannot read
    is hashed as it is, and vLLM answers a malformed one itself)."""
    got = _parse(route, raw)
    if isinstance(got, Rejection) and route not in STRICT:
        return parse_opaque(route, raw)
    return got


def _parse(route: str, raw: bytes) -> Parsed | Rejection:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        return bad_request(
            f"the request body is not valid JSON ({type(exc).__name__} at {_where(exc)}); "
            "send a JSON object", "invalid_json")
    except RecursionError:
        return bad_request(
            "the request body is nested too deeply to parse; send a flatter JSON object",
            "invalid_json")
    if not isinstance(body, dict):
        return bad_request(f"the request body must be a JSON object, got {type(body).__name__}",
                           "invalid_json")
    refused = _typed(body) if route in STRICT else None
    if refused is not None:
        return refused
    try:
        found = prompts.of(route, body)
        key = engine_key(route, body)
        longest = max(found, key=lambda p: p.upper_bound) if found else None
        tokenize = {"model": body["model"]
                    } if isinstance(body.get("model"), str) and body["model"] else {}
        encoded = json.dumps({**tokenize, **(longest.tokenize if longest else {})},
                             ensure_ascii=False).encode()
    except prompts.BadPrompt as exc:
        return bad_request(str(exc), exc.code)
    except (RecursionError, ValueError):
        return bad_request(
            "the request body is nested too deeply to hash; send a flatter JSON object",
            "invalid_json")
    prompt_logprobs = body.get("prompt_logprobs")
    return Parsed(
        route,
        body.get("stream") is True, sum(p.text_bytes for p in found),
        sum(p.messages for p in found), sum(p.token_ids for p in found), prompt_logprobs
        if isinstance(prompt_logprobs, int) and not isinstance(prompt_logprobs, bool) else None,
        key.digest, encoded, key.shape, longest, key.prompt)


def _typed(body: dict[str, Any]) -> Rejection | None:
    """The fields every strictly read route relies on, type-checked (a 400 names the field)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        return bad_request(f"'stream' must be true or false, got {type(stream).__name__}",
                           "invalid_type")
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None and (isinstance(prompt_logprobs, bool)
                                        or not isinstance(prompt_logprobs, int)):
        return bad_request(
            f"'prompt_logprobs' must be an integer or null, got {type(prompt_logprobs).__name__}",
            "invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return bad_request(f"'model' must be a string, got {type(model).__name__}", "invalid_type")
    return None


def parse_opaque(route: str, raw: bytes) -> Parsed:
    """A model route whose prompt this gateway does not read (audio, or a body that is not a JSON
    object): held, shed and quarantined like the others, by the key of what the engine gets;
    its length is the engine's to judge. Never refused here: vLLM answers a malformed body
    itself."""
    try:
        body = json.loads(raw)
        stream = isinstance(body, dict) and body.get("stream") is True
        key = engine_key(route, body)
    except (UnicodeDecodeError, ValueError, RecursionError):  # multipart audio, or not JSON at all
        digest = hashlib.sha256(route.encode() + b"\0" + raw).hexdigest()[:32]
        return Parsed(route, False, 0, 0, 0, None, digest, b"", digest)
    return Parsed(route, stream, 0, 0, 0, None, key.digest, b"", key.shape, prompt_key=key.prompt)


@dataclass(frozen=True)
class EngineKey:
    """The quarantine's key of a body (``digest``), the same without its prompt (``shape``), and
    its prompt alone (``prompt``: what a request that reuses a quarantined prompt with other
    fields shares with it)."""

    digest: str
    shape: str
    prompt: str = ""


def engine_key(route: str, body: Any) -> EngineKey:
    """What vLLM will run for ``body`` on ``route`` (ENGINE_FIELDS, VALUE_FIELDS, the prompt).
    Raises RecursionError or ValueError on a body too deep to serialise."""
    if not isinstance(body, dict):
        digest = _hash([KEY_VERSION, route, body])
        return EngineKey(digest, digest)
    features = {k: _as_run(k, body[k]) for k in ENGINE_FIELDS if body.get(k) is not None}
    switches = {k: (body[k] if _number(body.get(k)) else default) != off
                for k, (default, off) in SAMPLING_SWITCHES.items()}
    shape = _hash([KEY_VERSION, route, body.get("model"), features, switches])
    values = {k: _as_run(k, body[k]) for k in VALUE_FIELDS if body.get(k) is not None}
    for k, (default, _) in SAMPLING_SWITCHES.items():  # a default sent is the default left out
        values[k] = values[k] if _number(values.get(k)) else float(default)
    prompt, _ = _prompt_of(body)
    return EngineKey(_hash([shape, values, prompt]), shape,
                     _hash([KEY_VERSION, route, body.get("model"), prompt]))


def _as_run(field_name: str, value: Any) -> Any:
    """A field as vLLM reads it: one stop string is a list of one; a number is the same whether 1
    or 1.0."""
    if field_name == "stop" and isinstance(value, str):
        return [value]
    if _number(value):
        return float(value)
    return value


def _hash(material: Any) -> str:
    text = json.dumps(material, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# labels in a prompt
NOT_TEXT = frozenset({"role", "type", "name", "id", "tool_call_id", "format", "detail"})


def _prompt_of(body: dict[str, Any]) -> tuple[Any, list[str]]:
    """The prompt as the engine gets it (every PROMPT_FIELDS field, its text
    whitespace-normalised), and its words (or, for token ids alone, the ids) for the sketch."""
    words: list[str] = []
    ids: list[str] = []

    def norm(value: Any, key: str = "") -> Any:
        if isinstance(value, str):
            split = value.split()
            if key not in NOT_TEXT:
                words.extend(split)
            return " ".join(split)
        if isinstance(value, list):
            return [norm(v, key) for v in value]
        if isinstance(value, dict):
            return {k: norm(v, k) for k, v in value.items()}
        if isinstance(value, int) and not isinstance(value, bool):
            ids.append(str(value))
        return value

    prompt = {k: norm(body[k]) for k in PROMPT_FIELDS if k in body}
    return prompt, words or ids


def body_sketch(raw: bytes) -> tuple[int, ...]:
    """The sketch of a body's prompt (its words, or token ids), () when it has none to sketch.
    Asked only when a quarantined request has the body's shape: most bodies never pay for it
    (the gateway's parser pool runs it for a big one)."""
    try:
        body = json.loads(raw)
        return sketch(_prompt_of(body)[1]) if isinstance(body, dict) else ()
    except (UnicodeDecodeError, ValueError, RecursionError):
        return ()


def sketch(words: Sequence[str]) -> tuple[int, ...]:
    """The SKETCH_SIZE smallest hashes of the 3-word shingles of ``words`` (its first and last
    SKETCH_WINDOW): two prompts' sketches estimate how much of them is the same (a variant
    with a few words removed shares nearly all its shingles)."""
    if len(words) < SKETCH_MIN_WORDS:
        return ()
    if len(words) > 2 * SKETCH_WINDOW:
        words = [*words[:SKETCH_WINDOW], *words[-SKETCH_WINDOW:]]
    # Each shingle is counted with its occurrence (the 2nd "word word word" is another element than
    # the 1st): a multiset, so that 2,000 repetitions of a word are not a variant of 30,000 of them.
    seen: dict[tuple[str, str, str], int] = {}
    hashes = set()
    for shingle in zip(words, words[1:], words[2:], strict=False):
        n = seen[shingle] = seen.get(shingle, 0) + 1
        hashes.add(zlib.crc32(f"{shingle[0]}\0{shingle[1]}\0{shingle[2]}\0{n}".encode()))
    return tuple(sorted(hashes)[:SKETCH_SIZE])


def similarity(a: Sequence[int], b: Sequence[int]) -> float:
    """The Jaccard similarity of two prompts' shingles, estimated from their sketches (bottom-k)."""
    if not a or not b:
        return 0.0
    sa, sb = set(a), set(b)
    union = sorted(sa | sb)[:SKETCH_SIZE]
    return sum(1 for h in union if h in sa and h in sb) / len(union)


def _where(exc: Exception) -> str:
    pos = getattr(exc, "pos", None)
    return f"byte {pos}" if pos is not None else "the start"


# ---- 413: the prompt against the limits of the current profile -----------------------------------
def too_long(tokens: int, limit: int, why: str) -> Rejection | None:
    """``tokens`` over ``limit`` → 413 naming both (``why`` says where the limit comes from)."""
    if tokens <= limit:
        return None
    return Rejection(
        413, "prompt_too_long",
        f"the prompt has {tokens} tokens; this server accepts at most {limit} ({why}). "
        "Shorten the prompt or split it into several requests.")


def prompt_limit(max_model_len: int | None, safe_len: int | None) -> tuple[int | None, str]:
    """The lesser of the engine's context length and the length learned from crash evidence; and
    where it comes from (shown in /status)."""
    if safe_len is not None and (max_model_len is None or safe_len < max_model_len):
        return safe_len, "quarantine: a longer prompt crashed the engine recently"
    return max_model_len, "the engine's max_model_len"


def logprobs_too_big(parsed: Parsed, tokens: int, chunk: int, vocab: int,
                     max_gib: float) -> Rejection | None:
    """``prompt_logprobs`` on a long prompt needs chunk x vocabulary logits at once: refuse what
    cannot fit."""
    if parsed.prompt_logprobs is None or not max_gib:
        return None
    need = min(tokens, chunk) * vocab * PROMPT_LOGPROBS_BYTES
    if need <= max_gib * GIB:
        return None
    fits = int(max_gib * GIB // (vocab * PROMPT_LOGPROBS_BYTES))
    return Rejection(
        413, "prompt_logprobs_too_large",
        f"prompt_logprobs on a {tokens}-token prompt needs about {need / GIB:.1f} GiB of logits "
        f"({min(tokens, chunk)} tokens x {vocab} vocabulary entries), more than the "
        f"{max_gib:g} GiB this server allows: it is a known out-of-memory trigger. Send at most "
        f"{fits} prompt tokens with prompt_logprobs, or leave prompt_logprobs out.")


# ---- 429: real memory pressure -------------------------------------------------------------------
@dataclass(frozen=True)
class PressureRules:
    min_free_bytes: int
    foreign_growth_bytes: int
    kv_cache_high: float
    kv_waiting: int


@dataclass(frozen=True)
class Pressure:
    """Why the engine is short of memory, and whom that concerns."""

    reason: str
    # the KV cache is full: every new request waits; else only prompts that need new memory
    everyone: bool


def pressure(rules: PressureRules, *, free: Sequence[int], foreign: Sequence[int],
             foreign_before: Sequence[int], kv_usage: float, waiting: float) -> Pressure | None:
    """Why the engine is under memory pressure now, or None.

    vLLM preallocates its share of the card, so a high "used" is normal; what matters is what is
    still free for the activations, another process growing into it, and the KV cache with a queue.
    """
    if rules.kv_cache_high and kv_usage >= rules.kv_cache_high and waiting >= rules.kv_waiting:
        return Pressure(f"KV cache {kv_usage:.0%} full with {waiting:.0f} requests waiting", True)
    for i, f in enumerate(free):
        if rules.min_free_bytes and f < rules.min_free_bytes:
            return Pressure(
                f"GPU {i}: {f / MIB:.0f} MiB free, under the {rules.min_free_bytes / MIB:.0f} MiB "
                "floor", False)
    for i, (now, before) in enumerate(zip(foreign, foreign_before, strict=False)):
        if rules.foreign_growth_bytes and now - before >= rules.foreign_growth_bytes:
            return Pressure(f"GPU {i}: another process grew by {(now - before) / MIB:.0f} MiB",
                            False)
    return None


def shed(p: Pressure | None, tokens: int | None, proven: int,
         retry_after_s: float) -> Rejection | None:
    """429 under pressure: for everyone when the KV cache is full; else only for a prompt longer
    than the engine has already run since its start (``proven``: its allocator holds that
    much; a longer prefill needs memory the card no longer has). ``tokens`` None: not known to
    be short."""
    if p is None:
        return None
    if not p.everyone and tokens is not None and tokens <= proven:
        return None
    who = "" if p.everyone else f" prompts over {proven} tokens are refused until it eases;"
    return Rejection(
        429, "engine_overloaded", f"the engine is under memory pressure ({p.reason});{who} retry "
        f"after {retry_after_s:g}s", "rate_limit_error", retry_after_s)


# ---- quarantine ----------------------------------------------------------------------------------
@dataclass
class Quarantine:
    """Content hashes of requests that killed the engine again, each until it expires."""

    # key -> {until, tokens, reason, and (newer entries) kind, shape, sketch}
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, digest: str, until: float, tokens: int | None, reason: str, kind: str = "",
            shape: str = "", sketch: Sequence[int] = (), prompt: str = "") -> None:
        self.entries[digest] = {
            "until": until, "tokens": tokens, "reason": reason, "kind": kind, "shape": shape,
            "sketch": list(sketch), "prompt": prompt
        }

    def kinship(self, prompt: str, shape: str, now: float) -> int:
        """How close a request not refused comes to a live entry: 2 its prompt and its fields
        (only sampling values differ), 1 its prompt with other fields, 0 neither. A kin is the
        first suspect of a death it is at (gate.py), never refused for it."""
        kin = [2 if e.get("shape") == shape else 1 for e in self.entries.values()
               if prompt and e["until"] > now and e.get("prompt") == prompt]
        return max(kin, default=0)

    def has_shape(self, shape: str, now: float) -> bool:
        """A live entry has this shape: a body of it may be a variant (its sketch is worth
        computing)."""
        return bool(shape) and any(e["until"] > now and e.get("shape") == shape and e.get("sketch")
                                   for e in self.entries.values())

    def holds(self, digest: str, now: float, shape: str = "",
              sketch: Sequence[int] = ()) -> dict[str, Any] | None:
        """The entry that refuses this request: its own key, or a quarantined prompt it is a
        variant of (the same key without the prompt, and NEAR or more of the prompt's shingles
        the same)."""
        entry = self.entries.get(digest)
        if entry is not None:
            return entry if entry["until"] > now else None
        if not sketch or not shape:
            return None
        for e in self.entries.values():
            if e["until"] > now and e.get("shape") == shape and similarity(
                    sketch,
                    e.get("sketch") or ()) >= NEAR:
                return e
        return None

    def prune(self, now: float) -> bool:
        stale = [d for d, e in self.entries.items() if e["until"] <= now]
        for d in stale:
            del self.entries[d]
        return bool(stale)

    def clear(self, key: str | None) -> int | None:
        """Forget one entry (``key``) or every entry; how many were forgotten, None when ``key``
        is unknown."""
        if key is None:
            n = len(self.entries)
            self.entries.clear()
            return n
        return 1 if self.entries.pop(key, None) is not None else None

    def safe_len(self, now: float, served: int = 0) -> int | None:
        """Shorter than the shortest quarantined prompt: the length learned from crash evidence.

        Only prompts longer than ``served`` (the longest this engine ran, its warm-up's included)
        count: one that was no longer did not die of its length, and lowers nothing for anyone
        else. Nor does one that killed the engine without running out of memory (a segfault,
        "engine dead"): its length is not what killed it."""
        lengths = [
            int(e["tokens"]) for e in self.entries.values()
            if e["until"] > now and e.get("tokens") and int(e["tokens"]) > served and _of_length(e)
        ]
        return min(lengths) - 1 if lengths else None

    def as_dict(self) -> dict[str, Any]:
        return {"quarantine": self.entries}

    @classmethod
    def load(cls, doc: Any) -> tuple[Quarantine, list[str]]:
        """From the file's JSON; entries of the wrong shape (a hand edit) are dropped and named."""
        raw = doc.get("quarantine") if isinstance(doc, dict) else None
        if not isinstance(raw, dict):
            return cls(), []
        ok: dict[str, dict[str, Any]] = {}
        dropped: list[str] = []
        for k, v in raw.items():
            if (isinstance(v, dict) and _number(v.get("until"))
                    and (v.get("tokens") is None or _count(v["tokens"]))
                    and all(isinstance(v.get(f, ""), str)
                            for f in ("reason", "kind", "shape", "prompt"))
                    and isinstance(v.get("sketch", []), list)
                    and all(_count(h) for h in v.get("sketch", []))):
                ok[str(k)] = {
                    "until": float(v["until"]), "tokens": v.get("tokens"),
                    "reason": v.get("reason", ""), "kind": v.get("kind",
                                                                 ""), "shape": v.get("shape", ""),
                    "sketch": v.get("sketch", [])[:SKETCH_SIZE], "prompt": v.get("prompt", "")
                }
            else:
                dropped.append(str(k))
        return cls(ok), dropped


def _of_length(entry: Mapping[str, Any]) -> bool:
    """A quarantined prompt whose length may be what killed the engine: a memory failure (entries
    written before the kind was kept count too)."""
    return entry.get("kind", "") in ("", "runtime_oom", "startup_memory")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def quarantined(entry: Mapping[str, Any], digest: str) -> Rejection:
    return Rejection(
        413, "request_quarantined",
        f"this server could not serve this request at its current settings: it (content hash "
        f"{digest[:12]}) crashed the inference engine twice and is refused until the quarantine "
        f"expires; it is not retried. Change or shorten it ({entry.get('reason', '')}).")


def suspect_of(suspect_request: str | None, in_flight: Mapping[str, int]) -> str | None:
    """Which gateway request vLLM named (its req_id carries our X-Request-Id), else the largest
    prompt.

    ``in_flight`` maps our request ids to their prompt size; the longest id wins when several match,
    so a short hostile id cannot shadow another request's.
    """
    if not in_flight:
        return None
    return named_by(suspect_request, in_flight) or max(in_flight, key=lambda rid: in_flight[rid])


def named_by(suspect_request: str | None, in_flight: Mapping[str, int]) -> str | None:
    """The gateway request vLLM's own record named, if any (the longest matching id)."""
    named = [rid for rid in in_flight if suspect_request and _names(suspect_request, rid)]
    return max(named, key=len) if named else None


def _names(req_id: str, rid: str) -> bool:
    """vLLM's request ids are ``cmpl-<X-Request-Id>-<n>[-<hex>]`` and
    ``chatcmpl-<X-Request-Id>[...]``."""
    return any(req_id == p + rid or req_id.startswith(p + rid + "-")
               for p in ("cmpl-", "chatcmpl-", "embd-", ""))
