"""/v1/responses with the official client's `client.responses.create`, streamed and not, on a tiny random Qwen3
(Qwen3's chat template, --reasoning-parser qwen3) behind two API keys.

The Responses API runs the chat path: the same prompt, tools' grammar, structured output and reasoning split as
/v1/chat/completions, answered as output items (message, function_call, reasoning) or typed events.
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
KEYS = ("key-responses-0001", "key-responses-0002")
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}}, "required": ["city"],
    "additionalProperties": False}}
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_responses")
    write_model_dir(path, "qwen3", seed=5, qwen3=True, max_position_embeddings=1024)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    proc = start_server(model_dir, "--served-model-name", "tiny", "--kv-cache-memory", "16MiB", "--max-model-len",
                        "1024", "--reasoning-parser", "qwen3", "--api-key", KEYS[0], "--api-key", KEYS[1],
                        "--responses-store-size", "8")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[0], max_retries=0)


@pytest.fixture(scope="module")
def other(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[1], max_retries=0)


def test_text_in_text_out_equals_chat_completions(client):
    response = client.responses.create(model="tiny", input="Hello there", instructions="Be brief.",
                                       max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.instructions == "Be brief." and response.max_output_tokens == 12


def test_streamed_events_come_in_order_and_add_up_to_the_response(client):
    kwargs = dict(model="tiny", input=[{"role": "user", "content": "Tell me a story."}], max_output_tokens=16,
                  temperature=0)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:5] == STREAM_ORDER
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text == events[-1].response.output_text
    assert text == client.responses.create(**kwargs).output_text  # the same reply, whole


def test_function_calls_and_their_outputs_round_trip(client):
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=60, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    follow = client.responses.create(model="tiny", previous_response_id=first.id, tools=[WEATHER], max_output_tokens=8,
                                     temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                            "output": "sunny, 21 C"}])
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens  # the call and its output are in the prompt


def test_streamed_function_call_arguments(client):
    events = list(client.responses.create(model="tiny", input="Weather in Tokyo?", tools=[WEATHER], stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=60, temperature=0))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert added and added[0].item.name == "get_weather"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == deltas
    jsonschema.validate(json.loads(deltas), WEATHER["parameters"])
    final = events[-1].response
    assert final.output[0].arguments == deltas and final.output[0].status == "completed"


def test_text_format_json_schema(client, model_dir):
    import transformers

    no_thinking = {str(transformers.AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<think>")): -100}
    response = client.responses.create(model="tiny", input="Yes or no?", max_output_tokens=20, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}},
                                       extra_body={"logit_bias": no_thinking})  # else it may think past 20 tokens
    assert [item.type for item in response.output] == ["message"]
    jsonschema.validate(json.loads(response.output_text), ANSWER)


def test_previous_response_id_continues_and_get_reads_it_back(client, server):
    first = client.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=4, temperature=0)
    second = client.responses.create(model="tiny", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    alone = client.responses.create(model="tiny", input="What is my name?", max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens > alone.usage.input_tokens
    stored = client.responses.retrieve(first.id)
    assert stored.id == first.id and stored.output_text == first.output_text


def test_store_false_keeps_nothing(client):
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="again", previous_response_id=unstored.id, max_output_tokens=2)


def test_one_api_key_never_reads_another_keys_responses(client, other):
    mine = client.responses.create(model="tiny", input="secret", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.retrieve(mine.id)
    assert e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="tiny", input="continue", previous_response_id=mine.id, max_output_tokens=2)
    assert client.responses.retrieve(mine.id).id == mine.id


def test_the_store_is_bounded(client):
    first = client.responses.create(model="tiny", input="one", max_output_tokens=1)
    for _ in range(8):  # --responses-store-size 8: the oldest goes
        client.responses.create(model="tiny", input="more", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_reasoning_comes_as_a_reasoning_item(client, model_dir):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    bias = {str(tokenizer.convert_tokens_to_ids("<think>")): 30, str(tokenizer.convert_tokens_to_ids("</think>")): 29}
    for stream in (False, True):
        raw = client.responses.create(model="tiny", input="Think first.", max_output_tokens=12, temperature=0,
                                      stream=stream, extra_body={"logit_bias": bias})
        raw_events = list(raw) if stream else []
        response = raw_events[-1].response if stream else raw
        kinds = [item.type for item in response.output]
        assert kinds[0] == "reasoning", kinds  # <think> first: the bias
        assert response.output[0].content[0].type == "reasoning_text"
        assert "<think>" not in response.output_text and response.usage.output_tokens_details.reasoning_tokens >= 0
        if stream:
            types = [e.type for e in raw_events]
            assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
            assert "response.reasoning_text.delta" in types or "response.reasoning_text.done" in types


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 123}}}}, "text.format"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),  # beyond --max-model-len 1024
    ({"input": "hi", "temperature": 3}, "temperature"),
])
def test_bad_input_is_an_openai_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.base_url}/v1/responses", json={"model": "tiny", **body},
                   headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_unknown_previous_response_id_is_404_and_the_server_stays_healthy(client, server):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope", max_output_tokens=1)
    assert httpx.get(f"{server.base_url}/health").status_code == 200
