"""``<state dir>/pages.json``: the pages this host has open, per hook, until their condition ends
(mode 0600).

A page that outlives the supervisor that opened it (a FATAL exit, a SIGKILL, a reboot) is resolved
by the next supervisor once its condition is over: the file survives restarts, as the state
directory does. A file that cannot be read is reported and treated as empty: resolving a page twice
is harmless, a page that never resolves is what this file exists to prevent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import structlog

from supervisor.host.files import read_json, write_private

FILENAME = "pages.json"
log = structlog.get_logger("supervisor.alerts")


class OpenPages:
    def __init__(self, state_dir: str | Path | None) -> None:
        self.path = Path(state_dir) / FILENAME if state_dir is not None else None
        # hook -> dedup_key -> what opened it
        self.open: dict[str, dict[str, dict[str, Any]]] = self._load()

    def _load(self) -> dict[str, dict[str, dict[str, Any]]]:
        if self.path is None:
            return {}
        try:
            doc = read_json(self.path)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("alerts.pages_unreadable", path=str(self.path), error=str(exc))
            return {}
        pages = doc.get("open") if isinstance(doc, dict) else None
        if not isinstance(pages, dict):
            return {}
        return {str(h): {str(k): v for k, v in keys.items() if _page(v)}
                for h, keys in pages.items() if isinstance(keys, dict)}

    def opened(self, hook: str, key: str, clears_on: str, event: str, at: float,
               severity: str = "") -> None:
        self.open.setdefault(hook, {})[key] = {"clears_on": clears_on, "event": event, "since": at,
                                               "severity": severity}
        self._save()

    def closing(self, hook: str, conditions: list[str]) -> list[tuple[str, dict[str, Any]]]:
        """The pages of ``hook`` that these conditions end, forgotten now (their resolves are
        being sent)."""
        mine = self.open.get(hook, {})
        done = [(k, v) for k, v in mine.items() if v["clears_on"] in conditions]
        for k, _ in done:
            del mine[k]
        if done:
            self._save()
        return done

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_private(self.path,
                          json.dumps({"open": {h: k for h, k in self.open.items() if k}}, indent=1))
        except OSError as exc:
            log.error("alerts.pages_not_saved", path=str(self.path), error=str(exc))


def _page(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("clears_on"), str)
