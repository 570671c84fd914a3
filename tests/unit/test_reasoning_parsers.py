"""Reasoning parsers (banyan/text/reasoning.py): the thinking split from the answer, whole or streamed in any
pieces, and the engine's grammar gate read from the prompt."""

from __future__ import annotations

import pytest

from banyan.registry import UnknownChoiceError
from banyan.text.reasoning import REASONING_PARSERS, GrammarGate, ReasoningSplitter, splitters

QWEN3 = REASONING_PARSERS.get("qwen3")
R1 = REASONING_PARSERS.get("deepseek_r1")


def streamed(fmt, text: str, size: int, prompt_open: bool = False) -> tuple[str, str]:
    split = ReasoningSplitter(fmt, prompt_open)
    pieces = [split.feed(text[i:i + size]) for i in range(0, len(text), size)] + [split.finish()]
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces)


@pytest.mark.parametrize("fmt, prompt_open, text, expected", [
    (QWEN3, False, "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    (QWEN3, False, "  <think>a</think>b", ("a", "b")),
    (QWEN3, False, "Paris, without thinking.", ("", "Paris, without thinking.")),
    (QWEN3, False, "<thin", ("", "<thin")),  # a half marker at the end is text
    (QWEN3, True, "still thinking </think> done", ("still thinking ", " done")),
    (R1, True, "reasoning</think>answer", ("reasoning", "answer")),
    (R1, True, "cut short by max_tokens <", ("cut short by max_tokens <", "")),
    (QWEN3, False, "<think>x</think>y</think>z", ("x", "y</think>z")),  # one reasoning block
])
def test_split_whole_and_in_every_piece_size(fmt, prompt_open, text, expected):
    assert ReasoningSplitter(fmt, prompt_open).parse(text) == expected
    for size in (1, 2, 3, 7, len(text)):
        assert streamed(fmt, text, size, prompt_open) == expected, size


def test_a_marker_split_across_pieces_never_leaks():
    split = ReasoningSplitter(QWEN3)
    assert split.feed("<th") == ("", "")
    assert split.feed("ink>abc</th") == ("abc", "")
    assert split.feed("ink>def") == ("", "def")


def test_the_prompt_decides_where_a_reply_starts():
    assert QWEN3.open_in("<|im_start|>assistant\n<think>\n") and not QWEN3.open_in("<|im_start|>assistant\n")
    assert not QWEN3.open_in("assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert R1.open_in("<｜Assistant｜>") and R1.open_in("<think>\n") and not R1.open_in("<think></think>")
    assert splitters(None, "x") is None
    assert splitters("deepseek_r1", "q")().parse("a</think>b") == ("a", "b")
    with pytest.raises(UnknownChoiceError, match="qwen3"):
        splitters("nope", "x")


def test_grammar_gate_follows_the_prompt_as_the_splitter_does():
    qwen3, r1 = GrammarGate(start_id=7, end_id=8), GrammarGate(start_id=7, end_id=8, starts_open=True)
    assert qwen3.for_prompt([1, 7, 3]) == (8, None)  # left open: wait for the end
    assert qwen3.for_prompt([1, 7, 8, 3]) == (None, None)  # closed (enable_thinking false): the grammar at once
    assert qwen3.for_prompt([8, 7, 3]) == (8, None)
    assert qwen3.for_prompt([1, 2, 3]) == (None, (7, 8))  # the reply's first token decides
    assert r1.for_prompt([1, 2, 3]) == (8, None)  # deepseek_r1 replies start inside the reasoning
    assert r1.for_prompt([7, 8]) == (None, None)
