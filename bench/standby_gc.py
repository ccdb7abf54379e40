"""Real vLLM (CPU): a start from the standby with its imported heap frozen for the garbage collector, and without.

The standby (supervisor/child/vllm_standby.py) imports vLLM, then waits for the start's argv; activated, it runs
the API server and forks the EngineCore and worker from itself. vLLM's start runs about ten full collections
(memory snapshots, profiling, graph capture), each walking every object the imports made unless the standby froze
them (``freeze_imports``). Side by side in one run, alternating: the shipped script ("frozen") and a copy with
that one call removed ("plain"). Measured: activation -> /health 200, and the API server's own collections after
activation (gc callbacks in a sitecustomize). A first start with vLLM's spawn learns the variables vLLM sets for
its engine processes, so that the standbys import under them and their EngineCore is forked, as the
supervisor's are.

  python bench/standby_gc.py [--python .venv-vllm/bin/python] [--model .cache/tiny-llama] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from common import free_port, here

SCRIPT = here().parent / "supervisor" / "child" / "vllm_standby.py"
GC_PROBE = """
import gc, os, sys, time
_t = {}
def _probe(phase, info):
    if phase == "start":
        _t["t"] = time.perf_counter()
    elif info.get("generation") == 2 and os.environ.get("VLLMSUP_ACTIVATED"):
        sys.stderr.write(f"GC-PROBE {os.getpid()} {time.perf_counter() - _t['t']:.4f}\\n")
gc.callbacks.append(_probe)
"""
SET_BY_VLLM = re.compile(r"vLLM's platform set (.+) for its engine processes")


def activate(python: str, script: Path, model: str, env: dict[str, str], log: Path,
             learn: bool = False) -> tuple[float, float]:
    """One standby: imported, then activated with the start's argv; (seconds to /health, its own gc seconds).
    ``learn``: take into ``env`` the variables vLLM set for its engine processes (a start that spawned them)."""
    port = free_port()
    ready = log.with_suffix(".ready")
    imports = dict(env, VLLMSUP_STANDBY_READY=str(ready))
    with open(log, "w") as out:
        proc = subprocess.Popen([python, str(script), "module", "vllm.entrypoints.openai.api_server"],
                                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=imports, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the standby did not import: {log}")
            time.sleep(0.2)
        argv = ["--model", model, "--port", str(port), "--max-model-len", "512", "--gpu-memory-utilization", "0.2"]
        start = dict(imports, VLLM_WORKER_MULTIPROC_METHOD="fork", VLLMSUP_ACTIVATED="1")
        t0 = time.monotonic()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"argv": argv, "env": start}) + "\n")
        proc.stdin.flush()
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the engine did not answer /health: {log}")
            time.sleep(0.1)
        took = time.monotonic() - t0
        if learn:
            learn_vllm_env(proc.pid, log, env)
    finally:
        with open(log) as f:
            own = sum(float(m.group(1)) for m in re.finditer(rf"GC-PROBE {proc.pid} ([\d.]+)", f.read()))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return took, own


def learn_vllm_env(pid: int, log: Path, env: dict[str, str]) -> None:
    """After a spawned start: the variables vLLM named on stderr, as its EngineCore had them (into ``env``)."""
    m = SET_BY_VLLM.search(log.read_text())
    if not m:
        return
    names = [n.strip() for n in m.group(1).split(",") if n.strip() != "VLLM_WORKER_MULTIPROC_METHOD"]
    for child in psutil.Process(pid).children(recursive=True):
        theirs = child.environ()
        if all(n in theirs for n in names):
            env.update({n: theirs[n] for n in names})
            return


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=".venv-vllm/bin/python")
    ap.add_argument("--model", default=".cache/tiny-llama")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="standby-gc-"))
    (work / "sitecustomize.py").write_text(GC_PROBE)
    plain = work / "vllm_standby_plain.py"
    text = SCRIPT.read_text()
    assert "\n    freeze_imports()\n" in text, "the standby no longer calls freeze_imports(): update this bench"
    plain.write_text(text.replace("\n    freeze_imports()\n", "\n", 1))
    env = dict(os.environ, PYTHONPATH=str(work), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    model = str(Path(args.model).resolve())
    took, _ = activate(args.python, SCRIPT, model, env, work / "learn.log", learn=True)
    learnt = sorted(k for k in env if k not in os.environ and k not in ("PYTHONPATH", "HF_HUB_OFFLINE",
                                                                       "VLLM_NO_USAGE_STATS"))
    if not learnt:
        raise SystemExit(f"vLLM named no variables for its engine processes: {work / 'learn.log'}")
    print(f"learning vLLM's variables (its own spawn): activation -> /health {took:.2f}s; the standbys import "
          f"under {learnt}", flush=True)
    runs: dict[str, list[tuple[float, float]]] = {"frozen": [], "plain": []}
    for n in range(args.rounds):
        for arm, script in (("frozen", SCRIPT), ("plain", plain)) if n % 2 == 0 else (("plain", plain),
                                                                                    ("frozen", SCRIPT)):
            runs[arm].append(activate(args.python, script, model, env, work / f"{arm}-{n}.log"))
            print(f"round {n + 1} {arm}: activation -> /health {runs[arm][-1][0]:.2f}s, the API server's "
                  f"collections after activation {runs[arm][-1][1]:.3f}s", flush=True)
    med = {arm: statistics.median(t for t, _ in r) for arm, r in runs.items()}
    print(f"median activation -> /health: frozen {med['frozen']:.2f}s, plain {med['plain']:.2f}s: "
          f"{med['frozen'] / med['plain']:.3f}x ({args.rounds} each, alternating)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
