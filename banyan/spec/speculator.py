"""Speculator: the scheduler's one handle on speculation, a proposer and a controller under one SpeculativeConfig.

    each step, before pages are handed out:
        drafts = speculator.drafts([(request_id, verified token ids, room), ...], base_tokens, ...)
    after the forward (the engine):      speculator.observe_step(tokens in the step, seconds, ..., sequences)
    after verification (the scheduler):  speculator.observe(request_id, drafted, accepted)
    when a request ends:                 speculator.finish(request_id, output token ids)

`room` is the most drafts the request may verify (its tokens left, less the one the target always adds); a
request the caller cannot speculate for (its sampling is not the same at every position) is not a candidate.
The step-time model is measured at start-up (`calibrate`: a verify-shaped forward at each of a ladder of token
counts, within a time budget; beyond the last point the last slope goes on) and every step refines it. Without
a measurement (a runner that cannot time forwards) it starts from an assumed shape that the first measured
step scales. Pure Python, no torch; the one clock it reads (injectable) times its own proposal passes:

A proposal pass over every candidate costs CPU time whatever the controller then decides. A pass that drafts nothing
is paid for out of at most PROPOSAL_SHARE of the step time: after one, the next passes are skipped (the plain path)
until its cost spread over the skipped steps is within that share. A pass that drafts resets the count. Under the
adaptive policy only: `fixed` and `table` draft wherever the proposer has drafts, every step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from banyan.spec.config import SpeculativeConfig
from banyan.spec.controller import SpecController
from banyan.spec.step_time import StepTimeModel
from banyan.spec.proposer import make_proposer

logger = logging.getLogger(__name__)

NETWORK_METHODS = ("layer_skip", "draft_model")
"""Methods whose drafts a network makes in the runner's step (the proposer offers placeholders)."""
STEP_TIME_SHAPE = ((1, 1.0), (8, 1.05), (32, 1.3), (256, 4.0), (2048, 30.0))
"""(tokens, relative seconds) of one forward when nothing could be measured at start-up."""
SMALL_SPAN = (1, 2, 4, 8, 16)
"""Token counts `calibrate` times first: the span of a small batch's verify steps, so that a time budget spent early (a
loaded machine) still reaches them (on a 2-vCPU EPYC at load 10 a smallest-first ladder stopped at 4 tokens, and its
slope overestimated 24-token steps by 10-30%)."""
LARGE_SPAN = (32, 64, 128, 256, 512, 1024)
BETWEEN = (12, 24, 48, 96, 192, 384, 768)


def calibration_ladder(max_k: int) -> tuple[int, ...]:
    """The token counts `calibrate` times, in order: the small span, then every count of one request's verify pass
    (1 + k for k <= max_k), then the large span, then counts between. One request's counts come before the large
    span because the kernels' row tiles make the curve step there (4 rows a tile: 5 tokens cost a second pass over
    the weights), where interpolating between 4 and 8 priced 6 tokens 40% above their measured time and talked the
    controller out of its 4th and 5th drafts at batch 1 (a 2-vCPU Zen 4, 1 thread: the old ladder's 2 s ran out at 256
    before it reached 3, 5 or 6)."""
    verify = tuple(n for n in range(3, max_k + 2) if n not in SMALL_SPAN)
    return SMALL_SPAN + verify + LARGE_SPAN + tuple(n for n in BETWEEN if n not in verify)


DRAFT_COST_RATE = 0.1
"""EWMA weight of each step's measured cost per network draft."""
STEP_TIME_RATES = (0.1, 0.02)
"""The step-time model's EWMA weights for a step faster / slower than its fit: a step slowed by another process
is not a cost of its tokens, and a fit that rose on such noise where nothing drafts would never come down."""
CALIBRATION_REPEATS = 3
"""Timings per token count; the least is kept (noise on a shared machine only ever adds time)."""
PROPOSAL_SHARE = 0.01
"""The most of the step time that proposal passes which draft nothing may take (the module docstring). On an H200
(scripts/gpu_check.sh, 7B shape, random prompts at temperature 1, nothing to copy) ngram-adaptive ran at 0.91x of
no speculation at 64 streams with 69 drafts in all: its passes' CPU time, about 8% of a 12 ms step (inferred). On a
CPU at batch 1 a pass is about 0.5% of a step: never skipped."""
MAX_SKIPPED_STEPS = 64
"""Skipped passes in a row at most: how long a request that starts to repeat itself can wait for its first draft."""
STEP_SECONDS_RATE = 0.1
"""EWMA weight of each step's seconds in the step time a skipped pass is measured against."""
PRIORS = {"ngram": (0.7, 0.6, 0.5), "suffix": (0.7, 0.6, 0.5), "layer_skip": (0.5, 0.4, 0.3), "draft_model": (0.6, 0.5, 0.4)}
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
    def __init__(self, config: SpeculativeConfig, clock: Callable[[], float] = time.perf_counter):
        self.config = config
        self.clock = clock
        self.step_seconds = 0.0  # an EWMA of the steps' measured seconds (0: none measured yet)
        self.skip_passes = 0  # proposal passes still to skip
        self.proposal_share = PROPOSAL_SHARE
        self.proposer = make_proposer(config.method, **config.proposer_options())
        self.controller = SpecController(config, step_time_model(STEP_TIME_SHAPE), PRIORS[config.method])
        self.max_k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_pos=[0] * self.max_k)
        self._measured = False

    @property
    def drafts_in_runner(self) -> bool:
        """A network drafts inside the runner's step (layer_skip, draft_model): `drafts` returns placeholders."""
        return self.config.method in NETWORK_METHODS

    def drafts(self, candidates: Sequence[tuple[str, Sequence[int], int]], base_tokens: int, base_emitted: float,
               token_budget: int, base_seqs: int = 0) -> dict[str, list[int]]:
        """Draft tokens per request id, for those the controller gives k > 0 (absent: the plain path).
        candidates: (request_id, its verified tokens, room); base_tokens / base_emitted / base_seqs: the rest of
        the step."""
        if self.skip_passes:
            self.skip_passes -= 1
            return {}
        start = self.clock()
        found = [self.proposer.propose_with_evidence(rid, tokens, min(room, self.max_k)) for rid, tokens, room in candidates]
        proposals = [drafts for drafts, _ in found]
        ids = [rid for rid, _, _ in candidates]
        ks = self.controller.choose(ids, [len(p) for p in proposals], base_tokens, base_emitted, token_budget,
                                    evidence=[evidence for _, evidence in found], base_seqs=base_seqs)
        # a pass that drafts nothing: paid for by the passes skipped next (adaptive only: `fixed` and `table` promise
        # drafts at every step where the proposer has any)
        if not any(ks) and self.step_seconds > 0 and self.config.policy == "adaptive":
            budget = self.proposal_share * self.step_seconds
            self.skip_passes = min(MAX_SKIPPED_STEPS, int((self.clock() - start) / budget))
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

    def calibrate(self, time_forward: Callable[[int], float], max_tokens: int, budget_seconds: float = 2.0,
                  time_draft: Callable[[], float] | None = None) -> None:
        """Measure the step-time model: time_forward(n) is the seconds of one forward over n tokens (the runner's);
        time_draft() the seconds of one draft token of a network proposer (the controller's draft cost).

        Times each count of `calibration_ladder` up to max_tokens, in its order (after one warm-up forward), until the time
        spent passes budget_seconds, so a slow model stops early and the model extrapolates past its last point."""
        if time_draft is not None:
            time_draft()  # warm-up
            self.controller.draft_seconds = min(time_draft() for _ in range(CALIBRATION_REPEATS))
        time_forward(1)  # warm-up: first-call allocations and kernel builds are not a step's cost
        points, spent = [], 0.0
        for n in (n for n in calibration_ladder(self.max_k) if n <= max_tokens):
            times = [time_forward(n) for _ in range(CALIBRATION_REPEATS)]
            points.append((n, min(times)))
            spent += sum(times)
            if spent > budget_seconds:
                break
        if len(points) < 2 or not all(seconds > 0 for _, seconds in points):
            return  # too little to fit a curve: the assumed shape stays, scaled by the first step
        self.controller.step_time = step_time_model(points)
        self._measured = True
        logger.info("speculation: step time at start-up (tokens: ms) %s",
                    ", ".join(f"{n}: {seconds * 1e3:.1f}" for n, seconds in points))

    def observe_step(self, num_tokens: int, seconds: float, draft_seconds: float = 0.0, num_drafts: int = 0,
                     num_seqs: int = 1) -> None:
        """A step over `num_tokens` tokens of `num_seqs` sequences took `seconds` and verified `num_drafts` drafts,
        of which a network spent `draft_seconds` making them; without a start-up measurement the first step scales the
        assumed shape."""
        if num_drafts and draft_seconds > 0:
            controller = self.controller
            controller.draft_seconds += DRAFT_COST_RATE * (draft_seconds / num_drafts - controller.draft_seconds)
            seconds -= draft_seconds
        if seconds > 0:
            self.step_seconds = seconds if not self.step_seconds else (
                self.step_seconds + STEP_SECONDS_RATE * (seconds - self.step_seconds))
        if not self._measured and seconds > 0:
            scale = seconds / self.controller.step_time.predict(num_tokens)  # still the assumed shape
            self.controller.step_time = step_time_model([(n, t * scale) for n, t in STEP_TIME_SHAPE])
            self._measured = True
        self.controller.observe_step(num_tokens, seconds, num_seqs, drafted=num_drafts > 0)

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """The request ended (finished, aborted): both forget it, a cross-request proposer learns its output."""
        self.proposer.finish(request_id, output_token_ids)
        self.controller.finish(request_id)


def step_time_model(points: Sequence[tuple[int, float]]) -> StepTimeModel:
    rate, up_rate = STEP_TIME_RATES
    return StepTimeModel(points, rate=rate, up_rate=up_rate)
