"""OpenAI's error format, and every way a request goes wrong turned into it.

    {"error": {"message": "temperature: Input should be less than or equal to 2 (got 3.0)",
               "type": "invalid_request_error", "param": "temperature", "code": null}}

`param` names the offending field as a path (`messages[0].content`), `code` is set where OpenAI sets
one (`invalid_json`, `context_length_exceeded`, `model_not_found`). Messages never echo more than a
short, truncated piece of what the client sent. banyan's own errors carry their status, type and code
(banyan/errors.py); `from_banyan_error` reads them through `error_info`, the one mapping.

`parse_json_body` is the first thing a route does with a body: it turns bytes into a dict, or raises
APIError for anything that is not a JSON object of finite numbers, 64-bit integers and valid strings,
nested at most MAX_JSON_DEPTH levels (RELIABILITY H1, H2, H6, H7, T6).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from pydantic import ValidationError

from banyan.errors import BanyanError, InvalidParameterError, error_info

MAX_JSON_DEPTH = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_MAX_ECHO = 80  # characters of a client's value quoted back in a message


class APIError(BanyanError):
    """An error to answer with: HTTP status plus OpenAI's error fields (and Retry-After, for 429/503)."""

    public_message = None

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def error_body(error: APIError) -> dict:
    """{"error": {"message", "type", "param", "code"}}: OpenAI's error shape."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def model_not_found(model: str) -> APIError:
    return APIError(404, f"the model {_echo(model)} does not exist", type="NotFoundError", param="model",
                    code="model_not_found")


def from_banyan_error(e: BaseException) -> APIError:
    """The answer for an error raised while handling a request (anything not banyan's own is a 500)."""
    if isinstance(e, APIError):
        return e
    info = error_info(e)
    return APIError(info.status, info.message, type=info.type, param=info.param, code=info.code,
                    retry_after=info.retry_after)


def from_validation_error(e: ValidationError) -> APIError:
    """400 for the first error pydantic found, with `param` the path of the field it concerns."""
    error = e.errors(include_url=False)[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidParameterError):  # raised by a validator, param relative to where it ran
        param = join_path(format_path(error["loc"]), cause.param)
        message = str(cause)[len(cause.param) + 2:]
    else:
        param = format_path(error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] != "missing" and _is_scalar(error.get("input")):
            message += f" (got {_echo(error['input'])})"
    return APIError(400, f"{param}: {message}" if param else message, param=param or None)


def format_path(loc: Sequence[str | int]) -> str:
    """("messages", 0, "content") -> "messages[0].content"; pydantic's union-member tags are left out."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _is_type_tag(part):
            path += f".{part}" if path else part
    return path


def join_path(base: str, relative: str) -> str:
    if not base or not relative:
        return base or relative
    return base + relative if relative.startswith("[") else f"{base}.{relative}"


def _is_type_tag(part: str) -> bool:
    # union members appear in pydantic's loc as "str", "list[int]", "function-after[...]", "ToolCall", ...
    return part in ("str", "int", "float", "bool", "list", "dict") or not part.isidentifier() or part[:1].isupper()


def _is_scalar(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _echo(value) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_ECHO else text[: _MAX_ECHO - 3] + "..."


# -- the body -------------------------------------------------------------------------------------
def parse_json_body(body: bytes) -> dict:
    """The request body as a dict; APIError (400) when it is not a JSON object we can use."""
    if not body.strip():
        raise _invalid_json("the request body is empty; expected a JSON object")
    try:
        value = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise _invalid_json("the request body is not valid UTF-8") from None
    except RecursionError:
        raise _invalid_json(f"the JSON is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as e:  # JSONDecodeError, and integers of more than 4300 digits
        raise _invalid_json(f"the request body is not valid JSON: {_shorten(str(e))}") from None
    if not isinstance(value, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_json_type(value)}")
    _check_values(value)
    return value


def _check_values(root: dict) -> None:
    """Depth, numbers and strings of the whole document, without recursion (a stack of (node, path))."""
    stack: list[tuple[dict | list, tuple]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise APIError(400, f"{format_path(path[:1])}: nested more than {MAX_JSON_DEPTH} levels deep",
                           param=format_path(path[:1]))
        if type(node) is list and set(map(type, node)) == {int} and INT64_MIN <= min(node) and max(node) <= INT64_MAX:
            continue  # a list of token ids, checked in C
        for key, value in node.items() if type(node) is dict else enumerate(node):
            kind = type(value)
            if kind is dict or kind is list:
                stack.append((value, (*path, key)))
            elif kind is int and not INT64_MIN <= value <= INT64_MAX:
                _reject_value(path, key, "integers must fit in 64 bits")
            elif kind is float and not math.isfinite(value):
                _reject_value(path, key, "numbers must be finite (no NaN, Infinity, or values beyond 1.8e308)")
            elif kind is str and not _valid_unicode(value):
                _reject_value(path, key, "strings must be valid Unicode (no lone surrogates)")
            if type(key) is str and not _valid_unicode(key):
                _reject_value(path, key, "keys must be valid Unicode (no lone surrogates)")


def _reject_value(path: tuple, key, message: str):
    param = format_path((*path, key) if isinstance(key, int) or key.isidentifier() else path) or None
    raise APIError(400, f"{param}: {message}" if param else message, param=param)


def _valid_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _invalid_json(message: str) -> APIError:
    return APIError(400, message, code="invalid_json")


def _json_type(value) -> str:
    return {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(type(value), "a number")


def _shorten(text: str) -> str:
    return text if len(text) <= 200 else text[:197] + "..."
