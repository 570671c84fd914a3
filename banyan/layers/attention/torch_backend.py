"""Reference paged attention in plain torch: works on any device, the oracle for the kernels.

Decode rows (query_len 1) of all requests run as one batch; short chunks (up to SHORT_QUERY rows: the
k + 1 rows of a speculative verify pass, the last bits of a prompt) as one batch padded to the longest;
each longer prefill chunk on its own (a step holds few). Each group gathers its requests' K/V from their
pages and calls SDPA with a mask:

    request i, context of c tokens, q new rows (the last q positions of the context):
    key position:     0  1  2  ...  c-q  ...  c-1   (c .. max_ctx-1: padding, masked)
    new row j sees:   [0, c-q+j]  (and only (c-q+j-w, c-q+j] with a sliding window w)

The rows of each group, the pages to gather and the masks depend only on the batch: the first layer
of a forward builds them (a `_Plan`) and every other layer reuses them.

On a float32, float16 or fp8 CPU cache banyan's fused kernel (banyan/kernels/cpu_decode.c) takes every row instead:
it reads each key where it lies in its page (a prefill chunk's gathered a block at a time), no mask, no padding.
Gathering and SDPA cost more per call than a decode row's whole attention, and on prefill chunks SDPA with a mask was
slower too (AMX Xeon, 2 threads, the default model, prefill alone: 16 x 128 tokens 0.68 s through SDPA against 0.52 s,
4 x 512 0.97 against 0.78, 1 x 2,000 2.05 against 1.73); it once took only requests of a few new rows. On a CPU
with AMX tiles and batch invariance off (`bf16_chunks`), as the bf16 weight copies serve prefill chunks' matmuls,
chunks attend in bf16 too: every chunk of FLASH_CHUNK_ROWS or more rows through banyan's flash attention on AMX-BF16
tiles (cpu_decode.c's flash_prefill_bf16: 1.6-2.8x SDPA-bf16, 2.2-5.5x the fused kernel from 48 rows), or where
that cannot serve (no AMX-BF16, an fp8 cache, head_dim not a multiple of 32, a sliding window) a chunk of
BF16_CHUNK_ROWS or more rows over BF16_CHUNK_KEYS or more keys through SDPA in bfloat16.

SDPA's blocking follows the shapes, so a row's output moves in its last bits with the padding and the
number of sequences beside it. The fused kernel attends each row over the positions it sees in position order, and
so does `fixed_order` (banyan's CPU kernels, set for batch-invariant mode) over a cache the fused kernel does not
read (bfloat16: cpu_attention.c on gathered pages): the same bits alone, in a batch, in a prefill chunk or in a
decode step.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from banyan.kernels import cpu_decode
from banyan.layers.attention.base import AttentionBackend, read_pages, write_kv_cache
from banyan.forward_batch import ForwardBatch


SHORT_QUERY = 32
"""Chunks of at most this many rows share one padded group (padding costs less than a call per request)."""

BF16_CHUNK_ROWS, BF16_CHUNK_KEYS = 48, 256
"""With `bf16_chunks`, a chunk of at least this many rows over at least this many keys attends through SDPA in
bfloat16 (q, K and V rounded to it; float32 sums). One layer's attention on an AMX Xeon, 2 threads, the default
model's heads, float16 pages, SDPA's time including the gather (rows x keys: the fused kernel / SDPA-bf16):
128 x 1,400 2.06, 64 x 800 1.83, 48 x 800 1.22, 33 x 1,400 1.03, 16 x 1,400 0.65, 128 x 256 1.53, 128 x 128 0.77,
512 x 512 1.84, 2,000 x 2,000 1.98. Again after the one-pass gather and the mask made once a forward (30 layers,
2026-12-04): 128 x 128 0.92, 96 x 96 0.69, 64 x 128 0.91, 64 x 200 1.08, 128 x 256 1.56-1.59, 512 x 512 1.74,
1,024 x 1,024 1.89: the thresholds stand."""


FLASH_CHUNK_ROWS = 16
"""With AMX-BF16 tiles (and batch invariance off), a chunk of at least this many rows attends through flash attention
in bf16 (cpu_decode.c's flash_prefill_bf16); fewer rows (decode, speculative verify passes) keep the fused kernel's
float32. One layer, the default model's heads, float16 pages, 2 threads (rows x keys: SDPA-bf16's time / flash's,
the fused kernel's / flash's): 16 x 300 2.04 / 1.26, 16 x 1,400 1.31 / 1.09, 48 x 800 1.99 / 3.04, 152 x 152
2.62 / 2.42, 128 x 1,344 1.59 / 4.20, 512 x 512 2.09 / 3.98, 2,048 x 2,048 2.77 / 5.46; 8 x 1,400 flash 0.73x the
fused kernel (too few tiles for two threads)."""


@dataclass
class _Group:
    """Requests whose new rows attend over their pages as one padded batch."""

    rows: torch.Tensor | slice | None  # their rows of q, in request order, padded ones too; None: every row
    max_query_len: int
    pages: torch.Tensor  # [num_seqs, num_pages] int64
    mask: torch.Tensor  # [num_seqs, 1, max_query_len, max_ctx] bool; additive (0 / -inf) in `dtype` where that is set
    keep: torch.Tensor | None = None  # padded: which of the group's output rows are real (in q's order)
    out_rows: torch.Tensor | slice | None = None  # padded: where those real rows go in the output
    dtype: torch.dtype | None = None  # what SDPA computes in (None: q's)


@dataclass
class _FlashChunk:
    """A prefill chunk that attends in bf16 on AMX tiles (cpu_decode.c's flash_prefill_bf16): its rows of q, the
    position of its first row, and its sequence's pages."""

    rows: slice
    first: int
    table: torch.Tensor  # [pages] int32
    seq: int  # its sequence in the batch

    def alone(self, batch: ForwardBatch) -> cpu_decode.PagedRows:
        """Its rows for the fused kernel, where flash attention refuses them (its scratch memory not granted)."""
        rows = range(self.rows.start, self.rows.stop)
        return cpu_decode.PagedRows(list(rows), [self.seq] * len(rows), list(range(self.first, self.first + len(rows))),
                                    batch.block_tables)


@dataclass
class _Plan:
    """One forward's groups, the same in every layer."""

    batch: ForwardBatch
    sliding_window: int | None
    context_lens: list[int]  # copies: the plan serves only a batch with these very lengths
    query_lens: list[int]
    groups: list[_Group]
    paged: cpu_decode.PagedRows | None = None  # the rows the fused CPU kernel attends (the groups: the others)
    flash: list[_FlashChunk] = dataclasses.field(default_factory=list)  # chunks AMX flash attention takes
    tiles: bool = False  # AMX-BF16 tiles serve: the flash chunks, and the paged rows' shared prompts

    def fits(self, batch: ForwardBatch, sliding_window: int | None) -> bool:
        return (batch is self.batch and sliding_window == self.sliding_window
                and batch.context_lens == self.context_lens and batch.query_lens == self.query_lens)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, kv_scale: float = 1.0, fused: bool = True):
        """fused: banyan's fused CPU kernel attends the rows it serves on a float32, float16 or fp8 CPU cache (False: SDPA only,
        the reference the kernels are tested against)."""
        super().__init__(kv_scale)
        self.kernels = cpu_decode.kernels_for(torch.device("cpu"), torch.float32) if fused else None  # None: SDPA
        self._plan: _Plan | None = None  # the forward in progress, built by its first layer
        self.fixed_order = None  # banyan's CPU kernels (cpu_gemv.load()) in batch-invariant mode, else SDPA
        self.bf16_chunks = False  # AMX tiles, batch invariance off: wide prefill chunks through SDPA in bf16

    def forward(self, q, k, v, k_cache, v_cache, batch: ForwardBatch, scale: float, sliding_window=None,
                kv_stored=False):
        if not kv_stored:
            write_kv_cache(k, v, k_cache, v_cache, batch.slot_mapping, self.kv_scale)
        plan, kernels = self._plan, self._kernels(k_cache)
        if plan is None or not plan.fits(batch, sliding_window):
            bf16_chunks = self.bf16_chunks and self.fixed_order is None
            plan = self._plan = make_plan(batch, sliding_window, k_cache.shape[1], fused=kernels is not None,
                                          bf16_chunks=bf16_chunks, flash=self.amx_tiles(k_cache, sliding_window))
        if plan.paged is None and not plan.flash and len(plan.groups) == 1 and plan.groups[0].rows is None:  # decode only
            return self._attend(plan.groups[0], q, k_cache, v_cache, scale)
        out = q.new_empty(q.shape)
        if plan.paged is not None:
            kernels.paged_attention(q, k_cache, v_cache, out, plan.paged, scale, sliding_window, self.kv_scale,
                                    bf16_tiles=plan.tiles)
        for chunk in plan.flash:
            if not kernels.flash_prefill(q[chunk.rows], k_cache, v_cache, chunk.table, chunk.first, out[chunk.rows],
                                         scale, self.kv_scale):
                kernels.paged_attention(q, k_cache, v_cache, out, chunk.alone(batch), scale, None, self.kv_scale)
        for group in plan.groups:
            attended = self._attend(group, q, k_cache, v_cache, scale)
            if group.keep is None:
                out[group.rows] = attended
            else:
                out[group.out_rows] = attended[group.keep]
        return out

    def amx_tiles(self, k_cache: torch.Tensor, sliding_window: int | None) -> bool:
        """Whether rows attend on AMX-BF16 tiles here: prefill chunks of FLASH_CHUNK_ROWS or more (flash_prefill) and
        decode rows over a shared prompt's pages (paged_attention's bf16_tiles). Where bf16 chunks were asked for
        (AMX, batch invariance off), over the fused kernels' pages (float32, float16, fp8) of head_dim a multiple of
        32, with no window."""
        kernels = self._kernels(k_cache)
        return (self.bf16_chunks and self.fixed_order is None and kernels is not None and kernels.amx_bf16
                and sliding_window is None and k_cache.shape[-1] % 32 == 0)

    def _kernels(self, k_cache: torch.Tensor) -> cpu_decode.DecodeKernels | None:
        """The fused CPU kernels where they serve this cache (float32, float16 or fp8 on a CPU, head_dim in lanes of 8)."""
        if k_cache.dtype not in cpu_decode.KV_DTYPES or not k_cache.is_cpu or k_cache.shape[-1] % 8:
            return None
        return self.kernels

    def _attend(self, group: _Group, q, k_cache, v_cache, scale: float) -> torch.Tensor:
        """The group's output rows: [rows, num_heads, head_dim]."""
        rows = q if group.rows is None else q[group.rows]
        padded = rows.unflatten(0, (-1, group.max_query_len))  # [num_seqs, max_query_len, heads, dim]
        if group.dtype is not None:
            padded = padded.to(group.dtype)
        out = attend_pages(padded, k_cache, v_cache, group.pages, group.mask, scale, self.kv_scale, self.fixed_order,
                           self._kernels(k_cache))
        return out.flatten(0, 1).to(q.dtype)


def make_plan(batch: ForwardBatch, sliding_window: int | None, page_size: int, fused: bool = False,
              bf16_chunks: bool = False, flash: bool = False) -> _Plan:
    """fused: every row to the fused kernel, but with bf16_chunks each wide chunk over a long context (BF16_CHUNK_ROWS,
    BF16_CHUNK_KEYS) in its own group in bfloat16, and with flash (AMX-BF16 tiles) every chunk of FLASH_CHUNK_ROWS
    or more rows through flash attention in bf16 instead; else decode rows in one group, short chunks in one padded
    group, each longer prefill chunk in its own."""
    device = batch.block_tables.device
    starts = [0, *itertools.accumulate(batch.query_lens)]
    if fused:
        chunks = list(enumerate(zip(batch.query_lens, batch.context_lens)))
        by_flash = [i for i, (n, _) in chunks if flash and n >= FLASH_CHUNK_ROWS]
        wide = [i for i, (n, ctx) in chunks
                if bf16_chunks and not flash and n >= BF16_CHUNK_ROWS and ctx >= BF16_CHUNK_KEYS]
        groups = [_chunk_group(batch, i, starts, page_size, sliding_window, torch.bfloat16) for i in wide]
        tables = batch.block_tables.to(torch.int32) if by_flash else None
        flashed = [_FlashChunk(slice(starts[i], starts[i + 1]), batch.context_lens[i] - batch.query_lens[i],
                               tables[i].contiguous(), i) for i in by_flash]
        return _Plan(batch, sliding_window, list(batch.context_lens), list(batch.query_lens), groups,
                     paged_rows(batch, starts, skip={*wide, *by_flash}), flashed, tiles=flash)
    decode = [i for i, n in enumerate(batch.query_lens) if n == 1]
    groups = []
    if decode:
        every = len(decode) == batch.num_seqs
        rows = None if every else torch.tensor([starts[i] for i in decode], device=device)
        tables = batch.block_tables if every else batch.block_tables[torch.tensor(decode, device=device)]
        context_lens = [batch.context_lens[i] for i in decode]
        layout = paged_layout(tables, context_lens, [1] * len(decode), page_size, sliding_window)
        groups.append(_Group(rows, 1, *layout))
    short = [i for i, n in enumerate(batch.query_lens) if 1 < n <= SHORT_QUERY]
    if short:
        groups.append(_padded_group(batch, short, starts, page_size, sliding_window))
    groups += [_chunk_group(batch, i, starts, page_size, sliding_window) for i, n in enumerate(batch.query_lens)
               if n > SHORT_QUERY]
    return _Plan(batch, sliding_window, list(batch.context_lens), list(batch.query_lens), groups)


def _chunk_group(batch: ForwardBatch, i: int, starts: list[int], page_size: int, sliding_window: int | None,
                 dtype: torch.dtype | None = None) -> _Group:
    """Request i's prefill chunk alone; in `dtype` (SDPA's), its mask additive once for every layer (SDPA would turn
    a bool mask into one in each: 128 x 1,344 keys, 0.74 -> 0.64 ms a layer on an AMX Xeon)."""
    table, n = batch.block_tables[i : i + 1], batch.query_lens[i]
    pages, mask = paged_layout(table, [batch.context_lens[i]], [n], page_size, sliding_window)
    if dtype is not None:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return _Group(slice(starts[i], starts[i + 1]), n, pages, mask, dtype=dtype)


def paged_rows(batch: ForwardBatch, starts: list[int], skip: set[int] = frozenset()) -> cpu_decode.PagedRows | None:
    """The rows of every request but those in skip; request i's j-th new row is at position
    context_lens[i] - query_lens[i] + j."""
    rows, seqs, positions = [], [], []
    for i, (n, ctx) in enumerate(zip(batch.query_lens, batch.context_lens)):
        if i not in skip:
            rows += range(starts[i], starts[i] + n)
            seqs += [i] * n
            positions += range(ctx - n, ctx)
    return cpu_decode.PagedRows(rows, seqs, positions, batch.block_tables) if rows else None


def _padded_group(batch: ForwardBatch, seqs: list[int], starts: list[int], page_size: int,
                  sliding_window: int | None) -> _Group:
    """Requests `seqs` (a few rows each) padded to the longest, w rows each; a padding row repeats the request's
    last row, which sees its whole context, and its output is dropped:

        rows:  [ a0 a1 a1 | b0 b1 b2 | c0 c0 c0 ]    (w = 3; a has 2 rows, b 3, c 1)
        keep:  [ 0  1     | 3  4  5  | 6        ]    the real ones, written back to a0 a1 b0 b1 b2 c0
    """
    device, lens = batch.block_tables.device, [batch.query_lens[i] for i in seqs]
    width = max(lens)
    rows = [starts[i] + min(j, n - 1) for i, n in zip(seqs, lens) for j in range(width)]
    keep = [s * width + j for s, n in enumerate(lens) for j in range(n)]
    out_rows = [starts[i] + j for i, n in zip(seqs, lens) for j in range(n)]
    tables = batch.block_tables[torch.tensor(seqs, device=device)]
    layout = paged_layout(tables, [batch.context_lens[i] for i in seqs], lens, page_size, sliding_window)
    return _Group(torch.tensor(rows, device=device), width, *layout, keep=torch.tensor(keep, device=device),
                  out_rows=torch.tensor(out_rows, device=device))


def paged_attention(
    q: torch.Tensor,  # [num_seqs, max_query_len, num_heads, head_dim], padded after each query_len
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_pages]
    context_lens: list[int],
    query_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    kv_scale: float = 1.0,  # an fp8 cache's scale
) -> torch.Tensor:  # [num_seqs, max_query_len, num_heads, head_dim]
    """Causal attention of each sequence's new rows over its whole paged context."""
    pages, mask = paged_layout(block_tables, context_lens, query_lens, k_cache.shape[1], sliding_window)
    return attend_pages(q, k_cache, v_cache, pages, mask, scale, kv_scale)


def paged_layout(
    block_tables: torch.Tensor, context_lens: list[int], query_lens: list[int], page_size: int,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages to gather [num_seqs, num_pages] int64, mask [num_seqs, 1, max_query_len, max_ctx] bool)."""
    device, max_ctx = block_tables.device, max(context_lens)
    pages = block_tables[:, : -(-max_ctx // page_size)].long()
    ctx = torch.tensor(context_lens, device=device)[:, None, None]  # [num_seqs, 1, 1]
    first = ctx - torch.tensor(query_lens, device=device)[:, None, None]  # position of row 0
    q_pos = first + torch.arange(max(query_lens), device=device)[None, :, None]  # [num_seqs, max_q, 1]
    kv_pos = torch.arange(max_ctx, device=device)[None, None, :]  # [1, 1, max_ctx]
    mask = (kv_pos <= q_pos) & (kv_pos < ctx)  # [num_seqs, max_q, max_ctx]
    if sliding_window is not None:
        mask &= kv_pos > q_pos - sliding_window
    return pages, mask[:, None]


def attend_pages(q, k_cache, v_cache, pages, mask, scale: float, kv_scale: float = 1.0, fixed_order=None,
                 kernels: cpu_decode.DecodeKernels | None = None) -> torch.Tensor:
    """q [num_seqs, max_q, num_heads, head_dim] over the K/V in `pages`, masked (paged_layout's) -> like q.
    fixed_order: banyan's CPU kernels, to attend row by row in position order (float32) instead of SDPA. kernels:
    the fused CPU kernels, which read float16 pages into bf16 in one pass (AMX prefill)."""
    max_ctx = mask.shape[-1]
    k = _read(k_cache, pages, q.dtype, kv_scale, kernels).flatten(1, 2)[:, :max_ctx]  # [num_seqs, max_ctx, kv_heads, dim]
    v = _read(v_cache, pages, q.dtype, kv_scale, kernels).flatten(1, 2)[:, :max_ctx]
    if fixed_order is not None:
        return fixed_order.attend(q, k, v, mask[:, 0], scale)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    )  # [num_seqs, num_heads, max_q, head_dim]
    return out.transpose(1, 2)


def _read(cache, pages, dtype: torch.dtype, kv_scale: float, kernels: cpu_decode.DecodeKernels | None) -> torch.Tensor:
    """read_pages, float16 pages into bf16 through the kernel where one is given (the same bits)."""
    if kernels is None or cache.dtype != torch.float16 or dtype != torch.bfloat16:
        return read_pages(cache, pages, dtype, kv_scale)
    return kernels.gather_as_bf16(cache, pages.reshape(-1)).view(*pages.shape, *cache.shape[1:])
