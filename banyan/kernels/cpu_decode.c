/* The small ops of a decoder layer fused for float32 on x86 CPUs with AVX2 (built into the same library as
 * cpu_gemv.c; banyan/kernels/cpu_decode.py binds them). A decode step of a small model is dozens of tiny
 * torch ops per layer, each a few microseconds of dispatch for a few hundred floats of work; these do the
 * same math in one call each:
 *
 *     rms_norm         s = x + residual (optional), y = (s / sqrt(mean(s^2) + eps)) * w
 *     rope_store_kv    q, k rotated in place (neox rotate_half), k and v written to their cache slot
 *     paged_attention  each row over the keys it sees, from the pages where they lie
 *     silu_mul         y = silu(gate) * up, gate and up the halves of one row (float32, or bf16: silu_mul_bf16)
 *
 * The KV cache is float32 or float16 (KV_F16), and attention also reads fp8 (KV_FP8: float8_e4m3fn holding K/V
 * divided by a scale; torch writes it): a decode row's attention reads every key and value of its context once,
 * so at long contexts it is memory-bound, and fewer bytes a value is less time. F16C converts 8 values an
 * instruction, rounding to nearest even as torch's .half() does, so either path writes the same bits.
 *
 * Every row is computed alone and in a fixed order (position order in attention), so its bits do not depend
 * on the other rows of the batch, which batch-invariant mode needs.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

enum { KV_F32 = 0, KV_F16 = 1, KV_FP8 = 2 };  /* a cache's element: banyan/kernels/cpu_decode.py's kv_kind */

static inline __attribute__((always_inline)) int kv_bytes(const int kind) {
    return kind == KV_FP8 ? 1 : kind == KV_F16 ? 2 : 4;
}

/* Eight cache values from element i on as float32, exactly: float16 widened; fp8 e4m3fn (s eeee mmm, bias 7) moved
 * into float16's fields (the exponent's field read with bias 15: 2^(e-15) (1 + m/8), or m 2^-17 for e = 0, which
 * vcvtph2ps widens exactly whatever the denormal mode), so 2^-8 times its value: paged_attention and flash_prefill
 * take the 2^8 into their scales (the same bits as each value times 2^8; three operations a vector instead of eight:
 * decode attention over fp8 pages 1.13-1.19x). kind is a constant where inlined. */
static inline __attribute__((always_inline)) __m256 load_kv(const void *cache, size_t i, const int kind) {
    if (kind == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + i)));
    if (kind == KV_FP8) {  /* sign-extended, times 2^7: s s eeee mmm 0000000; the sign's copy cleared */
        const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)cache + i)));
        return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16((short)0xBFFF)));
    }
    return _mm256_loadu_ps((const float *)cache + i);
}

/* What scores and outputs over a cache of `kind` are scaled by, for load_kv's values: kv_scale (an fp8 cache holds
 * K / kv_scale and V / kv_scale), times 2^8 for fp8, which load_kv reads as 2^-8 times its values. */
static inline float kv_read_scale(int kind, float kv_scale) { return kind == KV_FP8 ? 256.0f * kv_scale : kv_scale; }

/* The cache lines of `width` values from element i on, into L2 ahead of use. Into L1 (T0) each prefetch held one of
 * the core's few L1 miss buffers until its line came, and a decode row stalled on its own prefetch instructions (a
 * quarter of the kernel's samples on a Zen 4); into L2 the loads find them there, and decode attention from memory ran
 * 1.35-1.4x faster with a pool's scattered pages (benchmarks/paged_attention_ab.py, 2026-12-02). */
static inline __attribute__((always_inline)) void prefetch_kv(const void *cache, size_t i, int width, const int kind) {
    const char *at = (const char *)cache + i * kv_bytes(kind);
    for (int b = 0; b < width * kv_bytes(kind); b += 64) _mm_prefetch(at + b, _MM_HINT_T1);
}

#define PREFETCH_KEYS 64 /* how far ahead a decode row fetches its K rows (32 and 128 measured no better) */

/* What a row reading in place fetches ahead of a key. 1: the first KV head's item every head's part of the key's row
 * (one run of memory: the next heads find theirs in cache), the others their own; measured faster on a Zen 4
 * (82b53a4). 0: each head its own; on an Intel Xeon with AMX (one build per ISA: this is that build) the whole rows
 * tied up its miss buffers, a third of the kernel's samples sat on prefetch instructions, and each head its own was
 * 1.08-1.18x faster in every decode case of benchmarks/paged_attention_ab.py (2 threads, 2026-12-04). */
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define FETCH_WHOLE_ROWS 0
#else
#define FETCH_WHOLE_ROWS 1
#endif

/* exp on the lanes of a W-bit vector (exp8: 256, exp16: 512, the same operations a lane, so the same bits): e^x =
 * 2^n e^r with n = round(x log2 e), |r| <= ln2/2, e^r by a degree-6 polynomial (the Cephes coefficients); relative
 * error about 2e-7. Inputs are clamped to +-88.37 (float's range). */
#define EXP_LANES(W, x)                                                                                            \
    do {                                                                                                           \
        const __m##W bound = _mm##W##_set1_ps(88.3762626647949f);                                                  \
        x = _mm##W##_min_ps(_mm##W##_max_ps(x, _mm##W##_sub_ps(_mm##W##_setzero_ps(), bound)), bound);             \
        const __m##W n = _mm##W##_floor_ps(_mm##W##_fmadd_ps(x, _mm##W##_set1_ps(1.44269504088896341f),           \
                                                             _mm##W##_set1_ps(0.5f)));                             \
        __m##W r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(0.693359375f), x); /* ln 2 in two parts: exact n * hi */ \
        r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(-2.12194440e-4f), r);                                           \
        __m##W p = _mm##W##_set1_ps(1.9875691500e-4f);                                                             \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.3981999507e-3f));                                           \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(8.3334519073e-3f));                                           \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(4.1665795894e-2f));                                           \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.6666665459e-1f));                                           \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(5.0000001201e-1f));                                           \
        p = _mm##W##_fmadd_ps(p, _mm##W##_mul_ps(r, r), _mm##W##_add_ps(r, _mm##W##_set1_ps(1.0f)));               \
        const __m##W##i biased = _mm##W##_add_epi32(_mm##W##_cvtps_epi32(n), _mm##W##_set1_epi32(127));           \
        const __m##W##i e = _mm##W##_slli_epi32(biased, 23);                                                       \
        return _mm##W##_mul_ps(p, _mm##W##_castsi##W##_ps(e));                                                     \
    } while (0)

static inline __m256 exp8(__m256 x) { EXP_LANES(256, x); }
#if defined(__AVX512F__)
static inline __m512 exp16(__m512 x) { EXP_LANES(512, x); }
#endif

/* n floats through exp8, and their sum: lane l adds the elements l, l + 8, ... in order, then one fixed tree. The
 * tail goes through a zero-padded copy, so every element takes the same path, and only its n elements count. */
static inline float exp_shifted_sum(float *p, int n, float shift) {
    const __m256 s = _mm256_set1_ps(shift);
    __m256 total = _mm256_setzero_ps();
    int i = 0;
#if defined(__AVX512F__)
    /* 16 exponentials a vector (exp16: the same bits a lane), added into the 8 lanes in the same order */
    for (const __m512 s16 = _mm512_set1_ps(shift); i + 16 <= n; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + i), s16));
        _mm512_storeu_ps(p + i, e);
        total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
        total = _mm256_add_ps(total, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
#endif
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), s));
        _mm256_storeu_ps(p + i, e);
        total = _mm256_add_ps(total, e);
    }
    if (i < n) {
        float tail[8] = {0};
        for (int j = 0; i + j < n; j++) tail[j] = p[i + j];
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), s)));
        for (int j = n - i; j < 8; j++) tail[j] = 0.0f;
        total = _mm256_add_ps(total, _mm256_loadu_ps(tail));
        for (int j = 0; i + j < n; j++) p[i + j] = tail[j];
    }
    return hsum8(total);
}

/* x, y [rows, dim]; residual NULL or [rows, dim], in which case sum_out [rows, dim] gets x + residual and the
 * norm is of that sum. dim a multiple of 8. */
void rms_norm(const float *x, const float *residual, float *sum_out, const float *w, float *y, int rows, int dim,
              float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 32)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        if (residual != NULL) {
            const float *rr = residual + (size_t)r * dim;
            float *sr = sum_out + (size_t)r * dim;
            for (int i = 0; i < dim; i += 8)
                _mm256_storeu_ps(sr + i, _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(rr + i)));
            xr = sr;
        }
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < dim; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(xr + i), acc);
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc) / (float)dim + eps));
        float *yr = y + (size_t)r * dim;
        for (int i = 0; i < dim; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv), _mm256_loadu_ps(w + i)));
    }
}

/* One head of D = 2 * half values rotated in place: (a, b) -> (a cos - b sin, b cos + a sin) per pair
 * (x[i], x[i + half]), as q * cos + rotate_half(q) * sin computes it. half a multiple of 8. */
static inline void rotate(float *x, const float *c, const float *s, int half) {
    for (int i = 0; i < half; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
        __m256 ci = _mm256_loadu_ps(c + i), si = _mm256_loadu_ps(s + i);
        _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(a, ci), _mm256_mul_ps(b, si)));
        _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(b, ci), _mm256_mul_ps(a, si)));
    }
}

/* Eight float32 values as an fp8 cache stores them (8 bytes, the low half): times inv (1 / kv_scale), clamped to
 * [-448, 448] and rounded to float8_e4m3fn's nearest even, as torch's .to(float8_e4m3fn) rounds (c10's
 * fp8e4m3fn_from_fp32_value): below 2^-6 the integer nearest |x| 2^9 (a subnormal's code, 8 the smallest normal),
 * else float32's 23-bit mantissa rounded to 3 bits and its exponent rebased (bias 127 to 7); NaN stays NaN (0x7F). */
static inline uint64_t fp8_bytes(__m256 x, __m256 inv) {
    x = _mm256_mul_ps(x, inv);
    const __m256i bits = _mm256_castps_si256(x), nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
    const __m256 clamped = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-448.0f)), _mm256_set1_ps(448.0f));
    const __m256i a = _mm256_and_si256(_mm256_castps_si256(clamped), _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
    const __m256i normal = _mm256_sub_epi32(
        _mm256_srli_epi32(_mm256_add_epi32(a, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFFF))), 20),
        _mm256_set1_epi32((127 - 7) << 3));
    const __m256i tiny = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(512.0f)));
    __m256i code = _mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), a));
    code = _mm256_or_si256(_mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), nan), sign);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    return (uint64_t)_mm_cvtsi128_si64(_mm_packus_epi16(words, words));
}

/* Row t of q [T, H, D] (rows q_stride floats apart) and of k [T, KVH, D] (k_stride) rotated by the angles of
 * positions[t] (cos, sin: [max_pos, D / 2]); k and v (v_stride) rows then copied to slot slots[t] of the caches
 * [slots, KVH, D] (a negative slot: not stored), of kind KV_F32, KV_F16 (rounded to nearest even) or KV_FP8 (times
 * inv_scale, 1 / kv_scale: fp8_bytes). Returns how many positions fell outside [0, max_pos) (those rows are left as
 * they were). */
int rope_store_kv(float *q, int q_stride, float *k, int k_stride, const float *v, int v_stride,
                  const int64_t *positions, const float *cos_table, const float *sin_table, int max_pos,
                  void *k_cache, void *v_cache, const int64_t *slots, int T, int H, int KVH, int D, int kv_kind,
                  float inv_scale, int threads) {
    const int half = D / 2;
    int bad = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : bad) if (T >= 32)
    for (int t = 0; t < T; t++) {
        const int64_t pos = positions[t];
        if (pos < 0 || pos >= max_pos) {
            bad++;
            continue;
        }
        const float *c = cos_table + pos * half, *s = sin_table + pos * half;
        for (int h = 0; h < H; h++) rotate(q + (size_t)t * q_stride + (size_t)h * D, c, s, half);
        float *kt = k + (size_t)t * k_stride;
        const float *vt = v + (size_t)t * v_stride;
        for (int h = 0; h < KVH; h++) rotate(kt + (size_t)h * D, c, s, half);
        if (slots[t] < 0) continue;
        const size_t at = (size_t)slots[t] * KVH * D;
        if (kv_kind == KV_FP8) {
            uint8_t *kc = (uint8_t *)k_cache + at, *vc = (uint8_t *)v_cache + at;
            const __m256 inv = _mm256_set1_ps(inv_scale);
            for (int i = 0; i < KVH * D; i += 8) {
                const uint64_t kb = fp8_bytes(_mm256_loadu_ps(kt + i), inv);
                const uint64_t vb = fp8_bytes(_mm256_loadu_ps(vt + i), inv);
                __builtin_memcpy(kc + i, &kb, 8);
                __builtin_memcpy(vc + i, &vb, 8);
            }
            continue;
        }
        if (kv_kind == KV_F16) {
            uint16_t *kc = (uint16_t *)k_cache + at, *vc = (uint16_t *)v_cache + at;
            for (int i = 0; i < KVH * D; i += 8) {
                _mm_storeu_si128((__m128i *)(kc + i), _mm256_cvtps_ph(_mm256_loadu_ps(kt + i), _MM_FROUND_TO_NEAREST_INT));
                _mm_storeu_si128((__m128i *)(vc + i), _mm256_cvtps_ph(_mm256_loadu_ps(vt + i), _MM_FROUND_TO_NEAREST_INT));
            }
            continue;
        }
        float *kc = (float *)k_cache + at, *vc = (float *)v_cache + at;
        for (int i = 0; i < KVH * D; i++) {
            kc[i] = kt[i];
            vc[i] = vt[i];
        }
    }
    return bad;
}

/* The largest of p[0, n): eight lanes at a time (a maximum is exact in any order; libm's fmaxf was a call a key). */
static inline float max_of(const float *p, int n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(p + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    for (; j < n; j++) top = p[j] > top ? p[j] : top;
    return top;
}

/* _mm256_hadd_ps(a, b) from two shuffles and an add: the same sums, so the same bits. The scores' horizontal sums cost
 * about two thirds as much as their FMAs on a Zen 3 (perf); this way paged_attention_ab measured 0.97-1.07x a case
 * there, most 1.00-1.04x. */
static inline __m256 hadd8(__m256 a, __m256 b) {
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
}

/* Eight lanes' sums of eight vectors at once: out[u] = the sum of a[u]'s lanes, each added up in the same tree
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) whichever u it is. */
static inline __m256 hsum8x8(const __m256 a[8]) {
    __m256 u0 = hadd8(hadd8(a[0], a[1]), hadd8(a[2], a[3]));
    __m256 u1 = hadd8(hadd8(a[4], a[5]), hadd8(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* p[u] = scores' lane u for u < n */
static inline __attribute__((always_inline)) void store_first(__m256 scores, int n, float *p) {
    if (n == 8) {  /* the usual case: one store (a scalar copy through memory stalled on the store it reads) */
        _mm256_storeu_ps(p, scores);
        return;
    }
    float sums[8];
    _mm256_storeu_ps(sums, scores);
    for (int u = 0; u < n; u++) p[u] = sums[u];
}

/* p[u] = scale * (the lanes of acc[u] added up) for u < n */
static inline __attribute__((always_inline)) void store_scores(const __m256 acc[8], int n, float scale, float *p) {
    store_first(_mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)), n, p);
}

/* p[j] = scale * <q, k[keys[j], + D)> for j < n (n <= 8; keys[n..7] valid rows, their products dropped): eight
 * keys' dot products interleaved over D. */
static inline __attribute__((always_inline)) void score8(const float *q, const void *k, const size_t keys[8], int n,
                                                         int D, float scale, float *p, const int kind) {
    __m256 acc[8];
    for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(qd, load_kv(k, keys[u] + d, kind), acc[u]);
    }
    store_scores(acc, n, scale, p);
}

#if defined(__AVX512F__)
/* hadd_ps on 512 bits: each 128-bit lane [a0 + a1, a2 + a3, b0 + b1, b2 + b3] (a sum's two terms commute: hadd's bits) */
static inline __m512 hadd16(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/* store_scores of 8 keys held in pairs (pair[v]: key 2v's 8 lanes, then key 2v + 1's): each key's lanes added in
 * hsum8x8's tree, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), at 512 bits (half the operations of splitting
 * the pairs into 8 vectors of 256), so the same bits. */
static inline __attribute__((always_inline)) void store_scores_pairs(const __m512 pair[4], int n, float scale,
                                                                     float *p) {
    /* 128-bit lanes of c: keys 0, 2, 4, 6 lanes 0-3 summed, the same keys' lanes 4-7, then keys 1, 3, 5, 7 likewise */
    const __m512 c = hadd16(hadd16(pair[0], pair[1]), hadd16(pair[2], pair[3]));
    const __m512 sums = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0xB1));  /* lanes 0-3 + 4-7 of each key */
    const __m512 order = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0), sums);
    store_first(_mm256_mul_ps(_mm512_castps512_ps256(order), _mm256_set1_ps(scale)), n, p);
}
#endif

/* score8 over 8 key rows gathered by gather_keys; D a constant where inlined, so every load is one register and an
 * offset (eight row pointers spilled out of the registers). Same sums, same bits. With AVX-512 two keys a vector
 * (gather_keys puts their 8 values of a chunk side by side): half the FMAs, each lane's the same in the same order,
 * and each key's lanes added up in store_scores' tree as before (store_scores_pairs). Three heads a call, sharing
 * each load of the keys, measured 0.91x of a head a call in prefill tiles (GCC then kept none of the block in
 * registers between calls). */
static inline __attribute__((always_inline)) void score8_rows(const float *q, const float *rows, int n, const int D,
                                                              float scale, float *p) {
#if defined(__AVX512F__)
    __m512 pair[4];
    for (int v = 0; v < 4; v++) pair[v] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        const __m512 qd = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q + d))));
        for (int v = 0; v < 4; v++)
            pair[v] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(rows + ((size_t)d + 2 * v) * 8), pair[v]);
    }
    store_scores_pairs(pair, n, scale, p);
#else
    __m256 acc[8];
    for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(rows + u * D + d), acc[u]);
    }
    store_scores(acc, n, scale, p);
#endif
}

/* score8 for NH (2 or 3) query heads at once over 4 keys read in place: p[h][u] = scale * <q + h * D, k[keys[u],
 * + D)> for u < n (n <= 4). Each key row is loaded (and widened) once for every head; each dot product is added up
 * in score8's very tree (hsum8x8's lanes), so a score has the same bits either way. */
static inline __attribute__((always_inline)) void score4_heads(const float *q, const int NH, const void *k,
                                                               const size_t keys[4], int n, int D, float scale,
                                                               float *const p[3], const int kind) {
    __m256 acc[3][4];
    for (int h = 0; h < NH; h++)
        for (int u = 0; u < 4; u++) acc[h][u] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m256 qd[3];
        for (int h = 0; h < NH; h++) qd[h] = _mm256_loadu_ps(q + (size_t)h * D + d);
        for (int u = 0; u < 4; u++) {
            const __m256 kd = load_kv(k, keys[u] + d, kind);
            for (int h = 0; h < NH; h++) acc[h][u] = _mm256_fmadd_ps(qd[h], kd, acc[h][u]);
        }
    }
    for (int h = 0; h < NH; h++) {  /* ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), as hsum8x8 */
        const __m256 u = hadd8(hadd8(acc[h][0], acc[h][1]), hadd8(acc[h][2], acc[h][3]));
        const __m128 scores = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)), _mm_set1_ps(scale));
        float sums[4];
        _mm_storeu_ps(sums, scores);
        for (int i = 0; i < n; i++) p[h][i] = sums[i];
    }
}

/* score8 over the 8 keys of one run of a page (cache rows one token apart): key u at k + at + u * token. Two row
 * pointers and the stride keep every address in registers (score8's eight offsets spill in the big loops). The same
 * sums in the same order: the same bits. */
static inline __attribute__((always_inline)) void score8_run(const float *q, const void *k, size_t at, size_t token,
                                                             const int D, float scale, float *p, const int kind) {
    const char *r0 = (const char *)k + at * kv_bytes(kind), *r4 = r0 + 4 * token * kv_bytes(kind);
    const size_t t1 = token * kv_bytes(kind), t3 = 3 * t1;
    __m256 acc[8];
    for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        const size_t b = (size_t)d * kv_bytes(kind);
        acc[0] = _mm256_fmadd_ps(qd, load_kv(r0 + b, 0, kind), acc[0]);
        acc[1] = _mm256_fmadd_ps(qd, load_kv(r0 + t1 + b, 0, kind), acc[1]);
        acc[2] = _mm256_fmadd_ps(qd, load_kv(r0 + 2 * t1 + b, 0, kind), acc[2]);
        acc[3] = _mm256_fmadd_ps(qd, load_kv(r0 + t3 + b, 0, kind), acc[3]);
        acc[4] = _mm256_fmadd_ps(qd, load_kv(r4 + b, 0, kind), acc[4]);
        acc[5] = _mm256_fmadd_ps(qd, load_kv(r4 + t1 + b, 0, kind), acc[5]);
        acc[6] = _mm256_fmadd_ps(qd, load_kv(r4 + 2 * t1 + b, 0, kind), acc[6]);
        acc[7] = _mm256_fmadd_ps(qd, load_kv(r4 + t3 + b, 0, kind), acc[7]);
    }
    store_scores(acc, 8, scale, p);
}

/* score8_run for 3 query heads at once, 4 keys at a time (score4_heads over a run): each key's chunk loaded and widened
 * once for all three. Each dot product in score8's tree: the same bits. */
static inline __attribute__((always_inline)) void score3x8_run(const float *q, const void *k, size_t at, size_t token,
                                                               const int D, float scale, float *const p[3],
                                                               const int kind) {
    const size_t t1 = token * kv_bytes(kind), t3 = 3 * t1;
    for (int half = 0; half < 2; half++) {
        const char *r0 = (const char *)k + (at + (size_t)half * 4 * token) * kv_bytes(kind);
        __m256 acc[3][4];
        for (int h = 0; h < 3; h++)
            for (int u = 0; u < 4; u++) acc[h][u] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            const size_t b = (size_t)d * kv_bytes(kind);
            const __m256 q0 = _mm256_loadu_ps(q + d), q1 = _mm256_loadu_ps(q + D + d), q2 = _mm256_loadu_ps(q + 2 * D + d);
            __m256 kd = load_kv(r0 + b, 0, kind);
            acc[0][0] = _mm256_fmadd_ps(q0, kd, acc[0][0]), acc[1][0] = _mm256_fmadd_ps(q1, kd, acc[1][0]), acc[2][0] = _mm256_fmadd_ps(q2, kd, acc[2][0]);
            kd = load_kv(r0 + t1 + b, 0, kind);
            acc[0][1] = _mm256_fmadd_ps(q0, kd, acc[0][1]), acc[1][1] = _mm256_fmadd_ps(q1, kd, acc[1][1]), acc[2][1] = _mm256_fmadd_ps(q2, kd, acc[2][1]);
            kd = load_kv(r0 + 2 * t1 + b, 0, kind);
            acc[0][2] = _mm256_fmadd_ps(q0, kd, acc[0][2]), acc[1][2] = _mm256_fmadd_ps(q1, kd, acc[1][2]), acc[2][2] = _mm256_fmadd_ps(q2, kd, acc[2][2]);
            kd = load_kv(r0 + t3 + b, 0, kind);
            acc[0][3] = _mm256_fmadd_ps(q0, kd, acc[0][3]), acc[1][3] = _mm256_fmadd_ps(q1, kd, acc[1][3]), acc[2][3] = _mm256_fmadd_ps(q2, kd, acc[2][3]);
        }
        for (int h = 0; h < 3; h++) {  /* ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), as hsum8x8 */
            const __m256 u = hadd8(hadd8(acc[h][0], acc[h][1]), hadd8(acc[h][2], acc[h][3]));
            _mm_storeu_ps(p[h] + 4 * half, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)),
                                                      _mm_set1_ps(scale)));
        }
    }
}

/* p[h * stride + u] = scale * <q + h * D, key u> for the group's heads h and the 8 keys of a page's run from cache
 * element at on: score3x8_run for groups of 3, else score8_run a head. Also a function of its own for each kind
 * (score_run_*), called from the big loops of attend_tile_heads, whose registers its pointers would not fit. */
static inline __attribute__((always_inline)) void score_run(const float *q, const void *k, size_t at, size_t token,
                                                            int group, const int D, float scale, float *p,
                                                            size_t stride, const int kind) {
    if (group == 3) {
        float *const ph[3] = {p, p + stride, p + 2 * stride};
        score3x8_run(q, k, at, token, D, scale, ph, kind);
        return;
    }
    for (int h = 0; h < group; h++) score8_run(q + (size_t)h * D, k, at, token, D, scale, p + h * stride, kind);
}
#define SCORE_RUN_FN(NAME, D_, KIND)                                                                                   \
    static __attribute__((noinline)) void NAME(const float *q, const void *k, size_t at, size_t token, int group,     \
                                               int D, float scale, float *p, size_t stride) {                         \
        (void)D;                                                                                                       \
        score_run(q, k, at, token, group, D_, scale, p, stride, KIND);                                                 \
    }
SCORE_RUN_FN(score_run_f16_64, 64, KV_F16)
SCORE_RUN_FN(score_run_f16, D, KV_F16)
SCORE_RUN_FN(score_run_fp8, D, KV_FP8)
SCORE_RUN_FN(score_run_f32, D, KV_F32)
#undef SCORE_RUN_FN

/* o[0, width) += sum_j p[j] * v[at + slot[j] * token, + width) in j order, width <= 64: the sums stay in registers. */
static inline __attribute__((always_inline)) void weighted_add(const float *p, const void *v, size_t at,
                                                               const uint32_t *slot, size_t token, int n, int width,
                                                               float *o, const int kind) {
    __m256 acc[8];
    const int lanes = width / 8;
    for (int r = 0; r < lanes; r++) acc[r] = _mm256_loadu_ps(o + 8 * r);
    if (lanes == 8) {
        for (int j = 0; j < n; j++) {
            const __m256 w = _mm256_set1_ps(p[j]);
            const size_t row = at + slot[j] * token;
            for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(w, load_kv(v, row + 8 * r, kind), acc[r]);
        }
    } else {
        for (int j = 0; j < n; j++) {
            const __m256 w = _mm256_set1_ps(p[j]);
            const size_t row = at + slot[j] * token;
            for (int r = 0; r < lanes; r++) acc[r] = _mm256_fmadd_ps(w, load_kv(v, row + 8 * r, kind), acc[r]);
        }
    }
    for (int r = 0; r < lanes; r++) _mm256_storeu_ps(o + 8 * r, acc[r]);
}

#if defined(__AVX512F__)
/* load_kv on 16 lanes: the same bits */
static inline __attribute__((always_inline)) __m512 load_kv16(const void *cache, size_t i, const int kind) {
    if (kind == KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + i)));
    if (kind == KV_FP8) {
        const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)cache + i)));
        return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16((short)0xBFFF)));
    }
    return _mm512_loadu_ps((const float *)cache + i);
}

/* weighted_add_heads (and _rows: slot NULL, row j at at + j * token) 16 columns a vector, lanes even: each output
 * takes the same FMAs in the same order, so the same bits as 8 a vector; half the FMAs and loads (prefill tiles and
 * shared-prompt decode 1.03-1.08x on an AMX Xeon, paged_attention_ab). */
static inline __attribute__((always_inline)) void weighted_add_heads16(const float *const p[3], const int NH,
                                                                       const void *v, size_t at, const uint32_t *slot,
                                                                       size_t token, int n, const int lanes,
                                                                       float *const o[3], const int kind) {
    __m512 acc[3][4];
    for (int h = 0; h < NH; h++)
        for (int r = 0; r < lanes / 2; r++) acc[h][r] = _mm512_loadu_ps(o[h] + 16 * r);
    for (int j = 0; j < n; j++) {
        const size_t row = at + (slot != NULL ? slot[j] : (size_t)j) * token;
        __m512 w[3];
        for (int h = 0; h < NH; h++) w[h] = _mm512_set1_ps(p[h][j]);
        for (int r = 0; r < lanes / 2; r++) {
            __m512 vr = load_kv16(v, row + 16 * r, kind);
            __asm__("" : "+v"(vr));  /* one load a V vector: GCC folded it into each head's FMA, three loads a vector */
            for (int h = 0; h < NH; h++) acc[h][r] = _mm512_fmadd_ps(w[h], vr, acc[h][r]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int r = 0; r < lanes / 2; r++) _mm512_storeu_ps(o[h] + 16 * r, acc[h][r]);
}
#endif

/* weighted_add for NH (1 to 3) heads at once over width <= 32 floats (64 with AVX-512's registers; lanes = width / 8):
 * o[h] += sum_j p[h][j] * v[slot[j]] in j order, each V row loaded once for every head (the same FMAs in the same
 * order for each output, so the same bits). */
static inline __attribute__((always_inline)) void weighted_add_heads(const float *const p[3], const int NH, const void *v,
                                                                     size_t at, const uint32_t *slot, size_t token, int n,
                                                                     const int lanes, float *const o[3], const int kind) {
#if defined(__AVX512F__)
    if (lanes % 2 == 0) {
        weighted_add_heads16(p, NH, v, at, slot, token, n, lanes, o, kind);
        return;
    }
#endif
    __m256 acc[3][8];
    for (int h = 0; h < NH; h++)
        for (int r = 0; r < lanes; r++) acc[h][r] = _mm256_loadu_ps(o[h] + 8 * r);
    for (int j = 0; j < n; j++) {  /* 12 sums, 3 weights and a V vector: the 16 registers (24 sums: AVX-512's 32) */
        const size_t row = at + slot[j] * token;
        __m256 w[3];
        for (int h = 0; h < NH; h++) w[h] = _mm256_set1_ps(p[h][j]);
        for (int r = 0; r < lanes; r++) {
            const __m256 vr = load_kv(v, row + 8 * r, kind);
            for (int h = 0; h < NH; h++) acc[h][r] = _mm256_fmadd_ps(w[h], vr, acc[h][r]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int r = 0; r < lanes; r++) _mm256_storeu_ps(o[h] + 8 * r, acc[h][r]);
}

/* weighted_add_heads over V rows gathered one after another, 8 * lanes columns each (rows [n, 8 * lanes], lanes 4, or 8
 * with AVX-512's 32 registers): one pointer walks them, no slot lookups. Same FMAs in the same order, same bits. */
static inline __attribute__((always_inline)) void weighted_add_heads_rows(const float *const p[3], const int NH,
                                                                          const float *rows, int n, const int lanes,
                                                                          float *const o[3]) {
#if defined(__AVX512F__)
    if (lanes % 2 == 0) {
        weighted_add_heads16(p, NH, rows, 0, NULL, (size_t)8 * lanes, n, lanes, o, KV_F32);
        return;
    }
#endif
    __m256 acc[3][8];
    for (int h = 0; h < NH; h++)
        for (int r = 0; r < lanes; r++) acc[h][r] = _mm256_loadu_ps(o[h] + 8 * r);
    for (int j = 0; j < n; j++, rows += 8 * lanes) {
        __m256 w[3];
        for (int h = 0; h < NH; h++) w[h] = _mm256_set1_ps(p[h][j]);
        for (int r = 0; r < lanes; r++) {
            const __m256 vr = _mm256_loadu_ps(rows + 8 * r);
            for (int h = 0; h < NH; h++) acc[h][r] = _mm256_fmadd_ps(w[h], vr, acc[h][r]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int r = 0; r < lanes; r++) _mm256_storeu_ps(o[h] + 8 * r, acc[h][r]);
}

/* o[h] += sum_j p[h][j] * v[slot[j]] for nh (1 to 3) heads over width columns read in place (or from a gathered block:
 * kind KV_F32, slot its row order): weighted_add_heads where the width has its registers, else weighted_add a head.
 * NH and lanes reach the kernels as literals. */
static inline __attribute__((always_inline)) void weigh_values(const float *const ph[3], int nh, const void *v,
                                                               size_t at, const uint32_t *slot, size_t token, int n,
                                                               int width, float *const oh[3], const int kind) {
    if (width == 64 && nh == 3) weighted_add_heads(ph, 3, v, at, slot, token, n, 8, oh, kind);
    else if (width == 64 && nh == 2) weighted_add_heads(ph, 2, v, at, slot, token, n, 8, oh, kind);
    else if (width == 32 && nh == 3) weighted_add_heads(ph, 3, v, at, slot, token, n, 4, oh, kind);
    else if (width == 32 && nh == 2) weighted_add_heads(ph, 2, v, at, slot, token, n, 4, oh, kind);
    else
        for (int h = 0; h < nh; h++) weighted_add(ph[h], v, at, slot, token, n, width, oh[h], kind);
}

/* The first position a row at pos sees: pos - window + 1, or 0 (window 0: all of them) */
static inline int first_seen(int pos, int window) { return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0; }

/* A row's heads (heads of D floats from o on) divided by their sums of exponentials (times value_scale) */
static inline void divide_by_totals(float *o, int heads, int D, float value_scale, const float *totals) {
    for (int h = 0; h < heads; h++) {
        const __m256 inv = _mm256_set1_ps(value_scale / totals[h]);
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + (size_t)h * D + d, _mm256_mul_ps(_mm256_loadu_ps(o + (size_t)h * D + d), inv));
    }
}

#define V_BLOCK 32 /* keys whose V rows serve every head of a group from L1 (32 x 64 floats: 8 KiB) */

/* The K and V rows a tile of several query rows reads (a prefill chunk's) are gathered a block at a time into one
 * float32 buffer, one row after another (a float16 cache's widened, exactly), which every row and head of the tile
 * then reads with plain offsets, for head_dim up to this. A decode row and a tile of up to IN_PLACE_ROWS rows read
 * the cache in place (gathering would cost them more than it saves), as does every row of a larger head_dim. */
#define MAX_GATHER_HEAD_DIM 256

/* rows [0, n) of cache elements at + slot[j] * token, width values each, into buf [n, width] as float32 */
static inline __attribute__((always_inline)) void gather_rows(const void *cache, size_t at, const uint32_t *slot,
                                                              size_t token, int n, int width, float *buf, const int kind) {
    for (int j = 0; j < n; j++)
        for (int d = 0; d < width; d += 8)
            _mm256_storeu_ps(buf + (size_t)j * width + d, load_kv(cache, at + slot[j] * token + d, kind));
}

/* The 8 K rows of a score8_rows call gathered (float16 widened) in the layout it reads: with AVX-512 chunk d / 8 of
 * key u at (d + u) * 8, so that keys u and u + 1 lie side by side in 16 floats; else one key after another ([8, D]). */
static inline __attribute__((always_inline)) void gather_keys(const void *cache, size_t at, const uint32_t *slot,
                                                              size_t token, int D, float *buf, const int kind) {
#if defined(__AVX512F__)
    for (int u = 0; u < 8; u++)
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(buf + ((size_t)d + u) * 8, load_kv(cache, at + slot[u] * token + d, kind));
#else
    gather_rows(cache, at, slot, token, 8, D, buf, kind);
#endif
}

/* Query rows that go through the keys together: up to Q_TILE consecutive rows of one sequence (a prefill chunk's), or
 * the decode rows of up to Q_TILE sequences over the pages their tables begin with alike (a shared prompt's pages:
 * see plan_tiles). Must match banyan/kernels/cpu_decode.py's ATTENTION_TILE, which sizes the scratch. */
#define Q_TILE 8

/* Rows of one sequence (a verify pass's) that read their keys in place, each row on its own, rather than gathered once
 * for all of them: attend_rows_in_place. */
#ifndef IN_PLACE_ROWS
#define IN_PLACE_ROWS 4
#endif

/* Leading pages two decode rows' tables must have alike for the rows to read them together (not tuned: the 1,024-token
 * prompts measured share 64). */
#define MIN_SHARED_PAGES 2

/* The most floats a thread's scores may take to hold every query head of a full tile at once (16 MiB): a 9-head model
 * up to 57k keys, a 32-head one up to 16k. Past it a thread holds one KV head's, and a tile's KV heads go in items of
 * their own. */
#define WIDE_SCRATCH_FLOATS (4 << 20)

/* Score rows (query heads of tile rows, max_keys floats each) a thread's scratch holds; the slots follow them.
 * banyan/kernels/cpu_decode.py's attention_scratch sizes the scratch by the same rule. */
static inline int score_rows(int H, int KVH, int max_keys) {
    return (size_t)(Q_TILE * H + 1) * max_keys <= WIDE_SCRATCH_FLOATS ? Q_TILE * H : Q_TILE * (H / KVH);
}

/* This thread's part of the scratch: its scores, and past them (*slot) the cache row of each key of a span */
static inline float *thread_scratch(float *scratch, int H, int KVH, int max_keys, uint32_t **slot) {
    const size_t held = score_rows(H, KVH, max_keys);
    float *p = scratch + (size_t)omp_get_thread_num() * (held + 1) * max_keys;
    *slot = (uint32_t *)(p + held * max_keys);
    return p;
}

/* A tile's own pages (each row's past the pages its rows share: positions [first, pos[t]] of its table), fetched into
 * L2 a few lines at a time while the shared keys' passes compute: else both threads went through the shared keys
 * from cache while memory idled, then through their rows' own keys at memory's pace. The lines still unread when L2
 * fills move on to L3, from where the own passes read them. A cursor: row t, page (an index of its table), the byte
 * off within it up to end. */
typedef struct {
    const char *cache;
    const int32_t *table_of_row[Q_TILE], *pos;
    int rows, first, P;
    size_t token_bytes;
    int t, page;
    size_t off, end;
} OwnPages;

static inline OwnPages own_pages(const void *cache, const int32_t *tables, int table_stride, const int32_t *seq_of_row,
                                 const int32_t *positions, int rows, int first, int P, size_t token_bytes) {
    OwnPages a = {.cache = (const char *)cache, .pos = positions, .rows = rows, .first = first, .P = P,
                  .token_bytes = token_bytes, .t = -1};
    for (int t = 0; t < rows; t++) a.table_of_row[t] = tables + (size_t)seq_of_row[t] * table_stride;
    return a;
}

/* The most lines of own pages a shared tile fetches ahead in a pass (2 MiB): the first of them, which its own pass reads
 * first. Rows with long contexts of their own would otherwise fetch more than the caches keep until their pass comes. */
#define OWN_FETCH_LINES ((2 << 20) / 64)

/* The lines own_fetch has to fetch, about (each page's first may share a line with the page before's last) */
static inline size_t own_lines(const OwnPages *a) {
    size_t lines = 0;
    for (int t = 0; t < a->rows; t++)
        if (a->pos[t] >= a->first)
            lines += (size_t)(a->pos[t] - a->first + 1) * a->token_bytes / 64 + a->pos[t] / a->P - a->first / a->P + 1;
    return lines;
}

/* The next n lines of a's pages into L2 (none once all are) */
static inline void own_fetch(OwnPages *a, int n) {
    while (n > 0 && a->t < a->rows) {
        if (a->t < 0 || a->off >= a->end) {  /* the next page: this row's next, or the next row's first */
            if (a->t < 0 || ++a->page > a->pos[a->t] / a->P) {
                do
                    if (++a->t == a->rows) return;
                while (a->pos[a->t] < a->first);
                a->page = a->first / a->P;
            }
            const int lo = a->page == a->first / a->P ? a->first % a->P : 0;
            const int hi = a->page == a->pos[a->t] / a->P ? a->pos[a->t] % a->P + 1 : a->P;
            a->off = ((size_t)lo * a->token_bytes) & ~(size_t)63, a->end = (size_t)hi * a->token_bytes;
        }
        const char *page = a->cache + (size_t)a->table_of_row[a->t][a->page] * a->P * a->token_bytes;
        for (; n > 0 && a->off < a->end; n--, a->off += 64) _mm_prefetch(page + a->off, _MM_HINT_T1);
    }
}

/* One (tile, KV head) of attend_pages. Key j of the tile's span is position base + j, in cache row slot[j] (page * P +
 * offset); the tile's row t is q row rows[t] at position positions[t], seeing keys [first[t] - base, positions[t] -
 * base] of the span; its scores for query head g of this KV head lie at p + t * row_scores + g * max_keys. */
typedef struct {
    const float *q;          /* q + this KV head's first query head: row r's at q + r * q_stride */
    float *out;              /* out + this KV head's first query head: row r's at out + r * out_stride */
    const void *k_cache, *v_cache;
    const int32_t *rows, *positions;
    const int *first;
    int q_stride, out_stride, group, D, base, max_keys, P;
    size_t row_scores;       /* floats from a row's scores to the next row's: the heads of its item times max_keys */
    size_t token, head_at, fetch_at, fetch_width;  /* elements a token's row, this head's within it, what to prefetch */
    float scale, *p;
    uint32_t *slot;
    OwnPages *own;           /* NULL, or pages to fetch own_quota lines of a block while these passes compute */
    int own_quota;
} Tile;

/* What a key's prefetch covers for KV heads [kh0, kh1): the whole token row where KV head 0 leads (FETCH_WHOLE_ROWS),
 * else these heads' part. The width; *at the first element. */
static inline int fetch_range(int kh0, int kh1, int D, size_t token, size_t *at) {
    const int whole = FETCH_WHOLE_ROWS && kh0 == 0;
    *at = whole ? 0 : (size_t)kh0 * D;
    return whole ? (int)token : (kh1 - kh0) * D;
}

/* w (a tile's view of KV head 0, its scores those of the item's first KV head kh0) for KV head kh. A key's prefetch
 * covers this head's part of its row: a tile's pass goes a KV head at a time, and fetching whole rows ahead in the
 * first (FETCH_WHOLE_ROWS, for rows read in place) measured 0.93-0.97x in shared-prompt decode tiles and 0.97-0.98x
 * in prefill tiles on a Zen 4 (bursts of 6 lines a key held its misses; perf put 16% of a shared tile's samples on
 * the prefetches). */
static inline Tile head_view(Tile w, int kh, int kh0) {
    const size_t at = (size_t)kh * w.D;
    w.q += at * w.group, w.out += at * w.group, w.head_at = at;
    w.fetch_at = at, w.fetch_width = (size_t)w.D;
    w.p += (size_t)(kh - kh0) * w.group * w.max_keys;
    return w;
}

/* slot[j] for keys [jb, je) of the span: the cache rows `table` gives their positions */
static void fill_slots(const Tile *w, const int32_t *table, int jb, int je, int P) {
    for (int j = jb, page = (w->base + jb) / P, at = (w->base + jb) % P; j < je; j++) {  /* one division, not one a key */
        w->slot[j] = (uint32_t)table[page] * P + at;
        if (++at == P) at = 0, page++;
    }
}

/* Scores of rows [t0, t1) for keys [jb, je) (a row's keys it does not see, past its position or before its window,
 * are computed and never read), the K rows fetched ahead and, past je, the first V rows of [jb, je) where the V pass
 * of those keys comes next (then_values; else add_values fetches them). gather: the keys gathered 8 at a time (float16
 * widened) for every row and head (see MAX_GATHER_HEAD_DIM); else read in place. */
static inline __attribute__((always_inline)) void score_keys(const Tile *w, int t0, int t1, int jb, int je,
                                                             const int gather, const int then_values, const int kind) {
    const int D = w->D, group = w->group, n = then_values ? je - jb : 0;
    float block[8 * MAX_GATHER_HEAD_DIM];  /* 8 keys x D */
    for (int j = jb; j < je; j += 8) {
        const int m = je - j < 8 ? je - j : 8;
        size_t kr[8];
        for (int u = j == jb ? jb : j + PREFETCH_KEYS; u < j + PREFETCH_KEYS + 8 && u < je + n; u++)
            prefetch_kv(u < je ? w->k_cache : w->v_cache, w->fetch_at + w->slot[u < je ? u : u - n] * w->token,
                        w->fetch_width, kind);
        if (w->own != NULL) own_fetch(w->own, w->own_quota);
        if (gather) {
            uint32_t edge[8];
            for (int u = 0; u < 8; u++) edge[u] = w->slot[j + (u < m ? u : 0)];
            gather_keys(w->k_cache, w->head_at, edge, w->token, D, block, kind);  /* score8_rows reads it whole */
        } else
            for (int u = 0; u < 8; u++) kr[u] = w->head_at + w->slot[j + (u < m ? u : 0)] * w->token;
        const int run = !gather && m == 8 && (w->base + j) % w->P + 8 <= w->P;  /* 8 keys of one page */
        for (int t = t0; t < t1; t++) {
            const float *qr = w->q + (size_t)w->rows[t] * w->q_stride;
            if (run) {
                float *pt = w->p + t * w->row_scores + j;
                const size_t at = w->head_at + w->slot[j] * w->token;
                if (kind == KV_F16 && D == 64) score_run_f16_64(qr, w->k_cache, at, w->token, group, D, w->scale, pt, w->max_keys);
                else if (kind == KV_F16) score_run_f16(qr, w->k_cache, at, w->token, group, D, w->scale, pt, w->max_keys);
                else if (kind == KV_FP8) score_run_fp8(qr, w->k_cache, at, w->token, group, D, w->scale, pt, w->max_keys);
                else score_run_f32(qr, w->k_cache, at, w->token, group, D, w->scale, pt, w->max_keys);
                continue;
            }
            for (int g = 0; g < group; g++) {
                float *pg = w->p + t * w->row_scores + (size_t)g * w->max_keys + j;
                const int nh = group - g < 3 ? group - g : 3;
                if (!gather && kind == KV_FP8 && nh > 1) {  /* fp8 in place: each key widened once for 2-3 heads */
                    float *ph[3], *ph4[3];
                    for (int h = 0; h < 3; h++) ph[h] = pg + (size_t)(h < nh ? h : 0) * w->max_keys, ph4[h] = ph[h] + 4;
                    const float *qg = qr + (size_t)g * D;
                    const int lo = m < 4 ? m : 4;
                    if (nh == 3) {
                        score4_heads(qg, 3, w->k_cache, kr, lo, D, w->scale, ph, kind);
                        if (m > 4) score4_heads(qg, 3, w->k_cache, kr + 4, m - 4, D, w->scale, ph4, kind);
                    } else {
                        score4_heads(qg, 2, w->k_cache, kr, lo, D, w->scale, ph, kind);
                        if (m > 4) score4_heads(qg, 2, w->k_cache, kr + 4, m - 4, D, w->scale, ph4, kind);
                    }
                    g += nh - 1;
                    continue;
                }
                if (!gather) score8(qr + (size_t)g * D, w->k_cache, kr, m, D, w->scale, pg, kind);
                else if (D == 64) score8_rows(qr + (size_t)g * D, block, m, 64, w->scale, pg);
                else if (D == 128) score8_rows(qr + (size_t)g * D, block, m, 128, w->scale, pg);
                else score8_rows(qr + (size_t)g * D, block, m, D, w->scale, pg);
            }
        }
    }
}

/* The output columns a V pass takes at a time: 8 registers of sums for one head, 4 for more; with AVX-512's 32
 * registers, 64 columns of three heads (24 registers). A column's sums are the same FMAs in the same order however
 * the columns are cut: the same bits. */
static inline int value_columns(int group) {
#if defined(__AVX512F__)
    (void)group;
    return 64;
#else
    return group > 1 ? 32 : 64;
#endif
}

/* out rows [t0, t1) += their weights times the V rows of keys [jb, je), each row's keys in position order, the V rows
 * fetched ahead: from the first on where other keys' passes came between (fetch_first), else as far on from where
 * score_keys' tail fetched them. gather: gathered a block at a time; else read in place. */
static inline __attribute__((always_inline)) void add_values(const Tile *w, int t0, int t1, int jb, int je,
                                                             const int gather, const int fetch_first, const int kind) {
    const int D = w->D, group = w->group;
    static const uint32_t in_order[V_BLOCK] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                               16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
    _Static_assert(V_BLOCK * 64 <= 8 * MAX_GATHER_HEAD_DIM, "a V block fits the gathering buffer");
    float block[8 * MAX_GATHER_HEAD_DIM];  /* a V block: V_BLOCK rows x 64 columns at most */
    const int cw = value_columns(group);
    for (int c = 0; c < D; c += cw)
        for (int j = jb; j < je; j += V_BLOCK) {
            const int j_end = je - j < V_BLOCK ? je : j + V_BLOCK, width = D - c < cw ? D - c : cw;
            /* the block's V rows: in the cache, or gathered once into `block` [j_end - j, width] */
            const void *values = w->v_cache;
            size_t value_at = w->head_at + c, value_token = w->token;
            if (c == 0)  /* V rows PREFETCH_KEYS ahead (the first of them: score_keys' tail, or here) */
                for (int u = fetch_first && j == jb ? jb : j + PREFETCH_KEYS; u < j_end + PREFETCH_KEYS && u < je; u++)
                    prefetch_kv(w->v_cache, w->fetch_at + w->slot[u] * w->token, w->fetch_width, kind);
            if (w->own != NULL) own_fetch(w->own, w->own_quota);
            if (gather) {
                gather_rows(w->v_cache, w->head_at + c, w->slot + j, w->token, j_end - j, width, block, kind);
                values = block, value_at = 0, value_token = (size_t)width;
            }
            for (int t = t0; t < t1; t++) {  /* each row's keys of this block, in position order */
                const int lo = w->first[t] - w->base, hi = w->positions[t] - w->base + 1;
                const int from = j > lo ? j : lo, to = j_end < hi ? j_end : hi;
                if (from >= to) continue;
                float *o = w->out + (size_t)w->rows[t] * w->out_stride;
                const float *pt = w->p + t * w->row_scores;
                if (group == 1) {
                    weighted_add(pt + from, values, value_at, gather ? in_order + (from - j) : w->slot + from,
                                 value_token, to - from, width, o + c, gather ? KV_F32 : kind);
                    continue;
                }
                for (int g = 0; g < group; g += 3) {
                    const float *ph[3];
                    float *oh[3];
                    for (int h = 0; h < 3; h++) {
                        const int gh = g + h < group ? g + h : g;
                        ph[h] = pt + (size_t)gh * w->max_keys + from;
                        oh[h] = o + (size_t)gh * D + c;
                    }
                    const int nh = group - g < 3 ? group - g : 3, n = to - from;
                    const uint32_t *vs = gather ? in_order + (from - j) : w->slot + from;
                    const float *gathered = block + (size_t)(from - j) * width;  /* when gather */
                    if (gather && width == 64 && nh == 3) weighted_add_heads_rows(ph, 3, gathered, n, 8, oh);
                    else if (gather && width == 64 && nh == 2) weighted_add_heads_rows(ph, 2, gathered, n, 8, oh);
                    else if (gather && width == 32 && nh == 3) weighted_add_heads_rows(ph, 3, gathered, n, 4, oh);
                    else if (gather && width == 32 && nh == 2) weighted_add_heads_rows(ph, 2, gathered, n, 4, oh);
                    else if (gather) weigh_values(ph, nh, values, value_at, vs, value_token, n, width, oh, KV_F32);
                    else weigh_values(ph, nh, values, value_at, vs, value_token, n, width, oh, kind);
                }
            }
        }
}

/* The end of the run of decode rows sharing pages that begins at row i (i + 1: none), and of the rows of one
 * sequence that begin there */
static inline int run_end(const int32_t *shared, int window, int n, int i) {
    int end = i + 1;
    if (shared != NULL && window == 0)
        while (end < n && shared[end] >= MIN_SHARED_PAGES) end++;
    return end;
}
static inline int sequence_end(const int32_t *seq_of_row, int n, int i) {
    int end = i + 1;
    while (end < n && seq_of_row[end] == seq_of_row[i]) end++;
    return end;
}

/* The tiles of n rows: tile i is rows [start[i], start[i + 1]), keys[i] how many keys from position 0 on all its
 * rows' tables give alike (0: one sequence's rows, one table for all its keys), in_place[i] whether its rows read
 * their keys in place (attend_rows_in_place) rather than gathered. Rows come in segments: a run of decode rows whose
 * tables begin with the same MIN_SHARED_PAGES pages or more (shared[i]: the leading pages row i's table has alike
 * with row i - 1's; cpu_decode.py's PagedRows puts such rows side by side), or the rows of one sequence (a prefill
 * chunk's, a verify pass's, a decode row alone). Each segment is cut evenly into tiles of at most Q_TILE rows, and
 * into more while the threads would have fewer than two (tile, KV head) items each: a run down to 2 rows a tile, a
 * sequence's rows (more than IN_PLACE_ROWS of them, whose tiles stay gathered) down to 2. So the 5-9 rows of a batch-1
 * verify pass make two tiles, six items for two threads, where 5-8 rows had made one tile (three items: one thread
 * did two while the other waited) and 9 rows 8 + 1. A run's tile's shared keys: the fewest any two neighbours in it share,
 * and no more than any of its rows sees. Which tile a row lands in changes none of its bits. Returns the number of
 * tiles. */
static int plan_tiles(const int32_t *seq_of_row, const int32_t *positions, const int32_t *shared, int n, int P,
                      int window, int KVH, int threads, int *start, int *keys, int *in_place) {
    int *seg_end = (int *)__builtin_alloca(sizeof(int) * n), *parts = (int *)__builtin_alloca(sizeof(int) * n);
    char *is_run = (char *)__builtin_alloca(n);
    int segs = 0, tiles = 0;
    for (int i = 0; i < n; i = seg_end[segs++]) {
        const int end = run_end(shared, window, n, i);
        is_run[segs] = end - i > 1;
        seg_end[segs] = is_run[segs] ? end : sequence_end(seq_of_row, n, i);
        parts[segs] = (seg_end[segs] - i + Q_TILE - 1) / Q_TILE;
        tiles += parts[segs];
    }
    while (tiles * KVH < 2 * threads) {  /* cut the segment of the widest tiles once more */
        int widest = -1, widest_rows = 0;
        for (int g = 0, i = 0; g < segs; i = seg_end[g++]) {
            const int rows = seg_end[g] - i;
            if (rows / (parts[g] + 1) < 2 || (!is_run[g] && rows <= IN_PLACE_ROWS)) continue;
            if (widest < 0 || rows * parts[widest] > widest_rows * parts[g]) widest = g, widest_rows = rows;
        }
        if (widest < 0) break;
        parts[widest]++, tiles++;
    }
    tiles = 0;
    for (int g = 0, i = 0; g < segs; i = seg_end[g++]) {
        const int end = seg_end[g];
        for (int k = 0; k < parts[g]; k++) {
            const int a = i + (end - i) * k / parts[g], b = i + (end - i) * (k + 1) / parts[g];
            int common = INT32_MAX;
            for (int row = a; is_run[g] && row < b; row++) {
                if (row > a && shared[row] * P < common) common = shared[row] * P;
                if (positions[row] + 1 < common) common = positions[row] + 1;
            }
            start[tiles] = a, keys[tiles] = is_run[g] && b - a > 1 ? common : 0;
            in_place[tiles] = keys[tiles] == 0 && (is_run[g] || end - i <= IN_PLACE_ROWS);
            tiles++;
        }
    }
    start[tiles] = n;
    return tiles;
}

/* Scores of rows [0, n) for keys [jb, je) of a span beginning at position base, each key's row read in place at
 * slot[j] for KV heads [kh0, kh1) in one pass: row t is q row rows[t] (its heads from kh0's first on), its scores of
 * head h (counted from kh0's first) at p + t * row_scores + h * max_keys. Every score is score8's, or score_run's over
 * a page's run of 8 keys: the numbers of score_keys. The K rows are fetched PREFETCH_KEYS ahead (fetch_at and
 * fetch_width of a token's row) and, with then_values, past je the first V rows, whose pass comes next. A row's keys
 * past its position are scored and never read. */
static inline __attribute__((always_inline)) void score_rows_in_place(
        const float *q, int q_stride, const void *k_cache, const void *v_cache, const int32_t *rows, int n,
        const uint32_t *slot, int base, int jb, int je, int kh0, int kh1, int group, const int D, int P, size_t token,
        size_t fetch_at, int fetch_width, float scale, float *p, size_t row_scores, int max_keys, int then_values,
        const int kind) {
    const int values = then_values ? je - jb : 0;
    for (int j = jb; j < je; j += 8) {
        for (int u = j == jb ? jb : j + PREFETCH_KEYS; u < j + PREFETCH_KEYS + 8 && u < je + values; u++)
            prefetch_kv(u < je ? k_cache : v_cache, fetch_at + slot[u < je ? u : u - values] * token, fetch_width, kind);
        const int m = je - j < 8 ? je - j : 8, run = m == 8 && (base + j) % P + 8 <= P;  /* 8 keys of one page */
        size_t kr[8];
        for (int kh = kh0; kh < kh1; kh++) {
            if (!run)
                for (int u = 0; u < 8; u++) kr[u] = (size_t)kh * D + slot[j + (u < m ? u : 0)] * token;
            const int lh = (kh - kh0) * group;  /* this KV head's first query head here */
            for (int t = 0; t < n; t++) {
                const float *qr = q + (size_t)rows[t] * q_stride + (size_t)kh0 * group * D;
                float *pt = p + t * row_scores + j;
                if (run) score_run(qr + (size_t)lh * D, k_cache, slot[j] * token + (size_t)kh * D, token, group, D,
                                   scale, pt + (size_t)lh * max_keys, max_keys, kind);
                else
                    for (int h = lh; h < lh + group; h++)
                        score8(qr + (size_t)h * D, k_cache, kr, m, D, scale, pt + (size_t)h * max_keys, kind);
            }
        }
    }
}

/* Rows [0, n)'s outputs of KV heads [kh0, kh1) (out row rows[t], heads from kh0's first on) += their weights times the
 * V rows of keys [jb, je), read in place at slot[j], each row's keys in position order: row t sees keys [lo[t], hi[t])
 * of the span, its weights laid out as score_rows_in_place's. The V rows are fetched PREFETCH_KEYS ahead, from jb on
 * where other passes came between (fetch_first), else from where score_rows_in_place's tail left off. The numbers of
 * add_values: a column's sums take the same FMAs in the same order however the columns and keys are cut. */
static inline __attribute__((always_inline)) void add_values_in_place(
        const void *v_cache, const int32_t *rows, int n, const int *lo, const int *hi, const uint32_t *slot, int jb,
        int je, int kh0, int kh1, int group, const int D, int H, size_t token, size_t fetch_at, int fetch_width,
        const float *p, size_t row_scores, int max_keys, float *out, int fetch_first, const int kind) {
    const int cw = value_columns(group);
    for (int j = jb; j < je; j += V_BLOCK) {
        for (int u = fetch_first && j == jb ? jb : j + PREFETCH_KEYS; u < j + V_BLOCK + PREFETCH_KEYS && u < je; u++)
            prefetch_kv(v_cache, fetch_at + slot[u] * token, fetch_width, kind);
        const int j_end = je - j < V_BLOCK ? je : j + V_BLOCK;
        for (int t = 0; t < n; t++) {  /* each row's keys of this block, in position order */
            const int from = j > lo[t] ? j : lo[t], to = j_end < hi[t] ? j_end : hi[t], keys = to - from;
            if (keys <= 0) continue;
            float *o = out + (size_t)rows[t] * H * D + (size_t)kh0 * group * D;
            for (int kh = kh0; kh < kh1; kh++)
                for (int c = 0; c < D; c += cw) {
                    const int width = D - c < cw ? D - c : cw;
                    const size_t at = (size_t)kh * D + c;
                    for (int g = 0; g < group; g += 3) {
                        const int nh = group - g < 3 ? group - g : 3;
                        const float *ph[3];
                        float *oh[3];
                        for (int i = 0; i < 3; i++) {
                            const int h = (kh - kh0) * group + g + (i < nh ? i : 0);
                            ph[i] = p + t * row_scores + (size_t)h * max_keys + from, oh[i] = o + (size_t)h * D + c;
                        }
                        weigh_values(ph, nh, v_cache, at, slot + from, token, keys, width, oh, kind);
                    }
                }
        }
    }
}

/* Rows [0, n)'s scores of heads [0, heads) (laid out as score_rows_in_place's) over their keys [lo[t], hi[t]) turned
 * into exponentials against their max, each row and head's sum in totals[t * heads + h]; their output rows (out row
 * rows[t], from element at on) zeroed for the V passes. */
static inline void exponentiate_rows(float *p, size_t row_scores, int max_keys, int n, int heads, const int *lo,
                                     const int *hi, const int32_t *rows, float *out, size_t at, int H, int D,
                                     float *totals) {
    for (int t = 0; t < n; t++) {
        for (int h = 0; h < heads; h++) {
            float *ph = p + t * row_scores + (size_t)h * max_keys + lo[t];
            totals[t * heads + h] = exp_shifted_sum(ph, hi[t] - lo[t], max_of(ph, hi[t] - lo[t]));
        }
        float *o = out + (size_t)rows[t] * H * D + at;
        for (int d = 0; d < heads * D; d += 8) _mm256_storeu_ps(o + d, _mm256_setzero_ps());
    }
}

/* A tile's shared keys on AMX-BF16 tiles (decode rows sharing a prompt's pages, batch invariance off): defined with the
 * flash kernels below. */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AMX_INT8__)
#define SHARED_BF16 1
int amx_tiles_granted(void);  /* cpu_gemv.c: whether Linux lets this process use the tile state */
static void flash_layout(const void *k_cache, const void *v_cache, const int32_t *table, int keys, int from, int to,
                         int h, int KVH, int D, int P, const int kind, uint16_t *kt, uint16_t *vt);
static void flash_configure(void);
static uint16_t *shared_layouts(const void *k_cache, const void *v_cache, const int32_t *tables, int table_stride,
                                const int32_t *seq_of_row, const int32_t *shared, const int *tile_start, int *tile_keys,
                                int tiles, int KVH, int D, int P, int threads, int kind, ptrdiff_t *tile_at,
                                int *tile_padded);
static void shared_scores_bf16(const float *q, int q_stride, const int32_t *rows, int n, int kh, int kh0, int group,
                               int D, int common, const uint16_t *kt, float scale, float *p, size_t row_scores,
                               int max_keys);
static void shared_values_bf16(const float *p, size_t row_scores, int max_keys, const int32_t *rows, int n, int kh,
                               int kh0, int group, int D, int H, int common, const uint16_t *vt, float *out);
#else
#define SHARED_BF16 0
#endif

/* One (tile, KV heads [kh0, kh1)) item of attend_pages: its rows' scores, softmax and weighted V rows. Called with
 * `kind` a literal inside the OpenMP region: GCC outlines that region into a function of its own and passes what it
 * captures through memory, so a kind passed down from outside would be a load there, and every loop would keep all
 * three kinds' code, constants and registers (perf annotate showed two of weighted_add_heads' twelve sums spilled to
 * the stack, a store and a reload on every key). Float16 pages of head_dim 64 (the CPU default, the default model's
 * heads) get a copy with D a literal too. Measured side by side (benchmarks/paged_attention_ab.py, 2-vCPU Zen 3, 2
 * threads, the same bits): float16 decode, verify and prefill cases 1.02-1.19x with the kind a literal, then
 * 0.99-1.10x more with D (about 4 s more to compile).
 *
 * A tile of rows sharing pages (a shared prompt's) reads those keys once for all its rows, gathered, a KV head at a
 * time; each row's own keys after them it reads in place for all the item's KV heads in one pass, as a decode row
 * alone does (attend_rows_in_place), so each token's row is fetched once, a run of memory, where a KV head an item
 * fetched a third of it three times over. Scores [t][head - kh0 * group][span] (rows x heads <= score_rows). */
static inline __attribute__((always_inline)) void attend_tile_heads(
        const float *q, int q_stride, const void *k_cache, const void *v_cache, const int32_t *tables, int table_stride,
        const int32_t *rows, const int32_t *seq_of_row, const int32_t *positions, int H, int KVH, int D, int P,
        int window, float scale, float value_scale, float *out, float *scratch, int max_keys, const int *tile_start,
        const int *tile_keys, int tile, int kh0, int kh1, const uint16_t *layout, int padded, const int kind) {
    const int group = H / KVH, heads = (kh1 - kh0) * group;
    const int i0 = tile_start[tile], rows_here = tile_start[tile + 1] - i0, alike = tile_keys[tile];
    int first[Q_TILE], lo[Q_TILE], hi[Q_TILE], base = INT32_MAX, top = 0;
    for (int t = 0; t < rows_here; t++) {
        const int pos = positions[i0 + t];
        first[t] = first_seen(pos, window);
        base = first[t] < base ? first[t] : base;
        top = pos > top ? pos : top;
    }
    const size_t token = (size_t)KVH * D, row_scores = (size_t)heads * max_keys, at = (size_t)kh0 * group * D;
    uint32_t *slot;
    float *p = thread_scratch(scratch, H, KVH, max_keys, &slot);
    const Tile tile_view = {.q = q, .out = out, .k_cache = k_cache, .v_cache = v_cache, .rows = rows + i0,
                            .positions = positions + i0, .first = first, .q_stride = q_stride, .out_stride = H * D,
                            .group = group, .D = D, .base = base, .max_keys = max_keys, .P = P,
                            .row_scores = row_scores, .token = token, .scale = scale, .p = p, .slot = slot};
    /* keys [0, common) of the span: every row's, from the first row's table; read once for the tile's rows,
     * gathered (a decode row alone reads its keys in place: gathering would cost it more than it saves) */
    const int span = top - base + 1, common = alike ? alike : span;
    const int gather = rows_here > 1 && D <= MAX_GATHER_HEAD_DIM;
    size_t fetch_at;  /* own keys: whole rows, or these heads' */
    const int fetch_width = fetch_range(kh0, kh1, D, token, &fetch_at);
    fill_slots(&tile_view, tables + (size_t)seq_of_row[i0] * table_stride, 0, common, P);
    /* layout: the shared keys laid out for AMX-BF16 tiles (attend_pages' shared_layouts), KV head kh's K at layout +
     * kh * 2 * padded * D and its V padded * D on; NULL: the float way */
#if SHARED_BF16
    if (layout != NULL) flash_configure();
#else
    (void)layout, (void)padded;
#endif
    /* with shared pages, every row's own K rows come between a span's K and V passes (more than L2 holds at long
     * contexts): the V passes fetch their first rows themselves. The rows' own K pages are fetched while the shared K
     * passes compute, their V pages while the shared V passes do (an item of every KV head: whole token rows): 1.08x
     * in decode steps of 8 x 1,400 and 32 x 1,200 sharing 1,024 on a Zen 3 (paged_attention_ab, medians of pairs). */
    const int fetch_own = alike && layout == NULL && gather && kh0 == 0 && kh1 == KVH;
    OwnPages own_k = {0};
    if (fetch_own)
        own_k = own_pages(k_cache, tables, table_stride, seq_of_row + i0, positions + i0, rows_here, common, P,
                          token * kv_bytes(kind));
    OwnPages own_v = own_k;
    own_v.cache = (const char *)v_cache;
    const size_t all_lines = fetch_own ? own_lines(&own_k) : 0;
    const size_t lines = all_lines < OWN_FETCH_LINES ? all_lines : OWN_FETCH_LINES;
    const int key_blocks = (kh1 - kh0) * ((common + 7) / 8);
    const int cw = value_columns(group);
    const int value_blocks = (kh1 - kh0) * ((common + V_BLOCK - 1) / V_BLOCK) * ((D + cw - 1) / cw);
    for (int kh = kh0; kh < kh1; kh++) {
        Tile w = head_view(tile_view, kh, kh0);
        if (fetch_own) w.own = &own_k, w.own_quota = (int)(lines / key_blocks + 1);
#if SHARED_BF16
        if (layout != NULL) {
            shared_scores_bf16(q, q_stride, rows + i0, rows_here, kh, kh0, group, D, common,
                               layout + (size_t)kh * 2 * padded * D, scale, p, row_scores, max_keys);
            continue;
        }
#endif
        score_keys(&w, 0, rows_here, 0, common, gather, !alike, kind);
    }
    for (int t = 0; alike && t < rows_here; t++) {  /* each row's own keys after the pages it shares */
        const int end = positions[i0 + t] - base + 1;
        fill_slots(&tile_view, tables + (size_t)seq_of_row[i0 + t] * table_stride, common, end, P);
        score_rows_in_place(q, q_stride, k_cache, v_cache, rows + i0 + t, 1, slot, base, common, end, kh0, kh1, group,
                            D, P, token, fetch_at, fetch_width, scale, p + t * row_scores, row_scores, max_keys, 0, kind);
    }
    float totals[Q_TILE * heads];  /* each row and head's sum of its exponentials */
    for (int t = 0; t < rows_here; t++) lo[t] = first[t] - base, hi[t] = positions[i0 + t] - base + 1;
    exponentiate_rows(p, row_scores, max_keys, rows_here, heads, lo, hi, rows + i0, out, at, H, D, totals);
    for (int kh = kh0; kh < kh1; kh++) {
        Tile w = head_view(tile_view, kh, kh0);
        if (fetch_own) w.own = &own_v, w.own_quota = (int)(lines / value_blocks + 1);
#if SHARED_BF16
        if (layout != NULL) {
            shared_values_bf16(p, row_scores, max_keys, rows + i0, rows_here, kh, kh0, group, D, H, common,
                               layout + (size_t)(2 * kh + 1) * padded * D, out);
            continue;
        }
#endif
        add_values(&w, 0, rows_here, 0, common, gather, alike, kind);
    }
#if SHARED_BF16
    if (layout != NULL) _tile_release();
#endif
    for (int t = 0; alike && t < rows_here; t++) {
        fill_slots(&tile_view, tables + (size_t)seq_of_row[i0 + t] * table_stride, common, hi[t], P);
        add_values_in_place(v_cache, rows + i0 + t, 1, lo + t, hi + t, slot, common, hi[t], kh0, kh1, group, D, H,
                            token, fetch_at, fetch_width, p + t * row_scores, row_scores, max_keys, out, 1, kind);
    }
    for (int t = 0; t < rows_here; t++)
        divide_by_totals(out + (size_t)rows[i0 + t] * H * D + at, heads, D, value_scale, totals + t * heads);
}

/* The rows of a tile that reads its keys in place (rows [0, n) of one sequence, its table, nothing shared: a decode
 * row alone, or a verify pass's few rows), KV heads [kh0, kh1) in one pass over the keys: with all of them (a step of
 * two tiles or more a thread), each token's row of all heads is fetched once, a run of memory, and read while the
 * heads compute, where one (tile, KV head) item at a time left memory idle while the second and third heads worked
 * from cache. Each row and head's numbers are attend_tile_heads': the same scores (score8's, or score_run's over a
 * page's run of 8 keys), exponentials, sums and weighted V rows in the same order, so the same bits whichever way a
 * step's rows are handed out. Scores [t][head - kh0 * group][span] in the thread's scratch (n x heads <=
 * score_rows). */
static inline __attribute__((always_inline)) void attend_rows_in_place(
        const float *q, int q_stride, const void *k_cache, const void *v_cache, const int32_t *table,
        const int32_t *rows, const int32_t *positions, int n, int H, int KVH, int kh0, int kh1, const int D, int P,
        int window, float scale, float value_scale, float *out, float *scratch, int max_keys, const int kind) {
    const int group = H / KVH, heads = (kh1 - kh0) * group;
    int lo[Q_TILE], hi[Q_TILE], base = INT32_MAX, top = 0;
    for (int t = 0; t < n; t++) {
        lo[t] = first_seen(positions[t], window);
        base = lo[t] < base ? lo[t] : base;
        top = positions[t] > top ? positions[t] : top;
    }
    const int span = top - base + 1;
    const size_t token = (size_t)KVH * D, row_scores = (size_t)heads * max_keys;
    size_t fetch_at;
    const int fetch_width = fetch_range(kh0, kh1, D, token, &fetch_at);
    uint32_t *slot;
    float *p = thread_scratch(scratch, H, KVH, max_keys, &slot);
    for (int j = 0, page = base / P, at = base % P; j < span; j++) {
        slot[j] = (uint32_t)table[page] * P + at;
        if (++at == P) at = 0, page++;
    }
    score_rows_in_place(q, q_stride, k_cache, v_cache, rows, n, slot, base, 0, span, kh0, kh1, group, D, P, token,
                        fetch_at, fetch_width, scale, p, row_scores, max_keys, 1, kind);
    float totals[Q_TILE * heads];
    for (int t = 0; t < n; t++) lo[t] -= base, hi[t] = positions[t] - base + 1;
    exponentiate_rows(p, row_scores, max_keys, n, heads, lo, hi, rows, out, (size_t)kh0 * group * D, H, D, totals);
    add_values_in_place(v_cache, rows, n, lo, hi, slot, 0, span, kh0, kh1, group, D, H, token, fetch_at, fetch_width,
                        p, row_scores, max_keys, out, 0, kind);
    for (int t = 0; t < n; t++)
        divide_by_totals(out + (size_t)rows[t] * H * D + (size_t)kh0 * group * D, heads, D, value_scale,
                         totals + t * heads);
}

/* attend_rows_in_place for each kind (float16 of head_dim 64 its own too), each a function of its own: inlined into
 * attend_pages' OpenMP region it shared that region's registers, and score8_run's row pointers spilled there. */
#define ROW_HEADS_FN(NAME, D_, KIND)                                                                                   \
    static __attribute__((noinline)) void NAME(const float *q, int q_stride, const void *k_cache, const void *v_cache, \
                                               const int32_t *table, const int32_t *rows, const int32_t *positions,   \
                                               int n, int H, int KVH, int kh0, int kh1, int D, int P, int window,     \
                                               float scale, float value_scale, float *out, float *scratch,            \
                                               int max_keys) {                                                        \
        (void)D;                                                                                                       \
        attend_rows_in_place(q, q_stride, k_cache, v_cache, table, rows, positions, n, H, KVH, kh0, kh1, D_, P,       \
                             window, scale, value_scale, out, scratch, max_keys, KIND);                                \
    }
ROW_HEADS_FN(row_heads_f16_64, 64, KV_F16)
ROW_HEADS_FN(row_heads_f16, D, KV_F16)
ROW_HEADS_FN(row_heads_fp8, D, KV_FP8)
ROW_HEADS_FN(row_heads_f32, D, KV_F32)
#undef ROW_HEADS_FN

/* attend_tile_heads for each kind, the same way */
#define TILE_HEADS_FN(NAME, D_, KIND)                                                                                  \
    static __attribute__((noinline)) void NAME(                                                                        \
            const float *q, int q_stride, const void *k_cache, const void *v_cache, const int32_t *tables,            \
            int table_stride, const int32_t *rows, const int32_t *seq_of_row, const int32_t *positions, int H,         \
            int KVH, int D, int P, int window, float scale, float value_scale, float *out, float *scratch,            \
            int max_keys, const int *tile_start, const int *tile_keys, int tile, int kh0, int kh1,                   \
            const uint16_t *layout, int padded) {                                                                      \
        (void)D;                                                                                                       \
        attend_tile_heads(q, q_stride, k_cache, v_cache, tables, table_stride, rows, seq_of_row, positions, H, KVH,   \
                          D_, P, window, scale, value_scale, out, scratch, max_keys, tile_start, tile_keys, tile,     \
                          kh0, kh1, layout, padded, KIND);                                                             \
    }
TILE_HEADS_FN(tile_heads_f16_64, 64, KV_F16)
TILE_HEADS_FN(tile_heads_f16, D, KV_F16)
TILE_HEADS_FN(tile_heads_fp8, D, KV_FP8)
TILE_HEADS_FN(tile_heads_f32, D, KV_F32)
#undef TILE_HEADS_FN

/* Causal attention of n query rows over a paged cache [pages, P, KVH, D]. Query row i is q row rows[i] (rows
 * q_stride floats apart, heads D apart), at position positions[i] of the sequence whose pages are
 * tables[seq_of_row[i]] (table_stride entries apart); it sees the keys at positions (pos - window, pos]
 * (window 0: [0, pos]), the key at position t lying in page table[t / P], offset t % P:
 *
 *     s_t = scale * <q, k_t>      p_t = exp(s_t - max s)      out row rows[i] = sum_t p_t v_t / sum_t p_t
 *
 * each sum taken in position order, each dot product in one fixed tree. The H / KVH query heads of a KV head
 * go together, so each K and V row is read from memory once for all of them; so do the rows of a tile (plan_tiles:
 * up to Q_TILE consecutive rows of one sequence, a prefill chunk's; or decode rows of sequences whose first pages are
 * the same pages, over those pages), which read those keys once for all of them, gathered: a row's numbers are the
 * same as alone, since a score is one key's own dot product (score8 treats its eight keys apart), a row's
 * exponentials and sums cover exactly its own keys in position order, and only the loads are shared. shared: NULL,
 * or per row the leading pages its table has alike with the row before's (see plan_tiles). out [T, H, D]; scratch:
 * threads * (score_rows(H, KVH, max_keys) + 1) * max_keys floats (each row and head's scores, the slots), max_keys at
 * least the keys a tile spans (the largest position + 1). D a multiple of 8. The caches hold float32, float16 or fp8
 * (kind: each its own compiled loop: attend_tile_heads); fp8 values are K / kv_scale and V / kv_scale, so the scores
 * take scale * kv_scale and the outputs kv_scale / sum p (1.0 for the others: the same bits as without it). */
static inline __attribute__((always_inline)) void attend_pages(
        const float *q, int q_stride, const void *k_cache, const void *v_cache, const int32_t *tables, int table_stride,
        const int32_t *rows, const int32_t *seq_of_row, const int32_t *positions, const int32_t *shared, int n, int H,
        int KVH, int D, int P, int window, float scale, float value_scale, float *out, float *scratch, int max_keys,
        int threads, int bf16, const int kind) {
    int *tile_start = (int *)__builtin_alloca(sizeof(int) * (n + 1)), *tile_keys = (int *)__builtin_alloca(sizeof(int) * n);
    int *tile_in_place = (int *)__builtin_alloca(sizeof(int) * n);
    const int tiles = plan_tiles(seq_of_row, positions, shared, n, P, window, KVH, threads, tile_start, tile_keys,
                                 tile_in_place);
    /* Taken a few at a time as threads come free (a prefill tile costs many decode rows), a tile's KV heads
     * together where there are enough to go round: one thread then walks whole token rows, which its prefetcher
     * follows, where two threads reading different heads of the same rows ran 20% slower in a decode step. */
    int chunk = KVH;
    while (chunk > 1 && tiles * KVH < chunk * threads * 4) chunk--;
    /* A tile plan_tiles reads in place (a sequence of up to IN_PLACE_ROWS rows: a decode row alone, a short verify
     * pass) goes through attend_rows_in_place: with two tiles or more a thread and room in the scratch, all its KV
     * heads in one pass; else each KV head an item of its own, so that every thread has work (the same bits either
     * way). */
    const int whole_rows = tiles >= 2 * threads, held = score_rows(H, KVH, max_keys);
    /* bf16: tiles over a shared prompt's pages read its keys laid out for AMX-BF16 tiles (shared_layouts) */
    ptrdiff_t *tile_at = (ptrdiff_t *)__builtin_alloca(sizeof(ptrdiff_t) * n);
    int *tile_padded = (int *)__builtin_alloca(sizeof(int) * n);
    uint16_t *layouts = NULL;
#if SHARED_BF16
    if (bf16 && shared != NULL && window == 0)
        layouts = shared_layouts(k_cache, v_cache, tables, table_stride, seq_of_row, shared, tile_start, tile_keys,
                                 tiles, KVH, D, P, threads, kind, tile_at, tile_padded);
#else
    (void)bf16;
#endif
#define TILE_HEADS(FN)                                                                                                   \
    FN(q, q_stride, k_cache, v_cache, tables, table_stride, rows, seq_of_row, positions, H, KVH, D, P, window, scale,     \
       value_scale, out, scratch, max_keys, tile_start, tile_keys, tile, kh, kh + heads < KVH ? kh + heads : KVH,      \
       layout, padded)
#define ROW_HEADS(FN)                                                                                                    \
    FN(q, q_stride, k_cache, v_cache, tables + (size_t)seq_of_row[i0] * table_stride, rows + i0, positions + i0, n, H,    \
       KVH, whole ? 0 : kh, whole ? KVH : kh + 1, D, P, window, scale, value_scale, out, scratch, max_keys)
#pragma omp parallel for collapse(2) num_threads(threads) schedule(dynamic, chunk)
    for (int tile = 0; tile < tiles; tile++) {
        for (int kh = 0; kh < KVH; kh++) {
            const int i0 = tile_start[tile];
            const int n = tile_start[tile + 1] - i0, whole = whole_rows && n * H <= held;
            if (tile_in_place[tile]) {
                if (whole && kh > 0) continue;  /* kh 0's item took them */
                if (kind == KV_F16 && D == 64) ROW_HEADS(row_heads_f16_64);
                else if (kind == KV_F16) ROW_HEADS(row_heads_f16);
                else if (kind == KV_FP8) ROW_HEADS(row_heads_fp8);
                else ROW_HEADS(row_heads_f32);
                continue;
            }
            /* a shared prompt's tile: as many KV heads an item as the scratch holds (its own keys read once for
             * them: 1.16-1.22x in float16 decode steps sharing 1,024 tokens); else a KV head an item */
            const int heads = tile_keys[tile] ? held / (n * (H / KVH)) : 1;
            if (kh % heads) continue;  /* the item of kh - kh % heads took it */
            const uint16_t *layout = layouts != NULL && tile_at[tile] >= 0 ? layouts + tile_at[tile] : NULL;
            const int padded = layout != NULL ? tile_padded[tile] : 0;
            if (kind == KV_F16 && D == 64) TILE_HEADS(tile_heads_f16_64);
            else if (kind == KV_F16) TILE_HEADS(tile_heads_f16);
            else if (kind == KV_FP8) TILE_HEADS(tile_heads_fp8);
            else TILE_HEADS(tile_heads_f32);
        }
    }
#undef TILE_HEADS
#undef ROW_HEADS
    free(layouts);
}

void paged_attention(const float *q, int q_stride, const void *k_cache, const void *v_cache,
                     const int32_t *tables, int table_stride, const int32_t *rows, const int32_t *seq_of_row,
                     const int32_t *positions, const int32_t *shared, int n, int H, int KVH, int D, int P, int window, float scale,
                     float *out, float *scratch, int max_keys, int kv_kind, float kv_scale, int threads,
                     int bf16_tiles) {
    kv_scale = kv_read_scale(kv_kind, kv_scale);  /* 2^8 for fp8: a power of two, the same bits as each value's */
    const float s = scale * kv_scale;
#if SHARED_BF16
    const int bf16 = bf16_tiles && D % 32 == 0 && D <= 256 && amx_tiles_granted();
#else
    const int bf16 = 0;
    (void)bf16_tiles;
#endif
    /* one region, whose loop body takes the kind as a literal (attend_tile_heads) */
    attend_pages(q, q_stride, k_cache, v_cache, tables, table_stride, rows, seq_of_row, positions, shared, n, H, KVH, D, P,
                 window, s, kv_scale, out, scratch, max_keys, threads, bf16, kv_kind);
}

/* Eight bf16 values from p on, widened to float32 (exactly: bf16 is float32's upper half). */
static inline __m256 load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Eight float32 values rounded to bf16 as torch rounds them (to nearest, ties to even; a NaN stays a quiet NaN). */
static inline void store_bf16(uint16_t *p, __m256 v) {
    __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

#if defined(__AVX512F__)
/* load_bf16 and store_bf16 on 16 lanes: the same bits. */
static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline void store_bf16x16(uint16_t *p, __m512 v) {
    __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    b = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), b, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(b));  /* every lane fits 16 bits: exact */
}
#endif

/* y [rows, n] = silu(x[:, :n]) * x[:, n:] for x [rows, 2n], silu(g) = g / (1 + e^-g), n a multiple of 8; float32, or
 * bf16 rows (bf16: const where inlined; the MLP's middle where its matmuls run on bf16 weight copies, AMX prefill),
 * each value widened, the same float32 math, the product rounded to bf16 once. With AVX-512, 16 values at a time
 * (the same operations a lane: the same bits; bf16 rows of a 2,048-row prefill 1.46x on an AMX Xeon, float32
 * ones 1.05x), the last 8 as before. */
static inline __attribute__((always_inline)) void silu_mul_rows(const void *x, void *y, int rows, int n, int threads,
                                                                const int bf16) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 8)
    for (int r = 0; r < rows; r++) {
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) {
            const size_t at = (size_t)r * 2 * n + i;
            const __m512 g = bf16 ? load_bf16x16((const uint16_t *)x + at) : _mm512_loadu_ps((const float *)x + at);
            const __m512 u = bf16 ? load_bf16x16((const uint16_t *)x + at + n) : _mm512_loadu_ps((const float *)x + at + n);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 product = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
            if (bf16) store_bf16x16((uint16_t *)y + (size_t)r * n + i, product);
            else _mm512_storeu_ps((float *)y + (size_t)r * n + i, product);
        }
#endif
        for (; i < n; i += 8) {
            const size_t at = (size_t)r * 2 * n + i;
            const __m256 g = bf16 ? load_bf16((const uint16_t *)x + at) : _mm256_loadu_ps((const float *)x + at);
            const __m256 u = bf16 ? load_bf16((const uint16_t *)x + at + n) : _mm256_loadu_ps((const float *)x + at + n);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            const __m256 product = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
            if (bf16) store_bf16((uint16_t *)y + (size_t)r * n + i, product);
            else _mm256_storeu_ps((float *)y + (size_t)r * n + i, product);
        }
    }
}

void silu_mul(const float *x, float *y, int rows, int n, int threads) { silu_mul_rows(x, y, rows, n, threads, 0); }
void silu_mul_bf16(const uint16_t *x, uint16_t *y, int rows, int n, int threads) {
    silu_mul_rows(x, y, rows, n, threads, 1);
}

/* out[i] = cache row index[i] (width float16 values a row: a KV page's) widened and rounded to bf16 as torch rounds it:
 * read_pages' gather and conversion for SDPA in bf16 (AMX prefill) in one pass, where index_select then .to(bf16)
 * wrote and read every value twice (0.23 ms of a 128-row chunk's 1.10 ms a layer at 1,344 keys on an AMX Xeon).
 * float16 -> float32 is exact, so the bits are those of torch's two steps. width a multiple of 8. */
void gather_f16_as_bf16(const uint16_t *cache, const int64_t *index, int n, int width, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if ((long)n * width >= 65536)
    for (int i = 0; i < n; i++) {
        const uint16_t *src = cache + (size_t)index[i] * width;
        uint16_t *dst = out + (size_t)i * width;
        int d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= width; d += 16)
            store_bf16x16(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + d))));
#endif
        for (; d < width; d += 8) store_bf16(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
    }
}

/* Causal attention of one prefill chunk in bf16 on AMX tiles: n query rows of one sequence at positions first ..
 * first + n - 1 over its keys 0 .. first + n - 1 in the pages `table` lists, q and K rounded to bf16 for the scores,
 * the softmax in float32, its weights and V rounded to bf16 for the outputs, every sum of products in float32 (what
 * torch's bf16 SDPA computes, in another blocking). Flash attention's running max and sum, 32 keys a step:
 *
 *     S = q K^T (two 16 x 16 tiles a step, D / 32 products each)    m' = max(m, max_j s_j)
 *     p_j = e^(s_j - m')    l = l e^(m - m') + sum_j p_j             o = o e^(m - m') + p V (D / 16 tiles)
 *
 * A tile of 16 query rows of one head takes 16 x 32 bf16 of q (A), and the keys' tiles hold K's dimension pairs
 * against 16 keys (B: row r = dims 2r, 2r + 1 of each key; VNNI's pairs), V's key pairs against 16 output columns
 * (B: row r = keys 2r, 2r + 1). Both are laid out once a call per KV head (every query head of its group and every
 * row tile reads them), rounded from the cache's float32 or float16. The weights p of a step are the A tile of
 * the second product. A row's numbers follow from its own q and keys alone (a step past its position adds exact
 * zeros), but they are not the fused float32 kernel's: a token attends otherwise in a chunk of 16 rows or more than
 * in a decode step, so this serves only outside batch-invariant mode.
 * Returns 0, or -1 where this build or CPU has no AMX-BF16, or for an fp8 cache (the caller attends another way). */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AMX_INT8__)  /* cpu_gemv.c asks for the tiles */
#include <stdlib.h>
#define FLASH_ROWS 16
#define FLASH_KEYS 32

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_bf16;

/* Keys [t0, t0 + n) of KV head h as bf16 rows dst [n][D], each value rounded to nearest even (zeros past `keys`: their
 * scores are masked, their weights 0). */
static inline __attribute__((always_inline)) void flash_rows(const void *cache, const int32_t *table, int t0, int n,
                                                             int keys, int h, int KVH, int D, int P, const int kind,
                                                             uint16_t *dst) {
    for (int u = 0; u < n; u++) {
        const int t = t0 + u;
        if (t >= keys) {
            __builtin_memset(dst + (size_t)u * D, 0, sizeof(uint16_t) * D);
            continue;
        }
        const size_t at = ((size_t)table[t / P] * P + t % P) * KVH * D + (size_t)h * D;
        for (int d = 0; d < D; d += 32)
            _mm512_store_si512(dst + (size_t)u * D + d,
                               (__m512i)_mm512_cvtne2ps_pbh(load_kv16(cache, at + d + 16, kind),
                                                            load_kv16(cache, at + d, kind)));
    }
}

/* m[0..15], 16 rows of 16 32-bit words, transposed in place: unpacks of words, then of pairs, within 128-bit lanes,
 * then two rounds of lane shuffles. */
static inline __attribute__((always_inline)) void transpose16_epi32(__m512i m[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_epi32(m[i], m[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(m[i], m[i + 1]);
    for (int i = 0; i < 16; i += 4) {  /* m[i + c], lane l: column 4l + c of rows i .. i + 3 */
        m[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), m[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        m[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), m[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i x0 = _mm512_shuffle_i32x4(m[c], m[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(m[c], m[4 + c], 0xEE);
        const __m512i y0 = _mm512_shuffle_i32x4(m[8 + c], m[12 + c], 0x44);
        const __m512i y1 = _mm512_shuffle_i32x4(m[8 + c], m[12 + c], 0xEE);
        t[c] = _mm512_shuffle_i32x4(x0, y0, 0x88), t[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        t[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88), t[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
    for (int i = 0; i < 16; i++) m[i] = t[i];
}

/* Keys [from, to) of KV head h (multiples of 32; to at most `keys` rounded up to 32) as the B tiles of both products:
 * kt [blocks of 16 keys][D / 32][16 pairs][16 keys][2], vt [blocks of 32 keys][D / 16][16 key pairs][16 columns][2];
 * keys past `keys` are zeros. 32 keys at a time: their K and V rows rounded to bf16 rows first, then a K tile is those
 * rows' 32 dimensions (16 pairs, a 32-bit word each) transposed, and a V tile's row two keys' 16 columns interleaved
 * (one permute). */
static void flash_layout(const void *k_cache, const void *v_cache, const int32_t *table, int keys, int from, int to,
                         int h, int KVH, int D, int P, const int kind, uint16_t *kt, uint16_t *vt) {
    uint16_t k16[FLASH_KEYS * 256] __attribute__((aligned(64))), v16[FLASH_KEYS * 256] __attribute__((aligned(64)));
    const __m512i pairs = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                           39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (int t0 = from; t0 < to; t0 += FLASH_KEYS) {
        for (int t = t0 + PREFETCH_KEYS; t < t0 + PREFETCH_KEYS + FLASH_KEYS && t < keys; t++) {  /* as decode rows */
            const size_t at = ((size_t)table[t / P] * P + t % P) * KVH * D + (size_t)h * D;
            prefetch_kv(k_cache, at, D, kind);
            prefetch_kv(v_cache, at, D, kind);
        }
        flash_rows(k_cache, table, t0, FLASH_KEYS, keys, h, KVH, D, P, kind, k16);
        flash_rows(v_cache, table, t0, FLASH_KEYS, keys, h, KVH, D, P, kind, v16);
        for (int half = 0; half < 2; half++)
            for (int c = 0; c < D / 32; c++) {
                __m512i m[16];
                for (int u = 0; u < 16; u++) m[u] = _mm512_load_si512(k16 + (size_t)(16 * half + u) * D + 32 * c);
                transpose16_epi32(m);
                uint16_t *dst = kt + ((size_t)(t0 / 16 + half) * (D / 32) + c) * 512;
                for (int r = 0; r < 16; r++) _mm512_store_si512(dst + 32 * r, m[r]);
            }
        for (int c = 0; c < D / 16; c++)
            for (int r = 0; r < 16; r++) {
                const uint16_t *pair = v16 + (size_t)(2 * r) * D + 16 * c;  /* keys 2r and 2r + 1, 16 columns */
                const __m512i even = _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)pair));
                const __m512i odd = _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(pair + D)));
                _mm512_store_si512(vt + (((size_t)(t0 / FLASH_KEYS) * (D / 16) + c) * 16 + r) * 32,
                                   _mm512_permutex2var_epi16(even, pairs, odd));
            }
    }
}

int flash_ready(void) { return amx_tiles_granted(); }

static void flash_configure(void) {
    tile_config_bf16 c = {0};
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    /* GCC's _tile_loadconfig names 8 bytes of the config as its operand, so the compiler may drop the stores of
     * the rest (cpu_decode.c lost them where inlined: ldtilecfg read stale stack bytes as rows and faulted): all 64 */
    __asm__ volatile("" : : "m"(c));
    _tile_loadconfig(&c);
}

/* s [16][32] = the 16 bf16 query rows qa [16][D] against keys [j0, j0 + 32) of a K layout (flash_layout's kt) */
static inline __attribute__((always_inline)) void flash_scores(const uint16_t *qa, const uint16_t *kt, int j0, int D,
                                                               float *s) {
    _tile_zero(0);
    _tile_zero(1);
    for (int cc = 0; cc < D / 32; cc++) {
        _tile_loadd(2, qa + 32 * cc, D * 2);
        _tile_loadd(4, kt + (((size_t)(j0 / 16) * (D / 32) + cc) * 512), 64);
        _tile_dpbf16ps(0, 2, 4);
        _tile_loadd(5, kt + (((size_t)(j0 / 16 + 1) * (D / 32) + cc) * 512), 64);
        _tile_dpbf16ps(1, 2, 5);
    }
    _tile_stored(0, s, FLASH_KEYS * 4);
    _tile_stored(1, s + 16, FLASH_KEYS * 4);
}

/* Decode rows sharing a prompt's pages, outside batch-invariant mode: the shared keys' scores and weighted V rows on
 * AMX-BF16 tiles, 16 query rows (a row's head) a tile, the softmax between them left to attend_tile_heads:
 *
 *     p[row, head, j] = scale * <q, k_j> for the shared keys j      then, after the exponentials,   o += p V
 *
 * q, K, V and the weights rounded to bf16, float32 sums (flash_prefill_bf16's numbers): a row's numbers then depend on
 * the rows it shares those keys with, so this serves only outside batch-invariant mode.
 *
 * The keys are laid out first, for all of attend_pages' tiles at once: consecutive tiles over a shared prompt's pages
 * (tile_keys > 0, the row at a tile's start sharing MIN_SHARED_PAGES or more with the row before) form a run, whose
 * keys every row of it shares are laid out once for all its tiles and KV heads (flash_layout, by all threads,
 * LAYOUT_KEYS keys an item), and each of its tiles' tile_keys becomes that count. A tile's layout: tile_at[t] into
 * the returned buffer (the caller frees it), or -1 (the float way); tile_padded[t] its keys rounded up to 32, KV head
 * kh's K at kh * 2 * padded * D and its V padded * D on. NULL (every tile the float way) where memory is not granted,
 * the layout would pass LAYOUT_MAX_BYTES, or no tile shares pages. Where each tile had laid out its own keys, the two
 * tiles of 8 rows a step cut for two threads read the pages twice and the layout was half the time of a decode
 * step's shared tiles. */
#define LAYOUT_KEYS 256
#define LAYOUT_MAX_BYTES ((size_t)64 << 20) /* more (a very long shared prompt, many KV heads): the float way, not a
                                              * copy of that size each layer of each step */
static __attribute__((noinline)) uint16_t *shared_layouts(const void *k_cache, const void *v_cache,
                                                         const int32_t *tables, int table_stride,
                                                         const int32_t *seq_of_row, const int32_t *shared,
                                                         const int *tile_start, int *tile_keys, int tiles, int KVH,
                                                         int D, int P, int threads, int kind, ptrdiff_t *tile_at,
                                                         int *tile_padded) {
    int *run_of = (int *)__builtin_alloca(sizeof(int) * tiles), *common = (int *)__builtin_alloca(sizeof(int) * tiles);
    int *first = (int *)__builtin_alloca(sizeof(int) * tiles), runs = 0;
    for (int t = 0; t < tiles; t++) {
        run_of[t] = -1, tile_at[t] = -1;
        if (!tile_keys[t]) continue;
        const int row = tile_start[t];
        if (t > 0 && run_of[t - 1] >= 0 && shared[row] >= MIN_SHARED_PAGES) {  /* the run of the tile before */
            const int r = run_of[t - 1], keys = shared[row] * P < tile_keys[t] ? shared[row] * P : tile_keys[t];
            common[r] = keys < common[r] ? keys : common[r], run_of[t] = r;
        } else
            common[runs] = tile_keys[t], first[runs] = row, run_of[t] = runs++;
    }
    if (runs == 0) return NULL;
    int *padded = (int *)__builtin_alloca(sizeof(int) * runs);
    int *items = (int *)__builtin_alloca(sizeof(int) * (runs + 1));
    size_t *at = (size_t *)__builtin_alloca(sizeof(size_t) * (runs + 1));
    at[0] = 0, items[0] = 0;
    for (int r = 0; r < runs; r++) {
        padded[r] = (common[r] + FLASH_KEYS - 1) / FLASH_KEYS * FLASH_KEYS;
        at[r + 1] = at[r] + (size_t)KVH * 2 * padded[r] * D;
        items[r + 1] = items[r] + KVH * ((padded[r] + LAYOUT_KEYS - 1) / LAYOUT_KEYS);
    }
    if (at[runs] * sizeof(uint16_t) > LAYOUT_MAX_BYTES) return NULL;
    uint16_t *layout = aligned_alloc(64, at[runs] * sizeof(uint16_t));
    if (layout == NULL) return NULL;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int item = 0; item < items[runs]; item++) {  /* (run, KV head, LAYOUT_KEYS keys) */
        int r = 0;
        while (item >= items[r + 1]) r++;
        const int chunks = (padded[r] + LAYOUT_KEYS - 1) / LAYOUT_KEYS, kh = (item - items[r]) / chunks;
        const int from = (item - items[r]) % chunks * LAYOUT_KEYS;
        const int to = from + LAYOUT_KEYS < padded[r] ? from + LAYOUT_KEYS : padded[r];
        const int32_t *table = tables + (size_t)seq_of_row[first[r]] * table_stride;
        uint16_t *kt = layout + at[r] + (size_t)kh * 2 * padded[r] * D, *vt = kt + (size_t)padded[r] * D;
        const int keys = common[r];
        if (kind == KV_F16) flash_layout(k_cache, v_cache, table, keys, from, to, kh, KVH, D, P, KV_F16, kt, vt);
        else if (kind == KV_FP8) flash_layout(k_cache, v_cache, table, keys, from, to, kh, KVH, D, P, KV_FP8, kt, vt);
        else flash_layout(k_cache, v_cache, table, keys, from, to, kh, KVH, D, P, KV_F32, kt, vt);
    }
    for (int t = 0; t < tiles; t++)
        if (run_of[t] >= 0) {
            const int r = run_of[t];
            tile_keys[t] = common[r], tile_at[t] = (ptrdiff_t)at[r], tile_padded[t] = padded[r];
        }
    return layout;
}

/* The masks of keys [j0, j0 + 32) below `common`: the first 16 and the next */
static inline void shared_masks(int j0, int common, __mmask16 *ka, __mmask16 *kb) {
    const int keys = common - j0;
    *ka = keys >= 16 ? 0xFFFF : (__mmask16)((1u << keys) - 1);
    *kb = keys >= 32 ? 0xFFFF : keys <= 16 ? 0 : (__mmask16)((1u << (keys - 16)) - 1);
}

/* Where query row r of a shared tile (row r / group's head r % group of KV head kh) keeps its scores in the thread's
 * scratch: score_keys' places, for an item of KV heads from kh0 on. */
static inline size_t shared_score_at(int r, int group, int kh, int kh0, size_t row_scores, int max_keys) {
    return (size_t)(r / group) * row_scores + (size_t)((kh - kh0) * group + r % group) * max_keys;
}

/* The scores of the tile's n rows for KV head kh over the shared keys [0, common), at shared_score_at. */
static __attribute__((noinline)) void shared_scores_bf16(const float *q, int q_stride, const int32_t *rows, int n,
                                                         int kh, int kh0, int group, int D, int common,
                                                         const uint16_t *kt, float scale, float *p, size_t row_scores,
                                                         int max_keys) {
    uint16_t qa[FLASH_ROWS * 256] __attribute__((aligned(64)));
    float s[FLASH_ROWS * FLASH_KEYS] __attribute__((aligned(64)));
    const __m512 by = _mm512_set1_ps(scale);
    for (int r0 = 0; r0 < n * group; r0 += FLASH_ROWS) {
        const int m = n * group - r0 < FLASH_ROWS ? n * group - r0 : FLASH_ROWS;
        for (int i = 0; i < FLASH_ROWS; i++) {
            const float *src = i < m ? q + (size_t)rows[(r0 + i) / group] * q_stride
                                           + (size_t)(kh * group + (r0 + i) % group) * D : NULL;
            for (int d = 0; d < D; d += 16)
                store_bf16x16(qa + i * D + d, src != NULL ? _mm512_loadu_ps(src + d) : _mm512_setzero_ps());
        }
        for (int j0 = 0; j0 < common; j0 += FLASH_KEYS) {
            flash_scores(qa, kt, j0, D, s);
            __mmask16 ka, kb;
            shared_masks(j0, common, &ka, &kb);
            for (int i = 0; i < m; i++) {
                float *dst = p + shared_score_at(r0 + i, group, kh, kh0, row_scores, max_keys) + j0;
                _mm512_mask_storeu_ps(dst, ka, _mm512_mul_ps(_mm512_load_ps(s + i * FLASH_KEYS), by));
                _mm512_mask_storeu_ps(dst + 16, kb, _mm512_mul_ps(_mm512_load_ps(s + i * FLASH_KEYS + 16), by));
            }
        }
    }
}

/* out rows += the shared keys' weights (p, shared_scores_bf16's places, exponentials by now) times their V rows, for
 * KV head kh's query heads; 64 columns (four tiles of sums) a pass over the keys. */
static __attribute__((noinline)) void shared_values_bf16(const float *p, size_t row_scores, int max_keys,
                                                         const int32_t *rows, int n, int kh, int kh0, int group, int D,
                                                         int H, int common, const uint16_t *vt, float *out) {
    __m512bh pa[FLASH_ROWS];
    float ob[FLASH_ROWS * 16] __attribute__((aligned(64)));
    for (int r0 = 0; r0 < n * group; r0 += FLASH_ROWS) {
        const int m = n * group - r0 < FLASH_ROWS ? n * group - r0 : FLASH_ROWS;
        for (int c0 = 0; c0 < D / 16; c0 += 4) {
            const int cols = D / 16 - c0 < 4 ? D / 16 - c0 : 4;  /* tiles of 16 columns this pass */
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int j0 = 0; j0 < common; j0 += FLASH_KEYS) {
                __mmask16 ka, kb;
                shared_masks(j0, common, &ka, &kb);
                for (int i = 0; i < FLASH_ROWS; i++) {
                    const float *src = p + shared_score_at(r0 + i, group, kh, kh0, row_scores, max_keys) + j0;
                    pa[i] = i < m ? _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(kb, src + 16),
                                                        _mm512_maskz_loadu_ps(ka, src))
                                  : (__m512bh)_mm512_setzero_si512();
                }
                _tile_loadd(2, pa, FLASH_KEYS * 2);
                const uint16_t *vb = vt + ((size_t)(j0 / FLASH_KEYS) * (D / 16) + c0) * 512;
                _tile_loadd(3, vb, 64);
                _tile_dpbf16ps(4, 2, 3);
                if (cols > 1) {
                    _tile_loadd(3, vb + 512, 64);
                    _tile_dpbf16ps(5, 2, 3);
                }
                if (cols > 2) {
                    _tile_loadd(3, vb + 1024, 64);
                    _tile_dpbf16ps(6, 2, 3);
                }
                if (cols > 3) {
                    _tile_loadd(3, vb + 1536, 64);
                    _tile_dpbf16ps(7, 2, 3);
                }
            }
            for (int c = 0; c < cols; c++) {
                if (c == 0) _tile_stored(4, ob, 64);
                else if (c == 1) _tile_stored(5, ob, 64);
                else if (c == 2) _tile_stored(6, ob, 64);
                else _tile_stored(7, ob, 64);
                for (int i = 0; i < m; i++) {
                    const int r = r0 + i;
                    float *o = out + (size_t)rows[r / group] * H * D + (size_t)(kh * group + r % group) * D
                               + 16 * (c0 + c);
                    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_load_ps(ob + 16 * i)));
                }
            }
        }
    }
}

/* 2^t for t <= 128: 2^n 2^r, n = round(t), |r| <= 1/2, 2^r by its Taylor polynomial of degree 4 (relative error
 * below 5e-5, under a tenth of bf16's rounding, which these weights take next); t below -127 gives about 0. */
static inline __m512 exp2_weights(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-127.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.6181291e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Rows [r0, r0 + 16) of the chunk (fewer at its end: the rest zeros, never written) for query head hq. The running
 * max m is in raw scores and moves only when a step's scores exceed it (then o and l are rescaled by
 * 2^((m - m') c)); a row's sum l is kept in 16 lanes and added up once at the end, the output times value_scale / l. */
static void flash_tile(const float *q, int q_stride, const uint16_t *kt, const uint16_t *vt, int first, int n, int r0,
                       int hq, int D, float scale, float value_scale, float *out, int out_stride) {
    uint16_t qa[FLASH_ROWS * 256] __attribute__((aligned(64)));  /* q's rows in bf16, D apart */
    float s[FLASH_ROWS * FLASH_KEYS] __attribute__((aligned(64)));
    __m512bh pa[FLASH_ROWS];  /* a step's weights: row i's 32 in pa[i] */
    float o[FLASH_ROWS * 256] __attribute__((aligned(64))), ob[FLASH_ROWS * 16] __attribute__((aligned(64)));
    __m512 l[FLASH_ROWS];
    float m[FLASH_ROWS], alpha[FLASH_ROWS];
    const float c = scale * 1.44269504088896341f;  /* scores to base-2 exponents */
    const int rows = n - r0 < FLASH_ROWS ? n - r0 : FLASH_ROWS;
    for (int i = 0; i < FLASH_ROWS; i++) {
        for (int d = 0; d < D; d += 16) {
            const __m512 x = i < rows ? _mm512_loadu_ps(q + (size_t)(r0 + i) * q_stride + (size_t)hq * D + d) : _mm512_setzero_ps();
            store_bf16x16(qa + i * D + d, x);
            _mm512_store_ps(o + i * D + d, _mm512_setzero_ps());
        }
        m[i] = -INFINITY, l[i] = _mm512_setzero_ps();
    }
    const int lo = first + r0, hi = first + r0 + rows - 1;  /* the tile's first and last positions */
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int j0 = 0; j0 <= hi; j0 += FLASH_KEYS) {
        flash_scores(qa, kt, j0, D, s);
        const int whole = j0 + FLASH_KEYS - 1 <= lo;  /* every row sees every key of the step */
        int rescale = 0;
        for (int i = 0; i < rows; i++) {
            __m512 a = _mm512_load_ps(s + i * FLASH_KEYS), b = _mm512_load_ps(s + i * FLASH_KEYS + 16);
            __mmask16 ka = 0xFFFF, kb = 0xFFFF;
            if (!whole) {  /* keys after the row's position (and past the chunk) */
                const __m512i seen = _mm512_set1_epi32(first + r0 + i - j0 + 1);  /* keys of this step the row sees */
                ka = _mm512_cmplt_epi32_mask(lanes, seen);
                kb = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32(16)), seen);
                a = _mm512_mask_blend_ps(ka, _mm512_set1_ps(-INFINITY), a);
                b = _mm512_mask_blend_ps(kb, _mm512_set1_ps(-INFINITY), b);
            }
            alpha[i] = 1.0f;
            const __m512 mi = _mm512_set1_ps(m[i]);
            if (_mm512_cmp_ps_mask(a, mi, _CMP_GT_OQ) | _mm512_cmp_ps_mask(b, mi, _CMP_GT_OQ)) {  /* a new max */
                const float top = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
                alpha[i] = m[i] == -INFINITY ? 0.0f : exp2f((m[i] - top) * c);
                l[i] = _mm512_mul_ps(l[i], _mm512_set1_ps(alpha[i]));
                m[i] = top, rescale = 1;
            }
            const __m512 shift = _mm512_set1_ps(m[i] * c);
            const __m512 pa16 = _mm512_maskz_mov_ps(ka, exp2_weights(_mm512_fmsub_ps(a, _mm512_set1_ps(c), shift)));
            const __m512 pb16 = _mm512_maskz_mov_ps(kb, exp2_weights(_mm512_fmsub_ps(b, _mm512_set1_ps(c), shift)));
            l[i] = _mm512_add_ps(l[i], _mm512_add_ps(pa16, pb16));
            pa[i] = _mm512_cvtne2ps_pbh(pb16, pa16);
        }
        for (int i = rows; i < FLASH_ROWS; i++) pa[i] = (__m512bh)_mm512_setzero_si512();
        _tile_loadd(6, pa, FLASH_KEYS * 2);
        for (int cc = 0; cc < D / 16; cc++) {
            _tile_zero(7);
            _tile_loadd(5, vt + (((size_t)(j0 / FLASH_KEYS) * (D / 16) + cc) * 512), 64);
            _tile_dpbf16ps(7, 6, 5);
            _tile_stored(7, ob, 64);
            for (int i = 0; i < rows; i++) {
                float *oi = o + i * D + 16 * cc;
                const __m512 add = _mm512_load_ps(ob + 16 * i);
                _mm512_store_ps(oi, rescale ? _mm512_fmadd_ps(_mm512_load_ps(oi), _mm512_set1_ps(alpha[i]), add)
                                            : _mm512_add_ps(_mm512_load_ps(oi), add));
            }
        }
    }
    for (int i = 0; i < rows; i++) {
        const __m512 inv = _mm512_set1_ps(value_scale / _mm512_reduce_add_ps(l[i]));
        float *dst = out + (size_t)(r0 + i) * out_stride + (size_t)hq * D;
        for (int d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_load_ps(o + i * D + d), inv));
    }
}

int flash_prefill_bf16(const float *q, int q_stride, const void *k_cache, const void *v_cache, const int32_t *table,
                       int first, int n, int H, int KVH, int D, int P, float scale, float *out, int out_stride,
                       int kv_kind, float kv_scale, int threads) {
    if (D % 32 || D > 256 || n <= 0 || !amx_tiles_granted()) return -1;
    const float unit = kv_read_scale(kv_kind, kv_scale);
    const int keys = first + n, padded = (keys + FLASH_KEYS - 1) / FLASH_KEYS * FLASH_KEYS, group = H / KVH;
    const size_t per_head = (size_t)padded * D;  /* bf16 values of K (and of V) a KV head */
    uint16_t *kt = aligned_alloc(64, per_head * 2 * KVH * sizeof(uint16_t)), *vt = kt + per_head * KVH;
    if (kt == NULL) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (KVH > 1)
    for (int h = 0; h < KVH; h++) {
        uint16_t *kh = kt + h * per_head, *vh = vt + h * per_head;
        if (kv_kind == KV_F16) flash_layout(k_cache, v_cache, table, keys, 0, padded, h, KVH, D, P, KV_F16, kh, vh);
        else if (kv_kind == KV_FP8)
            flash_layout(k_cache, v_cache, table, keys, 0, padded, h, KVH, D, P, KV_FP8, kh, vh);
        else flash_layout(k_cache, v_cache, table, keys, 0, padded, h, KVH, D, P, KV_F32, kh, vh);
    }
    const int tiles = (n + FLASH_ROWS - 1) / FLASH_ROWS;
#pragma omp parallel num_threads(threads)
    {
        flash_configure();
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < H * tiles; item++) {
            const int hq = item / tiles, r0 = (tiles - 1 - item % tiles) * FLASH_ROWS;  /* the longest rows first */
            const int h = hq / group;
            flash_tile(q, q_stride, kt + h * per_head, vt + h * per_head, first, n, r0, hq, D, scale * unit, unit, out,
                       out_stride);
        }
        _tile_release();
    }
    free(kt);
    return 0;
}
#else
int flash_ready(void) { return 0; }

int flash_prefill_bf16(const float *q, int q_stride, const void *k_cache, const void *v_cache, const int32_t *table,
                       int first, int n, int H, int KVH, int D, int P, float scale, float *out, int out_stride,
                       int kv_kind, float kv_scale, int threads) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)table, (void)first, (void)n, (void)H, (void)KVH;
    (void)D, (void)P, (void)scale, (void)out, (void)out_stride, (void)kv_kind, (void)kv_scale, (void)threads;
    return -1;
}
#endif
