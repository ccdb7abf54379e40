"""On a lent H200: the seed's incident with the gateway in front (issue 7).

1. the supervisor starts vLLM (0.9B random Llama, chunk 8192, gpu_memory_utilization 0.5) behind the gateway,
   with the gateway's memory-floor rules off, so that the seed's crash happens as it did in the field;
2. another process takes all but 16 MiB of the card;
3. 16 clients send ordinary requests (half streaming) through the gateway, without pause;
4. a 30,000-token prompt arrives through the gateway at chunk 8192: a real CUDA OOM; the gateway holds the
   clients' requests, replays what the engine lost, sends the long prompt alone to the stepped-down engine;
5. every answer the clients got is counted.
PART=shed instead: the gateway's memory rules on (defaults, with a 256 MiB floor); while 16 clients are served,
another process takes all but 16 MiB of what is free: the gateway sheds prompts longer than the engine has run
(a 30,000-token prompt gets 429 + Retry-After) and the ordinary requests go on; once it leaves, the same prompt
is served at chunk 8192.
PART=cost: no incident; 64 concurrent streams and one request at a time, straight to vLLM vs through the gateway
(bench/gateway.py's measure, interleaved).
Everything goes to $OUT: the supervisor's JSON events, /status snapshots, incidents, a summary.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpu_common import OUT, PORT, Stop, counted, http, note, notes, start_hog, status, supervisor_toml, wait

GW = "127.0.0.1:8000"


class Clients:
    """``n`` threads sending ordinary requests through the gateway until stopped; every answer counted."""

    def __init__(self, n: int) -> None:
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.codes: dict[int, int] = {}
        self.errors: list[str] = []
        self.latencies: list[float] = []
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(n)]

    def loop(self, i: int) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            body = {"model": "tiny", "prompt": f"hello {i} " * 20, "max_tokens": 32, "stream": i % 2 == 0}
            code, out, _ = http(f"http://{GW}/v1/completions", body)
            if code == 200 and isinstance(out, str) and '"error"' in out:
                code = 599  # a stream that ended in an error event
            with self.lock:
                self.codes[code] = self.codes.get(code, 0) + 1
                self.latencies.append(time.monotonic() - t)
                if code != 200 and len(self.errors) < 5:
                    self.errors.append(f"{code}: {str(out)[:200]}")

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            if t.ident is not None:
                t.join(450)


def config(state: Path, floor_mib: int) -> str:
    return supervisor_toml(state, 0.0, f"""
[gateway]
listen = "{GW}"
hold_timeout_s = 400.0
min_free_mib = {floor_mib}
foreign_growth_mib = {1024 if floor_mib else 0}
""")


def crash_through_the_gateway(clients: Clients) -> list[subprocess.Popen[str]]:
    """Part one: the seed's crash with the gateway in front (its memory-floor rules off)."""
    note(f"the long prompt: {counted('hello ' * 30000, 'tiny', 32768)} tokens by the engine's tokenizer")
    hogs = [start_hog()]
    clients.start()
    time.sleep(5)
    note(f"16 clients running: {clients.codes}")
    t = time.monotonic()
    code, body, _ = http(f"http://{GW}/v1/completions", {"model": "tiny", "prompt": "hello " * 30000,
                                                         "max_tokens": 4})
    usage = body.get("usage") if isinstance(body, dict) else body
    note(f"30k-token prompt through the gateway at chunk 8192 -> HTTP {code} after {time.monotonic() - t:.1f}s "
         f"({usage if code == 200 else str(body)[:300]})")
    st = wait(lambda s: s["ready"], "READY after the OOM")
    if st:
        lf = st["last_failure"] or {}
        note(f"READY: restarts {st['restarts']} profile {st['profile']} last {lf.get('kind')}: "
             f"{str(lf.get('evidence'))[:200]}")
        note(f"gateway: {st.get('gateway')}")
    return hogs


def shed_under_pressure(clients: Clients) -> list[subprocess.Popen[str]]:
    """Part two: the card runs short while serving: long prompts get 429, ordinary ones go on."""
    clients.start()
    time.sleep(5)
    note(f"16 clients running: {clients.codes}")
    hogs = [start_hog()]
    st = wait(lambda s: s["gateway"]["shedding"], "shedding")
    if st:
        note(f"shedding: {st['gateway']['shedding']}")
    code, body, headers = http(f"http://{GW}/v1/completions", {"model": "tiny", "prompt": "hello " * 30000,
                                                               "max_tokens": 4})
    note(f"30k-token prompt at chunk 8192 while the card is short -> HTTP {code}, Retry-After "
         f"{headers.get('Retry-After')}: {str(body)[:300]}")
    time.sleep(5)
    hogs.pop().kill()
    note("the other process left the card")
    st = wait(lambda s: not s["gateway"]["shedding"], "shedding over")
    t = time.monotonic()
    code, body, _ = http(f"http://{GW}/v1/completions", {"model": "tiny", "prompt": "hello " * 30000,
                                                         "max_tokens": 4})
    note(f"the same 30k prompt at chunk 8192 after the other process left -> HTTP {code} in "
         f"{time.monotonic() - t:.2f}s")
    return hogs


def cost() -> None:
    """PART=cost: 64 concurrent streams and one request at a time, straight to vLLM vs through the gateway."""
    import asyncio

    sys.path.insert(0, str(Path(__file__).parent))
    from gateway import cost as measure

    for line in asyncio.run(measure("H200, vLLM 0.26, 0.9B model", f"http://127.0.0.1:{PORT}", f"http://{GW}",
                                    "tiny", 64, 10.0, 16, 200)):
        note(line)


def main() -> int:
    part = os.environ.get("PART", "crash")
    OUT.mkdir(parents=True, exist_ok=True)
    state = Path("/tmp/sup-state-gw")
    shutil.rmtree(state, ignore_errors=True)
    cfg = Path("/tmp/sup-gw.toml")
    cfg.write_text(config(state, 0 if part == "crash" else 256))
    log = open(OUT / "supervisor.log", "w")  # noqa: SIM115
    sup = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "--config", str(cfg)],
                           stdout=log, stderr=subprocess.STDOUT)
    hogs: list[subprocess.Popen[str]] = []
    clients = Clients(16)
    try:
        st = wait(lambda s: s["ready"], "first READY")
        if not st:
            return 1
        note(f"READY: start_to_ready {st['timings']['start_to_ready_s']} s, profile {st['profile']}")
        if part == "cost":
            cost()
        else:
            hogs = crash_through_the_gateway(clients) if part == "crash" else shed_under_pressure(clients)
    except Stop as why:
        note(f"STOPPED: {why}")
        return 1
    finally:
        clients.finish()
        lat = sorted(clients.latencies)
        if lat:
            note(f"ordinary requests: {sum(clients.codes.values())} answered, by status {clients.codes}; latency "
                 f"p50 {lat[len(lat) // 2]:.2f}s max {lat[-1]:.1f}s; first errors {clients.errors}")
        st = status()
        if st:
            note(f"final gateway counters: {st.get('gateway')}")
        for hog in hogs:
            hog.kill()
            hog.wait()
        sup.send_signal(signal.SIGTERM)
        try:
            rc = sup.wait(90)
        except subprocess.TimeoutExpired:
            sup.kill()
            rc = sup.wait()
        log.close()
        note(f"supervisor exit status {rc}")
        for line in (OUT / "supervisor.log").read_text().splitlines():
            if any(f'"{e}"' in line for e in ("engine.failed", "engine.profile_lowered", "gateway.shedding",
                                              "gateway.request_quarantined", "gpu.not_enough_free")):
                note(line[:400])
        (OUT / "summary.txt").write_text("\n".join(notes) + "\n")
        incidents = sorted((state / "incidents").glob("*.json")) if (state / "incidents").exists() else []
        for p in incidents[:3]:
            shutil.copy(p, OUT / p.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
