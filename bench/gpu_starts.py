"""On a lent H200: issue 38, item 1: the starts a user waits for, against vLLM's own, with the shipped defaults.

MODEL (default ~/glm9b, ../shared/gpu/mkglm9b.py's GLM-4-9B shape) at 128k, UTIL (default 0.9, vLLM's own default),
chunk 8192, 10 sequences, every other key at its default; HOG_BEFORE (default 0): a share of the card another
process holds from before each part's first start and through it (the field report's shared card: 0.47 with
UTIL=0.4). Two parts, each one device call on the same machine:
PART=plain  vLLM alone (`python3 -m vllm.entrypoints.openai.api_server`, the supervisor's own engine arguments):
            a fresh-host cold start (an empty compile cache), then a warm-cache cold start on that cache; each
            spawn -> /health 200. Kept in /tmp/starts-plain.json for the next part. WARM_ON=/tmp/vcache-starts:
            after PART=sup, only the warm-cache cold start, on the cache the supervisor's starts used.
PART=sup    the supervisor on a fresh host of its own (another empty compile cache, a fresh state directory), the
            gateway in front with its memory rules off as in the field, 16 clients through it from the first READY:
            1. its first READY (what it compiles first is said as it goes);
            2. once the next standby has imported, a planned restart (`vllm-supervisor restart`): the command ->
               READY, what the clients waited, and the engine's spawn -> READY;
            3. a reload that changes the engine's environment (the standby waiting no longer fits): the command ->
               READY, and what the clients were held (DRAINING -> READY);
            4. SECOND_AFTER_S (10) later, the seed's crash (another process takes all but 16 MiB and stays, the
               long prompt through the gateway), with no spare (none fits beside the engine at 0.9): death -> READY
               and the restart's phases;
            5. (COMPARE=1, the default) a second reload that also turns `standby_engine_imports` off: the same kind
               of start as 3., its standby imported vLLM's API server alone; vLLM's phases after the imports side by
               side with 3.'s. COMPARE=beside: every start has VLLMSUP_COMPILED_BESIDE_WEIGHTS=1 (the default since
               run 10) but the second reload, which sets it to 0 instead (vLLM loads its compiled model after the
               weights).
            Each against PART=plain's starts in the same machine: the first READY against vLLM's fresh-host cold
            start (issue 38's bound 1.3x), the planned restart against its warm-cache cold start (1.2x), the crash
            against the same (0.15x is item 4's bound).
$OUT gets summary-<part>.txt and, for PART=sup, events-starts.jsonl. Usage: `PART=plain python3 bench/gpu_starts.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import events_in
from gpu_common import OUT, PORT, Stop, http, note, notes, plain_vllm, run_supervisor, stop_group, wait
from gpu_proof import LOG, recovered, seed_crash, start_hog_share
from gpu_seed import GW, MAX_LEN, MODEL, Clients, at, ended, ready, second_engines, toml, wrapped_up

UTIL = float(os.environ.get("UTIL", "0.9"))
HOG_BEFORE = float(os.environ.get("HOG_BEFORE", "0"))
PLAIN = Path("/tmp/starts-plain.json")
ROOT = Path(__file__).resolve().parents[1]


def plain_start(cache: Path, what: str) -> float:
    """vLLM alone, as the supervisor would start it: spawn -> /health 200, then stopped (its process group)."""
    argv, env = plain_vllm(cache, MODEL, UTIL, MAX_LEN)
    log = open(OUT / "vllm-plain.log", "ab")  # noqa: SIM115 - the child holds it
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while proc.poll() is None:
            if http(f"http://127.0.0.1:{PORT}/health", timeout=2)[0] == 200:
                took = time.monotonic() - t0
                note(f"plain vLLM, {what}: spawn -> /health 200 in {took:.1f}s")
                return took
            time.sleep(0.25)
        raise Stop(f"plain vLLM exited with {proc.returncode} during its {what}")
    finally:
        stop_group(proc)


def part_plain() -> int:
    # WARM_ON=<cache>: only the warm-cache cold start, on a cache an earlier part left (PART=sup's, after its
    # starts: the same engine arguments, so the same compiled rung; a start that fails there says the cache is
    # spoiled)
    warm_on = os.environ.get("WARM_ON")
    cache = Path(warm_on or "/tmp/vcache-plain")
    if not warm_on:
        shutil.rmtree(cache, ignore_errors=True)
    hog = start_hog_share(HOG_BEFORE)
    note(f"utilization {UTIL}, another process holding {HOG_BEFORE:.0%} of the card from before the start")
    try:
        fresh = None if warm_on else plain_start(cache, "a fresh-host cold start (empty compile cache)")
        warm = plain_start(cache, f"a warm-cache cold start{f' on {cache}' if warm_on else ''}")
    except Stop as why:
        note(f"STOPPED: {why}")
        return 1
    finally:
        ended([hog], None)
        (OUT / "summary-plain.txt").write_text("\n".join(notes) + "\n")
    PLAIN.write_text(json.dumps({"fresh_s": fresh, "warm_s": warm}))
    return 0


def part_sup() -> int:
    plain = json.loads(PLAIN.read_text()) if PLAIN.exists() else None
    note(f"plain vLLM on this machine: {plain}; utilization {UTIL}, another process holding {HOG_BEFORE:.0%}")
    cache, state, log = Path("/tmp/vcache-starts"), Path("/tmp/sup-state-starts"), LOG  # gpu_proof's helpers read it
    for stale in (cache, state):
        shutil.rmtree(stale, ignore_errors=True)
    cfg = Path("/tmp/sup-starts.toml")
    gateway = f'[gateway]\nlisten = "{GW}"\nmin_free_mib = 0\nforeign_growth_mib = 0\n'
    text = toml(state, cache, gateway, UTIL)  # spare = "auto", every order at its default
    if os.environ.get("COMPARE") == "beside":  # on for every start but reload 2's
        text = text.replace('VLLM_NO_USAGE_STATS = "1"',
                            'VLLM_NO_USAGE_STATS = "1", VLLMSUP_COMPILED_BESIDE_WEIGHTS = "1"', 1)
    cfg.write_text(text)
    hogs = [start_hog_share(HOG_BEFORE)]
    clients, sup = Clients(), run_supervisor(cfg, log)
    try:
        progress = second_engines(log, "engine.rung_precompiled", "spare.asleep")
        st = ready(sup, log, "the first READY on a fresh host", progress=progress)
        first = float(st["timings"]["start_to_ready_s"])
        since = at(events_in(log, "supervisor.started")[0])
        first_wall = at(next(e for e in events_in(log, "engine.state_changed") if e.get("to") == "READY")) - since
        note(f"first READY on a fresh host: {first_wall:.1f}s after the supervisor started (the engine's spawn -> "
             f"READY {first:.1f}s); precompile {json.dumps(st['next_start']['precompile'])[:400]}; spare "
             f"{json.dumps(st['next_start']['spare'])[:600]}")
        answers = [("first READY", greedy())]
        clients.start()
        standby = wait(lambda s: (s["next_start"]["standby"] or {}).get("imported_s") is not None, "the next standby")
        if standby is not None:
            sb = standby["next_start"]["standby"]
            note(f"the standby: imports {sb['imported_s']}s; of the engine's modules {sb.get('engine_modules')}")
        t0, w0 = time.monotonic(), time.time()
        cmd = subprocess.run([sys.executable, "-m", "supervisor", "restart", "--config", str(cfg)],
                             capture_output=True, text=True, cwd=ROOT)
        note(f"vllm-supervisor restart: rc {cmd.returncode} {(cmd.stdout + cmd.stderr).strip()[:200]}")
        again = wait(lambda s: s["ready"] and s["start"] >= 2, "READY after the planned restart")
        if again is None:
            raise Stop("no READY after the planned restart")
        planned, spawn_ready = time.monotonic() - t0, float(again["timings"]["start_to_ready_s"])
        time.sleep(2)
        note(f"planned restart: the command -> READY {planned:.1f}s (spawn -> READY {spawn_ready:.1f}s, phases "
             f"{again['timings']['phases']}); clients meanwhile: {clients.latency(w0, time.time())}; built first: "
             f"{len(events_in(log, 'precompile.started'))} second engines in all so far")
        answers.append(("planned restart", greedy()))
        reload_s, reload_outage, on = reload_env(cfg, clients, log)
        answers.append(("reload", greedy()))
        time.sleep(float(os.environ.get("SECOND_AFTER_S", "10")))
        hogs.append(seed_crash())
        crash = recovered(sup, 1, "the seed's crash, no spare")
        crash_phases = [e.get("phases") for e in events_in(log, "engine.state_changed") if e.get("to") == "READY"]
        note(f"the crash's restart phases: {crash_phases[-1]}")
        answers.append(("the crash's restart", greedy()))
        compare = os.environ.get("COMPARE", "1")
        if compare in ("1", "beside"):
            # Side by side with the reload above, the same kind of start: its standby imported vLLM's API server
            # alone, as before standby_engine_imports; or (beside) vLLM loads its compiled model after the weights,
            # as before load_compiled_beside_weights.
            what = ("reload without the engine's imports" if compare == "1" else
                    "reload with the compiled model loaded after the weights")
            off = reload_env(cfg, clients, log, start=5, engine_imports=compare != "1",
                             beside=compare != "beside", what=what)[2]
            answers.append((what, greedy()))
            note(f"{'the engine modules imported ahead' if compare == '1' else 'the compiled model beside the weights'}"
                 " (reload 1) against not (reload 2), vLLM's phases after the "
                 "imports, s: " + ", ".join(f"{k} {on.get(k)} / {off.get(k)}" for k in off if k != "gates")
                 + f"; sum {sum(v for k, v in on.items() if k != 'gates'):.2f} / "
                 f"{sum(v for k, v in off.items() if k != 'gates'):.2f}")
        time.sleep(5)
        note(clients.finish())
        note("the same greedy prompt after each start (tokens, equal to the first READY's): "
             + "; ".join(f"{what} {toks} {toks == answers[0][1]}" for what, toks in answers))
        if plain:
            fresh, warm = plain["fresh_s"], plain["warm_s"]
            first_vs = (f"{first_wall / fresh:.2f}x vLLM's fresh-host cold start ({fresh:.1f}s; bound 1.3x)"
                        if fresh else "no fresh-host start of plain vLLM in this run (WARM_ON)")
            note(f"starts: first READY {first_wall:.1f}s = {first_vs}; planned restart {planned:.1f}s = "
                 f"{planned / warm:.2f}x vLLM's warm-cache cold start ({warm:.1f}s; bound 1.2x); the seed's crash "
                 f"without a spare {crash:.1f}s = "
                 f"{crash / warm:.3f}x (item 4's bound 0.15x); a reload of the engine's environment: the command "
                 f"-> READY {reload_s:.1f}s, clients held {reload_outage:.1f}s = {reload_outage / warm:.2f}x")
    except Stop as why:
        note(f"STOPPED: {why}")
        return 1
    finally:
        for kept in Path("/tmp").glob("vllm-supervisor-*/engine-modules.txt*"):  # before the stop removes it
            shutil.copy(kept, OUT / kept.name)
        wrapped_up(clients, hogs, sup, log, "starts",
                   ("gpu.utilization_adapted", "engine.failed", "start.building_first"))
    return 0


def greedy() -> list[str] | None:
    """A fixed prompt answered greedily through the gateway (16 tokens): a start whose compiled model came another
    way must answer it as the first READY did."""
    code, doc, _ = http(f"http://{GW}/v1/completions", {"model": "m", "prompt": "The field report says the engine",
                                                        "max_tokens": 16, "temperature": 0, "logprobs": 1}, 120)
    return list(doc["choices"][0]["logprobs"]["tokens"]) if code == 200 and isinstance(doc, dict) else None


def reload_env(cfg: Path, clients: Clients, log: Path, start: int = 3, engine_imports: bool = True,
               beside: bool = True, what: str = "reload") -> tuple[float, float, dict[str, float]]:
    """A reload that changes the engine's environment (the standby waiting no longer fits): the command -> READY,
    and how long the engine was out of READY (DRAINING -> READY: what the clients were held). ``engine_imports``
    false: the reload also turns ``standby_engine_imports`` off, so its standby imports vLLM's API server alone;
    ``beside`` false: it sets VLLMSUP_COMPILED_BESIDE_WEIGHTS = "0" in the engine's environment."""
    wait(lambda s: (s["next_start"]["standby"] or {}).get("imported_s") is not None, "the next standby")
    text = cfg.read_text()
    text = text.replace('VLLM_NO_USAGE_STATS = "1"', f'VLLM_NO_USAGE_STATS = "1", BENCH_RELOADED_{start} = "1"', 1)
    if not engine_imports:
        text = text.replace("[recovery]\n", "[recovery]\nstandby_engine_imports = false\n", 1)
    if not beside:
        text = text.replace('VLLMSUP_COMPILED_BESIDE_WEIGHTS = "1"', 'VLLMSUP_COMPILED_BESIDE_WEIGHTS = "0"', 1)
    cfg.write_text(text)
    t0, w0 = time.monotonic(), time.time()
    cmd = subprocess.run([sys.executable, "-m", "supervisor", "reload", "--config", str(cfg)],
                         capture_output=True, text=True, cwd=ROOT)
    said = (cmd.stdout + cmd.stderr).strip()[:300]
    note(f"vllm-supervisor reload ([engine] env changed{'' if engine_imports else ', standby_engine_imports off'}): "
         f"rc {cmd.returncode} {said}")
    st = wait(lambda s: s["ready"] and s["start"] >= start, f"READY after the {what}")
    if st is None:
        raise Stop(f"no READY after the {what}")
    took = time.monotonic() - t0
    changes = [e for e in events_in(log, "engine.state_changed") if at(e) >= w0]
    left = next(at(e) for e in changes if e.get("to") == "DRAINING")
    back = next(at(e) for e in changes if e.get("to") == "READY")
    spawned = events_in(log, "engine.spawned")[-1]
    time.sleep(2)
    note(f"{what}: the command -> READY {took:.1f}s; out of READY {back - left:.1f}s (DRAINING after "
         f"{left - w0:.1f}s: the new standby's imports, the engine serving); from the standby "
         f"{spawned.get('standby')}; spawn -> READY {float(st['timings']['start_to_ready_s']):.2f}s; phases "
         f"{st['timings']['phases']}; clients meanwhile: {clients.latency(w0, time.time())}")
    return took, back - left, dict(st["timings"]["phases"])


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    part = os.environ.get("PART", "sup")
    if part not in ("plain", "sup"):
        raise SystemExit(f"PART must be plain or sup, not {part!r}")
    return part_plain() if part == "plain" else part_sup()


if __name__ == "__main__":
    raise SystemExit(main())
