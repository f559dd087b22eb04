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

#include "attention_args.h"

/* One (sequence, KV head): G query heads of C*16 dims each. Inlined with G and C known at compile
 * time for the common shapes, so the query, key and accumulator vectors stay in registers. Keys
 * are walked block by block (no division per key). */
/* Blocks are scattered over the cache, so every new block starts on pages the hardware prefetcher
 * has not seen (it stops at page boundaries): ask for the next block's rows while this one is read.
 */
static inline void prefetch_block(const uint16_t *base, long rows, long row, long bytes) {
    for (long j = 0; j < rows; j++)
        for (long o = 0; o < bytes; o += 64) _mm_prefetch((const char *)(base + j * row) + o, _MM_HINT_T0);
}

/* The four horizontal sums of a, b, c, d as one vector. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    __m256 ab = _mm256_hadd_ps(a8, b8), cd = _mm256_hadd_ps(c8, d8);
    __m256 abcd = _mm256_hadd_ps(ab, cd); /* per 128-bit half: a, b, c, d partial sums */
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

static inline __attribute__((always_inline)) void head_impl(const uint16_t *q, long q_head_stride,
                                                            const uint16_t *k_cache, const uint16_t *v_cache,
                                                            const int64_t *table, long ctx, uint16_t *out,
                                                            long kv_heads, long kv_head, long block_size, float scale,
                                                            float *scores, const int G, const int C) {
    const long row = kv_heads * C * 16; /* elements per cache slot */
    const long dim = C * 16;
    /* q as bf16 pairs: one vdpbf16ps per 32 dims against the raw cache row (no conversion);
       the 1/sqrt(dim) scale is applied to the sums. C is even for every shape dispatched. */
    __m512bh qv[G][C / 2 ? C / 2 : 1];
    if (C % 2 == 0)
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C / 2; c++)
                qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * q_head_stride + c * 32);
    const __m128 vscale = _mm_set1_ps(scale);
    for (long t0 = 0, b = 0; t0 < ctx; t0 += block_size, b++) {
        const long n = ctx - t0 < block_size ? ctx - t0 : block_size;
        const uint16_t *kb = k_cache + table[b] * block_size * row + kv_head * dim;
        if (t0 + block_size < ctx)
            prefetch_block(k_cache + table[b + 1] * block_size * row + kv_head * dim, block_size, row, dim * 2);
        long j = 0;
        if (C % 2 == 0) {
            for (; j + 4 <= n; j += 4) { /* four keys at a time: one combined horizontal sum */
                __m512bh k4[4][C / 2 ? C / 2 : 1];
                for (int u = 0; u < 4; u++)
                    for (int c = 0; c < C / 2; c++)
                        k4[u][c] = (__m512bh)_mm512_loadu_si512(kb + (j + u) * row + c * 32);
                for (int g = 0; g < G; g++) {
                    __m512 a[4];
                    for (int u = 0; u < 4; u++) {
                        a[u] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k4[u][0]);
                        for (int c = 1; c < C / 2; c++) a[u] = _mm512_dpbf16_ps(a[u], qv[g][c], k4[u][c]);
                    }
                    _mm_storeu_ps(scores + g * ctx + t0 + j, _mm_mul_ps(sum4(a[0], a[1], a[2], a[3]), vscale));
                }
            }
        }
        for (; j < n; j++) {
            const uint16_t *k = kb + j * row;
            __m512 kv[C];
            for (int c = 0; c < C; c++) kv[c] = bf16_to_f32(_mm256_loadu_si256((const __m256i *)(k + c * 16)));
            for (int g = 0; g < G; g++) {
                __m512 acc = _mm512_mul_ps(bf16_to_f32(_mm256_loadu_si256((const __m256i *)(q + g * q_head_stride))), kv[0]);
                for (int c = 1; c < C; c++)
                    acc = _mm512_fmadd_ps(bf16_to_f32(_mm256_loadu_si256((const __m256i *)(q + g * q_head_stride + c * 16))),
                                          kv[c], acc);
                scores[g * ctx + t0 + j] = _mm512_reduce_add_ps(acc) * scale;
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float *s = scores + g * ctx;
        __m512 vmx = _mm512_set1_ps(-INFINITY);
        long t = 0;
        for (; t + 16 <= ctx; t += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + t));
        float mx = _mm512_reduce_max_ps(vmx);
        for (; t < ctx; t++) mx = s[t] > mx ? s[t] : mx;
        vmx = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        for (t = 0; t + 16 <= ctx; t += 16) {
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
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
        for (t = 0; t + 16 <= ctx; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
        for (; t < ctx; t++) s[t] *= _mm512_cvtss_f32(inv);
    }
    __m512 acc[G][C];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) acc[g][c] = _mm512_setzero_ps();
    for (long t0 = 0, b = 0; t0 < ctx; t0 += block_size, b++) {
        const long n = ctx - t0 < block_size ? ctx - t0 : block_size;
        const uint16_t *vb = v_cache + table[b] * block_size * row + kv_head * dim;
        if (t0 + block_size < ctx)
            prefetch_block(v_cache + table[b + 1] * block_size * row + kv_head * dim, block_size, row, dim * 2);
        for (long j = 0; j < n; j++) {
            const uint16_t *v = vb + j * row;
            for (int c = 0; c < C; c++) {
                __m512 vv = bf16_to_f32(_mm256_loadu_si256((const __m256i *)(v + c * 16)));
                for (int g = 0; g < G; g++)
                    acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * ctx + t0 + j]), vv, acc[g][c]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            _mm256_storeu_si256((__m256i *)(out + g * dim + c * 16), (__m256i)_mm512_cvtneps_pbh(acc[g][c]));
}

#define HEAD(G, C) head_impl(q, q_head_stride, k_cache, v_cache, table, ctx, out, kv_heads, kv_head, block_size, \
                             scale, scores, G, C)

static void generic_head(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table,
                         long ctx, uint16_t *out, long kv_heads, long kv_head, long dim, long block_size, float scale,
                         float *scores) {
    const long q_head_stride = dim;
    switch (dim / 16) {
    case 1: HEAD(1, 1); break;
    case 2: HEAD(1, 2); break;
    case 3: HEAD(1, 3); break;
    case 4: HEAD(1, 4); break;
    case 5: HEAD(1, 5); break;
    case 6: HEAD(1, 6); break;
    case 7: HEAD(1, 7); break;
    case 8: HEAD(1, 8); break;
    case 9: HEAD(1, 9); break;
    case 10: HEAD(1, 10); break;
    case 11: HEAD(1, 11); break;
    case 12: HEAD(1, 12); break;
    case 13: HEAD(1, 13); break;
    case 14: HEAD(1, 14); break;
    case 15: HEAD(1, 15); break;
    default: HEAD(1, 16); break;
    }
}

static void one_head(const uint16_t *q, long q_head_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                     const int64_t *table, long ctx, uint16_t *out, long group, long kv_heads, long kv_head,
                     long dim, long block_size, float scale, float *scores) {
    /* common shapes get a copy with everything in registers; others go one query head at a time */
    if (dim == 64) {
        switch (group) {
        case 1: HEAD(1, 4); return;
        case 2: HEAD(2, 4); return;
        case 3: HEAD(3, 4); return;
        case 4: HEAD(4, 4); return;
        case 8: HEAD(8, 4); return;
        }
    } else if (dim == 128) {
        switch (group) {
        case 1: HEAD(1, 8); return;
        case 2: HEAD(2, 8); return;
        case 4: HEAD(4, 8); return;
        case 8: HEAD(8, 8); return;
        }
    }
    for (long g = 0; g < group; g++)
        generic_head(q + g * q_head_stride, k_cache, v_cache, table, ctx, out + g * dim, kv_heads, kv_head, dim,
                     block_size, scale, scores);
}

/* The checks of a decode attention call (0, or the code it returns), for a caller that shares its
   tasks out (decode_helpers.c's ps_decode_attention_bf16_shared, from decode_step_bf16.c). */
int ps_attention_args_bf16(const int64_t *lens, long n, long heads, long kv_heads, long dim, long block_size,
                           long max_blocks, long scratch_per_thread) {
    return ps_attention_args(lens, n, heads, kv_heads, dim, 16, block_size, max_blocks, scratch_per_thread);
}

/* Tasks [t0, t1) of a decode attention call (task = sequence * kv_heads + KV head), arguments
   checked: what the decode helpers share out, each task computed as the call computes it. */
void ps_attention_tasks_bf16(const uint16_t *q, long q_row, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *tables, long max_blocks, const int64_t *lens, uint16_t *out, long heads,
                             long kv_heads, long dim, long block_size, float scale, float *scores, long t0, long t1) {
    const long group = heads / kv_heads;
    for (long task = t0; task < t1; task++) {
        const long i = task / kv_heads, h = task % kv_heads;
        one_head(q + i * q_row + h * group * dim, dim, k_cache, v_cache, tables + i * max_blocks, lens[i],
                 out + (i * heads + h * group) * dim, group, kv_heads, h, dim, block_size, scale, scores);
    }
}

/* q: [n, heads, dim] with row stride q_row (elements); out: [n, heads, dim] contiguous;
 * k_cache, v_cache: [slots, kv_heads, dim]; tables: [n, max_blocks]; lens: [n] (tokens incl. the
 * new one); scratch: `threads` x heads/kv_heads x max(lens) floats. */
int ps_decode_attention_bf16(const uint16_t *q, long q_row, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *tables, long max_blocks, const int64_t *lens, uint16_t *out, long n,
                             long heads, long kv_heads, long dim, long block_size, float scale, float *scratch,
                             long scratch_per_thread, int threads) {
    const int bad = ps_attention_args_bf16(lens, n, heads, kv_heads, dim, block_size, max_blocks, scratch_per_thread);
    if (bad) return bad;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(dynamic, 1)
    for (long task = 0; task < n * kv_heads; task++)
        ps_attention_tasks_bf16(q, q_row, k_cache, v_cache, tables, max_blocks, lens, out, heads, kv_heads, dim,
                                block_size, scale, scratch + omp_get_thread_num() * scratch_per_thread, task,
                                task + 1);
    return 0;
}
