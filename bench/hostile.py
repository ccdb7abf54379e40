"""Hostile clients against the public port, beside ordinary ones, across engine deaths (issues 16 and 25).

On loopback over the stand-in engine, for ``--seconds`` (default 75), under ``max_restarts = 6``:
- 32 ordinary clients send short completions (half of them streaming) the whole time;
- hostile clients (each kind from a loopback address of its own, as distinct hosts: the gateway caps the connections
  of one address): idle connections that never send a byte, connections that trickle a body a byte a second,
  clients sending 8 MiB token-id bodies, a client resending a prompt that kills the engine at every rung
  (three deaths: 8192, 6144 and the lowest rung, 2048, then it is quarantined), three prompts that make the
  engine segfault with nothing in vLLM's records naming them, each resent and then sent as variants (a junk
  field, a nudged temperature, a few words removed), two streaming clients that never read their answers,
  requests to unknown and engine-changing routes, and a local process posting vLLM's dev routes (/sleep) to
  the engine's own port.
Then a "frame" round (issue 36, ``--frame-seconds``, default 40): 16 ordinary clients send chats that share a long
system prompt and completions of the soak's prompts, while an attacker sends those very prompts with a field that
kills the engine (a stop string the stand-in's engine core segfaults on), each framed request resent until refused,
then variants of it. Printed: how many ordinary requests were refused (goal 0: the quarantine blocks the request
that kills, never its prompt for others) and how many engine deaths each attacker request cost before its 413.
Printed for the soak: what the ordinary clients lost (goal 0: every request 200, every stream ending in [DONE] with no
error event), the engine deaths and whether the supervisor gave up (goal: never), the supervisor's longest
event-loop stall during the soak (goal <= 100 ms: /status `loop`), and its RSS and open descriptors before
the hostile clients and after they left (goal: back to where they started). Never gates CI.

    python bench/hostile.py [--seconds 75] [--rounds 2] [--frame-seconds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import aiohttp
import psutil

from common import Supervisor, free_port, here, status, wait_ready

TOML = """
[engine]
model = "fake-model"
port = {{port}}
command = ["{python}", "{fake}"]
[engine.env]
FAKE_VLLM_TOKEN_DELAY = "0.002"
FAKE_VLLM_OOM_TOKENS = "1000"
FAKE_VLLM_SEGV_WORD = "ZAP"
VLLM_SERVER_DEV_MODE = "1"
[engine.args]
enable_sleep_mode = true
[profile]
max_num_batched_tokens = 8192
max_num_seqs = 64
max_model_len = 32768
[warmup]
prompt_tokens = [256, 512]
[restart]
backoff_initial_s = 0.05
backoff_max_s = 0.2
max_restarts = 6
[gateway]
listen = "127.0.0.1:{gw}"
send_timeout_s = 5.0
"""
POISON = "word " * 30_000
SEGFAULTS = [f"ZAP {name} " + " ".join(f"{name}{i}" for i in range(300)) for name in ("alpha", "beta", "gamma")]


def completion(prompt: str, stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


class Tally:
    def __init__(self) -> None:
        self.ok = 0
        self.lost: list[str] = []


async def ordinary(s: aiohttp.ClientSession, url: str, stream: bool, until: float, t: Tally) -> None:
    n = 0
    while time.monotonic() < until:
        n += 1
        try:
            async with s.post(url, json=completion(f"hello number {n} " * 8, stream)) as r:
                body = await r.text()
                if r.status != 200:
                    t.lost.append(f"{r.status} {body[:120]}")
                elif stream and ('"error"' in body or "data: [DONE]" not in body):
                    t.lost.append(f"broken stream {body[-160:]!r}")
                else:
                    t.ok += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            t.lost.append(repr(exc))


async def idle_connections(addr: tuple[str, int], count: int, until: float) -> int:
    """Open ``count`` connections that never send; reopen each as the server closes it. How many were closed."""
    closed = 0

    async def one() -> None:
        nonlocal closed
        while time.monotonic() < until:
            try:
                reader, writer = await asyncio.open_connection(*addr, local_addr=("127.0.0.2", 0))
            except OSError:
                await asyncio.sleep(0.5)
                continue
            try:
                await asyncio.wait_for(reader.read(65536), max(0.1, until - time.monotonic()))
                closed += 1
            except TimeoutError:
                pass
            finally:
                writer.close()

    await asyncio.gather(*(one() for _ in range(count)))
    return closed


async def trickle(addr: tuple[str, int], until: float) -> str:
    """A body announced at 100 kB and sent a byte a second: what the server answered."""
    reader, writer = await asyncio.open_connection(*addr, local_addr=("127.0.0.3", 0))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n{")
    answer = b""
    try:
        while time.monotonic() < until and not answer:
            writer.write(b" ")
            try:
                answer = await asyncio.wait_for(reader.read(200), 1.0)
            except TimeoutError:
                continue
            except ConnectionError:
                break
    finally:
        writer.close()
    return answer.decode(errors="replace").split("\r\n")[0]


async def big_bodies(s: aiohttp.ClientSession, url: str, until: float) -> list[int]:
    ids = json.dumps(completion(list(range(10_000_000, 10_000_000 + 900_000)), max_tokens=1)).encode()  # type: ignore[arg-type]
    codes = []
    while time.monotonic() < until:
        async with s.post(url, data=ids, headers={"Content-Type": "application/json"}) as r:
            codes.append(r.status)
            await r.read()
    return codes


async def poison(s: aiohttp.ClientSession, url: str, until: float) -> list[int]:
    codes = []
    while time.monotonic() < until:
        async with s.post(url, json=completion(POISON, max_tokens=2)) as r:
            codes.append(r.status)
            await r.read()
        await asyncio.sleep(1.0)
    return codes


async def odd_routes(s: aiohttp.ClientSession, base: str, until: float) -> set[int]:
    seen = set()
    while time.monotonic() < until:
        for method, path in (("POST", "/sleep"), ("GET", "/metrics"), ("POST", "/collective_rpc"),
                             ("GET", "/no/such/route"), ("POST", "/v1/completions")):
            data = b"{" * 50_000 if path == "/v1/completions" else b"{}"
            async with s.request(method, base + path, data=data) as r:
                seen.add(r.status)
                await r.read()
        await asyncio.sleep(0.2)
    return seen


async def segfaults(s: aiohttp.ClientSession, url: str, until: float) -> list[list[int]]:
    """Three clients, 15 s apart, each resending its segfaulting prompt until refused (at most 4 times), then
    three variants of it: their codes."""
    async def one(n: int, prompt: str) -> list[int]:
        await asyncio.sleep(15.0 * n)
        return await segfault(s, url, until, prompt)

    return list(await asyncio.gather(*(one(n, p) for n, p in enumerate(SEGFAULTS))))


async def segfault(s: aiohttp.ClientSession, url: str, until: float, prompt: str) -> list[int]:
    codes: list[int] = []
    words = prompt.split()
    variants = [{**completion(prompt), "junk": "x" * 20}, {**completion(prompt), "temperature": 0.33},
                completion(" ".join(words[:40] + words[43:]))]
    for body in [completion(prompt)] * 4 + variants:
        if time.monotonic() > until or (codes and codes[-1] == 413 and body == completion(prompt)):
            continue
        async with s.post(url, json=body) as r:
            codes.append(r.status)
            await r.read()
    return codes


async def non_readers(addr: tuple[str, int], count: int, until: float) -> int:
    """Streaming clients that never read a byte of their answers: how many the server cut."""
    import socket

    # Long enough to outgrow the socket buffers, short enough for the stand-in's one-request-at-a-time core (real
    # vLLM batches; the stand-in would otherwise stall everyone behind it and read as hung).
    body = json.dumps({**completion("stream a lot", stream=True), "max_tokens": 4_000}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    loop = asyncio.get_running_loop()
    cut = 0

    async def one() -> None:
        nonlocal cut
        while time.monotonic() < until:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.bind(("127.0.0.4", 0))
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, addr)
                await loop.sock_sendall(sock, head + body)
                await asyncio.sleep(max(0.0, min(15.0, until - time.monotonic())))  # read nothing
                sock.setblocking(True)
                sock.settimeout(0.5)
                try:  # cut by the server: what is buffered, then EOF or a reset
                    while sock.recv(1 << 20):
                        pass
                    cut += 1
                except ConnectionResetError:
                    cut += 1
                except OSError:
                    pass
            except OSError:
                await asyncio.sleep(0.5)
            finally:
                sock.close()

    await asyncio.gather(*(one() for _ in range(count)))
    return cut


async def dev_routes(engine: str, until: float) -> list[int]:
    """A local process posting vLLM's dev routes straight to the engine's port (no gateway in the way)."""
    codes = []
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < until:
            await asyncio.sleep(15.0)
            try:
                async with s.post(engine + "/sleep?level=1") as r:
                    codes.append(r.status)
            except aiohttp.ClientError:
                codes.append(0)
    return codes


def footprint(pid: int) -> tuple[float, int]:
    p = psutil.Process(pid)
    return p.memory_info().rss / 2**20, p.num_fds()


async def soak(sup: Supervisor, gw: str, admin: str, pid: int, engine_port: int, seconds: float) -> tuple[float, int]:
    addr = ("127.0.0.1", int(gw.rsplit(":", 1)[1]))
    url = gw + "/v1/completions"
    rss0, fds0 = footprint(pid)
    st0 = status(admin) or {}
    stall0 = st0.get("loop", {}).get("max_stall_s", 0.0)
    until = time.monotonic() + seconds
    tally = Tally()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        plain = [asyncio.create_task(ordinary(s, url, i % 2 == 1, until, tally)) for i in range(32)]
        idle = asyncio.create_task(idle_connections(addr, 200, until))
        slow = [asyncio.create_task(trickle(addr, until)) for _ in range(20)]
        big = [asyncio.create_task(big_bodies(s, url, until)) for _ in range(4)]
        killer = asyncio.create_task(poison(s, url, until))
        routes_task = asyncio.create_task(odd_routes(s, gw, until))
        segv = asyncio.create_task(segfaults(s, url, until))
        deaf = asyncio.create_task(non_readers(addr, 2, until))
        dev = asyncio.create_task(dev_routes(f"http://127.0.0.1:{engine_port}", until))
        await asyncio.gather(*plain)
        closed = await idle
        trickled = [await t for t in slow]
        bigs = [c for t in big for c in await t]
        poisoned = await killer
        routes = await routes_task
        segv_codes, deaf_cut, dev_codes = await segv, await deaf, await dev
    # Let the last connections close on the server's side, and the engine connections kept alive by the
    # gateway's client (aiohttp keeps an idle one 15 s) expire, before measuring what is left.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (status(admin) or {}).get("gateway", {}).get("connections", {}).get("open"):
        await asyncio.sleep(0.2)
    await asyncio.sleep(20)
    rss1, fds1 = footprint(pid)
    st = status(admin) or {}
    print(f"ordinary clients: {tally.ok} answered, {len(tally.lost)} lost {tally.lost[:3]}")
    print(f"engine deaths: {st.get('restarts')}; state {st.get('state')}, gave up: {st.get('fatal')}, supervisor exit "
          f"status {sup.proc.poll()}; poison answers: {poisoned}")
    failed = sup.events("engine.failed")
    kinds = {k: sum(1 for f in failed if f.get("kind") == k) for k in ("runtime_oom", "engine_dead", "signal", "hang")}
    proven = sum(1 for f in failed if f.get("caused_by_request"))
    print(f"segfaulting prompts (resent, then 3 variants each): {segv_codes}")
    print(f"failures so far by kind {kinds}, {proven} proven caused by one request alone (no restart budget)")
    print(f"non-reading streams cut by the server: {deaf_cut}; dev route /sleep on the engine's port: {dev_codes}")
    print(f"idle connections closed by the server: {closed}; trickled bodies answered: {sorted(set(trickled))}")
    print(f"8 MiB bodies: {len(bigs)} sent, answers {sorted(set(bigs))}; odd routes answered {sorted(routes)}")
    shown = ("413", "408", "404", "503", "quarantined", "connections")
    gw_status = st.get("gateway", {})
    print(f"gateway: {json.dumps({k: gw_status[k] for k in shown if k in gw_status})}")
    stall = st.get("loop", {}).get("max_stall_s")
    print(f"event loop: longest stall {stall} s over the soak (it was {stall0} s before it)")
    print(f"supervisor RSS {rss0:.1f} -> {rss1:.1f} MiB, open descriptors {fds0} -> {fds1}")
    pooled = sum(1 for c in psutil.Process(pid).net_connections() if c.raddr and c.raddr.port == engine_port)
    print(f"  of which {pooled} are idle keep-alive connections to the engine in the gateway's client pool "
          "(one per request that was at the engine at once; aiohttp closes them after 15 s idle)")
    return rss1, fds1


SYSTEM_PROMPT = " ".join(f"rule {i}: answer politely, briefly and cite the policy section" for i in range(30))


def shared_chat(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "max_tokens": 8, **extra,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]}


async def framed_ordinary(s: aiohttp.ClientSession, gw: str, n0: int, until: float, t: Tally) -> None:
    """An ordinary client: chats sharing the system prompt, and the soak's completions, in turn."""
    n = n0
    while time.monotonic() < until:
        n += 1
        path, body = ("/v1/chat/completions", shared_chat(f"question {n % 5}?")) if n % 2 else \
            ("/v1/completions", completion(f"hello number {n % 5} " * 8))
        try:
            async with s.post(gw + path, json=body) as r:
                text = await r.text()
                if r.status == 200:
                    t.ok += 1
                else:
                    t.lost.append(f"{path} {r.status} {text[:120]}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            t.lost.append(repr(exc))


async def attacker(s: aiohttp.ClientSession, gw: str, sup: Supervisor) -> list[tuple[str, list[int], int]]:
    """The ordinary clients' prompts with a killing stop string, each resent until refused: (what, codes, deaths)."""
    killing = {"stop": ["ZAP"]}
    attempts = [("shared system prompt + killing stop", "/v1/chat/completions", shared_chat("question 1?", **killing)),
                ("ordinary completion + killing stop", "/v1/completions", completion("hello number 2 " * 8) | killing),
                ("variant: the same, a word changed", "/v1/chat/completions", shared_chat("question 1 ?", **killing)),
                ("variant: the same, temperature nudged", "/v1/completions",
                 completion("hello number 2 " * 8) | killing | {"temperature": 0.9}),
                ("variant: another killing stop list", "/v1/chat/completions",
                 shared_chat("question 1?", stop=["ZAP", "never"]))]
    out = []
    for what, path, body in attempts:
        await asyncio.sleep(3.0)
        before, codes = len(sup.events("engine.failed")), list[int]()
        while len(codes) < 5 and (not codes or codes[-1] == 200 or codes[-1] >= 500):
            async with s.post(gw + path, json=body) as r:
                codes.append(r.status)
                await r.read()
        await asyncio.to_thread(wait_ready, sup.admin, 0, 120)  # the last death's event is logged by then
        out.append((what, codes, len(sup.events("engine.failed")) - before))
    return out


async def frame(sup: Supervisor, gw: str, seconds: float) -> None:
    tally = Tally()
    until = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        plain = [asyncio.create_task(framed_ordinary(s, gw, i, until, tally)) for i in range(16)]
        framed = await attacker(s, gw, sup)
        await asyncio.gather(*plain)
    st = status(sup.admin) or {}
    print(f"frame round: ordinary requests {tally.ok} answered, {len(tally.lost)} refused or lost {tally.lost[:3]}")
    for what, codes, deaths in framed:
        print(f"  attacker, {what}: answers {codes}, engine deaths {deaths}")
    print(f"  quarantined {st.get('gateway', {}).get('quarantined')}; state {st.get('state')}, gave up: "
          f"{st.get('fatal')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=75.0)
    ap.add_argument("--rounds", type=int, default=2, help="soaks in a row: a leak grows each round, a plateau not")
    ap.add_argument("--frame-seconds", type=float, default=40.0, help="the frame round (0: none)")
    a = ap.parse_args()
    gw_port = free_port()
    toml = TOML.format(python=sys.executable, fake=here().parent / "tests" / "helpers" / "fake_vllm.py", gw=gw_port)
    sup = Supervisor(toml)
    try:
        wait_ready(sup.admin, 0, 60)
        for n in range(a.rounds):
            print(f"--- round {n + 1} of {a.rounds}")
            asyncio.run(soak(sup, f"http://127.0.0.1:{gw_port}", sup.admin, sup.proc.pid, sup.port, a.seconds))
        if a.frame_seconds:
            print("--- frame round")
            wait_ready(sup.admin, 0, 60)
            asyncio.run(frame(sup, f"http://127.0.0.1:{gw_port}", a.frame_seconds))
    finally:
        sup.stop()


if __name__ == "__main__":
    main()
