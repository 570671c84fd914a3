"""The model-free proposers: ngram (prompt lookup) and suffix decoding, on crafted sequences; their bounds,
the registry, and the suffix trie's memory bound."""

import random
import time

import pytest

from banyan.errors import InvalidParameterError
from banyan.registry import UnknownChoiceError
from banyan.spec import PROPOSERS, make_proposer
from banyan.spec.ngram import NgramProposer
from banyan.spec.suffix import SuffixProposer, SuffixTrie


def test_registry_names_and_unknown_method():
    assert PROPOSERS.names()[:2] == ["ngram", "suffix"]
    assert isinstance(make_proposer("ngram", prompt_lookup_min=1, prompt_lookup_max=3), NgramProposer)
    assert isinstance(make_proposer("suffix"), SuffixProposer)
    with pytest.raises(UnknownChoiceError, match="method"):
        make_proposer("eagle")


# -- ngram ----------------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_last_n_tokens():
    ngram = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3)
    assert ngram.propose("r", [1, 2, 3, 4, 5, 6, 9, 2, 3], max_k=3) == [4, 5, 6]
    assert ngram.propose("s", [1, 2, 3, 4, 5, 6, 9, 2, 3], max_k=10)[:5] == [4, 5, 6, 9, 2]


def test_ngram_prefers_the_longest_n_then_what_followed_most_often():
    ngram = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    # (7, 8) occurs twice; only the first occurrence has 6 before it: the 3-gram (6, 7, 8) wins
    assert ngram.propose("a", [6, 7, 8, 1, 5, 7, 8, 2, 6, 7, 8], max_k=1) == [1]
    # without the 3-gram, (7, 8) was followed by 1 and by 2 once each: the first to lead the vote, 1 (the source
    # text comes first in input-grounded work)
    assert ngram.propose("b", [6, 7, 8, 1, 5, 7, 8, 2, 9, 7, 8], max_k=1) == [1]
    # followed by 2 twice and by 1 once: 2, continued from its latest occurrence (2 then 4, not 2 then 3)
    assert ngram.propose("c", [7, 8, 2, 3, 7, 8, 1, 0, 7, 8, 2, 4, 9, 7, 8], max_k=2) == [2, 4]
    # the vote follows the history as it grows: a third 1 takes the lead back
    tokens = [7, 8, 1, 7, 8, 2, 7, 8, 2, 7, 8]
    assert ngram.propose("d", tokens, max_k=1) == [2]
    tokens += [1, 5, 7, 8, 1, 6, 7, 8]
    assert ngram.propose("d", tokens, max_k=2) == [1, 6]


def test_ngram_bounds_k_min_and_max_n():
    ngram = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=2)
    tokens = [1, 2, 3, 4, 1, 2]
    assert ngram.propose("r", tokens, max_k=2) == [3, 4]
    assert ngram.propose("r", tokens, max_k=0) == []
    assert NgramProposer(prompt_lookup_min=3, prompt_lookup_max=4).propose("r", tokens, max_k=2) == []  # n < 3
    assert NgramProposer(prompt_lookup_min=1, prompt_lookup_max=1).propose("r", [5, 1, 9, 1], max_k=1) == [9]
    with pytest.raises(InvalidParameterError, match="prompt_lookup_min"):
        NgramProposer(prompt_lookup_min=4, prompt_lookup_max=2)


def test_ngram_evidence_is_how_far_back_the_match_goes():
    ngram = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3)
    document = list(range(100, 140))
    # copying: the last 30 tokens repeat the document's first 30, far past the 3 looked up
    assert ngram.propose_with_evidence("copy", document + [1] + document[:30], max_k=2) == ([130, 131], 30)
    # a chance match: 2 tokens, and the token before them differs
    assert ngram.propose_with_evidence("chance", [7, 8, 9, 1, 2, 3, 5, 8, 9], max_k=2) == ([1, 2], 2)
    assert ngram.propose_with_evidence("none", [1, 2, 3], max_k=2) == ([], 0)
    looped = [5] * 200  # a loop: evidence stops at MAX_EVIDENCE
    assert ngram.propose_with_evidence("loop", looped, max_k=1) == ([5], 64)


def test_ngram_continues_a_repeating_pattern_past_the_end():
    ngram = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=2)
    assert ngram.propose("r", [9, 1, 2, 1, 2], max_k=5) == [1, 2, 1, 2, 1]
    assert ngram.propose("s", [7, 7, 7], max_k=4) == [7, 7, 7, 7]


def test_ngram_nothing_matches_gives_an_empty_list():
    ngram = NgramProposer()
    assert ngram.propose("r", list(range(1000)), max_k=5) == []
    assert ngram.propose("r", [], max_k=5) == [] and ngram.propose("q", [1], max_k=5) == []


def test_ngram_follows_a_growing_history_and_a_rewind():
    ngram = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=2)
    tokens = [1, 2, 3, 4]
    assert ngram.propose("r", tokens, 2) == []
    tokens += [1, 2]
    assert ngram.propose("r", tokens, 2) == [3, 4]
    tokens += [5, 3, 4]
    assert ngram.propose("r", tokens, 2) == [1, 2]
    assert ngram.propose("r", [8, 9, 8, 9], 2) == [8, 9]  # shorter: the index is rebuilt
    ngram.finish("r", [])
    assert "r" not in ngram._histories


def test_ngram_cost_is_linear_in_the_history():
    """A 20k-token prompt, then 2k tokens one at a time: each step indexes only the new token."""
    rng = random.Random(0)
    tokens = [rng.randrange(50_000) for _ in range(20_000)]
    ngram = NgramProposer()
    start = time.perf_counter()
    ngram.propose("r", tokens, 5)  # the prompt, indexed once
    for _ in range(2_000):
        tokens.append(rng.randrange(50_000))
        ngram.propose("r", tokens, 5)
    assert time.perf_counter() - start < 5.0  # a rescan per step would take minutes


# -- suffix ---------------------------------------------------------------------------------------------
def trie_paths(trie):
    """{path: count} of every node: the trie's whole content."""
    out, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children():
            out[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return out


def test_suffix_trie_counts_every_suffix_cut_at_max_depth():
    trie = SuffixTrie(max_depth=2)
    trie.add([1, 2, 1, 3])
    assert trie_paths(trie) == {(1,): 2, (1, 2): 1, (1, 3): 1, (2,): 1, (2, 1): 1, (3,): 1}
    assert trie.num_nodes == 7  # the root and six paths
    trie.remove([1, 2, 1, 3])
    assert trie_paths(trie) == {} and trie.num_nodes == 1


def test_suffix_proposes_the_most_frequent_continuation_of_the_longest_match():
    suffix = SuffixProposer(max_depth=8, max_match=4, min_token_prob=0.0)
    #   after (5, 6): 7 twice, 8 once -> 7; the longer match (4, 5, 6) was followed by 8 once
    tokens = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 8, 3, 9, 5, 6]
    assert suffix.propose("r", tokens, max_k=1) == [7]
    assert suffix.propose("s", tokens[:-3] + [4, 5, 6, 9, 4, 5, 6], max_k=1)[0] == 9


def test_suffix_speculation_length_follows_match_length_and_confidence():
    suffix = SuffixProposer(max_depth=16, max_match=8, max_spec_factor=1.0, min_token_prob=0.5)
    text = [1, 2, 3, 4, 5, 6, 7, 8]
    assert suffix.propose("long", text + [0] + text[:4], max_k=8) == [5, 6, 7, 8]  # match 4 -> at most 4
    assert suffix.propose("short", text + [0, 3], max_k=8) == [4]  # match 1 -> 1
    ambiguous = [1, 2, 1, 3, 1, 4, 1, 5, 1]  # after 1: four continuations of 1/5 each < 0.5
    assert suffix.propose("ambiguous", ambiguous, max_k=4) == []
    assert suffix.propose("long", text + [0] + text[:4], max_k=2) == [5, 6]


def test_suffix_evidence_is_the_length_of_the_suffix_matched():
    suffix = SuffixProposer(max_depth=16, max_match=8, max_spec_factor=1.0, min_token_prob=0.5)
    text = [1, 2, 3, 4, 5, 6, 7, 8]
    assert suffix.propose_with_evidence("long", text + [0] + text[:4], max_k=8) == ([5, 6, 7, 8], 4)
    assert suffix.propose_with_evidence("short", text + [0, 3], max_k=8) == ([4], 1)
    assert suffix.propose_with_evidence("ambiguous", [1, 2, 1, 3, 1, 4, 1, 5, 1], max_k=4) == ([], 0)


def test_suffix_learns_from_finished_requests():
    suffix = SuffixProposer(max_depth=8, max_match=4, min_token_prob=0.1)
    suffix.propose("a", [100, 101], 4)
    suffix.finish("a", [10, 11, 12, 13, 14])
    assert "a" not in suffix._local
    assert suffix.propose("b", [1, 2, 10, 11], max_k=3) == [12, 13]  # match 2 -> at most 2
    assert suffix.propose("c", [7, 8, 9], max_k=3) == []


def test_suffix_shared_trie_stays_within_its_memory_bound_and_equals_a_fresh_build():
    rng = random.Random(3)
    suffix = SuffixProposer(max_depth=6, max_match=3, max_cached_requests=20, max_cached_nodes=2_000)
    outputs = {}
    for i in range(300):
        out = [rng.randrange(30) for _ in range(rng.randrange(1, 60))]
        suffix.finish(f"r{i % 250}", out)  # some ids come back: the newer output replaces the older
        outputs[f"r{i % 250}"] = out
        assert len(suffix._cached) <= 20 and suffix.shared.num_nodes <= 2_000
    fresh = SuffixTrie(max_depth=6)
    for request_id in suffix._cached:
        assert list(suffix._cached[request_id]) == outputs[request_id]
        fresh.add(outputs[request_id])
    assert trie_paths(suffix.shared) == trie_paths(fresh) and suffix.shared.num_nodes == fresh.num_nodes
    for request_id in list(suffix._cached):  # evicting everything leaves the root alone
        suffix.shared.remove(suffix._cached.pop(request_id))
    assert suffix.shared.num_nodes == 1 and not any(suffix.shared.root.children())


def test_suffix_follows_a_growing_history_and_a_rewind():
    suffix = SuffixProposer(max_depth=8, max_match=4, min_token_prob=0.0)
    tokens = [1, 2, 3, 4]
    assert suffix.propose("r", tokens, 3) == []
    tokens += [1, 2]
    assert suffix.propose("r", tokens, 3) == [3, 4]
    incremental = trie_paths(suffix._local["r"].trie)
    fresh = SuffixTrie(8)
    fresh.add(tokens)
    assert incremental == trie_paths(fresh)
    assert suffix.propose("r", [8, 9, 8], 2) == [9]  # shorter: rebuilt
    suffix.finish("r", [])
    assert not suffix._local and not suffix._cached  # an empty output is not cached


def test_suffix_nothing_matches_is_cheap():
    suffix = SuffixProposer()
    tokens = list(range(2_000))
    suffix.propose("r", tokens, 5)
    start = time.perf_counter()
    for _ in range(1_000):
        assert suffix.propose("r", tokens, 5) == []
    assert time.perf_counter() - start < 1.0


def test_suffix_builds_no_trie_until_two_tokens_repeat():
    """Random text (nothing to copy) costs a list append a token; a repeated token alone is answered from where it
    occurs; the first repeated pair of tokens builds the trie."""
    proposer = SuffixProposer(max_spec_factor=2.0)
    text = list(range(100, 300))  # no token twice
    for end in range(150, len(text) + 1, 10):
        assert proposer.propose("r", text[:end], 4) == []
    assert proposer._local["r"].trie is None
    text += [130]  # 130 occurred once, followed by 131 132 ...: a one-token match, two drafts (max_spec_factor 2)
    assert proposer.propose("r", text, 4) == [131, 132]
    assert proposer._local["r"].trie is None
    text += [120, 121]  # 120 121 occurred before, followed by 122 123 ...
    assert proposer.propose("r", text, 8) == [122, 123, 124, 125]
    assert proposer._local["r"].trie is not None


def reference_suffix_proposal(proposer, text, max_k):
    """What SuffixProposer proposes, the slow way: a fresh trie of the text, and in it and the shared trie the longest
    suffix with a continuation found by trying every length from the longest down."""
    def longest(trie):
        for m in range(min(proposer.max_match, len(text), trie.max_depth - 1), 0, -1):
            node = trie.find(text[len(text) - m :])
            if node is not None and node.has_children():
                return node, m
        return None, 0

    own = SuffixTrie(proposer.max_depth)
    own.add(text)
    options = (max_k, proposer.max_spec_factor, proposer.min_token_prob)
    drafts, _, matched = max(own.speculate(longest(own), *options), proposer.shared.speculate(longest(proposer.shared),
                             *options), key=lambda option: option[1])
    return drafts, matched if drafts else 0


@pytest.mark.parametrize("vocab", [3, 12, 400])
@pytest.mark.parametrize("options", [{},
                                     {"max_depth": 3, "max_match": 2, "max_spec_factor": 4.0, "min_token_prob": 0.0},
                                     {"max_depth": 8, "max_match": 4, "max_spec_factor": 3.0, "min_token_prob": 0.2}])
def test_suffix_proposals_equal_a_fresh_trie_searched_at_every_length(vocab, options):
    """The incremental index (no trie until two tokens repeat, then open ends) and the galloping search of the shared
    trie change what a proposal costs, never what it is: texts that grow by drafts and random tokens, rewind, end."""
    rng = random.Random(vocab)
    proposer = SuffixProposer(**options, max_cached_requests=20, max_cached_nodes=2_000)
    for r in range(60):
        text = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        for _ in range(rng.randrange(1, 30)):
            k = rng.randrange(0, 7)
            drafts, matched = proposer.propose_with_evidence(str(r), text, k)
            assert (drafts, matched) == (reference_suffix_proposal(proposer, text, k) if k else ([], 0))
            if rng.random() < 0.05 and len(text) > 3:
                text = text[: rng.randrange(1, len(text))]
            else:
                copied = drafts[: rng.randrange(1, len(drafts) + 1)] if drafts and rng.random() < 0.5 else []
                text += copied or [rng.randrange(vocab)]
        proposer.finish(str(r), text[5:])
