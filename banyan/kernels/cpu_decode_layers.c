/* A whole decode step's decoder layers in one call, for a few rows on x86 CPUs with AVX2 (built into the same
 * library as cpu_gemv.c and cpu_decode.c; banyan/kernels/cpu_decode.py binds it, banyan/runner/cpu_step.py
 * decides when it serves). At batch 1 a step of a small model was half Python: nine ctypes calls a layer with
 * their arguments and output tensors, the module calls and the checks around them. This runs the same kernels in
 * the same order from C, so the results have the same bits as the call-by-call path:
 *
 *     h = rms_norm(x)                                  input_layernorm
 *     qkv = h Wqkv^T (+ b)                             int4_gemv / int8_gemv / float_gemv, as QuantizedLinear
 *     rope_store_kv(q, k, v)                           q, k rotated in place; k, v to their cache slots
 *     a = paged_attention(q) Wo^T (+ b)
 *     x = x + a, h = rms_norm(x)                       post_attention_layernorm with the residual add
 *     x = x + down(silu(gate(h)) * up(h))
 */
#include <stddef.h>
#include <stdint.h>

/* the kernels of cpu_gemv.c and cpu_decode.c (one library) */
void int4_gemv(const float *x, void *scratch, const uint8_t *packed, const void *scale, const void *offset, int half,
               float *y, int M, int N, int K, int group, int threads);
void int8_gemv(const float *x, void *scratch, const uint8_t *packed, const float *scale, float *y, int M, int N, int K,
               int threads);
void float_gemv(const float *x, const void *w, int half, float *y, int M, int N, int K, int threads);
void rms_norm(const float *x, const float *residual, float *sum_out, const float *w, float *y, int rows, int dim,
              float eps, int threads);
int rope_store_kv(float *q, int q_stride, float *k, int k_stride, const float *v, int v_stride,
                  const int64_t *positions, const float *cos_table, const float *sin_table, int max_pos,
                  void *k_cache, void *v_cache, const int64_t *slots, int T, int H, int KVH, int D, int kv_kind,
                  float inv_scale, int threads);
void paged_attention(const float *q, int q_stride, const void *k_cache, const void *v_cache,
                     const int32_t *tables, int table_stride, const int32_t *rows, const int32_t *seq_of_row,
                     const int32_t *positions, const int32_t *shared, int n, int H, int KVH, int D, int P, int window,
                     float scale, float *out, float *scratch, int max_keys, int kv_kind, float kv_scale, int threads,
                     int bf16_tiles);
void silu_mul(const float *x, float *y, int rows, int n, int threads);

enum { LINEAR_INT4 = 0, LINEAR_INT8 = 1, LINEAR_FP16 = 2 };

/* A weight as QuantizedLinear hands it to its narrow kernel (cpu_gemv.c has each layout). */
typedef struct {
    int kind, out, in, group;  /* LINEAR_*; N, K; int4's group size */
    int half;                  /* int4: scale and offset are float16 (else float32) */
    const void *q;             /* int4 | int8 8 rows interleaved (cpu_gemv.c) | float16 [N, K] */
    const void *scale;         /* int4 [N8 / 8, K/group, 8] | int8 [N8] float32 | unused */
    const void *offset;        /* int4 [N8 / 8, K/group, 8] | unused */
    const float *bias;         /* [N] or NULL */
} Linear;

typedef struct {
    const float *input_norm, *post_norm;  /* [hidden] */
    Linear qkv, o, gate_up, down;
    void *k_cache, *v_cache;              /* [pages, page_size, kv_heads, head_dim] of Step's kv_kind */
    int window;                           /* sliding window; 0: none */
} Layer;

/* What every layer shares, and one step's rows: paged_attention's arguments (see cpu_decode.c). */
typedef struct {
    int hidden, heads, kv_heads, head_dim, intermediate, page_size, max_pos, threads;
    int kv_kind;                          /* the caches' element: cpu_decode.c's KV_F32, KV_F16, KV_FP8 */
    float eps, scale;
    float kv_scale, kv_inv_scale;         /* an fp8 cache's scale and 1 / it (as torch rounds it); else 1 */
    const float *cos, *sin;               /* [max_pos, head_dim / 2] */
    const int64_t *positions, *slots;     /* [M] */
    const int32_t *tables, *rows, *seq_of_row, *row_positions, *shared;  /* shared: NULL or per row */
    int table_stride, max_keys;
    void *quant_scratch;                  /* x as int8 blocks: M * K + 8 * M * K / 32 bytes for the widest K */
    float *attn_scratch;                  /* threads * (heads / kv_heads + 1) * max_keys floats */
    int bf16_tiles;                       /* shared prompts' decode tiles on AMX-BF16 (paged_attention) */
} Step;

static void linear(const Linear *l, const float *x, float *y, int M, const Step *s) {
    if (l->kind == LINEAR_INT4)
        int4_gemv(x, s->quant_scratch, l->q, l->scale, l->offset, l->half, y, M, l->out, l->in, l->group, s->threads);
    else if (l->kind == LINEAR_INT8)
        int8_gemv(x, s->quant_scratch, l->q, (const float *)l->scale, y, M, l->out, l->in, s->threads);
    else
        float_gemv(x, l->q, 1, y, M, l->out, l->in, s->threads);
    if (l->bias != NULL)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < l->out; n++) y[(size_t)m * l->out + n] += l->bias[n];
}

/* x [M, hidden]: the embeddings in, the last layer's residual stream out. work: M * (2 hidden + qkv + heads *
 * head_dim + 3 intermediate) floats. Returns 0, or how many positions fell outside the rotary table (nothing is
 * computed past the first layer then). */
int decode_layers(const Layer *layers, int num_layers, const Step *s, float *x, int M, float *work) {
    const int q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim, qkv_n = q_size + 2 * kv_size;
    float *h = work, *a = h + (size_t)M * s->hidden, *qkv = a + (size_t)M * s->hidden;
    float *attn = qkv + (size_t)M * qkv_n, *gate_up = attn + (size_t)M * q_size;
    float *act = gate_up + (size_t)M * 2 * s->intermediate;
    for (int l = 0; l < num_layers; l++) {
        const Layer *L = &layers[l];
        rms_norm(x, NULL, NULL, L->input_norm, h, M, s->hidden, s->eps, s->threads);
        linear(&L->qkv, h, qkv, M, s);
        int bad = rope_store_kv(qkv, qkv_n, qkv + q_size, qkv_n, qkv + q_size + kv_size, qkv_n, s->positions, s->cos,
                                s->sin, s->max_pos, L->k_cache, L->v_cache, s->slots, M, s->heads, s->kv_heads,
                                s->head_dim, s->kv_kind, s->kv_inv_scale, s->threads);
        if (bad) return bad;
        paged_attention(qkv, qkv_n, L->k_cache, L->v_cache, s->tables, s->table_stride, s->rows, s->seq_of_row,
                        s->row_positions, s->shared, M, s->heads, s->kv_heads, s->head_dim, s->page_size, L->window, s->scale,
                        attn, s->attn_scratch, s->max_keys, s->kv_kind, s->kv_scale, s->threads, s->bf16_tiles);
        linear(&L->o, attn, a, M, s);
        rms_norm(x, a, x, L->post_norm, h, M, s->hidden, s->eps, s->threads);  /* x += a, h = its norm */
        linear(&L->gate_up, h, gate_up, M, s);
        silu_mul(gate_up, act, M, s->intermediate, s->threads);
        linear(&L->down, act, a, M, s);
        for (size_t i = 0; i < (size_t)M * s->hidden; i++) x[i] += a[i];
    }
    return 0;
}
