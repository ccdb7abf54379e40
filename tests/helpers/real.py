"""What the real-vLLM tier shares: vLLM's interpreter, the tiny model, and the supervisor's base config over them."""

from __future__ import annotations

import os
from typing import Any

VLLM_PYTHON = os.environ.get("VLLM_PYTHON", "")
TINY_MODEL = os.environ.get("TINY_MODEL", "")

START_S = 300  # a cold vLLM start is about a minute on 2 cores; leave room for a busy CI machine

REAL_BASE: dict[str, Any] = {
    "engine": {"model": TINY_MODEL, "command": [VLLM_PYTHON, "-m", "vllm.entrypoints.launchers.api_server.entry"],
               "env": {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"},
               # Request logging on, prefix caching off (rendered as vLLM's --no-enable-prefix-caching):
               # every request's stop strings reach vLLM's console, and must never steer a verdict.
               "args": {"kv_cache_memory_bytes": 268435456, "served_model_name": "tiny-llama",
                        "enable_log_requests": True, "enable_prefix_caching": False},
               "start_timeout_s": float(START_S), "stop_timeout_s": 15.0, "kill_timeout_s": 10.0},
    "profile": {"max_num_batched_tokens": 2048, "max_num_seqs": 8, "max_model_len": 4096},
    "ladder": {"max_num_batched_tokens": [2048, 1024, 512], "max_num_batched_tokens_floor": 256},
    # The shared engine dies seven times in this module (each test recovers it): room for all in one window.
    "restart": {"max_restarts": 10, "backoff_initial_s": 0.1, "backoff_max_s": 1.0},
    "health": {"hang_timeout_s": 10.0, "probe_interval_s": 0.5, "canary_interval_s": 2.0},
    "warmup": {"requests": 4, "concurrency": 2, "max_tokens": 8, "timeout_s": 120.0},
    "gpu": {"free_wait_s": 0.0},
    "log": {"format": "json"},
    # A throwaway engine compiling a rung beside the shared one would compete for the 2 cores mid-test:
    # bench/recovery.py measures it on real vLLM. The standby stays on: every restart below goes through it.
    "recovery": {"precompile": "off"},
}
