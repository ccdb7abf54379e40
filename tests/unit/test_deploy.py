"""deploy/: the container's config and the Kubernetes manifests, validated by a real validator (kubernetes-validate,
Kubernetes' own OpenAPI schemas) and against what the supervisor serves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from supervisor.config_file import load, parse

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
    scraped = {ep["path"]: ep["relabelings"][0]["replacement"] for ep in monitor["spec"]["endpoints"]}
    assert {ep["port"] for ep in monitor["spec"]["endpoints"]} == {"metrics"}
    # The dashboard's vllm:* panels select job "vllm": the supervisor re-exports vLLM's series for it.
    assert scraped == {"/metrics": "vllm-supervisor", "/metrics/engine": "vllm"}
    dashboard = (ROOT / "docs" / "grafana-dashboard.json").read_text()
    assert 'vllm:num_requests_running{job=\\"vllm\\"}' in dashboard
    for kind in ("servicemonitor.yaml", "prometheusrule.yaml"):  # what kube-prometheus-stack selects by default
        assert manifest(kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert manifest("pdb.yaml")["spec"]["selector"] == manifest("statefulset.yaml")["spec"]["selector"]


def test_the_prometheus_rule_carries_the_shipped_alert_rules() -> None:
    rules = yaml.safe_load((ROOT / "docs" / "prometheus-alerts.yml").read_text())
    assert manifest("prometheusrule.yaml")["spec"]["groups"] == rules["groups"]


def test_the_image_runs_the_supervisor_on_the_default_config_path() -> None:
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "COPY deploy/config.toml /etc/vllm-supervisor/config.toml" in docker
    assert 'ENTRYPOINT ["/opt/vllm-supervisor/bin/vllm-supervisor", "run"]' in docker
    assert "FROM ${VLLM_IMAGE}" in docker and "vllm/vllm-openai" in docker


def test_the_image_lints_clean_and_runs_as_the_pods_unprivileged_user() -> None:
    """Issue 39, item 3: no docker daemon here to build it, so hadolint (every rule, warnings fail) checks it."""
    import shutil

    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    r = subprocess.run([hadolint, "--failure-threshold", "style", str(ROOT / "deploy" / "Dockerfile")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)$", docker, re.M)
    assert users and users[-1] == "1000:1000"  # the last USER is who runs the ENTRYPOINT
    pod = manifest("statefulset.yaml")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 1000
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    for name in ("HOME", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR"):
        assert f"{name}={env[name]}" in docker, name


def test_the_pod_is_never_best_effort_runs_unprivileged_and_keeps_the_compile_cache_on_the_state_volume() -> None:
    """Issue 28, item 4."""
    pod = manifest("statefulset.yaml")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    requests, limits = c["resources"]["requests"], c["resources"]["limits"]
    assert {"cpu", "memory"} <= set(requests) and limits["memory"] == requests["memory"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["fsGroup"]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    env = {e["name"]: e["value"] for e in c["env"]}
    state = load(ROOT / "deploy" / "config.toml").state.dir
    for name in ("HOME", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR"):
        assert env[name].startswith(state + "/"), name  # beside compiled.json, on the pod's own volume
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/tmp", "/dev/shm", "/models"} <= mounts  # the only writable paths besides the state volume, and weights
    head = (K8S / "statefulset.yaml").read_text().split("apiVersion")[0]
    assert "Kubernetes >= 1.30" in head and "PersistentVolumeClaim `models`" in head


def test_docker_run_in_the_deploy_readme_shares_the_host_ipc_and_outwaits_the_drain() -> None:
    readme = (ROOT / "deploy" / "README.md").read_text()
    run = readme[readme.index("docker run"):].split("\n\n")[0]
    assert "--ipc=host" in run  # vLLM's docs: PyTorch shares memory between processes through /dev/shm
    grace = int(run.split("--stop-timeout ")[1].split()[0])
    assert grace >= manifest("statefulset.yaml")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


def test_every_alert_rule_has_a_runbook_entry_and_clients_failures_have_rules() -> None:
    """Issue 28, item 7."""
    import re

    rules = yaml.safe_load((ROOT / "docs" / "prometheus-alerts.yml").read_text())["groups"][0]["rules"]
    ops = (ROOT / "docs" / "operations.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", ops, re.M)}
    for rule in rules:
        url = rule["annotations"]["runbook_url"]
        assert url.split("#")[0].endswith("docs/operations.md") and url.split("#")[1] in anchors, rule["alert"]
    outcomes = {o for rule in rules for o in re.findall(r'outcome="(\w+)"', rule["expr"])}
    assert {"503", "429", "engine_errors"} <= outcomes
    from supervisor.gateway.server import OUTCOMES

    assert outcomes <= set(OUTCOMES)  # the labels the gateway really counts
