"""banyan's fused CPU decode kernels (banyan/kernels/cpu_decode.c) against their torch references, and the
fallback: where they do not apply, `kernels_for` answers None and the layers keep their torch ops."""

from __future__ import annotations

import ctypes
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from banyan.kernels import cpu_decode, cpu_features, cpu_gemv
from banyan.layers.activation import gated_activation
from banyan.layers.norm import RMSNorm
from banyan.layers.attention.base import FP8, to_cache_dtype, write_kv_cache
from banyan.layers.rotary import RotaryEmbedding
from banyan.layers.attention.torch_backend import SHORT_QUERY, TorchAttentionBackend, attend_pages, paged_attention
from tests.kernels.paged_batches import make_batch

KERNELS = cpu_decode.kernels_for(torch.device("cpu"), torch.float32)
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="needs an x86 CPU with AVX2 and a C compiler")


def torch_rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_and_its_fused_residual_add(rows):
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(2, rows, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    torch.testing.assert_close(KERNELS.rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5))
    total, normed = KERNELS.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(normed, torch_rms_norm(x + residual, weight, 1e-6))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_silu_mul(rows):
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(KERNELS.silu_mul(gate_up), F.silu(gate) * up)


@needs_kernels
def test_silu_mul_at_the_extremes():
    gate = torch.tensor([-200.0, -90.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 200.0])
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)])[None]
    torch.testing.assert_close(KERNELS.silu_mul(gate_up)[0], F.silu(gate) * 3.0)


@needs_kernels
def test_silu_mul_on_bf16_rows_rounds_once_as_torch_does():
    """bf16 in, bf16 out (an AMX prefill's MLP middle): silu(g) * u in float32, rounded to nearest even; exp8's 2e-7
    may move a product across a rounding boundary, one bf16 step at most; inf and NaN stay what they are."""
    gate_up = (torch.randn(37, 2 * 1536, generator=torch.Generator().manual_seed(3)) * 6).bfloat16()
    gate, up = gate_up.float().chunk(2, dim=-1)
    out, expected = KERNELS.silu_mul(gate_up), (F.silu(gate) * up).bfloat16()
    assert out.dtype == torch.bfloat16 and out.shape == (37, 1536)
    steps = (out.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert steps.max() <= 1 and (steps == 0).float().mean() > 0.999
    special = torch.tensor([[1.0, 2.0, -3.0, 0.5, 0.0, 1.0, 4.0, -2.0,
                             float("inf"), float("nan"), 1.0, 2.0, 0.0, -1.0, 3.0, 1e30]]).bfloat16()
    got = KERNELS.silu_mul(special)[0].float()
    assert got[0] == float("inf") and got[1].isnan() and got[4] == 0.0 and got[7].isfinite()


def qkv_rows(tokens, heads, kv_heads, dim, gen):
    """One qkv output [tokens, (heads + 2 kv_heads) * dim] and its q, k, v views, as RopeAttention splits it."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return qkv, q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)


KV_DTYPES = pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["kv32", "kv16"])  # stored
READ_DTYPES = pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, FP8], ids=["kv32", "kv16", "kv8"])


@needs_kernels
@KV_DTYPES
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_rope_store_matches_rotary_then_cache_write(dim, kv_dtype):
    """Rotated q and k in place, k and v at their slots (a float16 cache: rounded as .half() rounds); a negative
    slot (a padding row) writes nothing."""
    gen = torch.Generator().manual_seed(dim)
    rotary = RotaryEmbedding(dim, 4096, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
    heads, kv_heads, page_size = 6, 2, 4
    qkv, q, k, v = qkv_rows(7, heads, kv_heads, dim, gen)
    positions = torch.tensor([0, 1, 3, 4, 17, 1000, 4095])
    slots = torch.tensor([5, 2, -1, 9, 0, 11, 23])  # [num_pages * page_size) or -1
    k_cache, v_cache = torch.randn(2, 6, page_size, kv_heads, dim, generator=gen).to(kv_dtype)
    q_ref, k_ref = rotary(positions, q.clone(), k.clone())
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    kept = slots >= 0
    write_kv_cache(k_ref[kept], v[kept], k_expected, v_expected, slots[kept])

    KERNELS.rope_store(q, k, v, positions, rotary.cos, rotary.sin, k_cache, v_cache, slots)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    torch.testing.assert_close(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


@needs_kernels
def test_rope_store_refuses_positions_past_the_table():
    gen = torch.Generator().manual_seed(0)
    rotary = RotaryEmbedding(64, 32)
    _, q, k, v = qkv_rows(2, 3, 1, 64, gen)
    cache = torch.zeros(2, 4, 1, 64)
    with pytest.raises(ValueError, match="outside the rotary table"):
        KERNELS.rope_store(q, k, v, torch.tensor([3, 32]), rotary.cos, rotary.sin, cache, cache.clone(),
                           torch.tensor([0, 1]))


def paged_case(specs, page_size, kv_heads, heads, dim, seed, kv_dtype=torch.float32):
    """Requests (cached prefix, new rows) over shuffled pages of a noise cache: (q, caches, tables, per-row
    request index and position, context lengths, query lengths)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    pages = [-(-(prefix + new) // page_size) for prefix, new in specs]
    free = list(range(sum(pages) + 2))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in pages]
    width = max(pages)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache, v_cache = torch.randn(2, sum(pages) + 2, page_size, kv_heads, dim, generator=gen).to(kv_dtype)
    seq_of_row = [i for i, (_, new) in enumerate(specs) for _ in range(new)]
    positions = [prefix + j for prefix, new in specs for j in range(new)]
    q = torch.randn(len(positions), heads, dim, generator=gen)
    return q, k_cache, v_cache, table, seq_of_row, positions


def sdpa_reference(q, k_cache, v_cache, table, specs, scale, window, kv_scale=1.0):
    """torch_backend.paged_attention (gathered pages, SDPA), one request at a time, rows in q's order."""
    outs, start = [], 0
    for i, (prefix, new) in enumerate(specs):
        rows = q[start : start + new][None]
        outs.append(paged_attention(rows, k_cache, v_cache, table[i : i + 1], [prefix + new], [new], scale, window,
                                    kv_scale)[0])
        start += new
    return torch.cat(outs)


@needs_kernels
@READ_DTYPES
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("page_size,kv_heads,group", [(1, 1, 4), (4, 2, 3), (16, 3, 3)])
def test_paged_attention_reads_the_pages_directly(page_size, kv_heads, group, window, kv_dtype):
    """Decode rows and prefill chunks, prefixes ending on page edges or inside pages, GQA, sliding windows; a float16
    cache against SDPA over the same values widened."""
    specs = [(0, 1), (7, 1), (page_size * 2 - 1, 1), (page_size * 3, 1), (3, 6), (0, 9), (40, 1)]
    heads, dim = kv_heads * group, 64
    q, k_cache, v_cache, table, seq_of_row, positions = paged_case(specs, page_size, kv_heads, heads, dim, page_size,
                                                                   kv_dtype)
    out = torch.full_like(q, float("nan"))
    rows = cpu_decode.PagedRows(list(range(len(positions))), seq_of_row, positions, table)
    KERNELS.paged_attention(q, k_cache, v_cache, out, rows, dim**-0.5, window)
    expected = sdpa_reference(q, k_cache, v_cache, table, specs, dim**-0.5, window)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@needs_kernels
def test_paged_attention_writes_only_its_rows_and_reads_strided_queries():
    """A subset of rows (the decode rows of a mixed step), q a row-strided view of a qkv output."""
    specs = [(5, 1), (3, 4), (12, 1)]
    q, k_cache, v_cache, table, seq_of_row, positions = paged_case(specs, 4, 1, 3, 32, 0)
    wide = torch.randn(len(positions), 3 * 32 + 64)  # qkv-like rows: q first
    wide[:, : 3 * 32] = q.flatten(1)
    strided = wide[:, : 3 * 32].view(-1, 3, 32)
    out = torch.full_like(q, float("nan"))
    chosen = [0, 5]  # the two decode rows
    rows = cpu_decode.PagedRows(chosen, [seq_of_row[r] for r in chosen], [positions[r] for r in chosen], table)
    KERNELS.paged_attention(strided, k_cache, v_cache, out, rows, 0.3, None)
    expected = sdpa_reference(q, k_cache, v_cache, table, specs, 0.3, None)
    torch.testing.assert_close(out[chosen], expected[chosen], atol=2e-6, rtol=1e-5)
    assert out[[1, 2, 3, 4]].isnan().all()


@needs_kernels
def test_an_fp8_cache_is_read_with_its_scale():
    """An fp8 cache holds K / s and V / s (--kv-cache-dtype fp8's store): the kernel's output equals SDPA over the
    torch backend's reading of the same pages, times s, and the fp8 decoding covers every byte (all 254 finite
    values, subnormals included)."""
    specs = [(30, 1), (0, 9), (13, 4)]
    q, k_cache, v_cache, table, seq_of_row, positions = paged_case(specs, 4, 2, 6, 64, 3)
    k8, v8 = to_cache_dtype(k_cache, FP8, 0.25), to_cache_dtype(v_cache, FP8, 0.25)
    every = cpu_decode.PagedRows(list(range(len(positions))), seq_of_row, positions, table)
    out = torch.full_like(q, float("nan"))
    KERNELS.paged_attention(q, k8, v8, out, every, 0.125, None, kv_scale=0.25)
    expected = sdpa_reference(q, k8, v8, table, specs, 0.125, None, kv_scale=0.25)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    # 32 sequences of one token each, page i holding bytes 8i .. 8i + 7 as its V row: a row alone over one key
    # outputs that V row exactly, so the outputs are the kernel's decoding of every byte
    pages = torch.arange(256, dtype=torch.uint8).view(FP8).view(32, 1, 1, 8)
    rows = cpu_decode.PagedRows(list(range(32)), list(range(32)), [0] * 32, torch.arange(32, dtype=torch.int32)[:, None])
    decoded = torch.empty(32, 1, 8)
    KERNELS.paged_attention(torch.zeros(32, 1, 8), pages, pages, decoded, rows, 1.0, None)
    expected = pages.float().flatten()
    finite = expected.isfinite()  # 0x7f and 0xff are e4m3fn's NaNs, which a store never writes (it clamps)
    assert finite.sum() == 254 and torch.equal(decoded.flatten()[finite], expected[finite])


@needs_kernels
def test_a_rows_attention_does_not_depend_on_the_rows_beside_it():
    specs = [(30, 1), (2, 1), (60, 1), (9, 5)]
    q, k_cache, v_cache, table, seq_of_row, positions = paged_case(specs, 4, 3, 9, 64, 1)
    every = torch.empty_like(q)
    KERNELS.paged_attention(q, k_cache, v_cache, every, cpu_decode.PagedRows(list(range(8)), seq_of_row, positions,
                                                                            table), 0.125, None)
    for r in range(8):
        alone = torch.empty_like(q)
        rows = cpu_decode.PagedRows([r], [seq_of_row[r]], [positions[r]], table)
        KERNELS.paged_attention(q, k_cache, v_cache, alone, rows, 0.125, None)
        assert torch.equal(alone[r], every[r])


@needs_kernels
@READ_DTYPES
@pytest.mark.parametrize("kv_heads,group", [(3, 3), (1, 4), (2, 2), (1, 1)])
@pytest.mark.parametrize("new_rows", [1, 4, 6, 9])
def test_a_lone_row_or_tile_has_its_bits_at_any_thread_count(kv_heads, group, new_rows, kv_dtype):
    """A batch-1 decode row, or a verify pass's rows, over fewer (tile, KV head) items than threads or more (6 and 9
    rows are cut into more tiles as the threads grow): the same output bit for bit at 1, 2, 3 and 5 threads, and
    SDPA's closely."""
    specs = [(37, new_rows)]
    q, k_cache, v_cache, table, seq_of_row, positions = paged_case(specs, 4, kv_heads, kv_heads * group, 64, 3,
                                                                    kv_dtype)
    rows = cpu_decode.PagedRows(list(range(new_rows)), seq_of_row, positions, table)
    threads, outs = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            outs.append(torch.empty_like(q))
            KERNELS.paged_attention(q, k_cache, v_cache, outs[-1], rows, 0.125, None)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    expected = sdpa_reference(q, k_cache.float(), v_cache.float(), table, specs, 0.125, None)
    torch.testing.assert_close(outs[0], expected, atol=2e-6, rtol=1e-5)


@needs_kernels
@READ_DTYPES
@pytest.mark.parametrize("window", [None, 5, 12])
@pytest.mark.parametrize("page_size,kv_heads,group", [(16, 3, 3), (8, 2, 4), (16, 1, 1), (1, 3, 3), (4, 2, 2)])
def test_decode_and_verify_rows_read_in_place_keep_their_bits_however_the_threads_share_them(page_size, kv_heads,
                                                                                             group, window, kv_dtype):
    """A step of decode rows and verify passes of 2 to 4 rows, each of its own sequence, read in place: with two tiles
    or more a thread, a tile reads all its KV heads in one pass where the scratch has room (eight keys of a page at
    once where they lie in one); else one KV head an item. Each row equals itself alone bit for bit at 1, 2, 3 and 7
    threads and with a scratch holding one KV head's scores at a time, and SDPA closely: contexts of one key to several
    pages, ending on page edges and inside pages, windows shorter and longer than a page, pages in a shuffled order."""
    specs = [(n, 1) for n in (0, 7, 8, 15, 16, 17, 40, 63, 64, 100, 5, 33)] + [(30, 2), (14, 3), (61, 4)]
    q, k_cache, v_cache, table, seq_of_row, positions = paged_case(specs, page_size, kv_heads, kv_heads * group, 64, 5,
                                                                    kv_dtype)
    if page_size == 1:  # pages 7 apart at both ends of 8 keys, and not a run between
        table[9, :8] = torch.tensor([10, 3, 4, 5, 6, 7, 8, 17])
    every = cpu_decode.PagedRows(list(range(len(positions))), seq_of_row, positions, table)
    threads, outs = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3, 7):
            torch.set_num_threads(n)
            outs.append(torch.full_like(q, float("nan")))
            KERNELS.paged_attention(q, k_cache, v_cache, outs[-1], every, 0.125, window)
    finally:
        torch.set_num_threads(threads)
    outs.append(torch.full_like(q, float("nan")))
    narrow = cpu_decode.PagedRows(list(range(len(positions))), seq_of_row, positions, table)
    KERNELS.paged_attention(q, k_cache, v_cache, outs[-1], one_kv_head_at_a_time(narrow, q.shape[1]), 0.125, window)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    for r in range(len(positions)):
        alone = torch.full_like(q, float("nan"))
        rows = cpu_decode.PagedRows([r], [seq_of_row[r]], [positions[r]], table)
        KERNELS.paged_attention(q, k_cache, v_cache, alone, rows, 0.125, window)
        assert torch.equal(alone[r], outs[0][r]), f"row {r} (position {positions[r]})"
    expected = sdpa_reference(q, k_cache.float(), v_cache.float(), table, specs, 0.125, window)
    torch.testing.assert_close(outs[0], expected, atol=2e-6, rtol=1e-5)


@needs_kernels
@READ_DTYPES
@pytest.mark.parametrize("window", [None, 3, 7])
@pytest.mark.parametrize("page_size,kv_heads,group", [(1, 1, 4), (4, 3, 3), (16, 2, 1)])
def test_a_prefill_chunks_rows_go_through_the_keys_together_with_the_bits_of_each_row_alone(page_size, kv_heads,
                                                                                           group, window, kv_dtype):
    """Rows of one sequence share their key reads in tiles of ATTENTION_TILE; every row keeps its own keys and order:
    chunks longer and shorter than a tile, after cached prefixes ending on and inside page edges, a window shorter
    than a tile, GQA, decode rows between them."""
    tile = cpu_decode.ATTENTION_TILE
    specs = [(0, 2 * tile + 1), (page_size * 2, tile), (5, 1), (page_size * 3 - 1, tile + 2), (0, tile - 1), (40, 3)]
    heads, dim = kv_heads * group, 64
    assert_rows_together_are_rows_alone(specs, paged_case(specs, page_size, kv_heads, heads, dim, 7, kv_dtype), window)


@needs_kernels
@READ_DTYPES
@pytest.mark.parametrize("dim", [32, 128, 136, 264])  # 64 above; 64 and 128 compiled as constants; past 256: in place
def test_a_tiles_gathered_keys_give_each_row_its_bits_alone_at_every_head_dim(dim, kv_dtype):
    """A prefill tile reads its keys and values gathered into one buffer, a decode row reads them in place: the
    same sums either way, at head_dims the kernel compiles as constants (64, 128), others (32, 136), and one too
    large to gather (264, read in place by the tile too)."""
    specs = [(5, cpu_decode.ATTENTION_TILE + 3), (0, 9), (21, 1)]
    assert_rows_together_are_rows_alone(specs, paged_case(specs, 4, 2, 6, dim, dim, kv_dtype), None)


@pytest.fixture(scope="module")
def both_builds(tmp_path_factory):
    """The library built for AVX2 and for AVX-512 VNNI (each loaded beside the process's own)."""
    if KERNELS is None or "avx512_vnni" not in cpu_features.cpu_flags():
        pytest.skip("the AVX-512 build cannot run on this CPU")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("BANYAN_CACHE_DIR", str(tmp_path_factory.mktemp("kernels")))
        return [cpu_decode.DecodeKernels(ctypes.CDLL(str(cpu_gemv.build(shutil.which("cc"), isa))))
                for isa in ("avx2", "avx512_vnni")]


@READ_DTYPES
def test_the_avx512_build_gives_the_avx2_builds_attention_bits(kv_dtype, both_builds):
    """The AVX-512 build's decode rows take 64 output columns of three heads a pass (32 registers) where the AVX2
    build takes 32: the same sums in the same order, so the same bits, for decode rows and prefill tiles alike."""
    builds = both_builds
    specs = [(40, 1), (7, 1), (3, cpu_decode.ATTENTION_TILE + 2), (70, 1)]
    q, k_cache, v_cache, table, seq_of_row, positions = paged_case(specs, 16, 3, 9, 64, 3, kv_dtype)
    rows = cpu_decode.PagedRows(list(range(len(positions))), seq_of_row, positions, table)
    outs = []
    for kernels in builds:
        outs.append(torch.full_like(q, float("nan")))
        kernels.paged_attention(q, k_cache, v_cache, outs[-1], rows, 0.125, None)
    assert torch.equal(outs[0], outs[1])


def test_the_avx512_build_gives_the_avx2_builds_silu_mul_bits(both_builds):
    """16 values a step with AVX-512, 8 with AVX2 (and for a row's last 8): the same operations a lane, so the same
    bits, float32 and bf16, extremes and NaN included."""
    gate_up = torch.randn(9, 2 * 1544, generator=torch.Generator().manual_seed(5)) * 8  # 1544: 96 x 16 + 8
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, 0.0, -0.0, 1e-30, 90.0, float("inf"), float("nan")])
    for rows, bits in ((gate_up, torch.int32), (gate_up.bfloat16(), torch.int16)):
        avx2, avx512 = (kernels.silu_mul(rows).view(bits) for kernels in both_builds)
        assert torch.equal(avx2, avx512)


@needs_kernels
def test_gather_as_bf16_gives_the_bits_of_index_select_then_to_bf16(both_builds):
    """read_pages for SDPA in bf16 (AMX prefill) in one pass: float16 pages gathered and rounded to bf16 as torch's two
    steps round them, extremes and NaN included, in both builds; the attention of a bf16 chunk is unchanged."""
    cache = torch.randn(40, 16, 3, 64, generator=torch.Generator().manual_seed(2)).mul(300).half()
    cache[5, 0, 0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 65504.0, -0.0, 6e-8]).half()
    index = torch.tensor([5, 39, 0, 5, 17])
    expected = cache.index_select(0, index).to(torch.bfloat16).view(torch.int16)
    for kernels in (KERNELS, *both_builds):
        assert torch.equal(kernels.gather_as_bf16(cache, index).view(torch.int16), expected)
    cache[5, 0, 0, :6] = 1.0  # finite pages for the attention (NaN != NaN)
    pages, q = torch.tensor([[5, 39, 17]]), torch.randn(1, 40, 6, 64).bfloat16()
    mask = torch.ones(1, 1, 40, 48, dtype=torch.bool).tril(diagonal=8)
    through = attend_pages(q, cache, cache, pages, mask, 0.125, kernels=KERNELS)
    assert torch.equal(through, attend_pages(q, cache, cache, pages, mask, 0.125)) and not through.isnan().any()


def one_kv_head_at_a_time(rows: cpu_decode.PagedRows, heads: int) -> cpu_decode.PagedRows:
    """rows, with max_keys past what a thread's scratch may take to hold every query head of a tile (cpu_decode.c's
    score_rows): the kernel then holds one KV head's scores at a time, as at long contexts."""
    rows.max_keys = max(rows.max_keys, cpu_decode.WIDE_SCRATCH_FLOATS // (cpu_decode.ATTENTION_TILE * heads + 1) + 1)
    return rows


def assert_rows_together_are_rows_alone(specs, case, window, narrow=False):
    """Every row of one call (tiles of a sequence's rows) equals the row alone bit for bit, and SDPA closely; narrow:
    the call's scratch holds one KV head's scores at a time (one_kv_head_at_a_time), the rows alone every head's."""
    q, k_cache, v_cache, table, seq_of_row, positions = case
    scale = q.shape[-1] ** -0.5
    together = torch.full_like(q, float("nan"))
    all_rows = cpu_decode.PagedRows(list(range(len(positions))), seq_of_row, positions, table)
    KERNELS.paged_attention(q, k_cache, v_cache, together,
                            one_kv_head_at_a_time(all_rows, q.shape[1]) if narrow else all_rows, scale, window)
    for r in range(len(positions)):
        alone = torch.full_like(q, float("nan"))
        rows = cpu_decode.PagedRows([r], [seq_of_row[r]], [positions[r]], table)
        KERNELS.paged_attention(q, k_cache, v_cache, alone, rows, scale, window)
        assert torch.equal(alone[r], together[r]), f"row {r} (position {positions[r]})"
    expected = sdpa_reference(q, k_cache, v_cache, table, specs, scale, window)
    torch.testing.assert_close(together, expected, atol=2e-6, rtol=1e-5)


def shared_prompt_case(page_size, kv_heads, heads, dim, seed, kv_dtype):
    """Requests whose tables begin with the same pages, as the prefix cache hands a shared prompt's out: prompt A's 6
    pages begin 11 tables (one of them only A's first 4, one's row still inside A's pages), prompt B's 3 pages begin
    two, one request shares only B's first page, and a prefill chunk lies among them. (q, caches, tables, request
    and position per row, specs as paged_case's, the rows' table rows.)"""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    # (prompt, its pages the table begins with, own pages after them, new rows)
    requests = [("A", 6, 2, 1), ("A", 6, 1, 1), (None, 0, 3, 5), ("A", 6, 3, 1), ("A", 6, 0, 1), ("B", 3, 1, 1),
                ("B", 3, 2, 1), ("B", 1, 2, 1), ("A", 4, 1, 1)] + [("A", 6, 1 + i % 3, 1) for i in range(7)]
    free = list(range(1, 200))
    rng.shuffle(free)
    prompts = {"A": [free.pop() for _ in range(6)], "B": [free.pop() for _ in range(3)]}
    tables, specs = [], []
    for prompt, alike, own, new in requests:
        pages = (prompts[prompt][:alike] if prompt else []) + [free.pop() for _ in range(own)]
        context = len(pages) * page_size - rng.randrange(page_size)  # the last page partly filled
        tables.append(pages)
        specs.append((context - new, new))
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache, v_cache = torch.randn(2, 200, page_size, kv_heads, dim, generator=gen).to(kv_dtype)
    seq_of_row = [i for i, (_, new) in enumerate(specs) for _ in range(new)]
    positions = [prefix + j for prefix, new in specs for j in range(new)]
    q = torch.randn(len(positions), heads, dim, generator=gen)
    return (q, k_cache, v_cache, table, seq_of_row, positions), specs


def test_decode_rows_whose_tables_begin_alike_are_put_side_by_side():
    """PagedRows: the prefill chunk's rows first, then the decode rows by first page, each with the leading pages
    its table has alike with the row before's; no sharing, no reordering."""
    (q, _, _, table, seq_of_row, positions), specs = shared_prompt_case(4, 1, 1, 8, 0, torch.float32)
    rows = cpu_decode.PagedRows(list(range(len(positions))), seq_of_row, positions, table)
    order = rows.rows.tolist()
    assert order[:5] == [2, 3, 4, 5, 6]  # request 2's chunk
    shared = dict(zip(order, rows.shared.tolist()))
    prompt_a = [r for r in order if table[seq_of_row[r], 0] == table[0, 0]]
    at = order.index(prompt_a[0])
    assert len(prompt_a) == 12 and order[at : at + 12] == prompt_a  # side by side
    assert seq_of_row[prompt_a[-1]] == 8  # the request sharing only 4 of prompt A's pages, at the run's edge
    assert sorted(shared[r] for r in prompt_a[1:]) == [4] + [6] * 10
    assert rows.positions.tolist() == [positions[r] for r in order]
    alone = [0, 1]  # two requests, nothing shared
    rows = cpu_decode.PagedRows(alone, [seq_of_row[r] for r in (0, 9)], [positions[r] for r in (0, 9)], table)
    assert rows.shared is None and rows.rows.tolist() == alone


@needs_kernels
@READ_DTYPES
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("page_size,kv_heads,group", [(4, 1, 4), (16, 3, 3), (8, 2, 1)])
def test_decode_rows_read_shared_pages_together_with_the_bits_of_each_row_alone(page_size, kv_heads, group, window,
                                                                                kv_dtype):
    """Decode rows over pages their tables share go through those pages together, then each through its own (a run
    longer than a tile, cut in two and more by the thread count), all the KV heads of a tile in one item, or as many
    as a scratch holding one KV head's scores at a time allows: each row equals itself alone bit for bit, and SDPA
    closely; a sliding window turns the sharing off."""
    case, specs = shared_prompt_case(page_size, kv_heads, kv_heads * group, 64, page_size + group, kv_dtype)
    threads = torch.get_num_threads()
    try:
        for n, narrow in ((1, False), (2, False), (5, False), (2, True)):
            torch.set_num_threads(n)
            assert_rows_together_are_rows_alone(specs, case, window, narrow)
    finally:
        torch.set_num_threads(threads)


def test_the_attention_scratch_holds_every_heads_scores_up_to_its_bound_then_one_kv_heads():
    """Per thread, the scores of a full tile's rows for every query head, and the slots, while they fit
    WIDE_SCRATCH_FLOATS; past it, one KV head's: a 32-head model at 32k keys takes 8 x 4 + 1 rows of keys a thread,
    not 8 x 32 + 1."""
    tile, bound = cpu_decode.ATTENTION_TILE, cpu_decode.WIDE_SCRATCH_FLOATS
    assert cpu_decode.attention_scratch(2, 9, 3, 2048) == 2 * (tile * 9 + 1) * 2048
    assert cpu_decode.attention_scratch(2, 32, 8, 32768) == 2 * (tile * 4 + 1) * 32768
    edge = bound // (tile * 9 + 1)
    assert cpu_decode.attention_scratch(1, 9, 3, edge) == (tile * 9 + 1) * edge <= bound
    assert cpu_decode.attention_scratch(1, 9, 3, edge + 1) == (tile * 3 + 1) * (edge + 1)


@needs_kernels
@pytest.mark.parametrize("window", [None, 6])
def test_torch_backend_sends_every_row_to_the_kernel(window):
    """A step of decode rows, verify-sized chunks, a short and a long prefill chunk: every row goes to the kernel,
    no SDPA group is left, and the rows equal SDPA's alone."""
    specs = [(12, 1), (7, 8), (30, 3), (0, 12), (20, 1), (5, SHORT_QUERY + 6)]
    batch, q, k, v, k_cache, v_cache = make_batch(specs, page_size=4, num_kv_heads=3, group=3, head_dim=64, seed=2)
    fused = TorchAttentionBackend()
    out = fused.forward(q, k, v, k_cache.clone(), v_cache.clone(), batch, 0.125, window)
    reference = TorchAttentionBackend(fused=False)
    expected = reference.forward(q, k, v, k_cache, v_cache, batch, 0.125, window)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    assert fused._plan.paged.rows.tolist() == list(range(batch.num_tokens)) and fused._plan.groups == []
    assert reference._plan.paged is None and [g.max_query_len for g in reference._plan.groups] == [1, 12, SHORT_QUERY + 6]


@needs_kernels
@READ_DTYPES
def test_rope_store_then_backend_equals_rotary_then_backend(kv_dtype):
    """RopeAttention's fused path (rotate_and_store, then attention with kv_stored) against the torch path, the cache
    written as torch writes it (V with the same bits; an fp8 one with its kv_scale: times 1 / kv_scale, clamped,
    rounded as torch rounds; K within an fp8 step where the rotations' last bits differ);
    a bfloat16 cache is not theirs to write (False: the torch path does it all)."""
    specs = [(9, 1), (0, 5), (17, 1)]
    batch, _, _, _, k_cache, v_cache = make_batch(specs, page_size=4, num_kv_heads=1, group=3, head_dim=64, seed=4)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    kv_scale = 0.5 if kv_dtype == FP8 else 1.0
    rotary = RotaryEmbedding(64, 64)
    qkv, q, k, v = qkv_rows(batch.num_tokens, 3, 1, 64, torch.Generator().manual_seed(4))
    q_ref, k_ref = rotary(batch.positions, q.clone(), k.clone())
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    expected = TorchAttentionBackend(kv_scale, fused=False).forward(q_ref, k_ref, v, k_expected, v_expected, batch,
                                                                    0.125)
    assert rotary.rotate_and_store(batch.positions, q, k, v, k_cache, v_cache, batch.slot_mapping, kv_scale)
    out = TorchAttentionBackend(kv_scale).forward(q, k, v, k_cache, v_cache, batch, 0.125, kv_stored=True)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(v_cache.view(torch.uint8), v_expected.view(torch.uint8))  # K: rotated by other arithmetic
    within_a_step = {"rtol": 0.13, "atol": 2**-9} if kv_dtype == FP8 else {}
    torch.testing.assert_close(k_cache.float(), k_expected.float(), **within_a_step)
    bf16 = torch.bfloat16
    assert not rotary.rotate_and_store(batch.positions, q, k, v, k_cache.to(bf16), v_cache.to(bf16), batch.slot_mapping)


@needs_kernels
def test_rope_store_rounds_to_fp8_as_torch_does():
    """Every fp8 value, the midpoints between neighbours (ties to even) and a float32 either side of each, values
    over the range (clamped to +-448), subnormals, zeros of both signs, infinities and NaN, at several scales: the
    fused store writes torch's bytes (base.to_cache_dtype)."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[~grid.isnan()].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(5)
    values = torch.cat([grid, mid, torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(-1e9)),
                        torch.randn(4096, generator=gen) * 10 ** (torch.rand(4096, generator=gen) * 8 - 5),
                        torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 449.0,
                                      465.0, 1e30, 2**-10, 3 * 2**-10, 1e-40])])
    tokens = values.numel() // 64
    x = values[: tokens * 64].view(tokens, 1, 64)
    angle = torch.ones(1, 32), torch.zeros(1, 32)  # position 0: no rotation
    for kv_scale in (1.0, 0.5, 0.1, 3.7):
        k_cache, v_cache = (torch.zeros(tokens, 1, 1, 64, dtype=FP8) for _ in range(2))
        KERNELS.rope_store(torch.zeros(tokens, 1, 64), x.clone(), x.clone(), torch.zeros(tokens, dtype=torch.int64),
                           *angle, k_cache, v_cache, torch.arange(tokens), kv_scale)
        want = to_cache_dtype(x, FP8, kv_scale).view(torch.uint8)
        assert torch.equal(k_cache.view(tokens, 1, 64).view(torch.uint8), want), kv_scale
        assert torch.equal(v_cache.view(tokens, 1, 64).view(torch.uint8), want), kv_scale


def test_no_kernels_where_they_do_not_apply(monkeypatch):
    """Off CPU, other dtypes, or switched off: None, and the layers keep their torch ops."""
    assert cpu_decode.kernels_for(torch.device("meta"), torch.float32) is None
    assert cpu_decode.kernels_for(torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, "1")
    assert cpu_decode.kernels_for(torch.device("cpu"), torch.float32) is None


@needs_kernels
def test_layers_equal_their_torch_fallback(monkeypatch):
    """RMSNorm (with the residual add) and the gated activation, built with and without the fused kernels."""
    gen = torch.Generator().manual_seed(9)
    x, residual = torch.randn(2, 3, 576, generator=gen)
    gate_up = torch.randn(3, 2 * 1536, generator=gen)
    fused_norm, fused_act = RMSNorm(576, 1e-5), gated_activation("silu", 1536)
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, "1")
    plain_norm, plain_act = RMSNorm(576, 1e-5), gated_activation("silu", 1536)
    assert fused_norm.kernels is not None and plain_norm.kernels is None
    for norm in (fused_norm, plain_norm):
        norm.weight.data.copy_(torch.linspace(0.5, 1.5, 576))
    total, normed = fused_norm.add_forward(x, residual)
    plain_total, plain_normed = plain_norm.add_forward(x, residual)
    assert torch.equal(total, plain_total)
    torch.testing.assert_close(normed, plain_normed)
    torch.testing.assert_close(fused_norm(x), plain_norm(x))
    torch.testing.assert_close(fused_act(gate_up), plain_act(gate_up))
    strided = torch.randn(3, 2 * 576, generator=gen)[:, ::2]  # not contiguous: the torch ops
    torch.testing.assert_close(fused_norm(strided), plain_norm(strided))


needs_amx_bf16 = pytest.mark.skipif(KERNELS is None or not KERNELS.amx_bf16, reason="needs AMX-BF16 tiles")


@needs_amx_bf16
def test_flash_prefill_gives_each_row_the_same_numbers_at_any_thread_count_and_refuses_what_it_cannot_read():
    """Each (head, 16 rows) of a chunk is one thread's work in a fixed order, so the output is the same at 1 and 2
    threads; a long context (2,000 keys), 16 rows exactly and heads of 128 without grouping are served within bf16's
    error, and an fp8 cache with its kv_scale; head_dim not a multiple of 32 is refused with out untouched."""
    gen, threads_before = torch.Generator().manual_seed(11), torch.get_num_threads()
    for first, n, heads, kv_heads, dim in ((1984, 16, 9, 3, 64), (0, 16, 4, 4, 128), (7, 70, 6, 2, 64)):
        keys, page = first + n, 16
        table = torch.randperm(200, generator=gen)[: -(-keys // page)].to(torch.int32)
        k_cache, v_cache = (torch.randn(200, page, kv_heads, dim, generator=gen).half() for _ in range(2))
        q = torch.randn(n, heads, dim, generator=gen)
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.empty(n, heads, dim)
            assert KERNELS.flash_prefill(q, k_cache, v_cache, table, first, out, dim**-0.5)
            outs.append(out)
        torch.set_num_threads(threads_before)
        assert torch.equal(outs[0], outs[1])
        exact = paged_attention(q[None], k_cache.float(), v_cache.float(), table[None].long(), [keys], [n], dim**-0.5)[0]
        assert (outs[0] - exact).norm() / exact.norm() < 1e-2
    table = torch.randperm(40, generator=gen)[:5].to(torch.int32)
    k8, v8 = (to_cache_dtype(torch.randn(40, 16, 2, 64, generator=gen), FP8, 0.5) for _ in range(2))
    q, out = torch.randn(30, 6, 64, generator=gen), torch.empty(30, 6, 64)
    assert KERNELS.flash_prefill(q, k8, v8, table, 50, out, 0.125, kv_scale=0.5)
    exact = paged_attention(q[None], k8.float() * 0.5, v8.float() * 0.5, table[None].long(), [80], [30], 0.125)[0]
    assert (out - exact).norm() / exact.norm() < 1e-2
    untouched = torch.full((16, 4, 64), 7.0)
    narrow = torch.zeros(4, 16, 4, 48).half()
    assert not KERNELS.flash_prefill(torch.randn(16, 4, 48), narrow, narrow, torch.arange(1, dtype=torch.int32), 0,
                                     untouched[..., :48].contiguous(), 0.1)
    assert torch.equal(untouched, torch.full((16, 4, 64), 7.0))


@needs_amx_bf16
def test_flash_prefill_gives_a_row_the_same_numbers_in_any_chunk_of_sixteen_rows_or_more():
    """A row's scores, softmax and sums follow from its own q and keys (steps past its position add exact zeros), so
    chunked prefill gives the rows the same numbers wherever the chunks are cut."""
    gen = torch.Generator().manual_seed(12)
    table = torch.randperm(40, generator=gen)[:12].to(torch.int32)
    k_cache, v_cache = (torch.randn(40, 16, 3, 64, generator=gen).half() for _ in range(2))
    q = torch.randn(48, 9, 64, generator=gen)
    whole, tail = torch.empty(48, 9, 64), torch.empty(29, 9, 64)
    assert KERNELS.flash_prefill(q, k_cache, v_cache, table, 100, whole, 0.125)
    assert KERNELS.flash_prefill(q[19:], k_cache, v_cache, table, 119, tail, 0.125)
    assert torch.equal(whole[19:], tail)


def rows_in_runs(rows: cpu_decode.PagedRows) -> set[int]:
    """The rows PagedRows put side by side with a neighbour whose table begins with the same 2 pages or more."""
    order, shared = rows.rows.tolist(), rows.shared.tolist()
    return {order[i] for i in range(len(order)) if shared[i] >= 2 or (i + 1 < len(order) and shared[i + 1] >= 2)}


@needs_amx_bf16
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["kv32", "kv16"])
@pytest.mark.parametrize("page_size,kv_heads,group,dim", [(16, 3, 3, 64), (4, 1, 4, 64), (8, 2, 1, 128), (16, 2, 8, 32)])
def test_decode_rows_sharing_pages_attend_them_on_amx_tiles_within_bf16s_error(page_size, kv_heads, group, dim,
                                                                              kv_dtype):
    """bf16_tiles (batch invariance off): decode rows over a shared prompt's pages attend those keys on AMX-BF16 tiles
    (q, K, V and the weights rounded to bf16), within bf16's error of SDPA, with the same numbers at 1 and 2 threads
    (a row's numbers follow from the keys its run shares, not from how the run is cut into tiles); rows that share
    nothing, the prefill chunk's among them, keep the float kernel's bits."""
    (q, k_cache, v_cache, table, seq_of_row, positions), specs = shared_prompt_case(
        page_size, kv_heads, kv_heads * group, dim, 5, kv_dtype)
    rows = cpu_decode.PagedRows(list(range(len(positions))), seq_of_row, positions, table)
    scale, threads = dim**-0.5, torch.get_num_threads()
    plain, tiles = torch.full_like(q, float("nan")), []
    KERNELS.paged_attention(q, k_cache, v_cache, plain, rows, scale, None)
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            tiles.append(torch.full_like(q, float("nan")))
            KERNELS.paged_attention(q, k_cache, v_cache, tiles[-1], rows, scale, None, bf16_tiles=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(tiles[0], tiles[1])
    changed = {r for r in range(len(positions)) if not torch.equal(tiles[0][r], plain[r])}
    assert changed == rows_in_runs(rows) and len(changed) == 14
    expected = sdpa_reference(q, k_cache.float(), v_cache.float(), table, specs, scale, None)
    for r in changed:
        assert (tiles[0][r] - expected[r]).norm() / expected[r].norm() < 1e-2
    torch.testing.assert_close(tiles[0], expected, atol=3e-2, rtol=3e-2)


@needs_amx_bf16
def test_bf16_tiles_read_an_fp8_cache_with_its_scale_and_leave_a_sliding_window_to_the_float_kernel():
    """An fp8 cache's shared pages go on the tiles too, with its kv_scale, within bf16's error of SDPA over the
    dequantized pages; with a sliding window nothing is shared: the float kernel's numbers, bit for bit."""
    (q, k_cache, v_cache, table, seq_of_row, positions), specs = shared_prompt_case(16, 3, 9, 64, 6, FP8)
    rows = cpu_decode.PagedRows(list(range(len(positions))), seq_of_row, positions, table)
    tiles = torch.empty_like(q)
    KERNELS.paged_attention(q, k_cache, v_cache, tiles, rows, 0.125, None, kv_scale=0.5, bf16_tiles=True)
    expected = sdpa_reference(q, k_cache.float() * 0.5, v_cache.float() * 0.5, table, specs, 0.125, None)
    assert (tiles - expected).norm() / expected.norm() < 1e-2
    (q, k_cache, v_cache, table, seq_of_row, positions), _ = shared_prompt_case(16, 3, 9, 64, 6, torch.float16)
    rows = cpu_decode.PagedRows(list(range(len(positions))), seq_of_row, positions, table)
    plain, tiles = torch.empty_like(q), torch.empty_like(q)
    KERNELS.paged_attention(q, k_cache, v_cache, plain, rows, 0.125, 9)
    KERNELS.paged_attention(q, k_cache, v_cache, tiles, rows, 0.125, 9, bf16_tiles=True)
    assert torch.equal(plain, tiles)
