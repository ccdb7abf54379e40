"""The lifecycle's part of /status: the state, the profile, the counts, the engine's pid and
startup step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from supervisor.engine_states import EngineState as S

if TYPE_CHECKING:
    from supervisor.lifecycle import Lifecycle


def status(lc: Lifecycle) -> dict[str, Any]:
    now, cfg = lc.host.monotonic(), lc.cfg
    run, last = lc.run, lc.tally.last_ready
    warming = lc.state_since if lc.state is S.WARMING else None
    run_status = run.status(warming) if run else {
        "engine_pid": None, "phase": None, "startup": None, "engine_version": None
    }
    if lc.state not in (S.STARTING, S.WARMING):
        run_status["startup"] = None
    return {
        "state": lc.state.value,
        "ready": lc.state is S.READY,
        "profile": lc.profile.knobs(),
        "configured_profile": cfg.profile.knobs(),
        "restarts": lc.tally.restarts,
        "restarts_total": lc.tally.remembered.restarts_total,
        "failures_in_a_row": lc.policy.in_a_row,
        "last_failure": lc.tally.remembered.last_failure,
        "engine_pid": run_status["engine_pid"],
        "engine_url": (last and last.engine_url) or cfg.engine.base_url,
        "start": lc.tally.starts,
        "phase": run_status["phase"],
        "startup": run_status["startup"],
        "engine_version": run_status["engine_version"],
        # with or without vLLM's torch.compile, and why (decide/compile_mode.py)
        "compile": run.origin.compile.as_dict() if run else None,
        "degraded": lc.profile.knobs() != cfg.profile.knobs(),
        "state_for_s": round(now - lc.state_since, 3),
        "outage_s": lc.tally.outage_s(now),
        "timings": last.as_dict() if last else {},
        "fatal": lc.tally.remembered.fatal,
        # reset-profile asked while READY, until its start is prepared (a spare beside first)
        "restart_asked": asked[0].knobs() if (asked := lc.ready_period.asked) else None,
    }
