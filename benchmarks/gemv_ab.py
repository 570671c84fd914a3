"""Two versions of banyan's integer matmul kernel (banyan/kernels/cpu_gemv.c) side by side in one process, over the
default model's matmuls: the numbers behind a change to it.

    git show HEAD:banyan/kernels/cpu_gemv.c > /tmp/before.c
    python benchmarks/gemv_ab.py /tmp/before.c banyan/kernels/cpu_gemv.c [--rows 1,6,16,64] [--threads 2] [--rounds 5]

Each file is compiled (with this tree's cpu_attention.c; cc, the flags banyan builds with on this CPU: see paged_attention_ab.build) into its
own library and bound with `cpu_gemv.CpuKernels`, so both must have this tree's int4_gemv/int8_gemv signatures. A
pass is the default model's 121 matmuls of one forward at that many rows of x: 30 layers of int4 (group 32) q/k/v
(960 x 576), o (576 x 576), gate/up (3,072 x 576) and down (576 x 1,536), then the int8 lm_head (49,152 x 576), each
its own random weights (so they come from memory, as a model's do; int4 scales exact in float16 and held in float16 as
a model holds them, unless --scales says float32 for A or B: a kernel from before 2026-12-07 on an AMX CPU read them
so). A then B, alternating, `--rounds` times; prints
the medians, A/B (above 1: B faster) and the largest difference of their outputs (0 where B keeps A's bits).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from banyan.kernels import cpu_gemv

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS, GROUP = 576, 1536, 192, 49152, 30, 32
SHAPES = ((HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))


def build(source: str, out: Path, isa: str) -> cpu_gemv.CpuKernels:
    attention = str(Path(cpu_gemv.__file__).with_name("cpu_attention.c"))  # CpuKernels binds its attend_rows too
    subprocess.run(["cc", *cpu_gemv.FLAGS, *cpu_gemv.ISA_FLAGS[isa], source, attention, "-o", str(out), "-lm"],
                   check=True)
    return cpu_gemv.CpuKernels(ctypes.CDLL(str(out)), isa)


def random_int4(n: int, k: int, gen: torch.Generator, half_scales: bool) -> cpu_gemv.InterleavedInt4:
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // GROUP, generator=gen) * 0.02).half().float()  # exact in float16, as a GGUF file's
    return cpu_gemv.interleave_int4(packed, scale, -8 * scale, GROUP, half_scales=half_scales)


def model_weights(half_scales: bool) -> tuple[list[cpu_gemv.InterleavedInt4], cpu_gemv.InterleavedInt8]:
    gen = torch.Generator().manual_seed(0)
    layers = [random_int4(n, k, gen, half_scales) for _ in range(LAYERS) for n, k in SHAPES]
    q = torch.randint(-127, 128, (VOCAB, HIDDEN), dtype=torch.int8, generator=gen)
    return layers, cpu_gemv.interleave_int8(q, torch.rand(VOCAB, generator=gen) * 0.01)


def one_pass(lib: cpu_gemv.CpuKernels, layers, lm_head, xs: dict[int, torch.Tensor], keep: bool) -> list[torch.Tensor]:
    """keep: every output (the first round's, compared); else each dropped at once, as a forward drops them."""
    outs = [lib.int4(xs[w.in_features], w) for w in layers] if keep else [lib.int4(xs[w.in_features], w)[:0] for w in layers]
    return outs + [lib.int8(xs[HIDDEN], lm_head)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--rows", default="1,2,6,8,16,32,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scales", default="half,half",
                        help="A's and B's int4 scales: half (float16, as a model holds them) or float32")
    parser.add_argument("--isa", choices=tuple(cpu_gemv.ISA_FLAGS), default=cpu_gemv.builds_for_this_cpu()[0],
                        help="the build to compare (default: this CPU's best; avx2 measures the fallback)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = [model_weights({"half": True, "float32": False}[kind]) for kind in args.scales.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(args.a, Path(tmp) / "a.so", args.isa), build(args.b, Path(tmp) / "b.so", args.isa)]
        print(f"{args.threads} threads, {args.rounds} rounds, {len(weights[0][0]) + 1} matmuls a pass, "
              f"isa {libs[0].isa} (tiles {libs[0].tiles}); A = {args.a}, B = {args.b}, int4 scales {args.scales}")
        for rows in map(int, args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for k in (HIDDEN, INTERMEDIATE)}
            times, outputs = [[], []], []
            for round_ in range(args.rounds):
                for i, lib in enumerate(libs):
                    start = time.perf_counter()
                    out = one_pass(lib, *weights[i], xs, keep=round_ == 0)
                    times[i].append(time.perf_counter() - start)
                    if round_ == 0:
                        outputs.append(out)
            a, b = statistics.median(times[0]), statistics.median(times[1])
            diff = max((x - y).abs().max().item() for x, y in zip(*outputs))
            print(f"{rows:3d} rows  A {a * 1e3:7.2f} ms  B {b * 1e3:7.2f} ms  A/B {a / b:.2f}  max |A - B| {diff:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
