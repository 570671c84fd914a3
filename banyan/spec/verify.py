"""The one verifier: which drafts the target accepts, and the token it adds, batched over requests, exact.

Request b drafted k_b tokens d_1 .. d_k (k_b <= K; rows are padded to K). The target's forward over
[last token, d_1 .. d_k] gives k + 1 distributions:

    position   0        1        ...   k-1        k
    p_j        p(·|x)   p(·|x d_1)     ...        p(·|x d_1 .. d_k)
    checks     d_1      d_2            d_k        (the bonus: nothing to check)

The output is d_1 .. d_a (the accepted prefix) and one token from the target: a correction at position a
when d_{a+1} was rejected, the bonus from p_k when all k were accepted. So a + 1 tokens, 1 <= a + 1 <= k + 1.

"Processed" probabilities: p_j is exactly what the plain sampler would draw from at that position, i.e. the
raw logits through logit_bias, the grammar bitmask, min_tokens, repetition/presence/frequency penalties
(sampler._processed), then temperature, top_k, top_p, min_p (sampler._scaled), then softmax: the path of
banyan.layers.sampler._sample_rows, given to the verifier by banyan.layers.sampler.target_distribution. Position j's
processors see the history plus d_1 .. d_j (penalties and min_tokens count the drafts before it; the grammar
mask is the matcher's state after them, which is why drafts are cut at the first token the grammar refuses).
Greedy rows: only the argmax of their rows is read, so they may hold the processed logits instead.

Randomness: one uniform u_j in [0, 1) per position and request, float64, [B, K + 1]. Unseeded rows draw from
one shared generator, a seeded row from its own (request.generator), so its tokens do not depend on the rest
of the batch. A seeded row's generator is left after exactly a + 1 draws, one per token emitted, as the plain
sampler draws one per token; with deterministic drafts position j's token is the inverse CDF of p_j at u_j,
the plain sampler's own draw, so a seeded request samples the same tokens whatever k the controller picks
(and as it would with no speculation). Host syncs: one, the transfer of the results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from banyan.kernels.cpu_argmax import argmax_rows
from banyan.layers.sampler import ToHost, compute_prompt_logprobs, inverse_cdf
from banyan.request import Request, TokenLogprobs


@dataclass(frozen=True)
class AfterDrafts:
    """A request as the sampler's logits processors see it at verify position j: its tokens, then the j drafts before
    the position (sampler.target_distribution takes one a row). Penalties count those drafts, and min_tokens counts
    them as output, as the plain sampler would have seen them once they were accepted, which they are wherever row j
    matters."""

    request: Request
    drafts: Sequence[int]

    @property
    def sampling_params(self):
        return self.request.sampling_params

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return [*self.request.output_token_ids, *self.drafts]

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.request.all_token_ids, *self.drafts]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.request.eos_token_ids

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.request.stop_token_ids


def emitted_logprobs(raw: torch.Tensor, rows: Sequence[Sequence[int]], token_ids: Sequence[Sequence[int]],
                     top: Sequence[int], to_host: ToHost) -> list[list[TokenLogprobs]]:
    """Per request that asked for logprobs: each token it emitted, its raw logprob, rank and `top` most likely (the
    plain sampler's report), from the raw logits row that predicted it (rows[i][j]: the row of position j). One read
    through to_host for all."""
    flat_rows = [row for i, tokens in enumerate(token_ids) for row in rows[i][: len(tokens)]]
    flat_ids = torch.tensor([t for tokens in token_ids for t in tokens], dtype=torch.long)
    entries = iter(compute_prompt_logprobs(raw[flat_rows], flat_ids, max(top), to_host, "logprobs"))
    return [[next(entries).keep_top(n) for _ in tokens] for tokens, n in zip(token_ids, top)]


@dataclass
class VerifyOutput:
    num_accepted: list[int]
    """Per request, how many of its drafts were accepted (a)."""
    token_ids: list[list[int]]
    """Per request, the tokens to append: the a accepted drafts, then the target's token (a + 1 in all)."""


def verify(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None] | None = None,
    default_generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    to_host=None,
) -> VerifyOutput:
    """target_probs: [B, K + 1, V] processed (module docstring); draft_ids: [B, K] long, row b valid up to
    num_drafts[b] ([B] long); draft_probs: [B, K, V], the draft's own processed distribution each draft was
    sampled from, or None for deterministic proposers (q = one-hot of the draft). greedy: per request.
    generators: per request, its own generator or None (the shared `default_generator`); greedy rows draw
    nothing. uniforms: [B, K + 1] in [0, 1) to use instead of drawing (tests, or a caller that owns the random
    stream; then no generator is read or moved). to_host(tensor, what): the read of the result (the runner's
    counts its reads: runner/host_reads.py); default tolist."""
    batch, width, _ = target_probs.shape
    device = target_probs.device
    num_drafts = num_drafts.to(device)
    valid = torch.arange(width - 1, device=device) < num_drafts[:, None]  # [B, K]
    greedy_rows = torch.tensor(list(greedy), dtype=torch.bool, device=device)
    all_greedy, any_greedy = all(greedy), any(greedy)  # from the host list: no device sync
    seeded = [(row, g) for row, g in enumerate(generators or ()) if g is not None and not greedy[row]]
    states = {}
    if uniforms is None and not all_greedy:
        uniforms, states = draw_uniforms(batch, width, seeded, default_generator, device)
    if draft_probs is None or all_greedy:
        num_accepted, final = _match(_target_tokens(target_probs, uniforms, greedy_rows), draft_ids, valid)
    else:
        num_accepted, final = _reject(target_probs, draft_ids, draft_probs, valid, num_drafts, uniforms)
        if any_greedy:
            greedy_accepted, greedy_final = _match(_argmax(target_probs), draft_ids, valid)
            num_accepted = torch.where(greedy_rows, greedy_accepted, num_accepted)
            final = torch.where(greedy_rows, greedy_final, final)
    rows = torch.cat([num_accepted[:, None], final[:, None], draft_ids.to(device)], dim=1)  # [B, 2 + K]
    table = (to_host or _read_list)(rows.long(), "verified ids")  # the one host sync: [a, final token, drafts]
    counts = [row[0] for row in table]
    for row, generator in seeded:
        if row in states:
            generator.set_state(states[row][counts[row]])  # as if it had drawn a + 1 uniforms only
    return VerifyOutput(counts, [row[2 : 2 + row[0]] + [row[1]] for row in table])


def verify_plain_greedy(rows: torch.Tensor, drafts: Sequence[Sequence[int]], to_host=None) -> VerifyOutput:
    """verify for requests that are all greedy with nothing that changes their logits (the sampler's plain_greedy)
    and no grammar: p_j's argmax is the raw row's, so one argmax over the rows and one read give every target token,
    and the drafts are matched on the host, where verify's torch ops for the same answer took 0.3 ms of a 7 ms
    batch-1 step. rows: [sum_b (1 + k_b), V], request b's 1 + k_b rows in order; the same tokens as verify."""
    targets = (to_host or _read_list)(argmax_rows(rows), "verified ids")
    counts, tokens, first = [], [], 0
    for draft in drafts:
        mine = targets[first : first + len(draft) + 1]
        accepted = greedy_accepted(draft, mine)
        counts.append(accepted)
        tokens.append(list(draft[:accepted]) + [mine[accepted]])
        first += len(draft) + 1
    return VerifyOutput(counts, tokens)


def greedy_accepted(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many drafts a greedy request keeps: the longest prefix equal to the target's tokens at those positions."""
    n = 0
    while n < len(drafts) and n < len(targets) and drafts[n] == targets[n]:
        n += 1
    return n


def _argmax(probs: torch.Tensor) -> torch.Tensor:
    """probs.argmax(-1) of [B, K + 1, V], through banyan's CPU argmax where it serves (the sampler's: the same first
    index of the max; torch took 186 us for 6 rows of a 49k vocabulary, banyan 18 us, beside a 5 ms verify step)."""
    batch, width, vocab = probs.shape
    return argmax_rows(probs.reshape(batch * width, vocab)).view(batch, width)


def _read_list(tensor: torch.Tensor, what: str) -> list:
    return tensor.tolist()


def draw_uniforms(batch: int, width: int, seeded: Sequence[tuple[int, torch.Generator]],
                  default_generator: torch.Generator | None, device: torch.device):
    """([batch, width] U[0, 1) float64, {row: generator state after each of its draws}): one shared draw, then
    each seeded row's own, one at a time from its generator (one draw per position, like the plain sampler's
    one per step), keeping the state after each so that the row can be left after the draws it used."""
    uniforms = torch.rand(batch, width, generator=default_generator, dtype=torch.float64, device=device)
    states = {}
    for row, generator in seeded:
        states[row] = []
        for j in range(width):
            uniforms[row, j] = torch.rand(1, generator=generator, dtype=torch.float64, device=device)[0]
            states[row].append(generator.get_state())
    return uniforms, states


def _target_tokens(probs: torch.Tensor, uniforms: torch.Tensor | None, greedy: torch.Tensor) -> torch.Tensor:
    """x_j per request and position [B, K + 1]: argmax p_j for greedy rows, a draw from p_j with u_j for the rest."""
    argmax = _argmax(probs)
    if uniforms is None:
        return argmax
    batch, width, vocab = probs.shape
    sampled = inverse_cdf(probs.reshape(-1, vocab), uniforms.reshape(-1)).view(batch, width)
    return torch.where(greedy[:, None], argmax, sampled)


def _match(target: torch.Tensor, draft_ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic drafts (q = one-hot at d_j), and greedy rows.

    Rejection sampling with q = one-hot(d): accept d with probability min(1, p(d) / 1) = p(d); on reject draw
    from norm(max(0, p - one-hot(d))) = p without d, renormalised. Drawing x ~ p and accepting iff x = d is
    the same law: P(x = d) = p(d), and x given x != d is p without d, renormalised. So x_j is drawn from p_j
    with u_j (the inverse CDF the plain sampler uses), the prefix where x_j = d_j is accepted, and x_a is the
    token added: the correction, or the bonus x_k. Greedy is the same with x_j = argmax p_j.
    """
    accepted = (target[:, :-1] == draft_ids) & valid  # [B, K]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B], the first mismatch stops it
    return num_accepted, target.gather(1, num_accepted[:, None])[:, 0]


def _reject(p: torch.Tensor, draft_ids: torch.Tensor, q: torch.Tensor, valid: torch.Tensor, num_drafts: torch.Tensor,
            uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts sampled from a distribution q (a draft model): standard rejection sampling.

        accept d_j  iff  u_j < r_j = min(1, p_j(d_j) / q_j(d_j))
        P(emit x) = q(x) min(1, p(x) / q(x))  +  P(reject) norm(max(0, p - q))(x)
                  = min(p(x), q(x))  +  (1 - S) (p(x) - min(p(x), q(x))) / (1 - S)      S = sum_y min(p(y), q(y))
                  = p(x)
    since P(reject) = 1 - sum_y q(y) min(1, p(y) / q(y)) = 1 - S and sum_y max(0, p - q)(y) = 1 - S.
    The first rejection at position a draws from norm(max(0, p_a - q_a)); given u_a >= r_a, the uniform
    (u_a - r_a) / (1 - r_a) is again U[0, 1) and independent of the decision, so it draws the correction: one
    uniform per position. All accepted: the bonus is drawn from p_k with u_k.
    """
    batch, width, vocab = p.shape
    rows = torch.arange(batch, device=p.device)
    p_d = p[:, :-1].gather(2, draft_ids[..., None])[..., 0]  # [B, K] p_j(d_j)
    q_d = q.gather(2, draft_ids[..., None])[..., 0]  # [B, K] q_j(d_j), > 0 where d_j was drawn from q_j
    ratio = (p_d / q_d.clamp_min(torch.finfo(q_d.dtype).tiny)).clamp(max=1.0).double()  # p(d) = 0: never accepted
    accepted = (uniforms[:, :-1] < ratio) & valid
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B] a
    rejected = num_accepted < num_drafts  # [B] position a holds a rejected draft, else it is the bonus
    at = num_accepted.clamp(max=max(width - 2, 0))  # a, kept inside q's K positions (the bonus row is masked)
    q_a = torch.where(rejected[:, None], q[rows, at] if width > 1 else 0.0, 0.0)  # [B, V], 0 for the bonus
    residual = (p[rows, num_accepted] - q_a).clamp_min(0.0)  # max(0, p_a - q_a); p_k itself for the bonus
    u = uniforms[rows, num_accepted]
    r = torch.where(rejected, ratio[rows, at] if width > 1 else 0.0, 0.0)
    u = torch.where(rejected, (u - r) / (1.0 - r), u).clamp(0.0, 1.0 - 2**-53)
    return num_accepted, inverse_cdf(residual, u)
