"""Two versions of banyan's CPU attention kernel (banyan/kernels/cpu_decode.c) side by side in one process, at a long
context: the numbers behind a change to it.

    git show HEAD:banyan/kernels/cpu_decode.c > /tmp/before.c
    python benchmarks/paged_attention_ab.py /tmp/before.c banyan/kernels/cpu_decode.c [--threads 2] [--rounds 6]

Each file is compiled alone (cc, the flags banyan builds with on this CPU) into its own library and bound with
`cpu_decode.DecodeKernels`, so both must have this tree's `paged_attention` signature (for a kernel of an older
signature, measure both trees' benchmarks/paged_attention_ab.py with the same file twice instead). Every case is one decode step's
or one prefill chunk's attention through 30 layers, each layer its own K/V pages (as a model's are, so the pages come
from memory, not cache), with the default model's shape (9 query heads, 3 KV heads, head_dim 64, pages of 16):

    decode      8 sequences at 1,400 tokens, one new row each (float32, float16 and fp8 pages), 1 sequence, and
                64 sequences at 192 tokens (offline 64 x 128/128 halfway through its decode), 16 at 330 (16
                streams late in a 128/128 request's decode and beyond); 8 at 1,400 and 32 at 1,200 whose
                tables begin with the same 64 pages (a 1,024-token system prompt the prefix cache shares), and 8 at
                1,040 that are almost all that prompt (its tile alone)
    prefill     8 sequences, 128 new rows each after a 1,272-token prefix (a multi-turn conversation's next turn)
    mixed       prefill chunks of 64 rows beside decode rows, contexts of 467-1,400 tokens
    verify      a speculative verify pass's rows: 1, 2, 4 and 9 rows of one sequence at 800 tokens and 9 at 192
                (batch 1), and 16 sequences x 4 rows at 330
Each sequence's pages are consecutive, except in the cases marked scattered, whose pages lie in a random order
through the pool, as a server's are.

`--bf16-tiles A,B` (e.g. 0,1, with the same file twice) sets each side's bf16_tiles: decode rows sharing a prompt's
pages on AMX-BF16 tiles where the CPU has them (the default of an AMX CPU with batch invariance off).
`--only TEXT` runs the cases whose name contains it. A then B, alternating, `--rounds` times; prints the medians,
A/B (above 1: B faster), the median of the rounds' own A/B with its quartiles (pairs: steadier where the machine's
speed drifts, as a shared host's does), the largest difference of their outputs (0 where B keeps A's bits), and the K/V bytes the
case reads at least (bytes_read) with each one's rate, to set beside what the machine reads
(benchmarks/page_read_bandwidth.c).
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

from banyan.kernels import cpu_decode, cpu_gemv

PAGE, KV_HEADS, HEAD_DIM, HEADS, LAYERS = 16, 3, 64, 9, 30


def build(source: str, out: Path) -> cpu_decode.DecodeKernels:
    """Compiled as banyan compiles it on this CPU (cpu_gemv.load's choice: the AMX build where the CPU has AMX, the
    AVX-512 flags where it has VNNI: 32 vector registers)."""
    isa = cpu_gemv.builds_for_this_cpu()[0]
    # cpu_gemv.c beside it: the AMX paths ask it whether Linux grants the tiles (amx_tiles_granted)
    gemv = str(cpu_gemv.SOURCES[0])
    subprocess.run(["cc", *cpu_gemv.FLAGS, *cpu_gemv.ISA_FLAGS[isa], source, gemv, "-o", str(out), "-lm"], check=True)
    return cpu_decode.DecodeKernels(ctypes.CDLL(str(out)), amx_bf16=cpu_decode.kernels_for(torch.device("cpu"), torch.float32).amx_bf16)


def case(seqs: int, context: int, new_rows: int, dtype: torch.dtype, mixed: bool = False, scattered: bool = False,
         shared: int = 0):
    """(q, out, rows, [(k, v)] per layer): every sequence's pages its own, rows in sequence order; scattered: the
    pages in a random order, as a pool hands them out to sequences growing side by side (else each sequence's are
    consecutive); shared: tokens of a prompt whose pages begin every table (the prefix cache's pages of a system
    prompt: the first sequence's)."""
    pages_each = -(-context // PAGE)
    num_pages = seqs * pages_each + 1
    order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(0)) if scattered else torch.arange(num_pages - 1)
    tables = (order + 1).view(seqs, pages_each).int()
    tables[:, : shared // PAGE] = tables[0, : shared // PAGE]
    rows, seq_of_row, positions = [], [], []
    for s in range(seqs):
        n = new_rows if not mixed or s % 2 == 0 else 1
        ctx = context if not mixed else context // (1 + s % 3)
        rows += range(len(rows), len(rows) + n)
        seq_of_row += [s] * n
        positions += range(ctx - n, ctx)
    q = torch.randn(len(rows), HEADS, HEAD_DIM)
    layers = [(torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM).to(dtype),
               torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM).to(dtype)) for _ in range(LAYERS)]
    return q, torch.empty_like(q), cpu_decode.PagedRows(rows, seq_of_row, positions, tables), layers


F16_SCATTERED = dict(dtype=torch.float16, scattered=True)
CASES = {  # case()'s arguments
    "decode 8 x 1,400, float32": dict(seqs=8, context=1400, new_rows=1, dtype=torch.float32),
    "decode 8 x 1,400, float16": dict(seqs=8, context=1400, new_rows=1, dtype=torch.float16),
    "decode 8 x 1,400, fp8": dict(seqs=8, context=1400, new_rows=1, dtype=torch.float8_e4m3fn),
    "decode 1 x 1,400, float32": dict(seqs=1, context=1400, new_rows=1, dtype=torch.float32),
    "decode 64 x 192, float16": dict(seqs=64, context=192, new_rows=1, dtype=torch.float16),
    "decode 16 x 330, float16": dict(seqs=16, context=330, new_rows=1, dtype=torch.float16),
    "decode 16 x 330, float16, scattered": dict(seqs=16, context=330, new_rows=1, **F16_SCATTERED),
    "decode 8 x 1,400, float16, scattered": dict(seqs=8, context=1400, new_rows=1, **F16_SCATTERED),
    "decode 8 x 1,400 sharing 1,024, float16, scattered": dict(seqs=8, context=1400, new_rows=1, **F16_SCATTERED,
                                                               shared=1024),
    "decode 32 x 1,200 sharing 1,024, float16, scattered": dict(seqs=32, context=1200, new_rows=1, **F16_SCATTERED,
                                                                shared=1024),
    "decode 8 x 1,040 sharing 1,024, float16, scattered": dict(seqs=8, context=1040, new_rows=1, **F16_SCATTERED,
                                                               shared=1024),
    "prefill 8 x 128 at 1,400, float32": dict(seqs=8, context=1400, new_rows=128, dtype=torch.float32),
    "prefill 8 x 128 at 1,400, float16": dict(seqs=8, context=1400, new_rows=128, dtype=torch.float16),
    "prefill 8 x 128 at 1,400, fp8": dict(seqs=8, context=1400, new_rows=128, dtype=torch.float8_e4m3fn),
    "prefill 8 x 128 at 1,400, float16, scattered": dict(seqs=8, context=1400, new_rows=128, **F16_SCATTERED),
    "mixed, float32": dict(seqs=8, context=1400, new_rows=64, dtype=torch.float32, mixed=True),
    "verify 1 x 1 at 800, float16": dict(seqs=1, context=800, new_rows=1, dtype=torch.float16),
    "verify 1 x 2 at 800, float16": dict(seqs=1, context=800, new_rows=2, dtype=torch.float16),
    "verify 1 x 4 at 800, float16": dict(seqs=1, context=800, new_rows=4, dtype=torch.float16),
    "verify 1 x 9 at 192, float16": dict(seqs=1, context=192, new_rows=9, dtype=torch.float16),
    "verify 1 x 9 at 800, float16": dict(seqs=1, context=800, new_rows=9, dtype=torch.float16),
    "verify 16 x 4 at 330, float16, scattered": dict(seqs=16, context=330, new_rows=4, **F16_SCATTERED),
}


def bytes_read(seqs: int, context: int, dtype: torch.dtype, shared: int = 0, mixed: bool = False, **_) -> int:
    """K and V bytes a case's 30 layers read once each: every sequence's keys, a shared prompt's pages counted once
    (what decode attention cannot do with less than; a prefill case reads them once a tile, so its GB/s is a lower
    bound)."""
    keys = sum(context // (1 + s % 3) if mixed else context for s in range(seqs)) - shared * max(seqs - 1, 0)
    return 2 * LAYERS * keys * KV_HEADS * HEAD_DIM * dtype.itemsize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--only", default="", help="the cases whose name contains this (default: all)")
    parser.add_argument("--bf16-tiles", default="0,0", help="A's and B's paged_attention bf16_tiles (1: shared prompts "
                        "on AMX-BF16 tiles where the CPU has them), e.g. 0,1 with the same file twice")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tiles = [flag.strip() == "1" for flag in args.bf16_tiles.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        kernels = [build(args.a, Path(tmp) / "a.so"), build(args.b, Path(tmp) / "b.so")]
        print(f"{args.threads} threads, {args.rounds} rounds, {LAYERS} layers a case; A = {args.a}, B = {args.b}")
        for name, spec in CASES.items():
            if args.only not in name:
                continue
            q, out, rows, layers = case(**spec)
            times, outputs = [[], []], []
            for round_ in range(args.rounds):
                for i, lib in enumerate(kernels):
                    start = time.perf_counter()
                    for k, v in layers:
                        lib.paged_attention(q, k, v, out, rows, HEAD_DIM**-0.5, None, bf16_tiles=tiles[i])
                    times[i].append(time.perf_counter() - start)
                    if round_ == 0:
                        outputs.append(out.clone())
            a, b = statistics.median(times[0]), statistics.median(times[1])
            pairs = sorted(x / y for x, y in zip(*times))  # each round's A/B: a noisy machine moves both of a pair
            gb = bytes_read(**spec) / 1e9
            print(f"{name:36s} A {a * 1e3:8.1f} ms  B {b * 1e3:8.1f} ms  A/B {a / b:.2f}  "
                  f"pairs {statistics.median(pairs):.3f} [{pairs[len(pairs) // 4]:.3f}-{pairs[3 * len(pairs) // 4]:.3f}]  "
                  f"max |A - B| {(outputs[0] - outputs[1]).abs().max().item():.1e}  "
                  f"K/V read {gb * 1e3:.0f} MB: A {gb / a:.1f}, B {gb / b:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
