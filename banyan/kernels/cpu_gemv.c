/* Matmuls over compact weights on x86 CPUs with AVX2 (banyan/kernels/cpu_gemv.py builds and loads this file).
 * Decoding streams every weight once per step for a few rows of activations: the time is the bytes read, so
 * the weights stay 4 or 8 bits in memory and are multiplied as integers in registers.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k], weight rows in parallel (OpenMP, on the runtime torch already loaded). x is
 * rounded to int8 per block of 32 (one float scale each; llama.cpp's Q8 blocks), the weights keep their exact
 * values, and each block is one integer dot product (`vpmaddubsw` + `vpmaddwd`, or `vpdpbusd` where the library
 * is built for AVX-512 VNNI: the same exact integers), scaled by the blocks' scales into a float accumulator:
 * errors of 0.4-0.6% in norm on random inputs (tests/unit/test_quantization.py), as llama.cpp's.
 *
 * Register tiles of 2 weight rows x 4 rows of x: each x block loaded serves both weight rows, each weight block
 * all four rows of x. A (weight row, x row) pair takes the same instructions in the same order whatever tile
 * slot it falls in and however many rows the call has, so a row's result never depends on the other rows
 * (batch invariance: a token's logits have the same bits alone, in a batch, or inside a prompt).
 *
 * Compute bound from a few rows on: on a 2-vCPU AVX2 EPYC a block costs maddubs + madd + convert + fma per 32
 * products, about what FBGEMM's fp16 GEMM pays (one fma per 8), so past GEMV_MAX_ROWS rows that GEMM is as
 * fast or faster (docs/quantization.md has the measurements) and callers holding a float16 copy use it there.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define GEMV_MAX_ROWS 8

int gemv_max_rows(void) { return GEMV_MAX_ROWS; }

/* 32 unsigned x 32 signed bytes -> 8 int32 sums of 4 products. Pair sums never saturate int16 here (int4: 2 * 15 *
 * 127; int8 with the sign on x: 2 * 127 * 127), so both forms give the same integers. */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x rows in blocks of 32 as int8: x[m, 32b + i] ~= scale[m, b] * q[m, 32b + i] (symmetric, round to
 * nearest), with sum[m, b] = scale[m, b] * sum_i q[m, 32b + i], the sum of the rounded block, for int4's offsets:
 * w = s q + o, so sum_k w x = s sum q x + o sum x, and taking sum x of the same rounded x (as llama.cpp's Q8_1
 * does) leaves the error sum_k w (x~ - x), as for int8 weights. The exact sum instead adds o times the block's
 * rounding errors, and o (about -8 s) is large: perplexity of the default model's int4 layers with prompts
 * through the kernel 6.86 with the exact sums, 6.77 with these (float32: 6.76). */
static void quantize_rows(const float *x, int8_t *q, float *scale, float *sum, int M, int K) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int m = 0; m < M; m++) {
        for (int b = 0; b < K / 32; b++) {
            const float *xb = x + (size_t)m * K + 32 * b;
            __m256 v[4], amax = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(xb + 8 * j);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            float d = _mm_cvtss_f32(m4) / 127.0f;
            __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            __m256i i32[4];
            for (int j = 0; j < 4; j++)
                i32[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            /* pack 32 int32 -> 32 int8 in order: packs interleave 128-bit lanes, the permute restores it */
            __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
            __m256i i8 = _mm256_packs_epi16(i16a, i16b);
            i8 = _mm256_permutevar8x32_epi32(i8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(q + (size_t)m * K + 32 * b), i8);
            scale[(size_t)m * (K / 32) + b] = d;
            __m256i isum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
            s4 = _mm_hadd_epi32(s4, s4);
            sum[(size_t)m * (K / 32) + b] = d * (float)(_mm_cvtsi128_si32(s4) + _mm_extract_epi32(s4, 1));  /* exact integer */
        }
    }
}

/* RN (1 or 2) weight rows against R (at most 4) rows of x, both constants after inlining: the 2 x 4 accumulators
 * live in registers, each x block loaded serves both weight rows and each unpacked weight block all R rows. Each
 * block is one integer dot product (unsigned 4-bit x signed 8-bit, as llama.cpp does), scaled by the weight's
 * and the activation's block scales, group by group (AWQ's and GPTQ's groups of 64 or 128 hold 2 or 4 blocks).
 * The offsets' part, sum_g o[g] * xsum[r, g] (xsum summed per group: int4_gemv), goes eight groups at a time.
 * Every (weight row, x row) pair takes the same instructions in the same order whatever RN, R and the rows around
 * it: a row's result does not depend on the call's other rows. */
static inline __attribute__((always_inline)) void int4_tile(const uint8_t *row, const float *s, const float *o,
                                                            const int8_t *xq, const float *xscale, const float *xsum,
                                                            float *y, const int RN, const int R, int N, int K, int groups,
                                                            int per_group) {
    const int blocks = K / 32;
    const __m256i low4 = _mm256_set1_epi8(0x0F), shift = _mm256_setr_epi64x(0, 0, 4, 4);
    __m256 acc[2][4];
    for (int i = 0; i < RN; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm256_setzero_ps();
    for (int g = 0, b = 0; g < groups; g++) {
        __m256 sg[2];
        for (int i = 0; i < RN; i++) sg[i] = _mm256_set1_ps(s[(size_t)i * groups + g]);
        for (int j = 0; j < per_group; j++, b++) {
            /* Two tiles ahead (4 rows of K/2 bytes): the two rows' blocks alternate, which hides the stream from the
             * hardware prefetcher (a 49152 x 576 int8 matrix at one row of x: 3x slower than row by row without this) */
            _mm_prefetch((const char *)(row + 2 * (size_t)K + 32 * b), _MM_HINT_T0);
            __m256i w[2];
            for (int i = 0; i < RN; i++) {
                /* the 16 bytes in both halves, the upper shifted by 4: q[32b .. 32b + 31] in order, in three
                 * instructions where a 128-bit load, two ands, a shift and an insert took five (1.03-1.10x) */
                const __m128i *at = (const __m128i *)(row + (size_t)i * (K / 2) + 16 * b);
                __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(at));
                w[i] = _mm256_and_si256(_mm256_srlv_epi64(bytes, shift), low4);
            }
            for (int r = 0; r < R; r++) {
                __m256i xb = _mm256_loadu_si256((const __m256i *)(xq + (size_t)r * K + 32 * b));
                __m256 xs = _mm256_broadcast_ss(xscale + (size_t)r * blocks + b);
                for (int i = 0; i < RN; i++) {
                    __m256i dot = dot_u8s8(w[i], xb);  /* 8 partial sums, int32 */
                    acc[i][r] = _mm256_fmadd_ps(_mm256_mul_ps(sg[i], xs), _mm256_cvtepi32_ps(dot), acc[i][r]);
                }
            }
        }
    }
    for (int i = 0; i < RN; i++) {
        const float *oi = o + (size_t)i * groups;
        __m256 off[4];
        for (int r = 0; r < R; r++) off[r] = _mm256_setzero_ps();
        int g = 0;
        for (; g + 8 <= groups; g += 8) {
            __m256 og = _mm256_loadu_ps(oi + g);
            for (int r = 0; r < R; r++) off[r] = _mm256_fmadd_ps(og, _mm256_loadu_ps(xsum + (size_t)r * blocks + g), off[r]);
        }
        for (int r = 0; r < R; r++) {
            float tail = 0.0f;
            for (int t = g; t < groups; t++) tail += oi[t] * xsum[(size_t)r * blocks + t];
            y[(size_t)r * N + i] = hsum(_mm256_add_ps(acc[i][r], off[r])) + tail;
        }
    }
}

#define INT4_TILES_PG(RN, PG)                                                                                 \
    switch (M - m) {                                                                                          \
        case 1: int4_tile(row, s, o, xm, xs, xt, ym, RN, 1, N, K, groups, PG); break;                         \
        case 2: int4_tile(row, s, o, xm, xs, xt, ym, RN, 2, N, K, groups, PG); break;                         \
        case 3: int4_tile(row, s, o, xm, xs, xt, ym, RN, 3, N, K, groups, PG); break;                         \
        default: int4_tile(row, s, o, xm, xs, xt, ym, RN, 4, N, K, groups, PG); break;                        \
    }
/* groups of one block (GGUF's Q4, the default) get their own copy with the inner group loop gone */
#define INT4_TILES(RN)                                                                                        \
    if (per_group == 1) { INT4_TILES_PG(RN, 1) } else { INT4_TILES_PG(RN, per_group) }

/* 4-bit weights in blocks of 32 along k: w[n, k] = scale[n, g] * q[n, k] + offset[n, g], g = k / group.
 * packed [N, K/2]: block b of row n is bytes 16b..16b+15 of the row, byte j = q[32b + j] | q[32b + 16 + j] << 4.
 * scratch: M * K bytes + 2 * M * K / 32 floats, for x as int8 blocks (quantize_rows).
 * Weight rows go two at a time (one alone if N is odd), rows of x four at a time within them; the two weight
 * rows (K bytes) stay in L1 while every row of x passes. */
void int4_gemv(const float *x, void *scratch, const uint8_t *packed, const float *scale, const float *offset,
               float *y, int M, int N, int K, int group, int threads) {
    const int per_group = group / 32, groups = K / group, blocks = K / 32;
    float *xscale = (float *)scratch, *xsum = xscale + (size_t)M * blocks;
    int8_t *xq = (int8_t *)(xsum + (size_t)M * blocks);
    quantize_rows(x, xq, xscale, xsum, M, K);
    if (per_group > 1)  /* each row's block sums -> group sums, in place (row m keeps its stride of `blocks`) */
        for (int m = 0; m < M; m++) {
            float *sums = xsum + (size_t)m * blocks;
            for (int g = 0; g < groups; g++) {
                float total = 0.0f;
                for (int j = 0; j < per_group; j++) total += sums[g * per_group + j];
                sums[g] = total;
            }
        }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; n += 2) {
        const uint8_t *row = packed + (size_t)n * (K / 2);
        const float *s = scale + (size_t)n * groups, *o = offset + (size_t)n * groups;
        for (int m = 0; m < M; m += 4) {
            const int8_t *xm = xq + (size_t)m * K;
            const float *xs = xscale + (size_t)m * blocks, *xt = xsum + (size_t)m * blocks;
            float *ym = y + (size_t)m * N + n;
            if (n + 1 < N) INT4_TILES(2) else INT4_TILES(1)
        }
    }
}

/* 8-bit weights, one scale per row: w[n, k] = scale[n] * q[n, k]; q [N, K] int8, K a multiple of 32.
 * x goes in as int8 blocks too (scratch as for int4_gemv); signed x signed through maddubs by moving
 * the weight's sign onto x. Tiled as int4_tile: each pair the same instructions whatever the rows around it. */
static inline __attribute__((always_inline)) void int8_tile(const int8_t *row, const int8_t *xq, const float *xscale,
                                                            float *y, const int RN, const int R, int N, int K,
                                                            const float *scale) {
    const int blocks = K / 32;
    __m256 acc[2][4];
    for (int i = 0; i < RN; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m256i w[2], wabs[2];
        _mm_prefetch((const char *)(row + 4 * (size_t)K + 64 * b), _MM_HINT_T0);  /* two tiles ahead: see int4_tile */
        for (int i = 0; i < RN; i++) {
            w[i] = _mm256_loadu_si256((const __m256i *)(row + (size_t)i * K + 32 * b));
            wabs[i] = _mm256_sign_epi8(w[i], w[i]);
        }
        for (int r = 0; r < R; r++) {
            __m256i xr = _mm256_loadu_si256((const __m256i *)(xq + (size_t)r * K + 32 * b));
            __m256 xs = _mm256_broadcast_ss(xscale + (size_t)r * blocks + b);
            for (int i = 0; i < RN; i++) {
                __m256i dot = dot_u8s8(wabs[i], _mm256_sign_epi8(xr, w[i]));
                acc[i][r] = _mm256_fmadd_ps(xs, _mm256_cvtepi32_ps(dot), acc[i][r]);
            }
        }
    }
    for (int i = 0; i < RN; i++)
        for (int r = 0; r < R; r++) y[(size_t)r * N + i] = hsum(acc[i][r]) * scale[i];
}

#define INT8_TILES(RN)                                                                 \
    switch (M - m) {                                                                   \
        case 1: int8_tile(row, xm, xs, ym, RN, 1, N, K, scale + n); break;             \
        case 2: int8_tile(row, xm, xs, ym, RN, 2, N, K, scale + n); break;             \
        case 3: int8_tile(row, xm, xs, ym, RN, 3, N, K, scale + n); break;             \
        default: int8_tile(row, xm, xs, ym, RN, 4, N, K, scale + n); break;            \
    }

void int8_gemv(const float *x, void *scratch, const int8_t *q, const float *scale, float *y, int M, int N, int K,
               int threads) {
    const int blocks = K / 32;
    float *xscale = (float *)scratch, *xsum = xscale + (size_t)M * blocks;
    int8_t *xq = (int8_t *)(xsum + (size_t)M * blocks);
    quantize_rows(x, xq, xscale, xsum, M, K);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; n += 2) {
        const int8_t *row = q + (size_t)n * K;
        for (int m = 0; m < M; m += 4) {
            const int8_t *xm = xq + (size_t)m * K;
            const float *xs = xscale + (size_t)m * blocks;
            float *ym = y + (size_t)m * N + n;
            if (n + 1 < N) INT8_TILES(2) else INT8_TILES(1)
        }
    }
}

/* Float weights, float32 or float16 (widened in registers, F16C), for batch-invariant mode, where every row of
 * every matmul comes here: each output is 8-lane partial sums over k in order and one fixed horizontal sum, the
 * same whichever rows share the call (torch's float GEMMs pick their blocking by the number of rows).
 * Register tiles of up to 4 weight rows x 3 rows of x (12 accumulators, 3 x loads and 4 weight loads per 12 FMAs;
 * one weight row at a time read x once per FMA, which made wide calls load bound); every (weight row, x row) pair
 * takes the same FMAs in the same order in any tile slot, so the bits are those of a row alone. */
static inline __attribute__((always_inline)) void float_tile(const void *w, const float *x, float *y, const int RN,
                                                             const int R, const int half, int N, int K) {
    __m256 acc[4][3];
    for (int i = 0; i < RN; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        __m256 xr[3];
        for (int r = 0; r < R; r++) xr[r] = _mm256_loadu_ps(x + (size_t)r * K + k);
        for (int i = 0; i < RN; i++) {
            __m256 wi = half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + (size_t)i * K + k)))
                             : _mm256_loadu_ps((const float *)w + (size_t)i * K + k);
            for (int r = 0; r < R; r++) acc[i][r] = _mm256_fmadd_ps(wi, xr[r], acc[i][r]);
        }
    }
    for (int i = 0; i < RN; i++)
        for (int r = 0; r < R; r++) y[(size_t)r * N + i] = hsum(acc[i][r]);
}

#define FLOAT_TILE(RN, HALF)                                                           \
    switch (R) {                                                                       \
        case 1: float_tile(wn, xm, ym, RN, 1, HALF, N, K); break;                      \
        case 2: float_tile(wn, xm, ym, RN, 2, HALF, N, K); break;                      \
        default: float_tile(wn, xm, ym, RN, 3, HALF, N, K); break;                     \
    }
#define FLOAT_TILES(HALF)                                                              \
    switch (RN) {                                                                      \
        case 1: FLOAT_TILE(1, HALF) break;                                             \
        case 2: FLOAT_TILE(2, HALF) break;                                             \
        case 3: FLOAT_TILE(3, HALF) break;                                             \
        default: FLOAT_TILE(4, HALF) break;                                            \
    }

/* Weight rows in blocks of FLOAT_BLOCK (a block stays in L2 while every row of x passes, 3 at a time, over it). */
#define FLOAT_BLOCK 16

/* y [M, N] = x [M, K] w^T, w [N, K] float32 (half = 0) or float16 (half = 1), K a multiple of 8. */
void float_gemv(const float *x, const void *w, int half, float *y, int M, int N, int K, int threads) {
    const size_t row_bytes = (size_t)K * (half ? 2 : 4);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int n0 = 0; n0 < N; n0 += FLOAT_BLOCK) {
        const int n_end = n0 + FLOAT_BLOCK < N ? n0 + FLOAT_BLOCK : N;
        for (int m = 0; m < M; m += 3) {
            const int R = M - m < 3 ? M - m : 3;
            const float *xm = x + (size_t)m * K;
            for (int n = n0; n < n_end; n += 4) {
                const int RN = n_end - n < 4 ? n_end - n : 4;
                const void *wn = (const char *)w + (size_t)n * row_bytes;
                float *ym = y + (size_t)m * N + n;
                if (half) FLOAT_TILES(1) else FLOAT_TILES(0)
            }
        }
    }
}
