"""banyan's integer CPU kernels (banyan/kernels/cpu_gemv.c) as a specification: y = x W^T with x rounded to int8
per block of 32 and W's exact 4- or 8-bit values, equal to that product computed in float64 up to float32
accumulation; every row's bits independent of the rows beside it; the AVX-512 VNNI build the same integers."""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from banyan.kernels import cpu_features, cpu_gemv
from banyan.quantization.formats import INT8, WeightFormat
from banyan.quantization.linear import QuantizedLinear

pytestmark = pytest.mark.skipif(cpu_gemv.load() is None or not cpu_gemv.vector_cpu(),
                                reason="banyan's CPU kernels need an x86 CPU with AVX2 and a C compiler")

# M: one row, a tile of four, tails of 1-3 rows, more than one tile of weight rows; N: odd counts leave a weight
# row without its tile partner, and counts that are not a multiple of 8 pad int4's last row group; K: one block,
# a few, the default model's 576 and 1536.
SHAPES = [(1, 1, 32), (3, 7, 96), (4, 2, 64), (5, 33, 160), (8, 16, 576), (13, 9, 1536), (64, 31, 256),
          (150, 12, 1536)]  # 150 rows of 1536: more than one pass over the weights (PASS_BYTES of x each)


def round_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel multiplies it: per block of 32, d = max|x| / 127, q = round(x / d) (ties to even), x = d q,
    in float32 as the kernel computes it."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).view_as(x)


def int4_weight(n: int, k: int, group: int, seed: int = 0, half: bool = False):
    """Random 4-bit values q in [0, 15] with a scale and an offset per group; packed in blocks of 32 (see
    cpu_gemv.c): byte j of block b holds q[32b + j] and q[32b + 16 + j]. half: scales and offsets exact in float16,
    as GGUF's and AWQ/GPTQ's are (the layout then holds them as float16)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    offset = torch.randn(n, k // group, generator=g) * 0.05
    if half:
        scale, offset = scale.half().float(), offset.half().float()
    halves = q.view(n, -1, 2, 16)
    packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, -1).contiguous()
    return q, scale, offset, packed


def interleaved(weight, group: int) -> cpu_gemv.InterleavedInt4:
    """int4_weight's packed blocks, scale and offset in the kernel's layout."""
    _, scale, offset, packed = weight
    return cpu_gemv.interleave_int4(packed, scale, offset, group)


def int4_reference(x: torch.Tensor, q, scale, offset, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scaled values times x rounded, plus each group's offset times the sum of the rounded x over the group
    (w x~ for w = s q + o), in float64; and the same sum over the terms' magnitudes."""
    m, k = x.shape
    scaled = (q.double().view(q.shape[0], -1, group) * scale.double()[:, :, None]).view(q.shape[0], k)
    rounded = round_x(x).double()
    sums = rounded.view(m, -1, group).sum(-1)
    want = rounded @ scaled.T + sums @ offset.double().T
    return want, rounded.abs() @ scaled.abs().T + sums.abs() @ offset.double().abs().T


def assert_close(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    """Equal up to float32 accumulation: a few float32 roundings (6e-8 each) of the terms' magnitudes."""
    error = ((got.double() - want).abs() / magnitude.clamp(min=1e-30)).max()
    assert error < 1e-6, f"{error:.2e}"


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("half", [False, True], ids=["float32-scales", "float16-scales"])
def test_int4_kernel_is_the_rounded_product(m, n, k, group, half):
    if k % group:
        pytest.skip("K is not a multiple of the group")
    q, scale, offset, packed = int4_weight(n, k, group, half=half)
    x = torch.randn(m, k) * 3
    weight = interleaved((q, scale, offset, packed), group)
    assert weight.half == half
    assert_close(cpu_gemv.load().int4(x, weight), *int4_reference(x, q, scale, offset, group))


@pytest.mark.parametrize("group", [32, 128])
def test_scales_exact_in_float16_are_held_as_float16_with_the_same_bits(group):
    """Scales and offsets that float16 holds exactly are kept in it (a sixth fewer bytes of weight to read); the
    kernel widens them to the same floats, so every row count (one tile, tails, paired row groups, several passes)
    and thread count gives the bits of the same weight held in float32."""
    kernels, threads = cpu_gemv.load(), torch.get_num_threads()
    _, scale, offset, packed = int4_weight(41, 1536, group, half=True)
    half = cpu_gemv.interleave_int4(packed, scale, offset, group)
    full = cpu_gemv.interleave_int4(packed, scale, offset, group, half_scales=False)
    assert half.half and half.scale.dtype == half.offset.dtype == torch.float16 and not full.half
    assert half.nbytes() < full.nbytes()
    try:
        for num_threads, rows in itertools.product((1, 2, 3), (1, 2, 5, 6, 8, 16, 37, 150)):
            torch.set_num_threads(num_threads)
            x = torch.randn(rows, 1536)
            assert torch.equal(kernels.int4(x, half), kernels.int4(x, full)), (num_threads, rows)
    finally:
        torch.set_num_threads(threads)


def test_a_thread_taken_off_its_core_leaves_no_mark_on_the_bits():
    """Each thread multiplies its own weight rows first, then what the others have not begun, so a thread the OS
    takes off its core no longer holds up the call. With more threads than cores, where that happens all the time,
    every row count (one row, a split pair, several tiles, two passes over x) gives one thread's bits, call after
    call, for int4 and int8 weights alike."""
    kernels, before = cpu_gemv.load(), torch.get_num_threads()
    _, scale, offset, packed = int4_weight(1000, 576, 32, half=True)
    weight, weight8 = cpu_gemv.interleave_int4(packed, scale, offset, 32), int8_weight(1000, 576)[2]
    try:
        for rows in (1, 6, 16, 200):
            x = torch.randn(rows, 576)
            torch.set_num_threads(1)
            want = kernels.int4(x, weight), kernels.int8(x, weight8)
            torch.set_num_threads(7)
            for _ in range(10):
                got = kernels.int4(x, weight), kernels.int8(x, weight8)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), rows
    finally:
        torch.set_num_threads(before)


def test_scales_float16_cannot_hold_stay_float32():
    """One scale that float16 would round, or an offset past its range, keeps the whole weight's in float32."""
    _, scale, offset, packed = int4_weight(16, 64, 32, half=True)
    rounded, huge = scale.clone(), offset.clone()
    rounded[3, 1] += 1e-7
    huge[0, 0] = 1e5
    assert not cpu_gemv.interleave_int4(packed, rounded, offset, 32).half
    assert not cpu_gemv.interleave_int4(packed, scale, huge, 32).half
    assert cpu_gemv.interleave_int4(packed, scale, offset, 32).half


def int8_weight(n: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, cpu_gemv.InterleavedInt8]:
    """Random int8 values over the whole range (-128 too: compressed-tensors checkpoints hold it) and row scales, and
    both in the kernel's layout."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    q[0, :32] = -128  # a block of the value whose magnitude int8 cannot hold
    scale = torch.rand(n, generator=g) * 0.01
    return q, scale, cpu_gemv.interleave_int8(q, scale)


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_int8_kernel_is_the_rounded_product(m, n, k):
    q, scale, weight = int8_weight(n, k)
    x = torch.randn(m, k) * 3
    rounded = round_x(x).double()
    want, magnitude = (rounded @ q.double().T) * scale.double(), (rounded.abs() @ q.double().abs().T) * scale.double()
    assert_close(cpu_gemv.load().int8(x, weight), want, magnitude)


def test_the_int8_layout_gives_back_its_rows():
    """Tied embeddings read lm_head's rows from the kernel's layout: the same values and scales, padding unseen."""
    q, scale, weight = int8_weight(13, 96)
    ids = torch.tensor([12, 0, 7, 8, 3, 12])
    rows, scales = weight.rows(ids)
    assert rows.dtype == torch.int8 and torch.equal(rows, q[ids]) and torch.equal(scales, scale[ids])


def test_a_row_has_its_bits_whatever_the_call():
    """Row r of a 37-row call equals the row alone, and inside calls of other sizes at other places: the tiles
    only decide which rows share a loaded block, never a row's own order of sums."""
    kernels = cpu_gemv.load()
    weight = interleaved(int4_weight(33, 576, 32), 32)
    weight8 = int8_weight(33, 576)[2]
    x = torch.randn(37, 576)
    for multiply in (lambda rows: kernels.int4(rows, weight), lambda rows: kernels.int8(rows, weight8)):
        whole = multiply(x)
        for r in range(37):
            assert torch.equal(multiply(x[r:r + 1]), whole[r:r + 1])
        for start, stop in [(1, 6), (10, 16), (5, 13), (30, 37)]:  # 5, 6, 8, 7 rows: one tile, split pairs, pairs
            assert torch.equal(multiply(x[start:stop].contiguous()), whole[start:stop])


def test_threads_do_not_change_the_bits():
    kernels, threads = cpu_gemv.load(), torch.get_num_threads()
    weight, weight8 = interleaved(int4_weight(65, 256, 32), 32), int8_weight(65, 256)[2]
    x = torch.randn(9, 256)
    try:
        torch.set_num_threads(1)
        one, one8 = kernels.int4(x, weight), kernels.int8(x, weight8)
        torch.set_num_threads(2)
        assert torch.equal(kernels.int4(x, weight), one) and torch.equal(kernels.int8(x, weight8), one8)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", [INT8, WeightFormat("int4", 32)])
def test_a_layer_without_a_float16_copy_sends_every_row_to_the_kernel(fmt):
    """Prefill-sized batches too: the kernel is faster than dequantizing at any width, and a row is then the
    same whether it is decoded alone or computed inside a prompt."""
    layer = QuantizedLinear(256, 24, fmt)
    layer.load_weight(slice(None), torch.randn(24, 256), "w")
    layer.packed_kernels = False  # torch's own packed kernels where the CPU has AVX-512
    layer.finish_loading()
    assert layer.gemv is not None and layer.wide is None
    x = torch.randn(40, 256)
    wide = layer(x)
    assert all(torch.equal(layer(x[r:r + 1]), wide[r:r + 1]) for r in range(40))


def test_the_avx512_vnni_build_compiles_and_agrees(monkeypatch, tmp_path):
    """The library built with -mavx512vnni (vpdpbusd for the dot products, int4 and int8 row groups paired in 512-bit
    vectors) compiles wherever the compiler knows the flags, and where the CPU has VNNI it gives the AVX2 build's
    bits: for a row group paired or alone (33 rows: 5 groups, the last of 1 row, split 5 / 3+2 / 2+2+1 between
    threads), and for x rounded by one thread or by all."""
    compiler = shutil.which("cc")
    monkeypatch.setenv("BANYAN_CACHE_DIR", str(tmp_path))
    try:
        library = cpu_gemv.build(compiler, "avx512_vnni")
    except subprocess.CalledProcessError as e:
        pytest.skip(f"the compiler does not build for AVX-512 VNNI: {e.stderr[-200:]}")
    assert library.exists()
    if "avx512_vnni" not in cpu_features.cpu_flags():
        return  # compiled only: its code cannot run here
    vnni = cpu_gemv.CpuKernels(ctypes.CDLL(str(library)), "avx512_vnni")
    avx2 = cpu_gemv.CpuKernels(ctypes.CDLL(str(cpu_gemv.build(compiler, "avx2"))), "avx2")
    weight, weight16 = interleaved(int4_weight(33, 576, 32), 32), interleaved(int4_weight(33, 576, 32, half=True), 32)
    weight8 = int8_weight(33, 576)[2]
    threads = torch.get_num_threads()
    try:
        for num_threads, rows in itertools.product((1, 2, 3), (1, 13)):
            torch.set_num_threads(num_threads)
            x = torch.randn(rows, 576)
            assert torch.equal(vnni.int4(x, weight), avx2.int4(x, weight)), (num_threads, rows)
            assert torch.equal(vnni.int4(x, weight16), avx2.int4(x, weight16)), (num_threads, rows)
            assert torch.equal(vnni.int8(x, weight8), avx2.int8(x, weight8)), (num_threads, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def with_and_without_tiles():
    """Runs a call with the AMX tile path off and on (the CPU, the kernel and the build must grant it)."""
    kernels = cpu_gemv.load()
    if not kernels.use_tiles(True):
        pytest.skip("no AMX tiles here (needs amx_int8 in /proc/cpuinfo, Linux 5.16+ and a compiler that knows them)")

    def both(call):
        kernels.use_tiles(False)
        try:
            vector = call()
        finally:
            kernels.use_tiles(True)
        return vector, call()

    return both


@pytest.mark.parametrize("m, n, k, group", [(32, 16, 32, 32), (33, 33, 576, 32), (64, 48, 1536, 64), (47, 17, 96, 32),
                                            (100, 40, 256, 128), (200, 24, 1536, 32)])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("half", [False, True])
def test_amx_tiles_give_the_vector_paths_bits(m, n, k, group, threads, half, with_and_without_tiles):
    """With AMX, in calls of 32 rows and more, 16 rows of x at a time against 16 weight rows go through one tile
    product a block; the remaining
    rows, a row group without its partner and N's ragged end through the vector path. Every row keeps the vector
    path's bits: odd block counts (the tiles alternate two sets), groups of 1, 2 and 4 blocks, passes over x of
    several tiles (1536 inputs, 200 rows), any thread split, and int4 scales held in float32 or float16."""
    q, scale, offset, packed = int4_weight(n, k, group, half=half)
    weight, weight8 = interleaved((q, scale, offset, packed), group), int8_weight(n, k)[2]
    assert weight.half == half
    x, kernels, before = torch.randn(m, k) * 3, cpu_gemv.load(), torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        vector, tiled = with_and_without_tiles(lambda: (kernels.int4(x, weight), kernels.int8(x, weight8)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(tiled[0], vector[0]) and torch.equal(tiled[1], vector[1])
    assert_close(tiled[0], *int4_reference(x, q, scale, offset, group))


def test_the_amx_build_compiles_wherever_the_compiler_knows_the_flags(monkeypatch, tmp_path):
    """The AMX build (the VNNI build plus the tile path) compiles on any machine whose compiler knows -mamx-int8, so a
    source error shows on every CI machine; where the CPU has AMX, load() picks it and the tiles are granted."""
    monkeypatch.setenv("BANYAN_CACHE_DIR", str(tmp_path))
    try:
        library = cpu_gemv.build(shutil.which("cc"), "amx")
    except subprocess.CalledProcessError as e:
        pytest.skip(f"the compiler does not build for AMX: {e.stderr[-200:]}")
    assert library.exists()
    if "amx_int8" in cpu_features.cpu_flags():
        kernels = cpu_gemv.load()
        assert kernels.isa == "amx" and kernels.vnni


@pytest.mark.parametrize("program", ["gemv_pass", "int4_tile_cycles"])
def test_the_c_benchmarks_of_the_matmuls_build_against_the_kernel(tmp_path, program):
    """benchmarks/gemv_pass.c and int4_tile_cycles.c include the kernel's source and call int4_gemv and int8_gemv, and
    int4_tile: a change of their signatures that they miss fails here, not the next time someone measures."""
    source = Path(__file__).parents[2] / "benchmarks" / f"{program}.c"
    flags = [f for f in cpu_gemv.FLAGS if f not in ("-shared", "-fPIC")]
    built = subprocess.run([shutil.which("cc"), *flags, "-Wall", "-Werror", str(source), "-o", str(tmp_path / program), "-lm"],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]


def test_the_port_mix_benchmark_builds(tmp_path):
    """benchmarks/vnni_row_mix.c (the int4 tile's float steps beside its products, in cycles) stands alone: it builds
    with the AVX-512 VNNI flags on any x86 compiler, whatever CPU runs the tests."""
    source = Path(__file__).parents[2] / "benchmarks" / "vnni_row_mix.c"
    built = subprocess.run([shutil.which("cc"), "-O2", *cpu_gemv.ISA_FLAGS["avx512_vnni"], "-Wall", "-Werror", str(source),
                            "-o", str(tmp_path / "vnni_row_mix")], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]


def test_the_amx_overlap_benchmark_builds(tmp_path):
    """benchmarks/amx_overlap.c (whether tile instructions run beside AVX-512 work, in cycles) stands alone: it builds
    with -Wall -Werror wherever the compiler knows the AMX flags, whatever CPU runs the tests."""
    source = Path(__file__).parents[2] / "benchmarks" / "amx_overlap.c"
    flags = ["-O2", "-mavx512f", "-mamx-tile", "-mamx-int8"]
    probe = subprocess.run([shutil.which("cc"), *flags, "-x", "c", "-c", "-", "-o", str(tmp_path / "probe.o")],
                           input="int main(void) { return 0; }", capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"the compiler does not know the AMX flags: {probe.stderr[-200:]}")
    built = subprocess.run([shutil.which("cc"), *flags, "-Wall", "-Werror", str(source), "-o",
                            str(tmp_path / "amx_overlap")], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
