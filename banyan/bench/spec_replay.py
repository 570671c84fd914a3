"""Speculation replayed on recorded greedy outputs: step counts instead of wall time, and what the best could reach.

Wall-clock ratios of `banyan bench speculative` at batch 1 move by +-15% between runs on a shared 2-vCPU machine,
more than most changes to a proposer or the controller. A greedy request's tokens are the same with speculation
on and off, so its steps can be replayed without the model: each step the real Speculator proposes and chooses k
from the history so far, a draft passes while it equals the recorded output, and the step costs t(1 + k) from a
step-time curve measured once on the machine (ModelRunner.time_forward). The decode's speed-up is then

    sum over the output's tokens of t(1)   /   sum over the replayed steps of t(1 + k)

exact for that curve and those outputs, the same at every run. Two ceilings go beside it:
- best k: the proposer's own drafts, k chosen knowing how many will pass (what a perfect controller reaches);
- copy oracle: the longest start of the true continuation found anywhere in the history (what any lookup proposer,
  drafting from this request's own text, reaches at best).
Both choose, among the k they could draft, the one with the most tokens per second in that step. A third sits
between the controller and best k, for a proposer that tells its evidence (the length of the match its drafts
continue: ngram):
- k per evidence bucket in hindsight: a fixed k for each of the controller's evidence buckets, chosen on these traces
  (coordinate ascent from the best single k); what any controller that sees only the bucket reaches at best with
  one k a bucket.

What replay leaves out: the prompt's prefill (the same work on and off: it dilutes the ratio) and what a step costs
beyond its forward (proposing, verifying, output processing: small at batch 1). In the compact default a verify
pass of k + 1 rows may part from a plain decode where two logits nearly tie, so a recorded output is the run's
without speculation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from banyan.spec.config import SpeculativeConfig
from banyan.spec.controller import EVIDENCE_BUCKETS, evidence_bucket
from banyan.spec.proposer import Proposer
from banyan.spec.speculator import Speculator
from banyan.spec.verify import greedy_accepted

StepSeconds = Callable[[int], float]
"""Seconds of one forward of one sequence over n tokens (1: a decode, 1 + k: a verify of k drafts)."""


@dataclass(frozen=True)
class Trace:
    """One greedy request as it ran: its prompt, its output (output[0] came from the prefill) and its max_tokens
    (drafts may reach that far, as the scheduler's room does; None: its output's length, the end known)."""

    prompt: list[int]
    output: list[int]
    max_tokens: int | None = None

    def room(self, emitted: int) -> int:
        """Drafts the scheduler allows after `emitted` output tokens: the tokens left less the one the target adds."""
        return (self.max_tokens if self.max_tokens is not None else len(self.output)) - emitted - 1


@dataclass
class Replay:
    """What one configuration's replay counted."""

    off_seconds: float = 0.0  # the plain decode: a step of 1 token per output token after the first
    on_seconds: float = 0.0
    steps: dict[int, int] = field(default_factory=dict)  # drafts in a step -> steps
    drafted: int = 0
    accepted: int = 0

    @property
    def ratio(self) -> float:
        """The decode's speed-up: plain decode seconds over replayed seconds."""
        return self.off_seconds / self.on_seconds if self.on_seconds else 1.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens a verifying step emits (1 + accepted drafts per step that drafted)."""
        verifies = sum(n for k, n in self.steps.items() if k)
        return 1.0 + self.accepted / verifies if verifies else 1.0

    def add_step(self, drafts: int, accepted: int, seconds: float) -> None:
        self.steps[drafts] = self.steps.get(drafts, 0) + 1
        self.drafted += drafts
        self.accepted += accepted
        self.on_seconds += seconds


def replay(traces: Sequence[Trace], config: SpeculativeConfig, step_seconds: StepSeconds) -> Replay:
    """The real Speculator (its proposer, controller and learning) over `traces`, one request at a time, as at
    batch 1. Its step-time model is calibrated on step_seconds and each step is observed at step_seconds, as the
    engine observes a measured one; its clock stands still, so the proposal budget never skips a pass."""
    speculator = Speculator(config, clock=lambda: 0.0)
    speculator.calibrate(step_seconds, max_tokens=4 * config.num_speculative_tokens + 64)

    def step(request_id: str, trace: Trace, pos: int) -> tuple[int, int]:
        out = trace.output
        candidates = [(request_id, trace.prompt + out[:pos], trace.room(pos))]
        drafts = speculator.drafts(candidates, 0, 0.0, 1 << 30).get(request_id, [])
        accepted = greedy_accepted(drafts, out[pos:])
        if drafts:
            speculator.observe(request_id, len(drafts), accepted)
        speculator.observe_step(1 + len(drafts), step_seconds(1 + len(drafts)), num_drafts=len(drafts))
        return len(drafts), accepted

    return _walk(traces, step_seconds, step, speculator.finish)


def best_step(usable: int, step_seconds: StepSeconds) -> int:
    """Of k = 0..usable drafts that will all pass, the k with the most tokens per second in this step."""
    return max(range(usable + 1), key=lambda k: ((1 + k) / step_seconds(1 + k), -k))


def replay_best_k(traces: Sequence[Trace], proposer: Proposer, max_k: int, step_seconds: StepSeconds) -> Replay:
    """The proposer's drafts with k chosen knowing how many pass: the ceiling of any controller for this proposer."""
    def usable(request_id: str, history: list[int], truth: list[int], room: int) -> int:
        return greedy_accepted(proposer.propose(request_id, history, room), truth)

    return _walk(traces, step_seconds, _oracle_step(usable, max_k, step_seconds), proposer.finish)


def replay_copy_oracle(traces: Sequence[Trace], max_k: int, step_seconds: StepSeconds) -> Replay:
    """Drafts that are the longest start of the true continuation occurring anywhere in the history: the ceiling of
    a lookup proposer drafting from the request's own text."""
    def usable(request_id: str, history: list[int], truth: list[int], room: int) -> int:
        return longest_found(history, truth[:room])

    return _walk(traces, step_seconds, _oracle_step(usable, max_k, step_seconds), lambda request_id, out: None)


def replay_evidence_k(traces: Sequence[Trace], make: Callable[[], Proposer], ks: dict[int, int],
                      step_seconds: StepSeconds) -> Replay:
    """A fresh proposer's drafts (make(): one with propose_with_evidence), cut to ks[its evidence bucket] each step."""
    proposer = make()

    def step(request_id: str, trace: Trace, pos: int) -> tuple[int, int]:
        room, out = trace.room(pos), trace.output
        if room <= 0:
            return 0, 0
        drafts, evidence = proposer.propose_with_evidence(request_id, trace.prompt + out[:pos], room)
        drafts = drafts[: ks.get(evidence_bucket(evidence), 0)]
        return len(drafts), greedy_accepted(drafts, out[pos:])

    return _walk(traces, step_seconds, step, proposer.finish)


def replay_hindsight_evidence_k(traces: Sequence[Trace], make: Callable[[], Proposer], max_k: int,
                                step_seconds: StepSeconds, rounds: int = 2) -> tuple[Replay, dict[int, int]]:
    """The best fixed k for each evidence bucket on these traces, and its replay: from the best single k for every
    bucket, each bucket in turn takes its best k with the others held (ties to fewer drafts), `rounds` times over.
    Never below the best single k (the start), never above best k (which knows each step's outcome)."""
    def ratio(ks: dict[int, int]) -> float:
        return replay_evidence_k(traces, make, ks, step_seconds).ratio

    single = max(range(max_k + 1), key=lambda k: (ratio(dict.fromkeys(EVIDENCE_BUCKETS, k)), -k))
    ks = dict.fromkeys(EVIDENCE_BUCKETS, single)
    for _ in range(rounds):
        for bucket in EVIDENCE_BUCKETS:
            ks[bucket] = max(range(max_k + 1), key=lambda k, b=bucket: (ratio({**ks, b: k}), -k))
    return replay_evidence_k(traces, make, ks, step_seconds), ks


def longest_found(history: Sequence[int], continuation: Sequence[int]) -> int:
    """The largest n such that continuation[:n] occurs as a contiguous run in history."""
    found = 0
    text = list(history)
    for n in range(1, len(continuation) + 1):
        pattern = list(continuation[:n])
        if not any(text[i : i + n] == pattern for i in range(len(text) - n + 1)):
            break
        found = n
    return found


Step = Callable[[str, Trace, int], tuple[int, int]]
"""One step of a request at output position pos: (drafts verified, drafts accepted)."""


def _oracle_step(usable: Callable[[str, list[int], list[int], int], int], max_k: int, step_seconds: StepSeconds) -> Step:
    """A step that drafts best_step of the `usable` drafts (all of which pass), within the request's room."""
    def step(request_id: str, trace: Trace, pos: int) -> tuple[int, int]:
        room = min(max_k, trace.room(pos))
        out = trace.output
        k = best_step(usable(request_id, trace.prompt + out[:pos], out[pos:], room) if room > 0 else 0, step_seconds)
        return k, k

    return step


def _walk(traces: Sequence[Trace], step_seconds: StepSeconds, step: Step,
          finish: Callable[[str, list[int]], None]) -> Replay:
    """Every trace's decode, one step after another, each costing step_seconds(1 + its drafts)."""
    result = Replay()
    for i, trace in enumerate(traces):
        request_id, out = f"replay-{i}", trace.output
        result.off_seconds += (len(out) - 1) * step_seconds(1)
        pos = 1  # output[0] came from the prefill
        while pos < len(out):
            drafted, accepted = step(request_id, trace, pos)
            result.add_step(drafted, accepted, step_seconds(1 + drafted))
            pos += accepted + 1
        finish(request_id, out)
    return result
