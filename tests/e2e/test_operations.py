"""What an operator runs beside the API, against a real `banyan serve`: the dashboard and alert rules in deploy/
read only series the server exports, the audit log (one JSON line per request, no prompt text, no key), and the
admin-only profiler endpoints that write a torch trace of the engine core."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "banyan.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTS_TEST = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
USER_KEY, OTHER_KEY, ADMIN_KEY = "sk-user-7c1f0e", "sk-other-93ab22", "sk-admin-d41d8c"
SECRET = "PINEAPPLE-UMBRELLA-4417"  # prompt text that must never reach a log line
PROMETHEUS_OWN = {"up"}  # series Prometheus makes itself for every target; it adds job and instance to every series
# (position: the label of banyan:spec_decode_num_accepted_tokens_per_pos, which has no sample with speculation off)
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
            "summary": ("", "_sum", "_count"), "info": ("_info",)}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$model_name": "m"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("ops_model")
    write_model_dir(model_dir, "llama", seed=3)
    profile_dir = tmp_path_factory.mktemp("profiles")
    proc = start_server(model_dir, "--served-model-name", "tiny", "--max-model-len", "256", "--kv-cache-memory",
                        "32MiB", "--api-key", USER_KEY, "--api-key", OTHER_KEY, "--admin-api-key", ADMIN_KEY,
                        "--tokens-per-minute", "400", "--log-format", "json", "--profile-dir", str(profile_dir),
                        "--fault", "grammar-raise-after-tokens=2")  # only constrained requests fail (one test)
    proc.profile_dir = profile_dir
    yield proc
    assert proc.stop() == 0, proc.log()


def client(server, key: str = USER_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def post(server, path: str, key: str | None = None, headers: dict | None = None, **kwargs) -> httpx.Response:
    headers = {**(headers or {}), **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(f"{server.base_url}{path}", headers=headers, timeout=120, **kwargs)


def json_lines(server) -> list[dict]:
    return [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]


def audit_line(server, request_id: str, timeout: float = 15.0) -> dict:
    """The audit line of one request (written when its response ends, so it may trail the client a little)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [r for r in json_lines(server) if r["logger"] == "banyan.audit" and r.get("request_id") == request_id]
        if lines:
            assert len(lines) == 1, lines
            return lines[0]
        time.sleep(0.1)
    raise AssertionError(f"no audit line for {request_id}:\n{server.log()[-3000:]}")


# -- the audit log ------------------------------------------------------------------------------
def test_every_request_gets_one_audit_line_with_numbers_and_no_text(server):
    chat = dict(model="tiny", messages=[{"role": "user", "content": f"remember {SECRET}"}], max_tokens=4)
    whole = client(server).chat.completions.with_raw_response.create(**chat, extra_headers={"X-Request-Id": "audit-1"})
    usage = whole.parse().usage
    stream = client(server).chat.completions.create(**chat, stream=True, stream_options={"include_usage": True},
                                                    extra_headers={"X-Request-Id": "audit-2"})
    list(stream)
    refused = post(server, "/v1/chat/completions", key="sk-wrong-key", json=chat, headers={"X-Request-Id": "audit-3"})
    assert refused.status_code == 401

    line = audit_line(server, "audit-1")
    assert line["status"] == 200 and line["model"] == "tiny" and line["path"] == "/v1/chat/completions"
    assert (line["prompt_tokens"], line["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert line["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert line["finish_reasons"] and line["latency_s"] > 0
    assert line["tenant"] not in ("anonymous", USER_KEY) and USER_KEY not in json.dumps(line)
    streamed = audit_line(server, "audit-2")
    assert streamed["tenant"] == line["tenant"] and streamed["completion_tokens"] > 0
    assert audit_line(server, "audit-3")["status"] == 401

    log = server.log()
    assert SECRET not in log  # nowhere: neither the audit lines nor anything else
    assert USER_KEY not in log and "sk-wrong-key" not in log


def test_a_request_failing_in_the_engine_counts_as_an_error(server):
    """What the error-rate alert reads: a request that fails mid-stream ends finish_reason "error" in the metrics
    and in its audit line (the injected fault fails constrained requests after 2 tokens)."""
    def errors() -> float:
        text = httpx.get(f"{server.base_url}/metrics").text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "banyan:request_success_total" and s.labels["finished_reason"] == "error")

    before = errors()
    long_object = {"type": "object", "properties": {"a": {"type": "string", "minLength": 12}}, "required": ["a"]}
    stream = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "json"}], max_tokens=20, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": long_object}},
        extra_headers={"X-Request-Id": "audit-error"})
    with pytest.raises(openai.APIError):
        list(stream)
    line = audit_line(server, "audit-error")
    assert line["status"] == 200 and line["finish_reasons"] == ["error"]  # the stream had begun: 200, then an error
    assert errors() == before + 1


def test_log_lines_of_both_processes_are_json(server):
    lines = [line for line in server.log().splitlines() if line.strip()]
    assert all(line.startswith("{") for line in lines), [line for line in lines if not line.startswith("{")][:5]
    records = json_lines(server)
    assert {r["process"] for r in records} >= {"server", "engine-core"}
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    assert any(r["message"].startswith("banyan: serving tiny") for r in records)  # the start-up line too


# -- the profiler -------------------------------------------------------------------------------
def test_profile_endpoints_refuse_everyone_but_the_admin(server):
    for path in ("/start_profile", "/stop_profile"):
        assert post(server, path).status_code == 401
        assert post(server, path, key="sk-wrong-key").status_code == 401
        assert post(server, path, key=USER_KEY).status_code == 403
    assert not list(server.profile_dir.iterdir())


def test_profile_writes_a_trace_of_the_engine_core(server):
    assert post(server, "/start_profile", ADMIN_KEY).json() == {"profiling": True}
    again = post(server, "/start_profile", ADMIN_KEY)
    assert again.status_code == 409 and again.json()["error"]["code"] == "profiler_state"
    client(server).completions.create(model="tiny", prompt="profile me", max_tokens=4)
    stopped = post(server, "/stop_profile", ADMIN_KEY).json()
    trace = Path(stopped["trace"])
    assert stopped["traces"] == {"tiny": stopped["trace"]}  # one trace per model's core
    assert stopped["profiling"] is False and trace.parent == server.profile_dir and trace.name.endswith(".pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)  # the model's operators ran while it recorded
    assert post(server, "/stop_profile", ADMIN_KEY).status_code == 409


# -- the dashboard and the alert rules read only exported series ----------------------------------
def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict) and query["query"].startswith("label_values("):
            exprs.append(query["query"].removeprefix("label_values(").rsplit(",", 1)[0])  # its series selector
    return exprs


def rule_expressions() -> list[str]:
    return [rule["expr"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def selectors(expr: str):
    """(series name, label names it matches on or groups by) for every selector in a PromQL expression."""
    promql = pytest.importorskip("promql_parser")
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    found, grouping = [], set()

    def walk(node):
        if isinstance(node, promql.VectorSelector):
            found.append((node.name, {m.name for m in node.matchers.matchers}))
            return
        modifier = getattr(node, "modifier", None)
        labels = getattr(modifier, "labels", None)
        if labels:
            grouping.update(labels)
        for child in ("lhs", "rhs", "expr", "vector_selector", "param"):
            if getattr(node, child, None) is not None:
                walk(getattr(node, child))
        for arg in getattr(node, "args", None) or []:
            walk(arg)

    walk(promql.parse(expr))
    return found, grouping


def exported_series(server) -> dict[str, set[str]]:
    """Every series name /metrics exposes (a family with its type's suffixes), with the labels its samples carry."""
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            series.setdefault(family.name + suffix, set())
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def test_dashboard_and_alerts_read_only_exported_series_and_labels(server):
    client(server).completions.create(model="tiny", prompt="hello", max_tokens=2)
    big = dict(model="tiny", prompt="spend the budget", max_tokens=200)
    client(server, OTHER_KEY).completions.create(**big)
    with pytest.raises(openai.RateLimitError):  # the bucket is spent: a rejection series exists now
        client(server, OTHER_KEY).completions.create(**big)
    exported = exported_series(server)
    labels_everywhere = set().union(*exported.values())
    checked = 0
    for expr in dashboard_expressions() + rule_expressions():
        found, grouping = selectors(expr)
        for name, matched in found:
            if name in PROMETHEUS_OWN:
                continue
            assert name in exported, f"{name} (in {expr!r}) is not exported"
            checked += 1
            if not exported[name]:  # declared, no sample yet: its labels are unknown here
                assert name.startswith("banyan:spec_decode_"), f"{name} has no sample"  # speculation is off
                continue
            assert matched <= exported[name] | {"job", "instance"}, f"{name}: no label {matched - exported[name]}"
        assert grouping <= labels_everywhere | {"job", "instance", "position"}, f"{expr!r} groups by {grouping}"
    assert checked >= 30
    assert exported["banyan:request_rejections_total"] >= {"tenant", "status", "model_name"}


@pytest.mark.parametrize("command", [["check", "rules", str(ALERTS)], ["test", "rules", str(ALERTS_TEST)]],
                         ids=["check", "unit-tests"])
def test_the_alert_rules_pass_promtool(command):
    """check: the rules parse; test: on synthetic series each alert fires when it should, with its labels and
    annotations (deploy/prometheus/alerts_test.yml), and not before its `for`."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; or make ops-deps)")
    result = subprocess.run(["promtool", *command], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
