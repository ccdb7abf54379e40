"""A stream cut by an engine death, continued on the next engine as one stream (pure: no I/O).

What the client has received is tracked event by event: the stream's id, created and model, the
text so far and how many tokens carried it. When the engine dies under the stream, the request is
sent again to the next engine as its own continuation: a completion with the prompt plus the text
so far, a chat with that text as the partial assistant message (vLLM's ``continue_final_message``),
``max_tokens`` (and ``min_tokens``) less what was generated. The continuation's events are rewritten
to the first stream's id and created, its role chunk dropped, and its usage counted once: the
original prompt, and every generated token.

What cannot be continued faithfully still ends with an error event (``not_continuable`` says why):
several choices (``n`` > 1, ``best_of``), a prompt that is not one string (token ids, a batch),
``echo``, guided decoding and JSON schemas (the grammar's state is lost), tools and tool calls.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

CONTINUABLE_ROUTES = ("completions", "chat")
# a chat delta's reasoning text, in vLLM's newer and older names
REASONING = ("reasoning", "reasoning_content")
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "guided_decoding_backend", "structured_outputs", "response_format", "json_schema")


def not_continuable(route: str | None, doc: Any) -> str | None:
    """Why a stream of this request could not be continued on another engine; None when it can."""
    if route not in CONTINUABLE_ROUTES or not isinstance(doc, dict):
        return "only completions and chat completions streams can be continued"
    if (doc.get("n") or 1) != 1 or (doc.get("best_of") or 1) != 1:
        return "a request with several choices (n or best_of > 1)"
    if doc.get("echo"):
        return "echo"
    for key in GUIDED:
        value = doc.get(key)
        if value and not (key == "response_format" and isinstance(value, dict)
                          and value.get("type") == "text"):
            return f"guided decoding ({key}): the grammar's state would be lost"
    if doc.get("tools") or doc.get("functions"):
        return "tools"
    if route == "completions" and not isinstance(doc.get("prompt"), str):
        return "a prompt that is not one string (token ids or a batch)"
    if route == "chat" and not isinstance(doc.get("messages"), list):
        return "no messages"
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if doc.get(key) is not None and whole(doc[key]) is None:
            return f"'{key}' is not a whole number"
    return None


def whole(v: Any) -> int | None:
    """A token count as vLLM's lax parsing reads it (50, 50.0, "50", "50.0"), or None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return int(f) if math.isfinite(f) and f.is_integer() else None


@dataclass
class StreamState:
    """What the client has received of one stream, parsed from its server-sent events."""

    route: str
    id: str | None = None
    created: int | None = None
    text: list[str] = field(default_factory=list)
    tokens: int = 0  # content chunks received: vLLM sends one per generated token
    # A chunk with text, reasoning or a tool call has reached the client (before that, the stream is
    # "unsent"): a reasoning model streams its reasoning for minutes before its first content token,
    # and a tool call may come with no content at all; held, neither would reach the client before
    # it ended.
    content: bool = False
    finished: bool = False  # a finish_reason was seen
    done: bool = False  # [DONE] was seen
    usage_wanted: bool = False  # the client asked for stream_options.include_usage
    tool_calls: bool = False
    # a delta of the model's reasoning (vLLM's `reasoning`, formerly `reasoning_content`)
    reasoning: bool = False
    resumed: int = 0  # continuations so far
    tokens_before_resume: int = 0  # tokens generated before the current continuation began
    pending: bytes = b""  # an event not yet complete

    def events(self, chunk: bytes) -> list[bytes]:
        """The complete events in ``chunk`` (with what was pending), each with its blank line."""
        data = self.pending + chunk
        *whole, self.pending = data.split(b"\n\n")
        return [e + b"\n\n" for e in whole]

    def note(self, event: bytes) -> None:
        """Learn from one event the client is about to receive."""
        if is_done(event):
            self.done = True
        doc = payload(event)
        if not isinstance(doc, dict) or "error" in doc:
            return
        if self.id is None and isinstance(doc.get("id"), str):
            self.id, self.created = doc["id"], doc.get("created")
        for choice in doc.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            piece = _piece(choice)
            if piece is not None:
                self.tokens += 1
                self.text.append(piece)
                self.content = self.content or bool(piece)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if delta.get("tool_calls"):
                    self.tool_calls = self.content = True
                if any(isinstance(delta.get(k), str) and delta[k] for k in REASONING):
                    self.reasoning = self.content = True
            if choice.get("finish_reason"):
                self.finished = True

    def so_far(self) -> str:
        return "".join(self.text)

    def resuming(self) -> None:
        """A continuation is about to be sent: what it will be told was generated already."""
        self.resumed += 1
        self.tokens_before_resume = self.tokens
        self.pending = b""


def payload(event: bytes) -> Any:
    """The JSON of a ``data:`` event; None for [DONE], comments and what does not parse."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            body = line[5:].strip()
            if body == b"[DONE]":
                return None
            try:
                return json.loads(body)
            except ValueError:
                return None
    return None


def is_error(event: bytes) -> bool:
    doc = payload(event)
    return isinstance(doc, dict) and "error" in doc


def is_done(event: bytes) -> bool:
    return event.strip() == b"data: [DONE]"


def _piece(choice: dict[str, Any]) -> str | None:
    """The text a choice carries (a completion's ``text``, a chat delta's ``content``), None for
    a role chunk."""
    if "text" in choice and isinstance(choice["text"], str):
        return choice["text"]
    delta = choice.get("delta")
    if isinstance(delta, dict) and isinstance(delta.get("content"), str):
        if delta.get("role") and not delta["content"]:
            return None  # the opening role chunk
        return str(delta["content"])
    return None


@dataclass(frozen=True)
class Continuation:
    """What a cut stream's request allows: the body that continues it, or why it cannot be
    continued."""

    body: bytes | None
    why_not: str | None
    usage_wanted: bool  # the client asked for stream_options.include_usage


def continue_request(body: bytes, state: StreamState) -> Continuation:
    """From the client's original ``body``: the request that continues ``state`` on a new engine
    (pure; the gateway runs it in its parser pool for a big body, like every parse of a
    client's body)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        doc = None
    usage = isinstance(doc, dict) and bool((doc.get("stream_options") or {}).get("include_usage"))
    why = (not_continuable(state.route, doc) or ("tool calls" if state.tool_calls else None)
           or ("reasoning output: the next engine cannot be handed the reasoning so far"
               if state.reasoning else None))
    if why is not None:
        return Continuation(None, why, usage)
    assert isinstance(doc, dict)
    return Continuation(json.dumps(continuation(doc, state)).encode(), None, usage)


def continuation(doc: dict[str, Any], state: StreamState) -> dict[str, Any]:
    """The request that continues ``state`` on a new engine."""
    out = dict(doc)
    generated = state.tokens
    if state.route == "completions":
        out["prompt"] = doc["prompt"] + state.so_far()
        # vLLM's default is 16
        out["max_tokens"] = max(1, (whole(doc.get("max_tokens")) or 16) - generated)
    else:
        out["messages"] = [*doc["messages"], {"role": "assistant", "content": state.so_far()}]
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
        for key in ("max_completion_tokens", "max_tokens"):
            if whole(doc.get(key)):
                out[key] = max(1, (whole(doc[key]) or 0) - generated)
    if whole(doc.get("min_tokens")):
        out["min_tokens"] = max(0, (whole(doc["min_tokens"]) or 0) - generated)
    out["stream_options"] = {**(doc.get("stream_options") or {}), "include_usage": True}
    return out


def rewrite(event: bytes, state: StreamState, usage_wanted: bool) -> bytes | None:
    """A continuation's event as part of the first stream; None to drop it (its role chunk, an
    unwanted usage)."""
    doc = payload(event)
    if not isinstance(doc, dict) or "error" in doc:
        return event
    if state.id is not None:
        doc["id"] = state.id
    if state.created is not None:
        doc["created"] = state.created
    choices = doc.get("choices") or []
    if len(choices) == 1 and isinstance(choices[0], dict) and _is_role_only(choices[0]):
        return None
    usage = doc.get("usage")
    if isinstance(usage, dict):
        if not usage_wanted:
            if not choices:
                return None
            doc["usage"] = None
        else:
            doc["usage"] = counted_once(usage, state)
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def _is_role_only(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("role")) and not delta.get("content") \
        and not choice.get("finish_reason")


def counted_once(usage: dict[str, Any], state: StreamState) -> dict[str, Any]:
    """The continuation's usage as the whole stream's: the original prompt, and every token
    generated."""
    earlier = state.tokens_before_resume
    prompt = max(0, int(usage.get("prompt_tokens") or 0) - earlier)
    completion = int(usage.get("completion_tokens") or 0) + earlier
    return {
        **usage, "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion
    }
