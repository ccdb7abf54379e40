"""`vllm-supervisor alerts test [--resolve]`: one test page through every configured hook, before 3
a.m. does.

Each hook gets the same alert a real incident would send it, at the hook's own severity floor (so
that a PagerDuty hook pages and a Twilio hook texts), marked as a test; ``--resolve`` then resolves
it (PagerDuty closes the incident; the others get the resolve notice). One attempt each, with the
hook's timeout: the point is to see what fails. What is printed names the hook by its type and host
only: a Slack or webhook URL can carry a secret.
"""

from __future__ import annotations

import time
import urllib.parse
from dataclasses import dataclass

from supervisor.config import AlertsConfig, HookConfig
from supervisor.ops.alerts.channels import Channel, MissingSecret, SendFailed, make_channel
from supervisor.ops.alerts.rules import Alert


@dataclass(frozen=True)
class Outcome:
    hook: str  # "pagerduty (events.pagerduty.com)"
    sent: bool
    resolved: bool | None  # None: not asked
    error: str | None


def where(hook: HookConfig) -> str:
    if hook.type == "command":
        return f"command ({hook.argv[0] if hook.argv else '?'})"
    return f"{hook.type} ({urllib.parse.urlsplit(hook.endpoint).hostname or '?'})"


def trial_alert(host: str, hook: HookConfig, at: float, resolves: bool = False) -> Alert:
    key = f"vllm-supervisor/{host}/test/{int(at)}"
    # as a real resolve carries it: what opened the page (Alertmanager matches its labels)
    if resolves:
        opened = {"event": "test", "severity": hook.severity_floor, "since": at}
        return Alert("test_resolved", "info", host,
                     "resolved: the test page from `vllm-supervisor alerts test`", at, key,
                     details={"opened_as": opened}, resolves=True)
    return Alert(
        "test", hook.severity_floor, host,
        "TEST from `vllm-supervisor alerts test`: nothing is wrong; this "
        "is what an incident sends here", at, key, details={"test": True}, clears_on="test")


async def send_trial(cfg: AlertsConfig, host: str, resolve: bool,
                     now: float | None = None) -> list[Outcome]:
    at = time.time() if now is None else now
    secrets = cfg.withheld()
    out: list[Outcome] = []
    for hook in cfg.hooks:
        try:
            channel = make_channel(hook, secrets)
        except MissingSecret as exc:
            out.append(Outcome(where(hook), False, None, str(exc)))
            continue
        try:
            out.append(await _try(channel, hook, host, at, resolve))
        finally:
            await channel.close()
    return out


async def _try(channel: Channel, hook: HookConfig, host: str, at: float, resolve: bool) -> Outcome:
    try:
        await channel.send(trial_alert(host, hook, at))
    except SendFailed as exc:
        return Outcome(where(hook), False, None, str(exc))
    if not resolve:
        return Outcome(where(hook), True, None, None)
    try:
        await channel.send(trial_alert(host, hook, at, resolves=True))
    except SendFailed as exc:
        return Outcome(where(hook), True, False, f"the resolve: {exc}")
    return Outcome(where(hook), True, True, None)


def render(outcomes: list[Outcome]) -> str:
    if not outcomes:
        return "no [[alerts.hooks]] configured: nothing would page anybody"
    lines = []
    for o in outcomes:
        state = "sent" if o.sent else "FAILED"
        if o.resolved is not None:
            state += ", resolved" if o.resolved else ", resolve FAILED"
        lines.append(f"{o.hook}: {state}" + (f": {o.error}" if o.error else ""))
    return "\n".join(lines)
