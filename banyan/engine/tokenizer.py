"""Text in and out of the engine: tokenizer loading, chat templates, incremental detokenizing, stop strings.

Everything here works for any transformers `PreTrainedTokenizerBase` (fast, slow, or the ones built
from GGUF metadata) and needs no model and no GPU.

Chat templates are untrusted code (a request may carry one; a model repository ships one), so banyan
renders them itself in jinja2's immutable sandbox, with the same helpers Hugging Face provides
(`raise_exception`, `strftime_now`, `tojson`, `{% generation %}`), typed errors, an output cap and a
time cap. A sandbox bounds what a template can reach, not how long it runs, so the render counts its
own work: every loop turn and every call, attribute or item lookup goes through the sandbox, which
looks at the clock (and a cancel event) every few hundred of them and stops the render there
(RELIABILITY M1). A render past its cap ends in its own thread and uses no CPU after.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from banyan.errors import InvalidParameterError, ModelLoadError

DEFAULT_MAX_CHARS = 4 * 1024 * 1024
"""Longest rendered chat, in characters."""
DEFAULT_RENDER_TIMEOUT = 5.0
"""Longest a chat template may render, in seconds."""


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The Hugging Face tokenizer of a model directory (a `PreTrainedTokenizerBase`)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e


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


# -- chat to token ids, with control tokens in user text kept as text (RELIABILITY M5) ------------
_MARK_START, _MARK_END = "\U000f0000", "\U000f0001"  # private-use code points around user control tokens


def encode_chat(tokenizer, messages: Sequence[Mapping[str, Any]], **render_kwargs: Any) -> tuple[str, list[int]]:
    """Render (as `render_chat_template`) and tokenize a chat. Control tokens the template writes (like
    `<|im_start|>`) become control token ids; the same text inside messages, tools, documents or template
    kwargs is tokenized as plain text, so a user cannot inject a role. Returns (prompt text, token ids);
    for a chat without such text the ids equal `tokenizer.encode(text, add_special_tokens=False)`."""
    controls = _control_tokens(tokenizer)
    control_re = re.compile("|".join(map(re.escape, sorted(controls, key=len, reverse=True))) or "(?!)")
    mark = lambda value: _mark(value, control_re)  # noqa: E731
    for key in ("tools", "documents", "chat_template_kwargs"):
        if render_kwargs.get(key) is not None:
            render_kwargs[key] = mark(render_kwargs[key])
    marked = render_chat_template(tokenizer, mark(list(messages)), **render_kwargs)
    # [text, marked control, text, marked control, ..., text]; None where a lone marker was left behind
    pieces = re.split(f"{_MARK_START}({control_re.pattern}){_MARK_END}|[{_MARK_START}{_MARK_END}]", marked)
    ids = tokenizer.encode(pieces[0], add_special_tokens=False)
    for i, piece in enumerate(pieces[1:], start=1):
        if piece:
            ids += _encode_piece(tokenizer, piece, as_text=i % 2 == 1)
    return "".join(p for p in pieces if p), ids


def _control_tokens(tokenizer) -> set[str]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {t.content for t in added.values() if getattr(t, "special", False)} | set(tokenizer.all_special_tokens)


def _mark(value: Any, control_re: re.Pattern) -> Any:
    if isinstance(value, str):  # drop markers already there, so a user cannot forge a marked token
        value = value.replace(_MARK_START, "").replace(_MARK_END, "")
        return control_re.sub(lambda m: _MARK_START + m.group(0) + _MARK_END, value)
    if isinstance(value, Mapping):
        return {k: _mark(v, control_re) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark(v, control_re) for v in value]
    return value


def _encode_piece(tokenizer, piece: str, as_text: bool) -> list[int]:
    """Encode a piece from the middle of a chat; `as_text` ignores special tokens in it. Encoded after a
    newline (then removed) so SentencePiece does not add the space it puts at the start of a text."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=as_text)

    newline = tokenizer.encode("\n", add_special_tokens=False)
    ids = encode("\n" + piece)
    ids = ids[len(newline):] if ids[: len(newline)] == newline else encode(piece)
    if as_text and tokenizer.convert_tokens_to_ids(piece) in ids:
        raise InvalidParameterError("messages", f"cannot encode {piece!r} as plain text with this tokenizer")
    return ids


def with_special_tokens(tokenizer, ids: list[int]) -> list[int]:
    """`ids` between the special tokens (BOS, ...) the tokenizer adds around a text, found by encoding
    a probe with and without them; `ids` themselves stay as they are (a rendered chat's, say)."""
    probe, full = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("a", add_special_tokens=True)
    start = next((i for i in range(len(full) - len(probe) + 1) if full[i:i + len(probe)] == probe), None)
    if start is None:  # a tokenizer that rewrites the text itself: add nothing rather than guess
        return ids
    return full[:start] + ids + full[start + len(probe):]


# -- detokenizing ---------------------------------------------------------------------------------
def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(i for i, t in added.items() if getattr(t, "special", False)) | set(tokenizer.all_special_ids)


class IncrementalDetokenizer:
    """Turns output token ids into text deltas, O(window) per token.

    Tokens are taken one at a time. Each decodes two short windows of ids and emits the difference:

        self._ids:  | prefix window (already emitted) | new tokens (held) |
                    0                             read_offset            end
        prefix = decode(ids[:read_offset]);  text = decode(ids);  delta = text[len(prefix):]
        after emitting, the new tokens become the prefix window (the old one is dropped).

    The first prefix window is the prompt's last few tokens, so a SentencePiece "▁word" right after
    the prompt keeps its space (the continuation of the prompt, as vLLM). While `text` ends in U+FFFD a
    multi-byte character is incomplete and nothing is emitted (for at most MAX_HOLD tokens, so a model
    emitting invalid bytes cannot grow the window without bound). Skipped special tokens never enter
    the windows. Concatenated deltas equal decode(prompt tail + output)[len(decode(prompt tail)):]:
    decode(output) for byte-level BPE, and for SentencePiece too except for that first space.
    Decoding uses clean_up_tokenization_spaces=False.
    """

    PROMPT_WINDOW = 5
    MAX_HOLD = 16

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._skip = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        self._decode = _plain_decode(tokenizer, skip_special_tokens) or self._decode
        tail = [t for t in prompt_token_ids[-4 * self.PROMPT_WINDOW:] if t not in self._skip]
        self._ids: list[int] = tail[-self.PROMPT_WINDOW:]
        self._read_offset = len(self._ids)  # the prefix window is self._ids[:read_offset]

    def add(self, new_token_ids: Sequence[int]) -> str:
        """The new text the tokens add (possibly empty while a character is incomplete)."""
        return "".join(self._step(t) for t in new_token_ids if t not in self._skip)

    def flush(self) -> str:
        """At the end of the output: whatever is still held back (an incomplete character as U+FFFD)."""
        return self._emit() if len(self._ids) > self._read_offset else ""

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        if len(self._ids) - self._read_offset >= self.MAX_HOLD:
            return self._emit()
        return self._emit(unless_incomplete=True)

    def _emit(self, unless_incomplete: bool = False) -> str:
        prefix = self._decode(self._ids[: self._read_offset])
        text = self._decode(self._ids)
        if unless_incomplete and text.endswith("\ufffd"):
            return ""
        del self._ids[: self._read_offset]  # the new tokens become the next prefix window
        self._read_offset = len(self._ids)
        return text[len(prefix):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )


def _plain_decode(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The Rust tokenizer's own decode when `tokenizer.decode(ids, clean_up_tokenization_spaces=False)`
    is exactly that call (a fast tokenizer that overrides nothing); None otherwise. transformers'
    wrapper costs three times the decode itself, and the detokenizer decodes twice per token."""
    backend = getattr(tokenizer, "_tokenizer", None)
    base = _fast_tokenizer_class()
    if backend is None or base is None or not isinstance(tokenizer, base):
        return None
    cls = type(tokenizer)
    if cls.decode is not base.decode or cls._decode is not base._decode:
        return None
    return partial(backend.decode, skip_special_tokens=skip_special_tokens)


@lru_cache(maxsize=None)
def _fast_tokenizer_class() -> type | None:
    try:  # transformers >= 5
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as fast
    except ImportError:
        try:
            from transformers import PreTrainedTokenizerFast as fast
        except ImportError:
            return None
    return fast


# -- stop strings ---------------------------------------------------------------------------------
class StopStringMatcher:
    """Finds stop strings in streamed text without ever emitting part of one.

    `feed(delta)` returns the text that is safe to emit and, on a match, the stop string; the text after
    a match is dropped and later feeds return nothing. The match is the stop string completed first in
    the stream, so the result does not depend on how the text was cut into deltas. Trailing characters
    that could begin a stop string (at most max(len(stop)) - 1) are held back until they cannot;
    `flush()` returns them at the end.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool):
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped_on: str | None = None
        self._held = ""
        # for each stop string, the prefix lengths k by their last character: s[k - 1] -> [k, ...] descending
        self._prefix_ends: list[tuple[str, dict[str, list[int]]]] = []
        for s in self.stop:
            ends: dict[str, list[int]] = {}
            for k in range(len(s) - 1, 0, -1):
                ends.setdefault(s[k - 1], []).append(k)
            self._prefix_ends.append((s, ends))

    def feed(self, delta: str) -> tuple[str, str | None]:
        if self.stopped_on is not None:
            return "", None
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            at, s = match
            self.stopped_on, self._held = s, ""
            return text[: at + len(s)] if self.include_stop_str_in_output else text[:at], s
        hold = self._partial_match_len(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """The stop string completed first (then the one starting first): what a token-by-token stream
        would have found, however the text was cut into deltas."""
        best = None
        for s in self.stop:
            at = text.find(s)
            if at >= 0 and (best is None or (at + len(s), at) < (best[0] + len(best[1]), best[0])):
                best = (at, s)
        return best

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        if not text:
            return 0
        longest = 0
        for s, ends in self._prefix_ends:
            for k in ends.get(text[-1], ()):
                if k <= longest:
                    break
                if k <= len(text) and text.endswith(s[:k]):
                    longest = k
                    break
        return longest
