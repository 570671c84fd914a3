"""Structured output through the engine: sampled outputs (temperature 1, a tiny random model) always
parse and validate, a grammar that fails to compile ends only its request, and constrained rows
leave unconstrained ones in the same batch untouched.
"""

from __future__ import annotations

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
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_structured")
    write_model_dir(path, "llama", seed=5)
    return LLM(str(path), block_size=4, num_threads=2, max_model_len=512)


def constrained(spec: dict, **kw) -> SamplingParams:
    kw.setdefault("temperature", 1.0)
    return SamplingParams(max_tokens=kw.pop("max_tokens", 300), structured_outputs=spec, **kw)


def test_sampled_json_always_validates(llm):
    params = [constrained({"json": schema, "disable_any_whitespace": True}) for schema in SCHEMAS.values()] * 18
    outputs = llm.generate(["Reply in JSON."] * len(params), params, use_tqdm=False)
    for out, p in zip(outputs, params):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), p.structured_outputs.schema)
    llm.engine.kv.check_integrity()


def test_json_object_regex_and_choice(llm):
    params = [constrained({"json_object": True}, temperature=0.0)] * 4
    params += [constrained({"regex": r"[0-9]{3}-[a-z]{2,4}"})] * 4 + [constrained({"choice": ["yes", "no", "maybe so"]})] * 4
    outputs = [o.outputs[0] for o in llm.generate(["Go."] * len(params), params, use_tqdm=False)]
    assert [o.finish_reason for o in outputs] == ["stop"] * len(outputs), outputs
    assert all(isinstance(json.loads(o.text), dict) for o in outputs[:4])
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", o.text) for o in outputs[4:8])
    assert all(o.text in ("yes", "no", "maybe so") for o in outputs[8:])


def test_an_invalid_spec_is_refused_at_construction():
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(structured_outputs={"regex": "a{1,100000}"})
    assert e.value.param == "structured_outputs"


def test_a_grammar_that_fails_to_compile_ends_only_its_request(llm):
    bad = constrained({"json": {"type": "array", "uniqueItems": True}})
    good = constrained({"choice": ["alpha", "beta"]})
    failed, ok = llm.generate(["a", "b"], [bad, good], use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error"
    assert "uniqueItems" in failed.outputs[0].stop_reason  # the message
    assert ok.outputs[0].finish_reason == "stop" and ok.outputs[0].text in ("alpha", "beta")
    assert not llm.engine.has_unfinished_requests()


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


def test_preemption_keeps_the_matcher(tmp_path):
    write_model_dir(tmp_path, "llama", seed=5)
    small = LLM(str(tmp_path), block_size=4, num_threads=2, max_model_len=512, num_pages=48)
    spec = {"json": SCHEMAS["nested"], "disable_any_whitespace": True}
    params = [constrained(spec, max_tokens=150, seed=i) for i in range(6)]
    outputs = small.generate(["Reply in JSON, please, now."] * 6, params, use_tqdm=False)
    assert small.engine.scheduler.stats.num_preemptions > 0
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["nested"])
    small.engine.kv.check_integrity()
