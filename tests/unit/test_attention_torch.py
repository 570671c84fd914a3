"""The torch attention backend against a dense causal softmax, over random ragged paged batches."""

from __future__ import annotations

import random

import pytest
import torch

from banyan.errors import InvalidParameterError
from banyan.layers.attention import get_attention_backend
from banyan.forward_batch import ForwardBatch

HEAD_DIM = 8


def make_paged_batch(specs, *, page_size, num_kv_heads, num_heads, rng: random.Random, gen: torch.Generator,
                     head_dim: int = HEAD_DIM):
    """A ForwardBatch for requests given as (cached prefix length, new tokens), pages shuffled.

    The cache starts as noise with each request's prefix K/V written into its pages; returns the batch,
    the caches, the new q/k/v rows, and each request's full (prefix + new) K/V for the reference.
    """
    pages_per_seq = [-(-(prefix + new) // page_size) for prefix, new in specs]
    num_pages = sum(pages_per_seq) + 3
    free = list(range(num_pages))
    rng.shuffle(free)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)

    tables, slots, positions, full_kv = [], [], [], []
    for (prefix, new), n_pages in zip(specs, pages_per_seq):
        table = [free.pop() for _ in range(n_pages)]
        tables.append(table)
        seq_slots = [table[p // page_size] * page_size + p % page_size for p in range(prefix + new)]
        k_full = torch.randn(prefix + new, num_kv_heads, head_dim, generator=gen)
        v_full = torch.randn(prefix + new, num_kv_heads, head_dim, generator=gen)
        flat_k[seq_slots[:prefix]] = k_full[:prefix]
        flat_v[seq_slots[:prefix]] = v_full[:prefix]
        slots += seq_slots[prefix:]
        positions += range(prefix, prefix + new)
        full_kv.append((k_full, v_full))

    query_lens = [new for _, new in specs]
    context_lens = [prefix + new for prefix, new in specs]
    width = max(pages_per_seq)
    batch = ForwardBatch(
        input_ids=torch.zeros(sum(query_lens), dtype=torch.int64),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        logits_indices=torch.arange(sum(query_lens)),
        query_lens=query_lens,
        context_lens=context_lens,
        page_size=page_size,
    )
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    k = torch.cat([k_full[prefix:] for (k_full, _), (prefix, _) in zip(full_kv, specs)])
    v = torch.cat([v_full[prefix:] for (_, v_full), (prefix, _) in zip(full_kv, specs)])
    return batch, k_cache, v_cache, q, k, v, full_kv


def dense_reference(q, k_full, v_full, scale, sliding_window=None):
    """softmax(q k^T * scale + causal mask) v for one request; q holds its last rows."""
    new, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k_full.shape
    group = num_heads // num_kv_heads
    k = k_full.double().repeat_interleave(group, dim=1)  # [ctx, num_heads, head_dim]
    v = v_full.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(ctx - new, ctx)[:, None]
    kv_pos = torch.arange(ctx)[None, :]
    allowed = kv_pos <= q_pos
    if sliding_window is not None:
        allowed &= kv_pos > q_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def random_specs(rng: random.Random, kind: str):
    """1..6 requests: decode rows (1 new token) and/or prefill chunks (2..20), prefixes 0..40."""
    specs = []
    for i in range(rng.randint(1, 6)):
        decode = kind == "decode" or (kind == "mixed" and i % 2 == 0)
        specs.append((rng.randint(0, 40), 1 if decode else rng.randint(2, 20)))
    return specs


def check(specs, *, page_size, num_kv_heads, group, seed, sliding_window=None):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    batch, k_cache, v_cache, q, k, v, full_kv = make_paged_batch(
        specs, page_size=page_size, num_kv_heads=num_kv_heads, num_heads=num_heads, rng=rng, gen=gen
    )
    scale = HEAD_DIM**-0.5
    out = get_attention_backend("torch").forward(q, k, v, k_cache, v_cache, batch, scale, sliding_window)

    assert out.shape == q.shape
    assert torch.equal(k_cache.view(-1, num_kv_heads, HEAD_DIM)[batch.slot_mapping], k)
    assert torch.equal(v_cache.view(-1, num_kv_heads, HEAD_DIM)[batch.slot_mapping], v)
    start = 0
    for (_, new), (k_full, v_full) in zip(specs, full_kv):
        expected = dense_reference(q[start : start + new], k_full, v_full, scale, sliding_window)
        torch.testing.assert_close(out[start : start + new], expected, atol=1e-5, rtol=1e-5)
        start += new


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_matches_dense_causal_softmax(page_size, group, kind):
    for seed in range(3):
        specs = random_specs(random.Random(seed * 7 + page_size), kind)
        check(specs, page_size=page_size, num_kv_heads=2, group=group, seed=seed)


def test_edge_cases():
    # a lone first token, a one-token chunk after a prefix, and a chunk ending exactly on a page edge
    check([(0, 1)], page_size=4, num_kv_heads=1, group=4, seed=0)
    check([(5, 1), (0, 8), (3, 5), (40, 1)], page_size=4, num_kv_heads=2, group=2, seed=1)


@pytest.mark.parametrize("page_size", [4, 16])
def test_sliding_window(page_size):
    specs = [(30, 1), (0, 20), (12, 9), (3, 1)]
    check(specs, page_size=page_size, num_kv_heads=2, group=2, seed=3, sliding_window=7)


def test_verify_shaped_chunks_share_one_padded_group():
    """A speculative step: decode rows, k + 1-row verify passes of different k, and a long prefill chunk."""
    from banyan.layers.attention.torch_backend import SHORT_QUERY, make_plan

    specs = [(12, 1), (7, 4), (30, 2), (3, 1), (20, 6), (0, SHORT_QUERY + 8)]
    check(specs, page_size=4, num_kv_heads=2, group=2, seed=11)
    check(specs, page_size=4, num_kv_heads=2, group=2, seed=12, sliding_window=5)
    batch = make_paged_batch(specs, page_size=4, num_kv_heads=2, num_heads=4, rng=random.Random(0),
                             gen=torch.Generator().manual_seed(0))[0]
    groups = make_plan(batch, None, 4).groups
    assert [g.max_query_len for g in groups] == [1, 6, SHORT_QUERY + 8]  # decode, the padded short ones, the long


def test_registry():
    assert get_attention_backend("torch").name == "torch"
    with pytest.raises(InvalidParameterError):
        get_attention_backend("no-such-backend")


def test_one_plan_per_forward_serves_every_layer():
    """The first layer's gather indices and masks serve the next layers; a new batch gets its own."""
    backend = get_attention_backend("torch")
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    for specs in ([(3, 1), (0, 6), (9, 4)], [(4, 1), (7, 1)]):
        batch, k_cache, v_cache, q, k, v, _ = make_paged_batch(
            specs, page_size=4, num_kv_heads=2, num_heads=4, rng=rng, gen=gen
        )
        plans = []
        for layer in range(3):  # each layer: its own cache and queries, the same batch
            k_layer, v_layer, q_layer = k_cache.clone(), v_cache.clone(), q * (layer + 1)
            out = backend.forward(q_layer, k, v, k_layer, v_layer, batch, 0.5)
            plans.append(backend._plan)
            alone = get_attention_backend("torch").forward(q_layer, k, v, k_layer, v_layer, batch, 0.5)
            assert torch.equal(out, alone)
        assert plans[0] is plans[1] is plans[2]


def test_wide_chunks_over_long_contexts_attend_in_bf16_where_asked():
    """bf16_chunks (AMX CPUs, batch invariance off): a chunk of BF16_CHUNK_ROWS+ rows over BF16_CHUNK_KEYS+ keys
    goes to SDPA in bfloat16, alone; decode rows, narrower chunks and chunks over short contexts stay with the
    fused kernel, their numbers unchanged."""
    from banyan.layers.attention.torch_backend import BF16_CHUNK_KEYS, BF16_CHUNK_ROWS, TorchAttentionBackend, make_plan

    specs = [(260, 1), (BF16_CHUNK_KEYS, BF16_CHUNK_ROWS), (100, BF16_CHUNK_ROWS - 1), (0, BF16_CHUNK_KEYS + 20),
             (10, 60)]
    rng, gen = random.Random(21), torch.Generator().manual_seed(21)
    batch, k_cache, v_cache, q, k, v, full_kv = make_paged_batch(specs, page_size=16, num_kv_heads=2, num_heads=4,
                                                                 rng=rng, gen=gen)
    plan = make_plan(batch, None, 16, fused=True, bf16_chunks=True)
    assert [(g.rows, g.dtype) for g in plan.groups] == [(slice(1, 1 + BF16_CHUNK_ROWS), torch.bfloat16),
                                                         (slice(1 + 2 * BF16_CHUNK_ROWS - 1, 1 + 2 * BF16_CHUNK_ROWS
                                                                - 1 + BF16_CHUNK_KEYS + 20), torch.bfloat16)]
    assert len(plan.paged.rows) == 1 + BF16_CHUNK_ROWS - 1 + 60
    assert make_plan(batch, None, 16, fused=True).groups == []  # not asked: the kernel takes every row

    backend = TorchAttentionBackend()
    backend.bf16_chunks = True
    out = backend.forward(q, k, v, k_cache, v_cache, batch, HEAD_DIM**-0.5)
    plain = TorchAttentionBackend().forward(q, k, v, k_cache.clone(), v_cache.clone(), batch, HEAD_DIM**-0.5)
    start = 0
    for i, ((_, new), (k_full, v_full)) in enumerate(zip(specs, full_kv)):
        rows = slice(start, start + new)
        expected = dense_reference(q[rows], k_full, v_full, HEAD_DIM**-0.5)
        if i in (1, 3) and backend.kernels is not None:  # bf16: q, K and V rounded to 8 bits of mantissa
            torch.testing.assert_close(out[rows], expected, atol=3e-2, rtol=3e-2)
            assert not torch.equal(out[rows], plain[rows])
        else:
            torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
            assert torch.equal(out[rows], plain[rows])
        start += new


def test_chunks_of_sixteen_rows_and_more_are_planned_for_flash_attention_where_asked():
    """flash (AMX-BF16 tiles, batch invariance off): every chunk of FLASH_CHUNK_ROWS+ rows, whatever its context,
    goes to flash attention with its first position and its pages; decode rows and fewer rows (a verify pass) stay
    with the fused kernel, and no chunk goes to SDPA."""
    from banyan.layers.attention.torch_backend import FLASH_CHUNK_ROWS, make_plan

    specs = [(260, 1), (0, FLASH_CHUNK_ROWS), (100, FLASH_CHUNK_ROWS - 1), (300, 50)]
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    batch, *_ = make_paged_batch(specs, page_size=16, num_kv_heads=2, num_heads=4, rng=rng, gen=gen, head_dim=32)
    plan = make_plan(batch, None, 16, fused=True, bf16_chunks=True, flash=True)
    starts = [0, 1, 1 + FLASH_CHUNK_ROWS, 2 * FLASH_CHUNK_ROWS]
    assert [(c.rows, c.first) for c in plan.flash] == [(slice(starts[1], starts[2]), 0), (slice(starts[3], starts[3] + 50), 300)]
    assert torch.equal(plan.flash[1].table, batch.block_tables[3])
    assert plan.groups == [] and plan.paged.rows.tolist() == [0, *range(starts[2], starts[3])]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [(64, 9, 3), (128, 4, 4)])
def test_flash_attention_on_amx_tiles_matches_the_reference(cache_dtype, head_dim, num_heads, num_kv_heads):
    """Chunks through flash attention (q, K, V and the weights rounded to bf16, float32 sums) within bf16's error of
    the exact attention, whether they start a prompt or follow a cached prefix, end on a tile of 16 or not, over
    float32 or float16 pages; the step's other rows keep the fused kernel's numbers exactly."""
    from banyan.layers.attention.torch_backend import TorchAttentionBackend

    backend = TorchAttentionBackend()
    if backend.kernels is None or not backend.kernels.amx_bf16:
        pytest.skip("no AMX-BF16 tiles here")
    backend.bf16_chunks = True
    specs = [(70, 1), (0, 16), (133, 37), (5, 3), (1000, 130)]
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    batch, k_cache, v_cache, q, k, v, full_kv = make_paged_batch(specs, page_size=16, num_kv_heads=num_kv_heads,
                                                                 num_heads=num_heads, rng=rng, gen=gen, head_dim=head_dim)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    scale = head_dim**-0.5
    out = backend.forward(q, k, v, k_cache, v_cache, batch, scale)
    assert len(backend._plan.flash) == 3
    plain = TorchAttentionBackend().forward(q, k, v, k_cache.clone(), v_cache.clone(), batch, scale)
    start = 0
    for (prefix, new), (k_full, v_full) in zip(specs, full_kv):
        rows = slice(start, start + new)
        expected = dense_reference(q[rows], k_full.to(cache_dtype).float(), v_full.to(cache_dtype).float(), scale)
        if new >= 16:
            assert (out[rows] - expected).norm() / expected.norm() < 1e-2
            torch.testing.assert_close(out[rows], expected, atol=3e-2, rtol=3e-2)
        else:
            assert torch.equal(out[rows], plain[rows])
        start += new


def test_amx_tiles_serve_where_bf16_chunks_were_asked_for_and_the_pages_allow():
    """amx_tiles (flash prefill chunks and shared prompts' decode rows on AMX-BF16 tiles): only with bf16 chunks asked
    for and batch invariance off, over float32, float16 or fp8 pages of head_dim a multiple of 32, with no window."""
    from banyan.layers.attention.torch_backend import TorchAttentionBackend

    backend = TorchAttentionBackend()
    if backend.kernels is None or not backend.kernels.amx_bf16:
        pytest.skip("no AMX-BF16 tiles here")
    f16 = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    assert not backend.amx_tiles(f16, None)
    backend.bf16_chunks = True
    assert backend.amx_tiles(f16, None) and backend.amx_tiles(f16.float(), None)
    assert not backend.amx_tiles(f16, 8)
    assert backend.amx_tiles(f16.to(torch.float8_e4m3fn), None)
    assert not backend.amx_tiles(f16.to(torch.bfloat16), None)  # no fused kernel for bf16 pages
    assert not backend.amx_tiles(f16[..., :48].contiguous(), None)
    backend.fixed_order = object()  # batch-invariant mode
    assert not backend.amx_tiles(f16, None)


def test_a_chunk_flash_attention_refuses_is_attended_by_the_fused_kernel(monkeypatch):
    """Where the tiles' kernel refuses a chunk it was planned for (its scratch memory not granted), the chunk's rows
    take the fused kernel instead: the same numbers as a backend that never planned flash attention."""
    from banyan.layers.attention.torch_backend import TorchAttentionBackend

    backend = TorchAttentionBackend()
    if backend.kernels is None:
        pytest.skip("no fused CPU kernels here")
    backend.bf16_chunks = True
    monkeypatch.setattr(backend.kernels, "amx_bf16", True)
    monkeypatch.setattr(backend.kernels, "flash_prefill", lambda *args: False)
    specs = [(40, 1), (20, 33)]
    rng, gen = random.Random(9), torch.Generator().manual_seed(9)
    batch, k_cache, v_cache, q, k, v, _ = make_paged_batch(specs, page_size=16, num_kv_heads=2, num_heads=4, rng=rng,
                                                           gen=gen, head_dim=32)
    out = backend.forward(q, k, v, k_cache, v_cache, batch, 0.25)
    assert len(backend._plan.flash) == 1
    plain = TorchAttentionBackend().forward(q, k, v, k_cache.clone(), v_cache.clone(), batch, 0.25)
    assert torch.equal(out, plain)
