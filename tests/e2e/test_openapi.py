"""The OpenAPI document a real server publishes, and a schema-driven fuzzer (schemathesis) against it.

/openapi.json describes each request body as the server validates it (the pydantic models of
protocol.py) and each answer, errors included; /docs is Swagger UI over it. With an API key set,
both need the key like every route but /health (and /metrics): default-deny (RELIABILITY rule 5).
"""

from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest

from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

KEY = "key-openapi-0001"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODIES = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/detokenize": "DetokenizeRequest",
}
FUZZ_EXAMPLES = int(os.environ.get("BANYAN_FUZZ_EXAMPLES", "25"))
"""Generated requests per operation and mode: 25 in CI (about 500 requests over every operation, positive and
negative); the long tier sets BANYAN_FUZZ_EXAMPLES=560 (about 10,000: docs/reliability.md)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_openapi")
    write_model_dir(path, "llama", seed=6)
    proc = start_server(path, "--served-model-name", "tiny", "--kv-cache-memory", "32MiB", "--max-model-len", "128",
                        "--api-key", KEY)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def spec(server):
    r = httpx.get(f"{server.base_url}/openapi.json", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("path", ["/openapi.json", "/docs"])
def test_the_document_and_swagger_ui_need_the_key_like_every_route(server, path):
    refused = httpx.get(f"{server.base_url}{path}")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}{path}", headers=AUTH).status_code == 200


def test_swagger_ui_reads_the_document(server):
    assert "/openapi.json" in httpx.get(f"{server.base_url}/docs", headers=AUTH).text


def test_request_bodies_are_the_validated_models(spec):
    schemas = spec["components"]["schemas"]
    for path, model in BODIES.items():
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
    tokenize = spec["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {s["$ref"].rsplit("/", 1)[1] for s in tokenize["anyOf"]} == {"TokenizeCompletionRequest", "TokenizeChatRequest"}
    completion = schemas["CompletionRequest"]
    assert "prompt" in completion["required"]
    n = completion["properties"]["n"]["anyOf"]
    assert {"type": "null"} in n and any(o.get("minimum") == 1 and o.get("maximum") == 128 for o in n)
    assert {"type": "null"} in completion["properties"]["echo"]["anyOf"]  # null: the default
    assert any(o.get("type") == "string" for o in completion["properties"]["stop"]["anyOf"])  # one stop string
    assert "fcfs" in completion["properties"]["priority"]["description"]
    assert "best_of" in completion["properties"]
    assert "minItems" in schemas["ChatCompletionRequest"]["properties"]["messages"]  # required: not nullable


def test_responses_and_errors_are_described(spec):
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            if path not in ("/health", "/metrics"):
                assert "401" in operation["responses"], (method, path)
            if method == "post":
                assert {"200", "400", "401"} <= set(operation["responses"]), (method, path)
                error = operation["responses"]["400"]["content"]["application/json"]["schema"]
                assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    streamed = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(streamed) == {"application/json", "text/event-stream"}
    assert spec["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}


def fuzz_every_operation(server, mode: str, tally: Counter) -> list[str]:
    """Failures of the schema-driven fuzzer, every operation fuzzed before any is reported; `tally` counts the
    requests sent, the answers by status class ("2xx", ...) and the answers that failed a check ("failed").

    positive: requests the document allows; each answer must be no 5xx, a documented status, and
    match the documented schema. negative: bodies the document forbids; each must be refused (4xx)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance]
    checks.append(response_schema_conformance if mode == "positive" else negative_data_rejection)
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json", headers=AUTH)
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode == "negative" and operation.method.upper() != "POST":
            continue  # nothing of a GET request is described that could be broken

        @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call(base_url=server.base_url, headers=AUTH, timeout=30)
            tally["requests"] += 1
            tally[f"{response.status_code // 100}xx"] += 1
            try:
                case.validate_response(response, checks=checks, headers=AUTH)
            except (Exception, BaseExceptionGroup):
                tally["failed"] += 1
                raise

        try:
            fuzz()
        except (Exception, BaseExceptionGroup) as e:  # schemathesis's FailureGroup is a BaseExceptionGroup
            failures.append(f"{operation.method.upper()} {operation.path}: {e}")
    return failures


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_a_schema_driven_fuzzer_finds_no_server_error_and_no_undocumented_answer(server, spec, mode):
    assert len(spec["paths"]) == 21  # every route but the document's own
    tally = Counter()
    failures = fuzz_every_operation(server, mode, tally)
    alive = server.proc.poll() is None and httpx.get(f"{server.base_url}/health").status_code == 200
    print(f"\nfuzz {mode}: {tally['requests']} requests, answers {dict(sorted(tally.items()))}, engine alive: {alive}")
    assert not failures, "\n\n".join(failures)
    assert alive and tally["5xx"] == 0
