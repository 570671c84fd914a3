"""Matmuls over 4- and 8-bit weights on AVX2 CPUs (the C source beside this file).

torch 2.13's packed int4/int8 CPU kernels are vectorized for AVX-512 only; on AVX2 they run scalar
loops, and dequantizing a block of rows before each matmul costs more than the bytes it saves. These
kernels keep the weights compact in memory and take integer dot products against x rounded to int8
per block of 32, which is what a decode step (a few rows of activations, every weight read once) needs.

The same library holds a fixed-order causal attention (cpu_attention.c) for batch-invariant mode, where
every row of every matmul goes through these kernels: a row's result here is independent of the other
rows (tests/unit/test_quantization.py), unlike torch's float GEMMs and SDPA, whose blocking follows M.

The library is compiled on first use with the system C compiler (`cc -O3 -mavx2 -mfma -mf16c -fopenmp`, about
a second; with `-mavx512vnni` and its companions too where /proc/cpuinfo lists avx512_vnni, so the integer dot
products are `vpdpbusd`, giving the same integers; and `-mamx-tile -mamx-int8` where it lists amx_int8, so calls of
32 rows and more multiply 16 x 16 blocks in AMX tiles, the same integers again) into ~/.cache/banyan/kernels (or $BANYAN_CACHE_DIR/kernels),
named by a hash of the sources and flags, and loaded with ctypes; its OpenMP calls run on the libgomp torch has
already loaded.
Without a compiler, or on a CPU without AVX2, `load()` returns None and callers dequantize instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from banyan.kernels.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_gemv.c", "cpu_attention.c", "cpu_decode.c",
                                                         "cpu_decode_layers.c", "cpu_argmax.c"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
AVX512_VNNI = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
ISA_FLAGS = {"avx2": (), "avx512_vnni": AVX512_VNNI, "amx": (*AVX512_VNNI, "-mamx-tile", "-mamx-int8", "-mamx-bf16",
                                                        "-mavx512bf16")}


class CpuKernels:
    """The loaded library: y = x W^T with W 4-bit blocked or 8-bit per row, both 8 rows interleaved (any number of
    rows; callers that hold a float16 copy send it at most `max_rows`), and causal attention in a fixed order."""

    def __init__(self, lib: ctypes.CDLL, isa: str = "avx2"):
        p, i = ctypes.c_void_p, ctypes.c_int
        self.isa = isa  # the ISA the library was built for: a key of ISA_FLAGS
        self.vnni = isa in ("avx512_vnni", "amx")  # vpdpbusd for the integer dot products
        lib.int4_gemv.argtypes = [p, p, p, p, p, i, p, i, i, i, i, i]
        lib.int8_gemv.argtypes = [p, p, p, p, p, i, i, i, i]
        lib.float_gemv.argtypes = [p, p, i, p, i, i, i, i]
        lib.attend_rows.argtypes = [p, p, p, p, p, p, i, i, i, i, i, i, ctypes.c_float, i]
        lib.int4_gemv.restype = lib.int8_gemv.restype = lib.float_gemv.restype = lib.attend_rows.restype = None
        self._lib = lib
        self.max_rows = lib.gemv_max_rows()
        lib.cpu_gemv_tiles.argtypes = [i]
        # AMX tiles for calls of 32 rows and more, unless turned off (the vector path's bits either way)
        self.tiles = bool(lib.cpu_gemv_tiles(int(self.amx_allowed)))

    @property
    def amx_allowed(self) -> bool:
        """This library was built for AMX and BANYAN_DISABLE_AMX is not 1: what every AMX path here asks first."""
        return self.isa == "amx" and os.environ.get("BANYAN_DISABLE_AMX") != "1"

    def use_tiles(self, on: bool) -> bool:
        """Turns the AMX tile path on or off for every call (each gives the vector path's bits: tests compare
        them); returns whether it is on, which needs an AMX build on a CPU and kernel that grant the tiles."""
        self.tiles = bool(self._lib.cpu_gemv_tiles(int(on and self.isa == "amx")))
        return self.tiles

    def int4(self, x: torch.Tensor, w: InterleavedInt4) -> torch.Tensor:
        """x [M, K] float32 contiguous; w in the kernel's layout (interleave_int4)."""
        m = x.shape[0]
        y, scratch = torch.empty(m, w.out_features, dtype=torch.float32), _scratch(m, w.in_features)  # held through the call
        self._lib.int4_gemv(x.data_ptr(), scratch.data_ptr(), w.packed.data_ptr(), w.scale.data_ptr(), w.offset.data_ptr(),
                            int(w.half), y.data_ptr(), m, w.out_features, w.in_features, w.group_size,
                            torch.get_num_threads())
        return y

    def int8(self, x: torch.Tensor, w: InterleavedInt8) -> torch.Tensor:
        """x [M, K] float32 contiguous; w in the kernel's layout (interleave_int8)."""
        m = x.shape[0]
        y, scratch = torch.empty(m, w.out_features, dtype=torch.float32), _scratch(m, w.in_features)  # held through the call
        self._lib.int8_gemv(x.data_ptr(), scratch.data_ptr(), w.packed.data_ptr(), w.scale.data_ptr(), y.data_ptr(),
                            m, w.out_features, w.in_features, torch.get_num_threads())
        return y


    def float(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous; w [N, K] float32 or float16 contiguous, K a multiple of 8."""
        m, k = x.shape
        y = torch.empty(m, w.shape[0], dtype=torch.float32)
        self._lib.float_gemv(x.data_ptr(), w.data_ptr(), int(w.dtype == torch.float16), y.data_ptr(), m, w.shape[0], k,
                             torch.get_num_threads())
        return y

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """q [S, Q, H, D], k and v [S, C, KVH, D] float32, mask [S, Q, C] bool (the positions each row sees):
        softmax(q k^T * scale) v per row and head in position order (see cpu_attention.c)."""
        q, k, v, mask = q.contiguous(), k.contiguous(), v.contiguous(), mask.contiguous()
        (s, rows, heads, dim), (ctx, kv_heads) = q.shape, k.shape[1:3]
        out, threads = torch.empty_like(q), torch.get_num_threads()
        scratch = torch.empty(threads * ctx, dtype=torch.float32)
        self._lib.attend_rows(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                              s, rows, ctx, heads, kv_heads, dim, scale, threads)
        return out


class InterleavedInt4(NamedTuple):
    """A 4-bit weight w[n, k] = scale[n, g] * q[n, k] + offset[n, g] (g = k // group_size) in int4_gemv's layout
    (cpu_gemv.c): 8 rows interleaved a block of 32 at a time, padded to a multiple of 8 rows with zeros."""

    packed: torch.Tensor  # [ceil(N / 8), K / 32 * 128] uint8
    scale: torch.Tensor  # [ceil(N / 8), groups, 8] float16 where it and offset are exact in it, else float32
    offset: torch.Tensor  # [ceil(N / 8), groups, 8], scale's dtype
    out_features: int
    in_features: int
    group_size: int

    @property
    def half(self) -> bool:
        """Scales and offsets held as float16 (the same values in a sixth fewer bytes of weight to read)."""
        return self.scale.dtype == torch.float16

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.offset))


def interleave_int4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int,
                    half_scales: bool = True) -> InterleavedInt4:
    """The kernel's layout of a weight packed in blocks of 32 (bytes 16b .. 16b + 15 of row n hold q[n, 32b + j] in the
    low nibble and q[n, 32b + 16 + j] in the high one, QuantizedLinear's layout), scale and offset [N, groups].
    half_scales: hold scale and offset as float16 where every value of both is exact in it (GGUF's and AWQ/GPTQ's
    scales are float16 to begin with), so that the kernel reads the same floats from fewer bytes."""
    n, half_k = packed.shape
    blocks, rows8 = half_k // 16, -(-n // 8)
    nibbles = packed.view(n, blocks, 16)
    q = torch.zeros(rows8 * 8, blocks, 32, dtype=torch.uint8)
    q[:n] = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # [N, blocks, 32] in k order
    # byte 32t + 4r + j of block b of row group G: q[8G + r, 32b + 8t + j] | q[8G + r, 32b + 8t + 4 + j] << 4
    q = q.view(rows8, 8, blocks, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)  # [G, b, t, r, low/high, j]
    interleaved = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(rows8, blocks * 128).contiguous()

    dtype = torch.float16 if half_scales and exact_in_half(scale) and exact_in_half(offset) else torch.float32

    def by_row_group(t: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(rows8 * 8, t.shape[1], dtype=dtype)
        padded[:n] = t
        return padded.view(rows8, 8, -1).transpose(1, 2).contiguous()  # [G, groups, 8]

    return InterleavedInt4(interleaved, by_row_group(scale), by_row_group(offset), n, half_k * 2, group_size)


def exact_in_half(t: torch.Tensor) -> bool:
    """Every value of t the same after a round trip through float16 (so finite, and no rounding)."""
    return bool(torch.equal(t.to(torch.float16).to(t.dtype), t))


class InterleavedInt8(NamedTuple):
    """An 8-bit weight w[n, k] = scale[n] * q[n, k] in int8_gemv's layout (cpu_gemv.c): 8 rows interleaved a block of
    32 at a time, each byte q + 128, padded to a multiple of 8 rows (q 0, scale 0)."""

    packed: torch.Tensor  # [ceil(N / 8), K / 32, 8 chunks, 8 rows, 4] uint8
    scale: torch.Tensor  # [ceil(N / 8) * 8] float32
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale))

    def rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [len(ids), K] int8, scale [len(ids)]) of the given rows, read back from the layout (embeddings)."""
        picked = self.packed[ids // 8, :, :, ids % 8]  # [T, blocks, chunks, 4]: row order k = 32b + 4c + j
        return (picked.reshape(len(ids), self.in_features) ^ 0x80).view(torch.int8), self.scale[ids]


def interleave_int8(q: torch.Tensor, scale: torch.Tensor) -> InterleavedInt8:
    """The kernel's layout of q [N, K] int8 (K a multiple of 32) and its row scales [N]."""
    n, k = q.shape
    rows8 = -(-n // 8)
    flipped = torch.full((rows8 * 8, k), 0x80, dtype=torch.uint8)
    flipped[:n] = q.view(torch.uint8) ^ 0x80  # q + 128 as an unsigned byte
    # byte 32c + 4r + j of block b of row group G: q[8G + r, 32b + 4c + j] + 128
    packed = flipped.view(rows8, 8, k // 32, 8, 4).permute(0, 2, 3, 1, 4).contiguous()  # [G, b, c, r, j]
    padded = torch.zeros(rows8 * 8, dtype=torch.float32)
    padded[:n] = scale
    return InterleavedInt8(packed, padded, n, k)


def _scratch(m: int, k: int) -> torch.Tensor:
    """Room for x as int8 blocks: m*k bytes, and a scale and a sum per block of 32 (see cpu_gemv.c)."""
    return torch.empty(m * k + 8 * m * (k // 32), dtype=torch.uint8)


def vector_cpu() -> bool:
    """Whether torch reports AVX2 or AVX-512 here: the x86 vector ISAs this library is built for, and the ones the
    defaults that rest on it (its kernels, batch invariance) were measured on."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def supported(weight_device: torch.device, dtype: torch.dtype, in_features: int) -> bool:
    """Whether these kernels can serve a layer: float32 on an AVX2 (or newer) CPU, inputs in blocks of 32."""
    return (weight_device.type == "cpu" and dtype == torch.float32 and in_features % 32 == 0
            and vector_cpu() and load() is not None)


@functools.cache  # one compiled library per process, like torch's own extension cache
def load() -> CpuKernels | None:
    if os.environ.get("BANYAN_DISABLE_CPU_KERNELS") == "1":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("no C compiler (cc) found: 4/8-bit weights are dequantized per matmul, which is slower")
        return None
    for isa in builds_for_this_cpu():
        try:
            return CpuKernels(ctypes.CDLL(str(build(compiler, isa))), isa)
        except (OSError, subprocess.CalledProcessError) as e:  # an older compiler may not know the AVX-512 flags
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning("could not build the CPU kernels for %s (%s)", isa, detail.strip()[-500:])
    logger.warning("no CPU kernels: 4/8-bit weights are dequantized per matmul")
    return None


def builds_for_this_cpu() -> tuple[str, ...]:
    """The builds (keys of ISA_FLAGS) this CPU can run, best first: load() tries them in this order."""
    flags = cpu_flags()
    return ("amx",) * ("amx_int8" in flags) + ("avx512_vnni",) * ("avx512_vnni" in flags) + ("avx2",)


def build(compiler: str, isa: str) -> Path:
    """The library for `isa` (a key of ISA_FLAGS), compiled unless the cache has it; raises what the compiler
    raises."""
    flags = (*FLAGS, *ISA_FLAGS[isa])
    source = b"".join(path.read_bytes() for path in SOURCES)
    tag = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("BANYAN_CACHE_DIR", Path.home() / ".cache" / "banyan")) / "kernels"
    library = cache / f"cpu_gemv-{tag}.so"
    if not library.exists():
        _compile(compiler, cache, library, flags)
    return library


def _compile(compiler: str, cache: Path, library: Path, flags: tuple[str, ...]) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then renamed: processes may race
        out = Path(tmp) / library.name
        subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(out), "-lm"], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(out, library)
