"""reload_plan (issue 26): what a reload of one config over another changes, decided without I/O."""

from __future__ import annotations

from supervisor.config_file import parse
from supervisor.decide.reload import RESTART_ONLY, reload_plan

BASE = {"engine": {"model": "m"}, "gateway": {"listen": "0.0.0.0:8000"}}


def test_sections_changed_and_whether_the_engine_restarts() -> None:
    old = parse(BASE)
    same = reload_plan(old, parse(BASE))
    assert same.changed == () and not same.engine_restart and not same.alerts and same.refused == ()
    health = reload_plan(old, parse({**BASE, "health": {"probe_interval_s": 3}}))
    assert health.changed == ("health",) and not health.engine_restart
    profile = reload_plan(old, parse({**BASE, "profile": {"max_num_seqs": 4}}))
    assert profile.changed == ("profile",) and profile.engine_restart
    hooks = reload_plan(old, parse({**BASE, "alerts": {"hooks": [{"type": "webhook", "url": "http://h/"}]}}))
    assert hooks.alerts and not hooks.engine_restart
    drain = reload_plan(old, parse({**BASE, "gateway": {"listen": "0.0.0.0:8000", "drain_timeout_s": 9}}))
    assert drain.changed == ("gateway",) and drain.refused == ()  # applied at once


def test_what_only_a_restart_of_the_supervisor_may_change_refuses_the_file() -> None:
    old = parse(BASE)
    moved = reload_plan(old, parse({**BASE, "gateway": {"listen": "0.0.0.0:9000"},
                                    "admin": {"listen": "127.0.0.1:8101"}, "state": {"dir": "/elsewhere"}}))
    assert dict(moved.refused) == {"admin": RESTART_ONLY, "state": RESTART_ONLY, "gateway.listen": RESTART_ONLY}
    gone = reload_plan(old, parse({"engine": {"model": "m"}}))
    assert dict(gone.refused) == {"gateway.listen": RESTART_ONLY}
