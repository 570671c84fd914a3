"""Correct by construction: random logits sampled through each backend's mask always give valid output.

Temperature 1 over N(0, 1) logits is the worst case for a grammar: every allowed token is about as
likely as any other, so the masks alone keep the output valid. Each run checks, at every step, that
EOS is allowed only where the text so far is complete, and that ids past the tokenizer's vocabulary
(a model vocabulary larger than the tokenizer's) and special tokens are never allowed.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from banyan.structured import StructuredOutputSpec
from tests.unit.structured_helpers import BACKEND_NAMES, CATALOG, PERSON, backend, sample, tokenizer

TOKENIZERS = ["tiny", "default"]

PHONE = r"\+?[0-9]{1,3}-[0-9]{3}-[0-9]{4}"
CHOICES = ["red", "green", "dark blue", "東京", 'say "hi"']
GBNF = 'root ::= num (("+" | "-") num)*\nnum ::= [0-9] | [1-9] [0-9]'
LARK = 'start: num (("+" | "-") num)*\nnum: /[0-9]{1,2}/'
ARITH = r"[0-9]{1,2}([+-][0-9]{1,2})*"


def _validates(schema):
    validator = jsonschema.Draft202012Validator(schema)

    def check(text):
        validator.validate(json.loads(text))

    return check


def _is_object(text):
    assert isinstance(json.loads(text), dict)


def _matches(pattern):
    def check(text):
        assert re.fullmatch(pattern, text), text

    return check


def _one_of(choices):
    def check(text):
        assert text in choices

    return check


CASES = {  # name -> (spec, check, generations that must finish)
    "json-person-free-whitespace": (StructuredOutputSpec.json(PERSON, compact=False), _validates(PERSON), 1.0),
    "json-catalog": (StructuredOutputSpec.json(CATALOG), _validates(CATALOG), 1.0),
    "regex": (StructuredOutputSpec.regex(PHONE), _matches(PHONE), 1.0),
    "choice": (StructuredOutputSpec.choice(CHOICES), _one_of(CHOICES), 1.0),
    "gbnf": (StructuredOutputSpec.grammar(GBNF), _matches(ARITH), 1.0),
    "lark": (StructuredOutputSpec.grammar(LARK), _matches(ARITH), 1.0),
    # any JSON object: a uniform random walk over all of JSON rarely closes its strings; every step
    # is still checked, and the ones that finish must parse
    "json_object": (StructuredOutputSpec.json_object(), _is_object, 0.0),
}


@pytest.mark.parametrize("which", TOKENIZERS)
@pytest.mark.parametrize("name", BACKEND_NAMES)
@pytest.mark.parametrize("case", list(CASES))
def test_random_logits_always_give_valid_output(case, name, which):
    spec, check, must_finish = CASES[case]
    n = 50 if case != "json_object" else 8
    apply_every = 1 if which == "tiny" else 50
    texts, unfinished = sample(backend(name, which), tokenizer(which), spec, check, n, 300, apply_every=apply_every)
    assert len(texts) >= must_finish * n, f"{unfinished} of {n} generations did not finish"
    if must_finish:
        assert len(set(texts)) > 1 or case == "choice"


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_xgrammar_800_control_characters_in_length_bounded_strings_are_refused(name):
    """mlc-ai/xgrammar#800: minLength/maxLength strings accepted raw control characters."""
    tok, b = tokenizer("tiny"), backend(name)
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 5}}, "required": ["s"]}
    compiled = b.compile(StructuredOutputSpec.json(schema))
    for bad in ['{"s":"a\x01b"}', '{"s":"a\nb"}', '{"s":"a\tb"}', '{"s":"abcdef"}', '{"s":""}']:
        m = b.matcher(compiled)
        assert not (m.accept_tokens(tok.encode(bad)) and m.accept_token(tok.eos_token_id)), repr(bad)
    for good in ['{"s":"a"}', '{"s":"héllo"}', '{"s":"東京"}']:
        m = b.matcher(compiled)
        assert m.accept_tokens(tok.encode(good)) and m.accept_token(tok.eos_token_id), good


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_json_is_compact_unless_free_whitespace_is_asked_for(name):
    tok, b = tokenizer("tiny"), backend(name)
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}, "required": ["a"],
              "additionalProperties": False}

    def accepts(spec, text):
        m = b.matcher(b.compile(spec))
        return m.accept_tokens(tok.encode(text)) and m.accept_token(tok.eos_token_id)

    compact, free = StructuredOutputSpec.json(schema), StructuredOutputSpec.json(schema, compact=False)
    assert accepts(compact, '{"a":[1,2]}')
    assert not any(accepts(compact, t) for t in ('{"a": [1,2]}', '{"a":[1, 2]}', '{ "a":[1,2]}', '{"a":[1,2]}\n'))
    assert accepts(free, '{\n  "a": [1, 2]\n}') and not accepts(free, '{"a":' + " " * 17 + "[1]}")


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_jump_forward_tokens_are_the_forced_text(name):
    tok, b = tokenizer("tiny"), backend(name)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"], "additionalProperties": False}
    m = b.matcher(b.compile(StructuredOutputSpec.json(schema, compact=True)))
    forced = m.forced_tokens()
    assert forced and '{"answer":'.startswith(tok.decode(forced))
    assert m.accept_tokens(forced)
    assert m.accept_tokens(tok.encode('{"answer":'[len(tok.decode(forced)) :] + "42}"))
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()

    m = b.matcher(b.compile(StructuredOutputSpec.choice(["the quick brown fox"])))
    forced = m.forced_tokens()
    assert forced and "the quick brown fox".startswith(tok.decode(forced))


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_rollback_and_reset_restore_the_mask(name):
    tok, b = tokenizer("tiny"), backend(name)
    m = b.matcher(b.compile(StructuredOutputSpec.json(PERSON)))
    from banyan.structured import allocate_bitmask

    masks = allocate_bitmask(3, b.vocab_size)
    m.fill_bitmask(masks, 0)
    assert m.accept_tokens(tok.encode('{"name":"Ann",'))
    m.fill_bitmask(masks, 1)
    assert m.accept_tokens(tok.encode('"age":4'))
    m.rollback(len(tok.encode('"age":4')))
    m.fill_bitmask(masks, 2)
    assert masks[1].equal(masks[2])
    m.reset()
    m.fill_bitmask(masks, 2)
    assert masks[0].equal(masks[2])


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_a_rejected_token_says_why_and_eos_needs_a_complete_output(name):
    tok, b = tokenizer("tiny"), backend(name)
    m = b.matcher(b.compile(StructuredOutputSpec.regex("[0-9]+")))
    assert not m.accept_token(tok.eos_token_id)  # nothing generated yet: cannot end
    m = b.matcher(b.compile(StructuredOutputSpec.regex("[0-9]+")))
    assert not m.accept_tokens(tok.encode("x"))
    assert m.error
