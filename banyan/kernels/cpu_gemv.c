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
 * int4 and int8 weights are laid out 8 rows interleaved, so a vector's lanes are 8 weight rows (int4_tile, int8_tile):
 * fewer instructions a product than llama.cpp's row-at-a-time blocks. int4 is faster than FBGEMM's fp16 GEMM at every
 * batch width on an AVX2 EPYC, so int4 layers take this kernel for every call; int8 too where built for VNNI (2-2.6x
 * FBGEMM's from 16 rows on a Zen 4), while with AVX2 alone (maddubs + madd a chunk, about what FBGEMM's fp16 GEMM pays)
 * callers holding a float16 copy use that past GEMV_MAX_ROWS rows. In both, a (weight row, x row) pair takes the same
 * instructions in the same order whatever tile slot it falls in and however many rows the call has, so a row's
 * result never depends on the other rows (batch invariance: a token's logits have the same bits alone, in a batch,
 * or inside a prompt).
 */
#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

#define GEMV_MAX_ROWS 8

int gemv_max_rows(void) { return GEMV_MAX_ROWS; }

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

/* Rows of x a weight group's (unpacked) blocks serve at once (TILE_ROWS), rows of x from which row groups go in pairs
 * (PAIR_ROWS, see int4_tile16), how far ahead of its block a tile prefetches the weights (PREFETCH_AHEAD bytes; int8's
 * tiles too where INT8_PREFETCH), and rows of x (as int8) a pass over the weights keeps in cache: wide calls go
 * through the weights once per PASS_BYTES of x. Each build as measured on its CPUs (docs/quantization.md). Intel
 * cores with AMX run 512-bit dot products at full rate and read the weights from a large L3 with a long latency: 8
 * rows a tile (32 vector registers hold them), pairs from 2 rows and prefetches 4 KiB ahead took the default model's
 * matmuls for 6 rows (a verify pass) 1.4-1.6x and for 1 row 1.05-1.2x faster there. On the Zen 4 two row groups a
 * vector were 6-11% slower than one for 1-4 rows (30 layers' weights, 2 threads), and 0.88-0.90x at 5-6 rows in one
 * tile, but 1.19-1.29x faster at 7 (two tiles, which prefetch the next group: PREFETCH_NEXT_GROUP) and, as two tiles
 * of 3 + 2 or 3 + 3, 1.07x at 5 rows and 1.13x at 6 (medians of four runs against one unpaired tile); there a prefetch
 * 2 KiB ahead in place of 512 bytes measured 1.00-1.10x at 3-6 rows (a verify pass's; median of three runs about 1.04x,
 * one 0.94x at 5 rows), 4 KiB the same as 2. AVX2 has 16 vector registers. */
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__) && defined(__AVX512F__)
#define TILE_ROWS 8
#define PAIR_ROWS 2
#define PREFETCH_AHEAD 4096
#define INT8_PREFETCH 1
#define PREFETCH_NEXT_GROUP 0
#elif defined(__AVX512VNNI__) && defined(__AVX512F__)
#define TILE_ROWS 4
#define PAIR_ROWS 5
#define PREFETCH_AHEAD 2048
#define INT8_PREFETCH 0
#define PREFETCH_NEXT_GROUP 1
#else
#define TILE_ROWS 4
#define PAIR_ROWS 8
#define PREFETCH_AHEAD 512
#define INT8_PREFETCH 0
#define PREFETCH_NEXT_GROUP 0
#endif
/* The widest tile: TILE_ROWS, or where tiles are 4 rows, 6: a last tile of 1 or 2 rows unpacks every block again,
 * and the 5th row in a tile of its own added about a fifth to the matmuls of 4 rows. So 5 or 6 rows left take one
 * tile: the default model's matmuls at 5 rows (a verify of 4 drafts) 1.07-1.13x faster on a 2-vCPU Zen 3
 * (benchmarks/gemv_ab.py, 2 threads; 1.09x at 1), at 6 rows 1.07-1.08x; 7 rows in one tile were no faster than
 * 4 + 3; every row's bits the same. */
#define LAST_TILE_ROWS (TILE_ROWS == 4 ? 6 : TILE_ROWS)
#define PASS_BYTES (96 * 1024)

/* The weights' prefetch a tile makes a block (p: the block's place in its row group's weights, bytes: the block's).
 * to_next: where the call has several tiles a row group (more rows of x than one tile takes), the bytes from this row
 * group's (or pair's) weights to the next one's, which it fetches into L2 while it multiplies its own from L1: the
 * first tile would otherwise wait on memory for each block while the others wait on nothing, and the matmuls of 8-32
 * rows (a decode batch of that many) took 1.12-1.41x longer on a 2-vCPU Zen 4 (docs/quantization.md, "Prefetching
 * the next row group"). VNNI builds without AMX only (PREFETCH_NEXT_GROUP): the AVX2 build's tiles, slower, measured
 * 0.94-0.98x with it on the same CPU, and AMX's were not measured. to_next 0 (one tile a row group, or a build without
 * it): `ahead` bytes on within its own weights, where ahead is nonzero (PREFETCH_AHEAD; int8's tiles only where
 * INT8_PREFETCH). Prefetches change no result. always_inline: GCC 12 takes a function whose only effect is a prefetch
 * for one without effects, and drops its calls. */
static inline __attribute__((always_inline)) void prefetch_weights(const uint8_t *p, const int bytes, const size_t to_next,
                                                                   const size_t ahead) {
    for (int line = 0; line < bytes; line += 64) {
        if (to_next)
            _mm_prefetch((const char *)(p + to_next + line), _MM_HINT_T1);
        else if (ahead)
            _mm_prefetch((const char *)(p + ahead + line), _MM_HINT_T0);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* acc += w . x by one vpdpbusd that broadcasts x's four bytes itself ({1to8}, {1to16} on its memory operand). Compilers
 * emit _mm*_set1_epi32(x) as a vpbroadcastd of its own, one more instruction a product: on the Zen 4 a loop of both ran
 * 3.06 G 512-bit vpdpbusd a second, of the embedded form 3.39 G (3.53 G with x in a register). The same integer
 * products, so the same bits. */
static inline __m256i dpbusd_x8(__m256i acc, __m256i w, const int32_t *x) {
    __asm__("vpdpbusd %1%{1to8%}, %2, %0" : "+v"(acc) : "m"(*x), "v"(w));
    return acc;
}
static inline __m512i dpbusd_x16(__m512i acc, __m512i w, const int32_t *x) {
    __asm__("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*x), "v"(w));
    return acc;
}
#endif

/* A row group's 8 scales (or offsets) from element i of p: float16 where the weight's scales and offsets are all
 * exact in it (half; interleave_int4 decides), else float32. The same floats either way, so the same bits; float16
 * takes a sixth off the bytes of a 4-bit weight (128 of nibbles and 64 of scales and offsets a block of 8 rows),
 * which is what a call of a few rows waits on (docs/quantization.md, "Scales in float16"). */
static inline __m256 load_scales8(const void *p, size_t i, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}

/* 4-bit weights interleaved by 8 rows, so that the 8 lanes of a vector are 8 weight rows and each lane ends a
 * block holding that row's whole dot product: no horizontal sums, and one convert + one multiply-add per block for
 * 8 weight rows where a row at a time took them per row (1.5-1.9x faster from 1 row of x to 256 on a 2-vCPU AVX2
 * EPYC; 1.4-1.85x faster than FBGEMM's fp16 GEMM from 8 to 256 rows, so every batch width comes here).
 *
 * Layout (interleave_int4 in cpu_gemv.py writes it): row group G = weight rows 8G..8G+7, block b = k in
 * [32b, 32b + 32): 128 bytes at (G * blocks + b) * 128. Byte 32t + 4r + j holds q[8G + r, 32b + 8t + j] in its low
 * nibble and q[8G + r, 32b + 8t + 4 + j] in its high one (t < 4, r < 8, j < 4): unpacked, vector c (= 2t, 2t + 1)
 * is chunk c of the block, the four k's 32b + 4c .. 4c + 3 of each of the 8 rows. scale and offset are
 * [N8 / 8, groups, 8] (N8: N rounded up to 8; padding rows are all zero).
 *
 * A chunk is one `vpmaddubsw` against x's four bytes broadcast (unsigned 4-bit x signed 8-bit); the 8 chunks' int16
 * pair sums add exactly in int16 (at most 16 products of 15 * 127 = 30480 < 32767), one `vpmaddwd` makes them the
 * block's int32 dot products, which are scaled by the weight's group scales times x's block scale into a float
 * accumulator. The offsets' part, o[g] * xsum[r, g] (xsum summed per group: quantize_x), once per group. Every
 * (weight row, x row) pair takes the same instructions in the same order whatever tile slot or call it falls in:
 * a row's result does not depend on the call's other rows. */
static inline __attribute__((always_inline)) void int4_tile(const int R, const size_t to_next, const uint8_t *wp, const void *s8,
                                                            const void *o8, const int half, const int8_t *xq, const float *xscale, const float *xsum,
                                                            float *y, int ldy, int K, int groups, int per_group) {
    const int blocks = K / 32;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[LAST_TILE_ROWS], off[LAST_TILE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int g = 0, b = 0; g < groups; g++) {
        const __m256 sg = load_scales8(s8, 8 * (size_t)g, half);
        for (int j = 0; j < per_group; j++, b++) {
            const uint8_t *block = wp + (size_t)b * 128;
            prefetch_weights(block, 128, to_next, PREFETCH_AHEAD);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            __m256i w[8];
            for (int t = 0; t < 4; t++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 32 * t));
                w[2 * t] = _mm256_and_si256(bytes, low4);
                w[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            }
            for (int r = 0; r < R; r++) {
                const int32_t *x4 = (const int32_t *)(xq + (size_t)r * K + 32 * b);
                __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();  /* two chains: half the latency */
                for (int c = 0; c < 8; c += 2) {
                    even = dpbusd_x8(even, w[c], x4 + c);
                    odd = dpbusd_x8(odd, w[c + 1], x4 + c + 1);
                }
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(even, odd));
#else
            /* A chunk pair (the low and high nibbles of 32 bytes) at a time into every row's int16 sums, so that 4
             * sums and not the block's 8 unpacked chunks stay in registers (AVX2 has 16: holding the 8 chunks, the
             * loop moved 26 vectors a block through the stack at 4 rows). Integer sums, exact in any order: the
             * same dots. */
            __m256i sum[LAST_TILE_ROWS];
            for (int t = 0; t < 4; t++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 32 * t));
                const __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
                for (int r = 0; r < R; r++) {
                    const int32_t *x4 = (const int32_t *)(xq + (size_t)r * K + 32 * b);
                    const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x4[2 * t])),
                                                          _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x4[2 * t + 1])));
                    sum[r] = t == 0 ? pair : _mm256_add_epi16(sum[r], pair);
                    __asm__("" : "+x"(sum[r]));  /* kept here: else the compiler reorders the sums and spills again */
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r], _mm256_set1_epi16(1)));
#endif
                const __m256 xs = _mm256_broadcast_ss(xscale + (size_t)r * blocks + b);
                acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(sg, xs), acc[r]);
            }
        }
    }
    /* The offsets' part in a loop of its own: the same multiply-adds in the same order as beside the products, with
     * R fewer vectors live in the loop above. */
    for (int r = 0; r < R; r++) off[r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const __m256 og = load_scales8(o8, 8 * (size_t)g, half);
        for (int r = 0; r < R; r++) off[r] = _mm256_fmadd_ps(og, _mm256_broadcast_ss(xsum + (size_t)r * blocks + g), off[r]);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (size_t)ldy * r, _mm256_add_ps(acc[r], off[r]));
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* Two row groups at once (G and G + 1) in 512-bit vectors: lanes 0-7 are group G's 8 rows, lanes 8-15 group G + 1's,
 * so one broadcast of x and one `vpdpbusd` serve 16 weight rows. A 512-bit vpdpbusd does twice a 256-bit one's
 * products at about half its rate on a Zen 4, but the broadcasts, converts and scalings a block are halved: 1.35-1.8x
 * int4_tile's rate from 8 rows of x up where the weights are in cache (docs/quantization.md). Every lane takes int4_tile's
 * instructions in int4_tile's order, so a row's bits are the same whether its group is paired or runs alone. */
#define PAIRS 1
static inline __m512i load_pair_si(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
/* load_scales8 of elements i (lanes 0-7) and j (lanes 8-15) */
static inline __m512 load_pair_scales(const void *p, size_t i, size_t j, int half) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(load_scales8(p, i, half))),
                                               _mm256_castps_pd(load_scales8(p, j, half)), 1));
}
static inline __attribute__((always_inline)) void int4_tile16(const int R, const size_t to_next, const uint8_t *wp, const void *s8,
                                                              const void *o8, const int half, const int8_t *xq, const float *xscale, const float *xsum,
                                                              float *y, int ldy, int K, int groups, int per_group) {
    const int blocks = K / 32;
    const uint8_t *wp1 = wp + (size_t)blocks * 128;  /* group G + 1's blocks, scales and offsets follow G's */
    const size_t next = (size_t)groups * 8;  /* group G + 1's scales and offsets follow G's */
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[LAST_TILE_ROWS], off[LAST_TILE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = off[r] = _mm512_setzero_ps();
    for (int g = 0, b = 0; g < groups; g++) {
        const __m512 sg = load_pair_scales(s8, 8 * (size_t)g, next + 8 * g, half);
        for (int j = 0; j < per_group; j++, b++) {
            const uint8_t *b0 = wp + (size_t)b * 128, *b1 = wp1 + (size_t)b * 128;
            prefetch_weights(b0, 128, to_next, PREFETCH_AHEAD);
            prefetch_weights(b1, 128, to_next, PREFETCH_AHEAD);
            __m512i w[8];
            for (int t = 0; t < 4; t++) {
                const __m512i bytes = load_pair_si(b0 + 32 * t, b1 + 32 * t);
                w[2 * t] = _mm512_and_si512(bytes, low4);
                w[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
            }
            for (int r = 0; r < R; r++) {
                const int32_t *x4 = (const int32_t *)(xq + (size_t)r * K + 32 * b);
                __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
                for (int c = 0; c < 8; c += 2) {
                    even = dpbusd_x16(even, w[c], x4 + c);
                    odd = dpbusd_x16(odd, w[c + 1], x4 + c + 1);
                }
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
                const __m512 xs = _mm512_set1_ps(xscale[(size_t)r * blocks + b]);
                acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(sg, xs), acc[r]);
            }
        }
        const __m512 og = load_pair_scales(o8, 8 * (size_t)g, next + 8 * g, half);
        for (int r = 0; r < R; r++) off[r] = _mm512_fmadd_ps(og, _mm512_set1_ps(xsum[(size_t)r * blocks + g]), off[r]);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (size_t)ldy * r, _mm512_add_ps(acc[r], off[r]));
}
#else
#define PAIRS 0
#endif
/* A tile of R rows of x (at most TILE_ROWS) against one row group (int4_tile, int8_tile) or two (the *_tile16). */
#define TILE_CALL(TILE, ...)                                                                                       \
    switch (R) {                                                                                                   \
        case 1: TILE(1, __VA_ARGS__); break;                                                                       \
        case 2: TILE(2, __VA_ARGS__); break;                                                                       \
        case 3: TILE(3, __VA_ARGS__); break;                                                                       \
        WIDE_TILE_CASES(TILE, __VA_ARGS__)                                                                         \
        default: TILE(TILE_ROWS, __VA_ARGS__); break;                                                              \
    }
#if TILE_ROWS == 8
#define WIDE_TILE_CASES(TILE, ...)                                                                                 \
    case 4: TILE(4, __VA_ARGS__); break;                                                                           \
    case 5: TILE(5, __VA_ARGS__); break;                                                                           \
    case 6: TILE(6, __VA_ARGS__); break;                                                                           \
    case 7: TILE(7, __VA_ARGS__); break;
#else
#define WIDE_TILE_CASES(TILE, ...)                                                                                 \
    case 5: TILE(5, __VA_ARGS__); break;                                                                           \
    case 6: TILE(6, __VA_ARGS__); break;
#endif

/* Rows [begin, end) of x as int8 blocks (quantize_rows), their block sums summed per group when a group spans
 * several blocks (in place: row m keeps its stride of `blocks`). */
static void quantize_x(const float *x, int8_t *xq, float *xscale, float *xsum, int begin, int end, int K, int groups,
                       int per_group) {
    const int blocks = K / 32;
    quantize_rows(x + (size_t)begin * K, xq + (size_t)begin * K, xscale + (size_t)begin * blocks,
                  xsum + (size_t)begin * blocks, end - begin, K);
    if (per_group > 1)
        for (int m = begin; m < end; m++) {
            float *sums = xsum + (size_t)m * blocks;
            for (int g = 0; g < groups; g++) {
                float total = 0.0f;
                for (int j = 0; j < per_group; j++) total += sums[g * per_group + j];
                sums[g] = total;
            }
        }
}

/* 8-bit weights, one scale per row: w[n, k] = scale[n] * q[n, k], interleaved by 8 rows as int4's, so a vector's
 * lanes are 8 weight rows and each lane ends a block holding its row's whole integer dot product (a row at a time
 * took a convert and a multiply-add per 32 products and row, and a horizontal sum at the end of each).
 *
 * Layout (interleave_int8 in cpu_gemv.py writes it): row group G = weight rows 8G..8G+7, block b = k in [32b, 32b + 32):
 * 256 bytes at (G * blocks + b) * 256, byte 32c + 4r + j holding q[8G + r, 32b + 4c + j] + 128 (q's sign bit
 * flipped: an unsigned byte) for c < 8, r < 8, j < 4; scale [N8] (padding rows: q 0, scale 0).
 *
 * With VNNI a chunk c is one `vpdpbusd` of the unsigned weight bytes against x's four int8 broadcast, which counts
 * 128 * (the sum of x's block) too much: each block's chain starts from -128 times that sum (int8_corrections), so
 * it ends on the exact sum of q x. With AVX2, `vpmaddubsw` cannot take unsigned bytes up to 255 against int8 x (a
 * pair's sum can pass 32767), so the sign moves onto x as in llama.cpp (|q| x sign(x, q): at most 2 * 128 * 127),
 * and `vpmaddwd` widens each chunk to int32. Both give each block's exact integer, and from there the same float
 * steps: acc += dot * x's block scale, then y = acc * the row's scale. */

static inline __attribute__((always_inline)) void int8_tile(const int R, const uint8_t *wp, const float *s8, const int8_t *xq,
                                                            const float *xscale, const int32_t *xcorr, float *y, int ldy, int K) {
    const int blocks = K / 32;
    __m256 acc[LAST_TILE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *block = wp + (size_t)b * 256;
        __m256i dot[LAST_TILE_ROWS];
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        __m256i w[8];
        for (int c = 0; c < 8; c++) w[c] = _mm256_loadu_si256((const __m256i *)(block + 32 * c));
        for (int r = 0; r < R; r++) {
            const int32_t *x4 = (const int32_t *)(xq + (size_t)r * K + 32 * b);
            __m256i even = _mm256_set1_epi32(xcorr[(size_t)r * blocks + b]), odd = _mm256_setzero_si256();
            for (int c = 0; c < 8; c += 2) {
                even = dpbusd_x8(even, w[c], x4 + c);
                odd = dpbusd_x8(odd, w[c + 1], x4 + c + 1);
            }
            dot[r] = _mm256_add_epi32(even, odd);
        }
#else
        const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
        for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(block + 32 * c)), flip);
            const __m256i magnitude = _mm256_abs_epi8(q);  /* -128 stays 0x80: 128 as maddubs' unsigned operand */
            for (int r = 0; r < R; r++) {
                const __m256i x = _mm256_set1_epi32(((const int32_t *)(xq + (size_t)r * K + 32 * b))[c]);
                const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, q));
                dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs, ones));
                __asm__("" : "+x"(dot[r]));  /* as in int4_tile: a chunk at a time, or the loop spills */
            }
        }
#endif
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_broadcast_ss(xscale + (size_t)r * blocks + b), acc[r]);
    }
    const __m256 scale = _mm256_loadu_ps(s8);
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (size_t)ldy * r, _mm256_mul_ps(acc[r], scale));
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* int8_tile for two row groups at once (G in lanes 0-7, G + 1 in lanes 8-15), as int4_tile16: the same instructions
 * a lane in the same order, so the same bits. */
static inline __attribute__((always_inline)) void int8_tile16(const int R, const size_t to_next, const uint8_t *wp, const float *s8, const int8_t *xq,
                                                              const float *xscale, const int32_t *xcorr, float *y, int ldy, int K) {
    const int blocks = K / 32;
    const uint8_t *wp1 = wp + (size_t)blocks * 256;  /* group G + 1's blocks follow G's */
    __m512 acc[LAST_TILE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *b0 = wp + (size_t)b * 256, *b1 = wp1 + (size_t)b * 256;
        __m512i w[8];
        prefetch_weights(b0, 256, to_next, INT8_PREFETCH ? PREFETCH_AHEAD : 0);
        prefetch_weights(b1, 256, to_next, INT8_PREFETCH ? PREFETCH_AHEAD : 0);
        for (int c = 0; c < 8; c++) w[c] = load_pair_si(b0 + 32 * c, b1 + 32 * c);
        for (int r = 0; r < R; r++) {
            const int32_t *x4 = (const int32_t *)(xq + (size_t)r * K + 32 * b);
            __m512i even = _mm512_set1_epi32(xcorr[(size_t)r * blocks + b]), odd = _mm512_setzero_si512();
            for (int c = 0; c < 8; c += 2) {
                even = dpbusd_x16(even, w[c], x4 + c);
                odd = dpbusd_x16(odd, w[c + 1], x4 + c + 1);
            }
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(xscale[(size_t)r * blocks + b]), acc[r]);
        }
    }
    const __m512 scale = _mm512_loadu_ps(s8);
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (size_t)ldy * r, _mm512_mul_ps(acc[r], scale));
}
#endif

#define AMX_ROWS 16     /* rows of x a tile takes (and a pass rounds to where tiles serve) */
#define AMX_MIN_ROWS 32 /* calls of fewer rows keep the vector path (the comment below) */
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__) && defined(__AVX512F__)
/* AMX tiles (Intel Xeon from Sapphire Rapids) for calls of AMX_MIN_ROWS rows of x and more: one `tdpbsud` multiplies
 * a block of 32 k's of 16 rows of x (tile A, int8, signed) by the same block of 16 weight rows (tile B, unsigned:
 * int4's nibbles, int8's q + 128) into 16 x 16 exact int32 dot products (tile C), where int4_tile16 took 128
 * `vpdpbusd`.
 * B's rows are the block's 8 chunks as int4_tile16 unpacks them into registers (row c, bytes 4n + j: weight row n's
 * k = 32b + 4c + j), unpacked once per pair of row groups and pass over x (amx_unpack), so every tile of x rows in
 * the pass reuses them. From each block's integers on, a lane takes int4_tile16's (int8_tile16's) float steps in
 * their order, so a row's bits are those of the vector path: a call may mix both, and a row's result still does
 * not depend on the other rows. Linux hands tiles to a process that asks (cpu_gemv_tiles).
 * The tile unit and the vector units take turns on the AMX Xeon here (benchmarks/amx_overlap.c), so a block's tile
 * work and its float steps add up; since the vector path's float16 scales and pairs, calls of 16-31 rows ran faster
 * on it: offline decode steps of 16 / 24 rows 1.02x / 1.045x with the tiles off (6 rounds, in process), 32-40 rows
 * level, 48-64 rows 1.04-1.07x with them on (docs/quantization.md, "CPUs with AMX"). */
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
static int use_tiles = 0;

/* Whether Linux lets this process use the tile state (asked once; cpu_decode.c's flash attention asks here too). */
int amx_tiles_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}

/* Turns the tile path on (on = 1: asks Linux for the tile state once) or off; returns whether it is on. */
int cpu_gemv_tiles(int on) {
    use_tiles = on && amx_tiles_granted();
    return use_tiles;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0-1: C (16 x 16 int32), 2-3: A (16 rows x 32 bytes), 4-5: B (8 rows x 64 bytes); two sets, so that a block's
 * products run while the previous block's are scaled. */
static void amx_configure(void) {
    tile_config c = {0};
    c.palette = 1;
    for (int t = 0; t < 6; t++) {
        c.rows[t] = t >= 4 ? 8 : 16;
        c.colsb[t] = t == 2 || t == 3 ? 32 : 64;
    }
    /* GCC's _tile_loadconfig names 8 bytes of the config as its operand, so the compiler may drop the stores of
     * the rest (cpu_decode.c lost them where inlined: ldtilecfg read stale stack bytes as rows and faulted): all 64 */
    __asm__ volatile("" : : "m"(c));
    _tile_loadconfig(&c);
}

/* Row groups G and G + 1 (wp, wp1) as tile B rows, 512 bytes a block: int4 unpacked to one nibble a byte, int8
 * gathered (its chunks already are 4 bytes a row). */
static void amx_unpack(const int bits, const uint8_t *wp, const uint8_t *wp1, uint8_t *wb, int blocks) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int block_bytes = bits == 4 ? 128 : 256;  /* a block's, in each row group */
    for (int b = 0; b < blocks; b++) {
        __m512i *out = (__m512i *)(wb + (size_t)b * 512);
        for (int line = 0; line < block_bytes; line += 64) {
            _mm_prefetch((const char *)(wp + (size_t)b * block_bytes + PREFETCH_AHEAD + line), _MM_HINT_T0);
            _mm_prefetch((const char *)(wp1 + (size_t)b * block_bytes + PREFETCH_AHEAD + line), _MM_HINT_T0);
        }
        if (bits == 4)
            for (int t = 0; t < 4; t++) {
                const __m512i bytes = load_pair_si(wp + (size_t)b * 128 + 32 * t, wp1 + (size_t)b * 128 + 32 * t);
                _mm512_store_si512(out + 2 * t, _mm512_and_si512(bytes, low4));
                _mm512_store_si512(out + 2 * t + 1, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4));
            }
        else
            for (int c = 0; c < 8; c++)
                _mm512_store_si512(out + c, load_pair_si(wp + (size_t)b * 256 + 32 * c, wp1 + (size_t)b * 256 + 32 * c));
    }
}

/* The whole tiles of 16 rows of x in [m0, m_end) with each block's 16 x 32 bytes together (512 bytes at (tile * blocks
 * + b) * 512): tile A's load then reads 8 lines in a row where x's own rows put its 16 rows K bytes apart. */
static void amx_pack_x(const int8_t *xq, int8_t *xa, int m0, int m_end, int K) {
    const int blocks = K / 32;
    for (int t = 0; m0 + AMX_ROWS * (t + 1) <= m_end; t++)
        for (int b = 0; b < blocks; b++)
            for (int r = 0; r < AMX_ROWS; r++)
                _mm256_store_si256((__m256i *)(xa + ((size_t)t * blocks + b) * 512 + 32 * r),
                                   _mm256_loadu_si256((const __m256i *)(xq + (size_t)(m0 + AMX_ROWS * t + r) * K + 32 * b)));
}

/* Block b's products into tile set C, A, B (0, 2, 4 or 1, 3, 5: the intrinsics take literal tile numbers). */
#define AMX_ISSUE(C, A, B, b)                                                                                      \
    do {                                                                                                           \
        _tile_zero(C);                                                                                             \
        _tile_loadd(A, xa + 512 * (size_t)(b), 32);                                                                \
        _tile_loadd(B, wb + 512 * (size_t)(b), 64);                                                                \
        _tile_dpbsud(C, A, B);                                                                                     \
    } while (0)

/* Block b's 16 x 16 integers (dots) into the accumulators, with the float steps of int4_tile16 (bits 4: acc += dot *
 * (s * xs) a block, off += o * xsum a group) or int8_tile16 (bits 8: dot + x's correction, acc += dot * xs). */
static inline __attribute__((always_inline)) void amx_scale_block(const int bits, const int b, const int32_t *dots,
                                                                  __m512 *acc, __m512 *off, const void *s8,
                                                                  const void *o8, const int half, const size_t next,
                                                                  const float *xscale, const float *xsum, int blocks,
                                                                  int per_group) {
    if (bits == 4) {
        const int g = b / per_group;
        const __m512 sg = load_pair_scales(s8, 8 * (size_t)g, next + 8 * g, half);
#pragma GCC unroll 16
        for (int r = 0; r < AMX_ROWS; r++) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots + 16 * r));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(sg, _mm512_set1_ps(xscale[(size_t)r * blocks + b])), acc[r]);
        }
        if ((b + 1) % per_group == 0) {
            const __m512 og = load_pair_scales(o8, 8 * (size_t)g, next + 8 * g, half);
#pragma GCC unroll 16
            for (int r = 0; r < AMX_ROWS; r++)
                off[r] = _mm512_fmadd_ps(og, _mm512_set1_ps(xsum[(size_t)r * blocks + g]), off[r]);
        }
    } else {
        const int32_t *xcorr = (const int32_t *)xsum;
#pragma GCC unroll 16
        for (int r = 0; r < AMX_ROWS; r++) {
            const __m512i dot = _mm512_add_epi32(_mm512_load_si512(dots + 16 * r),
                                                 _mm512_set1_epi32(xcorr[(size_t)r * blocks + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xscale[(size_t)r * blocks + b]), acc[r]);
        }
    }
}

/* 16 rows of x against the pair in wb (amx_unpack) into y. Three blocks in flight: while block b - 1's integers are
 * scaled, block b's leave their tile for memory and block b + 1's are multiplied (a tile's store reaches the vector
 * loads only through the cache, so its integers are read one block later). */
static inline __attribute__((always_inline)) void amx_tile16(const int bits, const uint8_t *wb, const void *s8,
                                                             const void *o8, const int half, const int8_t *xa,
                                                             const float *xscale, const float *xsum, float *y, int ldy,
                                                             int K, int groups, int per_group) {
    const int blocks = K / 32;
    const size_t next = (size_t)groups * 8;  /* group G + 1's scales and offsets follow G's (int4) */
    int32_t dots[2][256] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS], off[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = off[r] = _mm512_setzero_ps();
    AMX_ISSUE(0, 2, 4, 0);
    for (int b = 0; b < blocks; b++) {
        if (b & 1) {
            _tile_stored(1, dots[1], 64);
            if (b + 1 < blocks) AMX_ISSUE(0, 2, 4, b + 1);
        } else {
            _tile_stored(0, dots[0], 64);
            if (b + 1 < blocks) AMX_ISSUE(1, 3, 5, b + 1);
        }
        if (b > 0)
            amx_scale_block(bits, b - 1, dots[(b - 1) & 1], acc, off, s8, o8, half, next, xscale, xsum, blocks,
                            per_group);
    }
    amx_scale_block(bits, blocks - 1, dots[(blocks - 1) & 1], acc, off, s8, o8, half, next, xscale, xsum, blocks,
                    per_group);
    const __m512 scale = _mm512_loadu_ps((const float *)s8);  /* int8's row scales: float32 */
    for (int r = 0; r < AMX_ROWS; r++)
        _mm512_storeu_ps(y + (size_t)ldy * r, bits == 4 ? _mm512_add_ps(acc[r], off[r]) : _mm512_mul_ps(acc[r], scale));
}

/* Rows [m, m_end) of x, 16 at a time (packed from m0 on in xa: amx_pack_x), against the pair G, G + 1 (wp, its
 * blocks unpacked into wb); returns the first row left (fewer than 16). A function of its own per weight kind: the caller's parallel region is one function for
 * both, and the accumulators need every register. */
#define AMX_ROWS_LOOP(BITS)                                                                                        \
    {                                                                                                              \
        const int blocks = K / 32;                                                                                 \
        amx_unpack(BITS, wp, wp1, wb, blocks);                                                                     \
        for (; m + AMX_ROWS <= m_end; m += AMX_ROWS)                                                               \
            amx_tile16(BITS, wb, s8, o8, half, xa + (size_t)(m - m0) * K, xscale + (size_t)m * blocks,               \
                       xsum + (size_t)m * blocks,                                                                  \
                       y + (size_t)m * N, N, K, groups, per_group);                                                \
        return m;                                                                                                  \
    }
static __attribute__((noinline)) int amx_rows_int4(const uint8_t *wp, const uint8_t *wp1, uint8_t *wb, const void *s8,
                                                   const void *o8, const int half, const int8_t *xa, int m0,
                                                   const float *xscale, const float *xsum, float *y, int m, int m_end,
                                                   int N, int K, int groups, int per_group) AMX_ROWS_LOOP(4)
static __attribute__((noinline)) int amx_rows_int8(const uint8_t *wp, const uint8_t *wp1, uint8_t *wb, const void *s8,
                                                   const void *o8, const int half, const int8_t *xa, int m0,
                                                   const float *xscale, const float *xsum, float *y, int m, int m_end,
                                                   int N, int K, int groups, int per_group) AMX_ROWS_LOOP(8)
#else
#define AMX 0
static const int use_tiles = 0;
int cpu_gemv_tiles(int on) { (void)on; return 0; }
#endif

/* -128 times the sum of each int8 block of x rows [begin, end), into xcorr (see int8_tile) */
static void int8_corrections(const int8_t *xq, int32_t *xcorr, int begin, int end, int K) {
    for (size_t i = (size_t)begin * (K / 32); i < (size_t)end * (K / 32); i++) {
        int32_t total = 0;
        for (int j = 0; j < 32; j++) total += xq[32 * i + j];
        xcorr[i] = -128 * total;
    }
}

/* From this many rows of x the threads round their shares of it: below, one thread is quicker than a barrier. */
#define PARALLEL_QUANTIZE_ROWS 8

/* Rows [begin, end) of x as int8 blocks with what the weights of `bits` need beside them: int4 each group's sum of
 * the rounded x (quantize_x), int8 the corrections in place of the sums (int8_corrections). */
static void prepare_x(const int bits, const float *x, int8_t *xq, float *xscale, float *xsum, int begin, int end, int K,
                      int groups, int per_group) {
    quantize_x(x, xq, xscale, xsum, begin, end, K, groups, per_group);
    if (bits == 8) int8_corrections(xq, (int32_t *)xsum, begin, end, K);
}

/* Work that a thread taken off its core does not hold up (not in AMX builds, whose threads pack x a pass each).
 * Each thread owns a range of row groups, as before, cut into items of STEAL_GROUPS groups a pass of x; it claims its
 * items in order from its range's counter, and then the other ranges' leftovers from theirs. On two vCPUs shared
 * with the API process, the benchmark client and their I/O threads, a thread preempted for a time slice used to
 * hold up the whole call (its partner waiting at the join); now the other thread finishes it (docs/quantization.md,
 * "A thread off its core holds up no call"). Which thread computes a group changes no bits (a tile's arithmetic is
 * its own); items begin at even offsets of a range, so row groups pair as before. The rows of x are rounded in items
 * too, and the threads wait for all of them (a counter, not a barrier: a preempted thread holding no item delays
 * nothing). */
#define STEAL_WORK (!AMX)
#define STEAL_GROUPS 8        /* even: pairs of row groups stay whole */
#define QUANTIZE_ITEM_ROWS 4
typedef struct {
    int next __attribute__((aligned(64)));  /* a line each: the threads' claims do not contend */
} Counter;

/* Row groups [G, G_end) of one thread's range over rows [m0, m_end) of x: the tiles of interleaved_gemv. */
static inline __attribute__((always_inline)) void multiply_groups(
    const int bits, const int8_t *xq, const float *xscale, const float *xsum, const uint8_t *packed,
    const void *scale, const void *offset, const int half, float *y, float *tile, int M, int N, int K, int groups,
    int per_group, int G, const int G_end, const int m0, const int m_end) {
    const int blocks = K / 32;
    const size_t group_bytes = (size_t)blocks * (bits == 4 ? 128 : 256), group_scales = bits == 4 ? groups * 8 : 8;
    const size_t scale_bytes = half ? 2 : 4;
    for (; G < G_end; G++) {
        const int pair = PAIRS && M >= PAIR_ROWS && G + 1 < G_end, width = pair ? 16 : 8;
        const uint8_t *wp = packed + (size_t)G * group_bytes;
        const void *s8 = (const char *)scale + (size_t)G * group_scales * scale_bytes;
        const void *o8 = bits == 4 ? (const char *)offset + (size_t)G * group_scales * scale_bytes : NULL;
        const int lanes = N - 8 * G < width ? N - 8 * G : width;
        /* 5-6 rows in pairs: two tiles (3 + 2, 3 + 3), so that they prefetch the next pair (to_next) */
        const int split = pair && m_end - m0 > TILE_ROWS && m_end - m0 <= LAST_TILE_ROWS;
        const int several = PREFETCH_NEXT_GROUP && (m_end - m0 > LAST_TILE_ROWS || split);  /* tiles a group */
        const size_t to_next = several ? (size_t)(width / 8) * group_bytes : 0;
        for (int m = m0, R; m < m_end; m += R) {
            const int8_t *xm = xq + (size_t)m * K;
            const float *xs = xscale + (size_t)m * blocks, *xt = xsum + (size_t)m * blocks;
            if (split)
                R = m_end - m > 3 ? 3 : m_end - m;
            else
                R = m_end - m <= LAST_TILE_ROWS ? m_end - m : TILE_ROWS;  /* 5 or 6 rows left: one tile */
            const int direct = lanes == width;  /* a whole group's columns go straight into y's rows */
            float *out = direct ? y + (size_t)m * N + 8 * G : tile;
            const int ldy = direct ? N : width;
            if (bits == 4) {
#if PAIRS
                if (pair) TILE_CALL(int4_tile16, to_next, wp, s8, o8, half, xm, xs, xt, out, ldy, K, groups, per_group) else
#endif
                TILE_CALL(int4_tile, to_next, wp, s8, o8, half, xm, xs, xt, out, ldy, K, groups, per_group)
            } else {
                const int32_t *xc = (const int32_t *)xt;
#if PAIRS
                if (pair) TILE_CALL(int8_tile16, to_next, wp, (const float *)s8, xm, xs, xc, out, ldy, K) else
#endif
                TILE_CALL(int8_tile, wp, (const float *)s8, xm, xs, xc, out, ldy, K)
            }
            if (!direct)
                for (int r = 0; r < R; r++)
                    for (int i = 0; i < lanes; i++) y[(size_t)(m + r) * N + 8 * G + i] = tile[width * r + i];
        }
        G += pair;
    }
}

/* y [M, N] = x [M, K] W^T, W 4-bit (bits 4) or 8-bit (bits 8, group 32, offset NULL) in its layout above, K a
 * multiple of the group (a multiple of 32); half: int4's scales and offsets are float16 (load_scales8), else float32
 * (int8's always). scratch: M * K bytes + 2 * M * K / 32 floats, for x as int8 blocks
 * (quantize_rows). Each thread takes its own range of row groups through every pass over x (and, STEAL_WORK, what
 * is left of the others'); from PAIR_ROWS rows of x, two row groups a vector where built for AVX-512. A tile stores a
 * row group's columns straight into y's rows (ldy: y's row stride); only a group cut short by N's end goes through a
 * buffer, whose copy was a scalar load and store per output. */
static inline __attribute__((always_inline)) void interleaved_gemv(const int bits, const float *x, void *scratch,
                                                                   const uint8_t *packed, const void *scale,
                                                                   const void *offset, const int half, float *y, int M,
                                                                   int N, int K, int group, int threads) {
    const int per_group = group / 32, groups = K / group, blocks = K / 32, row_groups = (N + 7) / 8;
    float *xscale = (float *)scratch, *xsum = xscale + (size_t)M * blocks;
    int8_t *xq = (int8_t *)(xsum + (size_t)M * blocks);
    const int parallel_quantize = M >= PARALLEL_QUANTIZE_ROWS;
    if (!parallel_quantize) prepare_x(bits, x, xq, xscale, xsum, 0, M, K, groups, per_group);
    const int tiles = AMX && use_tiles && M >= AMX_MIN_ROWS, step = tiles ? AMX_ROWS : TILE_ROWS;
    int pass = PASS_BYTES / K / step * step;
    if (pass < step) pass = step;
#if STEAL_WORK
    Counter claims[threads], rounding, rounded;  /* items taken of each range; rows of x taken, and rounded */
    for (int i = 0; i < threads; i++) claims[i].next = 0;
    rounding.next = rounded.next = 0;
    const int passes = (M + pass - 1) / pass;
#pragma omp parallel num_threads(threads)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        float tile[LAST_TILE_ROWS * 16];
        if (parallel_quantize) {  /* a row's bits do not depend on which thread rounds it */
            for (int r; (r = __atomic_fetch_add(&rounding.next, QUANTIZE_ITEM_ROWS, __ATOMIC_RELAXED)) < M;) {
                const int r_end = r + QUANTIZE_ITEM_ROWS < M ? r + QUANTIZE_ITEM_ROWS : M;
                prepare_x(bits, x, xq, xscale, xsum, r, r_end, K, groups, per_group);
                __atomic_fetch_add(&rounded.next, r_end - r, __ATOMIC_RELEASE);
            }
            while (__atomic_load_n(&rounded.next, __ATOMIC_ACQUIRE) < M) _mm_pause();
        }
        for (int k = 0; k < nt; k++) {  /* its own range first, then the others' leftovers */
            const int u = (t + k) % nt;
            const int g_begin = (int)((long)row_groups * u / nt), g_end = (int)((long)row_groups * (u + 1) / nt);
            const int items = (g_end - g_begin + STEAL_GROUPS - 1) / STEAL_GROUPS;
            for (int i; (i = __atomic_fetch_add(&claims[u].next, 1, __ATOMIC_RELAXED)) < items * passes;) {
                const int m0 = i / items * pass, G = g_begin + i % items * STEAL_GROUPS;
                multiply_groups(bits, xq, xscale, xsum, packed, scale, offset, half, y, tile, M, N, K, groups,
                                per_group, G, G + STEAL_GROUPS < g_end ? G + STEAL_GROUPS : g_end, m0,
                                m0 + pass < M ? m0 + pass : M);
            }
        }
    }
#else
    const size_t group_bytes = (size_t)blocks * (bits == 4 ? 128 : 256), group_scales = bits == 4 ? groups * 8 : 8;
#pragma omp parallel num_threads(threads)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int g_begin = (int)((long)row_groups * t / nt), g_end = (int)((long)row_groups * (t + 1) / nt);
        if (parallel_quantize) {  /* a row's bits do not depend on which thread rounds it */
            prepare_x(bits, x, xq, xscale, xsum, (int)((long)M * t / nt), (int)((long)M * (t + 1) / nt), K, groups,
                      per_group);
#pragma omp barrier
        }
        float tile[LAST_TILE_ROWS * 16];
#if AMX
        uint8_t *wb = tiles ? aligned_alloc(64, (size_t)blocks * 512) : NULL;  /* the pair's blocks as tile B rows */
        int8_t *xa = tiles ? aligned_alloc(64, (size_t)pass * K) : NULL;        /* this thread's copy of a pass's tiles */
        if (tiles) amx_configure();
#endif
        for (int m0 = 0; m0 < M; m0 += pass) {
            const int m_end = m0 + pass < M ? m0 + pass : M;
#if AMX
            if (tiles) amx_pack_x(xq, xa, m0, m_end, K);
#endif
            for (int G = g_begin; G < g_end; G++) {
                int m = m0;
#if AMX
                const int pair = PAIRS && M >= PAIR_ROWS && G + 1 < g_end, lanes = N - 8 * G < 16 ? N - 8 * G : 16;
                if (tiles && pair && lanes == 16 && m_end - m0 >= AMX_ROWS) {
                    const uint8_t *wp = packed + (size_t)G * group_bytes;
                    const size_t scale_bytes = half ? 2 : 4;
                    const void *s8 = (const char *)scale + (size_t)G * group_scales * scale_bytes;
                    const void *o8 = bits == 4 ? (const char *)offset + (size_t)G * group_scales * scale_bytes : NULL;
                    m = (bits == 4 ? amx_rows_int4 : amx_rows_int8)(wp, wp + group_bytes, wb, s8, o8, half, xa, m0,
                                                                    xscale, xsum, y + 8 * G, m, m_end, N, K, groups,
                                                                    per_group);
                }
#endif
                /* the rows AMX left (or all): this group, or its pair where it starts one */
                const int last = PAIRS && M >= PAIR_ROWS && G + 1 < g_end ? G + 2 : G + 1;
                if (m < m_end)
                    multiply_groups(bits, xq, xscale, xsum, packed, scale, offset, half, y, tile, M, N, K, groups,
                                    per_group, G, last, m, m_end);
                G = last - 1;
            }
        }
#if AMX
        if (tiles) {
            _tile_release();  /* back to the init state: a context switch saves no tile data */
            free(wb);
            free(xa);
        }
#endif
    }
#endif
}

void int4_gemv(const float *x, void *scratch, const uint8_t *packed, const void *scale, const void *offset, int half,
               float *y, int M, int N, int K, int group, int threads) {
    interleaved_gemv(4, x, scratch, packed, scale, offset, half, y, M, N, K, group, threads);
}

void int8_gemv(const float *x, void *scratch, const uint8_t *packed, const float *scale, float *y, int M, int N, int K,
               int threads) {
    interleaved_gemv(8, x, scratch, packed, scale, NULL, 0, y, M, N, K, 32, threads);
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
