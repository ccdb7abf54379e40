"""One JSON bundle per engine failure in <state dir>/incidents: what on-call reads first."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from supervisor.config import redact as mask_secrets
from supervisor.engine_states import Failure
from supervisor.event_stream import Event, IncidentWriteFailed
from supervisor.host.files import write_private
from supervisor.profile import Profile

MAX_KEPT = 50


def write(state_dir: str | Path, kind: str, bundle: dict[str, Any],
          redact: Callable[[str], str] | None = None) -> Path:
    """Write one bundle (mode 0600, ``redact`` applied to its whole text); keep the newest
    MAX_KEPT."""
    d = Path(state_dir) / "incidents"
    d.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    path = d / f"{stamp}-{int(time.time() * 1000) % 1000:03d}-{kind}.json"
    text = json.dumps(bundle, indent=1, default=str)
    write_private(path, redact(text) if redact else text)
    for old in sorted(d.glob("*.json"))[:-MAX_KEPT]:
        old.unlink(missing_ok=True)
    return path


def keep(state_dir: str | Path, kind: str, doc: dict[str, Any], secrets: Sequence[str],
         publish: Callable[[Event], None], wall: Callable[[], float]) -> str | None:
    """Write ``doc`` with the engine's secrets masked; its path, or None and an
    ``incident.write_failed`` event."""
    try:
        return str(write(state_dir, kind, doc, redact=lambda text: mask_secrets(text, secrets)))
    except OSError as exc:
        publish(IncidentWriteFailed(at=wall(), error=str(exc)))
        return None


def bundle(verdict: Any, failure: Failure, before: Profile, after: Profile, decision: str,
           detected_after_s: float, gpu: Any) -> dict[str, Any]:
    """The bundle of one failure: the verdict (an engine run's ``Verdict``), the decision, the
    GPU's state."""
    t = verdict.trigger
    evidence: Mapping[str, Any] = verdict.evidence
    return {
        "failure": failure.as_dict(),
        "decision": decision,
        "trigger": {"kind": t.kind.value, "evidence": t.evidence, "at": t.at},
        "phase": verdict.phase.value,
        "returncode": verdict.returncode,
        "profile_before": before.knobs(),
        "profile_after": after.knobs(),
        "stop": verdict.stop.__dict__ if verdict.stop else None,
        "gpu": gpu,
        "stacks": verdict.stacks,
        "detected_after_state_s": detected_after_s,
        **evidence,
    }
