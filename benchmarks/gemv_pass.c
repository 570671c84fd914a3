/* The default model's matmuls through banyan's integer kernel (banyan/kernels/cpu_gemv.c) in a C loop: what a
 * forward's matmuls cost with no Python between the calls, as the one-call decode step (cpu_decode_layers.c) runs
 * them. benchmarks/gemv_ab.py compares two kernels through ctypes, some 15 us a call (about 1.8 ms of its 121-call
 * pass on a Zen 3); this prints the kernel's own time per number of rows of x.
 *
 *     cc -O3 -mavx2 -mfma -mf16c -fopenmp benchmarks/gemv_pass.c -o /tmp/gemv_pass -lm && /tmp/gemv_pass [threads]
 *
 * (add cpu_gemv.py's ISA_FLAGS for an AVX-512 or AMX build; -DKERNEL='"/tmp/before.c"' for another version of the
 * kernel, a path from this directory or an absolute one). A pass: 30 layers of int4 (groups of 32) q/k/v
 * (960 x 576), o (576 x 576), gate/up (3,072 x 576) and down (576 x 1,536), each its own random weights (80 MB with
 * their scales, so they come from memory, as a model's do), then the int8 lm_head (49,152 x 576). Prints the best of
 * 10 passes at each row count. int4 scales and offsets are float16, as a model holds them (-DFLOAT32_SCALES for
 * float32 ones). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifndef KERNEL
#define KERNEL "../banyan/kernels/cpu_gemv.c"
#endif
#include KERNEL
#include "bench_clock.h"

#ifdef FLOAT32_SCALES
#define HALF 0
#else
#define HALF 1
#endif

typedef struct {
    int n, k;
    uint8_t *packed;
    void *scale, *offset;  /* int4's: float16 (HALF) or float32; int8's scale: float32, offset NULL */
} Weights;

static void store_scale(void *p, size_t i, float v, int half) {
    if (half) ((uint16_t *)p)[i] = _cvtss_sh(v, 0);
    else ((float *)p)[i] = v;
}

static Weights random_weights(int n, int k, int bits) {
    const size_t bytes = (size_t)n / 8 * (k / 32) * (bits == 4 ? 128 : 256);
    const size_t scales = bits == 4 ? (size_t)n * (k / 32) : (size_t)n;
    const int half = bits == 4 && HALF, size = half ? 2 : 4;
    Weights w = {n, k, aligned_alloc(64, bytes), aligned_alloc(64, scales * size),
                 bits == 4 ? aligned_alloc(64, scales * size) : NULL};
    for (size_t i = 0; i < bytes; i++) w.packed[i] = (uint8_t)rand();
    for (size_t i = 0; i < scales; i++) {
        const float scale = 0.0002f * (rand() % 100);
        store_scale(w.scale, i, scale, half);
        if (w.offset != NULL) store_scale(w.offset, i, -8 * scale, half);  /* int4 only */
    }
    return w;
}


int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 1, shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    Weights layers[120];
    for (int i = 0; i < 120; i++) layers[i] = random_weights(shapes[i % 4][0], shapes[i % 4][1], 4);
    const Weights head = random_weights(49152, 576, 8);
    float *x = malloc(sizeof(float) * 16 * 1536), *y = malloc(sizeof(float) * 16 * 49152);
    void *scratch = malloc((size_t)1 << 22);  /* x as int8 blocks and their scales: 16 rows of 1,536 need 0.03 MB */
    for (int i = 0; i < 16 * 1536; i++) x[i] = (float)(rand() % 1000) * 0.001f - 0.5f;
    printf("%d thread(s); best of 10 passes\n", threads);
    const int rows[] = {1, 2, 3, 4, 5, 8, 16};
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        const int m = rows[r];
        double int4_best = 1e9, int8_best = 1e9;
        for (int pass = 0; pass < 10; pass++) {
            const double start = now();
            for (int i = 0; i < 120; i++)
                int4_gemv(x, scratch, layers[i].packed, layers[i].scale, layers[i].offset, HALF, y, m, layers[i].n,
                          layers[i].k, 32, threads);
            const double middle = now();
            int8_gemv(x, scratch, head.packed, head.scale, y, m, head.n, head.k, threads);
            const double end = now();
            if (middle - start < int4_best) int4_best = middle - start;
            if (end - middle < int8_best) int8_best = end - middle;
        }
        printf("%2d rows  int4 layers %6.2f ms  lm_head %5.2f ms  together %6.2f ms\n", m, int4_best * 1e3,
               int8_best * 1e3, (int4_best + int8_best) * 1e3);
    }
    return 0;
}
