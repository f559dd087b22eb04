/* Causal attention for a prompt chunk (bf16 in, fp32 softmax): its L queries sit at positions
 * offset..offset+L-1 and see keys 0..their own position (a cached prefix of `offset` tokens, then
 * the chunk itself).
 *
 * Both products go through the matmul's register-blocked core (gemm_block.h): S = Q K^T with K
 * packed as the "weight" (16 keys a tile), then O = P V with V^T packed the same way. One task is
 * one KV head and QB query tokens (all query heads of that KV head), and it only visits keys up
 * to its last token, so the causal half is skipped a block at a time. torch's CPU flash
 * attention took ~4.5 ms a layer for 512 tokens here.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "gemm_block.h"

#define QB 16 /* query tokens per task */

static long round_up(long x, long m) { return (x + m - 1) / m * m; }

/* Per-thread scratch bytes, and the packed K/V^T size (elements) through *pack_elems, for NK keys. */
long ps_prefill_attention_scratch(long NK, long heads, long kv_heads, long dim, long *pack_elems) {
    const long group = heads / kv_heads, rows = QB * group, lp = round_up(NK, 16);
    *pack_elems = kv_heads * 2 * lp * dim;
    return 64 + rows * dim * 2 /* q */ + rows * lp * 4 /* scores */ + rows * lp * 2 /* probs */ + rows * dim * 2 /* out */;
}

/* src rows (stride `stride`) -> [lp/16][dim/2][16][2]: keys as the product's output columns. */
static void pack_keys(const uint16_t *src, long stride, long L, long dim, long lp, uint16_t *dst) {
    memset(dst, 0, lp * dim * 2);
    for (long t = 0; t < L; t++)
        for (long d = 0; d < dim; d++)
            dst[(t / 16) * 16 * dim + (d / 2) * 32 + (t % 16) * 2 + (d & 1)] = src[t * stride + d];
}

/* src rows -> V^T packed [dim/16][lp/2][16][2]: dims as output columns, keys as the inner axis. */
static void pack_values(const uint16_t *src, long stride, long L, long dim, long lp, uint16_t *dst) {
    memset(dst, 0, lp * dim * 2);
    for (long t = 0; t < L; t++)
        for (long d = 0; d < dim; d++)
            dst[(d / 16) * 16 * lp + (t / 2) * 32 + (d % 16) * 2 + (t & 1)] = src[t * stride + d];
}

static inline void product(const uint16_t *x, long xs, const uint16_t *wp, long ts, void *y, long ys, long M,
                           long N, long K, int out_f32) {
    const long tiles = (N + 15) / 16;
    for (long t = 0; t < tiles; t += 2)
        for (long r = 0; r < M; r += ROWS) {
            const uint16_t *xr = x + r * xs;
            void *yr = out_f32 ? (void *)((float *)y + r * ys) : (void *)((uint16_t *)y + r * ys);
            block_rows(xr, xs, wp, ts, 0, yr, ys, N, K, out_f32, t, t + 1 < tiles, 0, M - r >= ROWS ? ROWS : M - r);
        }
}

/* q [L, heads, dim] (row stride q_row), k/v [offset + L, kv_heads, dim] (row strides), out
 * [L, heads, dim] contiguous. pack: ps_prefill_attention_scratch(offset + L)'s pack_elems;
 * scratch: threads x per_thread bytes. */
int ps_prefill_attention_bf16(const uint16_t *q, long q_row, const uint16_t *k, long k_row, const uint16_t *v,
                              long v_row, uint16_t *out, long L, long offset, long heads, long kv_heads, long dim,
                              float scale, uint16_t *pack, char *scratch, long per_thread, int threads) {
    if (dim % 32 || heads % kv_heads || L < 1 || offset < 0) return -1;
    const long NK = offset + L, group = heads / kv_heads, lp = round_up(NK, 16), blocks = (L + QB - 1) / QB;
    long need_pack;
    if (ps_prefill_attention_scratch(NK, heads, kv_heads, dim, &need_pack) > per_thread) return -2;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (long i = 0; i < 2 * kv_heads; i++) {
            long h = i / 2;
            uint16_t *dst = pack + i * lp * dim;
            if (i % 2 == 0) pack_keys(k + h * dim, k_row, NK, dim, lp, dst);
            else pack_values(v + h * dim, v_row, NK, dim, lp, dst);
        }
        char *mine = scratch + omp_get_thread_num() * per_thread;
        uint16_t *qbuf = (uint16_t *)mine;
        float *sc = (float *)(qbuf + QB * group * dim);
        uint16_t *probs = (uint16_t *)(sc + QB * group * lp);
        uint16_t *obuf = probs + QB * group * lp;
        /* later query blocks see more keys: hand them out first and dynamically */
#pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < kv_heads * blocks; task++) {
            const long h = task % kv_heads, qb = blocks - 1 - task / kv_heads;
            const long i0 = qb * QB, i1 = i0 + QB < L ? i0 + QB : L, rows = (i1 - i0) * group;
            const long nk = offset + i1, nkp = round_up(nk, 2);
            const uint16_t *kp = pack + (2 * h) * lp * dim, *vp = pack + (2 * h + 1) * lp * dim;
            for (long i = i0; i < i1; i++)
                memcpy(qbuf + (i - i0) * group * dim, q + i * q_row + h * group * dim, group * dim * 2);
            product(qbuf, dim, kp, 16 * dim, sc, lp, rows, nk, dim, 1);
            for (long r = 0; r < rows; r++) {
                const long valid = offset + i0 + r / group + 1; /* keys 0..token */
                float *s = sc + r * lp;
                uint16_t *p = probs + r * nkp;
                __m512 vmx = _mm512_set1_ps(-INFINITY), vs = _mm512_set1_ps(scale);
                long t = 0;
                for (; t + 16 <= valid; t += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + t));
                if (t < valid)
                    vmx = _mm512_max_ps(vmx, _mm512_mask_loadu_ps(vmx, (__mmask16)((1u << (valid - t)) - 1), s + t));
                __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx) * scale), sum = _mm512_setzero_ps();
                for (t = 0; t < valid; t += 16) {
                    __mmask16 m = valid - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (valid - t)) - 1);
                    __m512 e = exp_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, s + t), vs, mx));
                    e = _mm512_maskz_mov_ps(m, e);
                    _mm512_mask_storeu_ps(s + t, m, e);
                    sum = _mm512_add_ps(sum, e);
                }
                __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
                for (t = 0; t < nkp; t += 16) {
                    long left = nkp - t;
                    __mmask16 st = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
                    __mmask16 live = valid - t >= 16 ? (__mmask16)0xffff
                                     : valid > t ? (__mmask16)((1u << (valid - t)) - 1) : 0;
                    __m512 e = _mm512_maskz_mul_ps(live, _mm512_maskz_loadu_ps(live, s + t), inv);
                    _mm256_mask_storeu_epi16(p + t, st, (__m256i)_mm512_cvtneps_pbh(e));
                }
            }
            product(probs, nkp, vp, 16 * lp, obuf, dim, rows, dim, nkp, 0);
            for (long i = i0; i < i1; i++)
                memcpy(out + (i * heads + h * group) * dim, obuf + (i - i0) * group * dim, group * dim * 2);
        }
    }
    return 0;
}
