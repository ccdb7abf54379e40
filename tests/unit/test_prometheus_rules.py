"""The client-facing rules fire on what clients see (promtool's own rule tests; CI installs promtool: .ci/run)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = "https://github.com/vllm-supervisor/vllm-supervisor/blob/main/docs/operations.md#"
HELD_503 = ("The engine is READY, yet requests end 503: the gateway holds too many bodies (max_body_bytes_in_flight), "
            "or requests held through a restart ran out of hold_timeout_s. While the engine is down its 503s are the "
            "outage page's (VllmEngineNotReady, or the supervisor's own outage alert).")


def series(outcome: str, per_minute: int, instance: str = "gpu-7") -> str:
    return (f"      - series: 'vllm_supervisor_gateway_requests_total{{instance=\"{instance}\", "
            f"job=\"vllm-supervisor\", outcome=\"{outcome}\"}}'\n        values: '0+{per_minute}x30'\n")


def ready(instance: str, value: int) -> str:
    return (f"      - series: 'vllm_supervisor_engine_state{{instance=\"{instance}\", job=\"vllm-supervisor\", "
            f"state=\"READY\"}}'\n        values: '{value}x30'\n")


def test_503s_page_only_while_ready_and_shedding_warns_only_past_their_share(tmp_path: Path) -> None:
    promtool = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool not installed (.ci/run installs it)")
    cases = tmp_path / "rules-test.yml"
    cases.write_text(f"""rule_files: [{ROOT / "docs" / "prometheus-alerts.yml"}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
{series("forwarded", 100)}{series("503", 5)}{series("429", 20)}{series("engine_errors", 0)}{ready("gpu-7", 1)}\
{series("forwarded", 100, "gpu-8")}{series("503", 50, "gpu-8")}{ready("gpu-8", 0)}
    alert_rule_test:
      - eval_time: 4m
        alertname: VllmClientsGetting503
        exp_alerts: []
      - eval_time: 12m
        alertname: VllmClientsGetting503
        exp_alerts:
          - exp_labels: {{instance: gpu-7, severity: error}}
            exp_annotations:
              summary: "4% of requests to vLLM on gpu-7 end 503"
              description: "{HELD_503}"
              runbook_url: "{BASE}vllmclientsgetting503"
      - eval_time: 12m
        alertname: VllmShedding
        exp_alerts: []
      - eval_time: 25m
        alertname: VllmShedding
        exp_alerts:
          - exp_labels: {{instance: gpu-7, severity: warning}}
            exp_annotations:
              summary: "vLLM on gpu-7 sheds 16% of requests (429) under GPU memory pressure"
              runbook_url: "{BASE}vllmshedding"
      - eval_time: 25m
        alertname: VllmEngineErrorsToClients
        exp_alerts: []
""")
    r = subprocess.run([promtool, "test", "rules", str(cases)], capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
