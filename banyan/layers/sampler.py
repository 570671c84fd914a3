"""Sampler: one batched pass from logits to the next token of every row, with vLLM's semantics.

    raw logits ──┬─ rows that asked for logprobs: logsumexp ─► the chosen token's logprob, rank, top-k
                 ├─ only when some row has them, on a copy: logit_bias, grammar bitmask (constrained
                 │  rows), min_tokens (mask EOS / stop ids unless the grammar allows nothing else),
                 │  repetition, presence/frequency penalties
                 ├─ greedy rows: argmax                          [an all-greedy batch stops here]
                 └─ ÷ temperature ─► top_k ─► top_p ─► min_p ─► exp ─► inverse CDF (a uniform a row)

Every step is a few tensor ops over many rows; a step that no row needs is skipped. On the CPU the
rows go through in chunks of about 8 MB, which stay in cache across those ops and below malloc's
mmap threshold (a 50 MB temporary is page-faulted in anew every step); on a GPU in one chunk.

Sampling is inverse-transform: u ~ U[0, 1) per row picks the token whose slice of the cumulative
probabilities holds it. The exponential race (argmax p / Exp(1)) needs a random number per token:
on the CPU drawing them cost at least four times the softmax itself (measured at 256 x 49,152),
where this needs one per row. Unseeded rows share one batched draw; a seeded row draws from its own
`request.generator`, so it samples the same tokens whatever else is in the batch and after
preemption. Like the race it needs no host sync: cumsum, compare, sum and gather on the device.
Host syncs: one transfer of the sampled ids at the end, through the caller's `to_host` (the runner's counts
them: runner/host_reads.py); then, only when some row asks for logprobs, one more of all their values (after
the ids, so that nothing else waits for them); on the CPU only, top_p's check of its candidates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F

from banyan.forward_batch import to_device
from banyan.kernels.cpu_argmax import argmax_rows
from banyan.request import Request, TokenLogprobs
from banyan.structured import apply_bitmask

_NEG_INF = float("-inf")
ToHost = Callable[[torch.Tensor, str], list]
"""(device tensor, what it is) -> its values as nested lists: every read of the step's results goes through one."""
CPU_CHUNK_BYTES = 8 << 20
"""Logits per chunk of rows on the CPU: small enough to stay in cache through several passes."""
BLOCK = 128
"""Tokens per block in the two-level inverse CDF: one short pass per level."""
TOP_P_CANDIDATES = 1024
"""top_p looks at this many most likely tokens first; a full sort only for rows they do not cover."""


@dataclass
class SamplerOutput:
    token_ids: list[int]
    """One sampled token per row."""
    logprobs: list[TokenLogprobs | None]
    """Per row; set only for requests whose sampling_params.logprobs is not None."""
    chosen_logprobs: list[float | None]
    """The chosen token's raw log-probability for rows that asked for logprobs, None for the others:
    `cumulative_logprob` is reported only with logprobs, as in vLLM (a logsumexp over the vocabulary
    cost more than everything else of a greedy step)."""


class Sampler:
    def __init__(self, vocab_size: int, default_seed: int | None = 0, cpu_chunk_bytes: int = CPU_CHUNK_BYTES):
        self.vocab_size = vocab_size
        self.default_seed = default_seed
        self.cpu_chunk_bytes = cpu_chunk_bytes
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self, logits: torch.Tensor, requests: Sequence[Request], grammar: tuple[torch.Tensor, list[int]] | None = None,
        to_host: ToHost | None = None,
    ) -> SamplerOutput:
        """logits: [len(requests), vocab] fp32, row i belongs to requests[i] (whose output so far is
        request.output_token_ids, prompt request.prompt_token_ids). grammar: (bitmask, rows), the
        bitmask's row j masks logits row rows[j] (structured output); None when no row is constrained.
        to_host: reads device tensors (default: tolist); called once for the ids, once more for any logprobs."""
        to_host = to_host or read_list
        raw = logits[:, : self.vocab_size].float()  # drop padded vocabulary columns
        if grammar is None and all(plain_greedy(r) for r in requests):  # each row's argmax and nothing else
            return SamplerOutput(to_host(argmax_rows(raw), "sampled ids"), [None] * len(requests), [None] * len(requests))
        uniforms = self._uniforms(requests, raw.device)  # drawn for the whole batch: chunking changes nothing
        params = [r.sampling_params for r in requests]
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        k = max((params[i].logprobs for i in wanted), default=0)
        token_ids, tables = [], []
        for rows in self._chunks(raw):
            tokens = _sample_rows(raw[rows], requests[rows], _grammar_rows(grammar, rows), _rows(uniforms, rows))
            token_ids.append(tokens)
            if wanted:  # while the chunk is in cache; read after the ids
                tables.append(_token_logprob_table(raw[rows], params[rows], tokens, k))
        ids = to_host(torch.cat(token_ids), "sampled ids")
        logprobs = _read_token_logprobs(tables, params, wanted, to_host)
        chosen = [None if entry is None else entry.logprob for entry in logprobs]
        return SamplerOutput(ids, logprobs, chosen)

    def _chunks(self, logits: torch.Tensor) -> list[slice]:
        rows, vocab = logits.shape
        step = rows if logits.device.type != "cpu" else max(1, self.cpu_chunk_bytes // (4 * vocab))
        return [slice(start, start + step) for start in range(0, rows, step)]

    def _uniforms(self, requests: Sequence[Request], device: torch.device) -> torch.Tensor | None:
        """One U[0, 1) per row (float64); None when every row is greedy. Unseeded rows share one
        draw from the sampler's generator; each seeded row draws from its own."""
        if all(r.sampling_params.temperature == 0.0 for r in requests):
            return None
        uniforms = torch.rand(len(requests), generator=self.generator(device), dtype=torch.float64, device=device)
        params = [r.sampling_params for r in requests]
        seeded = [i for i, p in enumerate(params) if p.seed is not None and p.temperature != 0.0]
        if seeded:
            draws = [_draw(requests[i], device) for i in seeded]
            uniforms[to_device(seeded, torch.long, device)] = torch.cat(draws)
        return uniforms

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator unseeded rows share (seeded from the engine's seed on first use; None: from the OS)."""
        if device not in self._generators:
            generator = self._generators[device] = torch.Generator(device)
            if self.default_seed is None:
                generator.seed()  # a fresh seed from the OS each start
            else:
                generator.manual_seed(self.default_seed)
        return self._generators[device]


def read_list(tensor: torch.Tensor, what: str) -> list:
    """The plain device->host read (a ToHost); `what` names it for one that counts."""
    return tensor.tolist()


def _rows(x: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if x is None else x[rows]


def _draw(request: Request, device: torch.device) -> torch.Tensor:
    """One U[0, 1) from the request's own generator."""
    return torch.rand(1, generator=request_generator(request, device), dtype=torch.float64, device=device)


def request_generator(request: Request, device: torch.device) -> torch.Generator | None:
    """A seeded request's own generator, made from its seed on first use; None for an unseeded or greedy one."""
    if request.sampling_params.seed is None or request.sampling_params.temperature == 0.0:
        return None
    if request.generator is None or request.generator.device != device:
        request.generator = torch.Generator(device).manual_seed(request.sampling_params.seed)
    return request.generator


def target_distribution(raw: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """What the sampler draws from at each row, for the verifier (banyan.spec.verify): the ops of _sample_rows up
    to the draw. Sampled rows: the unnormalised probabilities its inverse CDF reads; greedy rows: the processed
    logits (only their argmax is read). raw: [N, vocab] (vocab_size columns), row i belonging to requests[i] (a
    verify position: spec/verify.py's AfterDrafts, whose history holds the drafts before it); the rows take no
    grammar mask (the caller applies it)."""
    params = [r.sampling_params for r in requests]
    logits = _processed(raw.float(), requests, None)
    greedy = [p.temperature == 0.0 for p in params]
    if all(greedy):
        return logits
    probs = _exp_shifted(_scaled(logits, params))
    if any(greedy):
        probs = torch.where(to_device(greedy, torch.bool, raw.device)[:, None], logits, probs)
    return probs


def _sample_rows(raw: torch.Tensor, requests: Sequence[Request], grammar, uniforms: torch.Tensor | None):
    """The token ids [N] (a tensor) of one chunk of rows."""
    params = [r.sampling_params for r in requests]
    logits = _processed(raw, requests, grammar)
    greedy = [p.temperature == 0.0 for p in params]
    if all(greedy):
        return argmax_rows(logits)
    token_ids = inverse_cdf(_exp_shifted(_scaled(logits, params)), uniforms)
    if any(greedy):
        token_ids = torch.where(to_device(greedy, torch.bool, raw.device), argmax_rows(logits), token_ids)
    return token_ids


def _grammar_rows(grammar: tuple[torch.Tensor, list[int]] | None, rows: slice):
    """The grammar's (bitmask, rows) for the logits rows in `rows`, numbered from rows.start."""
    if grammar is None:
        return None
    bitmask, masked = grammar
    picked = [j for j, row in enumerate(masked) if rows.start <= row < rows.stop]
    if len(picked) == len(masked) and rows.start == 0:
        return grammar
    if not picked:
        return None
    return bitmask[picked], [masked[j] - rows.start for j in picked]


def _processed(raw: torch.Tensor, requests: Sequence[Request], grammar) -> torch.Tensor:
    """raw with bias, grammar, min_tokens and penalties applied: a copy, or raw itself when no row has any."""
    if grammar is None and not any(_has_processors(r) for r in requests):
        return raw
    params = [r.sampling_params for r in requests]
    logits = raw.clone()
    _apply_logit_bias(logits, params)
    if grammar is not None:
        apply_bitmask(logits, *grammar)
    _apply_min_tokens(logits, requests)
    _apply_penalties(logits, requests)
    return logits


def plain_greedy(request: Request) -> bool:
    """Greedy, without logprobs nor anything that changes the logits: its token is the raw logits' argmax (the
    fast path of a batch-1 or all-greedy step, which skips the chunks, the per-row lists and the logprobs pass)."""
    p = request.sampling_params
    return p.temperature == 0.0 and p.logprobs is None and not _has_processors(request)


def _has_processors(request: Request) -> bool:
    p = request.sampling_params
    return bool(p.logit_bias or request.num_output_tokens < p.min_tokens or p.has_penalties)


def _scaled(logits: torch.Tensor, params) -> torch.Tensor:
    """logits / temperature after top_k, top_p and min_p (greedy rows: temperature 1); logits
    itself when no row has any of these."""
    temperature = [p.temperature if p.temperature > 0.0 else 1.0 for p in params]
    masks = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
    if not masks and all(t == 1.0 for t in temperature):
        return logits
    logits = logits / _column(temperature, logits)  # a new tensor: the masks write in place
    _apply_top_k_top_p(logits, params)
    _apply_min_p(logits, params)
    return logits


def _exp_shifted(x: torch.Tensor) -> torch.Tensor:
    """exp(x - row max): unnormalised probabilities (a row whose max is infinite gets exp(x))."""
    shift = x.amax(dim=-1, keepdim=True)
    return (x - torch.where(shift.isinf(), 0.0, shift)).exp_()


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token i with probability probs[i] / sum(probs), from one u ~ U[0, 1) per row, in two levels:

        block:  pick block b of BLOCK tokens by its mass; where u fell inside b's slice is a new
                uniform u' (independent of b), which picks the token inside b the same way.
        level:  slices  [0, c_0) [c_0, c_1) ... [c_{M-2}, c_{M-1}),  c_j = w_0 + ... + w_j
                pick the first j with u * c_{M-1} < c_j; a zero-width slice is never picked.
    """
    rows, vocab = probs.shape
    if vocab % BLOCK:
        probs = F.pad(probs, (0, -vocab % BLOCK))  # zero-probability tokens up to whole blocks
    blocks = probs.unflatten(1, (-1, BLOCK))  # [N, num_blocks, BLOCK]
    block, uniforms = _pick(blocks.sum(dim=-1).double(), uniforms)
    token, _ = _pick(blocks[torch.arange(rows, device=probs.device), block].double(), uniforms)
    return block * BLOCK + token


def _pick(widths: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """widths [N, M] >= 0, uniforms [N] in [0, 1) -> (index of the slice u falls in [N], where in that
    slice it fell, scaled to [0, 1) [N])."""
    ends = widths.cumsum(dim=-1)  # c_j
    target = uniforms[:, None] * ends[:, -1:]  # [N, 1]
    index = (ends <= target).sum(dim=-1, keepdim=True)
    # Rounding can put the target at the very end; then take the last slice that has any width.
    positions = torch.arange(widths.shape[1], device=widths.device)
    last = torch.where(widths > 0, positions, 0).amax(dim=-1, keepdim=True)
    index = torch.minimum(index, last)
    width = widths.gather(1, index)
    inside = (target - (ends.gather(1, index) - width)) / width
    return index[:, 0], inside[:, 0].clamp(0.0, 1.0 - 2**-53)


def _token_logprob_table(raw: torch.Tensor, params, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """The logprob table (_logprob_table) of the chunk's rows whose request asked for logprobs, top k each."""
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if len(wanted) < len(params):
        rows = to_device(wanted, torch.long, raw.device)
        raw, token_ids = raw[rows], token_ids[rows]
    return _logprob_table(raw, torch.logsumexp(raw, dim=-1), token_ids, k)


def _read_token_logprobs(tables: list[torch.Tensor], params, wanted: list[int],
                         to_host: ToHost) -> list[TokenLogprobs | None]:
    """Per row: its logprob entry with its own top-n, or None for rows that did not ask; one read for all."""
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    if not wanted:
        return logprobs
    for i, entry in zip(wanted, _entries(to_host(torch.cat(tables), "logprobs"))):
        logprobs[i] = entry.keep_top(params[i].logprobs)
    return logprobs


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int, to_host: ToHost | None = None,
                            what: str = "prompt logprobs") -> list[TokenLogprobs]:
    """Row j's logits predict target_ids[j]: its logprob, rank and top-k (one read through to_host, named `what`)."""
    logits = logits.float()
    table = _logprob_table(logits, torch.logsumexp(logits, dim=-1), target_ids.to(logits.device), k)
    return _entries((to_host or read_list)(table, what))


def _logprob_table(logits: torch.Tensor, lse: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """logits: [N, V] raw, lse: [N] their logsumexp (logprob = logit - lse), token_ids: [N] -> [N, 3 + 2k] float64:
    token id, its logprob, its rank, the top k ids, their logprobs (ids below 2^53: exact in float64), so that one
    read brings them all. Rank is 1 + the number of tokens strictly more likely. No [N, V] log_softmax is built."""
    k = min(k, logits.shape[-1])
    chosen = logits.gather(1, token_ids[:, None])  # [N, 1]
    ranks = torch.count_nonzero(logits > chosen, dim=-1) + 1
    columns = [token_ids[:, None], chosen - lse[:, None], ranks[:, None]]
    if k > 0:
        top_values, top_ids = logits.topk(k, dim=-1)  # [N, k], most likely first
        columns += [top_ids, top_values - lse[:, None]]
    return torch.cat([c.double() for c in columns], dim=1)


def _entries(table: list[list[float]]) -> list[TokenLogprobs]:
    """_logprob_table's rows, read to the host, as TokenLogprobs."""
    entries = []
    for row in table:
        k = (len(row) - 3) // 2
        ids, values = row[3 : 3 + k], row[3 + k :]
        top = {int(t): v for t, v in zip(ids, values)}
        entries.append(TokenLogprobs(int(row[0]), row[1], int(row[2]), top))
    return entries


# -- logits processors (in place on [B, V]) ---------------------------------------------------------
def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return to_device(values, like.dtype, like.device)[:, None]  # [B, 1]


def _apply_logit_bias(logits: torch.Tensor, params) -> None:
    rows, cols, biases = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            if token_id < logits.shape[1]:
                rows.append(i), cols.append(token_id), biases.append(bias)
    if rows:
        index = (to_device(rows, torch.long, logits.device), to_device(cols, torch.long, logits.device))
        logits.index_put_(index, to_device(biases, logits.dtype, logits.device), accumulate=True)


def _apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    rows, cols = [], []
    for i, r in enumerate(requests):
        if r.num_output_tokens < r.sampling_params.min_tokens:
            banned = [t for t in r.eos_token_ids | r.stop_token_ids if t < logits.shape[1]]
            rows += [i] * len(banned)
            cols += banned
    if rows:
        banned = logits.clone()
        banned[to_device(rows, torch.long, logits.device), to_device(cols, torch.long, logits.device)] = _NEG_INF
        # A grammar that allows only EOS wins over min_tokens: such rows keep their logits.
        logits.copy_(torch.where(banned.isneginf().all(dim=-1, keepdim=True), logits, banned))


def _occurrences(token_lists: list[Sequence[int]], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) of every token in every row's list, out-of-vocabulary ids left out."""
    rows = torch.arange(len(token_lists)).repeat_interleave(torch.tensor([len(t) for t in token_lists]))
    flat = list(chain.from_iterable(token_lists))
    cols = torch.tensor(flat, dtype=torch.long)
    if flat and (min(flat) < 0 or max(flat) >= vocab):
        keep = (cols >= 0) & (cols < vocab)
        rows, cols = rows[keep], cols[keep]
    return to_device(rows, torch.long, device), to_device(cols, torch.long, device)


def _token_counts(logits: torch.Tensor, token_lists: list[Sequence[int]]) -> torch.Tensor:
    """[B, V] count of each token in each row's list: one scatter_add over the flattened batch."""
    batch, vocab = logits.shape
    rows, cols = _occurrences(token_lists, vocab, logits.device)
    counts = torch.zeros(batch * vocab, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(0, rows * vocab + cols, torch.ones_like(cols, dtype=logits.dtype))
    return counts.view(batch, vocab)


def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    params = [r.sampling_params for r in requests]
    if any(p.repetition_penalty != 1.0 for p in params):
        # HF/vLLM: over prompt + output tokens, divide positive logits and multiply negative ones.
        # Only the seen tokens' logits are read and written (a token seen twice gets the same value twice).
        tokens = [r.all_token_ids if p.repetition_penalty != 1.0 else () for r, p in zip(requests, params)]
        rows, cols = _occurrences(tokens, logits.shape[1], logits.device)
        penalty = _column([p.repetition_penalty for p in params], logits)[rows, 0]
        seen = logits[rows, cols]
        logits[rows, cols] = torch.where(seen > 0, seen / penalty, seen * penalty)
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
    Only rows with a mask take part, and only their leading candidates are sorted (topk): k of them,
    or TOP_P_CANDIDATES for top_p alone; rows whose candidates hold less than top_p are redone in full.
    """
    vocab = logits.shape[1]
    k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    rows = [i for i, p in enumerate(params) if k[i] < vocab or p.top_p < 1.0]
    if not rows:
        return
    # A GPU sorts whole rows fast, and checking the candidates' cover would cost it a host sync.
    candidates = TOP_P_CANDIDATES if logits.device.type == "cpu" else vocab
    width = min(vocab, max(k[i] if k[i] < vocab else candidates for i in rows))
    index = to_device(rows, torch.long, logits.device)
    top_p = _column([params[i].top_p if params[i].top_p < 1.0 else float("inf") for i in rows], logits)  # inf: off
    kept, covered = _top_k_top_p_rows(logits[index], _column([k[i] for i in rows], logits), top_p, width)
    top_p_alone = any(k[i] == vocab for i in rows)  # only such rows can be uncovered (never on a GPU: width = vocab)
    if width < vocab and top_p_alone and not bool(covered.all()):  # CPU tensors: no device wait
        full, _ = _top_k_top_p_rows(logits[index], _column([k[i] for i in rows], logits), top_p, vocab)
        kept = torch.where(covered[:, None], kept, full)
    logits[index] = kept


def _top_k_top_p_rows(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, width: int):
    """(the rows with everything past their top_k / top_p set to -inf, whether the `width` leading
    candidates decided each row's top_p). logits: [R, V]; k, top_p: [R, 1]."""
    sorted_logits, order = logits.topk(width, dim=-1)  # [R, width], most likely first
    position = torch.arange(width, device=logits.device)[None, :]
    sorted_logits.masked_fill_(position >= k, _NEG_INF)
    # Probabilities over everything top_k keeps: the candidates, or the whole row when k = vocab.
    kept_all = k >= logits.shape[1]
    total = torch.where(kept_all, logits.logsumexp(-1, keepdim=True), sorted_logits.logsumexp(-1, keepdim=True))
    probs = (sorted_logits - total).exp()
    mass = probs.cumsum(dim=-1)
    sorted_logits.masked_fill_(mass - probs >= top_p, _NEG_INF)
    covered = (mass[:, -1:] >= top_p) | (k <= width)
    kept = torch.full_like(logits, _NEG_INF).scatter_(1, order, sorted_logits)
    return kept, covered[:, 0]


def _apply_min_p(logits: torch.Tensor, params) -> None:
    """Drop tokens with p < min_p * p_max, i.e. logit < max_logit + log(min_p)."""
    if not any(p.min_p > 0.0 for p in params):
        return
    log_min_p = _column([math.log(p.min_p) if p.min_p > 0 else _NEG_INF for p in params], logits)
    threshold = logits.max(dim=-1, keepdim=True).values + log_min_p
    logits.masked_fill_(logits < threshold, _NEG_INF)
