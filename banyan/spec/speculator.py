"""Speculator: the scheduler's one handle on speculation, a proposer and a controller under one SpeculativeConfig.

    each step, before pages are handed out:
        drafts = speculator.drafts([(request_id, verified token ids, room), ...], base_tokens, ...)
    after the forward (the engine):      speculator.observe_step(tokens in the step, seconds)
    after verification (the scheduler):  speculator.observe(request_id, drafted, accepted)
    when a request ends:                 speculator.finish(request_id, output token ids)

`room` is the most drafts the request may verify (its tokens left, less the one the target always adds); a
request the caller cannot speculate for (its sampling is not the same at every position) is not a candidate.
The step-time model starts from a shape (flat while a forward is bound by reading the weights, then linear)
that the first measured step scales, and every step refines it; only its shape matters to the controller's
argmax. Pure Python: no torch, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from banyan.spec.config import SpeculativeConfig
from banyan.spec.controller import SpecController, StepTimeModel
from banyan.spec.proposer import make_proposer

STEP_TIME_SHAPE = ((1, 1.0), (8, 1.05), (32, 1.3), (256, 4.0), (2048, 30.0))
"""(tokens, relative seconds) of one forward before anything is measured."""
PRIORS = {"ngram": (0.7, 0.6, 0.5), "suffix": (0.7, 0.6, 0.5)}
"""Each proposer's P(draft j accepted | the ones before it were), before any request is observed."""


@dataclass
class SpecStats:
    """Counters since start-up, vLLM's spec_decode_* metrics."""

    num_drafts: int = 0
    """Verifications: requests times steps that verified at least one draft."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """accepted_per_pos[j]: how often draft j + 1 was accepted."""

    def copy(self) -> SpecStats:
        return replace(self, accepted_per_pos=list(self.accepted_per_pos))

    def since(self, before: SpecStats) -> SpecStats:
        """The counts that grew after `before` (an earlier copy of these counters)."""
        return SpecStats(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                         self.num_accepted_tokens - before.num_accepted_tokens,
                         [now - then for now, then in zip(self.accepted_per_pos, before.accepted_per_pos)])

    def summary(self) -> str:
        """One log line, as vLLM's: acceptance per position (accepted_per_pos[j] / num_drafts) and the mean
        accepted length, 1 + num_accepted_tokens / num_drafts (the target's own token counts as one)."""
        drafts = max(self.num_drafts, 1)
        per_pos = ", ".join(f"{n / drafts:.2f}" for n in self.accepted_per_pos)
        rate = self.num_accepted_tokens / max(self.num_draft_tokens, 1)
        return (f"speculation: mean accepted length {1 + self.num_accepted_tokens / drafts:.2f}, "
                f"acceptance per position [{per_pos}], {rate:.1%} of {self.num_draft_tokens} draft tokens "
                f"accepted in {self.num_drafts} drafts")


class Speculator:
    def __init__(self, config: SpeculativeConfig):
        """A typed error naming `method` for a method that has no proposer yet (draft_model, layer_skip)."""
        self.config = config
        options = {}
        if config.method == "ngram":
            options = {"prompt_lookup_min": config.prompt_lookup_min, "prompt_lookup_max": config.prompt_lookup_max}
        self.proposer = make_proposer(config.method, **options)
        self.controller = SpecController(config, StepTimeModel(STEP_TIME_SHAPE), PRIORS[config.method])
        self.max_k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_pos=[0] * self.max_k)
        self._measured = False

    def drafts(self, candidates: Sequence[tuple[str, Sequence[int], int]], base_tokens: int, base_emitted: float,
               token_budget: int) -> dict[str, list[int]]:
        """Draft tokens per request id, for those the controller gives k > 0 (absent: the plain path).
        candidates: (request_id, its verified tokens, room); base_tokens / base_emitted: the rest of the step."""
        proposals = [self.proposer.propose(rid, tokens, min(room, self.max_k)) for rid, tokens, room in candidates]
        ids = [rid for rid, _, _ in candidates]
        ks = self.controller.choose(ids, [len(p) for p in proposals], base_tokens, base_emitted, token_budget)
        return {rid: proposal[:k] for rid, proposal, k in zip(ids, proposals, ks) if k}

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """`accepted` of the request's `drafted` drafts passed the verifier."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += drafted
        stats.num_accepted_tokens += accepted
        for j in range(accepted):
            stats.accepted_per_pos[j] += 1
        self.controller.observe(request_id, drafted, accepted)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A forward over `num_tokens` tokens took `seconds`; the first one scales the assumed shape."""
        if not self._measured and seconds > 0:
            scale = seconds / self.controller.step_time.predict(num_tokens)  # still the assumed shape
            self.controller.step_time = StepTimeModel([(n, t * scale) for n, t in STEP_TIME_SHAPE])
            self._measured = True
        self.controller.observe_step(num_tokens, seconds)

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """The request ended (finished, aborted): both forget it, a cross-request proposer learns its output."""
        self.proposer.finish(request_id, output_token_ids)
        self.controller.finish(request_id)
