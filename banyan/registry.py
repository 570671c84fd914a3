"""Things chosen by name, one registry each (attention backends, model classes, grammar backends, tool-call
formats, RoPE kinds, scheduling policies, quantization methods), all alike:

    ATTENTION_BACKENDS = Registry("attention_backend")
    ATTENTION_BACKENDS.register("triton", "banyan.layers.attention.triton_backend:TritonAttentionBackend")
    ATTENTION_BACKENDS.get("triton")   # the class, its module imported only now: an absent library costs nothing
    ATTENTION_BACKENDS.names()         # ["torch", "triton"], in registration order
    ATTENTION_BACKENDS.get("flash")    # UnknownChoiceError("attention_backend: unknown 'flash'; choose from torch, triton")

An entry is a "module:attribute" path (imported on first get) or the object itself; `@REGISTRY.register("name")`
registers what it decorates. Whether a chosen backend can run on this machine is the backend's own answer
(e.g. AttentionBackend.unavailable_reason), not the registry's.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from banyan.errors import InvalidParameterError

T = TypeVar("T")


class UnknownChoiceError(InvalidParameterError):
    """A name the registry of `param` does not have; the message lists `choices`."""

    def __init__(self, param: str, name: Any, choices: Sequence[str]):
        super().__init__(param, f"unknown {name!r}; choose from {', '.join(choices)}")
        self.choices = tuple(choices)


class Registry(Generic[T]):
    def __init__(self, param: str):
        """param: the setting (or checkpoint field) whose value names an entry; errors name it."""
        self.param = param
        self._entries: dict[str, T | str] = {}

    def register(self, name: str, entry: T | str | None = None) -> Any:
        """Add `entry` ("module:attribute" for a lazy import) under `name`; without an entry, a decorator."""
        if entry is None:
            def decorate(obj: T) -> T:
                self._entries[name] = obj
                return obj

            return decorate
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> T:
        """The entry called `name`, its module imported if it is a path (ImportError passes through)."""
        if name not in self._entries:
            raise UnknownChoiceError(self.param, name, self.names())
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attribute = entry.partition(":")
            return getattr(importlib.import_module(module), attribute)
        return entry

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

