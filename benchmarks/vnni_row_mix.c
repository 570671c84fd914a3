/* What the float steps of a VNNI int4 tile cost beside its products, in cycles, one core: the ceiling of
 * banyan/kernels/cpu_gemv.c's int4_tile16 with its weights in cache, and what another formulation would gain.
 *
 *     cc -O2 -mavx512f -mavx512vnni -mavx512vl benchmarks/vnni_row_mix.c -o /tmp/vnni_row_mix && /tmp/vnni_row_mix
 *
 * int4_tile16 spends, per row of x and block of 32 inputs (16 weight rows), 8 `vpdpbusd` (x's four bytes broadcast
 * from memory) and then: `vpaddd` (its two chains), `vcvtdq2ps`, a broadcast of x's block scale, `vmulps` (the weight
 * rows' group scales times it) and `vfmadd231ps` into the row's sums; the nibbles' unpacking is shared by the tile's
 * rows. Each line below times a loop of 8 independent `vpdpbusd` with one such mix added (independent registers, so
 * only the execution ports limit it), in cycles an iteration (the clock from a chain of dependent adds).
 * The first line is the products alone; the line with the whole mix is what a row and block cannot go below; the
 * last ones are formulations the kernel does not use: one scale for x's whole row (the `vmulps` goes; activations
 * would be rounded per token, not per block of 32, which changes every result and its accuracy). */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#include "bench_clock.h"

#define N 50000000L
#define PRODUCTS                                                                                                    \
    "vpdpbusd %[x]%{1to16%}, %%zmm20, %%zmm0\n vpdpbusd %[x]%{1to16%}, %%zmm20, %%zmm1\n"                          \
    "vpdpbusd %[x]%{1to16%}, %%zmm20, %%zmm2\n vpdpbusd %[x]%{1to16%}, %%zmm20, %%zmm3\n"                          \
    "vpdpbusd %[x]%{1to16%}, %%zmm20, %%zmm4\n vpdpbusd %[x]%{1to16%}, %%zmm20, %%zmm5\n"                          \
    "vpdpbusd %[x]%{1to16%}, %%zmm20, %%zmm6\n vpdpbusd %[x]%{1to16%}, %%zmm20, %%zmm7\n"
#define MIX(LABEL, EXTRA)                                                                                           \
    {                                                                                                               \
        const double start = now();                                                                                 \
        for (long i = 0; i < N / 10; i++)                                                                           \
            __asm__ volatile(PRODUCTS EXTRA : : [x] "m"(x), [f] "m"(f)                                              \
                             : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",      \
                               "xmm10", "xmm11", "xmm12");                                                          \
        printf("%-58s %5.2f cycles\n", LABEL, (now() - start) * hz / (N / 10));                                     \
    }

int main(void) {
    const double hz = clock_hz();
    printf("clock %.2f GHz; a loop of 8 512-bit vpdpbusd and:\n", hz / 1e9);
    int x = 0x01020304;
    float f = 1.5f;
    MIX("nothing (the products alone)", "")
    MIX("vmulps", "vmulps %%zmm21, %%zmm22, %%zmm8\n")
    MIX("vfmadd231ps", "vfmadd231ps %%zmm21, %%zmm22, %%zmm9\n")
    MIX("vcvtdq2ps", "vcvtdq2ps %%zmm21, %%zmm8\n")
    MIX("vpaddd", "vpaddd %%zmm21, %%zmm22, %%zmm8\n")
    MIX("the nibbles' unpacking of a block (2 vpandd, vpsrlw)",
        "vpandd %%zmm21, %%zmm22, %%zmm8\n vpsrlw $4, %%zmm21, %%zmm10\n vpandd %%zmm21, %%zmm22, %%zmm11\n")
    MIX("int4_tile16's row: vpaddd, vcvtdq2ps, broadcast, vmulps, vfmadd",
        "vpaddd %%zmm21, %%zmm22, %%zmm10\n vcvtdq2ps %%zmm21, %%zmm8\n vbroadcastss %[f], %%zmm12\n"
        "vmulps %%zmm21, %%zmm22, %%zmm11\n vfmadd231ps %%zmm21, %%zmm22, %%zmm9\n")
    MIX("one scale a row of x: vpaddd, vcvtdq2ps, vfmadd",
        "vpaddd %%zmm21, %%zmm22, %%zmm10\n vcvtdq2ps %%zmm21, %%zmm8\n vfmadd231ps %%zmm21, %%zmm22, %%zmm9\n")
    MIX("the same with one chain of products: vcvtdq2ps, vfmadd",
        "vcvtdq2ps %%zmm21, %%zmm8\n vfmadd231ps %%zmm21, %%zmm22, %%zmm9\n")
    return 0;
}
