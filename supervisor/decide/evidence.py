"""What counts as evidence: vLLM's own error records, never text a client sent (pure).

A client's text reaches vLLM's output in several places: the ``stop`` strings of every request
appear in the ``SamplingParams(...)`` repr of a scheduler dump, ``--enable-log-requests`` prints
each request's params (and prompt) at INFO, and uvicorn's access log prints the path. If a
verdict were decided by matching words anywhere in that output, a request with
``stop=["error: unrecognized arguments: --x"]`` could turn an OOM into a "configuration error"
(exit 3, never restarted), and one with ``stop=["EngineDeadError"]`` could get a healthy engine
killed. So only these count:

- typed IPC events at WARNING and above (every event our handler sends is one of vLLM's log
  records);
- console lines whose vLLM header says WARNING, ERROR or CRITICAL;
- headerless lines that only the interpreter or the C runtime writes: a crash line (``Segmentation
  fault``, ``Fatal Python error``), argparse's ``usage:``/``<prog>: error:``, and the exception
  line that ends an uncaught traceback.

Scheduler dumps (``dump_input.py``) are never matched for a verdict; they are read, with every
quoted string and ``SamplingParams(...)`` span removed, only to name the suspect request.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# "(EngineCore pid=15062) ERROR 11-30 07:19:35 [core.py:1512] " (vLLM >= 0.6), the older "ERROR
# 07-10 12:00:00 engine.py:64] ", and the multiprocessing decoration "(EngineCore_DP0 pid=1) ".
_PROCS = re.compile(r"^(?:\([\w:\-. ]+ pid=\d+\)\s*)*")
_HEADER = re.compile(
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+"
    r"\[?(?P<where>[\w.\-]+:\d+)\]\s?")
EVIDENCE_LEVELS = frozenset({"WARNING", "ERROR", "CRITICAL"})
# vLLM's sources that print request contents (scheduler dumps, the request logger).
DUMP_SOURCES = frozenset({"dump_input.py", "logger.py", "request_logger.py"})

_RAW_LINES = [
    re.compile(r"^Fatal Python error: .*"),
    re.compile(r"^Segmentation fault(?: \(core dumped\))?$"),
    re.compile(r"^(?:Killed|Aborted(?: \(core dumped\))?|Bus error(?: \(core dumped\))?)$"),
    re.compile(r"^usage: .*"),
    re.compile(r"^[\w.\-]+: error: .*"),
]
_TRACEBACK = "Traceback (most recent call last):"
_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
_NEW_REQUEST = re.compile(r"NewRequestData\(req_id=([\w\-]+),prompt_token_ids_len=(\d+),")
_SCHEDULED = re.compile(r"num_scheduled_tokens=\{([^{}]*)\}")
_SCHEDULED_ONE = re.compile(r"(?:^|, )([\w\-]+): (\d+)(?=,|$)")


def strip_prefix(line: str) -> str:
    """Drop vLLM's '(Proc pid=N) LEVEL date [file:line]' header from one console line."""
    rest = _PROCS.sub("", line, count=1)
    m = _HEADER.match(rest)
    return (rest[m.end():] if m else rest).strip()


def scrub(text: str) -> str:
    """``text`` without any ``SamplingParams(...)`` span (a request's own strings live there)."""
    out: list[str] = []
    i = 0
    while True:
        j = text.find("SamplingParams(", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j] + "SamplingParams(...)")
        i = _close_paren(text, j + len("SamplingParams("))


def _close_paren(text: str, i: int) -> int:
    """Index after the ')' that closes a '(' just before ``i``, skipping quoted strings."""
    depth = 1
    while i < len(text) and depth:
        c = text[i]
        if c in "'\"":
            m = _QUOTED.match(text, i)
            i = m.end() if m else len(text)
            continue
        depth += {"(": 1, ")": -1}.get(c, 0)
        i += 1
    return i


@dataclass
class ConsoleFilter:
    """Feeds console lines one at a time; ``feed`` returns the line's evidence text, or None.

    Stateful only to know whether a headerless line ends an uncaught traceback.
    """

    in_traceback: bool = False

    def feed(self, line: str) -> str | None:
        rest = _PROCS.sub("", line, count=1)
        m = _HEADER.match(rest)
        if m:
            self.in_traceback = False
            if m.group("level") not in EVIDENCE_LEVELS or source_of(
                    m.group("where")) in DUMP_SOURCES:
                return None
            return scrub(rest[m.end():]).strip() or None
        body = rest.rstrip()
        if body.startswith(_TRACEBACK):
            self.in_traceback = True
            return None
        if self.in_traceback:
            if body[:1].isspace() or not body:
                return None  # a frame of the traceback
            self.in_traceback = False
            return body  # the exception line: "RuntimeError: Engine core initialization failed ..."
        for pat in _RAW_LINES:
            if pat.match(body):
                return body
        return None


def source_of(where: str) -> str:
    return where.rsplit(":", 1)[0]


def console_evidence(lines: Iterable[str]) -> list[str]:
    """The evidence texts of a console tail, in order."""
    f = ConsoleFilter()
    return [t for t in (f.feed(x) for x in lines) if t]


def event_evidence(event: Mapping[str, object]) -> list[str]:
    """The evidence texts of one IPC event: message, exception, and the traceback's last lines."""
    if str(event.get("level", "")) not in EVIDENCE_LEVELS:
        return []
    if source_of(str(event.get("where", ""))) in DUMP_SOURCES:
        return []
    out: list[str] = []
    for key in ("msg", "exc_type", "alloc"):
        val = event.get(key)
        if isinstance(val, str) and val:
            out.append(
                scrub(val) if key !=
                "exc_type" else f"{val}: {scrub(str(event.get('exc_msg', '')))}")
    tb = event.get("exc_tail")
    if isinstance(tb, list):
        out.extend(scrub(str(x)) for x in tb)
    return out


def events_evidence(events: Iterable[Mapping[str, object]]) -> list[str]:
    return [t for ev in events for t in event_evidence(ev)]


@dataclass(frozen=True)
class Suspect:
    """The request most likely to have caused the failure, from vLLM's scheduler dump."""

    request_id: str
    prompt_tokens: int | None  # known when the request was new in the failing batch


def batch(lines: Iterable[str],
          events: Iterable[Mapping[str, object]] = ()) -> list[dict[str, object]]:
    """The shapes of the requests in the failing batch (ids and token counts, never text), from
    the last dump."""
    texts = [strip_prefix(x) for x in lines if "Dumping scheduler output" in x]
    texts += [
        str(ev.get("msg", "")) for ev in events
        if "Dumping scheduler output" in str(ev.get("msg", ""))
    ]
    if not texts:
        return []
    bare = _QUOTED.sub("''", scrub(texts[-1]))
    prompt = {req: int(n) for req, n in _NEW_REQUEST.findall(bare)}
    out: dict[str, dict[str, object]] = {}
    for m in _SCHEDULED.finditer(bare):
        for req, n in _SCHEDULED_ONE.findall(m.group(1)):
            out[req] = {
                "request_id": req, "prompt_tokens": prompt.get(req), "scheduled_tokens": int(n)
            }
    for req, n in prompt.items():
        out.setdefault(req, {"request_id": req, "prompt_tokens": n, "scheduled_tokens": None})
    return list(out.values())


def suspect(lines: Iterable[str], events: Iterable[Mapping[str, object]] = ()) -> Suspect | None:
    """The largest new request named by a scheduler dump, else the one with most scheduled tokens.

    Read outside every quoted string and ``SamplingParams(...)`` span, and only in the fields vLLM
    writes itself, so a client's text cannot name (or hide) a suspect.
    """
    texts = [strip_prefix(x) for x in lines if "Dumping scheduler output" in x]
    texts += [
        str(ev.get("msg", "")) for ev in events
        if "Dumping scheduler output" in str(ev.get("msg", ""))
    ]
    new: list[Suspect] = []
    scheduled: list[tuple[int, str]] = []
    for text in texts:
        bare = _QUOTED.sub("''", scrub(text))
        new += [Suspect(req, int(n)) for req, n in _NEW_REQUEST.findall(bare)]
        for m in _SCHEDULED.finditer(bare):
            scheduled += [(int(n), req) for req, n in _SCHEDULED_ONE.findall(m.group(1))]
    # The supervisor's own warm-up and canary requests are suspects only when alone in the batch.
    new = [x for x in new if not _ours(x.request_id)] or new
    scheduled = [x for x in scheduled if not _ours(x[1])] or scheduled
    if new:
        return max(new, key=lambda s: s.prompt_tokens or 0)
    if scheduled:
        return Suspect(max(scheduled)[1], None)
    return None


def _ours(request_id: str) -> bool:
    return request_stem(request_id).startswith(("canary-", "warmup-"))


def request_stem(request_id: str) -> str:
    """The id a client (or our gateway) sent as X-Request-Id: vLLM's ``cmpl-<id>-0-<hex>``
    without its decorations."""
    m = re.fullmatch(r"(?:chat)?cmpl-(.+?)(?:-\d+)?(?:-[0-9a-f]{8})?", request_id)
    return m.group(1) if m else request_id
