"""What a reload changes (pure): which sections changed, whether the engine must restart, and
what only a restart of the supervisor can change (then the whole file is refused)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from supervisor.config import Config

RESTART_ONLY = "changes only with a restart of the supervisor"


@dataclass(frozen=True)
class ReloadPlan:
    changed: tuple[str, ...]  # the top-level sections that differ
    refused: tuple[tuple[str, str], ...]  # (field, why) when the file cannot be applied live
    engine_restart: bool  # [engine] or [profile] changed: a planned restart
    alerts: bool  # the hooks are rebuilt (their secrets read again)


def reload_plan(old: Config, new: Config) -> ReloadPlan:
    fixed = [name for name in ("admin", "state") if getattr(new, name) != getattr(old, name)]
    old_gw, new_gw = old.gateway, new.gateway
    if (old_gw is None) != (new_gw is None) or (old_gw and new_gw
                                                and old_gw.listen != new_gw.listen):
        fixed.append("gateway.listen")  # the public port itself; its other settings apply at once
    return ReloadPlan(
        changed=tuple(f.name for f in dataclasses.fields(Config)
                      if getattr(old, f.name) != getattr(new, f.name)), refused=tuple(
                          (name, RESTART_ONLY) for name in fixed),
        engine_restart=new.engine != old.engine or new.profile != old.profile, alerts=new.alerts
        != old.alerts)
