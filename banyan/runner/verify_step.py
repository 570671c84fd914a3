"""A verify step's sampling: the tokens each drafting request gains from its rows of logits (spec/verify.py holds
the rule; this module lays the rows out for it).

    plan.verify: (request, its drafts, its first logits row) per drafting request; rows first .. first + k are
    p_0 .. p_k. Requests that are all plain greedy (no penalty, bias, min_tokens, logprobs or grammar) take one
    argmax over their rows (spec_verify.verify_plain_greedy); any other step takes the general verifier over rows
    padded to K + 1 per request, each row's processors seeing the drafts before it.
"""

from __future__ import annotations

import torch

from banyan.layers.sampler import Sampler, plain_greedy, request_generator, target_distribution
from banyan.scheduler.batch import SampledToken
from banyan.spec import verify as spec_verify
from banyan.structured import apply_bitmask
from banyan.structured.bitmask import draft_bitmask


def verify_drafts(logits: torch.Tensor, verify: list[tuple], sampler: Sampler, grammar_vocab: int,
                  to_host) -> dict[str, list[SampledToken]]:
    """The tokens each drafting request gains: its accepted drafts, then the target's token. grammar_vocab: the
    vocabulary a grammar's bitmask covers (the model's)."""
    requests = [request for request, _, _ in verify]
    vocab = sampler.vocab_size
    if all(plain_greedy(r) and r.matcher is None for r in requests):
        rows = [first + j for _, drafts, first in verify for j in range(1 + len(drafts))]
        out = spec_verify.verify_plain_greedy(_rows(logits, rows, vocab), [drafts for _, drafts, _ in verify], to_host)
        return {r.request_id: [SampledToken(t, None) for t in tokens] for r, tokens in zip(requests, out.token_ids)}
    # Request b's rows padded to K + 1 with its last: [first_b, first_b + 1, ..., first_b + k_b, first_b + k_b, ...]
    width = 1 + max(len(drafts) for _, drafts, _ in verify)
    index = [[first + min(j, len(drafts)) for j in range(width)] for _, drafts, first in verify]
    constrained = [(b, r.matcher, drafts) for b, (r, drafts, _) in enumerate(verify) if r.matcher is not None]
    raw = _rows(logits, [row for each in index for row in each], vocab, copy=bool(constrained))
    if constrained:  # structured output: p_j under the grammar's state after the first j drafts (in the copy)
        apply_bitmask(raw, *draft_bitmask(constrained, width, grammar_vocab))
    positions = [spec_verify.AfterDrafts(r, drafts[:j]) for r, drafts, _ in verify for j in range(width)]
    probs = target_distribution(raw, positions)  # [B * (K + 1), V]: row j's processors see the drafts before it
    draft_ids = [list(drafts) + [0] * (width - 1 - len(drafts)) for _, drafts, _ in verify]
    out = spec_verify.verify(
        probs.view(len(verify), width, -1),
        torch.tensor(draft_ids, dtype=torch.long, device=logits.device),
        torch.tensor([len(drafts) for _, drafts, _ in verify], dtype=torch.long, device=logits.device),
        greedy=[r.sampling_params.temperature == 0.0 for r in requests],
        generators=[request_generator(r, logits.device) for r in requests],
        default_generator=sampler.generator(logits.device),
        to_host=to_host,
    )
    verified = {r.request_id: [SampledToken(t, None) for t in tokens] for r, tokens in zip(requests, out.token_ids)}
    wanted = [b for b, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if wanted:  # after the ids, as the plain sampler reads them: from the raw rows that predicted each token
        reports = spec_verify.emitted_logprobs(logits[:, :vocab], [index[b] for b in wanted],
                                               [out.token_ids[b] for b in wanted],
                                               [requests[b].sampling_params.logprobs for b in wanted], to_host)
        for b, entries in zip(wanted, reports):
            verified[requests[b].request_id] = [SampledToken(e.token_id, e.logprob, e) for e in entries]
    return verified


def _rows(logits: torch.Tensor, rows: list[int], vocab: int, copy: bool = False) -> torch.Tensor:
    """logits[rows, :vocab]: the rows as they lie where they are consecutive, the vocabulary unpadded and no copy is
    asked for (batch 1: a copy took 0.1 ms, page faults mostly), else gathered (a copy)."""
    if not copy and rows == list(range(rows[0], rows[0] + len(rows))) and logits.shape[1] == vocab:
        return logits[rows[0] : rows[0] + len(rows)]
    return logits[torch.tensor(rows, device=logits.device), :vocab]
