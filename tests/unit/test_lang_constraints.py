"""banyan.lang's constraint dialects (lang/constraints.py): the fields each kind of server takes for a gen's regex or
JSON schema and for a select's choice, and what it cannot take refused with the call's name."""

from __future__ import annotations

import json

import pytest

from banyan.lang.constraints import choice_fields, chosen, dialect_of, gbnf_literal, gen_fields
from banyan.lang.errors import BackendError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_the_dialect_comes_from_owned_by():
    assert [dialect_of(o) for o in ("vllm", "banyan", "llamacpp", "openai", "system", "")] == [
        "structured_outputs", "structured_outputs", "llamacpp", "openai", "openai", "openai"]


def test_vllm_and_banyan_take_structured_outputs_for_everything():
    assert gen_fields("structured_outputs", "gen('x')", {"regex": "[0-9]+"}, chat=True) == {
        "structured_outputs": {"regex": "[0-9]+"}}
    assert gen_fields("structured_outputs", "gen('x')", {"json": SCHEMA}, chat=False) == {
        "structured_outputs": {"json": SCHEMA}}
    assert choice_fields("structured_outputs", ["a", "b"]) == {"structured_outputs": {"choice": ["a", "b"]}}
    assert gen_fields("structured_outputs", "gen('x')", None, chat=True) == {}


def test_llama_server_takes_its_json_schema_field_a_response_format_and_a_grammar():
    assert gen_fields("llamacpp", "gen('x')", {"json": SCHEMA}, chat=False) == {"json_schema": SCHEMA}
    assert gen_fields("llamacpp", "gen('x')", {"json": SCHEMA}, chat=True)["response_format"]["json_schema"][
        "schema"] == SCHEMA
    assert choice_fields("llamacpp", ["yes", "no"]) == {"grammar": 'root ::= "yes" | "no"'}


@pytest.mark.parametrize("dialect", ["llamacpp", "openai"])
def test_a_regex_is_refused_where_the_server_has_none(dialect):
    with pytest.raises(BackendError) as refused:
        gen_fields(dialect, "gen('digits')", {"regex": "[0-9]{2}"}, chat=True)
    assert refused.value.call == "gen('digits')" and "regex" in str(refused.value)


def test_elsewhere_a_choice_is_a_strict_schema_enum_read_back_from_its_json():
    fields = choice_fields("openai", ["red", "blue"])
    schema = fields["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["choice"]["enum"] == ["red", "blue"] and schema["required"] == ["choice"]
    assert chosen("openai", json.dumps({"choice": "blue"})) == "blue"
    assert chosen("openai", "not json") == "not json"  # then not an option: the caller's error
    assert chosen("llamacpp", "blue") == "blue"


def test_gbnf_literals_escape_what_the_grammar_would_read():
    assert gbnf_literal('say "hi"') == r'"say \"hi\""'
    assert gbnf_literal("a\\b[c]") == r'"a\\b\[c\]"'
    assert gbnf_literal("line\nnext\ttab\x01") == r'"line\nnext\ttab\x01"'
    assert gbnf_literal("café") == '"café"'
