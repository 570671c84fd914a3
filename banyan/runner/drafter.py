"""Drafting by a network inside the runner's step: it proposes each drafting request's k tokens, greedily, before
the target verifies them in the same step.

The scheduler reserved the room: a drafting request's ScheduledRequest feeds [last token | k placeholders] with
slots for all 1 + k (banyan/spec/network.py). `draft` writes the k tokens in, one batched forward per depth, for
the requests that still draft at that depth:

    depth 0:          each request feeds the verified tokens its draft K/V lacks, up to and including the last one
                      (positions c .. start); d_1 = argmax of the logits at its last row
    depth j = 1..K-1: rows = requests with k_i > j; each feeds d_j at position start + j; d_{j+1} = argmax

layer_skip (own_cache=False): the target's first `num_layers` layers, its final norm and lm_head. Their K/V are
the target's own layers 0..L-1, which for verified tokens hold exactly what the draft computes (same weights,
same inputs), so c = start always: no catch-up.

draft_model (own_cache=True): a smaller model whose K/V live in its own tensors, indexed by the same page ids as
the target's (one block table, one allocation; the pool's size counts both). Its K/V are valid up to a position
the drafter remembers per request (for the request's life: a weak reference): what a step drafted stays valid
up to the last accepted draft, a request that skipped drafting catches up on the tokens it missed (a prefill
chunk of the draft at depth 0), and one that was preempted (its pages freed) starts again from 0. A prefix-cache
hit gives the draft nothing either: it computes the prefix itself, writing into the shared pages what any other
request with that prefix writes there.

What a draft writes at draft positions lies in slots reserved for this step; the verify pass then overwrites the
target's. A deterministic draft is a one-hot q, which the verifier's rejection sampling allows for any sampling.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence

import torch

from banyan.forward_batch import ForwardBatch
from banyan.scheduler.batch import SampledToken, ScheduledRequest


class NetworkDrafter:
    def __init__(self, model, kv_caches, vocab_size: int, page_size: int, device: torch.device, *,
                 num_layers: int | None = None, own_cache: bool = False,
                 forward: Callable[[ForwardBatch], torch.Tensor] | None = None):
        """num_layers: run only the model's first layers (layer_skip); own_cache: kv_caches are the draft's own
        (draft_model), so it must catch up on verified tokens it has not seen; forward: the final hidden states of a
        batch where the draft's runner has a faster way than the modules (a draft model's own runner: its one-call
        CPU step or CUDA graphs)."""
        self.model, self.kv_caches, self.num_layers, self.own_cache = model, kv_caches, num_layers, own_cache
        self.forward = forward or (lambda fb: model(fb, kv_caches, num_layers=num_layers))
        self.vocab_size, self.page_size, self.device = vocab_size, page_size, device
        self._valid: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> (preemptions, end)

    @torch.inference_mode()
    def draft(self, items: list[ScheduledRequest]) -> float:
        """Fill each item's draft_token_ids (placeholders on entry) in place; returns the seconds it took."""
        started = time.perf_counter()
        first = [(self._catch_up(item), item.page_ids) for item in items]
        drafts = [[token] for token in self._next_tokens(first)]
        for j in range(1, max(len(item.draft_token_ids) for item in items)):
            rows = [i for i, item in enumerate(items) if len(item.draft_token_ids) > j]
            feed = [(([drafts[i][-1]], items[i].start + j), items[i].page_ids) for i in rows]
            for i, token in zip(rows, self._next_tokens(feed)):
                drafts[i].append(token)
        for item, tokens in zip(items, drafts):
            item.draft_token_ids = tokens
        return time.perf_counter() - started

    def verified(self, items: Sequence[ScheduledRequest], verified: dict[str, list[SampledToken]]) -> None:
        """After the verifier: the draft's K/V hold the request's tokens up to its last accepted draft."""
        if not self.own_cache:
            return
        for item in items:
            accepted = len(verified.get(item.request.request_id, ())) - 1
            if accepted >= 0:  # positions start .. start + min(accepted, k - 1) hold verified tokens
                end = item.start + min(accepted, len(item.draft_token_ids) - 1) + 1
                self._valid[item.request] = (item.request.metrics.num_preemptions, end)

    @torch.inference_mode()
    def time_position(self, position: int, pages: list[int]) -> float:
        """Seconds of one depth for one request at `position` whose K/V slots are `pages` (the reserved page)."""
        started = time.perf_counter()
        self._next_tokens([(([0], position), pages)])
        return time.perf_counter() - started

    def _catch_up(self, item: ScheduledRequest) -> tuple[list[int], int]:
        """Depth 0's tokens and first position: from where the draft's K/V end to the last verified token."""
        request, start = item.request, item.start
        first = start
        if self.own_cache:
            preemptions, end = self._valid.get(request, (None, 0))
            first = min(end, start) if preemptions == request.metrics.num_preemptions else 0
        return list(request.all_token_ids[first : start + 1]), first

    def _next_tokens(self, rows: list[tuple[tuple[list[int], int], list[int]]]) -> list[int]:
        """The draft network's greedy next token after each ((tokens, first position), pages) row."""
        fb = self._batch(rows)
        hidden = self.forward(fb)
        return self.model.compute_logits(hidden[fb.logits_indices])[:, : self.vocab_size].argmax(dim=-1).tolist()

    def _batch(self, rows: list[tuple[tuple[list[int], int], list[int]]]) -> ForwardBatch:
        """Each row feeds its tokens at positions first .. first + len - 1 and reads [0, that end)."""
        P, dev = self.page_size, self.device
        ids, positions, slots, starts, lens, tables = [], [], [], [0], [], []
        for (tokens, first), pages in rows:
            span = range(first, first + len(tokens))
            ids += tokens
            positions += span
            slots += [pages[p // P] * P + p % P for p in span]
            starts.append(len(ids))
            lens.append(span.stop)
            tables.append(list(pages))
        width = max(len(t) for t in tables)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(starts[1:], dtype=torch.long, device=dev) - 1,
            query_lens=[len(tokens) for (tokens, _), _ in rows],
            context_lens=lens,
            page_size=P,
        )
