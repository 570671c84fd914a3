/* Causal attention in one fixed order per query row, for batch-invariant decoding on CPUs (built into the same
 * library as cpu_gemv.c; banyan/kernels/cpu_gemv.py loads it; banyan/layers/attention/torch_backend.py calls it).
 *
 * A row's output depends only on its query and the keys and values it sees, never on how many rows, sequences
 * or padded positions share the call: SDPA's blocking follows the shapes (a decode row alone and the same row
 * in a batch of 32 differ in the last bits), and over a long greedy generation such bits flip a near-tie.
 * Here every (row, head) walks its visible keys in position order:
 *
 *     s_t = scale * <q, k_t>           8-lane partial sums over head_dim, then one fixed horizontal sum
 *     p_t = exp(s_t - max_t s_t)       sum p_t added in position order
 *     out = (sum_t p_t v_t) / sum p_t  accumulated in position order, per element of head_dim
 *
 * so a prompt token computed inside a prefill chunk, a later chunk, or a decode step gets the same bits.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

static inline float dot(const float *a, const float *b, int n) {
    float total = 0.0f;
    int i = 0;
    if (n % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* q, out [S, Q, H, D]; k, v [S, C, KVH, D]; mask [S, Q, C]: the positions row j of sequence s sees (none: the
 * row comes out zero). scratch: threads * C floats. */
void attend_rows(const float *q, const float *k, const float *v, const uint8_t *mask, float *out, float *scratch,
                 int S, int Q, int C, int H, int KVH, int D, float scale, int threads) {
    const int group = H / KVH;
#pragma omp parallel for collapse(3) num_threads(threads) schedule(static)
    for (int s = 0; s < S; s++) {
        for (int j = 0; j < Q; j++) {
            for (int h = 0; h < H; h++) {
                const uint8_t *seen = mask + ((size_t)s * Q + j) * C;
                const float *qr = q + (((size_t)s * Q + j) * H + h) * D;
                float *o = out + (((size_t)s * Q + j) * H + h) * D, *p = scratch + (size_t)omp_get_thread_num() * C;
                float top = -INFINITY, total = 0.0f;
                for (int d = 0; d < D; d++) o[d] = 0.0f;
                for (int t = 0; t < C; t++) {
                    if (!seen[t]) continue;
                    p[t] = scale * dot(qr, k + (((size_t)s * C + t) * KVH + h / group) * D, D);
                    top = fmaxf(top, p[t]);
                }
                for (int t = 0; t < C; t++) {
                    if (!seen[t]) continue;
                    const float w = expf(p[t] - top), *vt = v + (((size_t)s * C + t) * KVH + h / group) * D;
                    total += w;
                    for (int d = 0; d < D; d++) o[d] += w * vt[d];
                }
                if (total > 0.0f)
                    for (int d = 0; d < D; d++) o[d] /= total;
            }
        }
    }
}
