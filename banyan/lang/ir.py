"""What a program appends to its state: text, generation calls, choices and role markers.

`s += expr` takes any of these; `+` joins them into a sequence (`"Q: " + bl.gen("a")`). Nothing here
talks to a model: the state's executor (state.py) interprets the expressions in order.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from banyan.errors import InvalidParameterError

ROLES = ("system", "user", "assistant")


class Expr:
    """Something a state can append; `a + b` is the sequence a then b."""

    def __add__(self, other: Any) -> Sequence:
        return Sequence([*_items(self), *_items(as_expr(other))])

    def __radd__(self, other: Any) -> Sequence:
        return Sequence([*_items(as_expr(other)), *_items(self)])


@dataclass
class Text(Expr):
    text: str


@dataclass
class Sequence(Expr):
    items: list[Expr]


@dataclass
class SamplingOptions:
    """A gen's sampling settings; None: the program's default (run(...)), else the backend's."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None

    def over(self, defaults: SamplingOptions) -> SamplingOptions:
        """These settings, with `defaults` where these say None."""
        return SamplingOptions(**{f.name: _first(getattr(self, f.name), getattr(defaults, f.name)) for f in fields(self)})

    def given(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class Gen(Expr):
    """Generate text; stored under `name` when given. At most one of regex / json_schema constrains it."""

    name: str | None
    sampling: SamplingOptions
    regex: str | None = None
    json_schema: str | dict | None = None


@dataclass
class Select(Expr):
    """Append the most likely of `choices` (length-normalised log-probability), stored under `name`."""

    name: str | None
    choices: list[str]
    temperature: float = 0.0


@dataclass
class RoleBegin(Expr):
    role: str


@dataclass
class RoleEnd(Expr):
    role: str


def as_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise InvalidParameterError("expr", f"a program appends text, gen, select or roles, not {type(value).__name__}")


def _items(expr: Expr) -> list[Expr]:
    return list(expr.items) if isinstance(expr, Sequence) else [expr]


def _first(value, default):
    return default if value is None else value


# -- the constructors programs call ----------------------------------------------------------------
def gen(name: str | None = None, max_tokens: int | None = None, *, min_tokens: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None, temperature: float | None = None,
        top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
        frequency_penalty: float | None = None, presence_penalty: float | None = None, ignore_eos: bool | None = None,
        seed: int | None = None, regex: str | None = None, json_schema: str | dict | None = None,
        choices: list[str] | None = None) -> Expr:
    """A generation call (SGLang's gen). With `choices` it is a select."""
    if choices is not None:  # SGLang's gen(choices=...): a select, whatever the sampling settings
        return select(name, choices)
    if regex is not None and json_schema is not None:
        raise InvalidParameterError("regex", "cannot be combined with json_schema")
    sampling = SamplingOptions(max_tokens, min_tokens, stop, stop_token_ids, temperature, top_p, top_k, min_p,
                               frequency_penalty, presence_penalty, ignore_eos, seed)
    return Gen(name, sampling, regex, json_schema)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0) -> Select:
    """Choose among `choices` by length-normalised log-probability (SGLang's token_length_normalized)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidParameterError("choices", "select needs a non-empty list of non-empty strings")
    if temperature != 0.0:
        raise InvalidParameterError("temperature", "select chooses the most likely option; only 0 is supported")
    return Select(name, list(choices), temperature)


def _role(role: str, content: Any) -> Expr:
    if content is None:
        return RoleBegin(role)
    return RoleBegin(role) + as_expr(content) + RoleEnd(role)


def system(content: Any = None) -> Expr:
    return _role("system", content)


def user(content: Any = None) -> Expr:
    return _role("user", content)


def assistant(content: Any = None) -> Expr:
    return _role("assistant", content)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")
