"""Tool calling over HTTP with the official client: calls always parse and validate, stream as
OpenAI's deltas, and results flow back into the template.

Three tiny random servers, one per format: a plain ChatML template (tools described by banyan:
json_list), a Qwen-style one (Hermes template, <tool_call> as an added token: hermes), and the
same template read with --tool-call-parser llama3_json (the template only shapes the prompt).
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
LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 1000}}, "required": ["text"],
             "additionalProperties": False}
"""No call of it fits in 64 tokens (the longest token of the tiny vocabulary has 13 characters)."""
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["json_list", "hermes", "llama3_json"])
def server(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tools_{request.param}")
    write_model_dir(path, "qwen2" if request.param == "hermes" else "llama", seed=5,
                    tool_template=request.param != "json_list", max_position_embeddings=2048)
    proc = start_server(path, "--served-model-name", "tiny", "--kv-cache-memory", "128MiB", "--max-model-len", "2048",
                        "--tool-call-parser", request.param)
    proc.format = request.param
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=kw.pop("messages", ASK), tools=kw.pop("tools", TOOLS), **kw)


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
    called = [c for c in out.choices if c.finish_reason == "tool_calls"]
    assert len(called) >= 3 and all(c.finish_reason == "length" for c in out.choices if c not in called), out
    for choice in called:
        [call] = choice.message.tool_calls
        assert_valid_call(call, names=("add",))


def test_parallel_tool_calls_false_allows_one_call(client):
    out = chat(client, tool_choice="required", parallel_tool_calls=False, n=6, temperature=1.0, max_tokens=120, seed=5)
    called = [c for c in out.choices if c.finish_reason == "tool_calls"]
    assert len(called) >= 3 and all(len(c.message.tool_calls) == 1 for c in called), out


def test_auto_answers_in_text_or_in_valid_calls(server, client):
    out = chat(client, tool_choice="auto", n=8, temperature=1.0, max_tokens=40, seed=6)
    texts = [c for c in out.choices if not c.message.tool_calls]
    for choice in texts:  # text that would open a call is never content
        content = choice.message.content
        assert isinstance(content, str)
        assert not content.lstrip().startswith("{") if server.format == "llama3_json" else "<tool_call>" not in content
    called = [c for c in out.choices if c.finish_reason == "tool_calls"]
    for call in (call for choice in called for call in choice.message.tool_calls):
        assert_valid_call(call)
    assert len(texts) + len(called) >= 4, out  # the rest were cut inside a call


def test_auto_constrains_a_call_once_the_model_opens_one(server, client):
    if server.format != "hermes":
        pytest.skip("needs the marker as one token, to push the model into a call with logit_bias")
    out = chat(client, tool_choice="auto", parallel_tool_calls=False, n=4, temperature=1.0, max_tokens=120, seed=7,
               logit_bias={"384": 100})  # <tool_call>
    for choice in out.choices:
        assert choice.finish_reason in ("tool_calls", "length"), choice
        [call] = choice.message.tool_calls
    called = [c for c in out.choices if c.finish_reason == "tool_calls"]
    assert len(called) >= 2, out
    for choice in called:
        assert_valid_call(choice.message.tool_calls[0])


def test_none_leaves_the_reply_free_and_the_tools_out_of_the_prompt(client):
    free = chat(client, tool_choice="none", max_tokens=8, temperature=0)
    auto = chat(client, tool_choice="auto", max_tokens=1, temperature=0)
    assert free.choices[0].message.tool_calls is None
    assert free.usage.prompt_tokens < auto.usage.prompt_tokens


CHOICES = {"none": "none", "auto": "auto", "required": "required",
           "named": {"type": "function", "function": {"name": "get_weather"}}}


def read_stream(chunks) -> dict[int, dict]:
    """Each choice of a stream put together as a whole response's message would read, checking
    OpenAI's chunk shape on the way: at most one item per tool-call index in a chunk; the first item
    of an index brings the id, type "function" and the name, later ones only argument fragments."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            got = out.setdefault(choice.index, {"content": "", "calls": {}, "finish_reason": None})
            got["content"] += choice.delta.content or ""
            items = choice.delta.tool_calls or []
            assert len({item.index for item in items}) == len(items), items
            for item in items:
                if item.index not in got["calls"]:
                    assert item.id.startswith("call_") and item.type == "function" and item.function.name, item
                    got["calls"][item.index] = (item.function.name, "")
                else:
                    assert item.id is None and item.type is None and item.function.name is None, item
                name, arguments = got["calls"][item.index]
                got["calls"][item.index] = (name, arguments + (item.function.arguments or ""))
            got["finish_reason"] = choice.finish_reason or got["finish_reason"]
    return out


def as_streamed(choice) -> dict:
    """A whole response's choice in read_stream's terms, content aside."""
    calls = choice.message.tool_calls or []
    return {"calls": {i: (c.function.name, c.function.arguments) for i, c in enumerate(calls)},
            "finish_reason": choice.finish_reason}


@pytest.mark.parametrize("tool_choice", CHOICES)
def test_a_stream_carries_the_whole_response_in_openais_chunk_shape(client, tool_choice):
    kw = dict(tool_choice=CHOICES[tool_choice], n=4, temperature=1.0, max_tokens=100, seed=8)
    whole = chat(client, **kw)
    streamed = read_stream(chat(client, stream=True, **kw))
    assert sorted(streamed) == [c.index for c in whole.choices]
    for choice in whole.choices:
        got = streamed[choice.index]
        content = got.pop("content")  # null in the whole response when blank before calls
        assert choice.message.content == (content if content.strip() or not choice.message.tool_calls else None)
        assert got == as_streamed(choice)
    called = [c for c in whole.choices if c.finish_reason == "tool_calls"]
    if tool_choice == "none":
        assert not called
    elif tool_choice in ("required", "named"):
        assert called  # the rest were cut: "length"
    for call in (call for choice in called for call in choice.message.tool_calls):
        assert_valid_call(call)


def test_a_call_cut_by_max_tokens_ends_with_length_in_the_response_and_the_stream(client):
    kw = dict(tool_choice="required", n=2, temperature=1.0, max_tokens=64, seed=9,
              tools=[{"type": "function", "function": {"name": "echo", "parameters": LONG_TEXT}}])
    whole = chat(client, **kw)
    streamed = read_stream(chat(client, stream=True, **kw))
    for choice in whole.choices:
        assert choice.finish_reason == streamed[choice.index]["finish_reason"] == "length"
        [call] = choice.message.tool_calls  # the partial call, as the stream sent it
        assert call.function.arguments.startswith('{"text"')
        with pytest.raises(json.JSONDecodeError):
            json.loads(call.function.arguments)


def test_a_call_cut_by_a_stop_string_is_not_reported_as_called(client):
    kw = dict(tool_choice="required", n=2, temperature=1.0, max_tokens=120, seed=9, stop=["}"])
    whole = chat(client, **kw)
    streamed = read_stream(chat(client, stream=True, **kw))
    for choice in whole.choices:
        assert choice.finish_reason == streamed[choice.index]["finish_reason"] == "stop"
        [call] = choice.message.tool_calls  # its arguments end before their closing brace
        with pytest.raises(json.JSONDecodeError):
            json.loads(call.function.arguments)


def test_max_length_bounds_a_string_argument_so_the_call_completes(client):
    bounded = {**LONG_TEXT, "properties": {"text": {"type": "string", "maxLength": 5}}}
    out = chat(client, tool_choice="required", parallel_tool_calls=False, n=3, temperature=1.0, max_tokens=120,
               seed=9, tools=[{"type": "function", "function": {"name": "echo", "parameters": bounded}}])
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), bounded)


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
    assert "get_weather tool" in prompt  # the tool list, by the template or by banyan (json_list)
    opening = '<tool_call>[{"name": "get_weather"' if server.format == "json_list" else "<tool_call>\n{"
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
