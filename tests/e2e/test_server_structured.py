"""RELIABILITY.md C4 (structured-output grammars) against a real server, with the official `openai` client.

Every hostile spec is a 400 `invalid_request_error` naming the request field, answered without
blocking anyone else; the grammar cache stays bounded; a grammar that cannot finish, or whose library
fails mid-generation, ends its own request only. (G6, tools, is covered with tool calling.)
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

CACHE_SIZE = 8
FAULT_AFTER_TOKENS = 40
"""The server's grammar library raises for any constrained request past this many output tokens
(--fault): every other constrained request here stays shorter."""
USER = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_structured_server")
    write_model_dir(path, "llama", seed=6)
    proc = start_server(path, "--served-model-name", "tiny", "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                        "--structured-output-cache-size", str(CACHE_SIZE),
                        "--fault", f"grammar-raise-after-tokens={FAULT_AFTER_TOKENS}")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def refused(client, param: str, **fields) -> str:
    """The message of the 400 invalid_request_error a chat request with these (extra) fields gets."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, extra_body=fields)
    error = e.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error["message"]


def json_schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def metric(server, name: str) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith(f"banyan:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_g1_an_invalid_json_schema(client):
    refused(client, "response_format", response_format=json_schema({"type": 123}))
    refused(client, "guided_json", guided_json={"type": "object", "properties": {"a": {"type": "nope"}}})


@pytest.mark.parametrize("regex", ["(", "[a-", r"(?=a)b", r"(?<!a)b", r"(a)\1"])
def test_g2_invalid_regexes_and_lookarounds_or_backreferences(client, regex):
    refused(client, "guided_regex", guided_regex=regex)
    refused(client, "structured_outputs", structured_outputs={"regex": regex})


def test_g3_catastrophic_regexes_never_block_other_requests(server, client):
    """Each bomb is refused or runs its bounded course, while a plain request goes through at once."""
    bombs = [r"(a+)+$", r"((a*)*)*b", r"(\w+\s?)*$", r"(x+x+)+y"]

    async def bomb(aclient, regex):
        try:
            out = await aclient.completions.create(model="tiny", prompt="aaaa", max_tokens=30, temperature=1.0,
                                                   extra_body={"guided_regex": regex})
            return out.choices[0].finish_reason
        except openai.BadRequestError as e:
            assert e.body["param"] == "guided_regex", e.body
            return "refused"

    async def plain(aclient):
        await asyncio.sleep(0.2)  # while the bombs compile and run
        start = time.monotonic()
        out = await aclient.completions.create(model="tiny", prompt="hello", max_tokens=4, extra_body={"ignore_eos": True})
        return out.choices[0].finish_reason, time.monotonic() - start

    async def run():
        async with async_client(server) as aclient:
            return await asyncio.gather(plain(aclient), *(bomb(aclient, b) for b in bombs))

    start = time.monotonic()
    (reason, plain_s), *outcomes = asyncio.run(run())
    assert reason == "length" and plain_s < 5.0, plain_s
    assert set(outcomes) <= {"refused", "stop", "length"}, outcomes
    assert time.monotonic() - start < 30.0
    start = time.monotonic()
    assert "100000" in refused(client, "guided_regex", guided_regex="a{1,100000}")  # refused by number, at once
    assert time.monotonic() - start < 2.0


def test_g4_deep_cyclic_and_huge_schemas(server, client):
    deep = '{"type":"object","properties":{"a":' * 10_000 + '{"type":"integer"}' + "}}" * 10_000  # json.dumps would overflow
    body = f'{{"messages":{json.dumps(USER)},"response_format":{{"type":"json_schema","json_schema":{{"name":"x","schema":{deep}}}}}}}'
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"  # too deep to parse
    refused(client, "response_format", response_format=json_schema({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}))
    cycle = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    refused(client, "response_format", response_format=json_schema(cycle))
    huge_enum = {"enum": [f"value-{i:07d}" for i in range(1 << 20 >> 4)]}  # 1 MiB of JSON
    assert len(json.dumps(huge_enum)) >= 1 << 20
    refused(client, "response_format", response_format=json_schema(huge_enum))


def test_g5_unique_schemas_keep_the_grammar_cache_bounded(server):
    async def one(aclient, i):
        schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"}}, "required": [f"field_{i}"]}
        await aclient.completions.create(model="tiny", prompt="x", max_tokens=2,
                                         extra_body={"response_format": json_schema(schema)})

    async def run():
        async with async_client(server) as aclient:
            await asyncio.gather(*(one(aclient, i) for i in range(5 * CACHE_SIZE)))

    evictions = metric(server, "grammar_cache_evictions_total")
    asyncio.run(run())
    time.sleep(0.5)  # the core's stats come a few times a second
    assert 0 < metric(server, "grammar_cache_entries") <= CACHE_SIZE
    assert metric(server, "grammar_cache_evictions_total") - evictions >= 4 * CACHE_SIZE
    assert 0 < metric(server, "grammar_cache_bytes") < 512 << 20


def test_g7_a_grammar_that_cannot_finish_within_max_tokens_ends_with_length(client):
    out = client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body={"guided_regex": "[a-z]{30}"})
    assert out.choices[0].finish_reason == "length" and len(out.choices[0].text) <= 30
    schema = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string"}, "minItems": 20}},
              "required": ["words"]}
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, response_format=json_schema(schema))
    assert out.choices[0].finish_reason == "length"


def test_g7_a_grammar_library_failing_mid_stream_ends_that_stream_only(server, client):
    """The injected fault makes the grammar library raise once a constrained request is long enough."""

    async def constrained(aclient):
        text = ""
        with pytest.raises(openai.APIError) as e:
            stream = await aclient.completions.create(model="tiny", prompt="x", max_tokens=120, stream=True,
                                                      extra_body={"guided_regex": "[a-z ]{100,110}"})
            async for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
        return text, e.value

    async def plain(aclient):
        stream = await aclient.completions.create(model="tiny", prompt="y", max_tokens=60, stream=True,
                                                  extra_body={"ignore_eos": True})
        return [c.choices[0].finish_reason async for c in stream if c.choices and c.choices[0].finish_reason]

    async def run():
        async with async_client(server) as aclient:
            return await asyncio.gather(constrained(aclient), plain(aclient))

    (text, error), plain_reasons = asyncio.run(run())
    assert "injected grammar library fault" in str(error), error
    assert len(text) >= FAULT_AFTER_TOKENS / 4, text  # it failed mid-stream
    assert plain_reasons == ["length"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # the engine lives on
    out = client.completions.create(model="tiny", prompt="x", max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text in ("yes", "no")


def test_g8_an_unknown_backend_override_is_refused(client):
    assert "backend" in refused(client, "structured_outputs", structured_outputs={"json": {"type": "object"}, "backend": "nope"})


# -- a grammar that forces the whole output ---------------------------------------------------------
FORCED = {"structured_outputs": {"choice": ["yes"]}}


def test_a_fully_forced_output_answers_with_the_forced_text(client):
    """The best case of jump-forward (no forward pass at all) answers like any other request."""
    free = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8)
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, extra_body=FORCED)
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == ("yes", "stop")
    usage = out.usage
    assert usage.prompt_tokens == free.usage.prompt_tokens and 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, extra_body=FORCED, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)  # the client raises if the stream breaks off before [DONE]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "yes"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage == usage


def test_fully_forced_completions_with_n_choices(server, client):
    out = client.completions.create(model="tiny", prompt="x", max_tokens=8, n=3, extra_body=FORCED)
    assert [(c.text, c.finish_reason) for c in out.choices] == [("yes", "stop")] * 3
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      json={"prompt": "x", "max_tokens": 8, "n": 2, "stream": True, **FORCED}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == "yesyes" and events[-1] == "data: [DONE]"
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


# -- whitespace in JSON ------------------------------------------------------------------------------
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def free_server(tmp_path_factory):
    """Free whitespace in JSON by default, and no jump-forward."""
    path = tmp_path_factory.mktemp("tiny_free_whitespace_server")
    write_model_dir(path, "llama", seed=6)
    proc = start_server(path, "--served-model-name", "tiny", "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                        "--structured-outputs-config", '{"disable_any_whitespace": false}', "--no-enable-jump-forward")
    yield proc
    assert proc.stop() == 0, proc.log()


def spaced_answers(client, **extra) -> list[bool]:
    """Four sampled answers under FLAGS: whether each has whitespace outside its strings."""
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=30, temperature=1.0, seed=3, n=4,
                                         extra_body=extra)
    texts = [c.message.content for c in out.choices]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices), out.choices
    return [any(ch.isspace() for ch in re.sub(r'"(?:[^"\\]|\\.)*"', "", text)) for text in texts]


def test_json_is_compact_unless_free_whitespace_is_asked_for(client):
    """JSON as OpenAI writes it, no whitespace between tokens: a model free to add whitespace can spend
    its whole budget on it. A request may ask for free whitespace (vLLM's disable_any_whitespace)."""
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=30, temperature=1.0, seed=3, n=4,
                                         response_format=json_schema(FLAGS))
    for choice in out.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(r'\{"ok":(true|false),"n":[0-9]\}', choice.message.content)
    assert spaced_answers(client, structured_outputs={"json": FLAGS}) == [False] * 4
    assert any(spaced_answers(client, structured_outputs={"json": FLAGS, "disable_any_whitespace": False}))


def test_the_server_default_for_whitespace_and_forced_output_without_jump_forward(free_server):
    client = openai.OpenAI(base_url=f"{free_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert any(spaced_answers(client, response_format=json_schema(FLAGS)))
    assert spaced_answers(client, structured_outputs={"json": FLAGS, "disable_any_whitespace": True}) == [False] * 4
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, extra_body=FORCED)
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == ("yes", "stop")
