"""bl.OpenAICompatible against a server that is not banyan: llama.cpp's llama-server, serving the default model's
GGUF. Skipped unless `benchmarks/install_peers.sh llama-server` has built it (or $BANYAN_LLAMA_SERVER names one).

llama-server renders no template through /tokenize and has no echo, so "auto" sends roles to
/v1/chat/completions and makes a select its GBNF grammar of the options; a JSON schema goes as OpenAI's
response_format; a regex, which it cannot take, is a typed error naming the call (lang/constraints.py). Each answer
is checked against the same request sent straight to the server with the official openai client."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

import banyan.lang as bl
from banyan.bench.launcher import free_port, launched
from banyan.bench.peers.llama_server import INSTALL_HINT, find_llama_server, llama_server_cmd
from banyan.checkpoint import resolve_model

pytestmark = pytest.mark.slow

BINARY = find_llama_server()
if BINARY is None:
    pytest.skip(f"llama-server is not built: {INSTALL_HINT}", allow_module_level=True)

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def server_url():
    port = free_port()
    cmd = llama_server_cmd(BINARY, resolve_model("smollm2-135m-instruct"), port, parallel=4, slot_len=1024,
                           num_threads=1)
    with launched(cmd, port, ready_timeout=120) as url:
        yield url


@pytest.fixture(scope="module")
def backend(server_url):
    made = bl.OpenAICompatible(f"{server_url}/v1")
    yield made
    made.close()


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="none")


@bl.function
def qa(s, question):
    s += bl.system("Answer briefly.")
    s += bl.user(question)
    s += bl.assistant(bl.gen("answer", max_tokens=12))
    s += bl.user("Is that right? Answer yes or no.")
    s += bl.assistant(bl.select("verdict", choices=["yes", "no"]))


def test_it_is_told_apart_from_banyan_and_vllm(backend):
    assert backend.owned_by == "llamacpp" and backend.dialect == "llamacpp"
    assert backend.select_mode == "choice"  # it has no echo to score options with


def test_roles_go_as_messages_and_the_answer_is_the_servers_own(backend, client):
    state = qa.run(question="What is the capital of France?", temperature=0, backend=backend)
    assert state.error() is None
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    direct = client.chat.completions.create(model=backend.model, messages=messages[:2], max_tokens=12, temperature=0)
    assert state["answer"] == direct.choices[0].message.content
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] == direct.usage.completion_tokens and meta["prompt_tokens"] > 10


def test_select_is_the_servers_grammar_of_the_options(backend, client):
    state = qa.run(question="Is the sky blue?", temperature=0, backend=backend)
    assert state["verdict"] in ("yes", "no")
    assert state.get_meta_info("verdict")["method"] == "constrained_choice"
    direct = client.chat.completions.create(model=backend.model, messages=state.messages()[:4], max_tokens=8,
                                            temperature=0, extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert state["verdict"] == direct.choices[0].message.content


def test_a_plain_text_program_selects_on_the_completions_api_too(backend):
    @bl.function
    def pick(s):
        s += "Colours of the rainbow include " + bl.select("colour", choices=["red", "plaid", "tartan \"x\""])

    state = pick.run(backend=backend)
    assert state.error() is None and state["colour"] in ("red", "plaid", 'tartan "x"')


def test_a_json_schema_gen_validates_and_a_regex_is_refused_naming_the_call(backend):
    @bl.function
    def extract(s):
        s += bl.user("Describe a person as JSON with a name and an age.")
        s += bl.assistant(bl.gen("person", max_tokens=48, json_schema=PERSON))
        s += bl.user("Two digits?")
        s += bl.assistant(bl.gen("digits", max_tokens=4, regex=r"[0-9]{2}"))

    state = extract.run(temperature=0, backend=backend)
    jsonschema.validate(json.loads(state["person"]), PERSON)
    error = state.error()
    assert isinstance(error, bl.BackendError) and error.call == "gen('digits')" and "regex" in str(error)


def test_streaming_and_run_batch(backend):
    state = qa.run(question="Name a fruit.", temperature=0, backend=backend, stream=True)
    assert "".join(state.text_iter("answer")) == state["answer"]
    states = qa.run_batch([{"question": f"What is {i} plus {i}?"} for i in range(4)], temperature=0,
                          backend=backend, num_threads=4)
    assert all(s.error() is None and s["verdict"] in ("yes", "no") for s in states)
    assert [s.messages()[1]["content"] for s in states] == [f"What is {i} plus {i}?" for i in range(4)]
