"""On a lent H200: issue 38, item 3 — a new state directory compiles nothing that vLLM's own cache holds.

One device call, a fresh host (an empty compile cache), UTIL (default 0.9, vLLM's own) and SPARE (default "off", so
that only the compiles count; "auto" builds a spare first in both arms), MODEL (default ~/tinyllama, 0.9B):
  A. the supervisor's first start on state directory A: the rungs within reach compiled first, then the engine;
  B. the same host, a new state directory B (a second supervisor, a volume replaced): its first READY, and the
     rungs it compiled first (before this change: all of A's again; now: none, read from vLLM's cache notes).
B's start is the warm-cache start of the same engine, side by side with A's in one run.
$OUT gets summary-newstate.txt and events-newstate-{a,b}.jsonl. Usage: `python3 bench/gpu_newstate.py`.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from common import events_in
from gpu_common import OUT, Stop, note, notes, run_supervisor, stop_supervisor
from gpu_seed import at, ready, second_engines, toml

UTIL = float(os.environ.get("UTIL", "0.9"))
SPARE = os.environ.get("SPARE", "off")
CACHE = Path("/tmp/vcache-newstate")


def first_ready(state: Path, arm: str) -> tuple[float, int]:
    """The supervisor's first start on ``state``: seconds to its first READY, and the rungs it compiled first."""
    cfg, log = Path(f"/tmp/sup-newstate-{arm}.toml"), OUT / f"supervisor-newstate-{arm}.log"
    cfg.write_text(toml(state, CACHE, "", UTIL, SPARE))
    sup = run_supervisor(cfg, log)
    try:
        st = ready(sup, log, f"arm {arm}'s first READY", progress=second_engines(log, "precompile.started",
                                                                               "engine.rung_precompiled"))
    finally:
        stop_supervisor(sup)
    started = events_in(log, "supervisor.started")[0]
    to_ready = next(e for e in events_in(log, "engine.state_changed") if e.get("to") == "READY")
    seconds = round(at(to_ready) - at(started), 1)
    spawned = at(events_in(log, "engine.spawned")[0])
    compiled = [e for e in events_in(log, "precompile.started") if at(e) < spawned and e.get("profile")]
    note(f"arm {arm} ({state}): first READY {seconds}s after the supervisor started; {len(compiled)} rung(s) built "
         f"first; engine spawn -> READY {round(at(to_ready) - spawned, 1)}s; phases {to_ready.get('phases')}")
    note(f"  next_start.precompile: {st['next_start']['precompile']}")
    ours = [line for line in log.read_text(errors="replace").splitlines() if line.startswith('{"')]
    (OUT / f"events-newstate-{arm}.jsonl").write_text("\n".join(ours) + "\n")
    return seconds, len(compiled)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    a, b = Path("/tmp/sup-state-newstate-a"), Path("/tmp/sup-state-newstate-b")
    for stale in (CACHE, a, b):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        a_s, a_n = first_ready(a, "a")
        notes_in_cache = sorted(str(p.relative_to(CACHE)) for p in CACHE.rglob("vllm-supervisor.json"))
        note(f"notes in vLLM's cache after A: {len(notes_in_cache)} {notes_in_cache}")
        b_s, b_n = first_ready(b, "b")
        note(f"RESULT util {UTIL} spare {SPARE}: fresh host {a_s}s ({a_n} built first); new state directory "
             f"{b_s}s ({b_n} built first); ratio new/fresh {b_s / a_s:.2f}x")
    except Stop as exc:
        note(f"STOPPED: {exc}")
        return 1
    finally:
        (OUT / "summary-newstate.txt").write_text("\n".join(notes) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
