"""Sampler: one batched pass from logits to the next token of every row, with vLLM's semantics.

    raw logits ──► log_softmax ──► logprobs (chosen token, its rank, top-k)   [what the model said]
        │
        ├─ logit_bias, grammar bitmask (constrained rows only), min_tokens (mask EOS / stop ids
        │  unless the grammar allows nothing else), repetition, presence/frequency penalties
        ├─ ÷ temperature ──► greedy rows: argmax
        └─ top_k ─► top_p ─► min_p masks ─► softmax ─► argmax(p / Exp(1))  [exponential race]

Every step is one tensor op over the whole batch; a step that no row needs is skipped. The only
loop over rows draws the exponential noise of seeded rows from their own `request.generator`, so a
seeded row samples the same token whatever else is in the batch and after preemption.
Host syncs: one transfer of the results at the end (plus logprobs when some row asks for them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from banyan.request import Request, TokenLogprobs
from banyan.structured import apply_bitmask

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    token_ids: list[int]
    """One sampled token per row."""
    logprobs: list[TokenLogprobs | None]
    """Per row; set only for requests whose sampling_params.logprobs is not None."""
    chosen_logprobs: list[float]
    """The chosen token's raw log-probability for every row (for `cumulative_logprob`)."""


class Sampler:
    def __init__(self, vocab_size: int, default_seed: int = 0):
        self.vocab_size = vocab_size
        self.default_seed = default_seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self, logits: torch.Tensor, requests: Sequence[Request], grammar: tuple[torch.Tensor, list[int]] | None = None
    ) -> SamplerOutput:
        """logits: [len(requests), vocab] fp32, row i belongs to requests[i] (whose output so far is
        request.output_token_ids, prompt request.prompt_token_ids). grammar: (bitmask, rows), the
        bitmask's row j masks logits row rows[j] (structured output); None when no row is constrained."""
        logits = logits[:, : self.vocab_size].float()  # drop padded vocabulary columns
        params = [r.sampling_params for r in requests]
        # Raw logprob = logit - logsumexp: one reduction here, a full log-softmax only for rows that
        # asked for top logprobs (a [B, V] log_softmax per step was a large share of the sampler's time).
        raw, lse = logits, torch.logsumexp(logits, dim=-1, keepdim=True)  # lse: [B, 1]

        logits = logits.clone()
        _apply_logit_bias(logits, params)
        if grammar is not None:
            apply_bitmask(logits, *grammar)
        _apply_min_tokens(logits, requests)
        _apply_penalties(logits, requests)

        greedy = [p.temperature == 0.0 for p in params]
        token_ids = logits.argmax(dim=-1)  # [B]
        if not all(greedy):
            temperature = _column([1.0 if g else p.temperature for g, p in zip(greedy, params)], logits)
            logits.div_(temperature)
            _apply_top_k_top_p(logits, params)
            _apply_min_p(logits, params)
            sampled = self._sample(torch.softmax(logits, dim=-1), requests)
            token_ids = torch.where(torch.tensor(greedy, device=logits.device), token_ids, sampled)

        chosen = (raw.gather(1, token_ids[:, None]) - lse).squeeze(1)  # [B]
        token_list, chosen_list = token_ids.tolist(), chosen.tolist()
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if wanted:
            rows = torch.tensor(wanted, device=logits.device)
            k = max(params[i].logprobs for i in wanted)
            entries = _logprob_entries(raw[rows] - lse[rows], token_ids[rows], k)
            for i, entry in zip(wanted, entries):
                entry.top = dict(list(entry.top.items())[: params[i].logprobs])
                logprobs[i] = entry
        return SamplerOutput(token_list, logprobs, chosen_list)

    def _sample(self, probs: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Exponential race: argmax(p / q) with q ~ Exp(1) picks token i with probability p_i."""
        q = torch.empty_like(probs).exponential_(generator=self._generator(probs.device))
        for i, request in enumerate(requests):
            seed = request.sampling_params.seed
            if seed is None or request.sampling_params.temperature == 0.0:
                continue
            if request.generator is None or request.generator.device != probs.device:
                request.generator = torch.Generator(probs.device).manual_seed(seed)
            q[i].exponential_(generator=request.generator)
        return probs.div_(q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.default_seed)
        return self._generators[device]


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Row j's logits predict target_ids[j]: its logprob, rank and top-k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return _logprob_entries(logprobs, target_ids.to(logits.device), k)


def _logprob_entries(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """logprobs: [N, V]; token_ids: [N]. Rank is 1 + the number of tokens strictly more likely."""
    k = min(k, logprobs.shape[-1])
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    tops: list[dict[int, float]] = [{} for _ in range(len(token_ids))]
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)  # [N, k], most likely first
        tops = [dict(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
    rows = zip(token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), tops)
    return [TokenLogprobs(t, lp, rank, top) for t, lp, rank, top in rows]


# -- logits processors (in place on [B, V]) ---------------------------------------------------------
def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]  # [B, 1]


def _apply_logit_bias(logits: torch.Tensor, params) -> None:
    rows, cols, biases = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            if token_id < logits.shape[1]:
                rows.append(i), cols.append(token_id), biases.append(bias)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


def _apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    rows, cols = [], []
    for i, r in enumerate(requests):
        if r.num_output_tokens < r.sampling_params.min_tokens:
            banned = [t for t in r.eos_token_ids | r.stop_token_ids if t < logits.shape[1]]
            rows += [i] * len(banned)
            cols += banned
    if rows:
        banned = logits.clone()
        banned[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = _NEG_INF
        # A grammar that allows only EOS wins over min_tokens: such rows keep their logits.
        logits.copy_(torch.where(banned.isneginf().all(dim=-1, keepdim=True), logits, banned))


def _token_counts(logits: torch.Tensor, token_lists: list[Sequence[int]]) -> torch.Tensor:
    """[B, V] count of each token in each row's list: one scatter_add over the flattened batch."""
    batch, vocab = logits.shape
    device = logits.device
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    rows = torch.repeat_interleave(torch.arange(batch, device=device), lengths)
    cols = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    cols = torch.where((cols >= 0) & (cols < vocab), cols, vocab)  # out-of-vocabulary ids go to a spare column
    counts = torch.zeros(batch * (vocab + 1), dtype=logits.dtype, device=device)
    counts.scatter_add_(0, rows * (vocab + 1) + cols, torch.ones_like(cols, dtype=logits.dtype))
    return counts.view(batch, vocab + 1)[:, :vocab]


def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    params = [r.sampling_params for r in requests]
    if any(p.repetition_penalty != 1.0 for p in params):
        # HF/vLLM: over prompt + output tokens, divide positive logits and multiply negative ones
        tokens = [r.all_token_ids if p.repetition_penalty != 1.0 else () for r, p in zip(requests, params)]
        seen = _token_counts(logits, tokens) > 0
        penalty = _column([p.repetition_penalty for p in params], logits).expand_as(logits)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, scaled, logits))
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        # OpenAI: over output tokens, logits -= frequency * count + presence * (count > 0)
        counts = _token_counts(logits, [r.output_token_ids for r in requests])
        frequency = _column([p.frequency_penalty for p in params], logits)
        presence = _column([p.presence_penalty for p in params], logits)
        logits.sub_(frequency * counts + presence * (counts > 0).to(logits.dtype))


def _apply_top_k_top_p(logits: torch.Tensor, params) -> None:
    """Keep the k most likely tokens, then the smallest set of those whose mass reaches top_p.

    Works in sorted order (descending) so ties at the k-th value keep exactly k tokens:
        sorted:     l_0 >= l_1 >= ... >= l_{V-1}
        top_k:      drop positions j >= k
        top_p:      p = softmax(kept), drop j when p_0 + ... + p_{j-1} >= top_p  (position 0 always stays)
    """
    use_k = any(p.top_k > 0 for p in params)
    use_p = any(p.top_p < 1.0 for p in params)
    if not (use_k or use_p):
        return
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if use_k:
        k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
        position = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits.masked_fill_(position >= k[:, None], _NEG_INF)
    if use_p:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        top_p = _column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], logits)
        sorted_logits.masked_fill_(mass_before >= top_p, _NEG_INF)
    logits.scatter_(1, order, sorted_logits)


def _apply_min_p(logits: torch.Tensor, params) -> None:
    """Drop tokens with p < min_p * p_max, i.e. logit < max_logit + log(min_p)."""
    if not any(p.min_p > 0.0 for p in params):
        return
    log_min_p = _column([math.log(p.min_p) if p.min_p > 0 else _NEG_INF for p in params], logits)
    threshold = logits.max(dim=-1, keepdim=True).values + log_min_p
    logits.masked_fill_(logits < threshold, _NEG_INF)
