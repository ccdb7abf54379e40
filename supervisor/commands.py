"""The operator's commands on the control socket (docs/operations.md): restart, reset-profile,
quarantine-clear and reload. It holds the config in force and the alert hooks made from it,
the two things a reload replaces; a reload reads the file again, refuses what cannot change
live, and hands each part its new settings."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from supervisor import config_file
from supervisor.config import Config, ConfigError
from supervisor.decide.policy import clamp_to_configured
from supervisor.decide.reload import reload_plan
from supervisor.engine_states import EngineState as S
from supervisor.engine_states import TriggerKind
from supervisor.event_stream import Event, Reloaded, ReloadFailed, Reloading
from supervisor.gateway.server import Gateway
from supervisor.host import Host
from supervisor.lifecycle import Lifecycle
from supervisor.lifecycle.serving import RELOADED
from supervisor.ops.alerts.channels import MissingSecret
from supervisor.ops.alerts.dispatch import Alerts
from supervisor.ops.metrics import Metrics
from supervisor.profile import Profile
from supervisor.recovery import Recovery

log = structlog.get_logger("supervisor.commands")


class OperatorCommands:
    def __init__(self, cfg: Config, host: Host, publish: Callable[[Event], None], metrics: Metrics,
                 config_path: str | None, lifecycle: Lifecycle, gateway: Gateway | None,
                 recovery: Recovery) -> None:
        self.cfg, self.host, self.publish, self.metrics = cfg, host, publish, metrics
        self.config_path = config_path
        # what the commands act on
        self.lifecycle, self.gateway, self.recovery = lifecycle, gateway, recovery
        self.alerts = self.alerts_for(cfg)  # raises MissingSecret (a configuration error)

    async def command(self, command: str, arg: str | None = None) -> tuple[bool, str]:
        if command == "quarantine-clear":
            if self.gateway is None:
                return False, "this supervisor has no [gateway]: nothing is quarantined"
            # on-call's undo: one entry, or all
            return self.gateway.quarantine.undo(arg, self.host.wall())
        if command == "reload":
            return await self.reload()
        lc = self.lifecycle
        if command == "reset-profile":  # failed rungs forgotten, and back to [profile]
            lc.policy.forget_failed_rungs()
            lc.learned()
            if lc.profile == lc.cfg.profile:
                return True, "the profile already is the configured one; failed rungs forgotten"
            # a climb: its spare built beside the serving engine first, where one fits
            return self.restart_when_prepared(lc.cfg.profile, "reset-profile: back to [profile]")
        return self.restart_at(lc.profile, "restart asked by the operator")

    def restart_when_prepared(self, target: Profile, why: str) -> tuple[bool, str]:
        """A planned restart at ``target`` whose start is prepared first, while the engine
        serves (reset-profile, a reload of the engine's settings): a spare of its rung asleep
        beside the engine where one fits, vLLM imported for the engine's command and environment
        in force. Not READY: as ``restart_at``."""
        lc = self.lifecycle
        if lc.state is not S.READY or lc.run is None:
            return self.restart_at(target, why)
        lc.ready_period.asked = (target, why)
        return True, (f"{why}: the engine restarts at {target.knobs()} once that start is "
                      "prepared (a spare of its rung asleep beside the engine where one fits, "
                      "vLLM imported for its command; /status next_start says which)")

    def restart_at(self, target: Profile, why: str) -> tuple[bool, str]:
        """A planned restart at ``target`` (the operator's restart or reset-profile, a reload):
        the run asked to end with it, or while the engine is already restarting, the next
        start's profile."""
        lc = self.lifecycle
        run = lc.run
        if lc.state not in (S.STARTING, S.WARMING, S.READY) or run is None:
            if lc.state in (S.BACKOFF, S.STOPPING):
                lc.change_profile(target, why)  # the start that comes next uses it
                lc.learned()
                return True, (f"the engine is already restarting ({lc.state.value}); the next "
                              "start uses the profile")
            return False, f"the engine is {lc.state.value}: nothing to restart"
        run.end(TriggerKind.RESTART, why, target=target)
        return True, f"{why}: the engine restarts at {target.knobs()}"

    def alerts_for(self, cfg: Config) -> Alerts:
        """The alert hooks of ``cfg``, their series at 0 on /metrics; raises MissingSecret."""
        alerts = Alerts.from_config(cfg.alerts, self.publish, cfg.state.dir, cfg.profile)
        for hook in cfg.alerts.hooks:
            self.metrics.alerts_sent.labels(hook.type)
            self.metrics.alerts_failed.labels(hook.type)
        return alerts

    async def reload(self) -> tuple[bool, str]:
        """Read the config file again: invalid → keep the old one; engine settings changed →
        planned restart."""
        path, publish = self.config_path, self.publish
        publish(Reloading(at=self.host.wall(), source=str(path)))
        try:
            if path is None:
                raise ConfigError([("(file)",
                                    "this supervisor was started without a config file path")])
            new = config_file.load(path)
            plan = reload_plan(self.cfg, new)
            if plan.refused:
                raise ConfigError(list(plan.refused))
            alerts = self.alerts_for(new) if plan.alerts else None
        except (ConfigError, MissingSecret) as exc:
            publish(ReloadFailed(at=self.host.wall(), error=str(exc)))
            return False, f"reload refused, still running on the old config:\n{exc}"
        # a bug in reading the file must never take down the running service
        except Exception as exc:
            log.exception("reload.crashed", source=str(path))
            publish(ReloadFailed(at=self.host.wall(), error=f"{type(exc).__name__}: {exc}"))
            return False, (f"reload refused (reading the file failed: {type(exc).__name__}: "
                           f"{exc}), still running on the old config")
        old, self.cfg = self.cfg, new
        self.lifecycle.reconfigure(new)
        if alerts is not None:
            await self.alerts.close()
            self.alerts = alerts
            self.alerts.start()
        if self.gateway is not None and new.gateway is not None:
            self.gateway.reconfigure(new.gateway)
        self.recovery.configure(new)
        publish(
            Reloaded(at=self.host.wall(), changed=plan.changed, engine_restart=plan.engine_restart,
                     configured_profile=new.profile))
        if not plan.engine_restart:
            return True, (f"reloaded ({', '.join(plan.changed) or 'nothing'} changed); the engine "
                          "keeps running")
        ok, message = self.restart_when_prepared(
            clamp_to_configured(self.lifecycle.profile, new.profile, old.profile), RELOADED)
        return ok, f"reloaded ({', '.join(plan.changed)} changed); {message}"
