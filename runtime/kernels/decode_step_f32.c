/* A whole decode step of the fp32-activation CPU path in one call: every layer's RMSNorm,
 * projections, RoPE + K/V write, paged attention, SwiGLU and residuals, then the final norm and
 * the LM head (cpu_decode_step.py builds the arguments once per model and per step).
 *
 * Why: at decode sizes the step of a small model on a CPU is ~300 kernel calls, and the Python
 * between them (module calls, views, a ctypes conversion of every argument, an allocation per
 * output) cost about as long as the kernels that are not matmuls; a GGUF Q8_0 step streams half
 * the bytes of a bf16 one, so that fixed cost decided how much faster it could be.
 *
 * It calls the same kernels, with the same arguments, in the same order as the layer-by-layer
 * forward (llama.py with the fp32 layer kernels): the logits are the same bits, which the runner
 * checks on its first step. With one thread the matmuls are shared with the decode helpers
 * (decode_helpers.c), as the forward's are, and so are the attention's (sequence, KV head) tasks.
 */
#include <stdint.h>

#include "decode_step.h"

int ps_rms_norm_f32(const float *x, const float *w, float *y, long M, long K, float eps, int threads);
int ps_rope_write_f32(float *qkv, long M, long heads, long kv_heads, long dim, const float *cos, const float *sin,
                      const int64_t *slots, float *k_cache, float *v_cache, int threads);
int ps_decode_attention_f32(const float *q, long q_row, const float *k_cache, const float *v_cache,
                            const int64_t *tables, long max_blocks, const int64_t *lens, float *out, long n,
                            long heads, long kv_heads, long dim, long block_size, float scale, float *scratch,
                            long scratch_per_thread, int threads);
int ps_decode_attention_f32_shared(const float *q, long q_row, const float *k_cache, const float *v_cache,
                                   const int64_t *tables, long max_blocks, const int64_t *lens, float *out, long n,
                                   long heads, long kv_heads, long dim, long block_size, float scale, float *scratch,
                                   long scratch_per_thread);
int ps_swiglu_f32(const float *gu, float *y, long M, long I);
int ps_gemm_bf16w_f32(const float *x, const uint16_t *wp, const float *res, float *y, long M, long N, long K,
                      int threads, int act);
int ps_gemm_bf16w_f32_shared(const float *x, const uint16_t *wp, const float *res, float *y, long M, long N, long K,
                             int act);
int ps_qgemm(const float *x, const uint8_t *w, const float *residual, float *out, long m, long n, long k,
             long row_bytes, int type, int threads);
int ps_qgemm_shared(const float *x, const uint8_t *w, const float *res, float *y, long M, long N, long K,
                    long row_bytes, int type);

typedef struct {
    long rows, hidden, heads, kv_heads, head_dim, inter, block_size, max_blocks, scratch_per_thread;
    float eps, scale;
    const float *cos, *sin;                 /* [rows, head_dim / 2] */
    const int64_t *slots, *tables, *lens;   /* [rows], [rows, max_blocks], [rows] */
    float *x, *xb, *h, *qkv, *attn, *mid, *gu, *scratch; /* work: see cpu_decode_step.py */
    const float *final_norm;
    ps_proj_t head;
    float *logits;                          /* [rows, head.n] */
    int threads;                            /* 1: matmuls shared with the decode helpers */
} ps_step_t;

/* y = x @ W^T (+ res); act: the fused SwiGLU of bf16 tiles. As cpu_gemm_avx2.matmul and
   cpu_quant.matmul choose (below their dense-rows switch, which the caller keeps to). */
static int proj(const ps_step_t *s, const ps_proj_t *p, const float *x, const float *res, float *y, int act) {
    const long M = s->rows;
    if (p->row_bytes == 0)
        return s->threads == 1 ? ps_gemm_bf16w_f32_shared(x, p->w, res, y, M, p->n, p->k, act)
                               : ps_gemm_bf16w_f32(x, p->w, res, y, M, p->n, p->k, s->threads, act);
    return s->threads == 1 ? ps_qgemm_shared(x, p->w, res, y, M, p->n, p->k, p->row_bytes, p->qtype)
                           : ps_qgemm(x, p->w, res, y, M, p->n, p->k, p->row_bytes, p->qtype, s->threads);
}

/* The layer's decode attention; with one thread its (sequence, KV head) tasks are shared with the
   decode helpers too (the same bits). */
static int attention(const ps_step_t *s, const ps_layer_t *L) {
    const long q_row = (s->heads + 2 * s->kv_heads) * s->head_dim;
    if (s->threads == 1)
        return ps_decode_attention_f32_shared(s->qkv, q_row, L->k_cache, L->v_cache, s->tables, s->max_blocks, s->lens,
                                              s->attn, s->rows, s->heads, s->kv_heads, s->head_dim, s->block_size,
                                              s->scale, s->scratch, s->scratch_per_thread);
    return ps_decode_attention_f32(s->qkv, q_row, L->k_cache, L->v_cache, s->tables, s->max_blocks, s->lens, s->attn,
                                   s->rows, s->heads, s->kv_heads, s->head_dim, s->block_size, s->scale, s->scratch,
                                   s->scratch_per_thread, s->threads);
}

/* Returns 0, or the failing call's code with the layer in the tens (-(layer * 100 + op)) so a
   rejected argument is found without a debugger. */
long ps_decode_step_f32(const ps_step_t *s, const ps_layer_t *layers, long n_layers) {
    const long M = s->rows, H = s->hidden, nq = s->heads, nkv = s->kv_heads, D = s->head_dim;
    float *x = s->x, *xb = s->xb;
    for (long l = 0; l < n_layers; l++) {
        const ps_layer_t *L = layers + l;
        const long code = -(l * 100);
        if (ps_rms_norm_f32(x, (const float *)L->attn_norm, s->h, M, H, s->eps, s->threads)) return code - 1;
        if (proj(s, &L->qkv, s->h, 0, s->qkv, 0)) return code - 2;
        float *k_cache = L->k_cache, *v_cache = L->v_cache;
        if (ps_rope_write_f32(s->qkv, M, nq, nkv, D, s->cos, s->sin, s->slots, k_cache, v_cache, s->threads))
            return code - 3;
        if (attention(s, L)) return code - 4;
        if (proj(s, &L->o, s->attn, x, xb, 0)) return code - 5;
        if (ps_rms_norm_f32(xb, (const float *)L->mlp_norm, s->h, M, H, s->eps, s->threads)) return code - 6;
        if (L->gate_up.swiglu) {
            if (proj(s, &L->gate_up, s->h, 0, s->mid, 1)) return code - 7;
        } else {
            if (proj(s, &L->gate_up, s->h, 0, s->gu, 0)) return code - 7;
            if (ps_swiglu_f32(s->gu, s->mid, M, s->inter)) return code - 8;
        }
        if (proj(s, &L->down, s->mid, xb, x, 0)) return code - 9;
    }
    if (ps_rms_norm_f32(x, s->final_norm, s->h, M, H, s->eps, s->threads)) return -99001;
    if (proj(s, &s->head, s->h, 0, s->logits, 0)) return -99002;
    return 0;
}
