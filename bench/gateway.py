"""The gateway, measured side by side in one run (issue 7).

(a) cost: throughput of 64 concurrent streams and the added latency of one request at a time, through the
    gateway vs straight to the engine (the same engine, runs interleaved), on the stand-in and on real vLLM CPU.
    Goal: >= 0.98x throughput, <= 1 ms added at p50.
(b) a real OOM restart in the middle of 32 clients' traffic (real vLLM CPU): the requests clients saw fail,
    through the gateway (supervisor + gateway) vs straight to vLLM under a plain restart loop (what
    `Restart=always` gives). Goal: 0 through the gateway.
(c) a client resending a prompt that kills the engine at every rung (stand-in): engine deaths before it stops,
    through the gateway vs straight to the engine. Goal: <= 2.

    python bench/gateway.py [--vllm-python .venv-vllm/bin/python --model .cache/tiny-llama] [--standin-only]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from common import OOM_LADDER, Supervisor, cap_worker, free_port, here, pct, real_vllm_toml, status, wait_ready

GATEWAY = """
[gateway]
listen = "127.0.0.1:{gw}"
hold_timeout_s = 300.0
"""
STANDIN = """
[engine]
model = "fake-model"
port = {{port}}
command = ["{python}", "{fake}"]
env = {{{{ FAKE_VLLM_TOKEN_DELAY = "0.0005"{env} }}}}
[profile]
max_num_batched_tokens = 8192
max_num_seqs = 256
max_model_len = 32768
[restart]
backoff_initial_s = 0.05
backoff_max_s = 0.2
max_restarts = 20
[health]
hang_timeout_s = 5.0
"""


def standin_toml(env: str = "", extra: str = "") -> str:
    fake = here().parent / "tests" / "helpers" / "fake_vllm.py"
    return STANDIN.format(python=sys.executable, fake=fake, env=env) + extra


class WithGateway(Supervisor):
    def __init__(self, toml: str) -> None:
        self.gw_port = free_port()
        super().__init__(toml + GATEWAY.format(gw=self.gw_port))
        self.gateway = f"http://127.0.0.1:{self.gw_port}"

    @property
    def engine(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# ---- load ---------------------------------------------------------------------------------------------------
async def one(s: aiohttp.ClientSession, url: str, model: str, max_tokens: int, stream: bool,
              prompt: str = "hello there", timeout: float = 300.0) -> int:
    """One completion; its status (599: no answer / connection error / a stream that ended in an error event)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
    try:
        async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            data = await r.read()
            if r.status == 200 and stream and b'"error"' in data:
                return 599
            return r.status
    except (aiohttp.ClientError, OSError, TimeoutError):
        return 599


async def throughput(url: str, model: str, clients: int, seconds: float, max_tokens: int) -> tuple[float, float]:
    """``clients`` streams back to back for ``seconds``: (completed requests/s, failures)."""
    done = failed = 0
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def client() -> None:
            nonlocal done, failed
            while time.monotonic() < stop:
                if await one(s, url, model, max_tokens, True) == 200:
                    done += 1
                else:
                    failed += 1
        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(clients)))
        return done / (time.monotonic() - t0), failed


async def latencies(urls: dict[str, str], model: str, n: int) -> dict[str, list[float]]:
    """One request at a time, alternating between the targets so that drift hits both alike (ms)."""
    out: dict[str, list[float]] = {k: [] for k in urls}
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            for name, url in urls.items():
                t0 = time.perf_counter()
                code = await one(s, url, model, 1, False)
                assert code == 200, (name, code)
                out[name].append((time.perf_counter() - t0) * 1000)
    return out


async def cost(label: str, direct: str, gateway: str, model: str, clients: int, seconds: float, max_tokens: int,
               n_latency: int) -> list[str]:
    urls = {"direct": direct, "gateway": gateway}
    await latencies(urls, model, 20)  # warm both paths' connections
    rps: dict[str, list[float]] = {"direct": [], "gateway": []}
    for _ in range(2):  # interleaved: direct, gateway, direct, gateway
        for name, url in urls.items():
            r, failed = await throughput(url, model, clients, seconds, max_tokens)
            assert failed == 0, (name, failed)
            rps[name].append(r)
    lat = await latencies(urls, model, n_latency)
    d, g = sum(rps["direct"]) / 2, sum(rps["gateway"]) / 2
    p50d, p50g = pct(lat["direct"], 50), pct(lat["gateway"], 50)
    return [f"(a) {label}: {clients} concurrent streams of {max_tokens} tokens, 2 x {seconds:g} s each way",
            f"    throughput  direct {d:8.1f} req/s   gateway {g:8.1f} req/s   ratio {g / d:5.3f}x (goal >= 0.98x)",
            f"    one at a time ({n_latency} each, interleaved): p50 direct {p50d:6.2f} ms  gateway {p50g:6.2f} ms  "
            f"added {p50g - p50d:+.2f} ms (goal <= 1 ms); p99 direct {pct(lat['direct'], 99):.2f} gateway "
            f"{pct(lat['gateway'], 99):.2f} ms"]


# ---- (b) a real OOM under 32 clients --------------------------------------------------------------------------
async def one_killer(s: aiohttp.ClientSession, url: str) -> int:
    body = {"model": "tiny-llama", "prompt": "word " * 3000, "max_tokens": 2, "prompt_logprobs": 1}
    try:
        async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=600)) as r:
            await r.read()
            return r.status
    except (aiohttp.ClientError, OSError, TimeoutError):
        return 599


class PlainLoop:
    """vLLM straight on a port, restarted whenever it exits: what `Restart=always` with no supervisor gives."""

    def __init__(self, python: str, model: str) -> None:
        self.port = free_port()
        self.argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(model).resolve()),
                     "--port", str(self.port), "--served-model-name", "tiny-llama", "--kv-cache-memory-bytes",
                     "268435456", "--max-num-batched-tokens", "2048", "--max-num-seqs", "8", "--max-model-len",
                     "4096"]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = -1
        self._stop = False
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / "plain-loop.log", "wb")  # noqa: SIM115

    async def run(self) -> None:
        while not self._stop:
            self.restarts += 1
            self.proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once; the loop polls it
                self.argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
            while self.proc.poll() is None and not self._stop:
                await asyncio.sleep(0.2)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        self._stop = True
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


async def oom_under_load(python: str, model: str, clients: int) -> list[str]:
    rows = []
    # Through the gateway.
    sup = WithGateway(real_vllm_toml(model, python, OOM_LADDER))
    try:
        st = await asyncio.to_thread(wait_ready, sup.admin, 0, 900)

        def ready_again() -> bool:
            s = status(sup.admin)
            return bool(s and s["ready"] and s["restarts"] >= 1)

        got = await traffic_with_oom(sup.gateway, lambda: status(sup.admin)["engine_pid"],  # type: ignore[index]
                                     clients, ready_again, 400)
        st = status(sup.admin) or {}
        rows.append(("gateway", got, st.get("restarts"), (st.get("last_failure") or {}).get("kind"),
                     st.get("gateway", {})))
    finally:
        sup.stop()
    # Straight to vLLM under a plain restart loop.
    loop = PlainLoop(python, model)
    runner = asyncio.create_task(loop.run())
    try:
        deadline = time.monotonic() + 900
        while not await asyncio.to_thread(loop.healthy):
            assert time.monotonic() < deadline, "vLLM did not start"
            await asyncio.sleep(0.5)
        assert loop.proc is not None
        pid0 = loop.proc.pid

        def back() -> bool:
            return loop.proc is not None and loop.proc.pid != pid0 and loop.healthy()

        got = await traffic_with_oom(f"http://127.0.0.1:{loop.port}", lambda: pid0, clients, back, 400)
        rows.append(("plain restart loop", got, loop.restarts, None, {}))
    finally:
        loop.stop()
        runner.cancel()
    out = [f"(b) real vLLM CPU: {clients} clients (half streaming), a real OOM (worker capped, prompt_logprobs) "
           "5 s in; until serving again for 10 s"]
    for name, got, restarts, kind, gw in rows:
        total = got["ok"] + got["failed"]
        extra = (f"  gateway: held {gw.get('held')}, replayed {gw.get('replayed')}, streams cut short by the death "
                 f"{gw.get('streams_broken')}, 413 {gw.get('413')}, 503 {gw.get('503')}") if gw else ""
        out.append(f"    {name:<20} client-visible failures {got['failed']:5d} of {total:5d} requests "
                   f"{got['kinds']} (restarts {restarts}{', ' + kind if kind else ''}); the OOM request itself: "
                   f"{got['killer'].get('status')} after {got['killer'].get('after_s')} s{extra}")
    return out


async def traffic_with_oom(url: str, api_pid: Callable[[], int], clients: int, serving_again: Callable[[], bool],
                           max_s: float) -> dict[str, Any]:
    """``clients`` loop on ordinary requests; 5 s in, the worker is capped and a prompt_logprobs prompt sent.

    Runs until ``serving_again()`` has held for 10 s after the OOM (or ``max_s``).
    """
    ok = failed = 0
    kinds: dict[str, int] = {}
    killer: dict[str, Any] = {}
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def client(i: int) -> None:
            nonlocal ok, failed
            stream = i % 2 == 0
            while not stop.is_set():
                code = await one(s, url, "tiny-llama", 16, stream, prompt=f"hello {i}")
                if code == 200:
                    ok += 1
                else:
                    failed += 1
                    what = ("stream " if stream else "") + ("cut short" if code == 599 and stream else str(code))
                    kinds[what] = kinds.get(what, 0) + 1
                    await asyncio.sleep(0.2)  # a client's pause before it retries

        async def oom() -> None:
            await asyncio.sleep(5)
            await asyncio.to_thread(cap_worker, api_pid())
            t0 = time.monotonic()
            killer.update(status=await one_killer(s, url), after_s=round(time.monotonic() - t0, 1))

        async def watch() -> None:
            t0 = time.monotonic()
            await asyncio.sleep(8)
            since = None
            while time.monotonic() - t0 < max_s:
                if await asyncio.to_thread(serving_again):
                    since = since or time.monotonic()
                    if time.monotonic() - since >= 10 and killer:
                        break
                else:
                    since = None
                await asyncio.sleep(0.5)
            stop.set()

        tasks = [asyncio.create_task(client(i)) for i in range(clients)]
        await asyncio.gather(oom(), watch())
        await asyncio.gather(*tasks)
    return {"ok": ok, "failed": failed, "killer": killer, "kinds": kinds}


# ---- (c) a client resending a poison prompt ---------------------------------------------------------------------
async def poison_resends(resends: int) -> list[str]:
    env = ', FAKE_VLLM_OOM_TOKENS = "256"'  # dies at every rung down to the floor
    extra = '[warmup]\nenabled = false\n[ladder]\nmax_num_batched_tokens_floor = 512\n'
    out = [f"(c) stand-in: one client resends a 30,000-token prompt that kills the engine at every rung "
           f"({resends} sends, each after the engine is READY again)"]
    for name in ("direct", "gateway"):
        sup = WithGateway(standin_toml(env, extra))
        try:
            await asyncio.to_thread(wait_ready, sup.admin, 0, 60)
            url = sup.gateway if name == "gateway" else sup.engine
            codes: list[int | str] = []
            async with aiohttp.ClientSession() as s:
                for _ in range(resends):
                    st = status(sup.admin)
                    if st is None:
                        codes.append("down")  # the supervisor gave up (FATAL)
                        break
                    with contextlib.suppress(SystemExit):
                        await asyncio.to_thread(wait_ready, sup.admin, 0, 30)
                    codes.append(await one(s, url, "fake-model", 4, False, prompt="word " * 30_000, timeout=120))
            await asyncio.sleep(1)
            st = status(sup.admin) or {}
            deaths = len([line for line in (sup.dir / "sup.log").read_text().splitlines()
                          if '"event": "engine.failed"' in line])
        finally:
            sup.stop()
        out.append(f"    {name:<8} engine deaths {deaths:2d}   answers {codes}   "
                   f"{'supervisor exited (FATAL)' if sup.proc.returncode not in (0, None) else ''}")
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--model", default=".cache/tiny-llama")
    ap.add_argument("--standin-only", action="store_true")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--parts", default="abc", help="which of (a), (b), (c) to run")
    a = ap.parse_args()
    report: list[str] = []
    if "a" in a.parts:
        sup = WithGateway(standin_toml())
        try:
            await asyncio.to_thread(wait_ready, sup.admin, 0, 60)
            report += await cost("stand-in", sup.engine, sup.gateway, "fake-model", 64, a.seconds, 16, 300)
        finally:
            sup.stop()
    if not a.standin_only and "a" in a.parts:
        sup = WithGateway(real_vllm_toml(a.model, a.vllm_python))
        try:
            await asyncio.to_thread(wait_ready, sup.admin, 0, 900)
            report += await cost("real vLLM CPU, tiny model", sup.engine, sup.gateway, "tiny-llama", 64, a.seconds, 16,
                                 100)
        finally:
            sup.stop()
    if not a.standin_only and "b" in a.parts:
        report += await oom_under_load(a.vllm_python, a.model, 32)
    if "c" in a.parts:
        report += await poison_resends(6)
    print("\n".join(report))
    print(json.dumps({"argv": sys.argv[1:]}))


if __name__ == "__main__":
    asyncio.run(main())
