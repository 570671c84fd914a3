"""Tool calls as specifications: the grammar admits exactly well-formed calls of the offered tools,
the parser reads them back (whole or streamed in any split), and the prompt carries tools and history."""

from __future__ import annotations

import functools
import json
import random

import jsonschema
import pytest

from banyan.errors import InvalidParameterError
from banyan.structured import make_backend
from banyan.tools import HERMES, JSON_LIST, LLAMA3_JSON, ToolCalling, ToolCallParser, detect_format, marker_token_ids
from tests.factories import CHATML_TEMPLATE, HERMES_TEMPLATE, make_tokenizer
from tests.unit.structured_helpers import sample

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
                                            "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 5}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
FORMATS = [HERMES, JSON_LIST, LLAMA3_JSON]


@functools.cache
def tokenizer(hermes: bool):
    return make_tokenizer(tool_template=hermes)


def call_text(fmt, name: str, arguments: dict) -> str:
    return f'{fmt.call_open}{{"name": "{name}", "{fmt.arguments_key}": {json.dumps(arguments)}}}{fmt.call_close}'


def reply(fmt, *calls) -> str:
    return fmt.section_open + fmt.call_separator.join(call_text(fmt, *c) for c in calls) + fmt.section_close


def assert_valid(calls, names=tuple(SCHEMAS)):
    for call in calls:
        assert call.complete and call.name in names and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


# -- the parser -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_parser_reads_content_and_calls(fmt):
    text = reply(fmt, ("get_weather", {"city": "Pa\"}ris", "unit": "c"}), ("add", {"a": 1, "b": [True]}))
    if fmt.trigger:
        text = "Let me check. " + text
    content, calls = ToolCallParser(fmt).parse(text)
    assert content == ("Let me check. " if fmt.trigger else "")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Pa\"}ris", "unit": "c"}), ("add", {"a": 1, "b": [True]})]
    assert_valid(calls[1:])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_streamed_in_any_split_the_deltas_add_up_to_the_whole(fmt):
    text = ("Hi <tool " if fmt.trigger else "") + reply(fmt, ("add", {"a": 10, "b": []}), ("get_weather", {"city": "Rome", "unit": "f"}))
    whole_content, whole_calls = ToolCallParser(fmt).parse(text)
    rng = random.Random(0)
    for _ in range(50):
        parser, content, names, arguments, at = ToolCallParser(fmt), "", {}, {}, 0
        while at < len(text):
            step = rng.randint(1, 7)
            piece, deltas = parser.feed(text[at:at + step])
            at += step
            content += piece
            assert len({d.index for d in deltas}) == len(deltas)  # one delta per call per piece, as OpenAI's chunks
            for d in deltas:
                assert (d.id is not None) == (d.index not in names)  # the id and name come first, once
                if d.id is not None:
                    names[d.index] = d.name
                arguments[d.index] = arguments.get(d.index, "") + d.arguments
        content += parser.finish()[0]
        assert content == whole_content
        assert [names[i] for i in sorted(names)] == [c.name for c in whole_calls]
        assert [arguments[i] for i in sorted(arguments)] == [c.arguments for c in whole_calls]


def test_text_that_only_looks_like_a_trigger_is_content():
    assert ToolCallParser(HERMES).parse("a <tool_cal b <tool") == ("a <tool_cal b <tool", [])
    assert ToolCallParser(LLAMA3_JSON).parse("  Sure {not a call}") == ("  Sure {not a call}", [])


def test_a_llama3_call_may_open_with_the_python_tag():
    content, [call] = ToolCallParser(LLAMA3_JSON).parse('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": []}}')
    assert content == "" and call.name == "add" and call.complete


@pytest.mark.parametrize("cut", ['{"a": 1', '{"a": 1, "b": [true]', '{"a": 1, "b": [true]}'])
def test_a_call_cut_short_is_reported_incomplete(cut):
    """Even whole arguments make no complete call until the call object closes."""
    parser = ToolCallParser(JSON_LIST)
    _, [call] = parser.parse('<tool_call>[{"name": "add", "arguments": ' + cut)
    assert call.arguments == cut and not call.complete and not parser.all_complete


def test_calls_are_all_complete_only_when_the_last_one_is():
    parser = ToolCallParser(HERMES)
    parser.feed(call_text(HERMES, "add", {"a": 1, "b": []}))
    assert parser.all_complete
    parser.feed('\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro')
    assert not parser.all_complete and [c.complete for c in parser.calls] == [True, False]


# -- the grammar, sampled over random logits -----------------------------------------------------
def grammar_backend(hermes: bool):
    tok = tokenizer(hermes)
    return tok, make_backend("llguidance", tok, vocab_size=len(tok), eos_token_ids=[tok.eos_token_id])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("mode", ["required", "named"])
def test_required_and_named_replies_always_parse_and_validate(fmt, mode):
    hermes = fmt is HERMES
    tok, backend = grammar_backend(hermes)
    choice = {"type": "function", "function": {"name": "add"}} if mode == "named" else "required"
    calling = ToolCalling.from_request(fmt, TOOLS, choice, None)
    names = ("add",) if mode == "named" else tuple(SCHEMAS)

    def check(text):
        content, calls = ToolCallParser(fmt).parse(text)
        assert content.strip() == "" and calls, text
        assert len(calls) == 1 or mode == "required"
        assert_valid(calls, names)

    texts, unfinished = sample(backend, tok, calling.spec(marker_token_ids(tok, fmt)), check, n=50, max_steps=300)
    assert len(texts) >= 25, f"only {len(texts)} of 50 finished ({unfinished} ran out of steps)"


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_auto_replies_are_text_or_valid_calls(fmt):
    tok, backend = grammar_backend(fmt is HERMES)
    calling = ToolCalling.from_request(fmt, TOOLS, "auto", None)

    def check(text):
        _, calls = ToolCallParser(fmt).parse(text)
        assert_valid(calls)

    sample(backend, tok, calling.spec(marker_token_ids(tok, fmt)), check, n=30, max_steps=200)


def test_auto_forces_a_valid_call_after_the_marker_token():
    tok, backend = grammar_backend(True)
    matcher = backend.matcher(backend.compile(ToolCalling.from_request(HERMES, TOOLS, "auto", False).spec(marker_token_ids(tok, HERMES))))
    assert matcher.accept_tokens(tok.encode("Checking. ") + [tok.convert_tokens_to_ids("<tool_call>")])
    assert matcher.accept_tokens(tok.encode("\n"))
    assert not matcher.accept_token(tok.encode("x")[0])  # free text is over: only a call may follow


# -- requests and prompts -------------------------------------------------------------------------
def test_the_format_is_read_from_the_template():
    assert detect_format(HERMES_TEMPLATE) is HERMES
    assert detect_format(CHATML_TEMPLATE) is JSON_LIST
    llama3 = "{% for m in messages %}<|start_header_id|>{{ m.role }}{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
    assert detect_format(llama3) is LLAMA3_JSON


def test_markers_that_are_added_tokens_are_used_as_tokens():
    assert marker_token_ids(tokenizer(True), HERMES) == {"<tool_call>": 384, "</tool_call>": 385}
    assert marker_token_ids(tokenizer(False), JSON_LIST) == {}


def test_tools_the_template_ignores_are_described_by_banyan():
    calling = ToolCalling.from_request(JSON_LIST, TOOLS, None, None)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "add 1"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "add", "arguments": {"a": 1, "b": []}}}]},
               {"role": "tool", "tool_call_id": "c", "content": "1"}]
    messages, template_tools = calling.template_inputs(history)
    assert template_tools is None
    assert messages[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": []}}]</tool_call>'
    assert "tool_calls" not in messages[2] and messages[3] == history[3]


def test_tool_choice_none_leaves_tools_out():
    calling = ToolCalling.from_request(HERMES, TOOLS, "none", None)
    assert not calling.active and calling.spec({}) is None and calling.parser() is None
    assert calling.template_inputs([{"role": "user", "content": "x"}])[1] is None


@pytest.mark.parametrize("tools, choice, param", [
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    (TOOLS + TOOLS[:1], "auto", "tools[2].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "auto", "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"pattern": "a{1,99999}"}}}}}],
     "auto", "tools[0].function.parameters"),
])
def test_bad_tools_and_choices_are_errors_naming_the_field(tools, choice, param):
    with pytest.raises(InvalidParameterError) as e:
        ToolCalling.from_request(HERMES, tools, choice, None)
    assert e.value.param == param
