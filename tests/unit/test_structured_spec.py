"""StructuredOutputSpec and the hostile-grammar rows of RELIABILITY.md C4 (G1-G4) on every backend:
each is a StructuredOutputError naming the field and the problem, within seconds, never a crash."""

from __future__ import annotations

import json
import time

import pytest
import torch

from banyan.errors import InvalidParameterError
from banyan.structured import GrammarCache, StructuredOutputError, StructuredOutputSpec, allocate_bitmask, apply_bitmask
from banyan.structured.bitmask import draft_bitmask
from banyan.structured.spec import MAX_CHOICES, MAX_REGEX_REPEAT, MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS, default_compact
from tests.unit.structured_helpers import BACKEND_NAMES, backend, tokenizer

SPEC_TIMEOUT_S = 5.0


def test_specs_are_frozen_and_keyed_canonically():
    a = StructuredOutputSpec.json({"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputSpec.json('{ "type": "object",\n "properties": {"a": {"type": "integer"}} }')
    assert a == b and a.cache_key == b.cache_key and hash(a) == hash(b)
    reordered = StructuredOutputSpec.json({"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert reordered.cache_key != a.cache_key  # key order orders the generated properties: kept
    assert StructuredOutputSpec.json(a.schema, compact=False).cache_key != a.cache_key
    assert StructuredOutputSpec.json(a.schema, compact=True).cache_key == a.cache_key  # left to the engine: compact
    assert StructuredOutputSpec.regex("a").cache_key != StructuredOutputSpec.grammar("a").cache_key
    with pytest.raises(AttributeError):
        a.text = "{}"  # type: ignore[misc]


def test_from_dict_takes_vllms_shape_and_rejects_the_rest():
    assert StructuredOutputSpec.from_dict({"json": {"type": "string"}}).kind == "json"
    assert StructuredOutputSpec.from_dict({"choice": ["a", "b"]}).choices == ["a", "b"]
    assert StructuredOutputSpec.from_dict({"json_object": True, "disable_any_whitespace": True}).compact
    assert StructuredOutputSpec.from_dict({"regex": "a+", "json": None}).kind == "regex"
    for bad in [{}, {"json": {}, "regex": "a"}, {"jsn": {}}, "json", {"json_object": False}]:
        with pytest.raises(StructuredOutputError) as e:
            StructuredOutputSpec.from_dict(bad)  # type: ignore[arg-type]
        assert e.value.param == "structured_outputs"
    with pytest.raises(StructuredOutputError) as e:
        StructuredOutputSpec.from_dict({"json_object": True, "disable_any_whitespace": "no"})
    assert e.value.param == "structured_outputs.disable_any_whitespace"


def test_whitespace_in_json_is_the_engines_default_unless_the_request_says():
    """vLLM's disable_any_whitespace: absent, the engine decides (compact unless configured otherwise)."""
    left, free = (StructuredOutputSpec.from_dict({"json": {"type": "object"}, **w})
                  for w in ({}, {"disable_any_whitespace": False}))
    assert left.compact is None and not left.free_whitespace  # a backend given it alone compiles it compact
    assert left.with_default_whitespace(False).free_whitespace and left.with_default_whitespace(True).compact
    assert free.with_default_whitespace(True) == free  # the request's word wins
    regex = StructuredOutputSpec.regex("a+")
    assert regex.with_default_whitespace(False) == regex
    assert [default_compact(o) for o in (None, {}, {"disable_any_whitespace": False})] == [True, True, False]
    for bad in ({"backend": "xgrammar"}, {"disable_any_whitespace": "no"}, ["disable_any_whitespace"]):
        with pytest.raises(InvalidParameterError) as e:
            default_compact(bad)  # type: ignore[arg-type]
        assert e.value.param == "structured_outputs_config"


def test_errors_are_invalid_parameter_errors_with_a_param():
    with pytest.raises(InvalidParameterError) as e:
        StructuredOutputSpec.choice([])
    assert e.value.param == "structured_outputs.choice"
    moved = e.value.with_param("response_format")
    assert moved.param == "response_format" and str(moved) == f"response_format: {e.value.message}"


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda: StructuredOutputSpec.json([1, 2]), "must be a JSON object"),
        (lambda: StructuredOutputSpec.json("{not json"), "not valid JSON"),
        (lambda: StructuredOutputSpec.json({"a": float("nan")}), "not JSON data"),
        (lambda: StructuredOutputSpec.choice("yes"), "non-empty list"),
        (lambda: StructuredOutputSpec.choice(["a", 1]), "must be a string"),
        (lambda: StructuredOutputSpec.regex(b"a"), "must be a string"),
        (lambda: StructuredOutputSpec.grammar("  "), "must not be empty"),
    ],
)
def test_malformed_specs(make, problem):
    with pytest.raises(StructuredOutputError, match=problem):
        make()


# -- RELIABILITY C4 ---------------------------------------------------------------------------------
def _rejected(name: str, spec_or_make) -> StructuredOutputError:
    """The spec is refused, at construction or by the backend, within SPEC_TIMEOUT_S."""
    start = time.monotonic()
    with pytest.raises(StructuredOutputError) as e:
        spec = spec_or_make() if callable(spec_or_make) else spec_or_make
        cache = GrammarCache(backend(name), compile_timeout_s=SPEC_TIMEOUT_S)
        try:
            cache.get(spec)
        finally:
            cache.close()
    assert time.monotonic() - start <= SPEC_TIMEOUT_S + 1
    assert e.value.param.startswith("structured_outputs")
    return e.value


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_g1_invalid_json_schema(name):
    assert "type" in _rejected(name, StructuredOutputSpec.json({"type": 123})).message.lower()
    assert "zz" in _rejected(name, StructuredOutputSpec.json({"$ref": "#/$defs/zz"})).message
    _rejected(name, StructuredOutputSpec.json({"type": "integer", "minimum": 5, "maximum": 1}))


@pytest.mark.parametrize("name", BACKEND_NAMES)
@pytest.mark.parametrize(
    "pattern, problem",
    [("(", "(?i)(paren|unclosed)"), ("(?=a)a", "(?i)look"), ("(?<!a)b", "(?i)look"), ("(a)\\1", "(?i)backref")],
)
def test_g2_invalid_or_unsupported_regex(name, pattern, problem):
    assert _rejected(name, StructuredOutputSpec.regex(pattern)).message
    with pytest.raises(StructuredOutputError, match=problem):
        raise _rejected(name, StructuredOutputSpec.json({"type": "string", "pattern": f"^{pattern}$"}))


@pytest.mark.parametrize("name", BACKEND_NAMES)
@pytest.mark.parametrize("pattern", ["(a+)+$", "((a*)*)*b", "(a|a)*c", "(x+x+)+y", "(\\w+\\s?)*$", "([a-z]+)*[0-9]"])
def test_g3_catastrophic_regexes_are_refused_or_harmless(name, pattern):
    """llguidance matches with a lazily built DFA: a ReDoS regex compiles in milliseconds and each
    token stays cheap. xgrammar's Earley parser slows down token after token on a repeated group that
    itself repeats, so banyan refuses those for it up front."""
    tok, b = tokenizer("tiny"), backend(name)
    start = time.monotonic()
    try:
        matcher = b.matcher(b.compile(StructuredOutputSpec.regex(pattern)))
    except StructuredOutputError as e:
        assert name == "xgrammar" and "llguidance" in e.message
        return
    for token in tok.encode("a" * 200):
        if not matcher.accept_token(token):
            break
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_g3_huge_counted_repeats_are_refused_by_number(name):
    for make in [
        lambda: StructuredOutputSpec.regex("a{1,100000}"),
        lambda: StructuredOutputSpec.regex("[a-z]{5000}"),
        lambda: StructuredOutputSpec.json({"type": "string", "pattern": "^(ab){2000,}$"}),
        lambda: StructuredOutputSpec.grammar('root ::= "a"{1,100000}'),
        lambda: StructuredOutputSpec.grammar('start: "a" ~ 1..100000'),
    ]:
        assert str(MAX_REGEX_REPEAT) in _rejected(name, make).message
    backend(name).compile(StructuredOutputSpec.regex(f"a{{1,{MAX_REGEX_REPEAT // 10}}}"))  # within the limit


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_g4_deep_nesting_ref_cycles_and_huge_enums(name):
    deep: dict = {"type": "integer"}
    for _ in range(10_000):
        deep = {"type": "array", "items": deep}
    assert "nested deeper" in _rejected(name, lambda: StructuredOutputSpec.json(deep)).message
    text = '{"items":' * 10_000 + "{}" + "}" * 10_000
    assert "nested deeper" in _rejected(name, lambda: StructuredOutputSpec.json(text)).message
    ok: dict = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH // 2 - 1):
        ok = {"type": "array", "items": ok}
    StructuredOutputSpec.json(ok)  # within the depth limit: a spec (the backend may still refuse it)

    cycle = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    _rejected(name, StructuredOutputSpec.json(cycle))
    mutual = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    _rejected(name, StructuredOutputSpec.json(mutual))

    enum = {"enum": [f"value_{i:07d}" for i in range(80_000)]}  # 1.3 MB
    assert len(json.dumps(enum)) > 2**20
    assert str(MAX_SPEC_CHARS) in _rejected(name, lambda: StructuredOutputSpec.json(enum)).message
    assert str(MAX_CHOICES) in _rejected(name, lambda: StructuredOutputSpec.choice(enum["enum"])).message
    long_choices = ["x" * 100_000, "y" * 100_000]
    assert str(MAX_SPEC_CHARS) in _rejected(name, lambda: StructuredOutputSpec.choice(long_choices)).message


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_recursive_schemas_that_make_progress_are_fine(name):
    tok, b = tokenizer("tiny"), backend(name)
    tree = {"type": "object", "properties": {"child": {"$ref": "#"}}, "additionalProperties": False}
    m = b.matcher(b.compile(StructuredOutputSpec.json(tree)))
    assert m.accept_tokens(tok.encode('{"child":{"child":{}}}')) and m.accept_token(tok.eos_token_id)


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_unsupported_keywords_are_named(name):
    error = _rejected(name, StructuredOutputSpec.json({"type": "array", "contains": {"const": 1}}))
    assert "contains" in error.message
    error = _rejected(name, StructuredOutputSpec.json({"type": "string", "format": "no-such-format"}))
    assert "no-such-format" in error.message


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_lenient_cannot_be_switched_on_from_inside_the_schema(name):
    schema = {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}
    assert "uniqueItems" in _rejected(name, StructuredOutputSpec.json(schema)).message


@pytest.mark.parametrize("given", [
    {"json": {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}},
    {"regex": "[a-z]+"}, {"choice": ["x", "y"]}, {"json_object": True, "disable_any_whitespace": True},
])
def test_sampling_params_carry_a_spec_across_the_wire(given):
    from banyan.ipc import messages
    from banyan.sampling_params import SamplingParams

    params = SamplingParams(structured_outputs=given)
    assert params.structured_outputs == StructuredOutputSpec.from_dict(given)
    sent = messages.AddRequest("r", [1, 2], params, arrival_time=0.0)
    received = messages.core_decoder().decode(messages.encoder().encode(sent))
    assert received.sampling_params.structured_outputs == params.structured_outputs
    assert SamplingParams(structured_outputs=None).structured_outputs is None


@pytest.mark.parametrize("bad", [{"regex": "a{1,99999}"}, {"json": "{nope"}, {"choice": []}, {"json": {}, "regex": "a"}, "x"])
def test_sampling_params_refuse_a_bad_spec_naming_structured_outputs(bad):
    from banyan.sampling_params import SamplingParams

    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(structured_outputs=bad)
    assert e.value.param == "structured_outputs"


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_valid_prefix_counts_what_the_grammar_accepts_and_changes_nothing(name):
    """Speculation cuts its drafts where the grammar refuses one: the matcher's state and error stay as they were."""
    tok, be = tokenizer("tiny"), backend(name)
    matcher = be.matcher(be.compile(StructuredOutputSpec.regex("(ab|cd){3}")))
    ids = tok.encode("abcdab", add_special_tokens=False)
    assert matcher.accept_token(ids[0])
    rest = ids[1:] + tok.encode("zz", add_special_tokens=False)
    before = allocate_mask(be, matcher)
    assert matcher.valid_prefix(rest) == len(ids) - 1  # stops at the refused "zz", none past the end either
    assert matcher.valid_prefix(tok.encode("zz", add_special_tokens=False)) == 0
    assert matcher.error == "" and torch.equal(allocate_mask(be, matcher), before)
    assert matcher.accept_tokens(ids[1:]) and matcher.valid_prefix(ids[:1]) == 0  # complete: nothing more


def allocate_mask(be, matcher):
    mask = allocate_bitmask(1, be.vocab_size)
    matcher.fill_bitmask(mask, 0)
    return mask.clone()


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_draft_bitmask_stops_at_the_first_draft_the_grammar_refuses(name):
    """A network's drafts reach the verify pass uncut: row j masks as the grammar stands after the first j drafts up
    to the first refused one, whose row already forbids it, and repeats that state past it; the matcher ends where
    it began, with no error."""
    tok, be = tokenizer("tiny"), backend(name)
    matcher = be.matcher(be.compile(StructuredOutputSpec.regex("(ab|cd){3}")))
    good = tok.encode("abcd", add_special_tokens=False)
    bad = tok.encode("zz", add_special_tokens=False)[:1]
    drafts = good + bad + good  # refused at len(good)
    width = len(drafts) + 1
    bitmask, rows = draft_bitmask([(0, matcher, drafts)], width, be.vocab_size)
    assert rows == list(range(width)) and matcher.error == ""
    expected = []
    for j in range(len(good) + 1):
        expected.append(allocate_mask(be, matcher))
        if j < len(good):
            assert matcher.accept_token(good[j])
    matcher.rollback(len(good))
    expected += [expected[-1]] * (width - len(expected))
    assert all(torch.equal(bitmask[j], expected[j][0]) for j in range(width))
    assert torch.equal(allocate_mask(be, matcher), expected[0])  # the matcher is back where it began
    logits = torch.zeros(1, be.vocab_size)
    apply_bitmask(logits, bitmask[len(good) : len(good) + 1], [0])
    assert logits[0, bad[0]] == float("-inf")  # the refused draft's row forbids it: never accepted
