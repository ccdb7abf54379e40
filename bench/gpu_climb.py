"""On a lent H200: issue 38, item 2: a climb back holds clients no longer than a failover with a spare.

A fresh host (empty compile cache, fresh state directory; WARM_HOST=1 keeps an earlier run's) at UTIL (default 0.5:
where a spare fits beside the engine on the H200), MODEL (default ~/glm9b, the GLM-4-9B shape) at 128k, every key
at its default, the gateway in front with its memory rules off as in the field, 16 clients through it from the first
READY on, in one device call:
  1. the first READY, then a spare asleep beside the engine;
  2. CRASH_AFTER_S (5) later the seed's crash (another process takes all but 16 MiB, the long prompt through the
     gateway): the failover, death -> READY, at the rung below (the spare woken); the other process gone, the window
     a second death would meet: that READY -> the next spare asleep (built at once, from a standby of its own);
  3. then the operator's climb back: `vllm-supervisor reset-profile` while READY. Its
     rung's spare is built beside the serving engine while it serves, and the climb wakes it: the command ->
     READY at the configured rung, the engine's own outage (READY left -> READY), how long new requests were held
     (READY left -> the hand-over to the woken spare), and what the clients waited in that outage, set beside the
     failover's death -> READY of step 2 in the same run;
  4. once the spare of the rung below sleeps beside the climbed engine, the EngineCore SIGKILLed (a death that is not
     memory's): death -> READY, and whether it woke that spare.
$OUT gets summary-climb.txt and events-climb.jsonl. Usage: `python3 bench/gpu_climb.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from common import events_in
from gpu_common import OUT, Stop, note, run_supervisor, spare_asleep, status, wait
from gpu_proof import CACHE, LOG, STATE, first_start, kill_engine_core, recovered, seed_crash
from gpu_seed import GW, Clients, at, toml, wrapped_up

UTIL = float(os.environ.get("UTIL", "0.5"))
ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    if not os.environ.get("WARM_HOST"):
        for stale in (CACHE, STATE):
            shutil.rmtree(stale, ignore_errors=True)
    cfg = Path("/tmp/sup-climb.toml")
    gateway = f'[gateway]\nlisten = "{GW}"\nmin_free_mib = 0\nforeign_growth_mib = 0\n'
    cfg.write_text(toml(STATE, CACHE, gateway, UTIL))  # every [recovery] and [ladder] key at its default
    clients, sup, hogs = Clients(), run_supervisor(cfg, LOG), []
    try:
        first_start(sup)
        clients.start()
        st = wait(spare_asleep, "a spare asleep")
        if st is None:
            raise Stop("no spare asleep beside the serving engine")
        note(f"spare asleep beside the engine: {json.dumps(st['next_start']['spare'])[:300]}")
        time.sleep(float(os.environ.get("CRASH_AFTER_S", "5")))
        hogs.append(seed_crash())
        failover = recovered(sup, 1, "the seed's crash (the failover)")
        time.sleep(2)  # the long prompt answered on the lower rung
        for hog in hogs:
            hog.kill()
            hog.wait()
        hogs = []
        note("the other process is gone")
        window_after_failover()
        climb(cfg, clients, failover)
        time.sleep(5)  # ordinary traffic on the climbed engine
        death_beside_a_spare(sup, failover)
        note(clients.finish())
    except Stop as why:
        note(f"STOPPED: {why}")
        return 1
    finally:
        wrapped_up(clients, hogs, sup, LOG, "climb",
                   ("engine.failed", "spare.asleep", "spare.woken", "spare.dropped", "engine.spawned",
                    "gateway.handed_over"))
    return 0


def window_after_failover() -> None:
    """The window a second death would find no spare asleep in: the failover's READY -> the next spare asleep (built
    at READY, from a standby of its own where one had imported), and where each spare of the run came from."""
    back = [e for e in events_in(LOG, "engine.state_changed") if e.get("to") == "READY"]
    st = wait(lambda s: (s["next_start"]["spare"] or {}).get("state") == "asleep", "the next spare asleep")
    if st is None or not back:
        note("the next spare after the failover: none asleep")
        return
    asleep = events_in(LOG, "spare.asleep")
    note(f"window after the failover: READY -> the next spare asleep {at(asleep[-1]) - at(back[-1]):.1f}s; every "
         f"spare so far (rung, spawn -> asleep s, sleep s, from a standby): "
         f"{[(e['profile']['max_num_batched_tokens'], e['took_s'], e['sleep_s'], e.get('standby')) for e in asleep]}")
    note(f"standbys spawned (role, s after the first READY): "
         f"{[(e.get('role'), round(at(e) - at(back[0]), 1)) for e in events_in(LOG, 'standby.spawned')]}")


def climb(cfg: Path, clients: Clients, failover: float) -> None:
    """The operator's reset-profile while READY: the command -> READY at the configured rung, and the outage."""
    t0, w0 = time.monotonic(), time.time()
    cmd = subprocess.run([sys.executable, "-m", "supervisor", "reset-profile", "--config", str(cfg)],
                         capture_output=True, text=True, cwd=ROOT)
    note(f"vllm-supervisor reset-profile: rc {cmd.returncode} {(cmd.stdout + cmd.stderr).strip()[:300]}")
    step = wait(lambda s: "the climb to" in ((s["next_start"]["step"] or {}).get("why") or ""), "the climb's step")
    note(f"climb: next_start.step {json.dumps(step['next_start']['step'] if step else None)[:500]}")
    note(f"the serving engine's processes (pid, session, group, parent, name): {tree()}")
    st = wait(lambda s: s["ready"] and s["profile"]["max_num_batched_tokens"] == 8192, "READY at 8192")
    if st is None:
        raise Stop("no READY at the configured rung after reset-profile")
    took = time.monotonic() - t0
    left = [e for e in events_in(LOG, "engine.state_changed") if e.get("from") == "READY" and at(e) >= w0]
    back = [e for e in events_in(LOG, "engine.state_changed") if e.get("to") == "READY" and at(e) >= w0]
    if not left or not back:
        raise Stop("the climb's state changes are not in the log")
    out_s, since = at(back[-1]) - at(left[0]), at(left[0])
    spawned = [e for e in events_in(LOG, "engine.spawned") if at(e) >= w0]
    built = [e for e in events_in(LOG, "spare.asleep") if at(e) >= w0]
    from_standby = [e.get("standby") for e in events_in(LOG, "precompile.started") if at(e) >= w0]
    note(f"climb: the command -> READY at {st['profile']} {took:.1f}s; its spare built beside the serving engine "
         f"{[(e['profile'], e['took_s']) for e in built]} (from a standby: {from_standby}); the engine's outage "
         f"(READY left -> READY) {out_s:.2f}s "
         f"(spawned {[(e.get('pid'), e.get('spare')) for e in spawned]}); the failover in this run {failover:.2f}s")
    parts = [(e.get("waited_s"), e.get("in_flight"), e.get("cut")) for e in events_in(LOG, "gateway.drained")
             if at(e) >= w0]
    stops = [(e.get("kill_s"), e.get("drain_s"), e.get("gpu_release_s"), e.get("at_once"), e.get("returncode"))
             for e in events_in(LOG, "engine.stopped") if at(e) >= w0]
    woken = [(e.get("took_s"), (e.get("canary") or {}).get("took_s"), e.get("warmup_s"), e.get("beside"),
              e.get("weights_s"))
             for e in events_in(LOG, "spare.woken") if at(e) >= w0]
    handed = [e for e in events_in(LOG, "gateway.handed_over") if at(e) >= w0]
    # item 2's measure: how long new requests were held, the engine left READY -> the hand-over (or READY)
    held_s = (at(handed[0]) if handed else at(back[-1])) - since
    note(f"climb: the drain (waited_s, in flight, cut) {parts}; the stop (kill_s, pipes_s, gpu_release_s, at "
         f"once, rc) {stops}; the wake (took_s, canary s, warm-up s, beside the draining engine, its weights "
         f"ahead s) {woken}; READY's phases {st['timings'].get('phases')}")
    note(f"clients: over the whole climb {clients.latency(w0, time.time())}; those answered within 20 s after the "
         f"engine left READY {clients.latency(since, since + 20)}")
    note(f"climb: outage {out_s:.2f}s = {out_s / failover:.2f}x the failover with a spare ({failover:.2f}s); new "
         f"requests held (READY left -> {'hand-over' if handed else 'READY'}) {held_s:.2f}s = "
         f"{held_s / failover:.2f}x the failover")


def death_beside_a_spare(sup: Any, failover: float) -> None:
    """Step 4: a death that is not memory's while the spare of the rung below sleeps beside the engine (built at the
    climb's READY): the EngineCore SIGKILLed, death -> READY, and whether the restart woke that spare
    (decide/policy.py ``into_sleeping_spare``) or started the same rung again."""
    st = wait(lambda s: (s["next_start"]["spare"] or {}).get("state") == "asleep", "the spare after the climb")
    if st is None:
        note("death beside a spare: no spare asleep after the climb; step 4 skipped")
        return
    spare, w0 = st["next_start"]["spare"], time.time()
    note(f"SIGKILL to the EngineCore, the spare at {spare['profile']} asleep beside: {kill_engine_core()}")
    took = recovered(sup, int(st["restarts"]) + 1, "the EngineCore SIGKILLed beside a sleeping spare")
    after = status() or {}
    lowered = [e.get("reason") for e in events_in(LOG, "engine.state_changed")
               if e.get("to") == "BACKOFF" and at(e) >= w0]
    note(f"death beside a spare: death -> READY {took:.3f}s = {took / failover:.2f}x the failover; "
         f"the engine is the spare: {after.get('engine_pid') == spare['pid']}; why {lowered}; spawned "
         f"{[(e.get('pid'), e.get('spare')) for e in events_in(LOG, 'engine.spawned') if at(e) >= w0]}")


def tree() -> list[tuple[int, int, int, int, str]]:
    """The serving engine's API server and every descendant, with its session and group: a descendant outside
    the leader's session is not in the session's SIGKILL."""
    st = status()
    out: list[tuple[int, int, int, int, str]] = []
    try:
        leader = psutil.Process(int(st["engine_pid"])) if st else None
        for p in ([leader, *leader.children(recursive=True)] if leader else []):
            out.append((p.pid, os.getsid(p.pid), os.getpgid(p.pid), p.ppid(), p.name()))
    except (psutil.Error, OSError, TypeError, ValueError) as exc:
        note(f"the engine's tree: {exc!r}")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
