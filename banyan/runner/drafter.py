"""Model drafting inside the runner's step: a network proposes each drafting request's k tokens, greedily, before
the target verifies them in the same step.

The scheduler reserved the room: a drafting request's ScheduledRequest feeds [last token | k placeholders] with
slots for all 1 + k (banyan/spec/model_drafts.py). `draft` writes the k tokens in, one batched forward per
position, for the requests that still draft at that depth:

    depth j = 0 .. K-1:   rows = requests with k_i > j
                          feed token t_j at position start + j    (t_0 = the last verified token, t_j = d_j)
                          d_{j+1} = argmax of the draft network's logits

LayerSkipDrafter: the target's first `num_layers` layers, its final norm and lm_head (self-speculation, no extra
weights). Its K/V are the target's own layers 0..L-1: for verified tokens those are exactly what the draft
computes (same weights, same inputs), so the draft never needs a catch-up; what it writes at draft positions
lies in slots reserved for this step, which the verify pass then overwrites with the target's values.
A deterministic draft is a one-hot q, which the verifier's rejection sampling allows for any sampling params.
"""

from __future__ import annotations

import time

import torch

from banyan.errors import InvalidParameterError
from banyan.forward_batch import ForwardBatch
from banyan.scheduler.batch import ScheduledRequest


class LayerSkipDrafter:
    def __init__(self, model, kv_caches, num_layers: int, vocab_size: int, page_size: int, device: torch.device):
        total = len(kv_caches)
        if not 1 <= num_layers < total:
            raise InvalidParameterError("num_layers", f"layer_skip drafts with 1 to {total - 1} of the target's "
                                                      f"{total} layers, got {num_layers}")
        self.model, self.kv_caches, self.num_layers = model, kv_caches, num_layers
        self.vocab_size, self.page_size, self.device = vocab_size, page_size, device

    @torch.inference_mode()
    def draft(self, items: list[ScheduledRequest]) -> float:
        """Fill each item's draft_token_ids (placeholders on entry) in place; returns the seconds it took."""
        started = time.perf_counter()
        depth = max(len(item.draft_token_ids) for item in items)
        drafts = {id(item): [] for item in items}
        feed = {id(item): item.request.all_token_ids[item.start] for item in items}
        for j in range(depth):
            rows = [item for item in items if len(item.draft_token_ids) > j]
            tokens = self._next_tokens([(feed[id(item)], item.start + j, item.page_ids) for item in rows])
            for item, token in zip(rows, tokens):
                drafts[id(item)].append(token)
                feed[id(item)] = token
        for item in items:
            item.draft_token_ids = drafts[id(item)]
        return time.perf_counter() - started

    @torch.inference_mode()
    def time_position(self, position: int, pages: list[int]) -> float:
        """Seconds of one depth for one request at `position` whose K/V slots are `pages` (the reserved page)."""
        started = time.perf_counter()
        self._next_tokens([(0, position, pages)])
        return time.perf_counter() - started

    def _next_tokens(self, rows: list[tuple[int, int, list[int]]]) -> list[int]:
        """The draft network's greedy next token for each (token, position, pages) row."""
        hidden = self.model(self._decode_batch(rows), self.kv_caches, num_layers=self.num_layers)
        return self.model.compute_logits(hidden)[:, : self.vocab_size].argmax(dim=-1).tolist()

    def _decode_batch(self, rows: list[tuple[int, int, list[int]]]) -> ForwardBatch:
        """One token per row: (token, position, the row's pages); each row reads positions [0, position]."""
        P, dev = self.page_size, self.device
        width = max(len(pages) for _, _, pages in rows)
        lens = [position + 1 for _, position, _ in rows]
        return ForwardBatch(
            input_ids=torch.tensor([token for token, _, _ in rows], dtype=torch.long, device=dev),
            positions=torch.tensor([position for _, position, _ in rows], dtype=torch.long, device=dev),
            slot_mapping=torch.tensor([pages[p // P] * P + p % P for _, p, pages in rows], dtype=torch.long, device=dev),
            query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([list(pages) + [0] * (width - len(pages)) for _, _, pages in rows],
                                      dtype=torch.int32, device=dev),
            logits_indices=torch.arange(len(rows), device=dev),
            query_lens=[1] * len(rows),
            context_lens=lens,
            page_size=P,
        )
