"""Structured output through the engine: sampled outputs (temperature 1, a tiny random model) always
parse and validate on both grammar backends, a grammar that fails to compile ends only its request,
constrained rows leave unconstrained ones in the same batch untouched, and tokens the grammar forces
cost no forward pass of their own (jump-forward).
"""

from __future__ import annotations

import contextlib
import json
import re

import jsonschema
import pytest

from banyan import LLM, SamplingParams
from banyan.errors import InvalidParameterError
from banyan.request import RequestStatus
from tests.factories import write_model_dir

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": -1.5, "maximum": 2},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "ok": {"type": "boolean"}},
                "required": ["x", "ok"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["point", "tags"],
        "additionalProperties": False,
    },
    "list": {"type": "array", "items": {"type": "integer", "exclusiveMinimum": 0, "maximum": 99}, "maxItems": 4},
    # mlc-ai/xgrammar#800: length-bounded strings accepted raw control characters (json.loads refuses them)
    "bounded-strings": {
        "type": "object",
        "properties": {"a": {"type": "string", "minLength": 2, "maxLength": 6}, "b": {"type": "string", "maxLength": 3}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
EBNF = 'root ::= num ("+" num)*\nnum ::= [1-9] [0-9]?'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_structured")
    write_model_dir(path, "llama", seed=5)
    return path


def make_llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), block_size=4, num_threads=2, max_model_len=512, **kw)


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


@pytest.fixture(scope="module")
def xgrammar_llm(model_dir):
    return make_llm(model_dir, structured_output_backend="xgrammar")


@pytest.fixture(params=["llguidance", "xgrammar"])
def each_backend(request):
    """The same tests on each grammar backend."""
    return request.getfixturevalue("llm" if request.param == "llguidance" else "xgrammar_llm")


def constrained(spec: dict, **kw) -> SamplingParams:
    kw.setdefault("temperature", 1.0)
    return SamplingParams(max_tokens=kw.pop("max_tokens", 300), structured_outputs=spec, **kw)


def test_sampled_json_always_validates(each_backend):
    llm = each_backend
    params = [constrained({"json": schema, "disable_any_whitespace": True}) for schema in SCHEMAS.values()] * 14
    outputs = llm.generate(["Reply in JSON."] * len(params), params, use_tqdm=False)
    for out, p in zip(outputs, params):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), p.structured_outputs.schema)
    llm.engine.kv.check_integrity()


def test_json_object_regex_choice_and_grammar(each_backend):
    # greedy, this random model closes an object only after whitespace (compact, it writes one endless key)
    params = [constrained({"json_object": True, "disable_any_whitespace": False}, temperature=0.0)] * 4
    params += [constrained({"regex": r"[0-9]{3}-[a-z]{2,4}"})] * 4 + [constrained({"choice": ["yes", "no", "maybe so"]})] * 4
    params += [constrained({"grammar": EBNF})] * 4
    outputs = [o.outputs[0] for o in each_backend.generate(["Go."] * len(params), params, use_tqdm=False)]
    assert [o.finish_reason for o in outputs] == ["stop"] * len(outputs), outputs
    assert all(isinstance(json.loads(o.text), dict) for o in outputs[:4])
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", o.text) for o in outputs[4:8])
    assert all(o.text in ("yes", "no", "maybe so") for o in outputs[8:12])
    assert all(re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", o.text) for o in outputs[12:]), outputs[12:]


def spaced(text: str) -> bool:
    """Whitespace outside the JSON strings of the text."""
    return any(c.isspace() for c in re.sub(r'"(?:[^"\\]|\\.)*"', "", text))


def test_json_is_compact_unless_the_request_frees_whitespace(each_backend):
    """JSON as OpenAI writes it: a tiny random model free to add whitespace spends its budget on it."""
    compact = [constrained({"json": SCHEMAS["nested"]}, seed=i, max_tokens=80) for i in range(3)]
    free = [constrained({"json": SCHEMAS["nested"], "disable_any_whitespace": False}, seed=i, max_tokens=20) for i in range(3)]
    outputs = [o.outputs[0] for o in each_backend.generate(["Reply in JSON."] * 6, compact + free, use_tqdm=False)]
    assert [spaced(o.text) for o in outputs] == [False] * 3 + [True] * 3, outputs
    assert all(o.finish_reason == "stop" for o in outputs[:3])


def test_the_engine_default_for_whitespace(model_dir):
    free = make_llm(model_dir, structured_outputs_config={"disable_any_whitespace": False})
    params = [constrained({"json": SCHEMAS["list"], **w}, seed=1, max_tokens=30) for w in ({}, {"disable_any_whitespace": True})]
    left, compact = (o.outputs[0] for o in free.generate(["Reply in JSON."] * 2, params, use_tqdm=False))
    assert spaced(left.text) and not spaced(compact.text) and compact.finish_reason == "stop"
    with pytest.raises(InvalidParameterError) as e:
        make_llm(model_dir, structured_outputs_config={"disable_any_whitespace": "yes"})
    assert e.value.param == "structured_outputs_config"


def test_an_invalid_spec_is_refused_at_construction():
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(structured_outputs={"regex": "a{1,100000}"})
    assert e.value.param == "structured_outputs"


def test_a_grammar_that_fails_to_compile_ends_only_its_request(each_backend):
    bad = constrained({"json": {"type": "array", "uniqueItems": True}})
    good = constrained({"choice": ["alpha", "beta"]})
    failed, ok = each_backend.generate(["a", "b"], [bad, good], use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error"
    error = failed.outputs[0].error  # OpenAI's fields, as the server would answer
    assert "uniqueItems" in error.message and (error.status, error.type) == (400, "invalid_request_error")
    assert ok.outputs[0].finish_reason == "stop" and ok.outputs[0].text in ("alpha", "beta")
    assert not each_backend.engine.has_unfinished_requests()


def test_xgrammar_refuses_what_it_would_silently_ignore(xgrammar_llm):
    """xgrammar drops a length limit next to `pattern`: refused, never a string longer than asked."""
    schema = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}
    out = xgrammar_llm.generate(["a"], constrained({"json": schema}), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error" and "maxLength" in out.error.message


def test_mixed_batch_leaves_unconstrained_outputs_unchanged(llm):
    prompts = ["The quick brown fox", "Paged attention", "A radix tree", "def add(a, b):"]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    solo = [llm.generate([p], plain, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    mixed_params = [plain, constrained({"json": SCHEMAS["person"]}, temperature=0.0), plain,
                    constrained({"choice": ["yes", "no"]}), plain, plain]
    mixed_prompts = [prompts[0], "json", prompts[1], "choice", prompts[2], prompts[3]]
    outputs = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    got = [outputs[i].outputs[0].token_ids for i in (0, 2, 4, 5)]
    assert got == solo
    jsonschema.validate(json.loads(outputs[1].outputs[0].text), SCHEMAS["person"])


def test_the_grammar_wins_over_min_tokens(llm):
    out = llm.generate(["x"], constrained({"choice": ["ok"]}, min_tokens=20), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("ok", "stop")


def test_requests_wait_for_their_grammar_then_run(llm):
    engine = llm.engine
    request = engine.add_request("g", [5, 6, 7], constrained({"regex": "[ab]{4}"}, max_tokens=10))
    assert request.status == RequestStatus.WAITING_FOR_GRAMMAR and not request.is_finished
    tokens = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
    assert request.finish_reason == "stop"
    assert re.fullmatch("[ab]{4}", llm.get_tokenizer().decode(tokens, skip_special_tokens=True))


def test_preemption_keeps_the_matcher(model_dir):
    small = make_llm(model_dir, num_pages=44)  # 43 hold one request; the 6 share their prompt's pages
    spec = {"json": SCHEMAS["nested"], "disable_any_whitespace": True}
    params = [constrained(spec, max_tokens=150, seed=i) for i in range(6)]
    outputs = small.generate(["Reply in JSON, please, now."] * 6, params, use_tqdm=False)
    assert small.engine.scheduler.stats.num_preemptions > 0
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["nested"])
    small.engine.kv.check_integrity()


# -- jump-forward ---------------------------------------------------------------------------------
ORDER = {  # long fixed keys and enum values: most of the output is forced by the grammar
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 6},
        "shipping_address_line": {"type": "string", "maxLength": 6},
        "order_status": {"enum": ["pending_review", "shipped_to_customer"]},
    },
    "required": ["customer_full_name", "shipping_address_line", "order_status"],
    "additionalProperties": False,
}
COMPACT_ORDER = {"json": ORDER, "disable_any_whitespace": True}


@pytest.fixture(scope="module")
def no_jump_llm(model_dir):
    return make_llm(model_dir, enable_jump_forward=False)


@contextlib.contextmanager
def counting_forwards(llm):
    """A list that gets one entry per forward pass of the model."""
    calls = []
    handle = llm.engine.runner.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def generate_one(llm, spec, **kw):
    with counting_forwards(llm) as calls:
        out = llm.generate(["Order:"], constrained(spec, **kw), use_tqdm=False)[0].outputs[0]
    return out, len(calls)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_forced_tokens_cost_no_forward_pass_of_their_own(request, no_jump_llm, backend):
    llm = request.getfixturevalue("llm" if backend == "llguidance" else "xgrammar_llm")
    for seed in range(2):
        out, forwards = generate_one(llm, COMPACT_ORDER, seed=seed)
        jsonschema.validate(json.loads(out.text), ORDER)
        assert forwards < len(out.token_ids) / 2, (forwards, out.token_ids)  # most of it was forced
        out, forwards = generate_one(no_jump_llm, COMPACT_ORDER, seed=seed)
        jsonschema.validate(json.loads(out.text), ORDER)
        assert forwards == len(out.token_ids)  # without jump-forward: one pass per token


def test_a_fully_forced_output_needs_no_forward_pass(llm):
    out, forwards = generate_one(llm, {"choice": ["the quick brown fox"]})
    assert (out.text, out.finish_reason, forwards) == ("the quick brown fox", "stop", 0)
    out, forwards = generate_one(llm, COMPACT_ORDER, max_tokens=3)  # max_tokens cuts the forced run
    assert (len(out.token_ids), out.finish_reason, forwards) == (3, "length", 0)


@pytest.mark.parametrize("engine", ["llm", "xgrammar_llm", "no_jump_llm"])
def test_a_fully_forced_output_is_the_forced_text_on_each_backend_with_or_without_jumps(request, engine):
    """xgrammar holds back a forced token that prefixes a longer one: the model samples it, under the grammar."""
    params = constrained({"json": {"const": {"a": [1, "b"]}}}, n=2)
    outputs = request.getfixturevalue(engine).generate(["x", "y"], params, use_tqdm=False)
    assert [(c.text, c.finish_reason) for o in outputs for c in o.outputs] == [('{"a":[1,"b"]}', "stop")] * 4


def test_forced_tokens_have_logprob_zero_and_stream_like_sampled_ones(llm):
    out, _ = generate_one(llm, COMPACT_ORDER, logprobs=2)
    assert len(out.logprobs) == len(out.token_ids)
    chosen = [lp[token] for lp, token in zip(out.logprobs, out.token_ids)]
    assert any(c.logprob == 0.0 and c.rank == 1 for c in chosen)
    assert out.cumulative_logprob == pytest.approx(sum(c.logprob for c in chosen))
    streamed = "".join(llm.stream("Order:", constrained(COMPACT_ORDER, seed=0)))
    assert streamed == generate_one(llm, COMPACT_ORDER, seed=0)[0].text


def test_a_stop_string_inside_forced_text_ends_there(llm):
    out, _ = generate_one(llm, COMPACT_ORDER, stop=["address"])
    assert (out.text, out.finish_reason) == (out.text.split("address")[0], "stop")
    assert out.text.endswith('"shipping_')


def test_siblings_and_preempted_requests_jump_forward_alike(model_dir):
    small = make_llm(model_dir, num_pages=64)
    params = [constrained(COMPACT_ORDER, n=3, seed=i, max_tokens=150) for i in range(4)]
    outputs = small.generate(["Orders, please, in JSON."] * 4, params, use_tqdm=False)
    assert small.engine.scheduler.stats.num_preemptions > 0
    for completion in (c for out in outputs for c in out.outputs):
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), ORDER)
    small.engine.kv.check_integrity()


def test_unconstrained_requests_are_unaffected(llm, no_jump_llm):
    prompts = ["The quick brown fox", "Paged attention"]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [plain, constrained(COMPACT_ORDER, seed=1), plain]
    with_jumps = llm.generate([prompts[0], "json", prompts[1]], params, use_tqdm=False)
    without = no_jump_llm.generate([prompts[0], "json", prompts[1]], params, use_tqdm=False)
    assert [with_jumps[i].outputs[0].token_ids for i in (0, 2)] == [without[i].outputs[0].token_ids for i in (0, 2)]


def test_closing_the_engine_stops_its_grammar_threads(model_dir):
    engine = make_llm(model_dir).engine
    engine.add_request("a", [5, 6], constrained({"choice": ["x", "y"]}))  # builds the grammar cache
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.add_request("b", [5, 6], constrained({"regex": "[0-9]"}))
    assert not engine.has_unfinished_requests()  # a request whose grammar cannot start is never queued


def test_a_backend_that_cannot_load_refuses_constrained_requests_only(model_dir):
    engine = make_llm(model_dir, structured_output_backend="nope").engine
    with pytest.raises(InvalidParameterError) as e:
        engine.add_request("a", [5, 6], constrained({"choice": ["x", "y"]}))
    assert e.value.param == "structured_outputs" and "llguidance, xgrammar" in str(e.value)
    assert not engine.has_unfinished_requests()
    engine.add_request("b", [5, 6], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
