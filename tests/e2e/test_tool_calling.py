"""Tool calling over HTTP with the official client: calls always parse and validate, stream as
OpenAI's deltas, and results flow back into the template.

Two tiny random models: one with a plain ChatML template (tools described by banyan: json_list
format) and one Qwen-style (Hermes template, <tool_call> as an added token).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["json_list", "hermes"])
def server(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tools_{request.param}")
    write_model_dir(path, "qwen2" if request.param == "hermes" else "llama", seed=5,
                    tool_template=request.param == "hermes", max_position_embeddings=2048)
    proc = start_server(path, "--served-model-name", "tiny", "--kv-cache-memory", "128MiB", "--max-model-len", "2048")
    proc.format = request.param
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=kw.pop("messages", ASK), tools=TOOLS, **kw)


def assert_valid_call(call, names=tuple(SCHEMAS)):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_always_parse_and_validate(client):
    out = chat(client, tool_choice="required", n=12, temperature=1.0, max_tokens=160, seed=3)
    finished = [c for c in out.choices if c.finish_reason == "tool_calls"]  # a random model may loop on calls
    assert len(finished) >= 4, [(c.finish_reason, c.message) for c in out.choices]
    for choice in finished:
        assert choice.message.tool_calls and choice.message.content is None
        for call in choice.message.tool_calls:
            assert_valid_call(call)


def test_a_named_function_is_called_exactly_once(client):
    out = chat(client, tool_choice={"type": "function", "function": {"name": "add"}}, n=6, temperature=1.0,
               max_tokens=80, seed=4)
    for choice in out.choices:
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert_valid_call(call, names=("add",))


def test_parallel_tool_calls_false_allows_one_call(client):
    out = chat(client, tool_choice="required", parallel_tool_calls=False, n=6, temperature=1.0, max_tokens=120, seed=5)
    assert all(len(c.message.tool_calls) == 1 for c in out.choices if c.finish_reason == "tool_calls")


def test_auto_answers_in_text_or_in_valid_calls(client):
    out = chat(client, tool_choice="auto", n=8, temperature=1.0, max_tokens=40, seed=6)
    for choice in out.choices:
        if choice.message.tool_calls:
            assert choice.finish_reason in ("tool_calls", "length")
            if choice.finish_reason == "tool_calls":
                for call in choice.message.tool_calls:
                    assert_valid_call(call)
        else:
            assert isinstance(choice.message.content, str) and "<tool_call>" not in choice.message.content


def test_auto_constrains_a_call_once_the_model_opens_one(server, client):
    if server.format != "hermes":
        pytest.skip("needs the marker as one token, to push the model into a call with logit_bias")
    out = chat(client, tool_choice="auto", parallel_tool_calls=False, n=4, temperature=1.0, max_tokens=120, seed=7,
               logit_bias={"384": 100})  # <tool_call>
    for choice in out.choices:
        assert choice.finish_reason in ("tool_calls", "length"), choice
        [call] = choice.message.tool_calls
        if choice.finish_reason == "tool_calls":
            assert_valid_call(call)


def test_none_leaves_the_reply_free_and_the_tools_out_of_the_prompt(client):
    free = chat(client, tool_choice="none", max_tokens=8, temperature=0)
    auto = chat(client, tool_choice="auto", max_tokens=1, temperature=0)
    assert free.choices[0].message.tool_calls is None
    assert free.usage.prompt_tokens < auto.usage.prompt_tokens


def test_streamed_deltas_reassemble_into_the_calls(client):
    stream = chat(client, tool_choice="required", n=4, temperature=1.0, max_tokens=120, seed=8, stream=True)
    calls: dict[tuple[int, int], dict] = {}
    finish = {}
    for chunk in stream:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                key = (choice.index, piece.index)
                if key not in calls:  # the first piece of a call brings its id and name
                    assert piece.id and piece.function.name and piece.type == "function"
                    calls[key] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and not piece.function.name
                calls[key]["arguments"] += piece.function.arguments or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert len(finish) == 4 and "tool_calls" in finish.values()
    for (index, _), call in calls.items():
        if finish[index] == "tool_calls":
            assert call["name"] in SCHEMAS
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_a_tool_result_flows_back_into_the_template(server, client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny and 21 degrees"},
    ]
    out = chat(client, messages=history, max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = httpx.post(f"{server.base_url}/tokenize", json={"messages": history, "tools": TOOLS}, timeout=30)
    prompt = httpx.post(f"{server.base_url}/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()["prompt"]
    assert "Sunny and 21 degrees" in prompt and '"city": "Paris"' in prompt
    assert "get_weather tool" in prompt  # the tool list, by the template (hermes) or by banyan (json_list)
    opening = "<tool_call>\n{" if server.format == "hermes" else '<tool_call>[{"name": "get_weather"'
    assert opening in prompt


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 123}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
])
def test_bad_tools_are_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.base_url}/v1/chat/completions",
                   json={"messages": ASK, "tools": TOOLS, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
