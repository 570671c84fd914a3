"""Each typed error says how it reaches an OpenAI client; `error_info` is the one mapping, read by the core,
the server and the offline LLM alike."""

from __future__ import annotations

import msgspec
import pytest

from banyan.errors import (
    BanyanError,
    CacheCapacityError,
    ContextLengthExceededError,
    ErrorInfo,
    InvalidParameterError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedModelError,
    error_info,
)
from banyan.ipc.client import EngineDeadError, RequestError
from banyan.ipc.core_process import failed_delta
from banyan.server.errors import APIError, error_body, from_banyan_error
from banyan.structured.spec import StructuredOutputError
from banyan.text.chat_template import ChatTemplateError


@pytest.mark.parametrize("cls, status, type_, code", [
    (BanyanError, 500, "server_error", None),
    (InvalidRequestError, 400, "invalid_request_error", None),
    (InvalidParameterError, 400, "invalid_request_error", None),
    (ContextLengthExceededError, 400, "invalid_request_error", "context_length_exceeded"),
    (CacheCapacityError, 400, "invalid_request_error", "request_too_large"),
    (StructuredOutputError, 400, "invalid_request_error", None),
    (ChatTemplateError, 400, "invalid_request_error", None),
    (ModelLoadError, 500, "server_error", None),
    (UnsupportedModelError, 500, "server_error", None),
    (EngineDeadError, 500, "server_error", "engine_dead"),
])
def test_each_error_class_carries_its_status_type_and_code(cls, status, type_, code):
    assert (cls.status, cls.type, cls.code) == (status, type_, code)


@pytest.mark.parametrize("error, expected", [
    (InvalidParameterError("top_k", "must be >= -1"), ErrorInfo("top_k: must be >= -1", param="top_k")),
    (ContextLengthExceededError("too long"),
     ErrorInfo("prompt: too long", param="prompt", code="context_length_exceeded")),
    (CacheCapacityError("needs 900 pages"), ErrorInfo("needs 900 pages", code="request_too_large")),
    (StructuredOutputError("structured_outputs", "uniqueItems is unsupported"),
     ErrorInfo("structured_outputs: uniqueItems is unsupported", param="structured_outputs")),
    (ModelLoadError("no such file"), ErrorInfo("no such file", type="server_error", status=500)),
    (EngineDeadError("core exited with status -9"),
     ErrorInfo("the engine stopped; the server is restarting", type="server_error", code="engine_dead", status=500)),
    (BanyanError("free list corrupt"), ErrorInfo("internal server error", type="server_error", status=500)),
    (RuntimeError("secret internals"), ErrorInfo("internal server error", type="server_error", status=500)),
])
def test_the_one_mapping(error, expected):
    assert error_info(error) == expected


def test_a_request_error_from_the_core_maps_back_to_what_the_core_sent():
    sent = ErrorInfo("prompt: too long", param="prompt", code="context_length_exceeded")
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=ErrorInfo)
    assert error_info(RequestError(received)) == sent


def test_the_server_answers_with_the_same_mapping():
    error = ContextLengthExceededError("too long")
    api = from_banyan_error(error)
    info = error_info(error)
    assert (api.status, api.message, api.type, api.param, api.code) == (
        info.status, info.message, info.type, info.param, info.code)
    assert error_body(api) == {"error": {"message": info.message, "type": info.type, "param": info.param,
                                         "code": info.code}}
    assert from_banyan_error(api) is api and error_info(api).status == api.status


def test_the_core_reports_a_request_refused_at_add_as_a_delta_with_its_error():
    delta = failed_delta("r1", CacheCapacityError("needs 900 pages"))
    assert (delta.request_id, delta.finish_reason, delta.new_token_ids) == ("r1", "error", [])
    assert delta.error == ErrorInfo("needs 900 pages", code="request_too_large")
    malformed = failed_delta("r2", msgspec.ValidationError("Expected `int`, got `str`"))
    assert (malformed.error.status, malformed.error.message) == (400, "invalid request: Expected `int`, got `str`")
    assert failed_delta("r3", KeyError("secret")).error.message == "internal server error"
