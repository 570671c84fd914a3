"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

Once a decode-only step's inputs sit in fixed buffers, its work depends only on its number of
requests (attention sizes its grid from the block table's width, not from the lengths). So the whole
forward is captured once per bucket b (1, 2, 4, ..., max_num_seqs) and replayed: one launch instead
of hundreds issued from Python. A step of n requests runs in the smallest bucket b >= n:

    static rows:   [ r0  r1  r2 | pad ]       n = 3 requests in bucket 4
    real row i:    its token, position, slot, seq_len and block table, copied in
    padding row:   seq_len 1, slot and block table in the reserved page (one page past the pool, never
                   handed to a request): it writes its K/V there and attends over that one key only.

Only rows [0, n) of the output are read. Steps with prefill rows, or more requests than the largest
bucket, run eagerly. With capture=False the same padded path runs eagerly: how CPU tests check it.
"""

from __future__ import annotations

import logging
import time

import torch

from banyan.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, then max_num_seqs itself."""
    buckets = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return buckets + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model, kv_caches, *, buckets: list[int], max_pages: int, page_size: int,
                 reserved_page: int, device: torch.device, capture: bool = True):
        self.model, self.kv_caches, self.buckets = model, kv_caches, buckets
        self.page_size, self.capture = page_size, capture
        self.reserved_slot = reserved_page * page_size
        self.reserved_page = reserved_page
        size = buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((size,), self.reserved_slot, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = torch.full((size, max_pages), reserved_page, dtype=torch.int32, device=device)
        self.rows = torch.arange(size + 1, dtype=torch.int32, device=device)  # query_start_loc of all-decode
        self.no_logits = torch.zeros(0, dtype=torch.long, device=device)  # the runner picks logits rows itself
        self._dirty = 0  # rows [0, _dirty) hold a real request's inputs from an earlier step
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def fits(self, fb: ForwardBatch) -> bool:
        return fb.is_decode_only and fb.num_seqs <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step of n <= buckets[-1] requests."""
        n = fb.num_seqs
        b = self.bucket(n)
        self._load(fb)
        if self.capture:
            self.graphs[b].replay()
            return self.outputs[b][:n]  # graph memory: read before the next replay
        return self.model(self._batch(b, fb.context_lens + [1] * (b - n)), self.kv_caches)[:n]

    def _load(self, fb: ForwardBatch) -> None:
        """Copy the step's rows into the static buffers; rows a larger earlier step used become padding again."""
        n, width = fb.num_seqs, fb.block_tables.shape[1]
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.slot_mapping[:n].copy_(fb.slot_mapping)
        self.seq_lens[:n].copy_(fb.seq_lens)
        self.block_tables[:n, :width].copy_(fb.block_tables)
        if self._dirty > n:
            self._pad(n, self._dirty)
        self._dirty = n

    def _pad(self, start: int, end: int) -> None:
        self.slot_mapping[start:end] = self.reserved_slot
        self.seq_lens[start:end] = 1
        self.block_tables[start:end, 0] = self.reserved_page

    def _batch(self, b: int, context_lens: list[int]) -> ForwardBatch:
        """The first b static rows as a decode-only batch (context_lens: the host copy the torch backend reads)."""
        return ForwardBatch(
            input_ids=self.input_ids[:b],
            positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.rows[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            logits_indices=self.no_logits,
            query_lens=[1] * b,
            context_lens=context_lens,
            page_size=self.page_size,
        )

    @torch.inference_mode()
    def capture_all(self) -> None:
        """One graph per bucket, largest first so that the smaller ones reuse its memory pool. Every row is
        padding while capturing: the warm-up and captured runs write only the reserved page."""
        start, pool = time.perf_counter(), None
        for b in reversed(self.buckets):
            side = torch.cuda.Stream()  # warm-up (compiles the kernels) off the capturing stream, as torch advises
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.model(self._batch(b, [1] * b), self.kv_caches)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):  # a batch of its own: nothing the warm-up looked up is reused
                self.outputs[b] = self.model(self._batch(b, [1] * b), self.kv_caches)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("CUDA graphs: captured decode batch sizes %s in %.1f s (--enforce-eager turns them off)",
                    self.buckets, time.perf_counter() - start)
