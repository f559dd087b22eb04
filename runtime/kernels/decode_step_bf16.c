/* A whole decode step of the native bf16 CPU path (AVX512-BF16) in one call: every layer's
 * RMSNorm, projections, RoPE + K/V write, paged attention, SwiGLU and residuals, then the final
 * norm and the LM head; the twin of decode_step_f32.c for CPUs where dtype auto is bf16.
 *
 * Why: a batch-1 step of SmolLM2 here is ~300 kernel calls with Python between them, and at
 * ~10 ms a step that fixed cost, not the weight bytes, decided both how close decode came to
 * the memory-bandwidth bound and how much a GGUF Q8_0 step (half the bytes) gained over bf16.
 *
 * It calls the same kernels with the same arguments in the same order as the layer-by-layer
 * forward (llama.py on bf16 activations), so the logits are the same bits (the runner checks its
 * first step). Matmuls the forward shares with the decode helpers, or runs through the GGUF block
 * kernels, live in the AVX2 library (decode_helpers.c, quant_gemm.c): their addresses come in the
 * step, as cpu_gemm.shared_call and cpu_quant.matmul reach them. GGUF projections take fp32
 * activations: x and the residual are widened here and the result rounded to bf16, as
 * cpu_quant.matmul does, and a GGUF gate/up's fp32 sums go through the fp32 SwiGLU before one
 * rounding (Linear.swiglu).
 */
#include <immintrin.h>
#include <stdint.h>

#include "bf16_round.h"
#include "decode_step.h"

int ps_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, long M, long K, float eps, int threads);
int ps_rope_write_bf16(uint16_t *qkv, long M, long heads, long kv_heads, long dim, const float *cos,
                       const float *sin, const int64_t *slots, uint16_t *k_cache, uint16_t *v_cache, int threads);
int ps_decode_attention_bf16(const uint16_t *q, long q_row, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *tables, long max_blocks, const int64_t *lens, uint16_t *out, long n,
                             long heads, long kv_heads, long dim, long block_size, float scale, float *scratch,
                             long scratch_per_thread, int threads);
int ps_attention_args_bf16(const int64_t *lens, long n, long heads, long kv_heads, long dim, long block_size,
                           long max_blocks, long scratch_per_thread);
void ps_attention_tasks_bf16(const uint16_t *q, long q_row, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *tables, long max_blocks, const int64_t *lens, uint16_t *out, long heads,
                             long kv_heads, long dim, long block_size, float scale, float *scores, long t0, long t1);
int ps_gemm_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *res, void *y, long M, long N, long K,
                 int out_f32, int threads, int act);
void ps_bf16_blocks(const uint16_t *x, const uint16_t *wp, const uint16_t *res, void *y, long M, long N, long K,
                    int out_f32, int act, long b0, long b1);

/* The AVX2 library's calls, by address (see the top of this file). */
typedef int (*bf16_shared_fn)(void *fn, const uint16_t *x, const uint16_t *wp, const uint16_t *res, void *y, long M,
                              long N, long K, int out_f32, int act);
typedef int (*qgemm_fn)(const float *x, const uint8_t *w, const float *residual, float *out, long m, long n, long k,
                        long row_bytes, int type, int threads);
typedef int (*qgemm_shared_fn)(const float *x, const uint8_t *w, const float *res, float *y, long M, long N, long K,
                               long row_bytes, int type);
typedef int (*swiglu_fn)(const float *gu, float *y, long M, long I);
typedef int (*attn_shared_fn)(void *fn, const uint16_t *q, long q_row, const uint16_t *k_cache,
                              const uint16_t *v_cache, const int64_t *tables, long max_blocks, const int64_t *lens,
                              uint16_t *out, long n, long heads, long kv_heads, long dim, long block_size, float scale,
                              float *scratch, long scratch_per_thread);

typedef struct {
    long rows, hidden, heads, kv_heads, head_dim, inter, block_size, max_blocks, scratch_per_thread;
    float eps, scale;
    const float *cos, *sin;                       /* [rows, head_dim / 2] */
    const int64_t *slots, *tables, *lens;         /* [rows], [rows, max_blocks], [rows] */
    uint16_t *x, *xb, *h, *qkv, *attn, *mid;      /* bf16 work: see cpu_decode_step.py */
    float *xf, *rf, *yf;                          /* fp32 work of GGUF projections */
    float *scratch;
    const uint16_t *final_norm;
    ps_proj_t head;
    float *logits;                                /* [rows, head.n] */
    int threads;                                  /* 1: matmuls shared with the decode helpers */
    void *bf16_shared;                            /* ps_bf16_shared, or NULL: ps_gemm_bf16 alone */
    void *qgemm, *qgemm_shared, *swiglu_f32;      /* NULL where no projection is GGUF blocks */
    void *attn_shared;                            /* ps_decode_attention_bf16_shared, or NULL */
} ps_step_bf16_t;

/* GGUF blocks: fp32 in (x widened, the residual widened), fp32 sums, as cpu_quant.matmul. */
static int qproj(const ps_step_bf16_t *s, const ps_proj_t *p, const float *xf, const uint16_t *res, float *y) {
    const long M = s->rows;
    const float *rf = 0;
    if (res) {
        bf16_widen(res, s->rf, M * p->n);
        rf = s->rf;
    }
    if (s->threads == 1 && s->qgemm_shared)
        return ((qgemm_shared_fn)s->qgemm_shared)(xf, p->w, rf, y, M, p->n, p->k, p->row_bytes, p->qtype);
    if (!s->qgemm) return -1;
    return ((qgemm_fn)s->qgemm)(xf, p->w, rf, y, M, p->n, p->k, p->row_bytes, p->qtype, s->threads);
}

/* y = x @ W^T (+ res) in bf16 (fp32 when out_f32); act: bf16 tiles with the fused SwiGLU, or a
   GGUF gate/up with the fp32 SwiGLU after it. As Linear.forward / Linear.swiglu choose. */
static int proj(const ps_step_bf16_t *s, const ps_proj_t *p, const uint16_t *x, const uint16_t *res, void *y,
                int out_f32, int act) {
    const long M = s->rows;
    if (p->row_bytes == 0) {
        if (s->threads == 1 && s->bf16_shared)
            return ((bf16_shared_fn)s->bf16_shared)((void *)ps_bf16_blocks, x, p->w, res, y, M, p->n, p->k, out_f32,
                                                    act);
        return ps_gemm_bf16(x, p->w, res, y, M, p->n, p->k, out_f32, s->threads, act);
    }
    bf16_widen(x, s->xf, M * p->k);
    if (out_f32) return qproj(s, p, s->xf, res, y);
    int rc = qproj(s, p, s->xf, res, s->yf);
    if (rc) return rc;
    if (act) {
        if (!s->swiglu_f32) return -1;
        rc = ((swiglu_fn)s->swiglu_f32)(s->yf, s->xf, M, p->n / 2);
        bf16_narrow(s->xf, y, M * (p->n / 2));
    } else {
        bf16_narrow(s->yf, y, M * p->n);
    }
    return rc;
}

/* The layer's decode attention: on one thread with the decode helpers sharing its tasks where
   they run (the matmuls' rule), else on s->threads. The same bits either way. */
static int attention(const ps_step_bf16_t *s, const ps_layer_t *L, long q_row) {
    const long M = s->rows, nq = s->heads, nkv = s->kv_heads, D = s->head_dim;
    if (s->threads == 1 && s->attn_shared) {
        const int bad = ps_attention_args_bf16(s->lens, M, nq, nkv, D, s->block_size, s->max_blocks,
                                               s->scratch_per_thread);
        if (bad) return bad;
        return ((attn_shared_fn)s->attn_shared)((void *)ps_attention_tasks_bf16, s->qkv, q_row, L->k_cache,
                                                L->v_cache, s->tables, s->max_blocks, s->lens, s->attn, M, nq, nkv,
                                                D, s->block_size, s->scale, s->scratch, s->scratch_per_thread);
    }
    return ps_decode_attention_bf16(s->qkv, q_row, L->k_cache, L->v_cache, s->tables, s->max_blocks, s->lens,
                                    s->attn, M, nq, nkv, D, s->block_size, s->scale, s->scratch,
                                    s->scratch_per_thread, s->threads);
}

/* Returns 0, or the failing call's code with the layer in the hundreds (-(layer * 100 + op)). */
long ps_decode_step_bf16(const ps_step_bf16_t *s, const ps_layer_t *layers, long n_layers) {
    const long M = s->rows, H = s->hidden, nq = s->heads, nkv = s->kv_heads, D = s->head_dim;
    const long q_row = (nq + 2 * nkv) * D;
    uint16_t *x = s->x, *xb = s->xb;
    for (long l = 0; l < n_layers; l++) {
        const ps_layer_t *L = layers + l;
        const long code = -(l * 100);
        if (ps_rms_norm_bf16(x, L->attn_norm, s->h, M, H, s->eps, s->threads)) return code - 1;
        if (proj(s, &L->qkv, s->h, 0, s->qkv, 0, 0)) return code - 2;
        if (ps_rope_write_bf16(s->qkv, M, nq, nkv, D, s->cos, s->sin, s->slots, L->k_cache, L->v_cache, s->threads))
            return code - 3;
        if (attention(s, L, q_row)) return code - 4;
        if (proj(s, &L->o, s->attn, x, xb, 0, 0)) return code - 5;
        if (ps_rms_norm_bf16(xb, L->mlp_norm, s->h, M, H, s->eps, s->threads)) return code - 6;
        if (proj(s, &L->gate_up, s->h, 0, s->mid, 0, 1)) return code - 7;
        if (proj(s, &L->down, s->mid, xb, x, 0, 0)) return code - 9;
    }
    if (ps_rms_norm_bf16(x, s->final_norm, s->h, M, H, s->eps, s->threads)) return -99001;
    if (proj(s, &s->head, s->h, 0, s->logits, 1, 0)) return -99002;
    return 0;
}
