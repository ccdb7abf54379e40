"""The client-facing rules fire on what clients see (promtool's own rule tests; CI installs promtool: .ci/run)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = "https://github.com/vllm-supervisor/vllm-supervisor/blob/main/docs/operations.md#"
HELD_503 = ("The gateway could not hold them long enough (the engine is down past hold_timeout_s) or holds too "
            "many bodies.")


def series(outcome: str, per_minute: int) -> str:
    return (f"      - series: 'vllm_supervisor_gateway_requests_total{{instance=\"gpu-7\", job=\"vllm-supervisor\", "
            f"outcome=\"{outcome}\"}}'\n        values: '0+{per_minute}x30'\n")


def test_503s_page_and_shedding_warns_only_past_their_share(tmp_path: Path) -> None:
    promtool = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool not installed (.ci/run installs it)")
    cases = tmp_path / "rules-test.yml"
    cases.write_text(f"""rule_files: [{ROOT / "docs" / "prometheus-alerts.yml"}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
{series("forwarded", 100)}{series("503", 5)}{series("429", 20)}{series("engine_errors", 0)}
    alert_rule_test:
      - eval_time: 4m
        alertname: VllmClientsGetting503
        exp_alerts: []
      - eval_time: 12m
        alertname: VllmClientsGetting503
        exp_alerts:
          - exp_labels: {{instance: gpu-7, severity: page}}
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
