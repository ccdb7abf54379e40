"""Liveness over real vLLM (CPU build): a long prompt's prefill is work, not a hang.

vLLM counts a prompt's tokens only when its prefill ends, so through a long chunked prefill both token counters
stand still; each chunk takes KV-cache blocks, which is the progress the hang rules read. A CI run of the gateway's
OOM test saw the replayed 3,000-token prompt (prompt_logprobs, chunk 256) hold a canary back for over 10 s on two
loaded cores: the supervisor called the engine hung and restarted it under the request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.helpers.processes import Launcher, Sup, http_json
from tests.helpers.real import REAL_BASE, START_S, TINY_MODEL, VLLM_PYTHON

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(not (VLLM_PYTHON and TINY_MODEL), reason="set VLLM_PYTHON and TINY_MODEL (make test-real)"),
]
HANG_S = 1.0
CHUNK = 8


@pytest.fixture(scope="module")
def sup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sup]:
    la = Launcher(tmp_path_factory.mktemp("liveness"), REAL_BASE)
    s = la.start({"profile": {"max_num_batched_tokens": CHUNK},
                  "ladder": {"max_num_batched_tokens": [CHUNK], "max_num_batched_tokens_floor": CHUNK},
                  "health": {"hang_timeout_s": HANG_S, "probe_interval_s": 0.2, "canary_interval_s": 0.3},
                  "warmup": {"requests": 1, "concurrency": 1, "max_tokens": 1},
                  "recovery": {"standby": False}})
    s.wait_ready(START_S)
    yield s
    la.cleanup()


def test_a_prefill_longer_than_hang_timeout_s_is_not_a_hang(sup: Sup) -> None:
    before = sup.status()
    assert before is not None
    t0 = time.monotonic()
    code, body = http_json(sup.engine_url + "/v1/completions",
                           {"model": "tiny-llama", "prompt": "word " * 3900, "prompt_logprobs": 1, "max_tokens": 1},
                           timeout=START_S)
    took = time.monotonic() - t0
    assert code == 200, body
    # The prefill (488 chunks of 8 tokens) outlasted the hang timeout: the test would see a hang on the old rules.
    assert took > 3 * HANG_S, took
    st = sup.status()
    assert st is not None and st["restarts"] == before["restarts"], st["last_failure"]
    assert st["ready"]
