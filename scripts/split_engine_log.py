"""Split a `vllm-supervisor run` log into one file of engine console lines per engine start.

The supervisor's own lines are JSON events; everything between two `engine.spawned` events is
vLLM's console output for that start, unedited. This is how the supervised-run fixtures in
tests/fixtures/vllm-logs were cut out of real runs:

    python scripts/split_engine_log.py supervisor.log OUTDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def split(log: Path) -> list[tuple[str, list[str]]]:
    """(how the start ended, its console lines) for each engine start in ``log``."""
    starts: list[tuple[str, list[str]]] = []
    for line in log.read_text(errors="replace").splitlines():
        event = None
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                event = None
        if isinstance(event, dict) and "event" in event:
            if event["event"] == "engine.spawned":
                starts.append(("running", []))
            elif event["event"] == "engine.failed" and starts and starts[-1][0] == "running":
                # The first verdict after a spawn is that start's; a later one (a start failed by a gate
                # before it spawned anything) belongs to no console output.
                starts[-1] = (str(event["kind"]), starts[-1][1])
            continue
        if starts:
            starts[-1][1].append(line)
    return starts


def main() -> None:
    log, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for i, (end, lines) in enumerate(split(log)):
        path = out / f"start{i}-{end}.log"
        path.write_text("\n".join(lines) + "\n")
        print(path, len(lines), "lines")


if __name__ == "__main__":
    main()
