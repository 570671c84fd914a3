"""Structured output: grammars that constrain generation (llguidance default, xgrammar), per-request
matchers, one shared bitmask layout and a bounded, asynchronous compile cache. Needs no GPU, no model."""

from banyan.structured.backend import (
    BACKENDS,
    DEFAULT_BACKEND,
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    make_backend,
)
from banyan.structured.cache import GrammarCache
from banyan.structured.spec import StructuredOutputError, StructuredOutputSpec

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarCache",
    "GrammarMatcher",
    "StructuredOutputError",
    "StructuredOutputSpec",
    "allocate_bitmask",
    "apply_bitmask",
    "make_backend",
]


def __getattr__(name):
    # The bitmask needs torch; import it only when asked for, so SamplingParams (-> spec) stays torch-free.
    if name in ("allocate_bitmask", "apply_bitmask"):
        from banyan.structured import bitmask

        return getattr(bitmask, name)
    raise AttributeError(name)
