"""Chat templates: banyan's own sandboxed renderer, with typed errors and caps on output and time.

Chat templates are untrusted code (a request may carry one; a model repository ships one), so banyan
renders them itself in jinja2's immutable sandbox, with the same helpers Hugging Face provides
(`raise_exception`, `strftime_now`, `tojson`, `{% generation %}`), typed errors, an output cap and a
time cap. A sandbox bounds what a template can reach, not how long it runs, so the render counts its
own work: every loop turn and every call, attribute or item lookup goes through the sandbox, which
looks at the clock (and a cancel event) every few hundred of them and stops the render there
(RELIABILITY M1). A render past its cap ends in its own thread and uses no CPU after.

Works for any transformers `PreTrainedTokenizerBase` (fast, slow, or built from GGUF metadata).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from banyan.errors import InvalidParameterError

DEFAULT_MAX_CHARS = 4 * 1024 * 1024
"""Longest rendered chat, in characters."""
DEFAULT_RENDER_TIMEOUT = 5.0
"""Longest a chat template may render, in seconds."""


# -- chat templates -------------------------------------------------------------------------------
class ChatTemplateError(InvalidParameterError):
    """The chat template does not compile, does something unsafe, or rejects the messages."""


SPECIAL_TOKEN_NAMES = frozenset(
    ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
     "additional_special_tokens")
)
RESERVED_TEMPLATE_KWARGS = SPECIAL_TOKEN_NAMES | {
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "max_chars", "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "raise_exception", "strftime_now", "namespace",
    "dict", "range", "cycler", "joiner", "lipsum",
}
"""Names a caller's template kwargs may not set: they would override what banyan passes the template."""

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_MAX_REPEAT = DEFAULT_MAX_CHARS  # `'a' * n` and `[x] * n` in a template may build at most this many items
_MAX_POWER_BITS = 1 << 16


class _TemplateRaised(TemplateError):
    """`raise_exception(...)` called by the template: it rejects the messages."""


class _RenderStopped(Exception):
    """The render ran out of time or was cancelled (not a TemplateError: nothing in jinja catches it)."""


class _Budget:
    """The work a render may still do: `tick()` once per loop turn or sandbox hook; every CHECK_EVERY
    ticks (~20 µs of template work) it looks at the clock and the cancel event."""

    CHECK_EVERY = 256

    def __init__(self, seconds: float | None, cancel: threading.Event | None):
        self.seconds = seconds
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.cancel = cancel
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks % self.CHECK_EVERY:
            return
        if self.cancel is not None and self.cancel.is_set():
            raise _RenderStopped("cancelled")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise _RenderStopped("out of time")


_budget: ContextVar[_Budget] = ContextVar("banyan_render_budget", default=_Budget(None, None))
"""The budget of the render running in this thread (set by _render)."""


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, stricter in two ways: reaching an unsafe attribute raises at once (instead of
    rendering as an empty string), and `*` / `**` cannot build huge strings, lists or numbers."""

    intercepted_binops = frozenset({"*", "**"})

    def budgeted(self, iterable: Iterable) -> Iterator:
        """What each `{% for %}` iterates (see _compile): the items, a tick each."""
        budget = _budget.get()
        for item in iterable:
            budget.tick()
            yield item

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        _budget.get().tick()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget.get().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget.get().tick()
        return super().getitem(obj, argument)

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _MAX_REPEAT:
                    raise SecurityError(f"the template builds a sequence of more than {_MAX_REPEAT} items")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right * abs(left).bit_length() > _MAX_POWER_BITS:
                raise SecurityError(f"the template computes a number of more than {_MAX_POWER_BITS} bits")
        return super().call_binop(context, operator, left, right)


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed attributes (as Hugging Face's)."""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_attribute_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_attribute_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_attribute_name(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (Hugging Face's assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message):
    raise _TemplateRaised(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Like Hugging Face's: no HTML escaping, and the json.dumps options templates use
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        namespace=_SafeNamespace,
        dict=lambda *args, **kwargs: dict(*args, **kwargs),
    )
    del env.globals["lipsum"]  # one call could run for minutes, out of the budget's sight
    tree = env.parse(source)
    for loop in tree.find_all(jinja2.nodes.For):  # {% for x in xs %} -> {% for x in environment.budgeted(xs) %}
        budgeted = jinja2.nodes.EnvironmentAttribute("budgeted", lineno=loop.lineno)
        loop.iter = jinja2.nodes.Call(budgeted, [loop.iter], [], None, None, lineno=loop.lineno)
    return env.from_string(tree)


def render_chat_template(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
    timeout: float | None = DEFAULT_RENDER_TIMEOUT,
    cancel: threading.Event | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render `messages` into a prompt string with `chat_template` (a template, or the name of one of the
    tokenizer's templates), else the tokenizer's own.

    Extra template variables (e.g. `enable_thinking`) come from `chat_template_kwargs` (pass request-
    supplied ones here, never by spreading them into this call) and `**template_kwargs`. Either naming
    something banyan sets itself (RESERVED_TEMPLATE_KWARGS: messages, tools, bos_token, ...) raises
    InvalidParameterError(param="chat_template_kwargs") rather than being dropped silently.

    Raises ChatTemplateError with param "chat_template" when the template does not compile, is missing,
    does something unsafe, runs longer than `timeout` seconds or is cancelled (`cancel` set: the render
    stops within microseconds), and with param "messages" when it rejects the messages;
    InvalidParameterError when the rendered text would exceed `max_chars`.
    """
    extra = {**(chat_template_kwargs or {}), **template_kwargs}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(extra))
    if reserved:
        raise InvalidParameterError("chat_template_kwargs", f"cannot set {', '.join(reserved)}: banyan sets them")
    if add_generation_prompt and continue_final_message:
        raise InvalidParameterError(
            "continue_final_message", "cannot be combined with add_generation_prompt (start or continue a message)"
        )
    template = _compile_or_raise(resolve_template(tokenizer, chat_template, tools))
    messages = [{k: v for k, v in _plain(m).items() if v is not None} for m in _check_messages(messages)]
    final_text = _tag_final_message(messages) if continue_final_message else None
    context = {
        **{k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)},
        **_plain(extra),
        "messages": messages,
        "tools": _plain(tools),
        "documents": _plain(documents),
        "add_generation_prompt": add_generation_prompt,
    }
    text = _render(template, context, max_chars, _Budget(timeout, cancel))
    return text if final_text is None else _cut_at_final_message(text, final_text)


def resolve_template(tokenizer, chat_template: str | None, tools) -> str:
    """The template source a chat renders with: the one given (or one of the tokenizer's named
    templates), else the tokenizer's own ("tool_use" when there are tools and it has one)."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, Mapping):  # named templates, e.g. {"default": ..., "tool_use": ...}
        if chat_template in own:
            return own[chat_template]
        own = own.get("tool_use") if tools and "tool_use" in own else own.get("default")
    template = chat_template if chat_template is not None else own
    if not template:
        raise ChatTemplateError(
            "chat_template", "the model's tokenizer has no chat template; supply one (e.g. --chat-template)"
        )
    if not isinstance(template, str):
        raise ChatTemplateError("chat_template", f"must be a string, got {type(template).__name__}")
    return template


def _compile_or_raise(source: str) -> jinja2.Template:
    try:
        return _compile(source)
    except TemplateSyntaxError as e:
        raise ChatTemplateError("chat_template", f"does not compile: {e.message} (line {e.lineno})") from None
    except TemplateError as e:  # e.g. an unknown extension tag
        raise ChatTemplateError("chat_template", f"does not compile: {e}") from None


def _render(template: jinja2.Template, context: dict, max_chars: int, budget: _Budget) -> str:
    pieces, size = [], 0
    token = _budget.set(budget)
    try:
        for piece in template.generate(**context):
            size += len(piece)
            if size > max_chars:
                raise InvalidParameterError("messages", f"the rendered chat exceeds {max_chars} characters")
            pieces.append(piece)
    except InvalidParameterError:
        raise
    except _RenderStopped as e:
        reason = "was cancelled" if str(e) == "cancelled" else f"ran for more than {budget.seconds:g} s"
        raise ChatTemplateError("chat_template", f"the chat template {reason}") from None
    except SecurityError as e:
        raise ChatTemplateError("chat_template", f"unsafe operation in the chat template: {e}") from None
    except _TemplateRaised as e:
        raise ChatTemplateError("messages", f"rejected by the chat template: {e}") from None
    except (TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError, ArithmeticError,
            RecursionError) as e:
        raise ChatTemplateError("messages", f"the chat template failed on these messages: {e!r}") from None
    finally:
        _budget.reset(token)
    return "".join(pieces)


def _check_messages(messages) -> list[Mapping]:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidParameterError("messages", "must be a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidParameterError(f"messages[{i}]", f"must be an object, got {type(message).__name__}")
    return list(messages)


def _plain(value: Any) -> Any:
    """Rebuild caller data out of plain JSON types, so the template sees no objects with methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) lose their extra methods
        return str.__str__(value)
    if isinstance(value, (int, float)):
        return (int if isinstance(value, int) else float)(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _tag_final_message(messages: list[dict]) -> str:
    """Append a tag to the final message's text, to find where to cut the rendered chat; return that text."""
    final = messages[-1]
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return content
    for block in reversed(content if isinstance(content, list) else []):
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            text, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
            return text
    raise ChatTemplateError("messages", "continue_final_message: the final message has no text to continue")


def _cut_at_final_message(text: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in text or tag not in text:
        raise ChatTemplateError(
            "messages", "continue_final_message: the chat template changes the final message, so it cannot be continued"
        )
    at = text.rindex(tag)
    return text[:at] if text[at:].startswith(_CONTINUE_TAG) else text[:at].rstrip()


