"""deploy/: the container's config and the Kubernetes manifests, validated by a real validator (kubernetes-validate,
Kubernetes' own OpenAPI schemas) and against what the supervisor serves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from supervisor.config import load, parse

ROOT = Path(__file__).parents[2]
K8S = ROOT / "deploy" / "kubernetes"


def manifest(name: str) -> Any:
    return yaml.safe_load((K8S / name).read_text())


def test_the_manifests_pass_kubernetes_schema_validation() -> None:
    files = sorted(str(p) for p in K8S.glob("*.yaml"))
    r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", *files], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    passed = [line for line in r.stdout.splitlines() if " passed for resource " in line]
    assert len(passed) == 4, r.stdout  # StatefulSet, Service, PodDisruptionBudget, ConfigMap
    # The Prometheus operator's kinds have no schema there: checked below against what they refer to.


def test_the_pod_probes_and_routes_what_the_supervisor_serves_and_its_grace_covers_the_drain() -> None:
    cfg = load(ROOT / "deploy" / "config.toml")
    cm = manifest("configmap.yaml")
    assert cm["data"]["config.toml"] == (ROOT / "deploy" / "config.toml").read_text()
    assert parse(__import__("tomllib").loads(cm["data"]["config.toml"])) == cfg
    pod = manifest("statefulset.yaml")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert cfg.gateway is not None and ports["http"] == cfg.gateway.host_port[1]
    assert cfg.admin.metrics_listen.endswith(f":{ports['metrics']}")
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert cfg.state.dir in mounts  # learned profiles, compiled rungs, the quarantine and open pages survive
    pre = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    e = cfg.engine
    worst = pre + cfg.gateway.drain_timeout_s + e.stop_timeout_s + e.kill_timeout_s + cfg.gpu.release_timeout_s \
        + cfg.alerts.flush_s
    assert pod["terminationGracePeriodSeconds"] >= worst
    service = manifest("service.yaml")
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "metrics"}
    monitor = manifest("servicemonitor.yaml")
    assert [ep["port"] for ep in monitor["spec"]["endpoints"]] == ["metrics"]
    assert monitor["spec"]["endpoints"][0]["relabelings"][0]["replacement"] == "vllm-supervisor"
    assert manifest("pdb.yaml")["spec"]["selector"] == manifest("statefulset.yaml")["spec"]["selector"]


def test_the_prometheus_rule_carries_the_shipped_alert_rules() -> None:
    rules = yaml.safe_load((ROOT / "docs" / "prometheus-alerts.yml").read_text())
    assert manifest("prometheusrule.yaml")["spec"]["groups"] == rules["groups"]


def test_the_image_runs_the_supervisor_on_the_default_config_path() -> None:
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "COPY deploy/config.toml /etc/vllm-supervisor/config.toml" in docker
    assert 'ENTRYPOINT ["/opt/vllm-supervisor/bin/vllm-supervisor", "run"]' in docker
    assert "FROM ${VLLM_IMAGE}" in docker and "vllm/vllm-openai" in docker
