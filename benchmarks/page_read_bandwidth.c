/* How fast two threads read KV pages from memory on this machine, with nothing else to do: the floor under decode
 * attention, which reads every K and V row of its context once a step.
 *
 *     cc -O3 -mavx2 -mfma -mf16c -fopenmp benchmarks/page_read_bandwidth.c -o /tmp/page_read && /tmp/page_read
 *
 * 20,000 chunks of 6 KiB (a page of the default model's float16 K or V: 16 tokens x 3 KV heads x 64 x 2 bytes) in
 * one buffer of 120 MiB, read by two threads (chunk c by thread c % 2), each 16 bytes widened to 8 floats and added
 * up (what attention does to a row before its FMAs). Read in a random order (a server's pages) and in order; and in
 * a random order with the next chunks fetched ahead into L2 (prefetcht1 of every line, 1 to 4 chunks a thread ahead),
 * as the kernel does. Prints GB/s for each, five times over. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHUNK 6144
#define CHUNKS 20000

#include "bench_clock.h"

/* the chunks in `order`, two threads, `ahead` chunks a thread fetched ahead (0: none); returns GB/s */
static double read_chunks(const char *buf, const uint32_t *order, int ahead, float *sink) {
    const double start = now();
    float total = 0;
#pragma omp parallel num_threads(2) reduction(+ : total)
    {
        __m256 acc = _mm256_setzero_ps();
        for (size_t c = omp_get_thread_num(); c < CHUNKS; c += 2) {
            const char *p = buf + (size_t)order[c] * CHUNK;
            if (ahead > 0 && c + 2 * ahead < CHUNKS) {
                const char *next = buf + (size_t)order[c + 2 * ahead] * CHUNK;
                for (size_t b = 0; b < CHUNK; b += 64) _mm_prefetch(next + b, _MM_HINT_T1);
            }
            for (size_t b = 0; b < CHUNK; b += 16)
                acc = _mm256_add_ps(acc, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + b))));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        total += lanes[0];
    }
    *sink += total;
    return (double)CHUNK * CHUNKS / (now() - start) / 1e9;
}

int main(void) {
    char *buf = aligned_alloc(4096, (size_t)CHUNK * CHUNKS);
    memset(buf, 1, (size_t)CHUNK * CHUNKS);
    uint32_t *shuffled = malloc(sizeof(uint32_t) * CHUNKS), *in_order = malloc(sizeof(uint32_t) * CHUNKS);
    for (uint32_t i = 0; i < CHUNKS; i++) shuffled[i] = in_order[i] = i;
    srand(1);
    for (int i = CHUNKS - 1; i > 0; i--) {
        const int j = rand() % (i + 1);
        const uint32_t t = shuffled[i];
        shuffled[i] = shuffled[j], shuffled[j] = t;
    }
    float sink = 0;
    for (int round = 0; round < 5; round++)
        printf("random %.1f  in order %.1f  random, fetched 1 / 2 / 4 ahead %.1f / %.1f / %.1f GB/s\n",
               read_chunks(buf, shuffled, 0, &sink), read_chunks(buf, in_order, 0, &sink),
               read_chunks(buf, shuffled, 1, &sink), read_chunks(buf, shuffled, 2, &sink),
               read_chunks(buf, shuffled, 4, &sink));
    return sink == 12345.0f;  /* keeps the sums alive */
}
