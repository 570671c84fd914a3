"""Scoring a prompt over HTTP (what select needs from a server): /v1/completions with echo and
max_tokens 0 (the prompt's log-probabilities, nothing generated), vLLM's prompt_logprobs, and banyan's
prompt_logprobs_start (positions before it may come from the prefix cache). Values are checked against
transformers on the same weights; the official openai client reads the answers."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_scoring")
    write_model_dir(path, "llama", seed=5)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    """log p(prompt[i] | prompt[:i]) for i >= 1, from transformers."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    return [None] + [float(logits[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]


@pytest.fixture(scope="module")
def server(model_dir):
    proc = start_server(model_dir, "--served-model-name", "tiny", "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                        "--kv-cache-dtype", "float32")  # scores compared with a direct float32 forward
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _close(values, expected, start=1):
    for got, want in zip(values[start:], expected[start:], strict=True):
        assert got == pytest.approx(want, abs=1e-4)


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(client, reference):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(PROMPT)
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(PROMPT)
    _close(choice.logprobs.token_logprobs, reference)
    assert choice.text == "".join(choice.logprobs.tokens)
    assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)


def test_echo_with_generation_puts_the_prompt_positions_first(client, reference):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, temperature=0,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(PROMPT) + 3
    _close(lp.token_logprobs[: len(PROMPT)], reference)
    assert all(v is not None for v in lp.token_logprobs[len(PROMPT):])


def test_vllm_prompt_logprobs(server, reference):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    choice = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    positions = choice["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(PROMPT)
    _close([None] + [positions[i][str(PROMPT[i])]["logprob"] for i in range(1, len(PROMPT))], reference)
    assert all(len(p) >= 2 for p in positions[1:])  # the prompt token and the top 2 (it may be one of them)


def test_prompt_logprobs_start_reads_the_prefix_from_the_cache(server, reference):
    url = f"{server.base_url}/v1/completions"
    httpx.post(url, json={"prompt": PROMPT[:9], "max_tokens": 1}, timeout=60).raise_for_status()  # warm 8 tokens
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0, "prompt_logprobs_start": 9}
    out = httpx.post(url, json=body, timeout=60).json()
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 8  # --block-size 4: two pages
    values = out["choices"][0]["logprobs"]["token_logprobs"]
    assert values[:9] == [None] * 9
    _close(values, reference, start=9)


def test_streamed_echo_with_max_tokens_0(server):
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0, "stream": True}
    text, finish, positions = "", None, 0
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            positions += len((choice["logprobs"] or {}).get("tokens", []))
    assert finish == "length" and positions == len(PROMPT)
    detok = httpx.post(f"{server.base_url}/detokenize", json={"tokens": PROMPT}, timeout=60).json()["prompt"]
    assert text == detok


def test_max_tokens_0_needs_echo(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
