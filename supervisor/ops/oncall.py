"""What on-call reads: `vllm-supervisor status` and `vllm-supervisor incidents`, as text.

``status`` asks the running supervisor; when none answers it says what the state directory
remembers (state.json and the newest incident bundle).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from supervisor.bounds import GIB
from supervisor.event_stream import building_beside_line, building_line
from supervisor.host.files import read_json
from supervisor.ops import statefile


def fmt_s(seconds: float) -> str:
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _knobs(profile: dict[str, Any], configured: dict[str, Any] | None) -> str:
    out = []
    for k, v in profile.items():
        text = f"{k}={'vllm-default' if v is None else v}"
        if configured is not None and configured.get(k) != v:
            c = configured.get(k)
            text += f" (configured {'vllm-default' if c is None else c})"
        out.append(text)
    return "  ".join(out)


def render_status(doc: dict[str, Any]) -> str:
    lines = [
        f"state     {doc['state']}{'  (ready)' if doc['ready'] else ''} for "
        f"{fmt_s(doc.get('state_for_s', 0))}"
    ]
    startup = doc.get("startup")
    if startup:
        lines.append(f"startup   {startup['step']} for {fmt_s(startup['for_s'])}")
    version = f"  vLLM {doc['engine_version']}" if doc.get("engine_version") else ""
    if (doc.get("compile") or {}).get("compiled") is False:
        version += "  [without torch.compile: a failure's restart; a climb or restart compiles]"
    lines.append(f"engine    pid {doc['engine_pid']}  {doc.get('engine_url', '')}{version}")
    degraded = "  [degraded: below the configured profile]" if doc.get("degraded") else ""
    lines.append("profile   " + _knobs(doc["profile"], doc.get("configured_profile")) + degraded)
    lines.append(
        f"restarts  {doc['restarts']} (this run), {doc.get('restarts_total', '?')} (all time); "
        f"{doc.get('failures_in_a_row', 0)} failures in a row")
    gw = doc.get("gateway")
    if gw:
        lines.append(
            f"gateway   {gw['listen']}  {gw.get('waiting', 0)} held now, {gw.get('held', 0)} held "
            "and "
            f"{gw.get('replayed', 0)} replayed so far, {gw.get('streams_continued', 0)} streams "
            "continued; "
            f"shedding: {gw.get('shedding') or 'no'}; quarantine: {gw.get('quarantine_size', 0)}")
    building = (doc.get("next_start") or {}).get("building_first")
    if building:
        lines.append("building  " + building_line(building["step"], building["done"],
                                                  building["of"], building.get("left_s")))
    beside = (doc.get("next_start") or {}).get("building_beside")
    if beside:
        lines.append("building  " + building_beside_line(
            beside["what"], beside["profile"], beside["done"], beside["of"],
            beside.get("left_s")) + f" (for {fmt_s(beside['for_s'])})")
    lines += _processes(doc.get("processes") or [])
    failing = {name: s for name, s in (doc.get("alerts") or {}).items() if s.get("last_error")
               and s.get("last_failed_at", 0) >= s.get("last_sent_at", 0)}
    if failing:
        lines.append("alerts    failing: "
                     + "; ".join(f"{name} ({s.get('failed', 0)} failed, {s.get('dropped', 0)} "
                                 f"dropped): {s['last_error']}" for name, s in failing.items()))
    if doc.get("fatal"):
        lines.append(fatal_line(doc["fatal"], "a previous supervisor"))
    lf = doc.get("last_failure")
    if lf:
        lines.append(f"last failure  {lf['kind']}: {lf['evidence']}")
        if lf.get("incident"):
            lines.append(
                f"              incident {Path(lf['incident']).stem}  (vllm-supervisor incidents "
                f"{Path(lf['incident']).stem})")
    return "\n".join(lines)


def _processes(rows: list[dict[str, Any]]) -> list[str]:
    """One line per vLLM of ours, so that on-call can tell nvidia-smi's processes apart: ``ps -o
    sid= -p PID`` prints the session of any of them."""
    out = []
    for n, row in enumerate(rows):
        held = row.get("gpu_bytes")
        memory = f"  {held / 2**30:.1f} GiB" if held else ""
        pids = ",".join(map(str, row.get("pids", [])))
        out.append(
            f"{'processes' if n == 0 else '':<10}{row['role']:<20} session {row['session']}  pids "
            f"{pids}"
            f"{memory}{'  ' + row['url'] if row.get('url') else ''}")
    return out


def fatal_line(fatal: dict[str, Any], who: str) -> str:
    """The FATAL kept in state.json: who gave up, when, with which exit code, and why."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(fatal.get("at") or 0)))
    return (f"GAVE UP   {who} ended FATAL at {when} with exit code {fatal.get('exit_code')}: "
            f"{fatal.get('reason')} (systemd restarts it unless the code is 2, 3 or 6)")


def render_instances(rows: dict[str, Any]) -> str:
    """`status --all`: one line per instance of the host."""
    lines = [
        f"{'instance':<14}{'state':<10}{'for':>8}  {'restarts':>8}  "
        f"{'gpu':<6}{'gateway':<22}profile"
    ]
    for name, row in rows.items():
        st = row.get("status")
        if row.get("error"):
            lines.append(
                f"{name:<14}{'BAD CFG':<10}{'':>8}  {'':>8}  {'':<6}{'':<22}{row['error']}")
            continue
        if st is None:
            learned = statefile.load(row["state_dir"])
            gave_up = (fatal_line(learned.fatal, "it") if learned and learned.fatal
                       else f"nothing answers on {row['admin']}")
            lines.append(f"{name:<14}{'DOWN':<10}{'':>8}  {'':>8}  {'':<6}{'':<22}{gave_up}")
            continue
        p = st.get("profile", {})
        gw = (st.get("gateway") or {}).get("listen", "-")
        knobs = (f"chunk={p.get('max_num_batched_tokens')} seqs={p.get('max_num_seqs')} "
                 f"util={p.get('gpu_memory_utilization')}"
                 + ("  [degraded]" if st.get("degraded") else ""))
        lines.append(
            f"{name:<14}{st['state']:<10}{fmt_s(st.get('state_for_s', 0)):>8}  "
            f"{st.get('restarts', 0):>8}  "
            f"{st.get('devices', '-')!s:<6}{gw:<22}{knobs}")
    return "\n".join(lines)


def incident_paths(state_dir: str | Path) -> list[Path]:
    """Incident bundles, oldest first."""
    d = Path(state_dir) / "incidents"
    return sorted(d.glob("*.json")) if d.is_dir() else []


def load_incident(path: Path) -> dict[str, Any] | None:
    try:
        doc = read_json(path)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def render_offline(state_dir: str | Path) -> str:
    """What the state directory says when no supervisor answers."""
    lines = [f"from {state_dir}:"]
    learned = statefile.load(state_dir)
    if learned is None:
        lines.append("  state.json: none (the next start uses the configured profile)")
    else:
        if learned.fatal:
            lines.append("  " + fatal_line(learned.fatal, "the supervisor"))
        lines.append("  profile   " + _knobs(learned.profile.knobs(), None))
        lines.append(f"  restarts  {learned.restarts_total} (all time)")
        if learned.last_failure:
            lines.append(
                f"  last failure  {learned.last_failure.get('kind')}: "
                f"{learned.last_failure.get('evidence')}"
            )
    paths = incident_paths(state_dir)
    if paths:
        lines.append("  newest incident " + incident_line(paths[-1]))
    return "\n".join(lines)


def offline_doc(state_dir: str | Path) -> dict[str, Any]:
    """``render_offline`` as a document, for `status --json` when no supervisor answers."""
    learned = statefile.load(state_dir)
    paths = incident_paths(state_dir)
    return {"state_dir": str(state_dir),
            "fatal": learned.fatal if learned else None,
            "profile": learned.profile.knobs() if learned else None,
            "restarts_total": learned.restarts_total if learned else None,
            "last_failure": learned.last_failure if learned else None,
            "newest_incident": paths[-1].stem if paths else None}


def incident_line(path: Path) -> str:
    doc = load_incident(path) or {}
    f = doc.get("failure") or {}
    evidence = str(f.get("evidence", "(unreadable)"))
    return f"{path.stem}  {f.get('kind', '?'):<15} {evidence[:100]}"


def render_incident(path: Path) -> str:
    doc = load_incident(path)
    if doc is None:
        return f"{path}: not a readable incident bundle"
    f = doc.get("failure", {})
    t = doc.get("trigger", {})
    lines = [f"incident  {path.stem}  ({path})",
             f"failure   {f.get('kind')}: {f.get('evidence')}",
             f"trigger   {t.get('kind')}: {t.get('evidence')}   phase {doc.get('phase')}   "
             f"API server return code {doc.get('returncode')}",
             f"decision  {doc.get('decision')}",
             f"profile   before {doc.get('profile_before')}",
             f"          after  {doc.get('profile_after')}"]
    for r in doc.get("requests_in_batch") or []:
        lines.append(f"request   {r.get('request_id')}  prompt tokens {r.get('prompt_tokens')}  "
                     f"scheduled {r.get('scheduled_tokens')}")
    gpu = doc.get("gpu")
    for g in gpu if isinstance(gpu, list) else []:
        procs = ", ".join(f"pid {p['pid']} {p['bytes'] / GIB:.2f} GiB"
                          for p in g.get("processes", []))
        lines.append(
            f"gpu {g['index']}     {g['free'] / GIB:.2f} of {g['total'] / GIB:.2f} GiB free; "
            f"{procs or '-'}"
        )
    stop = doc.get("stop") or {}
    if stop:
        lines.append(f"stop      pids {stop.get('pids')} sigkilled {stop.get('killed')} "
                     f"survivors {stop.get('survivors')}")
    if doc.get("versions"):
        lines.append("versions  " + "  ".join(f"{k} {v}" for k, v in doc["versions"].items()))
    if doc.get("stacks"):
        lines.append(
            f"stacks    py-spy dumps of {len(doc['stacks'])} processes (--json shows them)")
    lines.append(
        f"log tail  {len(doc.get('log_tail') or [])} console lines, {len(doc.get('events') or [])} "
        "IPC events "
        "(--json shows them)")
    return "\n".join(lines)
