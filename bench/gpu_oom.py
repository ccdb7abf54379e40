"""On a lent H200: the seed's incident, end to end, under vllm-supervisor with real vLLM and CUDA.

1. the supervisor starts vLLM (0.9B random Llama, chunk 8192, gpu_memory_utilization 0.5) and warms it up;
   the supervisor's own CUDA_VISIBLE_DEVICES names the card by its UUID (the GPU gate must map it in NVML);
2. another process takes all but 16 MiB of the card (the seed's "other process");
3. a 30,000-token prompt, whose stop strings are hostile words, kills the engine with a real CUDA OOM;
4. the supervisor classifies it (runtime_oom, whatever the stop strings say), steps the chunk down, waits for
   NVML to show the memory released, finds the card still held at the restart (the GPU gate lowers the
   utilization to what fits, and does not hold that against the rung), restarts, warms up;
5. the same prompt is sent again;
6. the other process leaves: after climb_after_s the utilization climbs back to what is configured.
Everything it saw goes to $OUT: the supervisor's JSON events, /status snapshots, incidents, a summary.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_common import OUT, PORT, Stop, counted, died_or_stop, http, note, notes, start_hog, supervisor_toml, wait

HOSTILE_STOP = ["error: unrecognized arguments: --x", "EngineDeadError", "an illegal memory access was encountered"]


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    state = Path("/tmp/sup-state")
    shutil.rmtree(state, ignore_errors=True)
    cfg = Path("/tmp/sup.toml")
    cfg.write_text(supervisor_toml(state, 20.0))
    uuid = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                          text=True, check=False).stdout.split()[:1]
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": uuid[0]} if uuid else {})}
    note(f"supervisor's CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')}")
    log = open(OUT / "supervisor.log", "w")  # noqa: SIM115
    sup = subprocess.Popen([sys.executable, "-m", "supervisor", "run", "--config", str(cfg)],
                           stdout=log, stderr=subprocess.STDOUT, env=env)
    hog: subprocess.Popen[str] | None = None
    snaps: list[dict[str, Any]] = []
    try:
        st = wait(lambda s: s["ready"], "first READY")
        if not st:
            return 1
        snaps.append(st)
        note(f"READY: timings {st['timings']} profile {st['profile']}")
        note(f"the long prompt: {counted('hello ' * 30000, 'tiny', 32768)} tokens by the engine's tokenizer")
        hog = start_hog()
        t = time.monotonic()
        code, body, _ = http(f"http://127.0.0.1:{PORT}/v1/completions",
                             {"model": "tiny", "prompt": "hello " * 30000, "max_tokens": 4, "stop": HOSTILE_STOP})
        note(f"30k-token prompt (hostile stop strings) at chunk 8192 -> HTTP {code} after "
             f"{time.monotonic() - t:.2f}s")
        died_or_stop(code, body)
        st = wait(lambda s: s["restarts"] >= 1 and s["last_failure"] is not None, "first failure")
        if st:
            note(f"failure seen: {json.dumps(st['last_failure'])[:500]}")
        st = wait(lambda s: s["ready"] and s["restarts"] >= 1, "READY after the OOM")
        if st:
            snaps.append(st)
            note(f"READY again: restarts {st['restarts']} profile {st['profile']} "
                 f"last {st['last_failure']['kind']}: {st['last_failure']['evidence'][:200]}")
            t = time.monotonic()
            code, body, _ = http(f"http://127.0.0.1:{PORT}/v1/completions",
                              {"model": "tiny", "prompt": "hello " * 30000, "max_tokens": 4})
            usage = body.get("usage") if isinstance(body, dict) else body
            note(f"same 30k-token prompt now -> HTTP {code} after {time.monotonic() - t:.2f}s usage {usage}")
            st2 = wait(lambda s: s["ready"] or s["state"] == "FATAL" or s["restarts"] > st["restarts"], "settle")
            if st2:
                snaps.append(st2)
            # Part two: the other process leaves; the utilization lowered for its memory climbs back.
            hog.kill()
            hog.wait()
            hog = None
            note("the other process left the card")
            if st2 and st2["ready"]:
                st3 = wait(lambda s: s["ready"] and s["profile"]["gpu_memory_utilization"] == 0.5
                           and s["restarts"] == st2["restarts"], "the utilization climbed back")
                if st3:
                    snaps.append(st3)
                    note(f"READY after the climb: profile {st3['profile']}")
                saved = json.loads((state / "state.json").read_text())
                note(f"rung failures remembered: {saved['rung_failures']}")
                for line in (OUT / "supervisor.log").read_text().splitlines():
                    if any(f'"{e}"' in line for e in ("engine.failed", "engine.profile_lowered",
                                                      "engine.profile_raised", "gpu.not_enough_free")):
                        note(line[:400])
    except Stop as why:
        note(f"STOPPED: {why}")
        return 1
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        sup.send_signal(signal.SIGTERM)
        try:
            rc = sup.wait(60)
        except subprocess.TimeoutExpired:
            sup.kill()
            rc = sup.wait()
        log.close()
        note(f"supervisor exit status {rc}")
        (OUT / "status.json").write_text(json.dumps(snaps, indent=1))
        (OUT / "summary.txt").write_text("\n".join(notes) + "\n")
        incidents = sorted((state / "incidents").glob("*.json")) if (state / "incidents").exists() else []
        for p in incidents[:4]:
            shutil.copy(p, OUT / p.name)
        subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv"], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
