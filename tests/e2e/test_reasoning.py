"""Reasoning models (--reasoning-parser qwen3) over HTTP with the official client, on a tiny random Qwen3 with
Qwen3's chat template and its <think> tokens: the thinking goes to message.reasoning (streamed as reasoning
deltas), the rest to content; a json_schema or the tools' grammar constrains only what follows </think>.

The random model thinks where told to: a reply whose prompt leaves <think> open (continue_final_message) is
reasoning until it samples </think>, made likely by a logit bias; a seed fixes each sample.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from banyan import LLM, SamplingParams
from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me JSON."}]
THINKING = ASK + [{"role": "assistant", "content": "<think>\n"}]  # the reply continues inside the thinking
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
SEEDS = range(5)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    write_model_dir(path, "qwen3", seed=3, qwen3=True, max_position_embeddings=1024)
    return path


@pytest.fixture(scope="module")
def server(qwen3_dir):
    proc = start_server(qwen3_dir, "--served-model-name", "tiny", "--kv-cache-memory", "16MiB",
                        "--max-model-len", "1024", "--reasoning-parser", "qwen3")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def end_id(qwen3_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(qwen3_dir).convert_tokens_to_ids("</think>")


def thinking_chat(client, end_id, seed: int, max_tokens: int = 24, **extra):
    return client.chat.completions.create(
        model="tiny", messages=THINKING, temperature=1.0, seed=seed, max_tokens=max_tokens,
        logit_bias={str(end_id): 5}, extra_body=CONTINUE | extra.pop("extra_body", {}), **extra)


def test_reasoning_is_split_from_content_whole_and_streamed_alike(client, end_id):
    both = 0
    for seed in SEEDS:
        whole = thinking_chat(client, end_id, seed).choices[0].message
        chunks = list(thinking_chat(client, end_id, seed, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        assert (reasoning or None, content) == (whole.reasoning, whole.content), seed
        assert "</think>" not in reasoning  # the first one ends it; later ones (the bias) are content
        both += bool(reasoning and content)
    assert both >= 2  # replies that thought, then answered


def test_a_reply_that_does_not_open_a_thinking_is_all_content(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=12)
    message = reply.choices[0].message
    assert message.reasoning is None and message.content


def test_json_schema_constrains_only_what_follows_the_thinking(client, end_id):
    free = 0
    for seed in SEEDS:
        response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
        choice = thinking_chat(client, end_id, seed, response_format=response_format).choices[0]
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        free += bool(choice.message.reasoning) and not choice.message.reasoning.lstrip().startswith("{")
    assert free >= 2  # thoughts no JSON grammar would allow


def test_tool_calls_follow_the_thinking(client, end_id):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    thought = 0
    for seed in SEEDS:
        choice = thinking_chat(client, end_id, seed, 60, tools=tools, tool_choice="required").choices[0]
        if choice.message.tool_calls is None:  # still thinking at max_tokens
            assert choice.finish_reason == "length" and choice.message.reasoning and not choice.message.content
            continue
        call = choice.message.tool_calls[0]  # after </think> the grammar allows only calls
        assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
        if choice.finish_reason == "tool_calls":  # else max_tokens cut the random arguments short
            jsonschema.validate(json.loads(call.function.arguments), tools[0]["function"]["parameters"])
        thought += bool(choice.message.reasoning)
    assert thought >= 2


def test_the_engine_gates_the_grammar_on_the_end_of_thinking(qwen3_dir):
    """Offline, greedy: where the prompt left the thinking open the grammar waits (free text up to max_tokens);
    where Qwen3's template closed it (enable_thinking false) the grammar applies from the first token; where the
    reply may open one, <think> is allowed first beside the grammar's tokens."""
    llm = LLM(str(qwen3_dir), num_threads=1, block_size=4, num_pages=128, reasoning_parser="qwen3")
    tokenizer = llm.get_tokenizer()
    start, end = tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>")
    greedy = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"json": SCHEMA})
    open_thinking = llm.chat(THINKING, greedy, use_tqdm=False, **CONTINUE)[0].outputs[0]
    assert open_thinking.finish_reason == "length" and not open_thinking.text.lstrip().startswith("{")
    closed = llm.chat(ASK, greedy, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0].outputs[0]
    assert closed.text.startswith("{")
    biased = greedy.clone(logit_bias={start: 30, end: 31}, max_tokens=40)
    opened = llm.chat(ASK, biased, use_tqdm=False)[0].outputs[0]
    assert opened.text.startswith("<think></think>{")
    assert opened.reasoning == "" and opened.content == opened.text.removeprefix("<think></think>")
    assert open_thinking.reasoning == open_thinking.text and open_thinking.content == ""  # LLM.chat reads it too
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.stats().num_in_use == 0
