"""banyan.lang's constructs on its three backends, on the same tiny model: bl.Engine in process,
bl.RuntimeEndpoint and bl.OpenAICompatible (echo + logprobs scoring, no banyan-only field) on a real
`banyan serve` on loopback. Outputs are checked against the offline API on the same weights."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import jsonschema
import pytest

import banyan.lang as bl
from banyan import LLM, SamplingParams
from banyan.lang.backend import option_start
from banyan.text.chat_template import render_chat_template
from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

PAGE = 4  # --block-size of the engine and the server
BACKENDS = ["engine", "runtime", "openai"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_lang")
    write_model_dir(path, "llama", seed=6)
    return path


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), block_size=PAGE, num_threads=1, max_model_len=512)


@pytest.fixture(scope="module")
def server(model_dir):
    proc = start_server(model_dir, "--kv-cache-memory", "64MiB", "--max-model-len", "512")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def backends(model_dir, server):
    made = {
        "engine": bl.Engine(str(model_dir), block_size=PAGE, num_threads=1, max_model_len=512),
        "runtime": bl.RuntimeEndpoint(server.base_url),
        "openai": bl.OpenAICompatible(f"{server.base_url}/v1", select_mode="logprobs"),
    }
    yield made
    for backend in made.values():
        backend.close()


@pytest.fixture(params=BACKENDS)
def backend(request, backends):
    return backends[request.param]


@bl.function
def qa(s, question):
    s += bl.system("Answer briefly.")
    s += bl.user(question)
    s += bl.assistant(bl.gen("answer", max_tokens=6))
    s += bl.user("Again?")
    s += bl.assistant_begin() + bl.gen("again", max_tokens=4) + bl.assistant_end()


def test_chat_roles_are_the_chat_template(backend, offline):
    state = qa.run(question="The quick brown fox", temperature=0, backend=backend)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert state.text() == render_chat_template(offline.tokenizer, messages, add_generation_prompt=False)
    assert messages[2]["content"] == state["answer"] and messages[4]["content"] == state["again"]
    meta = state.get_meta_info("answer")
    assert 1 <= meta["completion_tokens"] <= 6 and meta["prompt_tokens"] > 10
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["cached_tokens"] >= 0


def test_gen_equals_the_offline_engine(backend, offline):
    @bl.function
    def complete(s):
        s += "Paged attention keeps"
        s += bl.gen("rest", max_tokens=8, ignore_eos=True)

    state = complete.run(temperature=0, backend=backend)
    want = offline.generate(["Paged attention keeps"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert state["rest"] == want.text
    assert state.get_meta_info("rest")["finish_reason"] == {"type": "length", "length": 8}


def _scores_by_hand(offline, prefix: str, choices: list[str]) -> list[float]:
    """Mean log-probability of each option's tokens given the prefix, every position computed (no cache)."""
    tok = offline.tokenizer
    prefix_ids, scores = tok.encode(prefix), []
    for choice in choices:
        ids = tok.encode(prefix + choice)
        out = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        start = option_start(prefix_ids, ids)
        lps = [out.prompt_logprobs[i][ids[i]].logprob for i in range(start, len(ids))]
        scores.append(sum(lps) / len(lps))
    return scores


def test_select_agrees_with_scores_computed_by_hand(backend, offline):
    choices = ["fox", "lazy dog", "radix tree", " paged"]

    @bl.function
    def pick(s):
        s += bl.user("Which one?")
        s += bl.assistant(bl.gen("why", max_tokens=5) + " so: " + bl.select("thing", choices=choices))

    state = pick.run(temperature=0, backend=backend)
    meta = state.get_meta_info("thing")
    prefix = state.text()[: state.text().rindex(state["thing"])]
    want = _scores_by_hand(offline, prefix, choices)
    assert meta["normalized_prompt_logprobs"] == pytest.approx(want, abs=1e-4)
    assert state["thing"] == choices[max(range(len(choices)), key=lambda i: want[i])]


def test_forked_branches_find_the_shared_prefix_in_the_cache(backend, offline):
    @bl.function
    def tips(s):
        s += "A radix tree shares prefixes between requests. " * 4
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f"Tip {i}:" + bl.gen("tip", max_tokens=4)
        forks.join()
        s["branches"] = [(f.text()[: len(f.text()) - len(f["tip"])], f.get_meta_info("tip")) for f in forks]

    state = tips.run(temperature=0, backend=backend)
    parent = offline.tokenizer.encode(state.text())
    for prompt_text, meta in state["branches"]:
        prompt = offline.tokenizer.encode(prompt_text)
        shared = next((i for i, (a, b) in enumerate(zip(parent, prompt)) if a != b), len(parent))
        assert shared > 30 and meta["cached_tokens"] >= shared // PAGE * PAGE, (meta, shared)


def test_streaming_yields_the_final_text(backend):
    state = qa.run(question="Continuous batching", temperature=0, stream=True, backend=backend)
    pieces = list(state.text_iter())
    assert "".join(pieces) == state.text() and len(pieces) > 3

    async def answer_pieces():
        again = qa.run(question="Continuous batching", temperature=0, stream=True, backend=backend)
        return again, [p async for p in again.text_async_iter("answer")]

    again, pieces = asyncio.run(answer_pieces())
    assert "".join(pieces) == again["answer"]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_regex_and_json_schema_gens_always_validate(backend):
    @bl.function
    def structured(s, seed):
        s += "Code: " + bl.gen("code", regex=r"[0-9]{2}-[a-z]{3}", seed=seed, max_tokens=12)
        s += "\nPerson: " + bl.gen("person", json_schema=json.dumps(SCHEMA), seed=seed, max_tokens=40)

    states = structured.run_batch([{"seed": seed} for seed in range(4)], temperature=1.0, backend=backend)
    for state in states:
        assert state.error() is None
        assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", state["code"])
        jsonschema.validate(json.loads(state["person"]), SCHEMA)


def test_a_program_that_raises_keeps_its_exception_and_spares_the_others(backend):
    @bl.function
    def maybe(s, fail):
        s += "The quick" + bl.gen("word", max_tokens=2)
        if fail:
            raise ValueError(f"program gave up after {s['word']!r}")

    states = maybe.run_batch([{"fail": i == 2} for i in range(5)], temperature=0, backend=backend)
    assert isinstance(states[2].error(), ValueError)
    assert [s.error() for i, s in enumerate(states) if i != 2] == [None] * 4
    assert all(s["word"] for s in states)


def test_a_refused_call_is_a_typed_error_naming_the_call(backend):
    @bl.function
    def bad(s):
        s += "Hello" + bl.gen("fine", max_tokens=2)
        s += bl.gen("broken", max_tokens=2, top_p=0.0)
        s += bl.gen("never", max_tokens=2)

    state = bad.run(backend=backend)
    error = state.error()
    assert isinstance(error, bl.BackendError) and error.call == "gen('broken')" and "top_p" in str(error)
    assert state["fine"]
    with pytest.raises(bl.BackendError):
        state["never"]


def test_run_batch_returns_every_state_in_order(backend):
    states = qa.run_batch([{"question": f"Question {i}"} for i in range(6)], temperature=0, backend=backend,
                          num_threads=3, progress_bar=True)
    assert [s.messages()[1]["content"] for s in states] == [f"Question {i}" for i in range(6)]


def test_the_engine_runs_a_batch_of_programs_in_the_same_steps(backends):
    engine = backends["engine"]
    seen = []
    hook = lambda e: seen.append(len(e.scheduler.running) + len(e.scheduler.waiting))  # noqa: E731
    engine.llm.engine.before_step.append(hook)
    try:
        states = qa.run_batch([{"question": f"Q{i}"} for i in range(8)], temperature=0, backend=engine)
    finally:
        engine.llm.engine.before_step.remove(hook)
    assert all(s.error() is None for s in states)
    assert max(seen) > 1  # several programs' calls in one step


def test_language_misuse_is_a_clear_error(backends):
    engine = backends["engine"]

    @bl.function
    def unbalanced(s):
        s += bl.user_begin() + "hi" + bl.assistant_end()

    assert isinstance(unbalanced.run(backend=engine).error(), bl.ProgramUsageError)

    @bl.function
    def unknown(s):
        s += "x"
        s["nothing"]

    error = unknown.run(backend=engine).error()
    assert isinstance(error, bl.ProgramUsageError) and "nothing" in str(error)


def test_openai_compatible_says_how_it_selects_and_uses_the_constrained_choice(server, caplog):
    with caplog.at_level(logging.INFO, logger="banyan.lang"):
        backend = bl.OpenAICompatible(f"{server.base_url}/v1")
    assert "constrained choice" in caplog.text
    try:
        @bl.function
        def pick(s):
            s += "Pick: " + bl.select("x", choices=["alpha", "beta", "gamma"])

        state = pick.run(backend=backend)
        assert state["x"] in ("alpha", "beta", "gamma")
        assert state.get_meta_info("x")["method"] == "constrained_choice"
    finally:
        backend.close()


def test_on_the_chat_api_roles_go_as_messages_and_answer_as_the_template_text_does(server, backends):
    """api="chat" (what "auto" picks on a server without /tokenize, such as OpenAI's): the server renders the template.
    Greedy answers equal those of the same program sent as the template's text."""
    chat = bl.OpenAICompatible(f"{server.base_url}/v1", api="chat")
    try:
        state = qa.run(question="The quick brown fox", temperature=0, backend=chat)
        want = qa.run(question="The quick brown fox", temperature=0, backend=backends["runtime"])
        assert state.messages() == want.messages() and state["again"] == want["again"]
        assert state.text().startswith("SYSTEM: Answer briefly.\nUSER: The quick brown fox\nASSISTANT: ")
        streamed = qa.run(question="The quick brown fox", temperature=0, stream=True, backend=chat)
        assert "".join(streamed.text_iter()) == state.text()

        @bl.function
        def continued(s):  # text already in the assistant turn: the server continues it (continue_final_message)
            s += bl.user("Which one?")
            s += bl.assistant("I pick" + bl.gen("why", max_tokens=4) + ": " + bl.select("pick", choices=["fox", "dog"]))

        state, want = continued.run(temperature=0, backend=chat), continued.run(temperature=0, backend=backends["runtime"])
        assert state["why"] == want["why"] and state["pick"] in ("fox", "dog")
        assert state.get_meta_info("pick")["method"] == "constrained_choice"

        @bl.function
        def outside(s):
            s += bl.user("Hi") + bl.gen("nope", max_tokens=2)

        error = outside.run(backend=chat).error()
        assert isinstance(error, bl.ProgramUsageError) and "assistant" in str(error)
    finally:
        chat.close()
