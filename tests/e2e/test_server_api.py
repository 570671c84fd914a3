"""`banyan serve` as OpenAI clients see it: a real server on 127.0.0.1, the official `openai` client.

The server runs a tiny random Llama; outputs are checked against the offline engine on the same
weights (greedy), and between streaming and non-streaming (same seed).
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from banyan import LLM, SamplingParams
from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_serve")
    write_model_dir(path, "llama", seed=4)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    proc = start_server(model_dir, "--served-model-name", "tiny", "--kv-cache-memory", "64MiB", "--max-model-len", "256")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), block_size=4, num_threads=1, max_model_len=256)


def post(server, path, body=None, content=None, headers=None):
    return httpx.post(f"{server.base_url}{path}", json=body, content=content, headers=headers, timeout=60)


# -- the happy paths --------------------------------------------------------------------------
def test_models_version_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_completion_equals_the_offline_engine(client, offline):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    ref = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert out.choices[0].text == ref.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids) and out.usage.completion_tokens == 12


def test_prompt_forms(client):
    ids = [5, 6, 7, 8]
    out = client.completions.create(model="tiny", prompt=[ids, [9, 10, 11]], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    out = client.completions.create(model="tiny", prompt=["a b", "c d"], n=2, max_tokens=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]


def _streamed(chunks, route: str) -> dict[int, dict]:
    """Per choice index, what a stream's chunks say: the text joined, the logprobs' tokens and values joined, the
    finish reasons (each chunk as the openai client parsed it)."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            got = out.setdefault(c.index, {"text": "", "tokens": [], "logprobs": [], "finish_reasons": []})
            if route == "chat":
                got["text"] += c.delta.content or ""
                for p in c.logprobs.content if c.logprobs else []:
                    got["tokens"].append(p.token), got["logprobs"].append(p.logprob)
            else:
                got["text"] += c.text
                if c.logprobs:
                    got["tokens"] += c.logprobs.tokens
                    got["logprobs"] += c.logprobs.token_logprobs
            if c.finish_reason:
                got["finish_reasons"].append(c.finish_reason)
    return out


def _answered(full, route: str) -> dict[int, dict]:
    """The same fields of a non-streamed answer."""
    out = {}
    for c in full.choices:
        if route == "chat":
            text, positions = c.message.content, c.logprobs.content
            tokens, logprobs = [p.token for p in positions], [p.logprob for p in positions]
        else:
            text, tokens, logprobs = c.text, c.logprobs.tokens, c.logprobs.token_logprobs
        out[c.index] = {"text": text, "tokens": tokens, "logprobs": logprobs, "finish_reasons": [c.finish_reason]}
    return out


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_stream_means_what_the_answer_says_with_the_same_seed(client, route):
    """The streamed chunks of n=3 choices (several in one engine step, one cut by a stop string), joined per choice,
    equal the non-streamed answer: text, logprobs, finish reasons; one id, creation time and model on every chunk;
    the usage chunk equals the answer's usage."""
    if route == "chat":
        create = client.chat.completions.create
        kw = dict(messages=[{"role": "user", "content": "hello there"}], logprobs=True, top_logprobs=2)
    else:
        create = client.completions.create
        kw = dict(prompt=PROMPT, logprobs=2)
    kw |= dict(model="tiny", max_tokens=16, temperature=1.0, seed=11, n=3, extra_body={"ignore_eos": True})
    first = _answered(create(**kw), route)[0]["text"]
    kw["stop"] = [first[len(first) // 2:][:3]]  # met in the middle of choice 0, maybe in the others
    full = create(**kw)
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kw))
    answered = _answered(full, route)
    for c in answered.values():  # the same tokens; log-probabilities to float noise (a later run computes more
        c["logprobs"] = pytest.approx(c["logprobs"], abs=1e-3)  # of the prompt from the prefix cache)
    assert _streamed(chunks, route) == answered
    assert "stop" in _answered(full, route)[0]["finish_reasons"]
    assert len({(c.id, c.created, c.model, c.object) for c in chunks}) == 1 and chunks[0].model == "tiny"
    if route == "chat":
        assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3
    usage, want = chunks[-1].usage, full.usage  # (cached tokens: what the cache held then, stream or not)
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        want.prompt_tokens, want.completion_tokens, want.total_tokens)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_ends_with_done(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n_and_logprobs(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=4,
                                         temperature=1.0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for choice in out.choices:
        content = choice.logprobs.content
        assert len(content) == 4
        assert all(len(p.top_logprobs) == 2 and p.logprob <= 0 for p in content)
    comp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, logprobs=2, temperature=0,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and len(lp.top_logprobs[0]) <= 2
    assert len(lp.text_offset) == 3 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_stop_strings_and_echo(client):
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[4:7]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == base[: base.index(stop)] and out.choices[0].finish_reason == "stop"
    echo = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, echo=True, extra_body={"ignore_eos": True})
    assert echo.choices[0].text.startswith(PROMPT)


def test_cached_tokens_are_reported(client):
    long_prompt = "Radix trees share prefixes; paged attention keeps pages" * 2
    first = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=1)
    again = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_tokenize_detokenize(server):
    tokens = post(server, "/tokenize", {"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "<|im_start|>system"}]}).json()
    specials = post(server, "/tokenize", {"prompt": "<|im_start|>"}).json()["tokens"]
    # The user's text "<|im_start|>" is plain text, not the control token (no role injection).
    assert chat["tokens"].count(specials[0]) == 2  # the template's own: user turn + assistant turn


def test_metrics_names(server, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total", "request_success_total",
                 "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "num_preemptions_total"):
        assert f"banyan:{name}" in text


def test_request_id_is_echoed(server):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"


def test_64_concurrent_streams_complete_correctly(server, offline):
    prompts = [f"request number {i}" for i in range(64)]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
        text, reasons = "", []
        async for chunk in stream:
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        return text, [r for r in reasons if r]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(run())
    assert [t for t, _ in results] == [r.outputs[0].text for r in refs]
    assert all(reasons == ["length"] for _, reasons in results)


# -- structured output ------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "role": {"enum": ["admin", "user"]}},
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
USER = [{"role": "user", "content": "Who?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(client, stream):
    import jsonschema

    kw = dict(model="tiny", messages=USER, max_tokens=150, temperature=1.0, n=3, response_format=PERSON_FORMAT)
    if stream:
        texts = ["", "", ""]
        for chunk in client.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
    else:
        texts = [c.message.content for c in client.chat.completions.create(**kw).choices]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_response_format_json_object_on_completions(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=150, temperature=1.0, seed=1, n=8,
                                    extra_body={"response_format": {"type": "json_object"}})
    finished = [c.text for c in out.choices if c.finish_reason == "stop"]  # a random model may run out of tokens
    assert finished and all(isinstance(json.loads(text), dict) for text in finished), [c.text for c in out.choices]


def test_guided_choice_and_structured_outputs_extras(client):
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=10, n=4, temperature=1.0,
                                         extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.message.content in ("red", "green", "blue") for c in out.choices)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{2}-[a-c]{3}"}})
    assert re.fullmatch("[0-9]{2}-[a-c]{3}", out.choices[0].text)


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a{1,99999}"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},  # in the core
])
def test_an_invalid_schema_is_400_on_response_format(client, response_format):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, response_format=response_format)
    assert e.value.body["param"] == "response_format", e.value.body


def _removed(server):
    r = post(server, "/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


# -- fields that used to be accepted and ignored (issue 11) -------------------------------------
def _stream_usages(chunks) -> list[dict]:
    return [c.usage.model_dump() if c.usage else None for c in chunks]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_put_the_running_counts_on_every_chunk(client, route):
    kw = dict(model="tiny", max_tokens=6, n=2, temperature=1.0, seed=3, stream=True, extra_body={"ignore_eos": True},
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    if route == "chat":
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw))
    else:
        chunks = list(client.completions.create(prompt=PROMPT, **kw))
    usages = _stream_usages(chunks)
    assert None not in usages, usages
    completed = [u["completion_tokens"] for u in usages]
    assert completed == sorted(completed) and completed[-1] == 12  # running, then the total of both choices
    assert {u["prompt_tokens"] for u in usages} == {usages[-1]["prompt_tokens"]}
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert chunks[-1].choices == []  # include_usage's last chunk still comes


def test_continuous_usage_stats_alone_implies_the_last_usage_chunk(client):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, stream=True,
                                            stream_options={"continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    assert all(c.usage is not None for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_without_continuous_usage_stats_only_the_last_chunk_has_usage(client):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert [u is not None for u in _stream_usages(chunks)] == [False] * (len(chunks) - 1) + [True]


def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=21, extra_body={"ignore_eos": True})
    candidates = client.completions.create(n=4, logprobs=0, **kw)  # the same four: seeds 21, 22, 23, 24
    ranked = sorted(candidates.choices, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert best.choices[0].logprobs is None  # not asked for
    assert best.usage.completion_tokens == 4 * 5  # every generated token counts


def test_best_of_cannot_stream(server):
    body = {"model": "tiny", "prompt": PROMPT, "n": 1, "best_of": 2, "stream": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


def test_min_tokens_over_the_default_max_tokens_is_400_naming_min_tokens(server):
    """Completions default to 16 tokens (OpenAI's default): a larger min_tokens alone is the client's error, answered
    in OpenAI's format (a schema fuzzer once got a 500 here: the typed error escaped the endpoint)."""
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "min_tokens": 6001})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_priority_is_accepted_and_documented_under_fcfs(server, client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"priority": -5})
    assert out.choices[0].text is not None
    spec = httpx.get(f"{server.base_url}/openapi.json").json()
    priority = spec["components"]["schemas"]["CompletionRequest"]["properties"]["priority"]
    assert "fcfs" in priority["description"]


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"model": "gpt-17", "prompt": "hi"}),
    ("/tokenize", {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}),
    ("/detokenize", {"model": "gpt-17", "tokens": [5]}),
])
def test_tokenize_checks_the_model(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert post(server, path, {**body, "model": "tiny"}).status_code == 200


CHAT_TEMPLATE_B = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}" \
                  "{% if add_generation_prompt %}[assistant] {% endif %}"


@pytest.fixture(scope="module")
def tokenizer_dir(model_dir, tmp_path_factory):
    """The model's vocabulary with another chat template, and a BOS its post-processor adds."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tokenizer_b")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    tok.chat_template = CHAT_TEMPLATE_B
    tok.save_pretrained(path)
    return path


def test_the_tokenizer_flag_loads_tokenizer_and_chat_template_from_its_path(model_dir, tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    chat = [{"role": "user", "content": "hi"}]
    rendered = tok.encode("[user] hi\n[assistant] ", add_special_tokens=False)
    proc = start_server(model_dir, "--served-model-name", "tiny", "--kv-cache-memory", "16MiB", "--max-model-len", "64",
                        "--tokenizer", str(tokenizer_dir))
    try:
        assert post(proc, "/tokenize", {"prompt": "hi"}).json()["tokens"] == [bos, *tok.encode("hi", add_special_tokens=False)]
        assert post(proc, "/tokenize", {"messages": chat}).json()["tokens"] == rendered  # template B, no BOS by default
        with_specials = post(proc, "/tokenize", {"messages": chat, "add_special_tokens": True}).json()["tokens"]
        assert with_specials == [bos, *rendered]
        without = post(proc, "/tokenize", {"prompt": "hi", "add_special_tokens": False}).json()["tokens"]
        assert without == tok.encode("hi", add_special_tokens=False)
        c = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0)
        assert c.chat.completions.create(model="tiny", messages=chat, max_tokens=2).usage.prompt_tokens == len(rendered)
    finally:
        assert proc.stop() == 0, proc.log()


def test_the_offline_tokenizer_argument_loads_from_its_path(model_dir, tokenizer_dir):
    llm = LLM(str(model_dir), tokenizer=str(tokenizer_dir), block_size=4, num_threads=1, max_model_len=64,
              kv_cache_memory=16 << 20)
    assert llm.get_tokenizer().chat_template == CHAT_TEMPLATE_B
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt.startswith("[user] hi")


@pytest.mark.default_model
def test_the_tokenizer_argument_replaces_a_gguf_models_own(tokenizer_dir):
    from banyan.runner.weights import open_model

    source = open_model("smollm2-135m-instruct", tokenizer=str(tokenizer_dir))
    assert source.tokenizer.chat_template == CHAT_TEMPLATE_B and source.path.suffix == ".gguf"


def test_best_of_offline_keeps_the_most_likely_sequences(offline):
    kw = dict(temperature=1.0, seed=21, max_tokens=5, ignore_eos=True)
    four = offline.generate([PROMPT], SamplingParams(n=4, logprobs=0, **kw), use_tqdm=False)[0].outputs
    ranked = sorted(four, key=lambda o: o.cumulative_logprob, reverse=True)
    best = offline.generate([PROMPT], SamplingParams(n=2, best_of=4, **kw), use_tqdm=False)[0].outputs
    assert [o.text for o in best] == [o.text for o in ranked[:2]]
    assert [o.index for o in best] == [0, 1] and best[0].logprobs is None
