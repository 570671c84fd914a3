/* The AVX2 int4 tile of banyan/kernels/cpu_gemv.c against this CPU's own ceiling, in cycles: how close the matmuls
 * are to what the vector units can do, with the weights in cache (no memory in the way).
 *
 *     cc -O3 -mavx2 -mfma -mf16c -fopenmp benchmarks/int4_tile_cycles.c -o /tmp/tile_cycles -lm && /tmp/tile_cycles
 *
 * Prints the clock (a chain of dependent adds, one a cycle), the throughput of vpmaddubsw and of vfmadd231ps (12
 * independent chains each), then int4_tile's cycles per block and row of x (a block: 32 inputs x 8 weight rows, 8
 * vpmaddubsw) for tiles of 1, 2, 4 and 6 rows over a 64 x 576 matrix that stays in L1/L2. A tile can do no better
 * than 8 vpmaddubsw at the measured rate; the rest of a block (the int16 sums, the widening, the scaling, the
 * broadcasts of x and the unpacking of the nibbles) is what it costs above that.
 *
 * Built with -mavx512f -mavx512bf16 as well, it also prints the 512-bit vfmadd231ps and vdpbf16ps rates: the ceiling a
 * bf16 attention would have over banyan's float32 one (vdpbf16ps: 32 products summed into 16 float32 lanes, 64 flops;
 * vfmadd231ps: 16 multiply-adds, 32 flops). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../banyan/kernels/cpu_gemv.c"
#include "bench_clock.h"

#define TWELVE(OP) OP " %12,%0,%0\n" OP " %12,%1,%1\n" OP " %12,%2,%2\n" OP " %12,%3,%3\n" OP " %12,%4,%4\n" \
    OP " %12,%5,%5\n" OP " %12,%6,%6\n" OP " %12,%7,%7\n" OP " %12,%8,%8\n" OP " %12,%9,%9\n" OP " %12,%10,%10\n" \
    OP " %12,%11,%11\n"

/* instructions a second of `op` in 12 independent chains */
#define RATE(OP, TYPE, INIT)                                                                                        \
    do {                                                                                                            \
        TYPE a0 = INIT, a1 = INIT, a2 = INIT, a3 = INIT, a4 = INIT, a5 = INIT, a6 = INIT, a7 = INIT, a8 = INIT,     \
             a9 = INIT, a10 = INIT, a11 = INIT, b = INIT;                                                           \
        const long n = 50000000;                                                                                    \
        const double start = now();                                                                                 \
        for (long i = 0; i < n; i++)                                                                                \
            __asm__ volatile(TWELVE(OP) : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6),      \
                             "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11) : "v"(b));                          \
        rate = n * 12.0 / (now() - start);                                                                          \
    } while (0)

int main(void) {
    const double hz = clock_hz();
    double rate;
    printf("clock %.2f GHz (dependent adds)\n", hz / 1e9);
    RATE("vpmaddubsw", __m256i, _mm256_set1_epi8(3));
    const double maddubs_per_cycle = rate / hz;
    printf("vpmaddubsw %.2f a cycle\n", maddubs_per_cycle);
    RATE("vfmadd231ps", __m256, _mm256_set1_ps(1.0f));
    printf("vfmadd231ps %.2f a cycle\n", rate / hz);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    RATE("vfmadd231ps", __m512, _mm512_set1_ps(1.0f));
    printf("vfmadd231ps zmm %.2f a cycle, %.1f GFLOP/s a core\n", rate / hz, rate * 32 / 1e9);
    RATE("vdpbf16ps", __m512, _mm512_set1_ps(1.0f));  /* bf16 pairs (1, 0): no denormals */
    printf("vdpbf16ps zmm %.2f a cycle, %.1f GFLOP/s a core\n", rate / hz, rate * 64 / 1e9);
#endif

    enum { K = 576, N = 64, G = N / 8, BLOCKS = K / 32 };
    uint8_t *w = aligned_alloc(64, (size_t)G * BLOCKS * 128);
    float *s = malloc(sizeof(float) * G * BLOCKS * 8), *o = malloc(sizeof(float) * G * BLOCKS * 8);
    int8_t *xq = malloc((size_t)LAST_TILE_ROWS * K);
    float xs[LAST_TILE_ROWS * BLOCKS], xsum[LAST_TILE_ROWS * BLOCKS], y[LAST_TILE_ROWS * N];
    for (size_t i = 0; i < (size_t)G * BLOCKS * 128; i++) w[i] = (uint8_t)rand();
    for (int i = 0; i < G * BLOCKS * 8; i++) s[i] = 0.01f * (i % 7 + 1), o[i] = 0.001f * (i % 5);
    for (int i = 0; i < LAST_TILE_ROWS * K; i++) xq[i] = (int8_t)(rand() % 255 - 127);
    for (int i = 0; i < LAST_TILE_ROWS * BLOCKS; i++) xs[i] = 0.02f, xsum[i] = 1.0f;
    printf("int4_tile, weights in cache: cycles a block and row of x (the vpmaddubsw floor: %.2f)\n",
           8.0 / maddubs_per_cycle);
    const int rows[] = {1, 2, 4, 6};
    for (int t = 0; t < 4; t++) {
        const int R = rows[t] <= LAST_TILE_ROWS ? rows[t] : LAST_TILE_ROWS;
        const long iters = 100000;
        const double start = now();
        for (long it = 0; it < iters; it++)
            for (int g = 0; g < G; g++) {
                const uint8_t *wg = w + (size_t)g * BLOCKS * 128;
                const float *sg = s + g * BLOCKS * 8, *og = o + g * BLOCKS * 8;
                TILE_CALL(int4_tile, 0, wg, sg, og, 0, xq, xs, xsum, y + g * 8, N, K, BLOCKS, 1);
                __asm__ volatile("" : : "r"(y) : "memory");
            }
        printf("  %d rows: %.2f\n", R, (now() - start) * hz / ((double)iters * G * BLOCKS * R));
    }
    return 0;
}
