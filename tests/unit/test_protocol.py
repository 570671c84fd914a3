"""The OpenAI request layer as a specification: every hostile or malformed input a body can carry
(RELIABILITY C1, C2, C3 T3/T4, C5 M3/M4) becomes a 400 naming the offending field, and good requests
become the right SamplingParams."""

import json

import pytest
from pydantic import ValidationError

from banyan.errors import (
    BanyanError,
    CacheCapacityError,
    ContextLengthExceededError,
    InvalidParameterError,
    ModelLoadError,
)
from banyan.server.errors import (
    APIError,
    error_body,
    from_banyan_error,
    from_validation_error,
    model_not_found,
    parse_json_body,
)
from banyan.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    messages_for_template,
    parse,
    to_sampling_params,
)
from banyan.text.chat_template import ChatTemplateError

USER = [{"role": "user", "content": "hi"}]


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "Hello", **fields}


def chat(**fields) -> dict:
    return {"model": "m", "messages": USER, **fields}


def encode(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def accept(model, body, default_max_tokens=None):
    request = parse(model, parse_json_body(encode(body)))
    return request, to_sampling_params(request, default_max_tokens=default_max_tokens)


def reject(model, body) -> APIError:
    """The error the server would answer with (validation, then SamplingParams)."""
    try:
        accept(model, body, default_max_tokens=100)
    except BanyanError as e:
        return from_banyan_error(e)
    pytest.fail(f"accepted {body!r:.200}")


# -- C1: the body ---------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [b"{", b"\x80\xff\xfe garbage", b"", b"   \n", b'{"a": 1,}', b"\xef\xbb\xbf{}",
                                  b'{"n": ' + b"9" * 5000 + b"}"], ids=repr)
def test_h1_malformed_json_is_invalid_json(body):
    with pytest.raises(APIError) as info:
        parse_json_body(body)
    assert (info.value.status, info.value.type, info.value.code) == (400, "invalid_request_error", "invalid_json")


@pytest.mark.parametrize("body", [b"[]", b'"x"', b"1", b"null", b"true", b"[{}]"])
def test_h2_json_that_is_not_an_object(body):
    with pytest.raises(APIError) as info:
        parse_json_body(body)
    assert info.value.status == 400 and "must be a JSON object" in info.value.message


@pytest.mark.parametrize("depth", [100_000, 1_000, 65])
def test_h6_deep_nesting_is_400_not_recursion_error(depth):
    for body in ('{"a": ' + "[" * depth + "]" * depth + "}", '{"a": ' + '{"b": ' * depth + "1" + "}" * depth + "}"):
        with pytest.raises(APIError) as info:
            parse_json_body(body.encode())
        assert info.value.status == 400 and "nested" in info.value.message


def test_h6_nesting_within_the_limit_parses():
    assert parse_json_body(('{"a": ' + "[" * 60 + "]" * 60 + "}").encode())["a"]


@pytest.mark.parametrize("text, param", [
    ('{"temperature": NaN}', "temperature"),
    ('{"temperature": Infinity}', "temperature"),
    ('{"temperature": -Infinity}', "temperature"),
    ('{"top_p": 1e400}', "top_p"),
    ('{"n": 1180591620717411303424}', "n"),  # 2^70
    ('{"seed": -9223372036854775809}', "seed"),  # int64 min - 1
    ('{"messages": [{"content": [1, 2, NaN]}]}', "messages[0].content[2]"),
    ('{"logit_bias": {"50256": 1e999}}', "logit_bias"),
    ('{"prompt": "\\ud800"}', "prompt"),  # a lone surrogate (T6)
])
def test_h7_numbers_and_strings_json_cannot_hold(text, param):
    with pytest.raises(APIError) as info:
        parse_json_body(text.encode())
    assert (info.value.status, info.value.param) == (400, param)


def test_h7_int64_bounds_parse():
    assert parse_json_body(b'{"seed": 9223372036854775807, "x": [-9223372036854775808]}')["seed"] == 2**63 - 1


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, completion(temperature="hot"), "temperature"),
    (CompletionRequest, completion(n="2"), "n"),
    (CompletionRequest, completion(n=2.0), "n"),
    (CompletionRequest, completion(stream=1), "stream"),
    (CompletionRequest, completion(logprobs=True), "logprobs"),
    (CompletionRequest, completion(stop=7), "stop"),
    (ChatCompletionRequest, chat(messages={}), "messages"),
    (ChatCompletionRequest, chat(messages="hi"), "messages"),
    (ChatCompletionRequest, chat(logprobs=1), "logprobs"),
    (ChatCompletionRequest, chat(stream_options=[]), "stream_options"),
    (ChatCompletionRequest, {"model": "m"}, "messages"),
    (CompletionRequest, {"model": "m"}, "prompt"),
])
def test_h8_wrong_types_name_the_field(model, body, param):
    error = reject(model, body)
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", param)
    assert error.message.startswith(f"{param}: ")


def test_h8_messages_do_not_echo_huge_values():
    error = reject(CompletionRequest, completion(stop=["x" * 1_000_000]))
    assert error.param == "stop[0]" and len(error.message) < 300


def test_h9_unknown_fields_are_ignored():
    request, _ = accept(CompletionRequest, completion(foo=1, __class__="x", tokenize=True, model_config={}))
    assert not hasattr(request, "foo") and "foo" not in request.model_dump()
    request, _ = accept(ChatCompletionRequest, chat(messages=[{"role": "user", "content": "x", "extra": 1}],
                                                    functions=[], audio=None))
    assert "extra" not in request.messages[0].model_dump()


def test_h10_model_not_found():
    error = model_not_found("gpt-9" * 100)
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model") and len(error.message) < 200


# -- C2: parameter ranges -------------------------------------------------------------------------
BOTH = [CompletionRequest, ChatCompletionRequest]
RANGES = [  # (fields, param): each is a 400 naming param, for completions and chat alike
    (dict(n=0), "n"), (dict(n=-1), "n"), (dict(n=10**6), "n"), (dict(n=2**63), "n"), (dict(n=129), "n"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-5), "max_tokens"), (dict(max_tokens=2**64), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature=2.5), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"),
    (dict(top_k=-2), "top_k"), (dict(presence_penalty=2.1), "presence_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=-1), "repetition_penalty"),
    (dict(logit_bias={"abc": 1}), "logit_bias"), (dict(logit_bias={"-1": 1}), "logit_bias"),
    (dict(logit_bias={"1.5": 1}), "logit_bias"), (dict(logit_bias={str(2**31): 1}), "logit_bias"),
    (dict(logit_bias={"٣": 1}), "logit_bias"),  # a non-ASCII digit
    (dict(logit_bias={"5": 101}), "logit_bias"), (dict(logit_bias={"5": -100.5}), "logit_bias"),
    (dict(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"), (dict(stop=""), "stop[0]"), (dict(stop=["a", ""]), "stop[1]"),
    (dict(stop="x" * (1 << 20)), "stop[0]"),
    (dict(stop_token_ids=[-1]), "stop_token_ids[0]"), (dict(stop_token_ids=[2**31]), "stop_token_ids[0]"),
    (dict(seed=2**63), "seed"), (dict(seed=-(2**63) - 1), "seed"),
    (dict(cache_salt="a b"), "cache_salt"), (dict(cache_salt="x" * 257), "cache_salt"),
    (dict(cache_salt=""), "cache_salt"), (dict(cache_salt="../../etc"), "cache_salt"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(stream=False, stream_options={"include_usage": True}), "stream_options"),
    (dict(priority=2**31), "priority"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
]


@pytest.mark.parametrize("model", BOTH, ids=lambda m: m.__name__)
@pytest.mark.parametrize("fields, param", RANGES, ids=lambda x: repr(x)[:40])
def test_c2_out_of_range_is_400_with_param(model, fields, param):
    body = (completion if model is CompletionRequest else chat)(**fields)
    error = reject(model, body)
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", param), error.message


@pytest.mark.parametrize("fields, param", [
    (dict(best_of=0), "best_of"), (dict(n=3, best_of=2), "best_of"), (dict(best_of=10**9), "best_of"),
    (dict(best_of=2, stream=True), "best_of"),
    (dict(logprobs=6), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(suffix="the end"), "suffix"),
    (dict(prompt=["p"] * 257), "prompt"), (dict(prompt=[[1]] * 257), "prompt"),
])
def test_c2_completions_only(fields, param):
    assert reject(CompletionRequest, completion(**fields)).param == param


@pytest.mark.parametrize("fields, param", [
    (dict(max_completion_tokens=0), "max_completion_tokens"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"), (dict(logprobs=False, top_logprobs=0), "top_logprobs"),
    (dict(response_format={"type": "xml"}), "response_format.type"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}], tool_choice="none"),
     "tools[0].function.name"),
    (dict(tool_choice="sometimes"), "tool_choice"), (dict(tool_choice={"type": "function"}), "tool_choice"),
    (dict(continue_final_message=True), "continue_final_message"),
    (dict(continue_final_message=True, add_generation_prompt=True), "continue_final_message"),
    (dict(chat_template_kwargs=[]), "chat_template_kwargs"),
])
def test_c2_chat_only(fields, param):
    error = reject(ChatCompletionRequest, chat(**fields))
    assert (error.status, error.param) == (400, param), error.message


def test_c2_unsupported_features_say_so():
    assert "not supported" in reject(CompletionRequest, completion(suffix="x")).message


@pytest.mark.parametrize("body", [completion(prompt_embeds="AAAA"), {"prompt_embeds": [[0.5, 1.0]]}])
def test_t7_prompt_embeds_are_refused_not_ignored(body):
    error = reject(CompletionRequest, body)
    assert (error.status, error.param) == (400, "prompt_embeds") and "not supported" in error.message


# -- C3: tokens and lengths -----------------------------------------------------------------------
@pytest.mark.parametrize("prompt, param", [
    ([-1], "prompt[0]"), ([1, 2**31], "prompt[1]"), ([2**63 - 1], "prompt[0]"),
    ([5279552648203111001], "prompt[0]"), ([[1, 2], [3, -1]], "prompt[1][1]"), ([1, True], "prompt[1]"),
    ([1, 2.0], "prompt[1]"), ([1, "a"], "prompt[1]"), ([[1], "a"], "prompt[0]"),
])
def test_t3_token_ids_out_of_range(prompt, param):
    error = reject(CompletionRequest, completion(prompt=prompt))
    assert (error.status, error.param) == (400, param), error.message


@pytest.mark.parametrize("prompt, param", [
    ("", "prompt"), ([], "prompt"), ([[]], "prompt[0]"), ([""], "prompt[0]"), (["a", ""], "prompt[1]"),
    ([[1], []], "prompt[1]"), (None, "prompt"), ({}, "prompt"), (5, "prompt"),
])
def test_t4_empty_prompts(prompt, param):
    assert reject(CompletionRequest, completion(prompt=prompt)).param == param


def test_t2_t3_boundaries_pass():
    request, _ = accept(CompletionRequest, completion(prompt=[0, 2**31 - 1]))
    assert request.prompts == [[0, 2**31 - 1]]
    request, _ = accept(CompletionRequest, completion(prompt=["a"] * 256))
    assert len(request.prompts) == 256
    request, _ = accept(CompletionRequest, completion(prompt=[[1, 2], [3]]))
    assert request.prompts == [[1, 2], [3]]
    assert accept(CompletionRequest, completion(prompt="x"))[0].prompts == ["x"]


# -- C5: messages and chat templates --------------------------------------------------------------
@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": {"text": "x"}}], "messages[0].content"),
    ([{"role": "user", "content": []}], "messages[0].content"),
    ([{"role": "user", "content": ["x"]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {
        "url": "http://169.254.169.254/"}}]}], "messages[0].content[1].type"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "hologram"}]}], "messages[0].content[0]"),
    (USER + [{"role": "tool", "content": "42"}], "messages[1].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[0].tool_calls"),
    ([{"role": "assistant", "content": None}], "messages[0].content"),
    ([{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    (["hi"], "messages[0]"),
    ([{"role": "user", "content": "x", "name": 5}], "messages[0].name"),
])
def test_m4_bad_messages(messages, param):
    error = reject(ChatCompletionRequest, chat(messages=messages))
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", param), error.message


def test_m4_image_parts_say_not_supported():
    parts = [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]
    assert "not supported" in reject(ChatCompletionRequest, chat(messages=[{"role": "user", "content": parts}])).message


def test_m4_good_messages():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "bob"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "", "tool_calls": []},
    ]
    request, _ = accept(ChatCompletionRequest, chat(messages=messages))
    assert messages_for_template(request.messages) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "a\nb", "name": "bob"},
        {"role": "assistant",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "", "tool_calls": []},
    ]


def test_m4_tool_call_arguments_that_are_not_an_object_stay_text():
    deep = "[" * 10_000 + "]" * 10_000
    for arguments in ("not json", "[1, 2]", deep, '{"a": ' * 100 + "1" + "}" * 100):
        call = {"id": "c", "function": {"name": "f", "arguments": arguments}}
        request, _ = accept(ChatCompletionRequest, chat(messages=[{"role": "assistant", "tool_calls": [call]}]))
        assert messages_for_template(request.messages)[0]["tool_calls"][0]["function"]["arguments"] == arguments


@pytest.mark.parametrize("key", ["tokenize", "return_dict", "add_generation_prompt", "messages", "bos_token",
                                 "continue_final_message", "tools", "chat_template"])
def test_m3_template_kwargs_cannot_set_internals(key):
    error = reject(ChatCompletionRequest, chat(chat_template_kwargs={key: True}))
    assert (error.param, error.status) == ("chat_template_kwargs", 400) and key in error.message


def test_m3_other_template_kwargs_are_kept():
    request, _ = accept(ChatCompletionRequest, chat(chat_template_kwargs={"enable_thinking": False}))
    assert request.chat_template_kwargs == {"enable_thinking": False}


def test_m1_request_template_is_kept_for_the_server_to_judge():
    request, _ = accept(ChatCompletionRequest, chat(chat_template="{{ messages }}"))
    assert request.chat_template == "{{ messages }}"


# -- good requests -> SamplingParams --------------------------------------------------------------
def test_completion_defaults():
    request, params = accept(CompletionRequest, {"prompt": "x"})
    assert request.model is None and request.echo is False and request.stream is False
    assert (params.n, params.temperature, params.top_p, params.max_tokens, params.logprobs) == (1, 1.0, 1.0, 16, None)


def test_completion_maps_every_field():
    _, params = accept(CompletionRequest, completion(
        n=2, best_of=2, temperature=0, top_p=0.5, top_k=40, min_p=0.1, presence_penalty=0.5, frequency_penalty=-1,
        repetition_penalty=1.2, seed=-7, stop="END", stop_token_ids=[2], ignore_eos=True, max_tokens=9, min_tokens=3,
        logprobs=5, logit_bias={"7": -100, "8": 2.5}, include_stop_str_in_output=True, skip_special_tokens=False,
        spaces_between_special_tokens=False, stream=True, stream_options={"include_usage": True}, echo=True,
        user="u", cache_salt="tenant-1:a.b_c", priority=-3))
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (2, 0.0, 0.5, 40, 0.1)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1, 1.2)
    assert (params.seed, params.stop, params.stop_token_ids, params.ignore_eos) == (-7, ["END"], [2], True)
    assert (params.max_tokens, params.min_tokens, params.logprobs) == (9, 3, 5)
    assert params.logit_bias == {7: -100.0, 8: 2.5}
    assert params.include_stop_str_in_output and not params.skip_special_tokens
    assert not params.spaces_between_special_tokens


def test_best_of_reaches_the_sampling_params():
    assert accept(CompletionRequest, completion(n=2, best_of=5))[1].best_of == 5
    assert accept(CompletionRequest, completion(n=2, best_of=2, stream=True))[1].best_of == 2  # no more than n


def test_null_means_default_except_max_tokens():
    request, params = accept(CompletionRequest, completion(
        n=None, stream=None, temperature=None, stop=None, logprobs=None, echo=None, priority=None, best_of=None,
        suffix=None, max_tokens=None), default_max_tokens=77)
    assert (request.n, request.stream, request.echo, params.temperature, params.stop) == (1, False, False, 1.0, [])
    assert params.max_tokens == 77
    _, params = accept(CompletionRequest, completion(max_tokens=None), default_max_tokens=None)
    assert params.max_tokens is None


def test_chat_max_completion_tokens_wins():
    for fields, expected in [(dict(max_tokens=5, max_completion_tokens=7), 7), (dict(max_tokens=5), 5),
                             (dict(max_completion_tokens=7), 7), ({}, 123), (dict(max_tokens=None), 123)]:
        assert accept(ChatCompletionRequest, chat(**fields), default_max_tokens=123)[1].max_tokens == expected


@pytest.mark.parametrize("fields, logprobs", [
    ({}, None), (dict(logprobs=False), None), (dict(logprobs=True), 0), (dict(logprobs=True, top_logprobs=20), 20),
    (dict(logprobs=True, top_logprobs=None), 0),
])
def test_chat_logprobs(fields, logprobs):
    assert accept(ChatCompletionRequest, chat(**fields))[1].logprobs == logprobs


def test_chat_accepted_options():
    request, params = accept(ChatCompletionRequest, chat(
        response_format={"type": "text"}, tools=[{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object"}}}], tool_choice="none", parallel_tool_calls=False,
        add_generation_prompt=False, continue_final_message=True, documents=[{"title": "t", "text": "x"}],
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, user="u", seed=1))
    assert request.tools[0].function.name == "get_weather" and request.tool_choice == "none"
    assert request.continue_final_message and not request.add_generation_prompt
    assert request.stream_options.continuous_usage_stats and params.seed == 1
    request, _ = accept(ChatCompletionRequest, chat(tool_choice={"type": "function", "function": {"name": "f"}}))
    assert request.tool_choice.function.name == "f"
    assert accept(ChatCompletionRequest, chat(tools=[]))[0].tools == []


def test_stop_limits_at_the_boundary():
    _, params = accept(CompletionRequest, completion(stop=["a", "b", "c", "x" * 1024]))
    assert len(params.stop) == 4


# -- tokenize / detokenize ------------------------------------------------------------------------
def test_tokenize_requests():
    request = parse(TokenizeCompletionRequest, {"prompt": "hi"})
    assert request.add_special_tokens
    request = parse(TokenizeChatRequest, {"messages": USER, "add_generation_prompt": False, "foo": 1})
    assert not request.add_special_tokens and not request.add_generation_prompt
    with pytest.raises(APIError) as info:
        parse(TokenizeChatRequest, {"messages": [{"role": "tool", "content": "x"}]})
    assert info.value.param == "messages[0].tool_call_id"
    with pytest.raises(APIError) as info:
        parse(TokenizeChatRequest, {"messages": USER, "chat_template_kwargs": {"tokenize": True}})
    assert info.value.param == "chat_template_kwargs"
    with pytest.raises(APIError) as info:
        parse(TokenizeCompletionRequest, {"prompt": 5})
    assert info.value.param == "prompt"
    assert parse(DetokenizeRequest, {"tokens": [1, 2]}).tokens == [1, 2]
    with pytest.raises(APIError) as info:
        parse(DetokenizeRequest, {"tokens": [1, -2]})
    assert info.value.param == "tokens[1]"


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("error, status, param, code", [
    (InvalidParameterError("top_k", "bad"), 400, "top_k", None),
    (ContextLengthExceededError("prompt (9000 tokens) + max_tokens (16) > max_model_len (8192)"), 400, "prompt",
     "context_length_exceeded"),
    (ChatTemplateError("chat_template", "does not compile"), 400, "chat_template", None),
    (CacheCapacityError("needs 900 pages, the cache holds 800"), 400, None, "request_too_large"),
    (ModelLoadError("no such file"), 500, None, None),
    (RuntimeError("secret internals"), 500, None, None),
])
def test_from_banyan_error(error, status, param, code):
    api = from_banyan_error(error)
    assert (api.status, api.param, api.code) == (status, param, code)
    assert "secret" not in api.message
    body = error_body(api)
    assert body["error"]["message"] == api.message
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_error_body_shape():
    assert error_body(APIError(400, "m", param="n")) == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "n", "code": None}}


def test_from_validation_error_direct():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": USER, "top_p": "x" * 10_000})
    error = from_validation_error(info.value)
    assert error.param == "top_p" and len(error.message) < 200


# -- structured output ------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize("fields, kind", [
    (dict(response_format={"type": "json_object"}), "json_object"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}), "json"),
    (dict(structured_outputs={"regex": "[a-z]+"}), "regex"),
    (dict(guided_json=SCHEMA), "json"),
    (dict(guided_json=json.dumps(SCHEMA)), "json"),
    (dict(guided_regex="[0-9]+"), "regex"),
    (dict(guided_choice=["a", "b"]), "choice"),
    (dict(guided_grammar='root ::= "a"+'), "grammar"),
])
def test_structured_output_fields_become_one_spec(make, fields, kind):
    _, params = accept(ChatCompletionRequest if make is chat else CompletionRequest, make(**fields), default_max_tokens=100)
    assert params.structured_outputs.kind == kind


@pytest.mark.parametrize("fields, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}), "response_format"),
    (dict(structured_outputs={"json": SCHEMA, "regex": "a"}), "structured_outputs"),
    (dict(structured_outputs={"nope": 1}), "structured_outputs"),
    (dict(guided_regex="a{1,99999}"), "guided_regex"),
    (dict(guided_choice=[]), "guided_choice"),
    (dict(guided_json="{not json"), "guided_json"),
    (dict(guided_grammar=""), "guided_grammar"),
    (dict(guided_regex="a", guided_choice=["a"]), "guided_choice"),
])
def test_invalid_structured_output_is_400_naming_the_field(fields, param):
    error = reject(ChatCompletionRequest, chat(**fields))
    assert (error.status, error.param) == (400, param), error.message
