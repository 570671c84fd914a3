/* Greedy sampling's argmax over a step's logits on x86 CPUs with AVX2 (built into the same library as
 * cpu_gemv.c; banyan/kernels/cpu_argmax.py binds it). A batch-256 step of a 49k vocabulary is 50 MB of float32,
 * more than the L3, so the pass is memory bound: this reads each logit once, with the rows split over the
 * threads, where torch's CPU argmax is several times slower than its max (banyan's torch fallback is a block
 * max, then an argmax inside the winning block: one pass too, with more work per element).
 *
 * The answer is torch.argmax's, bit for bit: the first index of the maximum; a NaN counts as the maximum (the
 * first NaN's index); a row of -inf answers 0. Each of 32 lanes keeps the first index of its own strict maximum
 * (v > best); the lanes then reduce to the greatest value, on ties the smallest index.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define LANES 32

static int64_t first_nan(const float *x, int64_t n) {
    for (int64_t j = 0; j < n; j++)
        if (x[j] != x[j]) return j;
    return -1;
}

static int64_t argmax_row(const float *x, int64_t n) {
    __m256 best[4], nan = _mm256_setzero_ps();
    __m256i where[4], index[4];
    const __m256i step = _mm256_set1_epi32(LANES), none = _mm256_set1_epi32(-1);
    for (int a = 0; a < 4; a++) {
        best[a] = _mm256_set1_ps(-INFINITY);
        where[a] = none;
        index[a] = _mm256_add_epi32(_mm256_set1_epi32(8 * a), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    }
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int a = 0; a < 4; a++) {
            __m256 v = _mm256_loadu_ps(x + i + 8 * a);
            __m256 greater = _mm256_cmp_ps(v, best[a], _CMP_GT_OQ);  /* false for NaN: flagged apart */
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            best[a] = _mm256_blendv_ps(best[a], v, greater);
            where[a] = _mm256_castps_si256(
                _mm256_blendv_ps(_mm256_castsi256_ps(where[a]), _mm256_castsi256_ps(index[a]), greater));
            index[a] = _mm256_add_epi32(index[a], step);
        }
    }
    if (_mm256_movemask_ps(nan)) return first_nan(x, n);
    float values[LANES];
    int32_t indices[LANES];
    for (int a = 0; a < 4; a++) {
        _mm256_storeu_ps(values + 8 * a, best[a]);
        _mm256_storeu_si256((__m256i *)(indices + 8 * a), where[a]);
    }
    float max = -INFINITY;
    int64_t at = 0;  /* every value -inf so far: index 0 */
    for (int l = 0; l < LANES; l++)
        if (indices[l] >= 0 && (values[l] > max || (values[l] == max && indices[l] < at))) {
            max = values[l];
            at = indices[l];
        }
    for (; i < n; i++) {  /* the tail, past the last whole group of LANES */
        if (x[i] != x[i]) return first_nan(x, n);
        if (x[i] > max) {
            max = x[i];
            at = i;
        }
    }
    return at;
}

/* x [rows, n] float32 with row stride `stride` (floats), n < 2^31; out [rows] int64. */
void argmax_rows(const float *x, int64_t *out, int rows, int n, int64_t stride, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (int64_t)r * stride, n);
}
