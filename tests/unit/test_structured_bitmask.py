"""apply_bitmask: one layout for both backends, compact rows, padded vocabularies."""

from __future__ import annotations

import pytest
import torch

from banyan.structured import StructuredOutputSpec, allocate_bitmask, apply_bitmask
from banyan.structured.bitmask import allowed_tokens, bitmask_words
from tests.unit.structured_helpers import BACKEND_NAMES, backend, tokenizer


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows) -> torch.Tensor:
    """Token by token: the bit (t % 32) of word t // 32; tokens past the mask are disallowed."""
    out = logits.clone()
    for j, row in enumerate(rows):
        for t in range(logits.shape[1]):
            word = t // 32
            if word >= bitmask.shape[1] or not (int(bitmask[j, word]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [70, 96, 130])  # mask covers 96 tokens: fewer, equal, more logits
def test_apply_bitmask_matches_the_bit_by_bit_reference(vocab):
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, bitmask_words(96)), dtype=torch.int32, generator=generator)
    logits = torch.randn(5, vocab, generator=generator)

    every = logits.clone()
    apply_bitmask(every[:3], bitmask)
    assert torch.equal(every[:3], _reference(logits[:3], bitmask, range(3)))

    compact = logits.clone()
    apply_bitmask(compact, bitmask, rows=[4, 0, 2])  # bitmask row j masks logits row rows[j]
    assert torch.equal(compact, _reference(logits, bitmask, [4, 0, 2]))
    assert torch.equal(compact[[1, 3]], logits[[1, 3]])  # unconstrained rows untouched

    consecutive = logits.clone()
    apply_bitmask(consecutive, bitmask, rows=[1, 2, 3])  # filled in place
    assert torch.equal(consecutive, _reference(logits, bitmask, [1, 2, 3]))

    untouched = logits.clone()
    apply_bitmask(untouched, bitmask, rows=[])
    assert torch.equal(untouched, logits)


def test_allocate_bitmask_starts_all_allowed():
    bitmask = allocate_bitmask(4, 100)
    assert bitmask.shape == (4, 4) and bitmask.dtype == torch.int32 and bool((bitmask == -1).all())
    assert allowed_tokens(bitmask, 0, 100).tolist() == list(range(100))


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_both_backends_fill_the_same_layout(name):
    """For a choice, the first allowed tokens are exactly those that start one of the strings."""
    tok, b = tokenizer("tiny"), backend(name)
    bitmask = allocate_bitmask(1, b.vocab_size)
    b.matcher(b.compile(StructuredOutputSpec.choice(["quick", "lazy"]))).fill_bitmask(bitmask, 0)
    allowed = {tok.decode([t]) for t in allowed_tokens(bitmask, 0, b.vocab_size).tolist()}
    assert allowed and all("quick".startswith(s) or "lazy".startswith(s) for s in allowed)
    assert {"q", "l"} <= allowed


def test_the_backends_agree_on_the_layout():
    """Same bits for the same tokens; later steps may differ (llguidance also drops tokens that
    would make a non-canonical tokenization), but both allow the tokenizer's own next token."""
    tok = tokenizer("tiny")
    masks = []
    for name in BACKEND_NAMES:
        b = backend(name)
        m = b.matcher(b.compile(StructuredOutputSpec.choice(["the lazy dog", "the quick fox"])))
        rows = allocate_bitmask(8, b.vocab_size)
        for step, token in enumerate(tok.encode("the quick fox")):
            m.fill_bitmask(rows, step)
            assert token in allowed_tokens(rows, step, b.vocab_size).tolist()
            assert m.accept_token(token)
        masks.append(rows)
    assert torch.equal(masks[0][0], masks[1][0])


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_batch_fill_equals_one_by_one(name):
    tok, b = tokenizer("tiny"), backend(name)
    compiled = b.compile(StructuredOutputSpec.json({"type": "object", "properties": {"a": {"type": "string"}}}))
    prefixes = ["", "{", '{"a', '{"a":"x', '{"a":"xy"}']
    matchers = [b.matcher(compiled) for _ in prefixes]
    for m, prefix in zip(matchers, prefixes):
        assert m.accept_tokens(tok.encode(prefix))
    batch, single = allocate_bitmask(8, b.vocab_size), allocate_bitmask(8, b.vocab_size)
    rows = [6, 0, 3, 1, 5]  # any rows, any order
    b.fill_bitmasks(batch, list(zip(rows, matchers)))
    for row, m in zip(rows, matchers):
        m.fill_bitmask(single, row)
    assert torch.equal(batch, single)


class CrashingMatcher:
    """A matcher whose grammar library raises (RELIABILITY C4 G7)."""

    error = ""

    def fill_bitmask(self, bitmask, row):
        raise RuntimeError("library panic")


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_a_failing_matcher_gets_an_error_and_an_empty_row_and_the_others_their_masks(name):
    b = backend(name)
    compiled = b.compile(StructuredOutputSpec.regex("[0-9]+"))
    good, crashing, other = b.matcher(compiled), CrashingMatcher(), b.matcher(compiled)
    batch, single = allocate_bitmask(3, b.vocab_size), allocate_bitmask(3, b.vocab_size)
    b.fill_bitmasks(batch, [(0, good), (1, crashing), (2, other)])
    good.fill_bitmask(single, 0)
    assert "library panic" in crashing.error and not batch[1].any()
    assert torch.equal(batch[0], single[0]) and torch.equal(batch[2], single[0]) and not good.error


def test_make_backend_names_the_choices_and_checks_the_vocabulary():
    from banyan.structured import make_backend

    with pytest.raises(ValueError, match="llguidance, xgrammar"):
        make_backend("outlines", tokenizer("tiny"), 1000)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        make_backend("llguidance", tokenizer("tiny"), 100)
