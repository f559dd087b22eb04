/* Single-query (decode) attention over a paged bf16 KV cache, reading K and V where they lie.
 *
 * The torch path gathers each sequence's K/V rows into a padded copy and runs two block-diagonal
 * bmm over it: every byte of KV is read twice and written once, and 2/3 of the multiplies are
 * zeros. Here one (sequence, KV head) pair is one task: scores for the query heads that share
 * that KV head, a float32 softmax, and the weighted sum of V rows, all from the cache slots the
 * block table names.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <omp.h>

#include "vec_math.h"

#define MAX_GROUP 16 /* query heads per KV head this kernel handles */
#define MAX_DIM 256

static void one_head(const uint16_t *q, long q_head_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                     const int64_t *table, long ctx, uint16_t *out, long group, long kv_heads, long kv_head,
                     long dim, long block_size, float scale, float *scores) {
    const long row = kv_heads * dim; /* elements per cache slot */
    const long chunks = dim / 16;    /* 16 fp32 lanes per chunk */
    __m512 qv[MAX_GROUP][MAX_DIM / 16];
    for (long g = 0; g < group; g++)
        for (long c = 0; c < chunks; c++)
            qv[g][c] = _mm512_mul_ps(bf16_to_f32(_mm256_loadu_si256((const __m256i *)(q + g * q_head_stride + c * 16))),
                                     _mm512_set1_ps(scale));
    /* scores[g][t] */
    for (long t = 0; t < ctx; t++) {
        long slot = table[t / block_size] * block_size + t % block_size;
        const uint16_t *k = k_cache + slot * row + kv_head * dim;
        __m512 kv[MAX_DIM / 16];
        for (long c = 0; c < chunks; c++) kv[c] = bf16_to_f32(_mm256_loadu_si256((const __m256i *)(k + c * 16)));
        for (long g = 0; g < group; g++) {
            __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
            for (long c = 1; c < chunks; c++) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
            scores[g * ctx + t] = _mm512_reduce_add_ps(acc);
        }
    }
    for (long g = 0; g < group; g++) {
        float *s = scores + g * ctx;
        float mx = -INFINITY;
        for (long t = 0; t < ctx; t++) mx = s[t] > mx ? s[t] : mx;
        __m512 vmx = _mm512_set1_ps(mx), vsum = _mm512_setzero_ps();
        long t = 0;
        for (; t + 16 <= ctx; t += 16) {
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), vmx));
            _mm512_storeu_ps(s + t, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        if (t < ctx) {
            __mmask16 m = (__mmask16)((1u << (ctx - t)) - 1);
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), vmx));
            _mm512_mask_storeu_ps(s + t, m, e);
            vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
        }
        float inv = 1.0f / _mm512_reduce_add_ps(vsum);
        for (t = 0; t < ctx; t++) s[t] *= inv;
    }
    __m512 acc[MAX_GROUP][MAX_DIM / 16];
    for (long g = 0; g < group; g++)
        for (long c = 0; c < chunks; c++) acc[g][c] = _mm512_setzero_ps();
    for (long t = 0; t < ctx; t++) {
        long slot = table[t / block_size] * block_size + t % block_size;
        const uint16_t *v = v_cache + slot * row + kv_head * dim;
        for (long c = 0; c < chunks; c++) {
            __m512 vv = bf16_to_f32(_mm256_loadu_si256((const __m256i *)(v + c * 16)));
            for (long g = 0; g < group; g++) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * ctx + t]), vv, acc[g][c]);
        }
    }
    for (long g = 0; g < group; g++)
        for (long c = 0; c < chunks; c++)
            _mm256_storeu_si256((__m256i *)(out + g * dim + c * 16), (__m256i)_mm512_cvtneps_pbh(acc[g][c]));
}

/* q: [n, heads, dim] with row stride q_row (elements); out: [n, heads, dim] contiguous;
 * k_cache, v_cache: [slots, kv_heads, dim]; tables: [n, max_blocks]; lens: [n] (tokens incl. the
 * new one); scratch: `threads` x heads/kv_heads x max(lens) floats. */
int ps_decode_attention_bf16(const uint16_t *q, long q_row, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *tables, long max_blocks, const int64_t *lens, uint16_t *out, long n,
                             long heads, long kv_heads, long dim, long block_size, float scale, float *scratch,
                             long scratch_per_thread, int threads) {
    if (dim % 16 || dim > MAX_DIM || heads % kv_heads || heads / kv_heads > MAX_GROUP) return -1;
    const long group = heads / kv_heads;
    for (long i = 0; i < n; i++)
        if (lens[i] < 1 || group * lens[i] > scratch_per_thread || (lens[i] - 1) / block_size >= max_blocks) return -2;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(dynamic, 1)
    for (long task = 0; task < n * kv_heads; task++) {
        long i = task / kv_heads, h = task % kv_heads;
        float *scores = scratch + omp_get_thread_num() * scratch_per_thread;
        one_head(q + i * q_row + h * group * dim, dim, k_cache, v_cache, tables + i * max_blocks, lens[i],
                 out + (i * heads + h * group) * dim, group, kv_heads, h, dim, block_size, scale, scores);
    }
    return 0;
}
