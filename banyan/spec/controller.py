"""The speculation controller: how many drafts k_i each request verifies this step (0 <= k_i <= max_k).

Pure Python, no torch, no clock: the caller passes in proposal lengths, verification results and measured step
times, so every decision is deterministic and testable.

The model (the acceptance math, written once here):

    alpha_{i,j} = P(draft j of request i is accepted | drafts 1..j-1 were accepted)     (AcceptanceStats)
    g_{i,j}     = P(drafts 1..j all accepted) = prod_{m<=j} alpha_{i,m}                  (chain rule)

    A verified request always emits one token from the target (the correction on a reject, the bonus when all
    k drafts pass) plus its accepted drafts A_i. A_i >= j exactly when drafts 1..j all pass, and for a count
    E[A] = sum_{j>=1} P(A >= j), so

    E[emitted_i | k_i] = 1 + sum_{j=1..k_i} g_{i,j}

    A step holds B base tokens (prefill chunks, ...) that emit E_base tokens, and n decoding requests that
    each feed 1 + k_i tokens; a forward of N tokens of one sequence takes t(N) seconds (StepTimeModel), and each
    sequence past the first s more (SpecController.seq_seconds). The controller maximises the step's expected rate

    R(k) = (E_base + sum_i E[emitted_i | k_i]) / (t(B + n + T) + s (S - 1) + c T + [T > 0 and S > 1] j),
    T = sum_i k_i

where S is the step's sequences, c is what making one draft costs besides verifying it (0 for a lookup
proposer; a network's forward per draft token for layer_skip, measured like t), and j what a step of several
sequences costs more when it verifies drafts than when it does not, whatever their number: on a GPU the plain step
replays a CUDA graph of its decode rows and a verify step runs the piecewise path (an H200 at batch 1: 6.1 ms for 1
token, 7.6 for 2). One sequence's jump is in t itself (t(1) is measured on the plain path, t(2) on a verify pass).

Exactness. The cost depends on k only through T. Since alpha <= 1, g_{i,j} is non-increasing in j: each request's
expected output is concave in k_i, so for a fixed T the best numerator takes the T largest gains over all
(i, j), and those always form a prefix 1..k_i of each request's drafts (ties broken by j). With
G(T) = sum of the T largest gains,

    max_k R(k) = max_T (E_base + n + G(T)) / (t(B + n + T) + ... + [T > 0] j)

and `allocate` scans T = 0, 1, ... over the sorted gains: the exact optimum in O(M log M) for M candidate drafts,
whatever the shape of t. It stops only when a bound proves no larger T can win (t rises at least min_slope per
token from here and no draft left is worth more than the next gain), so a batch where nothing pays costs one
prediction. (A greedy that stops when the rate first drops is exact only when R(T) is unimodal, e.g. t linear or
convex; after a bump in t, such as a kernel tile boundary, it stops early and can lose a third of the rate.)
Ties go to the smaller T: speculation must pay strictly.

k = 0 everywhere is the plain decode path: when no request has a draft with positive expected gain, `choose`
returns zeros before it reads the step-time model (no allocation, no scan), and the caller runs no proposer
forward, no verifier and no extra synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

from banyan.spec.config import SpeculativeConfig
from banyan.spec.step_time import MAX_RISE, StepTimeModel


class AcceptanceStats:
    """Per-position conditional acceptance alpha[j] = P(draft j+1 accepted | drafts 1..j accepted), as EWMAs."""

    def __init__(self, alphas: Sequence[float], rate: float, relax_to: Sequence[float] = (), relax_rate: float = 0.0,
                 follow_unseen: bool = False, seen: Sequence[bool] = ()):
        """alphas: the starting estimates (one per position); rate: the EWMA weight of each new observation;
        relax_to / relax_rate: where each `idle` step (nothing drafted, nothing observed) moves the estimates;
        follow_unseen: a position never observed takes the estimate of the one before it, once one is observed;
        seen: the positions that count as observed already (those the estimates were seeded from had seen)."""
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        self._alphas = [min(1.0, max(0.0, float(a))) for a in alphas]
        self.rate = rate
        self.relax_to = list(relax_to) if relax_to else list(self._alphas)
        self.relax_rate = relax_rate
        self.follow_unseen = follow_unseen
        self._seen = [bool(seen[j]) if j < len(seen) else False for j in range(len(self._alphas))]
        self._idle_steps = 0

    @property
    def alphas(self) -> list[float]:
        """The estimates now, idle steps applied: each moved a fraction relax_rate toward relax_to, so after s
        of them alpha = target + (alpha - target) * (1 - relax_rate)^s (applied once, when next read)."""
        if self._idle_steps:
            keep = (1.0 - self.relax_rate) ** self._idle_steps
            self._alphas = [t + (a - t) * keep for a, t in zip(self._alphas, self.relax_to)]
            self._idle_steps = 0
        return self._alphas

    def update(self, drafted: int, accepted: int) -> None:
        """One verification: `accepted` of `drafted` drafts passed (a prefix, as the verifier stops at a reject).

        Positions 1..accepted saw a pass, position accepted+1 (if drafted) a reject; later positions saw
        nothing (their condition, all earlier drafts passed, did not hold) and keep their estimate.
        """
        alphas = self.alphas
        if not 0 <= accepted <= drafted <= len(alphas):
            raise ValueError(f"need 0 <= accepted ({accepted}) <= drafted ({drafted}) <= {len(alphas)}")
        for j in range(min(accepted + 1, drafted)):
            passed = 1.0 if j < accepted else 0.0
            alphas[j] += self.rate * (passed - alphas[j])
            self._seen[j] = True
        if self.follow_unseen:
            self._extend_to_unseen(alphas)

    def _extend_to_unseen(self, alphas: list[float]) -> None:
        """Positions never observed, past one that was, take its estimate: a proposer's declared prior falls with
        depth, but for a given kind of draft (a copy, a chance match) the conditional acceptance hardly does. A
        deep position left at a low declared value would never pay, so never be drafted, so never learn: copying
        requests whose first drafts pass at 0.95 would stay at k = 1 whenever a step's drafts are not nearly free."""
        past_seen = False
        for j, seen in enumerate(self._seen):
            if past_seen and not seen:
                alphas[j] = alphas[j - 1]
            past_seen = past_seen or seen

    @property
    def seen(self) -> list[bool]:
        """seen[j]: whether position j + 1 was ever observed (here or where the estimates were seeded from)."""
        return list(self._seen)

    def idle(self) -> None:
        """A step where the request could have drafted but did not: how an unobserved request gets probed again."""
        self._idle_steps += 1

    def gains(self, k: int) -> list[float]:
        """g_j = prod_{m<=j} alpha_m for j = 1..k: P(the first j drafts all pass), non-increasing in j."""
        out, product = [], 1.0
        for alpha in self.alphas[:k]:
            product *= alpha
            out.append(product)
        return out

    def expected_tokens(self, k: int) -> float:
        """E[tokens emitted | k drafts] = 1 + sum_{j<=k} g_j."""
        return 1.0 + sum(self.gains(k))


SEQ_RATE = 0.05  # EWMA weight of each step of several sequences in SpecController.seq_seconds


def allocate(gains: Sequence[Sequence[float]], step_time: StepTimeModel, base_tokens: int = 0,
             base_emitted: float = 0.0, max_drafts: int | None = None, draft_seconds: float = 0.0,
             overhead: float = 0.0, verify_seconds: float = 0.0) -> list[int]:
    """The exact argmax of R(k) (module docstring): k_i drafts for request i, given its gains g_{i,1..cap_i}.

    gains[i] must be non-increasing (as products of probabilities are); max_drafts bounds T (a token budget);
    draft_seconds is c, the cost of making each draft; overhead is the step's seconds besides its tokens' forward
    and its drafts (s (S - 1)), whatever k; verify_seconds (j) is added to every T > 0.
    Candidates with gain <= 0 are never drafted. The scan over T stops as soon as `_can_beat` proves that no
    larger T wins; when speculation cannot pay at all (a large compute-bound batch) that is before sorting.
    """
    n = len(gains)
    tokens, emitted = base_tokens + n, base_emitted + n
    seconds = step_time.predict(tokens) + overhead
    best_rate, best_total = emitted / seconds, 0
    top = max((row[0] for row in gains if row), default=0.0)
    if max_drafts == 0 or not _can_beat(best_rate, emitted, seconds + verify_seconds,
                                        step_time.min_slope(tokens) + draft_seconds, top):
        return [0] * n
    # every candidate draft (i, j), best first; within a request j ascending, so the top T form prefixes
    order = sorted(((g, j, i) for i, row in enumerate(gains) for j, g in enumerate(row) if g > 0.0),
                   key=lambda c: (-c[0], c[1], c[2]))
    if max_drafts is not None:
        order = order[:max_drafts]
    seconds += verify_seconds  # from the first draft on (the bound above and below: d drafts cost j + d * slope)
    for total, (g, _, _) in enumerate(order, start=1):
        if not _can_beat(best_rate, emitted, seconds, step_time.min_slope(tokens + total - 1) + draft_seconds, g):
            break  # every draft left is worth at most g
        emitted += g
        seconds = step_time.predict(tokens + total) + overhead + draft_seconds * total + verify_seconds
        if emitted / seconds > best_rate:
            best_rate, best_total = emitted / seconds, total
    ks = [0] * n
    for _, _, i in order[:best_total]:
        ks[i] += 1
    return ks


def _can_beat(rate: float, emitted: float, seconds: float, slope: float, gain: float) -> bool:
    """Whether d >= 1 more drafts, each worth at most `gain`, can lift the step above `rate`, when the step now
    emits `emitted` tokens in `seconds` and each added token costs at least `slope` seconds (StepTimeModel's
    min_slope). The best they can reach is sup_d (emitted + d*gain) / (seconds + d*slope), a ratio monotone in
    d, so its sup is at d = 1 or at d -> inf (gain / slope; unbounded when slope = 0: drafts may be free)."""
    if gain <= 0.0:
        return False
    if slope <= 0.0:
        return True
    return max((emitted + gain) / (seconds + slope), gain / slope) > rate


def cut_to_budget(caps: Sequence[int], max_drafts: int | None) -> list[int]:
    """`caps` trimmed to `max_drafts` drafts in all, shallow positions first (every request's first draft, then
    every second, ...): how the fixed and table policies fit a token budget."""
    ks = [0] * len(caps)
    left = sum(caps) if max_drafts is None else max(0, max_drafts)
    for depth in range(1, max(caps, default=0) + 1):
        for i, cap in enumerate(caps):
            if cap >= depth and left > 0:
                ks[i] += 1
                left -= 1
    return ks


EVIDENCE_BUCKETS = range(1, 7)
"""evidence_bucket's values for a proposal with evidence (0: none)."""


def evidence_bucket(evidence: int) -> int:
    """The prior a proposal's evidence (the length of the match its drafts continue; 0: nothing to tell) selects:
    0 for none, then one per power of two (1, 2-3, 4-7, 8-15, 16-31, 32+)."""
    return 0 if evidence <= 0 else min(evidence.bit_length(), EVIDENCE_BUCKETS[-1])


class SpecController:
    """Chooses each step's draft counts under one SpeculativeConfig, for one proposer.

    State: global priors (EWMAs over the verifications of every request, starting from the proposer's declared
    prior), one per evidence bucket, and per-request AcceptanceStats seeded from the prior of the request's
    bucket. The evidence is what a lookup proposer knows of its proposal, the length of the match it continues:
    a request copying a document matches dozens of tokens back, a chance match in fresh text one or two, and
    their drafts pass at very different rates. One prior for both would let a batch's fresh-text requests talk
    its copying requests out of drafting (they are seeded low, never drafted, so never learn otherwise); per
    bucket, each learns from its own kind. A request whose evidence moves to another bucket is seeded again from
    that bucket's prior (the population at that evidence predicts better than this request's past at another).
    A draft position nobody has observed yet follows the deepest observed one before it (`follow_unseen`), so a
    kind of draft that passes at the first position is tried at the next, instead of staying at the declared prior.

    A request that has a proposal but gets k = 0 is not observed, so its estimates relax toward its bucket's prior
    at `probe_rate` per such step: after a run of rejections it is tried again, once its recovered estimate pays,
    and sooner where other requests' drafts are being accepted. A step where proposals existed and none was
    drafted relaxes the priors of those proposals' buckets toward the declared one at `global_probe_rate`, so a
    workload that stopped paying (random text) is probed again now and then, not every few steps by every request.
    """

    def __init__(self, config: SpeculativeConfig, step_time: StepTimeModel, prior: Sequence[float],
                 request_rate: float = 0.3, global_rate: float = 0.05, probe_rate: float = 0.02,
                 global_probe_rate: float = 0.0005):
        """prior: the proposer's P(accept) per position (the last value repeats up to num_speculative_tokens)."""
        self.config = config
        self.max_k = config.num_speculative_tokens
        if not prior:
            raise ValueError("prior needs at least one position")
        self.seed = [float(prior[min(j, len(prior) - 1)]) for j in range(self.max_k)]
        self.step_time = step_time
        self.global_rate, self.global_probe_rate = global_rate, global_probe_rate
        self.priors: dict[int, AcceptanceStats] = {}  # evidence bucket -> what its verifications taught
        self.request_rate = request_rate
        self.probe_rate = probe_rate
        self.stats: dict[str, AcceptanceStats] = {}
        self.buckets: dict[str, int] = {}  # request id -> the evidence bucket of its latest proposal
        self.draft_seconds = 0.0  # c: what making one draft costs (a network proposer's forward per draft token)
        self.seq_seconds = 0.0  # s: what each sequence of a step past the first adds to it (observe_step)
        self.verify_seconds = 0.0  # j: what a step of several sequences adds when it verifies drafts (observe_step)

    def choose(self, request_ids: Sequence[str], proposal_lens: Sequence[int], base_tokens: int = 0,
               base_emitted: float = 0.0, token_budget: int | None = None,
               evidence: Sequence[int] | None = None, base_seqs: int = 0) -> list[int]:
        """k_i for each decoding request of the step, in order.

        proposal_lens[i]: drafts request i's proposer has (0: nothing to propose; cap it by the tokens the
        request may still emit, less one). base_tokens / base_emitted / base_seqs: tokens the rest of the step
        feeds / is expected to emit / sequences it holds. token_budget: the step's token limit, if any. evidence[i]:
        the length of the match request i's proposal continues (None or 0: nothing to tell). All zeros means the
        plain path.
        """
        caps = [min(length, self.max_k) for length in proposal_lens]
        if not any(caps):
            return [0] * len(caps)  # the plain path: nothing read, nothing updated
        if evidence is not None:
            for rid, cap, found in zip(request_ids, caps, evidence):
                if cap:
                    self._move_to_bucket(rid, evidence_bucket(found))
        room = None if token_budget is None else token_budget - base_tokens - len(caps)
        policy = self.config.policy
        if policy == "fixed":
            return cut_to_budget(caps, room)
        if policy == "table":
            k = self.table_k(len(caps))
            return cut_to_budget([min(cap, k) for cap in caps], room)
        gains = [self.request_stats(rid).gains(cap) if cap else [] for rid, cap in zip(request_ids, caps)]
        if not any(row and row[0] > 0.0 for row in gains):
            ks = [0] * len(caps)  # every draft is expected to fail: the plain path, step time not read
        else:
            sequences = len(caps) + base_seqs
            overhead = self.seq_seconds * max(0, sequences - 1)
            jump = self.verify_seconds if sequences > 1 else 0.0  # one sequence's is in the curve
            ks = allocate(gains, self.step_time, base_tokens, base_emitted, room, self.draft_seconds, overhead, jump)
        for rid, cap, k in zip(request_ids, caps, ks):
            if cap and not k:
                stats = self.stats[rid]
                stats.relax_to = list(self.prior_of(rid).alphas)
                stats.idle()
        if not any(ks):
            for bucket in {self.buckets.get(rid, 0) for rid, cap in zip(request_ids, caps) if cap}:
                self.prior(bucket).idle()
        return ks

    @property
    def global_stats(self) -> AcceptanceStats:
        """The prior of proposals with no evidence (every proposal, for a proposer that gives none)."""
        return self.prior(0)

    def prior(self, bucket: int) -> AcceptanceStats:
        """The learned prior of an evidence bucket, starting from the proposer's declared one."""
        stats = self.priors.get(bucket)
        if stats is None:
            stats = self.priors[bucket] = AcceptanceStats(self.seed, self.global_rate, self.seed, self.global_probe_rate,
                                                          follow_unseen=True)
        return stats

    def prior_of(self, request_id: str) -> AcceptanceStats:
        return self.prior(self.buckets.get(request_id, 0))

    def _move_to_bucket(self, request_id: str, bucket: int) -> None:
        """The request's latest proposal has evidence of `bucket`: on a change it is seeded again from there."""
        if self.buckets.get(request_id, 0) != bucket:
            self.buckets[request_id] = bucket
            self.stats.pop(request_id, None)

    def table_k(self, batch_size: int) -> int:
        """The table policy's k for a step of `batch_size` requests (0 outside every range)."""
        for start, end, k in self.config.num_speculative_tokens_per_batch_size or ():
            if start <= batch_size <= end:
                return k
        return 0

    def request_stats(self, request_id: str) -> AcceptanceStats:
        """The request's estimates, seeded from its bucket's prior the first time it is asked for."""
        stats = self.stats.get(request_id)
        if stats is None:
            prior = self.prior_of(request_id)
            stats = self.stats[request_id] = AcceptanceStats(prior.alphas, self.request_rate, prior.alphas,
                                                             self.probe_rate, follow_unseen=True, seen=prior.seen)
        return stats

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """After verification: `accepted` of the request's `drafted` drafts passed; both EWMAs learn from it."""
        if drafted:
            self.request_stats(request_id).update(drafted, accepted)
            self.prior_of(request_id).update(drafted, accepted)

    def observe_step(self, num_tokens: int, seconds: float, num_seqs: int = 1, drafted: bool = False) -> None:
        """A step of `num_tokens` tokens in `num_seqs` sequences took `seconds` (measured by the caller); `drafted`:
        it verified drafts.

        The step-time model is one sequence's, as measured at start-up, and only steps of one sequence refresh it;
        what a step of several takes beyond it (each sequence's attention over its own pages, its sampling and
        output) is learned from the others as seq_seconds per sequence past the first. Both from every step are not
        identified: a rising model and a falling seq_seconds explain the same steps (a simulated fit: 60% of s).
        Likewise s is learned from the steps of several sequences that verify nothing, and what verifying adds to
        such a step (j, verify_seconds) from those that do."""
        if num_seqs <= 1:
            self.step_time.observe(num_tokens, seconds)
        elif seconds > 0:
            predicted, extra = self.step_time.predict(num_tokens), num_seqs - 1
            plain = predicted + self.seq_seconds * extra
            one = self.step_time.predict(1)  # a sequence adds at most a decode step: one noisy prefill moves s little
            if drafted:  # verifying adds at most a decode step's time, and a stall is not a cost
                jump = min(one, max(-one, min(seconds, MAX_RISE * (plain + self.verify_seconds)) - plain))
                self.verify_seconds = max(0.0, self.verify_seconds + SEQ_RATE * (jump - self.verify_seconds))
                return
            seconds = min(seconds, MAX_RISE * plain)  # a stall is not a cost
            per_seq = min(one, max(-one, (seconds - predicted) / extra))
            self.seq_seconds = max(0.0, self.seq_seconds + SEQ_RATE * (per_seq - self.seq_seconds))

    def finish(self, request_id: str) -> None:
        """Forget a finished or aborted request."""
        self.stats.pop(request_id, None)
        self.buckets.pop(request_id, None)
