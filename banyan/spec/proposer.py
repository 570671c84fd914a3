"""Proposer: where draft tokens come from, chosen by name (speculative_config's `method`).

    proposer = make_proposer("ngram", prompt_lookup_min=2, prompt_lookup_max=5)
    each step, per decoding request:
        drafts = proposer.propose(request.request_id, request.all_token_ids, max_k)   # [] = nothing to propose
        drafts, evidence = proposer.propose_with_evidence(...)   # the same, and the length of the match behind them
    when a request ends (finished or aborted):
        proposer.finish(request.request_id, request.output_token_ids)

`token_ids` is the request's verified history, prompt + output; drafts are never part of it (they live
beside the request until the verifier accepts them). It only grows between calls, except that a shorter
history (a rewind) is allowed and rebuilds the proposer's state for that request. A proposer may keep per
request state keyed by request_id (an index over the history, extended by the new tokens only); `finish`
drops it, and a cross-request proposer (suffix) learns from the finished output there.

Model-free proposers (ngram, suffix) are plain Python and import no torch. A network drafts inside the
runner's step (layer_skip, draft_model): its proposer offers placeholders that the runner fills (spec/network.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from banyan.registry import Registry


class Proposer(ABC):
    @abstractmethod
    def propose(self, request_id: str, token_ids: Sequence[int], max_k: int) -> list[int]:
        """At most max_k draft tokens to follow token_ids (prompt + output so far), in order; []
        when there is nothing worth proposing, found cheaply. Updates only this request's own index."""

    def propose_with_evidence(self, request_id: str, token_ids: Sequence[int], max_k: int) -> tuple[list[int], int]:
        """propose's drafts and the evidence behind them: how many tokens of the text before the drafts match the
        text their continuation was taken from (the controller keeps one prior per amount of evidence: a long
        match predicts well, a chance one poorly); 0 when the proposer has nothing to tell (a network)."""
        return self.propose(request_id, token_ids, max_k), 0

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """The request ended: drop its state; a cross-request proposer also learns from its output.
        Unknown ids are ignored (a request that never proposed)."""


PROPOSERS: Registry[type[Proposer]] = Registry("method")
PROPOSERS.register("ngram", "banyan.spec.ngram:NgramProposer")
PROPOSERS.register("suffix", "banyan.spec.suffix:SuffixProposer")
PROPOSERS.register("layer_skip", "banyan.spec.network:NetworkProposer")  # the runner's drafter fills the drafts
PROPOSERS.register("draft_model", "banyan.spec.network:NetworkProposer")


def make_proposer(method: str, **options: Any) -> Proposer:
    """The proposer called `method`, built with its own options (UnknownChoiceError naming `method`)."""
    return PROPOSERS.get(method)(**options)
