"""One paging path: which of the configured hooks would page a person for the same alert twice
(pure).

A page is an alert with a condition that clears it (``rules.CLEARS_ON``). Three hook types reach a
person's pager: PagerDuty and Twilio directly, Alertmanager through its own routes (which usually
end at PagerDuty). An outage that goes to Alertmanager and to PagerDuty at once pages the on-call
twice; ``check`` and ``doctor`` warn about it. docs/operations.md ("One paging path") says which
path pages for what.
"""

from __future__ import annotations

from supervisor.config import SEVERITIES, HookConfig, Problems

# The severities each page can carry (rules.Rules: engine_restarted becomes "error" when restarts
# repeat).
PAGE_SEVERITIES = {
    "outage": ("error", ), "fatal": ("critical", ), "engine_restarted": ("warning", "error"),
    "hang_detected": ("warning", ), "profile_lowered": ("warning", ),
    "config_reload_failed": ("warning", )
}
DIRECT_PAGERS = ("pagerduty", "twilio")
ROUTED_PAGERS = ("alertmanager",)


def pages_for(hook: HookConfig) -> set[str]:
    """The pages ``hook`` gets (every page at or above its severity floor)."""
    floor = SEVERITIES.index(hook.severity_floor)
    return {page for page, severities in PAGE_SEVERITIES.items()
            if any(SEVERITIES.index(s) >= floor for s in severities)}


def double_pages(hooks: tuple[HookConfig, ...] | list[HookConfig]) -> Problems:
    """A warning for each direct pager that gets the same pages as an Alertmanager hook: one
    outage would page twice, once by each path. Direct pagers among themselves are one path
    (SMS for ``critical`` beside PagerDuty is the defaults' escalation, chosen on purpose)."""
    out: Problems = []
    routed = [(i, h) for i, h in enumerate(hooks) if h.type in ROUTED_PAGERS]
    direct = [(j, h) for j, h in enumerate(hooks) if h.type in DIRECT_PAGERS]
    for i, a in routed:
        for j, b in direct:
            both = sorted(pages_for(a) & pages_for(b))
            if not both:
                continue
            out.append((
                f"alerts.hooks[{j}]",
                f"{b.type} and alerts.hooks[{i}] ({a.type}) both page for {', '.join(both)}: one "
                "outage "
                "pages the on-call twice. Let one path page: route the supervisor's alerts in "
                "Alertmanager "
                "to a receiver that only records them, or raise one hook's min_severity past these "
                "(docs/operations.md, \"One paging path\")"))
    return out
