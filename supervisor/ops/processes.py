"""What runs on the card: every vLLM of ours on the host, by role (docs/operations.md, "What runs
on the card")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from supervisor.host import Child, DeviceSnapshot, Host
from supervisor.profile import Profile

Row = tuple[str, Child, str | None, Profile | None]  # role, session leader, URL, profile


def ours_on_host(host: Host, rows: Sequence[Row],
                 polled: Sequence[DeviceSnapshot]) -> list[dict[str, Any]]:
    """Each engine's session (the leader's pid, which `ps -o sid=` prints for any of its
    processes, nvidia-smi's EngineCore included), its live pids, and the GPU memory they held
    at the last poll (``polled``; none yet: unknown). A session with no live process left is
    not listed."""
    held = {pid: used for snap in polled for pid, used in snap.processes}
    out = []
    for role, child, url, profile in rows:
        pids = host.session_pids(child.sid)
        if pids:
            out.append({"role": role, "session": child.sid, "pids": pids, "url": url,
                        "profile": profile.knobs() if profile else None,
                        "gpu_bytes": sum(held.get(p, 0) for p in pids) if polled else None})
    return out
